"""One runtime for every schedule: PipeDream's per-stage delay on the engine, 2bw from its
program's own validity, and a schedule defined here (a generator only) trained by the engine.

The references are the simulate runner with ``optim.delay``: per-leaf delays
(``pipedream_leaf_delays``, the ``staleness.mode=pipedream``, ``pipedream_gradient='per_leaf'``
chain) for ``pipedream``, ``delay(1)`` for ``2bw``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax.models import dense
from asyncpp_jax.optim import DelaySchedule, delay, error_feedback, pipedream_leaf_delays
from asyncpp_jax.pipeline.spmd import engine
from asyncpp_jax.pipeline.schedules import programs
from asyncpp_jax.pipeline.schedules import slot_plan
from asyncpp_jax.pipeline.spmd.executor import Device
from test_pipeline import assert_params_close, batches, make_opt, model_cfg, run_pipeline, run_simulate


def leaf_delays(cfg, P):
    return pipedream_leaf_delays(dense.abstract_params(cfg), P)


def pipedream_reference(cfg, tx, data, P, **schedule):
    """The simulate runner with PipeDream's per-leaf delays in its chain."""
    return run_simulate(cfg, optax.chain(delay(leaf_delays=leaf_delays(cfg, P), **schedule), tx), data)


@pytest.mark.needs_devices(4)
@pytest.mark.slow  # the steady state is also the middle of the default test across a sync start and cooldown
def test_pipedream_on_the_engine_equals_simulate_with_per_stage_delays():
    """Stage s applies its gradient P-1-s updates late; the tied table (both uses) P-1 late."""
    P, cfg, data = 4, model_cfg(), batches(7, 2, 4, seed=21)
    want, want_m = pipedream_reference(cfg, make_opt("adamw"), data, P)
    got, got_m = run_pipeline(cfg, make_opt("adamw"), data, P, "pipedream")
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert [int(m["delay"]) for m in got_m] == [P - 1] * len(data)
    # the logged loss is the loss the last stage (delay 0) computed: the simulate runner's, update for update
    np.testing.assert_allclose([m["loss"] for m in got_m], [m["loss"] for m in want_m], rtol=1e-5)
    assert len(got.runner_state.weight_versions) == P - 1  # stage s reads P - s of them
    # Not vacuous: 2bw's one-step delay gives other weights.
    two_bw, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data)
    assert max(np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in
               zip(jax.tree.leaves(two_bw.params), jax.tree.leaves(want.params))) > 1e-3


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("placement", ["spmd", "mpmd"])
@pytest.mark.parametrize("tie", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pipedream_parity_across_sync_start_and_cooldown(tie, placement):
    """The per-slice fills after the synchronous start, the in-flight batches dropped at the
    cooldown switch, and error feedback on the same per-leaf schedule.  Under ``mpmd`` the same
    program is dispatched stage by stage from the host (one compiled program per stage and action):
    its weight versions, the cotangents crossing steps and a tied table's head gradient carried
    P-1 updates live in its own state."""
    from test_mpmd import run_mpmd

    P, K, C, n = 4, 2, 2, 9
    cfg, data = model_cfg(), batches(n, 2, 4, seed=22)
    cfg.tie_embeddings = tie
    kw = dict(sync_start_steps=K, sync_cooldown_steps=C, total_steps=n)
    ef = lambda: optax.chain(muon_opt(), error_feedback(1.0, leaf_delays=leaf_delays(cfg, P), **kw))  # noqa: E731
    want, want_m = pipedream_reference(cfg, ef(), data, P, **kw)
    dsched = DelaySchedule(P - 1, K, C, n)
    if placement == "mpmd":
        got, metrics, _ = run_mpmd(cfg, ef(), data, P, "pipedream", dsched=dsched)
    else:
        got, metrics = run_pipeline(cfg, ef(), data, P, "pipedream", dsched=dsched)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert [int(m["delay"]) for m in metrics] == [0] * K + [P - 1] * (n - K - C) + [0] * C
    assert [int(m["skipped_batches"]) for m in metrics] == [0] * (n - C) + [P - 1] + [0] * (C - 1)
    np.testing.assert_allclose([m["loss"] for m in metrics], [m["loss"] for m in want_m], rtol=1e-5)
    assert len(got.runner_state.weight_versions) == P - 1


def muon_opt():
    return make_opt("muon")


@pytest.mark.needs_devices(4)
@pytest.mark.slow  # the same skipping of dead actions as 2bw's default NaN test (tests/test_pipeline.py)
def test_pipedream_bubbles_filled_with_nan_leak_nothing():
    """Every buffer, weight version and partial gradient of the fresh state poisoned: the fills
    (stage s has nothing to apply for its first P-1-s updates) read none of it."""
    cfg, data = model_cfg(), batches(4, 2, 4, seed=23)
    clean, _ = run_pipeline(cfg, make_opt("adamw"), data, 4, "pipedream")
    poisoned, metrics = run_pipeline(cfg, make_opt("adamw"), data, 4, "pipedream", poison=True)
    assert all(np.isfinite(m["loss"]) for m in metrics)
    for x, y in zip(jax.tree.leaves(clean.params), jax.tree.leaves(poisoned.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.needs_devices(4)
@pytest.mark.slow  # the config's rule is tested by tests/test_config_domains.py
def test_2bw_runs_from_its_programs_own_validity():
    """M = P - 1 = 3 at P = 4: the 2bw program is valid there (no batch reaches two steps back),
    so the engine runs it; the tick tables needed 2(P - 1) = 6."""
    P, M = 4, 3
    assert programs.min_microbatches("2bw", P) == M
    cfg, data = model_cfg(), batches(4, M, 3, seed=24)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data)
    got, _ = run_pipeline(cfg, make_opt("adamw"), data, P, "2bw")
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)


def lazy_2bw(P: int, M: int, v: int = 1) -> programs.Program:
    """A schedule written for this test: every stage runs all of this step's forwards, then the
    previous batch's backwards, last microbatch first.  Flushless (update t applies batch t-1);
    the last stage's inputs wait a whole step in the activation buffer."""
    def act(kind, m):
        return programs.Action(kind, m, 0, m // M)

    lists = tuple(tuple([act("F", k) for k in range(M)] + [act("B", -1 - k) for k in range(M)]) for _ in range(P))
    return programs.Program("lazy-2bw", P, M, lists, delay=1)


@pytest.fixture(scope="module")
def lazy_schedule():
    if "lazy-2bw" not in programs.GENERATORS:
        programs.register("lazy-2bw", lazy_2bw)
    yield "lazy-2bw"


@pytest.mark.needs_devices(2)
def test_a_schedule_defined_here_is_validated_and_trained(lazy_schedule, monkeypatch):
    P, M = 2, 2
    program = programs.validate(programs.generate(lazy_schedule, P, M))
    assert slot_plan.compile_program(program).cyclic
    cfg, data = model_cfg(), batches(4, M, 4, seed=25)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data)
    got, _ = run_pipeline(cfg, make_opt("adamw"), data, P, lazy_schedule)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    # A mutation: one microbatch's backward reads this step's weights instead of its batch's.
    run = Device.run
    monkeypatch.setattr(Device, "run", lambda self, j, fn, part=None: run(self, jnp.where(j == -1, 0, j), fn, part))
    bad, _ = run_pipeline(cfg, make_opt("adamw"), data, P, lazy_schedule)
    with pytest.raises(AssertionError):
        assert_params_close(engine.to_model_layout(cfg, bad.params), want.params)


def test_the_validator_rejects_a_stale_version():
    """The same mutation written into the program: the validator names the rule."""
    good = lazy_2bw(2, 2)
    acts = list(good.actions[0])
    acts[-1] = programs.Action("B", acts[-1].microbatch, 0, 0)
    bad = programs.Program("lazy-2bw", 2, 2, (tuple(acts),) + good.actions[1:], delay=1)
    with pytest.raises(programs.ProgramError, match="rule 'version'"):
        programs.validate(bad)


@pytest.mark.needs_devices(4)
@pytest.mark.slow  # each compiles the engine twice over; the split tables' loop is tested under 2bw by default
@pytest.mark.parametrize("variant", ["split_tables", "moe_data_parallel", "mpmd_moe_data_parallel"])
def test_pipedream_variants_equal_simulate(variant):
    """The vocabulary split over stage (a layout the same loop reads), and MoE with data parallel
    under both placements."""
    cfg = model_cfg()
    if variant == "split_tables":
        P, data_size, cfg.vocab_size = 4, 1, 32
        data = [b % 32 for b in batches(5, 2, 4, seed=26)]
    else:
        P, data_size = 2, 2
        cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.25)
        data = batches(5, 2, 8, seed=27)
    want, _ = run_simulate(cfg, optax.chain(delay(leaf_delays=leaf_delays(cfg, P)), make_opt("adamw")), data,
                           data_size=data_size)
    if variant.startswith("mpmd"):
        from test_mpmd import run_mpmd

        got, _, _ = run_mpmd(cfg, make_opt("adamw"), data, P, "pipedream", data_size=data_size)
    else:
        got, _ = run_pipeline(cfg, make_opt("adamw"), data, P, "pipedream", data_size=data_size,
                              vocab_parallel=variant == "split_tables")
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)


@pytest.mark.needs_devices(4)
@pytest.mark.slow  # three engine runs; through real checkpoints: test_trainer's test_runner_state_resumes_exactly
def test_pipedream_resumes_exactly_mid_run():
    """The in-flight state (three weight versions, stash, buffers, batches in flight) through the host
    and back, as a checkpoint takes it: the run goes on as if never stopped."""
    P, cfg, data = 4, model_cfg(), batches(6, 2, 4, seed=28)
    whole, _ = run_pipeline(cfg, make_opt("adamw"), data, P, "pipedream")
    first, _ = run_pipeline(cfg, make_opt("adamw"), data[:3], P, "pipedream")
    host = jax.device_get(first)  # every array as NumPy, as a restore hands them back
    resumed, _ = run_pipeline(cfg, make_opt("adamw"), data[3:], P, "pipedream", state=host)
    for x, y in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
