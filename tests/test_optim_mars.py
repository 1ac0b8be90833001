"""MARS-AdamW against an independent float64 NumPy transcription of Yuan et al. (arXiv:2411.10438)."""

import jax
import numpy as np
import optax
import pytest

from asyncpp_jax.optim.adamw import AdamWBranch
from asyncpp_jax.optim.mars import mars, scale_by_mars
from helpers import flat as _flat
from helpers import orbax_round_trip
from helpers import run_tx as _run

B1, B2, GAMMA, EPS = 0.95, 0.99, 0.025, 1e-8
N_STEPS = 5
# grad scale per leaf: 'big' always clips (norm >> 1), 'small' never does; the stacked leaf has one
# clipping and one non-clipping matrix, so a whole-tensor norm would give a different answer.
SHAPES = {"big": (6, 4), "small": (4, 3), "vec": (5,), "stack": (2, 3, 5)}
GRAD_SCALE = {"big": 1.0, "small": 0.02, "vec": 1.0, "stack": np.array([1.0, 0.02])[:, None, None]}


def _lr(k):
    """lr of the k-th update (k = 0, 1, ...): a warmup ramp, written out by hand."""
    return 0.01 + 0.02 * min(k, 3) / 3


LR_SCHEDULE = optax.linear_schedule(0.01, 0.03, 3)


def np_mars(theta, grads, lr, wd, b1=B1, b2=B2, gamma=GAMMA, eps=EPS, per_matrix=True):
    """MARS-AdamW (approximate): flat dicts of float64 arrays in, per-step updates and clip flags out.

    g_0 = 0 (the official code's zero-initialised last_grad). The clip norm is per matrix over the
    last two axes for >=2-D leaves (whole tensor when per_matrix=False) and whole-tensor for vectors.
    """
    theta = dict(theta)
    m = {k: np.zeros_like(x) for k, x in theta.items()}
    v = {k: np.zeros_like(x) for k, x in theta.items()}
    prev = {k: np.zeros_like(x) for k, x in theta.items()}
    deltas, clipped = [], []
    for k, g in enumerate(grads):
        t = k + 1
        step, flags = {}, {}
        for key in theta:
            c = g[key] + gamma * b1 / (1 - b1) * (g[key] - prev[key])
            if c.ndim >= 2 and per_matrix:
                mats = c.reshape(-1, *c.shape[-2:])
                norms = np.array([np.linalg.norm(x) for x in mats])
                c = np.stack([x / nrm if nrm > 1 else x for x, nrm in zip(mats, norms)]).reshape(c.shape)
            else:
                norms = np.array([np.linalg.norm(c)])
                c = c / norms[0] if norms[0] > 1 else c
            flags[key] = norms > 1
            m[key] = b1 * m[key] + (1 - b1) * c
            v[key] = b2 * v[key] + (1 - b2) * c**2
            u = (m[key] / (1 - b1**t)) / (np.sqrt(v[key] / (1 - b2**t)) + eps)
            new = theta[key] - lr(k) * (u + wd * theta[key])
            step[key] = new - theta[key]
            theta[key] = new
        prev = dict(g)
        deltas.append(step)
        clipped.append(flags)
    return deltas, clipped


def np_adamw(theta, grads, lr, wd, b1, b2, eps):
    theta = dict(theta)
    m = {k: np.zeros_like(x) for k, x in theta.items()}
    v = {k: np.zeros_like(x) for k, x in theta.items()}
    deltas = []
    for k, g in enumerate(grads):
        t = k + 1
        step = {}
        for key in theta:
            m[key] = b1 * m[key] + (1 - b1) * g[key]
            v[key] = b2 * v[key] + (1 - b2) * g[key] ** 2
            u = (m[key] / (1 - b1**t)) / (np.sqrt(v[key] / (1 - b2**t)) + eps)
            lam = 0.0 if key[-1] in ("scale", "bias") else wd
            new = theta[key] - lr(k) * (u + lam * theta[key])
            step[key] = new - theta[key]
            theta[key] = new
        deltas.append(step)
    return deltas


def _assert_steps(got, want, rtol=1e-5, atol=1e-8, keys=None):
    for k, (a, b) in enumerate(zip(got, want)):
        for key in keys or b:
            np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=f"step {k} {key}")


def _hidden_tx(lr, wd, **kw):
    """The hidden-matrix branch of mars(), applied to every leaf."""
    return optax.chain(scale_by_mars(**kw), optax.add_decayed_weights(wd), optax.scale_by_learning_rate(lr))


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [
        {k: (GRAD_SCALE[k] * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
        for _ in range(N_STEPS)
    ]
    return params, grads


def test_matches_numpy(problem):
    params, grads = problem
    wd = 0.3
    got, _, _ = _run(_hidden_tx(LR_SCHEDULE, wd), params, grads)
    want, clipped = np_mars(_flat(params), [_flat(g) for g in grads], _lr, wd)
    _assert_steps(got, want)
    for flags in clipped:
        assert flags[("big",)].all() and not flags[("small",)].any()
        np.testing.assert_array_equal(flags[("stack",)], [True, False])
    # A whole-tensor norm for the stacked leaf is a different update (from step 2 on: step 1 of Adam is
    # scale-free), so the comparison above really checks per-matrix clipping.
    whole, _ = np_mars(_flat(params), [_flat(g) for g in grads], _lr, wd, per_matrix=False)
    assert not np.allclose(whole[-1][("stack",)], want[-1][("stack",)], rtol=1e-2)


def test_first_step_uses_zero_previous_gradient(problem):
    params, grads = problem
    tx = scale_by_mars()
    u, state = tx.update(grads[0], tx.init(params))
    # Unclipped leaf: c_1 = (1 + γ b1/(1-b1)) g_1, and m̂/sqrt(v̂) = sign(c_1) whatever the scale.
    np.testing.assert_allclose(state.m["small"], (1 - B1) * (1 + GAMMA * B1 / (1 - B1)) * grads[0]["small"],
                               rtol=1e-6)
    np.testing.assert_allclose(u["small"], np.sign(grads[0]["small"]), rtol=1e-5)
    np.testing.assert_array_equal(state.prev_grad["big"], grads[0]["big"])


def test_gamma_zero_is_adam(problem):
    params, grads = problem
    small = [{"small": g["small"]} for g in grads]  # norm < 1: no clip, so MARS with γ=0 is Adam
    ours, _, _ = _run(scale_by_mars(gamma=0.0), {"small": params["small"]}, small)
    adam, _, _ = _run(optax.scale_by_adam(B1, B2, EPS), {"small": params["small"]}, small)
    _assert_steps(ours, adam, rtol=1e-6)
    with_gamma, _, _ = _run(scale_by_mars(), {"small": params["small"]}, small)
    assert not np.allclose(with_gamma[1][("small",)], adam[1][("small",)], rtol=1e-3)


@pytest.fixture(scope="module")
def model_params():
    from asyncpp_jax.configs import base_config
    from asyncpp_jax.models import dense

    cfg = base_config().model
    cfg.update(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    # The model's parameter tree (names, shapes, dtypes) without running the slow eager init.
    shapes = jax.eval_shape(lambda key: dense.init_params(cfg, key), jax.random.key(0))
    rng = np.random.default_rng(2)
    return jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)


def _model_grads(params, n, seed=1):
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(params)
    # Small enough that some kernels stay under the clip threshold, large enough that others clip.
    draw = lambda x: (0.02 * rng.standard_normal(x.shape)).astype(np.float32)
    return [jax.tree.unflatten(treedef, [draw(x) for x in leaves]) for _ in range(n)]


def test_routing_on_model_params(model_params):
    params, n = model_params, 3
    grads = _model_grads(params, n)
    adamw_lr = lambda k: 0.5 * _lr(k)
    tx = mars(
        LR_SCHEDULE, weight_decay=0.2,
        side=AdamWBranch(learning_rate=optax.linear_schedule(0.005, 0.015, 3), weight_decay=0.1),
    )
    got, _, _ = _run(tx, params, grads, jit=True)
    theta, gs = _flat(params), [_flat(g) for g in grads]
    side = [k for k in theta if "embed" in k or k[-1] == "scale"]
    hidden = [k for k in theta if k not in side]
    assert ("embed", "embedding") in side and ("final_norm", "scale") in side
    assert ("layers", "attn", "q", "kernel") in hidden and len(hidden) == 7
    pick = lambda tree, keys: {k: tree[k] for k in keys}
    want_h, clipped = np_mars(pick(theta, hidden), [pick(g, hidden) for g in gs], _lr, 0.2)
    want_s = np_adamw(pick(theta, side), [pick(g, side) for g in gs], adamw_lr, 0.1, 0.9, 0.95, 1e-8)
    _assert_steps(got, want_h, keys=hidden)
    _assert_steps(got, want_s, keys=side)
    flags = np.concatenate([f.ravel() for f in clipped[0].values()])
    assert flags.any() and not flags.all()


def test_jit(problem):
    params, grads = problem
    tx = _hidden_tx(LR_SCHEDULE, 0.3)
    eager, s_eager, _ = _run(tx, params, grads)
    jitted, s_jit, _ = _run(tx, params, grads, jit=True)
    _assert_steps(jitted, eager, rtol=1e-6)
    assert jax.tree.structure(s_eager) == jax.tree.structure(s_jit)


def test_orbax_round_trip(model_params, tmp_path):
    params = model_params
    grads = _model_grads(params, 3)
    tx = mars(LR_SCHEDULE, weight_decay=0.2, side=AdamWBranch(weight_decay=0.1))
    _, state, p = _run(tx, params, grads[:2], jit=True)
    restored = orbax_round_trip(state, tmp_path / "opt")
    update = jax.jit(tx.update)
    u_ref, _ = update(grads[2], state, p)
    u_rt, _ = update(grads[2], restored, p)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), u_ref, u_rt)
