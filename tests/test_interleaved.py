"""The ``interleaved`` schedule in the engine: Megatron's interleaved 1F1B, ``v`` chunks of layers a device.

Virtual stage ``u = c P + d`` runs on device ``d`` as its chunk ``c``; the engine holds the layer
stack in that order (``layout.interleave_index``) so each device's ``stage`` shard is its chunks,
one after the other.  Checked here: the layout is a permutation that ``to_model_layout`` undoes;
every compiled plan delivers each message to its reader; train and eval steps equal the simulate
runner's; the settings that cannot hold are refused before anything compiles, a resume into
another layer order included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from asyncpp_jax import configs
from asyncpp_jax.models import dense
from asyncpp_jax.pipeline import layout
from asyncpp_jax.pipeline.spmd import engine
from asyncpp_jax.pipeline.schedules import programs
from asyncpp_jax.pipeline.schedules import slot_plan
from experiments.census import Census, census
from asyncpp_jax.train import step as step_lib
from asyncpp_jax.train.resume import ResumeRefused, _check_split

from test_pipeline import (BF16_U, SCHED, T, assert_params_close, batches, engine_options, engine_shapes, init_pipeline, make_opt,
                           model_cfg, run_pipeline, run_simulate)
from test_program_executor import _replay


def _cfg(n_layers):
    cfg = model_cfg()
    cfg.n_layers = n_layers
    return cfg


# ------------------------------------------------------------------------------------------ layout


def test_interleave_index_puts_each_devices_chunks_in_its_shard():
    """P = 2, v = 2, 8 rows: virtual stages 0..3 hold model rows (0,1), (2,3), (4,5), (6,7); device 0
    holds stages 0 and 2, device 1 stages 1 and 3."""
    dst = layout.interleave_index(8, 2, 2)
    held = np.empty(8, np.int32)
    held[dst] = np.arange(8)
    np.testing.assert_array_equal(held, [0, 1, 4, 5, 2, 3, 6, 7])
    for rows, P, v in ((8, 2, 2), (24, 4, 3), (16, 8, 2)):
        assert sorted(layout.interleave_index(rows, P, v)) == list(range(rows))


@pytest.mark.parametrize("tie", [True, False])
def test_engine_layout_round_trip(tie):
    cfg = _cfg(8)
    cfg.tie_embeddings = tie
    params = dense.init_params(cfg, jax.random.key(0))
    held = engine.to_engine_layout(cfg, params, None, (4, 2))
    q = lambda p: np.asarray(p["layers"]["attn"]["q"]["kernel"])  # noqa: E731
    # P = 4, v = 2: one layer per virtual stage; device 0 holds rows 0-1 (layers 0 and 4), device 1
    # rows 2-3 (layers 1 and 5).
    np.testing.assert_array_equal(q(held)[1], q(params)[4])
    np.testing.assert_array_equal(q(held)[2], q(params)[1])
    jax.tree.map(np.testing.assert_array_equal, engine.to_model_layout(cfg, held, None, (4, 2)), params)
    with pytest.raises(ValueError, match="virtual_stages=3"):
        engine.to_engine_layout(cfg, params, None, (4, 3))


def _config(**pipeline):
    c = configs.base_config()
    c.model = _cfg(8)
    c.train.update(global_batch_size=8, microbatches=4)
    c.pipeline.update(stages=2, schedule="interleaved", **pipeline)
    return c


def test_config_checks():
    configs.validate(_config())
    cases = {
        "virtual_stages=1 must be an integer >= 2": dict(virtual_stages=1),
        "does not split into config.pipeline.stages=2 x config.pipeline.virtual_stages=3": dict(virtual_stages=3),
        "stage_layers .* cannot be combined": dict(stage_layers=(6, 2)),
    }
    for why, kw in cases.items():
        with pytest.raises(configs.ConfigError, match=why):
            configs.validate(_config(**kw))
    c = _config()
    c.train.microbatches = 3
    c.train.global_batch_size = 6
    with pytest.raises(configs.ConfigError, match="microbatches=3 must be a multiple of config.pipeline.stages=2"):
        configs.validate(c)
    c.train.microbatches = -1  # auto: the smallest multiple of P dividing the batch
    assert configs.resolve(c).train.microbatches == 2
    assert configs.interleave_of(_config()) == (2, 2)
    assert configs.interleave_of(_config(virtual_stages=4)) == (2, 4)


def test_resume_into_another_layer_order_is_refused(tmp_path):
    saved = _config()
    for now in (_config(virtual_stages=4), _config()):
        if configs.interleave_of(now) == configs.interleave_of(saved):
            _check_split(tmp_path, saved.to_dict(), now)  # the same order: allowed
            continue
        with pytest.raises(ResumeRefused, match="interleaved, 2 chunks per stage"):
            _check_split(tmp_path, saved.to_dict(), now)
    plain = _config()
    plain.pipeline.schedule = "1f1b"
    with pytest.raises(ResumeRefused, match="schedule=interleaved and virtual_stages=2"):
        _check_split(tmp_path, saved.to_dict(), plain)


# ------------------------------------------------------------------------------------------ plans


@pytest.mark.parametrize("P, M", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
@pytest.mark.parametrize("recompute", [True, False])
def test_plan_delivers_every_message(P, M, recompute):
    """Both placements deliver each message; the faster (paired, but for a tie at P = M = 2)
    reaches the program's event-driven path; its stash holds no more entries than the program's
    own order does."""
    program = programs.generate("interleaved", P, M)
    for paired in (False, True):
        _replay(slot_plan.compile_program(program, recompute, paired), recompute)
    plan = slot_plan.compile_program(program, recompute)
    assert plan.step_time() == programs.step_time(program)
    assert plan.step_time() < 3 * (M + 2 * P - 2)  # the sync tick table's path at B = 2F
    assert plan.held("stash") <= max(programs.stash_depth(program)) * program.chunks


def test_forward_only_program_with_chunks():
    """Eval's program: each (microbatch, chunk) once per device, in Megatron's groups of P; any M."""
    for P, M, v in ((2, 3, 2), (4, 8, 2), (4, 5, 3)):
        p = programs.validate(programs.forward_only(P, M, v))
        assert all(sorted((a.microbatch, a.chunk) for a in acts) == [(m, c) for m in range(M) for c in range(v)]
                   for acts in p.actions)
        plan = slot_plan.compile_program(p)
        assert (plan.column("b") == slot_plan.IDLE).all() and plan.held("stash") == 0


# ------------------------------------------------------------------------------------------ parity


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("P, M, recompute", [(2, 2, True), (4, 4, True),
                                             pytest.param(2, 4, False, marks=pytest.mark.slow)])
def test_interleaved_equals_simulate(P, M, recompute):
    cfg, data = _cfg(2 * P), batches(2, M, 2 * M)
    want, _ = run_simulate(cfg, make_opt("adamw"), data)
    got, metrics = run_pipeline(cfg, make_opt("adamw"), data, P, "interleaved", recompute=recompute,
                                virtual_stages=2)
    assert_params_close(engine.to_model_layout(cfg, got.params, None, (P, 2)), want.params)
    assert np.isfinite(metrics[-1]["loss"]) and metrics[-1]["loss_microbatches"] == M


@pytest.mark.slow
@pytest.mark.needs_devices(2)
def test_interleaved_bf16_equals_simulate():
    """As test_pipeline's bf16 transport test: the bound of a few bf16 roundings per gradient entry."""
    cfg, data = _cfg(4), batches(3, 4, 8, seed=10)
    cfg.compute_dtype = "bfloat16"
    lr = 0.5
    tx = optax.sgd(lr)
    want, want_m = run_simulate(cfg, tx, data)
    got, _ = run_pipeline(cfg, tx, data, 2, "interleaved", virtual_stages=2)
    tol = lr * len(data) * 8 * BF16_U * max(float(m["grad_norm"]) for m in want_m)
    assert_params_close(engine.to_model_layout(cfg, got.params, None, (2, 2)), want.params, rtol=0, atol=tol)


@pytest.mark.needs_devices(4)
def test_eval_equals_simulate():
    P, cfg = 2, _cfg(4)
    params = dense.init_params(cfg, jax.random.key(3))
    batch = jnp.asarray(np.random.default_rng(12).integers(0, 31, (8, T + 1)), jnp.int32)
    mesh1 = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    want = step_lib.make_eval_step(cfg, mesh1)(params, jax.device_put(batch, step_lib.eval_sharding(mesh1)))
    mesh = engine.make_pipeline_mesh(2, P)
    abstract = engine_shapes(cfg, (P, 2))
    sharded = jax.device_put(engine.to_engine_layout(cfg, params, None, (P, 2)),
                             jax.tree.map(lambda sp: NamedSharding(mesh, sp), engine.param_specs(abstract)))
    fn = engine.make_pipeline_eval_step(cfg, mesh, abstract, 2, engine_options("interleaved", P, P, virtual_stages=2))
    got = fn(sharded, jax.device_put(batch, NamedSharding(mesh, jax.sharding.PartitionSpec("data"))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


@pytest.mark.needs_devices(2)
def test_conditionals_per_slot():
    """As 1f1b's: three conds per slot (F, B, the last stage's fused B) and the nested embedding
    conds of F and B: 5 per slot; the chunk only changes their predicates."""
    cfg, data, M = _cfg(4), batches(1, 4, 8), 4
    mesh, tx = engine.make_pipeline_mesh(1, 2), make_opt("adamw")
    step = engine.make_pipeline_train_step(cfg, tx, SCHED, mesh, engine_shapes(cfg, (2, 2)),
                                           engine_options("interleaved", 2, M, virtual_stages=2))
    state = init_pipeline(cfg, tx, mesh, M, 8, "interleaved", interleave=(2, 2))
    batch = jax.device_put(data[0], engine.global_batch_sharding(mesh))
    plan = slot_plan.compile_program(programs.generate("interleaved", 2, M))
    assert census(jax.make_jaxpr(step)(state, batch)) == Census(5 * plan.slots, 0)


def test_the_config_refuses_a_mismatched_chunk_count():
    """The rule is checked once, by the config's validator; the engine relies on it."""
    c = _config(virtual_stages=1)
    with pytest.raises(configs.ConfigError, match="virtual_stages=1 must be an integer >= 2"):
        configs.validate(c)


def test_export_reads_the_interleaved_order_back():
    """``python -m asyncpp_jax.export`` turns a run's saved params into the model's layer order."""
    from asyncpp_jax import export
    c = _config(virtual_stages=4)
    params = dense.init_params(c.model, jax.random.key(1))
    held = engine.to_engine_layout(c.model, params, None, configs.interleave_of(c))
    assert not np.array_equal(held["layers"]["attn"]["q"]["kernel"], params["layers"]["attn"]["q"]["kernel"])
    jax.tree.map(np.testing.assert_array_equal, export.model_layout(c, held), params)


@pytest.mark.slow
@pytest.mark.needs_devices(4)
def test_interleaved_with_data_parallel_equals_one_device():
    cfg, data = _cfg(4), batches(2, 2, 8)
    want, _ = run_simulate(cfg, make_opt("adamw"), data, data_size=1)
    got, _ = run_pipeline(cfg, make_opt("adamw"), data, 2, "interleaved", data_size=2, virtual_stages=2)
    assert_params_close(engine.to_model_layout(cfg, got.params, None, (2, 2)), want.params)


@pytest.mark.slow
@pytest.mark.needs_devices(2)
def test_interleaved_moe_equals_simulate():
    """MoE every other layer: 8 layers are 4 scanned rows, one per virtual stage at P = 2, v = 2."""
    cfg = _cfg(8)
    cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.25)
    data = batches(3, 2, 4, seed=5)
    want, want_m = run_simulate(cfg, make_opt("adamw"), data)
    got, metrics = run_pipeline(cfg, make_opt("adamw"), data, 2, "interleaved", virtual_stages=2)
    assert_params_close(engine.to_model_layout(cfg, got.params, None, (2, 2)), want.params)
    assert metrics[-1]["loss"] == pytest.approx(float(want_m[-1]["loss"]), rel=1e-5)


def test_the_layout_refuses_an_uneven_split_with_chunks():
    cfg = _cfg(8)
    params = dense.init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="cannot be combined"):
        engine.to_engine_layout(cfg, params, (3, 1), (2, 2))
