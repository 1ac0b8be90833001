"""What a pipeline run carries between steps (:class:`PipelineState`, flushless programs only), and
where every part of a pipeline ``TrainState`` lives on the mesh."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.models.moe import with_expert_parallel
from asyncpp_jax.optim.prediction import WeightPredictionState
from asyncpp_jax.pipeline.collectives import vary
from asyncpp_jax.pipeline.options import EngineOptions
from asyncpp_jax.pipeline.schedules.programs import Offsets
from asyncpp_jax.pipeline.layout import DEVICE, local_over_data, param_specs, partial_specs, update_specs
from asyncpp_jax.pipeline.stage import StageFns, residual_shapes, save_shapes, split_params, stat_names
from asyncpp_jax.train_state import BATCH_SPEC, TrainState, from_host


class PipelineState(NamedTuple):
    """What crosses ``train_step`` calls under a flushless program (``2bw``, ``pipedream``; a
    flushed one carries nothing): everything a batch in flight still needs, so a checkpoint holds it.

    Each tensor is held once: the weight versions are sharded like the parameters, the partial
    gradients like the update (reduced over ``stage`` at the end of each step), with each data
    replica's own (:func:`partial_specs`: it is reduced over ``data`` once, with the rest of its
    batch), and the activation state is per device because every device's is different.
    """

    weight_versions: tuple  # w[t-1], ..., w[t-D]: the versions the batches in flight read (D: the delay)
    stash: list  # per entry [D, P, S, ...]: stage inputs (recompute) or residuals awaiting their backward
    fwd_buf: jax.Array  # [D, P, S, b, T, d]: activations received from the previous stage (compute dtype)
    bwd_buf: jax.Array  # [D, P, S, b, T, d]: cotangents received from the next stage (compute dtype)
    # grad_partial[a]: what later steps' updates (offset a + 1 from the step that made it) have so
    # far, [data, ...] per replica (partial_specs), for the leaf groups that reach that offset
    grad_partial: tuple
    stats_partial: tuple  # the loss sums of those updates so far (``count``: their finished microbatches)
    batches: jax.Array  # [D, M, B, T+1]: the tokens of batches t-1, ..., t-D (the stages still need them)
    prediction: Any = None  # optim.WeightPredictionState (δ, sharded like the params) with weight prediction


def ring_shapes(model_cfg, mesh, params_abstract, microbatch_rows: int, seq_len: int, recompute: bool,
                 expert_parallel: bool, stage_rows: tuple | None = None, split: bool = False,
                 ring: str = "stash") -> list:
    """Per-device shapes of one entry of the stash (``ring='stash'``) or, for a split backward
    (``split``, zb-h1), of the ``save`` ring an ``I`` fills for its ``W`` (``ring='save'``), traced on
    the mesh (an MoE block's all_to_all needs it)."""
    fns = StageFns(model_cfg, 1, recompute, stage_rows, split=split)
    act = jax.ShapeDtypeStruct((microbatch_rows, seq_len, model_cfg.d_model), dense.dtype_of(model_cfg.compute_dtype))
    entry = save_shapes if ring == "save" else residual_shapes

    def local(layers, x):
        shapes = entry(fns, dense.compute_view(model_cfg, vary({"layers": layers}))["layers"], vary(x))
        return [vary(jnp.zeros(sh.shape, sh.dtype))[None, None] for sh in shapes]

    layer_specs = param_specs(params_abstract, expert_parallel)["layers"]
    out = jax.eval_shape(jax.shard_map(local, mesh=mesh, in_specs=(layer_specs, P()), out_specs=DEVICE),
                         params_abstract["layers"], act)
    return [jax.ShapeDtypeStruct(o.shape[2:], o.dtype) for o in out]


def init_pipeline_state(model_cfg, params, mesh, global_batch: int, seq_len: int, options: EngineOptions):
    """The in-flight state of a fresh run of the options' program: ``None`` for a flushed one
    (nothing crosses steps).  ``params`` in the engine's layout (padded by :func:`pad_layers` when
    ``options.stage_rows`` is set)."""
    plan, program = options.plan, options.program
    if not program.flushless:
        return None
    expert_parallel, weight_prediction = options.expert_parallel, options.weight_prediction
    data, n_stages, M, D = mesh.shape["data"], mesh.shape["stage"], program.microbatches, program.delay
    if expert_parallel:
        model_cfg = with_expert_parallel(model_cfg, "data", data)
    b = global_batch // M // data
    depth = plan.depth
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    entry = ring_shapes(model_cfg, mesh, abstract, b, seq_len, options.recompute, expert_parallel,
                        options.stage_rows)
    act = lambda n: jnp.zeros((data, n_stages, n, b, seq_len, model_cfg.d_model),  # noqa: E731
                              dense.dtype_of(model_cfg.compute_dtype))
    offsets = Offsets.of(program, model_cfg.tie_embeddings)

    def partial(a):
        return {g: jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.zeros((data,) * local_over_data(path, expert_parallel) + x.shape, jnp.float32), v)
            for g, v in params.items() if offsets.count(g) > a}

    return PipelineState(
        weight_versions=tuple(jax.tree.map(jnp.copy, params) for _ in range(D)),
        stash=[jnp.zeros((data, n_stages, depth["stash"]) + e.shape, e.dtype) for e in entry],
        fwd_buf=act(depth["fwd"]), bwd_buf=act(depth["bwd"]),
        grad_partial=tuple(partial(a) for a in range(1, offsets.carried + 1)),
        stats_partial=tuple({k: jnp.zeros((), jnp.float32) for k in stat_names(model_cfg)}
                            for _ in range(offsets.carried)),
        batches=jnp.zeros((D, M, global_batch // M, seq_len + 1), jnp.int32),
        prediction=weight_prediction.init(params) if weight_prediction is not None else None,
    )


def pipeline_state_specs(params, pstate: PipelineState | None, options: EngineOptions):
    """Where each part of the in-flight state lives (None: a flushed program carries none)."""
    if pstate is None:
        return None
    expert_parallel, vocab_parallel = options.expert_parallel, options.vocab_parallel
    n_stages = pstate.fwd_buf.shape[1]
    pspecs = param_specs(params, expert_parallel, vocab_parallel)
    partial = partial_specs(params, n_stages, expert_parallel, vocab_parallel)
    return PipelineState(
        weight_versions=tuple(pspecs for _ in pstate.weight_versions), stash=[DEVICE] * len(pstate.stash),
        fwd_buf=DEVICE, bwd_buf=DEVICE, grad_partial=tuple({g: partial[g] for g in p} for p in pstate.grad_partial),
        stats_partial=tuple({k: P() for k in s} for s in pstate.stats_partial), batches=P(None, None, "data"),
        prediction=None if pstate.prediction is None else WeightPredictionState(
            count=P(), velocity=param_specs(params, expert_parallel, vocab_parallel)))


def state_shardings(state, mesh, params_abstract, options: EngineOptions):
    """NamedShardings for a (possibly abstract) pipeline TrainState: layers and their optimizer
    moments over ``stage`` (experts also over ``data`` with expert parallelism), the in-flight
    state per device, the rest replicated."""
    expert_parallel, vocab_parallel = options.expert_parallel, options.vocab_parallel
    shard = functools.partial(NamedSharding, mesh)
    pspecs = param_specs(params_abstract, expert_parallel, vocab_parallel)
    n_layers = {x.shape[0] for x in jax.tree.leaves(params_abstract["layers"])}.pop()
    # Optimizer moments mirror their params' shapes: an expert-shaped moment is sharded like the
    # experts, a replicated leaf's like its update (split over stage), a stacked-layer one like the layers.
    expert_shapes = {tuple(x.shape) for x, sp in zip(jax.tree.leaves(params_abstract), jax.tree.leaves(pspecs))
                     if "data" in tuple(sp)}
    _, top = split_params(params_abstract)
    top_specs = split_params(update_specs(params_abstract, mesh.shape["stage"], expert_parallel, vocab_parallel))[1]
    top_shapes = {tuple(x.shape): sp for x, sp in zip(jax.tree.leaves(top), jax.tree.leaves(top_specs))}

    def opt_leaf(x):
        if tuple(x.shape) in expert_shapes:
            return shard(P("stage", "data"))
        if tuple(x.shape) in top_shapes:
            return shard(top_shapes[tuple(x.shape)])
        stacked = len(x.shape) >= 2 and x.shape[0] == n_layers
        return shard(P("stage") if stacked else P())

    return TrainState(step=shard(P()), params=jax.tree.map(shard, pspecs),
                      opt_state=jax.tree.map(opt_leaf, state.opt_state),
                      runner_state=jax.tree.map(shard, pipeline_state_specs(params_abstract, state.runner_state, options)))


def place_state(state: TrainState, mesh, params_abstract, options: EngineOptions) -> TrainState:
    """Put a fresh state, which every process holds whole, on the pipeline mesh (layers over
    ``stage``); in a job of several processes each one supplies only its own devices' shards."""
    return jax.tree.map(from_host, state_shardings(state, mesh, params_abstract, options), state)


def global_batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, BATCH_SPEC)
