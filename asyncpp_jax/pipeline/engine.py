"""The ``pipeline`` runner: one ``jax.shard_map`` over ``('data', 'stage')``, a ``lax.scan`` over ticks.

Stage ``s`` holds layers ``[s L/P, (s+1) L/P)`` (the stacked layer leaves are sharded on their
leading axis over ``stage``); the embedding, final norm and head are replicated, but only stage 0
runs the embedding and only stage ``P-1`` the final norm, head and loss
(:mod:`asyncpp_jax.pipeline.stage` says what each slot computes).  The params are held in the
engine's layout (:func:`to_engine_layout`): a tied embedding table as the head's ``[D, V]`` matrix,
so nothing vocabulary-sized is ever transposed.

An uneven split, ``config.pipeline.stage_layers = (L_0, ..., L_{P-1})`` (:func:`stage_split`), gives
stage ``s`` ``L_s`` layers, e.g. fewer to the last stage, which also runs the head and loss.  SPMD
needs one shape per device, so the stacked leaves are held padded to ``[P Lmax, ...]``
(:func:`pad_layers`; ``Lmax = max L_s``): stage ``s``'s rows ``[s Lmax, s Lmax + L_s)`` are its
layers, the rest zeros.  A padded row computes nothing in any slot (forward, backward with or
without recompute, the fused last slot, eval: ``dense.apply_layers_with_aux``'s ``live``), gets an
exactly zero gradient, and so stays zero under every optimizer (zero gradient, zero weight: zero
update).  The padding costs ``(P Lmax - L) / L`` of the layer stack over the mesh (params,
optimizer moments, the ``2bw`` weight version), nothing per device beyond the largest stage.

Per tick (:mod:`asyncpp_jax.pipeline.tick_tables` says which microbatch), each stage runs a
forward slot and a backward slot, each under a ``lax.cond`` on whether the tick table gives it
work: an idle slot computes nothing (and so cannot let a NaN through).  Activations go to
``s+1`` and input cotangents to ``s-1`` with ``lax.ppermute`` once per tick.  With
``recompute`` the backward slot recomputes the stage's block from its stashed input; without,
the forward slot stashes the block's autodiff residuals.  The last stage's forward and backward
of a microbatch share a tick and run as one fused ``vjp``.  Activations, cotangents and the stash
are in ``compute_dtype``, as in the simulate runner.

``sync`` flushes each step: the gradient of batch ``t`` at ``w[t]`` is applied at update ``t``,
as in the ``simulate`` runner; a step costs ``(M + P - 1)(F + B)``, a textbook 1F1B with flush.
``2bw`` never flushes (:class:`~asyncpp_jax.pipeline.tick_tables.OneStepDelay`, beside the
tick tables, is where its delay lives): the stash ring, the
activations and cotangents in transit, the in-flight batch's partial gradient and loss sums, the
previous weight version and the previous batch's tokens live in :class:`PipelineState` (so they
are checkpointed), and update ``t`` applies the gradient of batch ``t-1`` taken at ``w[t-1]``:
``optim.delay``'s conventions exactly (fill at the first delayed update, in-flight batch dropped
at a cooldown switch).  The logged loss of update ``t`` is that batch's loss at those weights.
The optimizer chain has no ``delay`` transform; mitigations (error feedback) follow the same
schedule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.models.moe import is_expert_weight, with_expert_parallel
from asyncpp_jax.optim.prediction import WeightPrediction, WeightPredictionState
from asyncpp_jax.optim.staleness import DelaySchedule
from asyncpp_jax.pipeline import tick_tables
from asyncpp_jax.pipeline.tick_tables import OneStepDelay
from asyncpp_jax.pipeline.stage import (ResidualTemplate, StageFns, head_of, join_params, lookup, residual_shapes,
                                        split_params, stat_names)
from asyncpp_jax.train_state import BATCH_SPEC, TrainState, apply_update, from_host

DEVICE = P("data", "stage")  # per-device in-flight state: leading [data, stage] axes


def make_pipeline_mesh(data: int, stages: int, devices=None) -> jax.sharding.Mesh:
    """A ``('data', 'stage')`` mesh.  Auto axes: the optimizer update outside the ``shard_map``
    is partitioned by XLA (each stage updates its own layer shard)."""
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < data * stages:
        raise ValueError(
            f"config.mesh.data={data} x config.pipeline.stages={stages} needs {data * stages} devices, "
            f"found {len(devices)}; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{data * stages} before JAX starts (python -m asyncpp_jax.main does).")
    return jax.make_mesh((data, stages), ("data", "stage"), axis_types=(AxisType.Auto,) * 2,
                         devices=devices[: data * stages])


def param_specs(params, expert_parallel: bool = False) -> Any:
    """``layers/...`` sharded on the leading (layer) axis over ``stage``, routed experts also on
    their expert axis over ``data`` with ``expert_parallel``; the rest replicated."""

    def spec(path, _):
        if path[0].key != "layers":
            return P()
        return P("stage", "data") if expert_parallel and is_expert_weight(path) else P("stage")

    return jax.tree_util.tree_map_with_path(spec, params)


def update_specs(params, n_stages: int, expert_parallel: bool = False) -> Any:
    """Where each leaf's gradient, optimizer state and update live: as :func:`param_specs`, except
    that each replicated leaf (embedding, head, final norm) is split over ``stage`` along its first
    axis divisible by ``P``.  Its gradient then arrives reduce-scattered and the optimizer updates
    it once over the mesh, not once per device (ZeRO-1 for the leaves every stage holds); only the
    new weights are gathered.  A leaf with no divisible axis stays replicated."""
    layer_specs = param_specs(params, expert_parallel)

    def spec(path, x, layer_spec):
        if path[0].key == "layers":
            return layer_spec
        for axis, n in enumerate(x.shape):
            if n % n_stages == 0:
                return P(*([None] * axis + ["stage"]))
        return P()

    return jax.tree_util.tree_map_with_path(spec, params, layer_specs)


def _local_over_data(path, expert_parallel: bool) -> bool:
    """Whether a leaf's in-flight partial gradient is held per data replica: every leaf but an
    expert weight under ``expert_parallel`` (never reduced over ``data``; its layout already is)."""
    return not (expert_parallel and is_expert_weight(path))


def partial_specs(params, n_stages: int, expert_parallel: bool = False) -> Any:
    """Where 2bw's in-flight partial gradient lives: reduced over ``stage`` (laid out as
    :func:`update_specs`) but not over ``data``, so a leading ``data`` axis holds each replica's
    own.  It joins its tail at the next step and the whole gradient is reduced over ``data`` once."""
    def spec(path, _, u):
        return P("data", *u) if _local_over_data(path, expert_parallel) else u

    return jax.tree_util.tree_map_with_path(spec, params, update_specs(params, n_stages, expert_parallel))


def _on_data_axis(tree, expert_parallel: bool, add: bool):
    """Inside ``shard_map``: add (or strip) the per-replica ``data`` axis of :func:`partial_specs`."""
    def one(path, x):
        if not _local_over_data(path, expert_parallel):
            return x
        return x[None] if add else x[0]

    return jax.tree_util.tree_map_with_path(one, tree)


# ------------------------------------------------------------------------------------------
# Uneven splits: ``config.pipeline.stage_layers``.  SPMD needs one shape on every device, so the
# stacked layer leaves are held padded to ``[P * Lmax, ...]`` (``Lmax`` the largest stage's rows):
# stage ``s`` owns rows ``[s Lmax, (s+1) Lmax)``, of which the first ``stage_rows[s]`` are its
# layers and the rest zeros that no slot ever runs (``dense.apply_layers_with_aux``'s ``live``).
# ------------------------------------------------------------------------------------------


def stage_split(model_cfg, n_stages: int, stage_layers) -> tuple | None:
    """``config.pipeline.stage_layers`` (layers per stage, summing to ``n_layers``) -> rows of the
    stacked layer axis per stage (``moe.every`` layers a row when MoE layers are grouped), or
    ``None`` for the even split (empty, or every stage equal: today's unpadded layout)."""
    if stage_layers is None or len(stage_layers) == 0:
        return None
    stage_layers = tuple(int(n) for n in stage_layers)
    unit = model_cfg.n_layers // dense.scan_length(model_cfg)
    if (len(stage_layers) != n_stages or sum(stage_layers) != model_cfg.n_layers
            or any(n < 0 or n % unit for n in stage_layers)):
        raise ValueError(
            f"config.pipeline.stage_layers={stage_layers} must give each of the config.pipeline.stages={n_stages} "
            f"stages a non-negative number of layers (a multiple of {unit}, the scanned unit) summing to "
            f"config.model.n_layers={model_cfg.n_layers}.")
    rows = tuple(n // unit for n in stage_layers)
    return None if len(set(rows)) == 1 else rows


def _pad_index(stage_rows: tuple) -> tuple[np.ndarray, int]:
    """``(dst, P * Lmax)``: row ``i`` of the model's stack sits at row ``dst[i]`` of the padded one."""
    lmax = max(stage_rows)
    dst = np.concatenate([s * lmax + np.arange(n) for s, n in enumerate(stage_rows)]).astype(np.int32)
    return dst, lmax * len(stage_rows)


def pad_layers(params, stage_rows: tuple | None):
    """The model's params -> the engine's layout: each stacked layer leaf ``[L, ...]`` becomes
    ``[P * Lmax, ...]`` with stage ``s``'s layers at rows ``[s Lmax, s Lmax + stage_rows[s])`` and
    exact zeros elsewhere.  Identity for ``None``.  Works on abstract shapes under ``jax.eval_shape``."""
    if stage_rows is None:
        return params
    dst, rows = _pad_index(stage_rows)
    pad = lambda x: jnp.zeros((rows,) + x.shape[1:], x.dtype).at[dst].set(x)  # noqa: E731
    return join_params(jax.tree.map(pad, params["layers"]), split_params(params)[1])


def unpad_layers(params, stage_rows: tuple | None):
    """Inverse of :func:`pad_layers`: the engine's params (or a tree laid out like them) -> the model's."""
    if stage_rows is None:
        return params
    dst, _ = _pad_index(stage_rows)
    return join_params(jax.tree.map(lambda x: x[dst], params["layers"]), split_params(params)[1])


def _transpose_tied_table(model_cfg, params):
    if not model_cfg.tie_embeddings:
        return params
    return {**params, "embed": {**params["embed"], "embedding": params["embed"]["embedding"].T}}


def to_engine_layout(model_cfg, params, stage_rows: tuple | None = None):
    """The model's params (or a tree laid out like them: abstract shapes under ``jax.eval_shape``
    too) -> the engine's layout: the layer stack padded for an uneven split (:func:`pad_layers`),
    and a tied embedding table held as the head's ``[D, V]`` matrix, the layout its heaviest user,
    the last stage's head, reads (:func:`stage.head_of`).  The lookup then takes the table's
    columns (:func:`stage.lookup`), and its gradient, its optimizer state and their reduction over
    stages stay in that one layout: no step transposes a vocabulary-sized matrix (on XLA:CPU each
    transpose of the 49152 x 576 table of ``dense135m`` is a full copy, one per weight version and
    device per step, and a reduction split along ``V`` copies the gradient into columns first).
    The values are the model's: every optimizer here treats a matrix and its transpose alike
    (the table is on the AdamW side of Muon, SOAP and MARS)."""
    return _transpose_tied_table(model_cfg, pad_layers(params, stage_rows))


def to_model_layout(model_cfg, params, stage_rows: tuple | None = None):
    """Inverse of :func:`to_engine_layout`: the engine's params -> the model's (the simulate
    runner's, ``dense.init_params``')."""
    return unpad_layers(_transpose_tied_table(model_cfg, params), stage_rows)


def engine_layout(model_cfg, stage_rows: tuple | None = None):
    """:func:`to_engine_layout` as a one-argument function (``train_state.init_state``'s ``layout``)."""
    return functools.partial(to_engine_layout, model_cfg, stage_rows=stage_rows)


def padding_of(params, stage_rows: tuple | None):
    """The padded rows of each stacked layer leaf (``[P * Lmax - L, ...]``; empty without padding):
    what must stay exactly zero through training."""
    rows = jax.tree.leaves(params["layers"])[0].shape[0]
    pad = np.setdiff1d(np.arange(rows), _pad_index(stage_rows)[0]) if stage_rows else np.zeros(0, np.int32)
    return jax.tree.map(lambda x: x[pad], params["layers"])


def _check_layout(model_cfg, params_abstract, n_stages: int, stage_rows: tuple | None) -> None:
    """The params must be in the engine's layout (:func:`to_engine_layout`)."""
    if model_cfg.tie_embeddings:
        got = tuple(params_abstract["embed"]["embedding"].shape)
        want = (model_cfg.d_model, model_cfg.vocab_size)
        if got != want:
            raise ValueError(
                f"the pipeline engine holds the tied embedding table as the head's [d_model, vocab] = {want} "
                f"matrix, got {got}: put the params (and their abstract shapes) in the engine's layout with "
                "engine.to_engine_layout(model_cfg, params, stage_rows) (engine.engine_layout(...) as "
                "init_state's layout=), and read them back with engine.to_model_layout.")
    rows = {x.shape[0] for x in jax.tree.leaves(params_abstract["layers"])}.pop()
    want = n_stages * max(stage_rows) if stage_rows is not None else None
    if stage_rows is not None and (len(stage_rows) != n_stages or rows != want):
        raise ValueError(f"stage_rows={stage_rows} over {n_stages} stages needs the layer stack padded to "
                         f"{n_stages} x {max(stage_rows)} = {want} rows (engine.pad_layers), got {rows}.")
    if stage_rows is None and rows % n_stages:
        raise ValueError(f"{rows} layer rows do not split evenly over config.pipeline.stages={n_stages}; set "
                         "config.pipeline.stage_layers for an uneven split.")


class PipelineState(NamedTuple):
    """What crosses ``train_step`` calls under ``2bw`` (the ``sync`` schedule carries nothing).

    Each tensor is held once: the weight version is sharded like the parameters, the partial
    gradient like the update (reduced over ``stage`` at the end of each step), with each data
    replica's own (:func:`partial_specs`: it is reduced over ``data`` once, with its tail), and the
    activation state is per device because every device's is different.
    """

    prev_params: Any  # w[t-1]: the weight version of the batch still draining
    stash: list  # per entry [D, P, S, ...]: stage inputs (recompute) or residuals awaiting their backward
    fwd_buf: jax.Array  # [D, P, b, T, d]: activation received from stage s-1 (compute dtype)
    bwd_buf: jax.Array  # [D, P, b, T, d]: cotangent received from stage s+1 (compute dtype)
    grad_partial: Any  # the in-flight batch's gradient so far: [data, ...] per replica (partial_specs)
    stats_partial: dict  # the in-flight batch's loss sums so far (``count``: its finished microbatches)
    prev_batch: jax.Array  # [M, B, T+1]: the in-flight batch's tokens (the last stage needs targets)
    prediction: Any = None  # optim.WeightPredictionState (δ, sharded like the params) with weight prediction


def _ring_shapes(model_cfg, mesh, params_abstract, microbatch_rows: int, seq_len: int, recompute: bool,
                 expert_parallel: bool, stage_rows: tuple | None = None) -> list:
    """Per-device shapes of one stash entry, traced on the mesh (an MoE block's all_to_all needs it)."""
    fns = StageFns(model_cfg, 1, recompute, stage_rows)
    act = jax.ShapeDtypeStruct((microbatch_rows, seq_len, model_cfg.d_model), dense.dtype_of(model_cfg.compute_dtype))

    def local(layers, x):
        shapes = residual_shapes(fns, dense.compute_view(model_cfg, _vary({"layers": layers}))["layers"], _vary(x))
        return [_vary(jnp.zeros(sh.shape, sh.dtype))[None, None] for sh in shapes]

    layer_specs = param_specs(params_abstract, expert_parallel)["layers"]
    out = jax.eval_shape(jax.shard_map(local, mesh=mesh, in_specs=(layer_specs, P()), out_specs=DEVICE),
                         params_abstract["layers"], act)
    return [jax.ShapeDtypeStruct(o.shape[2:], o.dtype) for o in out]


def init_pipeline_state(model_cfg, params, mesh, microbatches: int, global_batch: int, seq_len: int,
                        schedule: str = "2bw", recompute: bool = True, expert_parallel: bool = False,
                        weight_prediction: WeightPrediction | None = None, stage_rows: tuple | None = None):
    """The in-flight state of a fresh run: ``None`` for ``sync`` (nothing crosses steps).
    ``params`` in the engine's layout (padded by :func:`pad_layers` when ``stage_rows`` is set)."""
    if schedule != "2bw":
        return None
    data, n_stages = mesh.shape["data"], mesh.shape["stage"]
    if expert_parallel:
        model_cfg = with_expert_parallel(model_cfg, "data", data)
    b = global_batch // microbatches // data
    slots = tick_tables.stash_slots(n_stages, first_stage_stashes=not recompute)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    entry = _ring_shapes(model_cfg, mesh, abstract, b, seq_len, recompute, expert_parallel, stage_rows)
    act = jnp.zeros((data, n_stages, b, seq_len, model_cfg.d_model), dense.dtype_of(model_cfg.compute_dtype))
    return PipelineState(
        prev_params=jax.tree.map(jnp.copy, params),
        stash=[jnp.zeros((data, n_stages, slots) + e.shape, e.dtype) for e in entry],
        fwd_buf=act, bwd_buf=act,
        grad_partial=jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.zeros((data,) * _local_over_data(path, expert_parallel) + x.shape, jnp.float32),
            params),
        stats_partial={k: jnp.zeros((), jnp.float32) for k in stat_names(model_cfg)},
        prev_batch=jnp.zeros((microbatches, global_batch // microbatches, seq_len + 1), jnp.int32),
        prediction=weight_prediction.init(params) if weight_prediction is not None else None,
    )


def pipeline_state_specs(params, pstate: PipelineState | None, expert_parallel: bool = False):
    if pstate is None:
        return None
    n_stages = pstate.fwd_buf.shape[1]
    return PipelineState(
        prev_params=param_specs(params, expert_parallel), stash=[DEVICE] * len(pstate.stash), fwd_buf=DEVICE,
        bwd_buf=DEVICE, grad_partial=partial_specs(params, n_stages, expert_parallel),
        stats_partial={k: P() for k in pstate.stats_partial}, prev_batch=BATCH_SPEC,
        prediction=None if pstate.prediction is None else WeightPredictionState(
            count=P(), velocity=param_specs(params, expert_parallel)))


def _vary(tree, axes=("data", "stage")):
    """Cast to device-varying over ``axes``: differentiating w.r.t. a value that is invariant over an
    axis would make shard_map's transpose sum the gradient over that axis."""
    def one(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)


def _add_at(acc, i, tree, axes=None):
    """``acc[i] += tree`` leaf by leaf, ``i`` indexing each leaf's accumulator axis: the leading one
    (``axes=None``), or per leaf as ``axes`` says (:func:`_acc_axis`)."""
    if axes is None:
        return jax.tree.map(lambda a, g: a.at[i].add(g.astype(a.dtype)), acc, tree)
    return jax.tree.map(lambda a, g, ax: a.at[(slice(None),) * ax + (i,)].add(g.astype(a.dtype)), acc, tree, axes)


def _acc_axis(spec, ndim: int) -> int:
    """Where a replicated leaf's accumulator axis (one entry per batch in flight) sits in its
    stacked accumulator: right after the axis its update splits over ``stage``
    (:func:`update_specs`), so that each device's share of all the accumulators is one contiguous
    slab and one reduce-scatter serves them all (with the axis in front, XLA:CPU copies each
    vocabulary-sized accumulator out of the stack before reducing it); in front when the leaf is
    not split, or split along its last axis (a microbatch's add would then be strided)."""
    spec = tuple(spec)
    if "stage" in spec and spec.index("stage") + 1 < ndim:
        return spec.index("stage") + 1
    return 0


def _lookup_transpose_add(acc, tokens, ct, i, axis: int, tied: bool):
    """``acc[i] += (d lookup / d table)^T ct``: each cotangent row added to its token's row of an
    untied ``[V, D]`` table, or column of a tied table held as the head's ``[D, V]``; ``b x T``
    entries, not a dense table per call.  ``axis``: the accumulator axis (:func:`_acc_axis`).  (Numpy's
    rule places the advanced ``[b, T]`` axes first when the indices are apart, in place when adjacent.)"""
    ct = ct.astype(acc.dtype)
    if not tied:  # [V, D] table: acc [n, V, D] or [V, n, D]; both index to [b, T, D]
        return acc.at[(i, tokens) if axis == 0 else (tokens, i)].add(ct)
    if axis == 0:  # acc [n, D, V]: indexes to [b, T, D]
        return acc.at[i, :, tokens].add(ct)
    return acc.at[:, i, tokens].add(jnp.moveaxis(ct, -1, 0))  # acc [D, n, V]: indexes to [D, b, T]


def _reduce_top(acc, spec, axis: int):
    """A replicated leaf's stacked accumulator summed over ``stage`` (scattered where ``spec`` splits
    it), in one collective for every batch it holds; the accumulator axis stays at ``axis``."""
    spec = tuple(spec)
    if "stage" not in spec:
        return jax.lax.psum(acc, "stage")
    split = spec.index("stage")
    dim = split + (1 if axis <= split else 0)
    if _gloo_job():
        # Over gloo (a CPU job of several processes) XLA's reduce-scatter of a 50 MB slab takes
        # 1.5-2.5x its all-reduce (157 vs 96 ms between two pinned processes here; 100 MB: 335 vs
        # 143): reduce it whole and keep this device's slice.  In one process (and on accelerators)
        # the reduce-scatter is the faster one (67 vs 325 ms in-process, four devices on one core).
        full = jax.lax.psum(acc, "stage")
        n = full.shape[dim] // jax.lax.axis_size("stage")
        return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index("stage") * n, n, axis=dim)
    return jax.lax.psum_scatter(acc, "stage", scatter_dimension=dim, tiled=True)


def _gloo_job() -> bool:
    """Whether the collectives cross processes over gloo (XLA:CPU's multi-process collectives)."""
    return (jax.process_count() > 1 and jax.default_backend() == "cpu"
            and jax.config.jax_cpu_collectives_implementation == "gloo")


def _mean_over_data(grads, expert_parallel: bool):
    """Average each gradient over ``data``."""
    data_size = jax.lax.axis_size("data")

    def one(path, g):
        if expert_parallel and is_expert_weight(path):
            # This device's experts already got every data shard's tokens (all_to_all's
            # transpose sums them): divide for the mean, no reduction.
            return g / data_size
        return jax.lax.pmean(g, "data")

    return jax.tree_util.tree_map_with_path(one, grads)


def _scoped(name: str):
    """Run the function under ``jax.named_scope(name)``: the parts of a step that
    ``asyncpp_jax.train.profile`` times separately (their names are its ``PARTS``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)
        return inner
    return wrap


@dataclasses.dataclass
class _Device:
    """One device's view of a step inside the ``shard_map``: its stage, both weight versions (in
    ``compute_dtype``, the head as ``[D, V]``), the two batches, and the slot computations of one
    tick of the table.  Each method is one slot kind; :meth:`tick` runs the two slots of a tick."""

    fns: StageFns
    delay: OneStepDelay
    stage: Any  # this device's stage index (traced)
    n_stages: int
    cur: tuple  # (layers, top, head) of w[t] (or the predicted point)
    prev: tuple  # the same for w[t-1]
    batch: jax.Array
    prev_batch: jax.Array
    step: Any
    slots: int  # stash ring slots
    act_dtype: Any
    top_axes: Any  # the replicated leaves' accumulator axes (:func:`_acc_axis`), a tree like their accumulators
    template: ResidualTemplate = dataclasses.field(default_factory=ResidualTemplate)

    @property
    def tied(self) -> bool:
        return self.fns.cfg.tie_embeddings

    @property
    def is_first(self):
        return self.stage == 0

    @property
    def is_last(self):
        return self.stage == self.n_stages - 1

    def tokens_of(self, j):
        m = jnp.mod(j, self.fns.microbatches)
        return jnp.where(j < 0, self.prev_batch[m], self.batch[m])

    def slot(self, j):
        return jnp.mod(self.step * self.fns.microbatches + j, self.slots)

    def run(self, j, fn, part):
        """``fn`` of microbatch ``j``'s weights (``part`` 0: layers, 1: top, 2: head)."""
        return self.delay.run(j, fn, self.cur[part], self.prev[part])

    def embed(self, j, tokens):
        return self.run(j, lambda top: self.fns.embed(top, tokens), 1).astype(self.act_dtype)

    @_scoped("pp_fwd")
    def forward(self, j, fwd_buf, stash, sums):
        """Stages ``0..P-2``: the block on the embedded tokens or the received activation; the
        backward's entry into the stash ring."""
        tokens = self.tokens_of(j)
        x = jax.lax.cond(self.is_first, lambda: self.embed(j, tokens), lambda: fwd_buf)
        h, entry, stats = self.run(j, lambda lp: self.fns.forward(lp, x, self.template), 0)
        stash = [ring.at[self.slot(j)].set(e.astype(ring.dtype)) for ring, e in zip(stash, entry)]
        return stash, _add_at(sums, self.delay.accumulator(j), stats), h.astype(self.act_dtype)

    @_scoped("pp_bwd")
    def backward(self, j, bwd_buf, stash, acc_l):
        """Stages ``0..P-2``: the block's vjp from the stash entry; on stage 0 the input
        cotangent goes into the embedding's gradient (the lookup's transpose, in :meth:`tick`)."""
        tokens, i = self.tokens_of(j), self.delay.accumulator(j)
        entry = [ring[self.slot(j)] for ring in stash]
        x_again = lambda: jax.lax.cond(self.is_first, lambda: self.embed(j, tokens), lambda: entry[0])  # noqa: E731
        g_l, g_x = self.run(j, lambda lp: self.fns.backward(lp, entry, x_again, bwd_buf, self.template), 0)
        return _add_at(acc_l, i, g_l), g_x.astype(self.act_dtype)

    @_scoped("pp_last")
    def last(self, j, fwd_buf, acc_l, acc_t, sums):
        """Stage ``P-1``: block, final norm, head and loss of microbatch ``j`` as one fused vjp."""
        i, tokens = self.delay.accumulator(j), self.tokens_of(j)
        g_l, g_h, g_x, stats = self.delay.run(j, lambda w: self.fns.last(w[0], w[2], fwd_buf, tokens),
                                              self.cur, self.prev)
        acc_t = {**acc_t, "head": _add_at(acc_t["head"], i, g_h, self.top_axes["head"])}
        return _add_at(acc_l, i, g_l), acc_t, _add_at(sums, i, stats), g_x.astype(self.act_dtype)

    @_scoped("pp_embed_grad")
    def lookup_transpose_add(self, acc_t, tokens, ct, i):
        """Stage 0's embedding gradient, added to accumulator ``i`` (of a tied table: in the head's
        ``[D, V]`` accumulator, which the last stage also adds to)."""
        if self.tied:
            w = _lookup_transpose_add(acc_t["head"]["w"], tokens, ct, i, self.top_axes["head"]["w"], True)
            return {**acc_t, "head": {**acc_t["head"], "w": w}}
        table = _lookup_transpose_add(acc_t["embed"]["embedding"], tokens, ct, i,
                                      self.top_axes["embed"]["embedding"], False)
        return {**acc_t, "embed": {"embedding": table}}

    @_scoped("pp_tick")
    def tick(self, carry, row):
        """One tick: a forward slot and a backward slot, each a ``lax.cond`` on the table (idle
        slots compute nothing), then the activation to ``s+1`` and the cotangent to ``s-1``."""
        stash, fwd_buf, bwd_buf, acc_l, acc_t, sums = carry
        jf, jb = row[0], row[1]
        stash, sums, h_out = jax.lax.cond(
            self.delay.live(jf) & ~self.is_last, lambda st, su: self.forward(jf, fwd_buf, st, su),
            lambda st, su: (st, su, jnp.zeros_like(fwd_buf)), stash, sums)
        live = self.delay.live(jb)
        # Two conds, not one with a branch per slot kind: a buffer that a branch passes through
        # unchanged is copied by XLA at the branch's end, so each cond takes only what its slot
        # writes (the head's vocabulary-sized accumulator goes through the last stage's alone).
        acc_l, g_x = jax.lax.cond(live & ~self.is_last, lambda al: self.backward(jb, bwd_buf, stash, al),
                                  lambda al: (al, jnp.zeros_like(bwd_buf)), acc_l)
        acc_l, acc_t, sums, g_x = jax.lax.cond(live & self.is_last,
                                               lambda al, at, su, _: self.last(jb, fwd_buf, al, at, su),
                                               lambda *a: a, acc_l, acc_t, sums, g_x)
        # Stage 0's input cotangent into the embedding's gradient rows, outside the conds (every
        # stage scatters, the others zeros: b x T rows): updated inside a cond branch, XLA copies
        # the whole vocabulary-sized accumulator at every backward slot.
        ct = jnp.where(self.is_first, g_x, jnp.zeros_like(g_x)).astype(jnp.float32)
        acc_t = self.lookup_transpose_add(acc_t, self.tokens_of(jb)[:, :-1], ct, self.delay.accumulator(jb))
        with jax.named_scope("pp_send"):
            fwd_buf = jax.lax.ppermute(h_out, "stage", [(i, i + 1) for i in range(self.n_stages - 1)])
            bwd_buf = jax.lax.ppermute(g_x, "stage", [(i + 1, i) for i in range(self.n_stages - 1)])
        return (stash, fwd_buf, bwd_buf, acc_l, acc_t, sums), None


@_scoped("pp_versions")
def _versions(model_cfg, params):
    """(layers, top, head) of a weight version in ``compute_dtype``, device-varying; the head
    ``[D, V]`` (:func:`stage.head_of`: a tied table is held in that layout, so nothing is
    transposed)."""
    layers, top = split_params(_vary(dense.compute_view(model_cfg, params)))
    return layers, top, head_of(model_cfg, top)


def _make_grads_fn(model_cfg, mesh, table: tick_tables.TickTable, is_async: bool, carries_state: bool,
                   params_abstract, expert_parallel: bool = False, recompute: bool = True,
                   stage_rows: tuple | None = None):
    """``shard_map``-ped ``(cur, prev, batch, pstate, prev_live, step) -> (grads, stats, pstate)``."""
    n_stages, M = table.n_stages, table.microbatches
    fns = StageFns(model_cfg, M, recompute, stage_rows)
    S = tick_tables.stash_slots(n_stages, first_stage_stashes=not recompute)
    act_dtype = dense.dtype_of(model_cfg.compute_dtype)
    pspec = param_specs(params_abstract, expert_parallel)
    uspec = update_specs(params_abstract, n_stages, expert_parallel)
    tied = model_cfg.tie_embeddings
    top_specs = _top_acc_specs(model_cfg, uspec)
    rows = np.stack([table.forward, table.backward], axis=-1)  # [ticks, P, 2]: (forward, backward) slot

    def local(cur, prev, batch, pstate, prev_live, step):
        s = jax.lax.axis_index("stage")
        cur_v = _versions(model_cfg, cur)
        prev_v = _versions(model_cfg, prev) if is_async else cur_v
        b, T = batch.shape[1], batch.shape[2] - 1
        if carries_state:
            strip = lambda x: x[0, 0]  # noqa: E731
            stash, fwd_buf, bwd_buf = [strip(r) for r in pstate.stash], strip(pstate.fwd_buf), strip(pstate.bwd_buf)
            prev_batch = pstate.prev_batch
        else:
            fwd_buf = bwd_buf = _vary(jnp.zeros((b, T, model_cfg.d_model), act_dtype))
            stash = [_vary(jnp.zeros((S,) + e.shape, e.dtype)) for e in residual_shapes(fns, cur_v[0], fwd_buf)]
            prev_batch = batch
        delay = OneStepDelay(is_async, prev_live)
        n_acc = delay.accumulators
        # The embedding's lookup gradient (stage 0) and the head's (stage P-1, as [D, V]); a tied
        # table has one accumulator, in its (the head's) layout, for both.  Each replicated leaf's
        # accumulators are stacked along the axis _acc_axis gives it, the layers' in front.
        top_acc = {"head": cur_v[2]} if tied else {"embed": cur_v[1]["embed"], "head": cur_v[2]}
        top_axes = jax.tree.map(lambda x, sp: _acc_axis(sp, x.ndim), top_acc, top_specs)
        stacked = lambda x, ax: jnp.zeros(x.shape[:ax] + (n_acc,) + x.shape[ax:], jnp.float32)  # noqa: E731
        acc_l = _vary(jax.tree.map(lambda x: stacked(x, 0), cur_v[0]))
        acc_t = _vary(jax.tree.map(stacked, top_acc, top_axes))
        dev = _Device(fns, delay, s, n_stages, cur_v, prev_v, batch, prev_batch, step, S, act_dtype, top_axes)
        sums0 = _vary({k: jnp.zeros((n_acc,), jnp.float32) for k in stat_names(model_cfg)})
        carry = (stash, fwd_buf, bwd_buf, acc_l, acc_t, sums0)
        carry, _ = jax.lax.scan(dev.tick, carry, jnp.take(rows, s, axis=1))
        return _finish(model_cfg, carry, pstate, cur, batch, prev_live, is_async, carries_state, top_specs,
                       top_axes, expert_parallel)

    def grads_fn(cur, prev, batch, pstate, prev_live, step):
        sspec = pipeline_state_specs(params_abstract, pstate, expert_parallel)
        fn = jax.shard_map(local, mesh=mesh, in_specs=(pspec, pspec, BATCH_SPEC, sspec, P(), P()),
                           out_specs=(uspec, P(), sspec))
        return fn(cur, prev, batch, pstate, prev_live, step)

    return grads_fn


def _top_acc_specs(model_cfg, uspec) -> dict:
    """Where each replicated leaf's update lives (:func:`update_specs`), laid out like the
    accumulators of the engine's top leaves: ``{'head': {'final_norm', 'w'}}`` (and ``'embed'`` for
    an untied model, whose head ``w`` is the ``lm_head`` kernel)."""
    if model_cfg.tie_embeddings:
        return {"head": {"final_norm": uspec["final_norm"], "w": uspec["embed"]["embedding"]}}
    return {"head": {"final_norm": uspec["final_norm"], "w": uspec["lm_head"]["kernel"]}, "embed": uspec["embed"]}


def _reduce_accumulators(model_cfg, acc_l, acc_t, sums, n_acc, top_specs, top_axes):
    """The step's accumulators -> ``[(this replica's gradient laid out as update_specs, loss sums)]``,
    one per batch they hold.  The replicated leaves are reduced over ``stage`` once for all
    batches; the reduction over ``data`` is the caller's, once per batch's whole gradient."""
    summed = jax.tree.map(_reduce_top, acc_t, top_specs, top_axes)
    out = []
    for k in range(n_acc):
        t = jax.tree.map(lambda a, ax: jax.lax.index_in_dim(a, k, ax, keepdims=False), summed, top_axes)
        if model_cfg.tie_embeddings:  # both uses of the table, in its one [D, V] accumulator
            top = {"final_norm": t["head"]["final_norm"], "embed": {"embedding": t["head"]["w"]}}
        else:
            top = {**dense.grads_from_head(model_cfg, t["head"]), "embed": t["embed"]}
        grads = join_params(jax.tree.map(lambda a: a[k], acc_l), top)
        out.append((grads, {n: jax.lax.pmean(jax.lax.psum(v[k], "stage"), "data") for n, v in sums.items()}))
    return out


@_scoped("pp_reduce")
def _finish(model_cfg, carry, pstate, cur, batch, prev_live, is_async, carries_state, top_specs, top_axes,
            expert_parallel):
    """The end of a step: the applied batch's gradient and loss (accumulator 0, joined under
    ``2bw`` with its head carried in as ``grad_partial``), and the in-flight state to carry."""
    stash, fwd_buf, bwd_buf, acc_l, acc_t, sums = carry
    n_acc = jax.tree.leaves(acc_l)[0].shape[0]  # OneStepDelay.accumulators: 2 under the delayed table
    reduced = _reduce_accumulators(model_cfg, acc_l, acc_t, sums, n_acc, top_specs, top_axes)
    grads, totals = reduced[0]
    new = None
    if carries_state:
        if is_async:  # batch t-1's head, carried from the previous step, joins its tail before the reduction
            keep = lambda a, p: a + jnp.where(prev_live, p, jnp.zeros_like(p))  # noqa: E731
            grads = jax.tree.map(keep, grads, _on_data_axis(pstate.grad_partial, expert_parallel, add=False))
            totals = jax.tree.map(keep, totals, pstate.stats_partial)
            partial, partial_sums = reduced[1]
        else:
            partial = jax.tree.map(jnp.zeros_like, grads)
            partial_sums = jax.tree.map(jnp.zeros_like, totals)
        partial = _on_data_axis(partial, expert_parallel, add=True)
        grow = lambda x: x[None, None]  # noqa: E731
        new = PipelineState(prev_params=cur, stash=[grow(r) for r in stash], fwd_buf=grow(fwd_buf),
                            bwd_buf=grow(bwd_buf), grad_partial=partial, stats_partial=partial_sums,
                            prev_batch=batch)
    grads = _mean_over_data(grads, expert_parallel)  # once per batch: its head and tail together
    count = totals.pop("count")  # 0 at a fill update: no batch's gradient is applied, so no loss
    stats = {k: v / count for k, v in totals.items()}
    stats["loss_microbatches"] = count
    return grads, stats, new


def make_pipeline_train_step(model_cfg, optimizer, schedule: optax.Schedule, mesh, params_abstract,
                             microbatches: int, pipeline_schedule: str, delay_schedule: DelaySchedule | None = None,
                             expert_parallel: bool = False, recompute: bool = True,
                             weight_prediction: WeightPrediction | None = None, stage_rows: tuple | None = None):
    """Jitted ``train_step(state, batch) -> (state, metrics)`` with ``state.runner_state`` a
    :class:`PipelineState` (``2bw``) or ``None`` (``sync``).  Under ``2bw`` the
    ``delay_schedule`` (``optim.delay_schedule``) says which updates are synchronous (start,
    cooldown): those run the flushed ``sync`` table and drop what is in flight, as ``delay`` does.

    With ``weight_prediction`` (SpecTrain / PipeMare, :mod:`asyncpp_jax.optim.prediction`) batch
    ``t``'s microbatches run their forward and backward slots at ``ŵ_t = w_t + δ_t`` instead of
    ``w_t`` (the version carried as ``prev_params`` is then ``ŵ_t``), so update ``t+1`` applies
    ``∇L(ŵ_t; batch t)``, exactly the simulate runner's ``delay(1)`` with the same prediction.

    ``stage_rows`` (:func:`stage_split`): an uneven split, with ``params_abstract`` and the state
    in the padded layout of :func:`pad_layers`."""
    if weight_prediction is not None and pipeline_schedule != "2bw":
        raise ValueError("weight prediction corrects the 2bw delay: config.pipeline.schedule must be '2bw', "
                         f"not {pipeline_schedule!r} (or set config.staleness.weight_prediction=False).")
    n_stages = mesh.shape["stage"]
    if n_stages < 2:
        raise ValueError(f"the pipeline engine needs config.pipeline.stages >= 2, got {n_stages}.")
    _check_layout(model_cfg, params_abstract, n_stages, stage_rows)
    if expert_parallel:  # experts sharded over ``data``: the MoE layers exchange tokens with all_to_all
        model_cfg = with_expert_parallel(model_cfg, "data", mesh.shape["data"])
    is_2bw = pipeline_schedule == "2bw"
    kw = dict(carries_state=is_2bw, params_abstract=params_abstract, expert_parallel=expert_parallel,
              recompute=recompute, stage_rows=stage_rows)
    sync_fn = _make_grads_fn(model_cfg, mesh, tick_tables.sync_table(n_stages, microbatches), False, **kw)
    async_fn = None
    if is_2bw:
        async_fn = _make_grads_fn(model_cfg, mesh, tick_tables.async_table(n_stages, microbatches), True, **kw)
        delay_schedule = delay_schedule or DelaySchedule(1)

    update_shardings = jax.tree.map(functools.partial(NamedSharding, mesh),
                                    update_specs(params_abstract, n_stages, expert_parallel))

    def train_step(state: TrainState, batch):
        ps = state.runner_state
        if async_fn is None:
            grads, stats, ps = sync_fn(state.params, state.params, batch, ps, jnp.bool_(False), state.step)
        else:
            velocity = ps.prediction
            point = state.params if velocity is None else weight_prediction.predicted_point(state.params, velocity)
            args = (point, ps.prev_params, batch, ps._replace(prediction=None))
            prev_live = delay_schedule.in_force(state.step - 1)
            if delay_schedule.always_in_force:  # no synchronous phase: compile the delayed program only
                grads, stats, ps = async_fn(*args, prev_live, state.step)
            else:
                grads, stats, ps = jax.lax.cond(delay_schedule.in_force(state.step),
                                                lambda: async_fn(*args, prev_live, state.step),
                                                lambda: sync_fn(*args, prev_live, state.step))
        old_params = state.params
        # The update runs where its gradient lives: each replicated leaf's weights are sliced to
        # their split layout (local, no transfer), so the optimizer's elementwise work on them runs
        # once over the mesh; only the new weights are gathered, by the constraint below.
        state = state.replace(params=jax.lax.with_sharding_constraint(state.params, update_shardings))
        state, metrics = apply_update(state, grads, stats, ps, optimizer, schedule, delay_schedule)
        if weight_prediction is not None:
            state = state.replace(runner_state=ps._replace(
                prediction=weight_prediction.push(old_params, state.params, velocity)))
        # Keep the layout fixed across steps: weights where the stages read them, the optimizer
        # state of the replicated leaves split over ``stage`` (:func:`update_specs`).
        return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh, params_abstract,
                                                                       expert_parallel)), metrics

    return jax.jit(train_step, donate_argnums=0)


def state_shardings(state, mesh, params_abstract, expert_parallel: bool = False):
    """NamedShardings for a (possibly abstract) pipeline TrainState: layers and their optimizer
    moments over ``stage`` (experts also over ``data`` with expert parallelism), the in-flight
    state per device, the rest replicated."""
    shard = functools.partial(NamedSharding, mesh)
    pspecs = param_specs(params_abstract, expert_parallel)
    n_layers = {x.shape[0] for x in jax.tree.leaves(params_abstract["layers"])}.pop()
    # Optimizer moments mirror their params' shapes: an expert-shaped moment is sharded like the
    # experts, a replicated leaf's like its update (split over stage), a stacked-layer one like the layers.
    expert_shapes = {tuple(x.shape) for x, sp in zip(jax.tree.leaves(params_abstract), jax.tree.leaves(pspecs))
                     if len(sp) > 1}
    _, top = split_params(params_abstract)
    top_specs = split_params(update_specs(params_abstract, mesh.shape["stage"], expert_parallel))[1]
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
                      runner_state=jax.tree.map(shard, pipeline_state_specs(params_abstract, state.runner_state,
                                                                            expert_parallel)))


def place_state(state: TrainState, mesh, params_abstract, expert_parallel: bool = False) -> TrainState:
    """Put a fresh state, which every process holds whole, on the pipeline mesh (layers over
    ``stage``); in a job of several processes each one supplies only its own devices' shards."""
    return jax.tree.map(from_host, state_shardings(state, mesh, params_abstract, expert_parallel), state)


def global_batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, BATCH_SPEC)




def make_pipeline_eval_step(model_cfg, mesh, params_abstract, microbatch_rows: int, expert_parallel: bool = False,
                            stage_rows: tuple | None = None):
    """Jitted ``eval_step(params, batch[B, T+1]) -> (sum of token losses, token count)`` on the
    pipeline mesh: forward only, each stage with its own layers (the model is never gathered).

    Each data replica's rows are cut into microbatches of ``microbatch_rows`` (the training
    microbatch, so activations match what training holds) and streamed through the stages: stage
    ``s`` runs microbatch ``j`` at tick ``j + s``; stage 0 embeds, stage ``P-1`` applies the head
    and sums the token losses.  Idle slots compute nothing, nor do padded layer rows
    (``stage_rows``, :func:`stage_split`).
    """
    n_stages = mesh.shape["stage"]
    _check_layout(model_cfg, params_abstract, n_stages, stage_rows)
    if expert_parallel:
        model_cfg = with_expert_parallel(model_cfg, "data", mesh.shape["data"])
    fwd_perm = [(i, i + 1) for i in range(n_stages - 1)]
    act_dtype = dense.dtype_of(model_cfg.compute_dtype)

    def local(params, batch):
        s = jax.lax.axis_index("stage")
        is_first, is_last = s == 0, s == n_stages - 1
        live = None if stage_rows is None else jnp.asarray(stage_rows, jnp.int32)[s]
        layers, top = split_params(_vary(dense.compute_view(model_cfg, params)))
        head = head_of(model_cfg, top)
        rows, width = batch.shape
        b = min(microbatch_rows, rows)
        mbs = batch.reshape(rows // b, b, width)
        n_mb = mbs.shape[0]

        def tick(carry, k):
            buf, total, count = carry
            j = k - s
            tokens = mbs[jnp.clip(j, 0, n_mb - 1)]

            def work(buf):
                x = jax.lax.cond(is_first, lambda: lookup(model_cfg, top, tokens[:, :-1]).astype(act_dtype),
                                 lambda: buf)
                h = dense.apply_layers(model_cfg, layers, x, live).astype(act_dtype)

                def loss_sum():
                    logits = dense.logits_from_head(model_cfg, head, h)
                    lse = jax.nn.logsumexp(logits, axis=-1)
                    tgt = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
                    return jnp.zeros_like(h), _vary(jnp.sum(lse - tgt)), _vary(jnp.float32(tgt.size))

                zero = _vary(jnp.zeros((), jnp.float32))
                return jax.lax.cond(is_last, loss_sum, lambda: (h, zero, zero))

            def idle(buf):
                zero = _vary(jnp.zeros((), jnp.float32))
                return jnp.zeros_like(buf), zero, zero

            h_out, loss, n = jax.lax.cond((j >= 0) & (j < n_mb), work, idle, buf)
            return (jax.lax.ppermute(h_out, "stage", fwd_perm), total + loss, count + n), None

        zero = _vary(jnp.zeros((), jnp.float32))
        buf = _vary(jnp.zeros((b, width - 1, model_cfg.d_model), act_dtype))
        (_, total, count), _ = jax.lax.scan(tick, (buf, zero, zero), jnp.arange(n_mb + n_stages - 1))
        return jax.lax.psum(total, ("data", "stage")), jax.lax.psum(count, ("data", "stage"))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(param_specs(params_abstract, expert_parallel), P("data")),
                       out_specs=(P(), P()))
    return jax.jit(fn)
