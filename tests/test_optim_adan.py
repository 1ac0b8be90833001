"""Adan against an independent float64 NumPy transcription of Xie et al. (arXiv:2208.06677), Alg. 1."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax.optim.adan import adan, scale_by_adan
from helpers import flat as _flat
from helpers import orbax_round_trip
from helpers import run_tx as _run

B1, B2, B3, EPS = 0.98, 0.92, 0.99, 1e-8
SHAPES = {"mat": (6, 4), "vec": (5,), "stack": (2, 3, 5), "norm": {"scale": (5,)}}
N_STEPS = 5


def _tree(rng, shapes, scale=1.0):
    if isinstance(shapes, dict):
        return {k: _tree(rng, v, scale) for k, v in shapes.items()}
    return (scale * rng.standard_normal(shapes)).astype(np.float32)


def _lr(k):
    """lr of the k-th update (k = 0, 1, ...): a warmup ramp, written out by hand."""
    return 0.01 + 0.02 * min(k, 3) / 3


LR_SCHEDULE = optax.linear_schedule(0.01, 0.03, 3)


def np_adan(params, grads, wd, mode, diff_weight="paper", lr=_lr):
    """Algorithm 1 in the paper's small betas (β = 1 - b), bias-corrected as in the official code.

    ``diff_weight='paper'`` weights the gradient difference in n and v in u by (1 - β2);
    ``'optax'`` uses β2 instead (what optax 0.2.8 does). Returns per-step updates and directions.
    Leaves named 'scale' get no weight decay (the default mask).
    """
    be1, be2, be3 = 1 - B1, 1 - B2, 1 - B3
    w = (1 - be2) if diff_weight == "paper" else be2
    theta = _flat(params)
    m = {k: np.zeros_like(x) for k, x in theta.items()}
    v = {k: np.zeros_like(x) for k, x in theta.items()}
    n = {k: np.zeros_like(x) for k, x in theta.items()}
    prev = None
    deltas, dirs = [], []
    for k, g_tree in enumerate(grads):
        g = _flat(g_tree)
        step, direction = {}, {}
        eta = lr(k)
        for key in theta:
            d = np.zeros_like(g[key]) if prev is None else g[key] - prev[key]
            m[key] = (1 - be1) * m[key] + be1 * g[key]
            v[key] = (1 - be2) * v[key] + be2 * d
            n[key] = (1 - be3) * n[key] + be3 * (g[key] + w * d) ** 2
            t = k + 1
            mh, vh, nh = m[key] / (1 - B1**t), v[key] / (1 - B2**t), n[key] / (1 - B3**t)
            u = (mh + w * vh) / (np.sqrt(nh) + EPS)
            lam = 0.0 if key[-1] == "scale" else wd
            if mode == "proximal":
                new = (theta[key] - eta * u) / (1 + eta * lam)
            else:
                new = theta[key] - eta * (u + lam * theta[key])
            step[key], direction[key] = new - theta[key], u
            theta[key] = new
        prev = g
        deltas.append(step)
        dirs.append(direction)
    return deltas, dirs


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    params = _tree(rng, SHAPES)
    grads = [_tree(rng, SHAPES) for _ in range(N_STEPS)]
    return params, grads


def _assert_steps(got, want, rtol=1e-5, atol=1e-8):
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=f"step {k} {key}")


@pytest.mark.parametrize("mode", ["proximal", "decoupled"])
def test_matches_numpy_algorithm1(problem, mode):
    params, grads = problem
    wd = 0.5  # large, so that a wrong decay form or a wrong lr in the decay shows up
    got, _, _ = _run(adan(LR_SCHEDULE, weight_decay=wd, weight_decay_mode=mode), params, grads)
    want, _ = np_adan(params, grads, wd, mode)
    _assert_steps(got, want)


def test_proximal_and_decoupled_differ(problem):
    params, grads = problem
    a, _ = np_adan(params, grads, 0.5, "proximal")
    b, _ = np_adan(params, grads, 0.5, "decoupled")
    assert not np.allclose(a[0][("mat",)], b[0][("mat",)], rtol=1e-4)
    np.testing.assert_allclose(a[0][("norm", "scale")], b[0][("norm", "scale")])  # no decay there


def test_optax_scale_by_adan_uses_the_swapped_weight(problem):
    """optax weights the gradient difference by 1-b2 (paper β2) in n and in u; the paper uses b2."""
    params, grads = problem
    ours, _, _ = _run(scale_by_adan(B1, B2, B3, EPS), params, grads)
    theirs, _, _ = _run(optax.scale_by_adan(B1, B2, B3, EPS, eps_root=0.0), params, grads)
    _, paper_dirs = np_adan(params, grads, 0.0, "decoupled", "paper")
    _, optax_dirs = np_adan(params, grads, 0.0, "decoupled", "optax")
    # Directions are O(1) and m̂ + w v̂ cancels in places: float32 absolute error ~1e-7 there.
    _assert_steps(ours, paper_dirs, atol=2e-6)
    _assert_steps(theirs, optax_dirs, atol=2e-6)
    # Identical first step (no gradient difference yet), different from the second on.
    _assert_steps(ours[:1], theirs[:1])
    for k in range(1, N_STEPS):
        for key in ours[k]:
            assert not np.allclose(ours[k][key], theirs[k][key], rtol=1e-3), (k, key)


def test_first_step_has_no_gradient_difference(problem):
    params, grads = problem
    tx = scale_by_adan()
    u, state = tx.update(grads[0], tx.init(params))
    # m̂ = g, v̂ = 0, n̂ = g² after bias correction: the first direction is g / (|g| + eps).
    g = _flat(grads[0])
    for key, x in _flat(u).items():
        np.testing.assert_allclose(x, g[key] / (np.abs(g[key]) + EPS), rtol=1e-6)
    for key, x in _flat(state.v).items():
        np.testing.assert_array_equal(x, 0.0, err_msg=str(key))
    for key, x in _flat(state.prev_grad).items():
        np.testing.assert_array_equal(x, g[key], err_msg=str(key))


def test_jit(problem):
    params, grads = problem
    tx = adan(LR_SCHEDULE, weight_decay=0.5)
    eager, s_eager, p_eager = _run(tx, params, grads)
    jitted, s_jit, p_jit = _run(tx, params, grads, jit=True)
    _assert_steps(jitted, eager, rtol=1e-6)
    assert jax.tree.structure(s_eager) == jax.tree.structure(s_jit)
    assert int(s_jit[0].count) == N_STEPS


def test_orbax_round_trip(problem, tmp_path):
    params, grads = problem
    tx = adan(LR_SCHEDULE, weight_decay=0.5)
    _, state, p = _run(tx, params, grads[:3])
    restored = orbax_round_trip(state, tmp_path / "opt")
    u_ref, _ = tx.update(grads[3], state, p)
    u_rt, _ = tx.update(grads[3], restored, p)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), u_ref, u_rt)


def test_unknown_mode_names_the_config_field():
    with pytest.raises(ValueError, match="config.optimizer.adan.weight_decay_mode"):
        adan(1e-3, weight_decay_mode="l2")


def test_proximal_needs_params(problem):
    params, grads = problem
    tx = adan(1e-3)
    with pytest.raises(ValueError, match="params"):
        tx.update(grads[0], tx.init(params))


def test_on_model_params():
    from asyncpp_jax.configs import base_config
    from asyncpp_jax.models import dense

    cfg = base_config().model
    cfg.update(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    # The model's parameter tree (names, shapes, dtypes) without running the slow eager init.
    shapes = jax.eval_shape(lambda key: dense.init_params(cfg, key), jax.random.key(0))
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
    grads = jax.tree.map(lambda x: jnp.ones_like(x), params)
    tx = adan(0.1, weight_decay=0.5)
    u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    # Step 1 direction is sign(g) = 1; decay only on non-'scale' leaves: Δ = (-lr - lr λ θ) / (1 + lr λ).
    lam = 0.1 * 0.5
    np.testing.assert_allclose(u["final_norm"]["scale"], -0.1 * np.ones(32), rtol=1e-5)
    emb = np.asarray(params["embed"]["embedding"])
    np.testing.assert_allclose(u["embed"]["embedding"], (-0.1 - lam * emb) / (1 + lam), rtol=1e-5)
