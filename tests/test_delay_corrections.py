"""Delay corrections beyond the paper: Nesterov look-ahead, PipeMare's lr, weight prediction, their config.

References are independent: a float64 NumPy loop of PyTorch's NAdam update fed 2BW's delayed
gradients; PipeMare's factor written out by hand; and a hand-written weight-prediction loop that
keeps its own velocity, fills and schedule, against the real simulate runner.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax import configs
from asyncpp_jax.models import dense
from asyncpp_jax.optim import (DelaySchedule, WeightPrediction, build_nesterov_main, build_optimizer, delay,
                               delay_aware_lr, label_params, muon, nesterov_lookahead)
from helpers import run_cli, run_simulate_runner
from helpers import tiny_model_cfg as model_cfg
from helpers import token_batches as batches

# ------------------------------------------------------------------------------ Nesterov look-ahead

A = np.array([[1.0, 0.5, 2.0], [0.3, 1.5, 0.8]])  # a quadratic with different curvatures per entry


def quad_grads(p):
    """Gradient of 0.5 * sum(A * w^2) + 0.1 * sum(w) for 'w', and of 0.5 * |s - 1|^2 for 'scale'."""
    return {"w": A * p["w"] + 0.1, "scale": p["scale"] - 1.0}


def numpy_nadam_delayed(n, d, lr, b1, b2, eps, wd, psi, K=0):
    """PyTorch NAdam (decoupled decay, no decay on 'scale') fed delay's gradients, in float64."""
    p = {"w": np.array([[0.5, -1.0, 2.0], [1.5, 0.2, -0.7]]), "scale": np.array([0.3, 2.0])}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    on = lambda t: t >= K  # noqa: E731
    grads, mu_prod = [], 1.0
    for t in range(n):
        grads.append(quad_grads(p))
        if on(t):
            g = grads[t - d] if on(t - d) else {k: np.zeros_like(x) for k, x in p.items()}
        else:
            g = grads[t]
        s = t + 1
        mu = b1 * (1 - 0.5 * 0.96 ** (s * psi))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((s + 1) * psi))
        mu_prod *= mu
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            denom = np.sqrt(v[k] / (1 - b2**s)) + eps
            decay = wd if k == "w" else 0.0
            p[k] = p[k] * (1 - lr * decay)
            p[k] = p[k] - lr * (1 - mu) / (1 - mu_prod) * g[k] / denom
            p[k] = p[k] - lr * mu_next / (1 - mu_prod * mu_next) * m[k] / denom
    return p


def run_quadratic(tx, n):
    p = {"w": jnp.array([[0.5, -1.0, 2.0], [1.5, 0.2, -0.7]]), "scale": jnp.array([0.3, 2.0])}
    state = tx.init(p)
    update = jax.jit(tx.update)
    for _ in range(n):
        u, state = update(quad_grads(p), state, p)
        p = optax.apply_updates(p, u)
    return p


@pytest.mark.parametrize("d, K, psi", [(1, 0, 0.004), (2, 3, 0.5)])
def test_nesterov_lookahead_with_delay_matches_numpy_nadam(d, K, psi):
    kw = dict(lr=0.05, b1=0.99, b2=0.999, eps=1e-8, wd=0.1, psi=psi)
    want = numpy_nadam_delayed(14, d, K=K, **kw)
    tx = optax.chain(delay(d, sync_start_steps=K),
                     nesterov_lookahead(kw["lr"], b1=kw["b1"], b2=kw["b2"], eps=kw["eps"], weight_decay=kw["wd"],
                                        momentum_decay=psi))
    got = run_quadratic(tx, 14)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6)
    # The look-ahead is not optax's NAdam (no momentum schedule): a wrong rule would not match.
    other = run_quadratic(optax.chain(delay(d, sync_start_steps=K), optax.nadamw(kw["lr"], b1=0.99, b2=0.999,
                                                                                  weight_decay=0.1)), 14)
    assert not np.allclose(other["w"], want["w"], rtol=1e-3)


# --------------------------------------------------------------------------------- PipeMare lr


def test_delay_aware_lr_is_pipemares_rule():
    sched = jax.jit(delay_aware_lr(optax.constant_schedule(2.0), DelaySchedule(steps=4, sync_start_steps=2), 8))
    got = [float(sched(t)) for t in range(11)]
    want = [2.0, 2.0] + [2.0 * 4.0 ** -(1 - t / 8) for t in range(2, 8)] + [2.0] * 3
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[2] == pytest.approx(2.0 * 4 ** -0.75)
    one = delay_aware_lr(0.5, 1, 8)  # at a one-step delay the rule is the identity
    assert [float(one(t)) for t in range(10)] == [0.5] * 10
    with pytest.raises(ValueError, match="anneal_steps"):
        delay_aware_lr(0.5, 3, 0)


# ---------------------------------------------------------------------------- weight prediction

def run_runner(cfg, tx, data, mesh, prediction=None):
    return run_simulate_runner(cfg, tx, data, mesh, weight_prediction=prediction)


def reference_prediction(cfg, data, lr, beta, K, C, T, predict=True):
    """SGD under 2BW where batch t's gradient is taken at w_t + delta_t while the delay is on."""
    grad = _grad_fn(cfg)
    w = jax.tree.map(np.asarray, dense.init_params(cfg, jax.random.key(0)))
    vel = jax.tree.map(np.zeros_like, w)
    on = lambda t: t >= K and (C == 0 or t < T - C)  # noqa: E731
    pending = {}
    for t, b in enumerate(data):
        point = jax.tree.map(lambda x, v: x + v, w, vel) if on(t) and predict else w
        g = jax.tree.map(lambda *gs: sum(np.asarray(x) for x in gs) / len(gs), *[grad(point, mb) for mb in b])
        if on(t):
            applied = pending.pop(t - 1) if on(t - 1) else jax.tree.map(np.zeros_like, g)
            pending[t] = g
        else:
            applied = g
        new = jax.tree.map(lambda x, gg: x - lr * gg, w, applied)
        vel = jax.tree.map(lambda v, n, o: beta * v + (1 - beta) * (n - o), vel, new, w)
        w = new
    return w, vel


_GRADS = {}


def _grad_fn(cfg):
    if "g" not in _GRADS:  # one compile for every reference loop of the module
        _GRADS["g"] = jax.jit(jax.grad(lambda p, mb: dense.loss_fn(cfg, p, mb)[0]))
    return _GRADS["g"]


@pytest.mark.slow  # compiles the model's train step or three optimizer chains
def test_weight_prediction_runner_matches_hand_written_loop(mesh):
    """Smoothing 0.5, a synchronous start of 2 and a cooldown of 2 out of 8 updates: every transition."""
    cfg, lr, data, beta, K, C, T = model_cfg(), 0.5, batches(8), 0.5, 2, 2, 8
    sched = DelaySchedule(1, K, C, T)
    tx = optax.chain(delay(schedule=sched), optax.sgd(lr))
    state = run_runner(cfg, tx, data, mesh, WeightPrediction(sched, beta))
    want_w, want_vel = reference_prediction(cfg, data, lr, beta, K, C, T)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_w)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(state.runner_state.velocity), jax.tree.leaves(want_vel)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    plain, _ = reference_prediction(cfg, data, lr, beta, K, C, T, predict=False)  # the test can fail
    assert max(float(np.max(np.abs(a - b))) for a, b in
               zip(jax.tree.leaves(plain), jax.tree.leaves(state.params))) > 1e-4


def test_weight_prediction_rejects_bad_smoothing():
    with pytest.raises(ValueError, match="smoothing"):
        WeightPrediction(DelaySchedule(1), 1.0)


# ------------------------------------------------------------------------------- config and CLI


def tiny(**staleness):
    c = configs.load_file("configs/tiny.py")
    c.staleness.update(**staleness)
    return c


@pytest.mark.parametrize("overrides, needle", [
    (dict(nesterov=True), "config.staleness.nesterov corrects a gradient delay, but there is none"),
    (dict(mode="2bw", nesterov=True, _opt="lion"), "config.staleness.nesterov=True is defined for"),
    (dict(mode="2bw", nesterov=True, nesterov_b1=1.0), "config.staleness.nesterov_b1=1.0 must be a finite number in [0, 1)"),
    (dict(weight_prediction=True, _pipe="sync"), "config.staleness.weight_prediction corrects a gradient delay"),
    (dict(mode="pipedream", weight_prediction=True), "weight_prediction=True needs config.staleness.mode=2bw"),
    (dict(mode="2bw", weight_prediction=True, weight_prediction_smoothing=-0.1), "weight_prediction_smoothing"),
    (dict(mode="2bw", lr_rescheduling_steps=10), "lr_rescheduling_steps=10 does nothing at a one-step delay"),
    (dict(mode="pipedream", lr_rescheduling_steps=-1), "lr_rescheduling_steps=-1 must be an integer >= 0"),
])
def test_config_rejects_corrections_where_they_cannot_apply(overrides, needle):
    opt, pipe = overrides.pop("_opt", None), overrides.pop("_pipe", None)
    c = tiny(**overrides)
    if opt:
        c.optimizer.name = opt
    if pipe:
        c.pipeline.update(stages=2, schedule=pipe)
        c.train.microbatches = 2
    with pytest.raises(configs.ConfigError) as e:
        configs.validate(c)
    assert needle in str(e.value)


@pytest.mark.parametrize("staleness", [
    dict(mode="2bw", nesterov=True, mitigation="ef"),
    dict(mode="2bw", weight_prediction=True, weight_prediction_smoothing=0.5),
    dict(mode="pipedream", pipedream_stages=4, lr_rescheduling_steps=50),
])
def test_config_accepts_corrections(staleness):
    configs.validate(tiny(**staleness))


def test_pipeline_engine_takes_the_chain_corrections():
    c = tiny(nesterov=True)
    c.pipeline.update(stages=2, schedule="2bw")
    configs.validate(c)  # the engine's delay is physical: the look-ahead lives in the chain


def _run_tx(tx, params, grads):
    state, update = tx.init(params), jax.jit(tx.update)
    for g in grads:
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
    return params


@pytest.mark.slow  # compiles the model's train step or three optimizer chains
def test_factory_builds_the_look_ahead_for_adamw_and_muon():
    params = dense.init_params(model_cfg(), jax.random.key(1))
    rng = np.random.default_rng(0)
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params) for _ in range(2)]
    o, st = configs.base_config().optimizer, tiny(mode="2bw", nesterov=True, nesterov_b1=0.97).staleness
    o.update(name="adamw", lr=1e-2, grad_clip=0.0, warmup_steps=0, schedule="constant")
    got = _run_tx(build_nesterov_main(o, optax.constant_schedule(1e-2), st), params, grads)
    want = _run_tx(nesterov_lookahead(1e-2, b1=0.97, b2=o.adamw.b2, weight_decay=o.weight_decay), params, grads)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    o.name = "muon"
    got = _run_tx(build_nesterov_main(o, optax.constant_schedule(1e-2), st), params, grads)
    hidden = _run_tx(muon(1e-2, mu=0.97, weight_decay=o.weight_decay), params, grads)
    side = _run_tx(nesterov_lookahead(1e-2, b1=0.97, b2=o.side.b2, weight_decay=o.weight_decay), params, grads)
    labels = jax.tree.leaves(label_params(params))
    for lab, g, h, s in zip(labels, jax.tree.leaves(got), jax.tree.leaves(hidden), jax.tree.leaves(side)):
        np.testing.assert_array_equal(g, h if lab == "hidden" else s)
    # And the whole chain: lr rescheduling wraps the logged schedule.
    st = tiny(mode="pipedream", pipedream_stages=4, lr_rescheduling_steps=10).staleness
    cfg4 = model_cfg()
    cfg4.n_layers = 4
    _, schedule = build_optimizer(o, 100, st, jax.eval_shape(lambda: dense.init_params(cfg4, jax.random.key(0))))
    assert float(schedule(50)) == pytest.approx(1e-2) and float(schedule(0)) == pytest.approx(1e-2 / 3)


def test_cli_rejects_weight_prediction_on_the_engine_without_delay(tmp_path):
    out = run_cli([f"--workdir={tmp_path}/run", "--config.staleness.weight_prediction=True",
                   "--config.pipeline.stages=2", "--config.pipeline.schedule=sync"], timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "config.staleness.weight_prediction corrects a gradient delay, but there is none" in out.stderr
