"""An uneven layer split for the pipeline engine (``config.pipeline.stage_layers``).

The engine holds the layer stack padded to ``[P * Lmax, ...]`` (``engine.pad_layers``, part of
``engine.to_engine_layout``, which also holds a tied table as the head's ``[D, V]``); the
contract is parity with the simulate runner on the unpadded params (as tests/test_pipeline.py, at
its 2e-5 tolerance) and padding rows that stay exactly zero through training.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax import configs
from asyncpp_jax import train_state as state_lib
from asyncpp_jax.models import dense
from asyncpp_jax.optim import build_optimizer, delay
from asyncpp_jax.pipeline import stage
from asyncpp_jax.pipeline.spmd import engine
from test_pipeline import SCHED, T, assert_params_close, engine_options, batches, make_opt, model_cfg, run_simulate


def with_nan_padding(params, rows):
    """``params`` (padded) with every padded row NaN: a slot that read one would spread it."""
    real = engine.pad_layers(jax.tree.map(jnp.ones_like, engine.unpad_layers(params, rows)), rows)
    layers = jax.tree.map(lambda x, r: jnp.where(r == 1, x, jnp.nan), params["layers"], real["layers"])
    return {**params, "layers": layers}


def run_split(cfg, tx, data, P, schedule, stage_layers, recompute=True, poison=False, nan_padding=False):
    """``(final state, metrics)`` of the engine with ``stage_layers``; the state is padded."""
    rows = engine.stage_split(cfg, P, stage_layers)
    M, B = data[0].shape[0], data[0].shape[0] * data[0].shape[1]
    mesh = engine.make_pipeline_mesh(1, P)
    abstract = jax.eval_shape(engine.engine_layout(cfg, rows), dense.abstract_params(cfg))
    options = engine_options(schedule, P, M, recompute=recompute, stage_rows=rows)
    step = engine.make_pipeline_train_step(cfg, tx, SCHED, mesh, abstract, options)
    params = engine.to_engine_layout(cfg, dense.init_params(cfg, jax.random.key(0)), rows)
    if nan_padding:
        params = with_nan_padding(params, rows)
    state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    ps = engine.init_pipeline_state(cfg, params, mesh, B, T, options)
    if poison and ps is not None:  # in-flight buffers a bubble slot could read: NaN
        ps = ps._replace(**{k: jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), getattr(ps, k))
                            for k in ("stash", "fwd_buf", "bwd_buf")})
    state = engine.place_state(state.replace(runner_state=ps), mesh, abstract, options)
    metrics = []
    for b in data:
        state, m = step(state, jax.device_put(b, engine.global_batch_sharding(mesh)))
        metrics.append(jax.device_get(m))
    return state, metrics, rows


def assert_padding_zero(params, rows):
    for path, x in jax.tree_util.tree_leaves_with_path(engine.padding_of(params, rows)):
        assert x.size > 0 and not np.any(np.asarray(x)), jax.tree_util.keystr(path)


# ------------------------------------------------------------------------------------ layout


def test_pad_unpad_round_trip_and_layout():
    cfg = model_cfg()
    params = dense.init_params(cfg, jax.random.key(0))
    rows = engine.stage_split(cfg, 4, (2, 1, 0, 1))
    assert rows == (2, 1, 0, 1)
    padded = engine.pad_layers(params, rows)
    leaf, big = params["layers"]["attn"]["q"]["kernel"], padded["layers"]["attn"]["q"]["kernel"]
    assert big.shape == (8,) + leaf.shape[1:]
    for s, want in zip(range(4), [[0, 1], [2], [], [3]]):  # stage s: rows [2s, 2s + n_s)
        np.testing.assert_array_equal(big[2 * s:2 * s + len(want)], leaf[np.asarray(want, int)])
    assert_padding_zero(padded, rows)
    back = engine.unpad_layers(padded, rows)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    # An even split, given or not, is today's layout.
    assert engine.stage_split(cfg, 2, (2, 2)) is None and engine.stage_split(cfg, 2, ()) is None
    assert engine.pad_layers(params, None) is params


@pytest.mark.parametrize("tie", [True, False])
def test_engine_layout_round_trip_and_the_tied_table_as_the_head(tie):
    """The engine's layout pads the stack and holds a tied table as the head's [D, V] matrix (an
    untied model's leaves keep their shapes); to_model_layout undoes both exactly."""
    cfg = model_cfg()
    cfg.tie_embeddings = tie
    params = dense.init_params(cfg, jax.random.key(0))
    rows = engine.stage_split(cfg, 4, (2, 1, 0, 1))
    held = engine.to_engine_layout(cfg, params, rows)
    table = params["embed"]["embedding"]
    assert held["embed"]["embedding"].shape == (table.shape[::-1] if tie else table.shape)
    if tie:
        np.testing.assert_array_equal(held["embed"]["embedding"], table.T)
        np.testing.assert_array_equal(stage.head_of(cfg, held)["w"], dense.head_params(cfg, params)["w"])
    tokens = jnp.asarray([[3, 0, 30], [7, 7, 1]], jnp.int32)
    np.testing.assert_array_equal(stage.lookup(cfg, held, tokens), dense.embed(cfg, params, tokens))
    jax.tree.map(np.testing.assert_array_equal, engine.to_model_layout(cfg, held, rows), params)
    assert held["layers"]["attn"]["q"]["kernel"].shape[0] == 8


@pytest.mark.needs_devices(2)
def test_engine_refuses_params_in_the_model_layout():
    cfg = model_cfg()
    with pytest.raises(ValueError, match=r"tied embedding table as the head's \[d_model, vocab\] = \(16, 31\).*"
                                         r"engine.to_engine_layout"):
        engine.make_pipeline_train_step(cfg, optax.adamw(1e-3), SCHED, engine.make_pipeline_mesh(1, 2),
                                        dense.abstract_params(cfg), engine_options("sync", 2, 2))


def test_stage_split_rejects_bad_splits():
    cfg = model_cfg()
    for bad in [(3, 2), (4,), (5, -1)]:
        with pytest.raises(ValueError, match=r"config.pipeline.stage_layers"):
            engine.stage_split(cfg, 2, bad)


# ------------------------------------------------------------------------------------------ parity


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("schedule, recompute", [("sync", True), ("2bw", False),
                                                 pytest.param("sync", False, marks=pytest.mark.slow),
                                                 pytest.param("2bw", True, marks=pytest.mark.slow)])
def test_uneven_split_equals_simulate_two_stages(schedule, recompute):
    cfg, data = model_cfg(), batches(3, 2, 4, seed=1)
    want, _ = run_simulate(cfg, make_opt("adamw") if schedule == "sync" else optax.chain(delay(1), make_opt("adamw")),
                           data)
    got, metrics, rows = run_split(cfg, make_opt("adamw"), data, 2, schedule, (3, 1), recompute=recompute)
    assert_params_close(engine.to_model_layout(cfg, got.params, rows), want.params)
    assert_padding_zero(got.params, rows)
    assert np.isfinite(metrics[-1]["loss"])


@pytest.mark.slow
@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("schedule", ["sync", "2bw", "1f1b"])
@pytest.mark.parametrize("recompute", [True, False])
def test_uneven_split_equals_simulate_four_stages(schedule, recompute):
    """P = 4 with an empty third stage and a last stage of one layer; (1, 1, 1, 0) below covers a
    last stage that runs only the final norm, head and loss."""
    cfg, data = model_cfg(), batches(3, 6, 6, seed=2)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")) if schedule == "2bw" else make_opt("adamw"),
                           data)
    got, _, rows = run_split(cfg, make_opt("adamw"), data, 4, schedule, (2, 1, 0, 1), recompute=recompute)
    assert_params_close(engine.to_model_layout(cfg, got.params, rows), want.params)
    assert_padding_zero(got.params, rows)


@pytest.mark.needs_devices(4)
def test_head_only_last_stage_equals_simulate():
    """The last stage holds no layer (only final norm, head and loss); 2bw, kept residuals, NaN in
    the in-flight buffers that bubble slots could read."""
    cfg, data = model_cfg(), batches(3, 6, 6, seed=3)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data)
    got, _, rows = run_split(cfg, make_opt("adamw"), data, 4, "2bw", (1, 2, 1, 0), recompute=False, poison=True)
    assert_params_close(engine.to_model_layout(cfg, got.params, rows), want.params)
    assert_padding_zero(got.params, rows)


@pytest.mark.slow
@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("recompute", [True, False])
def test_moe_uneven_split_equals_simulate(recompute):
    """MoE layers grouped in pairs (``moe.every = 2``: two groups), both on stage 0: the last stage
    runs only the head; the aux losses come from the real groups only."""
    cfg = model_cfg()
    cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.25)
    data = batches(4, 2, 4, seed=5)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data)
    got, metrics, rows = run_split(cfg, make_opt("adamw"), data, 2, "2bw", (4, 0), recompute=recompute)
    assert rows == (2, 0)
    assert_params_close(engine.to_model_layout(cfg, got.params, rows), want.params)
    assert_padding_zero(got.params, rows)
    assert metrics[-1]["moe_lb_loss"] > 0


@pytest.mark.slow
@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("recompute", [True, False])
def test_nan_in_padding_never_reaches_the_real_layers(recompute):
    """Padded rows filled with NaN: no slot reads them (forward, backward, fused last slot), so the
    real layers train exactly as with zero padding, and the NaN stays in its rows."""
    cfg, data = model_cfg(), batches(3, 6, 6, seed=3)
    want, _ = run_simulate(cfg, optax.chain(delay(1), make_opt("adamw")), data)
    got, _, rows = run_split(cfg, make_opt("adamw"), data, 4, "2bw", (2, 1, 0, 1), recompute=recompute,
                             nan_padding=True)
    assert_params_close(engine.to_model_layout(cfg, got.params, rows), want.params)
    assert all(np.all(np.isnan(np.asarray(x))) for x in jax.tree.leaves(engine.padding_of(got.params, rows)))


@pytest.mark.needs_devices(2)
@pytest.mark.slow  # the even split's code path is the default one, which every parity test runs
def test_explicit_even_split_equals_default():
    cfg, data = model_cfg(), batches(2, 2, 4)
    from test_pipeline import run_pipeline
    want, _ = run_pipeline(cfg, make_opt("adamw"), data, 2, "2bw")
    got, _, rows = run_split(cfg, make_opt("adamw"), data, 2, "2bw", (2, 2))
    assert rows is None
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got.params), jax.device_get(want.params))


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("P, split", [(2, (3, 1)), (4, (2, 1, 0, 1))])
def test_eval_step_with_uneven_split_equals_simulate(P, split):
    cfg = model_cfg()
    rows = engine.stage_split(cfg, P, split)
    params = dense.init_params(cfg, jax.random.key(0))
    mesh = engine.make_pipeline_mesh(1, P)
    padded = with_nan_padding(engine.to_engine_layout(cfg, params, rows), rows)  # never read: the loss stays finite
    abstract = jax.eval_shape(lambda p: p, padded)
    eval_step = engine.make_pipeline_eval_step(cfg, mesh, abstract, 2, engine_options("sync", P, 4, stage_rows=rows))
    batch = batches(1, 4, 8, seed=5)[0].reshape(8, T + 1)
    total, count = eval_step(padded, batch)
    logits = dense.Decoder(cfg).apply({"params": params}, batch[:, :-1])
    lse = jax.nn.logsumexp(logits, axis=-1)
    want = jnp.sum(lse - jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0])
    assert float(count) == batch[:, 1:].size
    np.testing.assert_allclose(float(total), float(want), rtol=2e-5)


# -------------------------------------------------------------------- padding stays zero


@pytest.mark.needs_devices(2)
# Lion and MARS: elementwise like AdamW and Adan, which run by default.
@pytest.mark.parametrize("name", ["adamw", "muon", "soap", "adan", pytest.param("lion", marks=pytest.mark.slow),
                                  pytest.param("mars", marks=pytest.mark.slow)])
def test_padding_stays_zero_with_every_optimizer(name):
    """Zero gradient on a zero row gives a zero update with each optimizer of the factory, with
    weight decay, error feedback and (under 2bw) weight prediction, built on the padded shapes."""
    c = configs.base_config()
    c.model = model_cfg()
    c.optimizer.name = name
    c.optimizer.weight_decay = 0.1
    c.pipeline.update(stages=2, schedule="2bw", stage_layers=(3, 1))
    c.staleness.update(mode="2bw", mitigation="ef", weight_prediction=True)
    configs.validate(c)
    rows = engine.stage_split(c.model, 2, c.pipeline.stage_layers)
    shapes = jax.eval_shape(engine.engine_layout(c.model, rows), dense.abstract_params(c.model))
    staleness = configs.effective_staleness(c)
    from asyncpp_jax.optim import weight_prediction, delay_schedule
    tx, schedule = build_optimizer(c.optimizer, 4, staleness, shapes, delay_in_chain=False)
    data = batches(4, 2, 4, seed=6)
    mesh = engine.make_pipeline_mesh(1, 2)
    prediction = weight_prediction(staleness, 4)
    options = engine_options("2bw", 2, 2, delay_schedule(staleness, 4), prediction=prediction, stage_rows=rows)
    step = engine.make_pipeline_train_step(c.model, tx, schedule, mesh, shapes, options)
    params = engine.to_engine_layout(c.model, dense.init_params(c.model, jax.random.key(0)), rows)
    state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    ps = engine.init_pipeline_state(c.model, params, mesh, 4, T, options)
    state = engine.place_state(state.replace(runner_state=ps), mesh, shapes, options)
    before = jax.device_get(engine.unpad_layers(state.params, rows))
    for b in data:
        state, m = step(state, jax.device_put(b, engine.global_batch_sharding(mesh)))
    assert np.isfinite(float(m["loss"]))
    assert_padding_zero(state.params, rows)
    after = jax.device_get(engine.unpad_layers(state.params, rows))
    assert np.max(np.abs(after["layers"]["attn"]["q"]["kernel"] - before["layers"]["attn"]["q"]["kernel"])) > 0


# ----------------------------------------------------------------- the runner, trainer, resume


def test_runner_pads_builds_the_optimizer_on_padded_shapes_and_states_the_cost():
    from asyncpp_jax.models import count_params
    from asyncpp_jax.train import runner as runner_lib
    from asyncpp_jax.train.dry_run import _layer_padding
    c = configs.base_config()
    c.model = model_cfg()
    c.pipeline.update(stages=2, schedule="sync", stage_layers=(3, 1))
    c.train.update(global_batch_size=4, microbatches=2)
    c = configs.resolve(c)
    configs.validate(c)
    r = runner_lib.build(c, jax.devices()[:2])
    assert r.stage_rows == (3, 1)
    assert jax.tree.leaves(r.shapes["layers"])[0].shape[0] == 6
    assert count_params(r.model_shapes) == count_params(dense.abstract_params(c.model))
    state = jax.eval_shape(r.init_fn(), jax.random.key(0))
    opt_rows = {x.shape[0] for x in jax.tree.leaves(state.opt_state) if x.ndim >= 2 and x.shape[0] in (4, 6)}
    assert opt_rows == {6}  # the moments mirror the padded stack
    pad = _layer_padding(r)
    assert pad["stage_rows"] == [3, 1] and pad["fraction"] == pytest.approx((2 * 3 - 4) / 4)
    # Same key, same real weights as the simulate runner's init (both jitted: XLA's fusion moves the last bit).
    real = engine.to_model_layout(c.model, jax.jit(r.init_fn())(jax.random.key(0)).params, r.stage_rows)
    want = jax.jit(lambda k: dense.init_params(c.model, k))(jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(real), jax.device_get(want))


@pytest.mark.slow
@pytest.mark.needs_devices(2)
def test_trainer_resumes_an_uneven_split_and_refuses_another(cache_dir, tmp_path, caplog):
    """(2, 0): the last stage holds only the head and loss.  (0, 2) pads to the same shapes, so the
    checkpoint layout alone would restore it: the split itself is checked."""
    import logging

    from asyncpp_jax.models import count_params
    from asyncpp_jax.train.resume import ResumeRefused
    from asyncpp_jax.train.trainer import Trainer
    from helpers import small_train_config
    cfg = small_train_config(cache_dir, "split", 1, steps=4, microbatches=2, eval_every=4, eval_batches=2,
                             checkpoint_every=2)
    cfg.pipeline.update(stages=2, schedule="2bw", stage_layers=(2, 0))
    caplog.set_level(logging.INFO)
    first = Trainer(cfg, tmp_path / "run")
    assert first.run(until_step=2).status == "paused"
    first.close()
    assert f"{count_params(dense.abstract_params(cfg.model)):,} parameters" in caplog.text
    other = cfg.copy_and_resolve_references()
    other.pipeline.stage_layers = (0, 2)
    with pytest.raises(ResumeRefused, match=r"config.pipeline.stage_layers"):
        Trainer(other, tmp_path / "run")
    t = Trainer(cfg, tmp_path / "run")
    assert t.run().step == 4
    t.close()
    assert_padding_zero(t.state.params, (2, 0))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(t.state.params))


@pytest.mark.parametrize("moe", [False, True])
def test_the_stash_holds_no_weights(moe):
    """Kept residuals (``recompute=False``): the stash holds the block's activations, not its weights
    (the backward puts the microbatch's weight version back, ``stage.ResidualTemplate``).  Nothing
    in it but scalars keeps its size when the microbatch changes: no weight matrix, and no norm's
    scale either (``layers.scale_last`` keeps the weight row itself, which the template reads back)."""
    cfg = model_cfg()
    cfg.update(d_model=24, n_heads=4, n_kv_heads=2, d_ff=40, n_layers=2)
    if moe:
        cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.25)
    layers = dense.abstract_params(cfg)["layers"]
    fns = stage.StageFns(cfg, microbatches=4, recompute=False)
    small, large = (stage.residual_shapes(fns, layers, jax.ShapeDtypeStruct((b, 7, 24), jnp.float32)) for b in (3, 5))
    assert len(small) == len(large) and len(small) > 3
    fixed = [r.shape for r, r2 in zip(small, large) if r.shape == r2.shape]
    # Under MoE the router's per-expert statistics, [MoE layers, E], are data (no weight has that shape).
    n_moe = cfg.n_layers // cfg.moe.every if moe else 0
    allowed = {()} | ({(n_moe, cfg.moe.num_experts)} if moe else set())
    assert {w.shape for w in jax.tree.leaves(layers)}.isdisjoint(allowed - {()})
    assert all(s in allowed for s in fixed), fixed
