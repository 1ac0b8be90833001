"""The pipeline engine against the simulate runner (parity is the contract: docs/pipeline.md, "Parity").

Small model (4 layers, d 16) on fake CPU devices; the simulate runner with ``delay(1)`` in its
chain is the reference for ``2bw``, the plain simulate runner for ``sync``.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from asyncpp_jax.configs import base_config
from asyncpp_jax.models import dense
from asyncpp_jax.optim import DelaySchedule, WeightPrediction, delay, error_feedback, muon
from asyncpp_jax.pipeline.options import EngineOptions
from asyncpp_jax.pipeline.spmd import engine
from asyncpp_jax.pipeline.mesh import make_mesh
from experiments.census import Census, census, subjaxprs
from asyncpp_jax import train_state as state_lib
from helpers import run_simulate_runner
from asyncpp_jax.train import step as step_lib

T = 8
SCHED = optax.constant_schedule(0.0)  # only logged


def model_cfg():
    m = base_config().model
    m.update(vocab_size=31, d_model=16, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24, tie_embeddings=True)
    return m


def batches(n, M, B, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(0, 31, (M, B // M, T + 1)), jnp.int32) for _ in range(n)]


def make_opt(name, ef=False, K=0, C=0, total=None):
    # eps 1e-6: rows of rarely seen tokens get ~1e-9 gradients, whose float32 rounding Adam would
    # otherwise blow up to O(lr) differences between two equally valid summation orders.
    base = (optax.adamw(1e-2, b1=0.9, eps=1e-6, weight_decay=0.1) if name == "adamw"
            else muon(2e-2, mu=0.9, weight_decay=0.1))
    return optax.chain(base, error_feedback(1.0, sync_start_steps=K, sync_cooldown_steps=C,
                                            total_steps=total)) if ef else base


def run_simulate(cfg, tx, data, data_size=1):
    """``(final state, per-update metrics)`` of the simulate runner."""
    mesh = make_mesh(data_size, jax.devices()[:data_size])
    step = step_lib.make_train_step(cfg, tx, SCHED, mesh)
    state = jax.device_put(state_lib.init_state(cfg, tx, jax.random.key(0)), state_lib.replicated(mesh))
    metrics = []
    for b in data:
        state, m = step(state, jax.device_put(b, NamedSharding(mesh, state_lib.BATCH_SPEC)))
        metrics.append(jax.device_get(m))
    return state, metrics


def engine_shapes(cfg, interleave=None):
    """The params' abstract shapes in the engine's layout (a tied table as the head's [D, V])."""
    return jax.eval_shape(engine.engine_layout(cfg, None, interleave), dense.abstract_params(cfg))


def engine_options(schedule, P, M, dsched=None, ep=False, recompute=True, prediction=None, virtual_stages=1,
                   vocab_parallel=False, stage_rows=None) -> EngineOptions:
    """The engine's options for a test run (what ``runner.engine_options`` reads off a config)."""
    return EngineOptions(schedule=schedule, stages=P, microbatches=M, virtual_stages=virtual_stages,
                         recompute=recompute, vocab_parallel=vocab_parallel, expert_parallel=ep, stage_rows=stage_rows,
                         delay_schedule=dsched, weight_prediction=prediction)


def init_pipeline(cfg, tx, mesh, M, B, schedule, poison=False, ep=False, recompute=True, prediction=None,
                  interleave=None, vocab_parallel=False):
    abstract = engine_shapes(cfg, interleave)
    state = state_lib.init_state(cfg, tx, jax.random.key(0), layout=engine.engine_layout(cfg, None, interleave))
    options = engine_options(schedule, mesh.shape["stage"], M, ep=ep, recompute=recompute, prediction=prediction,
                             virtual_stages=interleave[1] if interleave else 1, vocab_parallel=vocab_parallel)
    ps = engine.init_pipeline_state(cfg, state.params, mesh, B, T, options)
    if poison and ps is not None:  # every buffer a bubble slot could read: NaN (tokens stay valid ints)
        ps = ps._replace(**{k: jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), getattr(ps, k))
                            for k in ("weight_versions", "stash", "fwd_buf", "bwd_buf", "grad_partial",
                                      "stats_partial")})
    return engine.place_state(state.replace(runner_state=ps), mesh, abstract, options)


def run_pipeline(cfg, tx, data, P, schedule, data_size=1, dsched=None, poison=False, ep=False, recompute=True,
                 prediction=None, virtual_stages=1, vocab_parallel=False, state=None):
    """Train on ``data`` with the engine; ``virtual_stages`` > 1: the params held interleaved
    (``to_model_layout(..., interleave=(P, virtual_stages))`` reads them back); ``vocab_parallel``:
    the tables split over ``stage``; ``state``: resume from it (host arrays, as a restore gives)."""
    M, B = data[0].shape[0], data[0].shape[0] * data[0].shape[1]
    mesh = engine.make_pipeline_mesh(data_size, P)
    interleave = (P, virtual_stages) if virtual_stages > 1 else None
    options = engine_options(schedule, P, M, dsched, ep, recompute, prediction, virtual_stages, vocab_parallel)
    step = engine.make_pipeline_train_step(cfg, tx, SCHED, mesh, engine_shapes(cfg, interleave), options)
    if state is None:
        state = init_pipeline(cfg, tx, mesh, M, B, schedule, poison, ep, recompute, prediction, interleave,
                              vocab_parallel)
    else:
        state = engine.place_state(state, mesh, engine_shapes(cfg, interleave), options)
    metrics = []
    for b in data:
        state, m = step(state, jax.device_put(b, engine.global_batch_sharding(mesh)))
        metrics.append(jax.device_get(m))
    return state, metrics


def assert_params_close(a, b, rtol=2e-5, atol=2e-5):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------------------------ tick tables


# Marked slow (each compiles the engine): the variants whose code path another default test covers
# (a second shape of the same schedule, the sync twin of a 2bw test, kept residuals under 2bw, plain
# AdamW under 2bw at P = 2, which the P = 4, M = 8 parity runs).

# ------------------------------------------------------------------------------------------ parity


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("P, M", [(2, 2), pytest.param(2, 4, marks=pytest.mark.slow), (4, 4), pytest.param(4, 8, marks=pytest.mark.slow)])
def test_sync_schedule_equals_simulate(P, M):
    cfg, data = model_cfg(), batches(2, M, 2 * M)
    want, _ = run_simulate(cfg, make_opt("adamw"), data)
    got, metrics = run_pipeline(cfg, make_opt("adamw"), data, P, "sync")
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert np.isfinite(metrics[-1]["loss"])


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("schedule", ["sync", "2bw"])
# (32, True): the tied table of every other parity test here.
@pytest.mark.parametrize("vocab, tie", [pytest.param(32, True, marks=pytest.mark.slow), (32, False), (31, False)])
def test_top_leaf_layouts_equal_simulate(schedule, vocab, tie):
    """The embedding and head gradients take a different road for each model: a tied table is held
    and accumulated once in the head's [D, V] layout (engine.to_engine_layout), its lookup reading
    columns, and reduce-scattered along D; an untied model has two accumulators, the embedding's
    reduce-scattered along V (divisible by P) or along D (not divisible)."""
    cfg, data = model_cfg(), batches(3, 4, 8, seed=7)
    cfg.update(vocab_size=vocab, tie_embeddings=tie)
    data = [d % vocab for d in data]
    chain = make_opt("adamw") if schedule == "sync" else optax.chain(delay(1), make_opt("adamw"))
    want, _ = run_simulate(cfg, chain, data)
    got, _ = run_pipeline(cfg, make_opt("adamw"), data, 2, schedule)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("smoothing", [pytest.param(0.0, marks=pytest.mark.slow), 0.5])  # 0.0: 0.5's path, unsmoothed
def test_2bw_weight_prediction_equals_simulate(smoothing):
    """SpecTrain / PipeMare in the engine: both slots of batch t run at w_t + δ_t, and the version
    carried to the next step is that predicted point; parity with the simulate runner's delay(1)
    with the same prediction, across a synchronous start (δ grows there, nothing is extrapolated)."""
    cfg, data = model_cfg(), batches(6, 2, 4, seed=3)
    dsched = DelaySchedule(1, sync_start_steps=2, total_steps=6)
    prediction = WeightPrediction(dsched, smoothing)
    tx = make_opt("adamw")
    want = run_simulate_runner(cfg, optax.chain(delay(1, sync_start_steps=2, total_steps=6), tx), data,
                               make_mesh(1, jax.devices()[:1]), weight_prediction=prediction)
    state, _ = run_pipeline(cfg, tx, data, 2, "2bw", dsched=dsched, prediction=prediction)
    assert_params_close(engine.to_model_layout(cfg, state.params), want.params)
    # Not vacuous: without the prediction the engine lands elsewhere.
    plain, _ = run_pipeline(cfg, tx, data, 2, "2bw", dsched=dsched)
    assert np.max(np.abs(np.asarray(plain.params["embed"]["embedding"])
                         - np.asarray(state.params["embed"]["embedding"]))) > 1e-4


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("schedule", ["sync", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_sync_schedule_with_data_parallel_equals_one_device(schedule):
    cfg, data = model_cfg(), batches(2, 2, 8)
    want, _ = run_simulate(cfg, make_opt("adamw"), data, data_size=1)
    got, _ = run_pipeline(cfg, make_opt("adamw"), data, 2, schedule, data_size=2)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("opt, ef", [pytest.param("adamw", False, marks=pytest.mark.slow), pytest.param("adamw", True, marks=pytest.mark.slow),
                                     pytest.param("muon", False, marks=pytest.mark.slow), ("muon", True)])
def test_2bw_equals_simulate_with_delay_one(opt, ef):
    cfg, data = model_cfg(), batches(10, 2, 4, seed=1)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt(opt, ef)), data)
    got, metrics = run_pipeline(cfg, make_opt(opt, ef), data, 2, "2bw")
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert [m["delay"] for m in metrics] == [1] * 10
    # Not vacuous: the delay matters at this learning rate.
    sync, _ = run_simulate(cfg, make_opt(opt, ef), data)
    assert np.max(np.abs(np.asarray(engine.to_model_layout(cfg, got.params)["embed"]["embedding"])
                         - np.asarray(sync.params["embed"]["embedding"]))) > 1e-3


@pytest.mark.needs_devices(4)
def test_2bw_with_data_parallel_equals_simulate():
    cfg, data = model_cfg(), batches(4, 2, 8, seed=4)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data, data_size=2)
    got, _ = run_pipeline(cfg, make_opt("adamw"), data, 2, "2bw", data_size=2)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)


@pytest.mark.needs_devices(4)
def test_2bw_parity_across_sync_start_and_cooldown_four_stages():
    K, C, n = 2, 3, 11
    cfg, data = model_cfg(), batches(n, 6, 6, seed=2)
    dsched = DelaySchedule(1, K, C, n)
    chain_kw = dict(sync_start_steps=K, sync_cooldown_steps=C, total_steps=n)
    want, _ = run_simulate(cfg, optax.chain(delay(1, **chain_kw), make_opt("muon", True, K, C, n)), data)
    got, metrics = run_pipeline(cfg, make_opt("muon", True, K, C, n), data, 4, "2bw", dsched=dsched)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert [int(m["delay"]) for m in metrics] == [0, 0] + [1] * 6 + [0] * 3
    assert [int(m["skipped_batches"]) for m in metrics] == [0] * 8 + [1, 0, 0]


@pytest.mark.needs_devices(2)
# MoE under 2bw by default: test_moe_expert_parallel_in_the_engine_equals_simulate (and mpmd's).
@pytest.mark.parametrize("schedule", [pytest.param("sync", marks=pytest.mark.slow), pytest.param("2bw", marks=pytest.mark.slow),
                                      pytest.param("1f1b", marks=pytest.mark.slow)])
def test_moe_model_equals_simulate(schedule):
    """MoE (every other layer, 4 experts top-2, capacity 1.25): aux losses included on every stage."""
    cfg = model_cfg()
    cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.25)
    data = batches(6, 2, 4, seed=5)
    chain = optax.chain(delay(1), make_opt("adamw")) if schedule == "2bw" else make_opt("adamw")
    want, _ = run_simulate(cfg, chain, data)
    got, metrics = run_pipeline(cfg, make_opt("adamw"), data, 2, schedule)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert metrics[-1]["moe_lb_loss"] > 0 and "moe_dropped" in metrics[-1]


@pytest.mark.needs_devices(4)
def test_moe_expert_parallel_in_the_engine_equals_simulate():
    """Experts sharded over data=2 (all_to_all inside the engine's shard_map) vs the data-parallel
    simulation with replicated experts: same per-device capacity groups, so the same drops."""
    cfg = model_cfg()
    cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.0)
    data = batches(4, 2, 8, seed=6)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data, data_size=2)
    got, metrics = run_pipeline(cfg, make_opt("adamw"), data, 2, "2bw", data_size=2, ep=True)
    assert metrics[-1]["moe_dropped"] > 0
    assert got.params["layers"]["block_1"]["moe"]["gate"].sharding.spec == jax.sharding.PartitionSpec("stage", "data")
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("schedule", [pytest.param("sync", marks=pytest.mark.slow), "2bw"])
def test_bubbles_filled_with_nan_leak_nothing(schedule):
    cfg, data = model_cfg(), batches(3, 4, 4, seed=3)
    clean, _ = run_pipeline(cfg, make_opt("adamw"), data, 2, schedule)
    poisoned, metrics = run_pipeline(cfg, make_opt("adamw"), data, 2, schedule, poison=True)
    fills = [m for m in metrics if m["loss_microbatches"] == 0]
    assert len(fills) == (1 if schedule == "2bw" else 0)  # the first 2bw update applies no batch
    assert all(np.isfinite(m["loss"]) for m in metrics if m["loss_microbatches"] > 0)
    for x, y in zip(jax.tree.leaves(clean.params), jax.tree.leaves(poisoned.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------- real-shape schedule, residuals, bf16


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("recompute", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_2bw_four_stages_eight_microbatches_equals_simulate(recompute):
    """P = 4, M = 8 > 2(P-1): the preset shape, where a step's window holds only part of a batch's
    tail.  Also the honest loss: update t logs batch t-1's loss at w[t-1], which is exactly what
    the simulate runner logged at update t-1."""
    cfg, data = model_cfg(), batches(4, 8, 8, seed=7)
    want, want_m = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data)
    got, got_m = run_pipeline(cfg, make_opt("adamw"), data, 4, "2bw", recompute=recompute)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert got_m[0]["loss_microbatches"] == 0 and all(m["loss_microbatches"] == 8 for m in got_m[1:])
    np.testing.assert_allclose([m["loss"] for m in got_m[1:]], [m["loss"] for m in want_m[:-1]], rtol=1e-6)


@pytest.mark.needs_devices(2)
@pytest.mark.slow  # MoE under 2bw: moe_model_equals_simulate[2bw]; kept residuals: the sync test below
def test_moe_2bw_with_kept_residuals_equals_simulate():
    cfg = model_cfg()
    cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.25)
    data = batches(4, 4, 4, seed=8)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data)
    got, metrics = run_pipeline(cfg, make_opt("adamw"), data, 2, "2bw", recompute=False)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert metrics[-1]["moe_lb_loss"] > 0


@pytest.mark.needs_devices(4)
def test_sync_schedule_with_kept_residuals_equals_simulate():
    cfg, data = model_cfg(), batches(2, 4, 4, seed=9)
    want, _ = run_simulate(cfg, make_opt("adamw"), data)
    got, _ = run_pipeline(cfg, make_opt("adamw"), data, 4, "sync", recompute=False)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)


# bf16 tolerance.  The engine runs the same bf16 ops as the simulate runner, but its fp32 gradient
# sums are ordered differently and the embedding's row scatter adds bf16 cotangents in fp32 where
# the unsplit model adds them in bf16.  Each update's gradient may then differ by a few bf16
# roundings (unit roundoff u = 2^-8) of its entries; with SGD (lr 0.5, 3 updates) a parameter
# differs by at most lr * steps * k u max|g| with k = 8 roundings: 0.5 * 3 * 8 * 2^-8 * max|g|.
BF16_U = 2.0 ** -8


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("schedule", [pytest.param("sync", marks=pytest.mark.slow), "2bw",
                                      pytest.param("1f1b", marks=pytest.mark.slow)])
def test_bf16_transport_equals_simulate(schedule):
    cfg, data = model_cfg(), batches(3, 4, 8, seed=10)
    cfg.compute_dtype = "bfloat16"
    lr, steps = 0.5, len(data)
    tx = optax.sgd(lr)
    want, want_m = run_simulate(cfg, optax.chain(delay(1), tx) if schedule == "2bw" else tx, data)
    got, _ = run_pipeline(cfg, tx, data, 2, schedule)
    if schedule == "2bw":
        state = got.runner_state
        assert state.fwd_buf.dtype == state.bwd_buf.dtype == state.stash[0].dtype == jnp.bfloat16
    max_g = max(float(m["grad_norm"]) for m in want_m)  # bounds max|g|
    tol = lr * steps * 8 * BF16_U * max_g
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params, rtol=0, atol=tol)
    # Not vacuous: bf16 rounding is far above the fp32 tolerance here.
    fp32, _ = run_simulate(model_cfg(), optax.chain(delay(1), tx) if schedule == "2bw" else tx, data)
    assert max(np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in
               zip(jax.tree.leaves(fp32.params), jax.tree.leaves(want.params))) > 2e-5


@pytest.mark.needs_devices(4)
def test_in_flight_state_holds_each_tensor_once():
    """The weight version is laid out like the params, the partial gradient like the update (no
    leading [data, stage] copies of the replicated embedding and norms; split over stage where an
    axis divides); only activations are per device.  The optimizer state of the replicated leaves
    is split over stage too, so their update runs once over the mesh."""
    cfg, data = model_cfg(), batches(2, 4, 8, seed=11)
    got, _ = run_pipeline(cfg, make_opt("adamw"), data, 2, "2bw", data_size=2)
    ps = got.runner_state
    (prev,), (partial,) = ps.weight_versions, ps.grad_partial  # 2bw: one earlier version, one later update
    for g, p in zip(jax.tree.leaves(prev), jax.tree.leaves(got.params)):
        assert g.shape == p.shape and g.sharding.spec == p.sharding.spec
    for g, p in zip(jax.tree.leaves(partial), jax.tree.leaves(got.params)):
        assert g.shape == (2,) + p.shape  # each data replica's own: reduced over data once, with its tail
        assert g.sharding.spec[0] == "data"
    embed_partial = partial["embed"]["embedding"]
    assert embed_partial.shape == (2, 16, 31)  # the tied table in the head's [D, V] layout, per replica
    assert not embed_partial.sharding.is_fully_replicated  # split over stage on d
    assert got.params["embed"]["embedding"].sharding.is_fully_replicated  # both end stages read it
    mu = got.opt_state[0].mu["embed"]["embedding"]
    assert mu.sharding.spec == jax.sharding.PartitionSpec("stage")
    sync, _ = run_pipeline(cfg, make_opt("adamw"), data, 2, "sync", data_size=2)
    assert sync.runner_state is None  # a flushed schedule carries nothing across steps


@pytest.mark.needs_devices(4)
def test_eval_on_the_pipeline_mesh_equals_simulate_and_gathers_nothing():
    cfg = model_cfg()
    params = dense.init_params(cfg, jax.random.key(3))
    batch = jnp.asarray(np.random.default_rng(12).integers(0, 31, (8, T + 1)), jnp.int32)
    mesh1 = make_mesh(1, jax.devices()[:1])
    want = step_lib.make_eval_step(cfg, mesh1)(params, jax.device_put(batch, step_lib.eval_sharding(mesh1)))
    mesh = engine.make_pipeline_mesh(2, 2)
    abstract = engine_shapes(cfg)
    sharded = jax.device_put(engine.to_engine_layout(cfg, params),
                             jax.tree.map(lambda sp: NamedSharding(mesh, sp), engine.param_specs(abstract)))
    fn = engine.make_pipeline_eval_step(cfg, mesh, abstract, 2, engine_options("sync", 2, 4))
    glob = jax.device_put(batch, NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    got = fn(sharded, glob)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    assert float(got[1]) == 8 * T
    assert "all-gather" not in fn.lower(sharded, glob).compile().as_text()


def _data_reductions(jaxpr) -> list[tuple]:
    """Shapes of the non-scalar operands reduced over ``data`` (psum, and pmean's psum) anywhere in
    ``jaxpr``, sub-jaxprs (shard_map, scan, cond) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("psum") and "data" in tuple(eqn.params.get("axes", ())):
            out += [tuple(v.aval.shape) for v in eqn.invars if v.aval.shape]
        for inner in subjaxprs(eqn):
            out += _data_reductions(inner)
    return out


@pytest.mark.needs_devices(4)
def test_2bw_reduces_each_gradient_over_data_once():
    """Under 2bw a batch's gradient is made over two steps (its head at t, its tail at t+1).  The head
    is carried per data replica and the whole gradient is reduced over ``data`` once: one reduction
    per parameter leaf per update.  (Before: the head was reduced at t and the tail at t+1, two per
    leaf.)"""
    cfg, data = model_cfg(), batches(1, 4, 8)
    mesh = engine.make_pipeline_mesh(2, 2)
    tx = make_opt("adamw")
    step = engine.make_pipeline_train_step(cfg, tx, SCHED, mesh, engine_shapes(cfg), engine_options("2bw", 2, 4))
    state = init_pipeline(cfg, tx, mesh, 4, 8, "2bw")
    jaxpr = jax.make_jaxpr(step)(state, jax.device_put(data[0], engine.global_batch_sharding(mesh)))
    reduced = _data_reductions(jaxpr.jaxpr)
    assert len(reduced) == len(jax.tree.leaves(state.params)), reduced


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("schedule,per_tick", [("sync", 5), ("2bw", 10)])
def test_conditionals_per_tick(schedule, per_tick):
    """XLA:GPU reads each conditional's predicate on the host, so their number per update is a cost
    (docs/pipeline.md).  A train tick runs its forward, backward and last-stage slots each under a
    cond, with nested conds for stage 0's embedding and, under 2bw, for the weight version of each
    use: 5 per tick under sync, 10 under 2bw (merging them into one switch per slot made XLA:CPU
    copy the stash ring in every branch).  The eval step runs 3 per tick: the tick's, stage 0's
    lookup, the last stage's loss (as one switch over the stage's role, each branch held its own
    copy of the stage's layer weights)."""
    cfg, data = model_cfg(), batches(1, 4, 8)
    mesh = engine.make_pipeline_mesh(1, 2)
    tx = make_opt("adamw")
    abstract = engine_shapes(cfg)
    options = engine_options(schedule, 2, 4)
    step = engine.make_pipeline_train_step(cfg, tx, SCHED, mesh, abstract, options)
    state = init_pipeline(cfg, tx, mesh, 4, 8, schedule)
    batch = jax.device_put(data[0], engine.global_batch_sharding(mesh))
    plan = options.plan
    assert census(jax.make_jaxpr(step)(state, batch)) == Census(per_tick * plan.slots, 0)
    evaluate = engine.make_pipeline_eval_step(cfg, mesh, abstract, 2, options)
    rows = jax.device_put(data[0].reshape(8, -1), NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    # 8 rows in microbatches of 2 through 2 stages: 4 + 2 - 1 ticks
    assert census(jax.make_jaxpr(evaluate)(state.params, rows)) == Census(3 * 5, 0)
