"""Staleness transforms against hand-written loops and a float64 NumPy reference of the conventions.

The reference (``np_run``) re-derives every update from the full histories of weights and gradients
(no rings, no counters): delay ``d`` in force for ``K <= t < T - C``; update ``t`` uses ``g_{t-d}`` if
the delay was in force at ``t - d``, zero if it is a fill step, ``g_t`` when the delay is off;
DC-ASGD ``g + lam g g (w_t - w_{t-d})`` (Zheng et al. 2017, arXiv:1609.08326); error feedback
``u + s (u - u_prev)`` when both updates come from delayed non-fill gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax.configs import base_config
from asyncpp_jax.models import dense
from asyncpp_jax.optim.staleness import (
    DelaySchedule,
    delay,
    error_feedback,
    pipedream_leaf_delays,
    taylor_compensation,
)
from helpers import orbax_round_trip

# ------------------------------------------------------- a quadratic whose gradient depends on the params

SHAPES = {"w": (5,), "M": (2, 3, 4)}
_rng = np.random.default_rng(0)
CURV = {k: _rng.uniform(0.5, 2.0, s) for k, s in SHAPES.items()}
TARGET = {k: _rng.standard_normal(s) for k, s in SHAPES.items()}
W0 = {k: _rng.standard_normal(s) for k, s in SHAPES.items()}


def grad_np(w):
    return {k: CURV[k] * (w[k] - TARGET[k]) for k in w}


def grad_jnp(w):
    return {k: jnp.asarray(CURV[k], jnp.float32) * (w[k] - jnp.asarray(TARGET[k], jnp.float32)) for k in w}


def in_force(t, d, K=0, C=0, T=None):
    return d > 0 and t >= K and (C == 0 or t < T - C)


def np_run(n, d, K=0, C=0, T=None, lr=0.1, ef=0.0, lam=0.0, adaptive=False, lam0=2.0, decay=0.99,
           eps=1e-8):
    """float64 SGD under the documented conventions, from full histories: returns w_0..w_n."""
    on = lambda t: in_force(t, d, K, C, T)  # noqa: E731
    ws, gs, us = [W0], [], []
    v = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t in range(n):
        w = ws[-1]
        gs.append(grad_np(w))
        if not on(t):
            g, filling = gs[t], False
        elif on(t - d):
            g, filling = gs[t - d], False
        else:
            g, filling = {k: np.zeros(s) for k, s in SHAPES.items()}, True
        if adaptive and not filling:
            v = {k: decay * v[k] + (1 - decay) * g[k] ** 2 for k in v}
        if (lam or adaptive) and on(t) and on(t - d):
            coeff = {k: lam0 / np.sqrt(v[k] + eps) for k in v} if adaptive else {k: lam for k in v}
            g = {k: g[k] + coeff[k] * g[k] * g[k] * (w[k] - ws[t - d][k]) for k in g}
        u = {k: -lr * g[k] for k in g}
        out = u
        if ef and on(t) and on(t - 1 - d):
            out = {k: u[k] + ef * (u[k] - us[-1][k]) for k in u}
        us.append(u)
        ws.append({k: w[k] + out[k] for k in w})
    return ws


def run_chain(tx, n, w0=None):
    w = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), W0 if w0 is None else w0)
    state, update = tx.init(w), jax.jit(tx.update)
    hist = [w]
    for _ in range(n):
        u, state = update(grad_jnp(w), state, w)
        w = optax.apply_updates(w, u)
        hist.append(w)
    return hist, state


def assert_hist_close(got, want, rtol=2e-5, atol=2e-6):
    assert len(got) == len(want)
    for t, (a, b) in enumerate(zip(got, want)):
        for k in SHAPES:
            np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=f"w[{t}][{k}]")


# ------------------------------------------------------------------------------------------- model tree


def small_cfg(n_layers=2, tie=True):
    cfg = base_config().model
    cfg.update(vocab_size=61, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, d_ff=48,
               tie_embeddings=tie)
    return cfg


def random_like(abstract, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), abstract)


def abstract_model(n_layers=2, tie=True):
    cfg = small_cfg(n_layers, tie)
    return jax.eval_shape(lambda: dense.init_params(cfg, jax.random.key(0)))


# ------------------------------------------------------------------------------------------- identities


def test_delay_zero_is_adamw_bit_for_bit():
    params = random_like(abstract_model(), 1)
    txs = [optax.chain(delay(0), optax.adamw(1e-2)), optax.adamw(1e-2)]
    finals = []
    for tx in txs:
        p, state, update = params, tx.init(params), jax.jit(tx.update)
        for t in range(4):
            u, state = update(random_like(params, 10 + t), state, p)
            p = optax.apply_updates(p, u)
        finals.append(p)
    for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1])):
        np.testing.assert_array_equal(a, b)
    assert [x.shape for x in jax.tree.leaves(delay(0).init(params))] == [()]


def test_delay_one_sgd_is_the_2bw_rule():
    lr, n = 0.1, 15
    got, _ = run_chain(optax.chain(delay(1), optax.sgd(lr)), n)
    want = [W0]  # w[t+1] = w[t] - lr g(w[t-1]); update 0 is the fill step (a zero gradient).
    for t in range(n):
        g = grad_np(want[t - 1]) if t >= 1 else {k: np.zeros(s) for k, s in SHAPES.items()}
        want.append({k: want[t][k] - lr * g[k] for k in SHAPES})
    assert_hist_close(got, want)
    # The delay makes a difference: the synchronous run is far from it.
    sync, _ = run_chain(optax.sgd(lr), n)
    assert np.abs(np.asarray(sync[-1]["w"]) - want[-1]["w"]).max() > 1e-3


@pytest.mark.parametrize("d,K,C,T", [(1, 3, 3, 16), (2, 3, 4, 16), (3, 0, 2, 16)])
def test_delay_with_sync_start_and_cooldown_matches_reference(d, K, C, T):
    kw = dict(sync_start_steps=K, sync_cooldown_steps=C, total_steps=T)
    got, _ = run_chain(optax.chain(delay(d, **kw), optax.sgd(0.1)), T)
    assert_hist_close(got, np_run(T, d, K, C, T))


def test_error_feedback_telescoped_form():
    lr, n = 0.1, 20
    got, _ = run_chain(optax.chain(delay(1), optax.sgd(lr), error_feedback(1.0)), n)
    # x[1] = x[0] (fill); x[2] = x[1] - lr g(x[0]); then x[t+1] = x[t] - 2u[t-1] + u[t-2], u[s] = lr g(x[s]).
    x = [W0, W0]
    x.append({k: x[1][k] - lr * grad_np(x[0])[k] for k in SHAPES})
    for t in range(2, n):
        g1, g2 = grad_np(x[t - 1]), grad_np(x[t - 2])
        x.append({k: x[t][k] - 2 * lr * g1[k] + lr * g2[k] for k in SHAPES})
    assert_hist_close(got, x)
    plain, _ = run_chain(optax.chain(delay(1), optax.sgd(lr)), n)
    assert np.abs(np.asarray(plain[-1]["w"]) - x[-1]["w"]).max() > 1e-3


@pytest.mark.parametrize("d,K,C,T,s", [(1, 3, 3, 18, 1.0), (2, 2, 4, 18, 0.5)])
def test_error_feedback_across_transitions_matches_reference(d, K, C, T, s):
    kw = dict(steps=d, sync_start_steps=K, sync_cooldown_steps=C, total_steps=T)
    got, _ = run_chain(optax.chain(delay(**kw), optax.sgd(0.1), error_feedback(s, **kw)), T)
    assert_hist_close(got, np_run(T, d, K, C, T, ef=s))


def test_error_feedback_strength_zero_is_identity():
    tx = error_feedback(0.0)
    params = jax.tree.map(jnp.asarray, W0)
    assert [x.shape for x in jax.tree.leaves(tx.init(params))] == [()]
    u, _ = tx.update(params, tx.init(params))
    assert all(a is b for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(params)))


def test_taylor_lam_zero_equals_plain_delay():
    kw = dict(steps=2, sync_start_steps=2, sync_cooldown_steps=3, total_steps=14)
    got, _ = run_chain(optax.chain(delay(**kw), taylor_compensation(0.0, **kw), optax.sgd(0.1)), 14)
    want, _ = run_chain(optax.chain(delay(**kw), optax.sgd(0.1)), 14)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def feed(tx, gs, ws):
    """Feed arbitrary gradient/param sequences through a transform; return its outputs."""
    state, update, outs = tx.init(ws[0]), jax.jit(tx.update), []
    for g, w in zip(gs, ws):
        u, state = update(g, state, w)
        outs.append(np.asarray(u, np.float64))
    return outs


@pytest.mark.parametrize("d", [1, 2])
def test_taylor_formula_against_numpy(d):
    rng = np.random.default_rng(3)
    n, lam = 9, 0.7
    gs = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(n)]
    ws = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(n)]
    got = feed(taylor_compensation(lam, steps=d), gs, ws)
    for t in range(n):
        g, w = gs[t].astype(np.float64), ws[t].astype(np.float64)
        want = g if t < d else g + lam * g * g * (w - ws[t - d])  # before t = d: fill, no correction
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-6, err_msg=f"t={t}")


def test_taylor_adaptive_against_numpy():
    rng = np.random.default_rng(4)
    n, lam0, decay, eps, K, C, T = 12, 0.3, 0.9, 1e-8, 2, 2, 12
    gs = [rng.standard_normal((5,)).astype(np.float32) for _ in range(n)]
    ws = [rng.standard_normal((5,)).astype(np.float32) for _ in range(n)]
    tx = taylor_compensation(adaptive=True, lam0=lam0, ema_decay=decay, eps=eps, steps=1,
                             sync_start_steps=K, sync_cooldown_steps=C, total_steps=T)
    got = feed(tx, gs, ws)
    v = np.zeros(5)
    for t in range(n):
        g = gs[t].astype(np.float64)
        filling = in_force(t, 1, K, C, T) and not in_force(t - 1, 1, K, C, T)
        if not filling:
            v = decay * v + (1 - decay) * g * g
        want = g
        if in_force(t, 1, K, C, T) and not filling:
            want = g + lam0 / np.sqrt(v + eps) * g * g * (ws[t].astype(np.float64) - ws[t - 1])
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-6, err_msg=f"t={t}")


def test_full_chain_with_taylor_and_ef_matches_reference():
    kw = dict(steps=2, sync_start_steps=3, sync_cooldown_steps=3, total_steps=18)
    tx = optax.chain(delay(**kw), taylor_compensation(adaptive=True, lam0=0.5, ema_decay=0.9, **kw),
                     optax.sgd(0.1), error_feedback(1.0, **kw))
    got, _ = run_chain(tx, 18)
    assert_hist_close(got, np_run(18, 2, 3, 3, 18, ef=1.0, adaptive=True, lam0=0.5, decay=0.9))
    tx = optax.chain(delay(**kw), taylor_compensation(0.4, **kw), optax.sgd(0.1))
    got, _ = run_chain(tx, 18)
    assert_hist_close(got, np_run(18, 2, 3, 3, 18, lam=0.4))


def test_per_leaf_delays_in_the_full_chain_match_the_per_slice_reference():
    # SGD and all three transforms act elementwise, so each slice must follow the uniform-delay
    # reference run at that slice's own delay (d = 0: plain SGD, no EF or Taylor correction).
    K, C, T = 2, 3, 16
    delays = {"w": 1, "M": np.array([2, 0])}
    kw = dict(sync_start_steps=K, sync_cooldown_steps=C, total_steps=T, leaf_delays=delays)
    tx = optax.chain(delay(**kw), taylor_compensation(0.3, **kw), optax.sgd(0.1), error_feedback(0.8, **kw))
    got, _ = run_chain(tx, T)
    ref = {d: np_run(T, d, K, C, T, lam=0.3, ef=0.8) for d in (0, 1, 2)}
    want = [{"w": ref[1][t]["w"], "M": np.stack([ref[2][t]["M"][0], ref[0][t]["M"][1]])}
            for t in range(T + 1)]
    assert_hist_close(got, want)


# ------------------------------------------------------------------------------------------- transitions


def one_hot_run(tx, n, nan_ring=False):
    """g_t = e_t in every slice; returns the outputs [n, ...] per leaf."""
    params = {"x": jnp.zeros(n), "stack": jnp.zeros((3, n))}
    state, update, outs = tx.init(params), jax.jit(tx.update), []
    if nan_ring:
        state = state._replace(gradient_ring=jax.tree.map(lambda r: jnp.full_like(r, jnp.nan),
                                                          state.gradient_ring))
    for t in range(n):
        e = jnp.zeros(n).at[t].set(1.0)
        u, state = update({"x": e, "stack": jnp.tile(e, (3, 1))}, state, params)
        outs.append(jax.tree.map(np.asarray, u))
    return {k: np.stack([o[k] for o in outs]) for k in params}


@pytest.mark.parametrize("case", ["d1", "d2", "per_leaf"])
def test_each_gradient_applied_at_most_once(case):
    K, C, T = 3, 3, 12
    kw = dict(sync_start_steps=K, sync_cooldown_steps=C, total_steps=T)
    if case == "per_leaf":
        delays = {"x": 1, "stack": np.array([2, 1, 0])}
        tx = delay(leaf_delays=delays, **kw)
    else:
        d = int(case[1])
        delays = {"x": d, "stack": np.array([d, d, d])}
        tx = delay(d, **kw)
    outs = one_hot_run(tx, T)
    slices = [("x", outs["x"], delays["x"])] + [
        (f"stack[{i}]", outs["stack"][:, i], int(delays["stack"][i])) for i in range(3)]
    for name, out, d in slices:
        assert out.sum(axis=0).max() <= 1, f"{name}: a gradient was applied twice"
        assert ((out == 0) | (out == 1)).all() and (out.sum(axis=1) <= 1).all()
        applied = {int(i) for i in np.nonzero(out.sum(axis=0))[0]}
        dropped = set(range(T - C - d, T - C))
        assert applied == set(range(T)) - dropped, name
        for t in range(T):
            source = np.nonzero(out[t])[0]
            if in_force(t, d, K, C, T) and not in_force(t - d, d, K, C, T):
                assert source.size == 0, f"{name}: update {t} must be a fill step (zeros)"
            elif in_force(t, d, K, C, T):
                assert list(source) == [t - d], name
            else:
                assert list(source) == [t], name
    if case != "per_leaf":
        assert outs["x"][K:K + d].sum() == 0  # fill zeros right after the sync start
        sched = DelaySchedule(d, **kw)
        assert [int(sched.skipped_at(t)) for t in range(T + 1)] == [d if t == T - C else 0
                                                                    for t in range(T + 1)]
        assert [int(sched.delay_at(t)) for t in range(T)] == [d if K <= t < T - C else 0
                                                              for t in range(T)]
        assert [bool(sched.filling(t)) for t in range(T)] == [K <= t < K + d for t in range(T)]


def test_fill_never_reads_the_buffer():
    # Fill bubbles are NaN: a fill step that read its ring instead of emitting zeros would leak them.
    outs = one_hot_run(delay(2), 6, nan_ring=True)
    assert np.isfinite(outs["x"]).all() and np.isfinite(outs["stack"]).all()
    assert outs["x"][:2].sum() == 0 and outs["x"][2:].sum() == 4
    tx = taylor_compensation(0.5, steps=2)
    params = {"x": jnp.ones(4)}
    state = tx.init(params)
    state = state._replace(param_ring=jax.tree.map(lambda r: jnp.full_like(r, jnp.nan), state.param_ring))
    for _ in range(2):
        u, state = tx.update({"x": jnp.zeros(4)}, state, params)
        assert np.isfinite(u["x"]).all()


def test_schedule_validation_and_jit():
    with pytest.raises(ValueError, match="total_steps"):
        DelaySchedule(1, sync_cooldown_steps=5)
    with pytest.raises(ValueError, match="total_steps"):
        delay(1, sync_cooldown_steps=5)
    with pytest.raises(ValueError, match="steps"):
        DelaySchedule(-1)
    sched = DelaySchedule(2, 1, 2, 8)
    got = jax.jit(jax.vmap(lambda t: (sched.in_force(t), sched.delay_at(t), sched.skipped_at(t))))(
        jnp.arange(9))
    np.testing.assert_array_equal(got[0], [0, 1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(got[1], [0, 2, 2, 2, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(got[2], [0, 0, 0, 0, 0, 0, 2, 0, 0])
    assert not DelaySchedule(0).in_force(5)
    # always in force exactly when in_force holds at every update from 0 on
    for sched in (DelaySchedule(1), DelaySchedule(2, total_steps=8), DelaySchedule(0), DelaySchedule(1, 1),
                  DelaySchedule(1, 0, 2, 8)):
        assert sched.always_in_force == bool(np.all(np.asarray(sched.in_force(jnp.arange(12)))))


# -------------------------------------------------------------------------------- PipeDream per-stage


@pytest.mark.parametrize("n_stages,tie", [(2, True), (4, False)])
def test_pipedream_delays_on_the_model_tree(n_stages, tie):
    n_layers = 4
    abstract = abstract_model(n_layers, tie)
    delays = pipedream_leaf_delays(abstract, n_stages)
    per = n_layers // n_stages
    want_layers = [n_stages - 1 - layer // per for layer in range(n_layers)]
    assert delays["embed"]["embedding"] == n_stages - 1
    assert delays["final_norm"]["scale"] == 0
    assert ("lm_head" in delays) == (not tie)
    if not tie:
        assert delays["lm_head"]["kernel"] == 0
    for leaf in jax.tree.leaves(delays["layers"]):
        assert list(leaf) == want_layers

    # Each output slice is the gradient from its stage's delay ago (zeros while its stage fills).
    n = n_stages + 2
    grads = [random_like(abstract, 20 + t) for t in range(n)]
    treedef = jax.tree.structure(abstract)
    flat_delays = treedef.flatten_up_to(delays)
    tx = delay(leaf_delays=delays)
    state, update = tx.init(abstract), jax.jit(tx.update)
    for t in range(n):
        out, state = update(grads[t], state)
        for j, (o, d) in enumerate(zip(jax.tree.leaves(out), flat_delays)):
            past = lambda k: np.asarray(jax.tree.leaves(grads[t - k])[j]) if t >= k else None  # noqa: E731
            if np.ndim(d) == 0:
                want = past(d) if t >= d else np.zeros(o.shape)
            else:
                want = np.stack([past(int(k))[i] if t >= k else np.zeros(o.shape[1:])
                                 for i, k in enumerate(d)])
            np.testing.assert_array_equal(o, want, err_msg=f"t={t} leaf {j}")


def test_pipedream_rejects_indivisible_layers():
    with pytest.raises(ValueError, match=r"config\.staleness\.pipedream_stages=3.*config\.model\.n_layers=4"):
        pipedream_leaf_delays(abstract_model(4), 3)


# ------------------------------------------------------------------------------------------ state cost


def sizes(tree):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_state_cost():
    abstract = abstract_model(4)
    n = sizes(abstract)
    cost = lambda tx: sizes(jax.eval_shape(tx.init, abstract))  # noqa: E731
    assert cost(delay(0)) == 1
    assert cost(delay(1)) == n + 1
    assert cost(delay(3)) == 3 * n + 1
    assert cost(error_feedback()) == n + 1
    assert cost(taylor_compensation(0.1, steps=1)) == n + 1
    assert cost(taylor_compensation(0.1, steps=2)) == 2 * n + 1
    assert cost(taylor_compensation(adaptive=True, steps=2)) == 3 * n + 1
    assert cost(taylor_compensation(0.0, steps=2)) == 1
    # Per-stage delays: a leaf keeps as many gradients as its largest delay (P-1 for stacked layers).
    delays = pipedream_leaf_delays(abstract, 2)
    layer_size = sizes(abstract["layers"])
    assert cost(delay(leaf_delays=delays)) == layer_size + sizes(abstract["embed"]) + 2  # + count, norm
    assert all(x.size for x in jax.tree.leaves(jax.eval_shape(delay(leaf_delays=delays).init, abstract)))


# ------------------------------------------------------------------------------------- jit and orbax


def test_orbax_round_trip_mid_run_is_bit_exact(tmp_path):
    kw = dict(sync_start_steps=1, sync_cooldown_steps=2, total_steps=10)
    delays = {"w": 1, "M": np.array([2, 0]), "b": 0}
    kw = dict(kw, leaf_delays=delays)
    tx = optax.chain(delay(**kw), taylor_compensation(adaptive=True, **kw), optax.adamw(1e-2),
                     error_feedback(**kw))
    w0 = {**W0, "b": np.ones(3)}
    grad = lambda w: {**grad_jnp({k: w[k] for k in SHAPES}), "b": w["b"] * 0.5}  # noqa: E731
    update = jax.jit(tx.update)

    def steps(w, state, ts):
        for _ in ts:
            u, state = update(grad(w), state, w)
            w = optax.apply_updates(w, u)
        return w, state

    w = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), w0)
    w_full, s_full = steps(w, tx.init(w), range(10))
    w_mid, s_mid = steps(w, tx.init(w), range(5))
    restored = orbax_round_trip({"params": w_mid, "opt": s_mid}, tmp_path / "ckpt")
    assert jax.tree.structure(restored["opt"]) == jax.tree.structure(s_mid)
    w_res, s_res = steps(restored["params"], restored["opt"], range(5, 10))
    for a, b in zip(jax.tree.leaves((w_full, s_full)), jax.tree.leaves((w_res, s_res))):
        np.testing.assert_array_equal(a, b)
    # Eager (un-jitted) agrees with jit.
    w_eager, state = w, tx.init(w)
    for _ in range(10):
        u, state = tx.update(grad(w_eager), state, w_eager)
        w_eager = optax.apply_updates(w_eager, u)
    for a, b in zip(jax.tree.leaves(w_eager), jax.tree.leaves(w_full)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
