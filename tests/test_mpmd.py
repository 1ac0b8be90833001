"""The ``mpmd`` placement against the simulate runner, and where its tensors live.

Same small model as test_pipeline (4 layers, d 16) on fake CPU devices.  Parity: ``1f1b`` with the
plain simulate runner, ``2bw`` with ``delay(1)`` in the simulate chain, at ``M = P``.  Placement:
no vocabulary-sized array (parameter, version, optimizer state, accumulator) on a middle stage,
and no middle stage's program reads one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax import configs
from asyncpp_jax.models import dense
from asyncpp_jax.optim import DelaySchedule, delay
from asyncpp_jax.pipeline.spmd import engine
from asyncpp_jax.pipeline.mpmd import engine as mpmd
from asyncpp_jax.pipeline.schedules import programs
from asyncpp_jax.pipeline.mesh import make_mesh
from asyncpp_jax.pipeline.mpmd.placement import bytes_on_devices
from asyncpp_jax.train import runner as runner_lib
from asyncpp_jax.train import step as step_lib
from helpers import orbax_round_trip
from test_pipeline import BF16_U, SCHED, T, engine_options, assert_params_close, batches, make_opt, model_cfg, run_simulate

V = 64  # bigger than any other dimension, so "vocabulary-sized" is unambiguous


def vocab_cfg(tie=True):
    cfg = model_cfg()
    cfg.update(vocab_size=V, tie_embeddings=tie)
    return cfg


def make_step(cfg, tx, M, B, P, schedule, data_size=1, dsched=None, clip=0.0):
    mesh = engine.make_pipeline_mesh(data_size, P)
    shapes = jax.eval_shape(engine.engine_layout(cfg), dense.abstract_params(cfg))
    return mpmd.MpmdTrainStep(cfg, tx, SCHED, mesh, shapes, engine_options(schedule, P, M, dsched), B, T, clip)


def run_mpmd(cfg, tx, data, P, schedule, data_size=1, dsched=None, clip=0.0, state=None, step=None):
    M, B = data[0].shape[0], data[0].shape[0] * data[0].shape[1]
    step = step or make_step(cfg, tx, M, B, P, schedule, data_size, dsched, clip)
    state = state if state is not None else mpmd.init_state(cfg, step, jax.random.key(0))
    metrics = []
    for b in data:
        state, m = step(state, jax.device_put(b, engine.global_batch_sharding(step.placement.mesh)))
        metrics.append(jax.device_get(m))
    return state, metrics, step


def model_params(cfg, state):
    return engine.to_model_layout(cfg, jax.device_get(state.params))


# ------------------------------------------------------------------------------------------ parity


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("tie", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_1f1b_equals_simulate(tie):
    cfg, data = vocab_cfg(tie), [b % V for b in batches(2, 4, 8)]
    want, want_m = run_simulate(cfg, make_opt("adamw"), data)
    got, got_m, _ = run_mpmd(cfg, make_opt("adamw"), data, 4, "1f1b")
    assert_params_close(model_params(cfg, got), want.params)
    np.testing.assert_allclose([m["loss"] for m in got_m], [m["loss"] for m in want_m], rtol=1e-6)
    np.testing.assert_allclose([m["grad_norm"] for m in got_m], [m["grad_norm"] for m in want_m], rtol=1e-5)


@pytest.mark.needs_devices(4)
def test_2bw_at_m_equals_p_equals_simulate_with_delay_one():
    """P = 4 at M = 4 (the 2BW paper's smallest M; the spmd tick tables need 2(P-1) = 6): update t
    applies batch t-1's gradient at w[t-1]; the logged loss of update t is batch t-1's."""
    cfg, data = vocab_cfg(tie=True), [b % V for b in batches(5, 4, 8, seed=1)]
    want, want_m = run_simulate(cfg, optax.chain(delay(1), make_opt("muon", ef=True)), data)
    got, got_m, step = run_mpmd(cfg, make_opt("muon", ef=True), data, 4, "2bw")
    assert_params_close(model_params(cfg, got), want.params)
    assert_vocabulary_only_on_the_end_stages(got, step)
    assert got_m[0]["loss_microbatches"] == 0 and all(m["loss_microbatches"] == 4 for m in got_m[1:])
    np.testing.assert_allclose([m["loss"] for m in got_m[1:]], [m["loss"] for m in want_m[:-1]], rtol=1e-6)
    assert [int(m["delay"]) for m in got_m] == [1] * 5
    assert programs.min_microbatches("2bw", 4) <= 4
    # Not vacuous: the delay matters at this learning rate.
    sync, _ = run_simulate(cfg, make_opt("muon", ef=True), data)
    assert np.max(np.abs(np.asarray(model_params(cfg, got)["embed"]["embedding"])
                         - np.asarray(sync.params["embed"]["embedding"]))) > 1e-3


@pytest.mark.needs_devices(4)
@pytest.mark.slow  # the switches: test_pipeline's spmd twin; the mpmd step's delayed window: the test above
def test_2bw_across_sync_start_and_cooldown():
    K, C, n = 1, 2, 6
    cfg, data = model_cfg(), batches(n, 4, 4, seed=2)
    kw = dict(sync_start_steps=K, sync_cooldown_steps=C, total_steps=n)
    want, _ = run_simulate(cfg, optax.chain(delay(1, **kw), make_opt("adamw")), data)
    got, metrics, _ = run_mpmd(cfg, make_opt("adamw"), data, 4, "2bw", dsched=DelaySchedule(1, K, C, n))
    assert_params_close(model_params(cfg, got), want.params)
    assert [int(m["delay"]) for m in metrics] == [0, 1, 1, 1, 0, 0]
    assert [int(m["skipped_batches"]) for m in metrics] == [0, 0, 0, 0, 1, 0]


@pytest.mark.needs_devices(4)
def test_2bw_with_data_parallel_and_global_clip_equals_simulate():
    """data = 2: each replica's accumulators, reduced over data once per update.  The clip's norm
    is global: every group's squared norm meets every other group's."""
    cfg, data = vocab_cfg(tie=False), [b % V for b in batches(4, 2, 8, seed=4)]
    clip = 0.05
    want, want_m = run_simulate(cfg, optax.chain(optax.clip_by_global_norm(clip), delay(1), make_opt("adamw")), data,
                                data_size=2)
    got, got_m, _ = run_mpmd(cfg, make_opt("adamw"), data, 2, "2bw", data_size=2, clip=clip)
    assert_params_close(model_params(cfg, got), want.params)
    assert min(float(m["grad_norm"]) for m in want_m[:-1]) > clip  # the clip fired at every update
    np.testing.assert_allclose([m["grad_norm"] for m in got_m[1:]], [m["grad_norm"] for m in want_m[:-1]],
                               rtol=1e-5)


@pytest.mark.needs_devices(2)
@pytest.mark.slow  # MoE: the stage programs are StageFns', which test_pipeline's MoE parity covers
def test_moe_model_equals_simulate():
    cfg = model_cfg()
    cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.25)
    data = batches(3, 2, 4, seed=5)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data)
    got, metrics, _ = run_mpmd(cfg, make_opt("adamw"), data, 2, "2bw")
    assert_params_close(model_params(cfg, got), want.params)
    assert metrics[-1]["moe_lb_loss"] > 0 and "moe_dropped" in metrics[-1]


@pytest.mark.needs_devices(2)
@pytest.mark.slow  # bf16 transport: test_pipeline's spmd twin runs the same StageFns
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_bf16_equals_simulate(schedule):
    """The spmd engine's bf16 bound (test_pipeline.test_bf16_transport_equals_simulate)."""
    cfg, data = model_cfg(), batches(3, 4, 8, seed=10)
    cfg.compute_dtype = "bfloat16"
    lr = 0.5
    tx = optax.sgd(lr)
    want, want_m = run_simulate(cfg, optax.chain(delay(1), tx) if schedule == "2bw" else tx, data)
    got, _, _ = run_mpmd(cfg, tx, data, 2, schedule)
    if schedule == "2bw":
        assert all(x.dtype == jnp.bfloat16 for x in got.runner_state.inflight.values())
    tol = lr * len(data) * 8 * BF16_U * max(float(m["grad_norm"]) for m in want_m)
    assert_params_close(model_params(cfg, got), want.params, rtol=0, atol=tol)


# --------------------------------------------------------------------------- state and checkpoints


@pytest.mark.needs_devices(4)
def test_checkpoint_mid_run_resumes_exactly(tmp_path):
    """The in-flight batch (its stashed activations, cotangents in transit and partial gradients)
    is in the state: saved after 2 updates, restored into the abstract state, and continued, the
    run ends where an unbroken one does."""
    cfg, data = vocab_cfg(tie=False), [b % V for b in batches(3, 4, 8, seed=6)]
    whole, _, step = run_mpmd(cfg, make_opt("adamw"), data, 4, "2bw")
    half, _, _ = run_mpmd(cfg, make_opt("adamw"), data[:2], 4, "2bw", step=step)
    assert_vocabulary_only_on_the_end_stages(half, step)
    restored = orbax_round_trip(half, tmp_path / "ckpt")
    abstract = mpmd.abstract_state(step, step.params_abstract)
    for x, a in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
        assert x.shape == a.shape and x.dtype == a.dtype and x.sharding.device_set == a.sharding.device_set
    # The step reads the restored state's update count from the device, as after a restart (the
    # trainer-level resume, through a fresh runner, is test_trainer's test_runner_state_resumes_exactly).
    resumed, _, _ = run_mpmd(cfg, make_opt("adamw"), data[2:], 4, "2bw", state=restored, step=step)
    for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_vocabulary_only_on_the_end_stages(state, step):
    """P = 4: the embedding, its versions and optimizer state on stage 0, the head on stage 3 (a
    tied table on both), the in-flight accumulators with them; the stash holds activations only,
    no weights; a middle stage holds less than an end stage."""
    mesh = step.placement.mesh
    middle = {d.id for d in mesh.devices[:, 1:3].flat}
    ends = {d.id for d in mesh.devices[:, [0, 3]].flat}
    vocab_leaves = [(path, x) for path, x in jax.tree_util.tree_leaves_with_path(state) if V in x.shape]
    assert len(vocab_leaves) >= 6  # params, prev version, optimizer moments, accumulators
    for path, x in vocab_leaves:
        held = {d.id for d in x.sharding.device_set}
        assert held <= ends and not held & middle, jax.tree_util.keystr(path)
    act = step.stages[1].activation(step.rows, T, mesh.shape["data"])
    for key, x in state.runner_state.inflight.items():
        assert x.shape == act.shape, key  # [data, 1, b, T, D]: one activation, no weights
    per_device = bytes_on_devices(state)
    assert max(per_device[i] for i in middle) < min(per_device[i] for i in ends)


@pytest.mark.needs_devices(4)
def test_middle_stage_programs_read_nothing_vocabulary_sized():
    """The compiled actions of stages 1 and 2 take and make no vocabulary-sized array, and stage
    0's backward and stage 3's fused vjp update their table accumulators in place (donated: no copy)."""
    cfg = vocab_cfg(tie=True)
    step = make_step(cfg, make_opt("adamw"), 4, 8, 4, "2bw")
    state = mpmd.init_state(cfg, step, jax.random.key(0))
    batch = jax.device_put(jnp.zeros((4, 2, T + 1), jnp.int32), engine.global_batch_sharding(step.placement.mesh))
    def vocab_sized(text):  # a V-long dimension in a StableHLO tensor type
        return f"x{V}x" in text or f"<{V}x" in text or f"x{V}>" in text

    for s in (1, 2):
        w = step.stage_params(state.params, s)
        act = step.stages[s].activation(step.rows, T, 1)
        acc, sums = step.zeros[s]()
        for fn, args in ((step.fwd[s], (w, act, sums)), (step.bwd[s], (w, act, act, acc))):
            assert not vocab_sized(fn.lower(*args).as_text())
    act = [step.stages[s].activation(step.rows, T, 1) for s in (0, 3)]
    tables = [(step.bwd[0], (step.stage_params(state.params, 0), step.placement.view(batch, 0), np.int32(0), act[0],
                             step.zeros[0]()[0])),
              (step.last, (step.stage_params(state.params, 3), act[1], step.placement.view(batch, 3), np.int32(0),
                           *step.zeros[3]()))]
    for fn, args in tables:
        lowered = fn.lower(*args)
        assert vocab_sized(lowered.as_text())  # the check above sees a table where there is one
        hlo = lowered.compile().as_text()
        assert not [line for line in hlo.splitlines() if " copy(" in line and f"{V}]" in line]


# ------------------------------------------------------------------------------------------- eval


@pytest.mark.needs_devices(4)
def test_eval_equals_simulate():
    cfg = vocab_cfg(tie=False)
    params = dense.init_params(cfg, jax.random.key(3))
    batch = jnp.asarray(np.random.default_rng(12).integers(0, V, (8, T + 1)), jnp.int32)
    mesh1 = make_mesh(1, jax.devices()[:1])
    want = step_lib.make_eval_step(cfg, mesh1)(params, jax.device_put(batch, step_lib.eval_sharding(mesh1)))
    mesh = engine.make_pipeline_mesh(2, 2)
    step = make_step(cfg, make_opt("adamw"), 2, 8, 2, "1f1b", data_size=2)
    state = mpmd.init_state(cfg, step, jax.random.key(0), params=params)
    fn = mpmd.MpmdEvalStep(cfg, mesh, 2, engine_options("sync", 2, 4))
    got = fn(state.params, jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    assert float(got[1]) == 8 * T


def test_carried_keys_follow_the_program():
    """What a 2bw window leaves in flight, derived from the program: stage s keeps the inputs of
    its last P-1-s forwards, and each channel s+1 -> s one cotangent.  Under pipedream stage s
    keeps every input of the P-1-s batches whose backwards are still to come, and nothing is in
    transit between steps but the cotangents its backwards wait for."""
    P, M = 4, 4
    window = mpmd.order(programs.two_bw(P, M))
    keys = mpmd.carried_keys(window, P, 1)
    assert {b for _, _, b, _ in keys} == {0}  # the previous batch's are all consumed
    stash = sorted((s, m) for kind, s, _, m in keys if kind == "stash")
    ct = sorted((s, m) for kind, s, _, m in keys if kind == "ct")
    assert stash == [(s, m) for s in range(1, P - 1) for m in range(M - (P - 1 - s), M)]
    assert ct == [(s, M - P + 1 + s) for s in range(P - 1)]
    assert not [k for k in keys if k[0] == "fwd"]
    window = mpmd.order(programs.generate("pipedream", P, M))
    keys = mpmd.carried_keys(window, P, P - 1)
    for s in range(1, P - 1):  # the last stage's backward runs in the step of its forward
        assert sorted((b, m) for kind, st, b, m in keys if kind == "stash" and st == s) == [
            (b, m) for b in range(-(P - 2 - s), 1) for m in range(M)]
    assert not [k for k in keys if k[0] == "stash" and k[1] == P - 1]


@pytest.mark.needs_devices(4)
@pytest.mark.slow  # ~30 s; configs/moe10b.py's mpmd dry run compiles the same programs at full size
def test_moe_expert_parallel_equals_simulate():
    """Experts split over data = 2 on each stage's devices (all_to_all over data inside the stage's
    programs) vs the data-parallel simulation: the same drops, the same update."""
    cfg = model_cfg()
    cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.0)
    data = batches(3, 2, 8, seed=6)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data, data_size=2)
    M, B = data[0].shape[0], data[0].shape[0] * data[0].shape[1]
    mesh = engine.make_pipeline_mesh(2, 2)
    shapes = jax.eval_shape(engine.engine_layout(cfg), dense.abstract_params(cfg))
    step = mpmd.MpmdTrainStep(cfg, make_opt("adamw"), SCHED, mesh, shapes, engine_options("2bw", 2, M, ep=True), B, T)
    got, metrics, _ = run_mpmd(cfg, make_opt("adamw"), data, 2, "2bw", data_size=2, step=step)
    assert metrics[-1]["moe_dropped"] > 0
    assert got.params["layers"]["block_1"]["moe"]["gate"].sharding.spec == jax.sharding.PartitionSpec("stage", "data")
    assert_params_close(model_params(cfg, got), want.params)


@pytest.mark.needs_devices(2)
def test_a_job_of_several_processes_is_refused_naming_the_setting(monkeypatch):
    c = configs.load_file("configs/tiny.py")
    c.pipeline.update(stages=2, schedule="2bw", placement="mpmd")
    c = configs.resolve(c)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(configs.ConfigError, match=r"config.pipeline.placement='mpmd' runs in one process .* set "
                                                  r"config.pipeline.placement='spmd'"):
        runner_lib.build(c, jax.devices()[:2])
