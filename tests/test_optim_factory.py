"""AdamW and Lion against NumPy references of their papers; routing; the config factory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax import configs
from asyncpp_jax.models import dense
from asyncpp_jax.optim import adamw, build_main, build_optimizer, describe_routing, label_params, lion
from helpers import assert_trees_equal, orbax_round_trip

SHAPES = [(6, 8), (5,), (2, 4, 3)]


def _grads(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s) for s in SHAPES] for _ in range(steps)]


def _params(seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in SHAPES]


def _run(tx, steps=4):
    params = [jnp.asarray(p, jnp.float32) for p in _params()]
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in _grads(steps):
        u, state = update([jnp.asarray(x, jnp.float32) for x in g], state, params)
        params = optax.apply_updates(params, u)
    return [np.asarray(p) for p in params]


def test_adamw_matches_loshchilov_hutter():
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    w = _params()
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    for t, g in enumerate(_grads(4), start=1):
        for i in range(len(w)):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            mh, vh = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            w[i] = w[i] - lr * (mh / (np.sqrt(vh) + eps) + wd * w[i])
    got = _run(adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, mask=None))
    for a, b in zip(got, w):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lion_matches_chen_et_al():
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    w = _params()
    m = [np.zeros_like(x) for x in w]
    for g in _grads(4):
        for i in range(len(w)):
            c = b1 * m[i] + (1 - b1) * g[i]
            w[i] = w[i] - lr * (np.sign(c) + wd * w[i])
            m[i] = b2 * m[i] + (1 - b2) * g[i]
    got = _run(lion(lr, b1=b1, b2=b2, weight_decay=wd, mask=None))
    for a, b in zip(got, w):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _model_params(tie=False):
    m = configs.base_config().model
    m.update(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, tie_embeddings=tie)
    return m, dense.init_params(m, jax.random.key(0))


def test_routing_of_model_params():
    _, params = _model_params(tie=False)
    labels = label_params(params)
    assert labels["embed"]["embedding"] == "adamw"
    assert labels["lm_head"]["kernel"] == "adamw"
    assert labels["final_norm"]["scale"] == "adamw"
    assert labels["layers"]["attn_norm"]["scale"] == "adamw"  # 2-D when stacked, still a norm
    for name in ("q", "k", "v", "o"):
        assert labels["layers"]["attn"][name]["kernel"] == "hidden"
    for name in ("gate", "up", "down"):
        assert labels["layers"]["mlp"][name]["kernel"] == "hidden"
    # The split is configurable: an empty pattern leaves only the 1-D leaves on AdamW.
    assert label_params(params, adamw_pattern="")["embed"]["embedding"] == "hidden"


def test_describe_routing_is_readable():
    cfg = configs.base_config()
    cfg.optimizer.name = "muon"
    _, params = _model_params()
    table = describe_routing(cfg.optimizer, params)
    line = next(x for x in table.splitlines() if x.startswith("layers/mlp/up/kernel"))
    assert line.split()[-1] == "muon" and "2x32x48" in line
    assert next(x for x in table.splitlines() if x.startswith("embed/embedding")).endswith("adamw (side)")
    cfg.optimizer.name = "adan"
    assert describe_routing(cfg.optimizer, params) == "all parameters -> adan"


@pytest.mark.parametrize("name", configs.OPTIMIZERS)
def test_every_optimizer_builds_from_config_and_steps_under_jit(name):
    cfg = configs.base_config()
    cfg.optimizer.name = name
    configs.validate(cfg)
    tx, schedule = build_optimizer(cfg.optimizer, total_steps=10)
    mcfg, params = _model_params()
    batch = jax.random.randint(jax.random.key(1), (2, 9), 0, mcfg.vocab_size)
    grad = jax.grad(lambda p: dense.loss_fn(mcfg, p, batch)[0])

    @jax.jit
    def step(params, state):
        u, state = tx.update(grad(params), state, params)
        return optax.apply_updates(params, u), state

    state = tx.init(params)
    new = params
    for _ in range(3):
        new, state = step(new, state)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(new))
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))]
    assert all(moved), f"{name} left some parameters untouched"


def test_side_branch_lr_ratio_scales_only_the_side():
    cfg = configs.base_config()
    cfg.optimizer.update(name="muon", warmup_steps=0, schedule="constant", weight_decay=0.0)
    _, params = _model_params()
    grads = jax.tree.map(lambda x: jnp.ones_like(x), params)

    def updates(ratio):
        cfg.optimizer.side.lr_ratio = ratio
        tx = build_main(cfg.optimizer, optax.constant_schedule(cfg.optimizer.lr))
        return tx.update(grads, tx.init(params), params)[0]

    u1, u2 = updates(1.0), updates(0.5)
    np.testing.assert_allclose(u2["embed"]["embedding"], 0.5 * u1["embed"]["embedding"], rtol=1e-6)
    np.testing.assert_allclose(u2["layers"]["mlp"]["up"]["kernel"], u1["layers"]["mlp"]["up"]["kernel"], rtol=1e-6)


def test_unknown_optimizer_is_a_clear_error():
    cfg = configs.base_config()
    cfg.optimizer.name = "sgd"
    with pytest.raises(ValueError, match="config.optimizer.name='sgd' is unknown"):
        build_main(cfg.optimizer, optax.constant_schedule(1e-3))


@pytest.mark.parametrize("name", configs.OPTIMIZERS)
def test_every_optimizer_state_round_trips_through_orbax(name, tmp_path):
    """The state after two updates, saved and restored with orbax, is equal bit for bit, and the next
    update from it equals the uninterrupted one bit for bit."""
    cfg = configs.base_config()
    cfg.optimizer.name = name
    tx, _ = build_optimizer(cfg.optimizer, total_steps=10)
    _, params = _model_params()
    rng = np.random.default_rng(3)
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params) for _ in range(3)]
    update = jax.jit(tx.update)
    state = tx.init(params)
    for g in grads[:2]:
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
    restored = orbax_round_trip(state, tmp_path / "opt")
    assert_trees_equal(state, restored)
    want, _ = update(grads[2], state, params)
    got, _ = update(grads[2], restored, params)
    assert_trees_equal(want, got)
