"""Muon against an independent float64 NumPy transcription of the published update equations.

Reference: Jordan et al. 2024 (kellerjordan.github.io/posts/muon), Liu et al. 2025 (arXiv:2502.16982):
``B <- mu B + g``, ``D = g + mu B`` (Nesterov) or ``B``, ``O = NS_5(D / (||D||_F + eps))`` with the
quintic coefficients (3.4445, -4.7750, 2.0315), ``W <- W - lr (s O + wd W)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax.configs import base_config
from asyncpp_jax.models import dense
from asyncpp_jax.optim.adamw import AdamWBranch, decay_mask
from asyncpp_jax.optim.muon import MuonState, muon, orthogonalize, scale_by_muon
from helpers import assert_trees_equal, orbax_round_trip

COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = {"a": (8, 16), "b": (16, 8), "c": (2, 8, 12), "v": (5,)}


# ----------------------------------------------------------------------------- NumPy reference


def np_newton_schulz(x, steps=5, coeffs=COEFFS, eps=1e-7):
    """One matrix, always with the Gram matrix X X^T (no transpose trick), in float64."""
    a, b, c = coeffs
    x = x / (np.linalg.norm(x) + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def np_scale(m, n, scaling):
    # fan_in = m (rows of a flax [in, out] kernel), fan_out = n.
    return np.sqrt(max(1.0, n / m)) if scaling == "keller" else 0.2 * np.sqrt(max(m, n))


def np_direction_to_update(d, scaling):
    mats = d.reshape((1, 1, -1)) if d.ndim < 2 else d.reshape((-1,) + d.shape[-2:])
    out = np.stack([np_newton_schulz(mat) for mat in mats]).reshape(d.shape)
    return np_scale(*mats.shape[-2:], scaling) * out


class NpMuon:
    def __init__(self, shapes, mu=0.95, nesterov=True, scaling="moonlight"):
        self.mu, self.nesterov, self.scaling = mu, nesterov, scaling
        self.buf = {k: np.zeros(s) for k, s in shapes.items()}

    def updates(self, grads):
        out = {}
        for k, g in grads.items():
            self.buf[k] = self.mu * self.buf[k] + g
            d = g + self.mu * self.buf[k] if self.nesterov else self.buf[k]
            out[k] = np_direction_to_update(d, self.scaling)
        return out


def random_tree(rng, shapes, scale=1.0):
    return {k: scale * rng.standard_normal(s) for k, s in shapes.items()}


def to_jax(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def assert_tree_close(actual, expected, rtol=1e-5, atol=1e-6):
    for k in expected:
        np.testing.assert_allclose(np.asarray(actual[k]), expected[k], rtol=rtol, atol=atol, err_msg=k)


def small_model_params():
    """This project's parameter tree (names, stacked shapes); random values, without running flax init."""
    cfg = base_config().model
    cfg.update(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    rng = np.random.default_rng(8)
    return jax.tree.map(lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype),
                        dense.abstract_params(cfg))


def with_conditioning(rng, m, n, cond):
    u, _ = np.linalg.qr(rng.standard_normal((m, m)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    k = min(m, n)
    return (u[:, :k] * np.geomspace(1.0, 1.0 / cond, k)) @ v[:, :k].T


# ----------------------------------------------------------------------------- update equations


@pytest.mark.parametrize("scaling", ["moonlight", "keller"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_scale_by_muon_matches_numpy(scaling, nesterov):
    rng = np.random.default_rng(0)
    tx = scale_by_muon(mu=0.9, nesterov=nesterov, scaling=scaling)
    ref = NpMuon(SHAPES, mu=0.9, nesterov=nesterov, scaling=scaling)
    state = tx.init(to_jax(random_tree(rng, SHAPES)))
    for _ in range(4):
        grads = random_tree(rng, SHAPES)
        updates, state = tx.update(to_jax(grads), state)
        assert_tree_close(updates, ref.updates(grads))
    assert int(state.count) == 4


@pytest.mark.parametrize("scaling", ["moonlight", "keller"])
def test_muon_with_schedule_and_weight_decay_matches_numpy(scaling):
    rng = np.random.default_rng(1)
    shapes = {k: s for k, s in SHAPES.items() if len(s) >= 2}  # routing sends vectors to AdamW
    schedule = optax.linear_schedule(0.02, 0.005, 4)
    wd = 0.1
    tx = muon(schedule, mu=0.95, scaling=scaling, weight_decay=wd)
    ref = NpMuon(shapes, mu=0.95, scaling=scaling)
    w_np = random_tree(rng, shapes)
    w = to_jax(w_np)
    state = tx.init(w)
    for t in range(4):
        grads = random_tree(rng, shapes)
        updates, state = tx.update(to_jax(grads), state, w)
        w = optax.apply_updates(w, updates)
        lr = 0.02 + (0.005 - 0.02) * t / 4
        w_np = {k: w_np[k] - lr * (u + wd * w_np[k]) for k, u in ref.updates(grads).items()}
        assert_tree_close(w, w_np)


def test_muon_default_scaling_is_moonlight():
    rng = np.random.default_rng(2)
    w = to_jax({"w": rng.standard_normal((8, 32))})
    g = to_jax({"w": rng.standard_normal((8, 32))})
    u_default, _ = muon(1.0, weight_decay=0.0).update(g, muon(1.0).init(w), w)
    u_moon, _ = muon(1.0, scaling="moonlight", weight_decay=0.0).update(g, muon(1.0).init(w), w)
    np.testing.assert_array_equal(u_default["w"], u_moon["w"])
    # Nesterov first step: D = g + mu * g, and NS normalizes the 1.95 away.
    expected = -np_direction_to_update(1.95 * np.asarray(g["w"], np.float64), "moonlight")
    np.testing.assert_allclose(u_default["w"], expected, rtol=1e-5, atol=1e-6)


def test_unknown_scaling_names_the_config_field():
    with pytest.raises(ValueError, match=r"config\.optimizer\.muon\.scaling"):
        scale_by_muon(scaling="adam")
    with pytest.raises(ValueError, match=r"config\.optimizer\.muon\.scaling"):
        muon(0.1, scaling="spectral")


# ----------------------------------------------------------------------------- Newton-Schulz


@pytest.mark.parametrize("shape", [(8, 16), (16, 8), (2, 8, 12)])
def test_orthogonalize_matches_numpy(shape):
    x = np.random.default_rng(3).standard_normal(shape)
    expected = np.stack([np_newton_schulz(m) for m in x.reshape((-1,) + shape[-2:])]).reshape(shape)
    np.testing.assert_allclose(orthogonalize(jnp.asarray(x, jnp.float32)), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32)])
@pytest.mark.parametrize("cond", [None, 100.0])
def test_singular_values_in_published_band_not_polar_factor(shape, cond):
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape) if cond is None else with_conditioning(rng, *shape, cond)
    o = np.asarray(orthogonalize(jnp.asarray(x, jnp.float32)), np.float64)
    sv = np.linalg.svd(o, compute_uv=False)
    # Jordan et al. 2024: these coefficients leave the singular values roughly in U(0.68, 1.13).
    assert sv.min() > 0.6 and sv.max() < 1.2, (sv.min(), sv.max())
    # ... and not at 1: an exact polar factor U V^T (or a fully converged iteration) would fail here.
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    assert np.abs(sv - 1.0).max() > 0.1
    assert np.linalg.norm(o - u @ vt) > 0.1 * np.linalg.norm(u @ vt)
    # The singular vectors are the input's: O = U f(S) V^T.
    np.testing.assert_allclose(u @ np.diag(np.diag(u.T @ o @ vt.T)) @ vt, o, atol=1e-4)
    if cond is not None:
        # The classical quintic Newton-Schulz coefficients converge far slower on small singular
        # values: this test tells the two coefficient sets apart.
        slow = np.asarray(orthogonalize(jnp.asarray(x, jnp.float32), coeffs=(15 / 8, -10 / 8, 3 / 8)))
        assert np.linalg.svd(slow, compute_uv=False).min() < 0.6


def test_transposed_path_equals_orthogonalizing_the_transpose_and_uses_small_gram():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((16, 8)), jnp.float32)
    np.testing.assert_allclose(orthogonalize(x), orthogonalize(x.T).T, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(orthogonalize(x), np_newton_schulz(np.asarray(x, np.float64)),
                               rtol=1e-5, atol=1e-6)
    jaxpr = jax.make_jaxpr(orthogonalize)(x).jaxpr
    dot_shapes = [eqn.outvars[0].aval.shape for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"]
    assert dot_shapes and (8, 8) in dot_shapes and (16, 16) not in dot_shapes, dot_shapes


def test_stacked_leaves_are_orthogonalized_per_layer():
    rng = np.random.default_rng(6)
    # Very different per-layer magnitudes: a norm taken over the whole stack would leave the small
    # layer's singular values near zero after NS, so this tells per-matrix from per-leaf normalization.
    x = np.stack([rng.standard_normal((8, 12)), 1e-3 * rng.standard_normal((8, 12))])
    xj = jnp.asarray(x, jnp.float32)
    stacked = orthogonalize(xj)
    for i in range(2):
        np.testing.assert_allclose(stacked[i], orthogonalize(xj[i]), rtol=1e-6, atol=1e-7)
    # The same through scale_by_muon: a [2, m, n] leaf behaves as two [m, n] leaves.
    tx = scale_by_muon()
    u_stacked, _ = tx.update({"w": xj}, tx.init({"w": xj}))
    u_split, _ = tx.update({"w0": xj[0], "w1": xj[1]}, tx.init({"w0": xj[0], "w1": xj[1]}))
    np.testing.assert_allclose(u_stacked["w"][0], u_split["w0"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(u_stacked["w"][1], u_split["w1"], rtol=1e-6, atol=1e-7)
    assert np.linalg.svd(np.asarray(stacked[1]), compute_uv=False).min() > 0.6


# ----------------------------------------------------------------------------- on the model


def run_steps(tx, params, n, seed=7, jit=True):
    rng = np.random.default_rng(seed)
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    updates_seen = []
    for _ in range(n):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        updates_seen.append(updates)
    return params, state, updates_seen


@pytest.fixture(scope="module")
def model_params():
    return small_model_params()


def test_model_params_route_embeddings_and_norms_to_adamw_kernels_to_muon(model_params):
    params = model_params
    side = AdamWBranch(learning_rate=1e-3, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.05)
    _, _, got = run_steps(muon(3e-3, weight_decay=0.1, side=side), params, 3)
    _, _, want_adamw = run_steps(
        optax.adamw(1e-3, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.05, mask=decay_mask), params, 3)
    want_muon_tx = optax.chain(scale_by_muon(), optax.add_decayed_weights(0.1),
                               optax.scale_by_learning_rate(3e-3))
    _, _, want_muon = run_steps(want_muon_tx, params, 3)
    adamw_names, muon_names = set(), set()
    for step in range(3):
        for (path, u), a, m in zip(jax.tree_util.tree_leaves_with_path(got[step]),
                                   jax.tree.leaves(want_adamw[step]), jax.tree.leaves(want_muon[step])):
            name = jax.tree_util.keystr(path)
            if "kernel" in name:
                muon_names.add(name)
                np.testing.assert_allclose(u, m, rtol=1e-5, atol=1e-8, err_msg=name)
            else:
                adamw_names.add(name)
                np.testing.assert_allclose(u, a, rtol=1e-5, atol=1e-8, err_msg=name)
    assert any("embedding" in n for n in adamw_names) and any("final_norm" in n for n in adamw_names)
    assert len(muon_names) == 7  # q, k, v, o, gate, up, down


def test_muon_under_jit_equals_eager(model_params):
    params = model_params
    tx = muon(optax.cosine_decay_schedule(1e-2, 10), scaling="keller")
    p_eager, s_eager, _ = run_steps(tx, params, 3, jit=False)
    p_jit, s_jit, _ = run_steps(tx, params, 3)
    for a, b in zip(jax.tree.leaves((p_eager, s_eager)), jax.tree.leaves((p_jit, s_jit))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_state_round_trip_through_orbax(tmp_path, model_params):
    params = model_params
    tx = muon(1e-2)
    params, state, _ = run_steps(tx, params, 2)
    muon_states = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, MuonState))
                   if isinstance(s, MuonState)]
    assert len(muon_states) == 1 and int(muon_states[0].count) == 2
    restored = orbax_round_trip(state, tmp_path / "opt")
    assert_trees_equal(state, restored)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3) + 0.01 * p, params)
    want, _ = tx.update(grads, state, params)
    got, _ = tx.update(grads, restored, params)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)
