"""The engine's layout: the ``('data', 'stage')`` mesh, where each leaf lives on it (parameters,
updates, 2bw's in-flight partial gradient), the padded layer stack of an uneven split, and the
engine's parameter layout (a tied table held as the head's ``[D, V]``; the layer stack ordered
by virtual stage under the ``interleaved`` schedule, :func:`interleave_index`).

Stage ``s`` holds layers ``[s L/P, (s+1) L/P)``: the stacked layer leaves are sharded on their
leading axis over ``stage``.  The embedding, final norm and head are replicated; their updates are
split over ``stage`` (:func:`update_specs`).

An uneven split, ``config.pipeline.stage_layers = (L_0, ..., L_{P-1})`` (:func:`stage_split`), gives
stage ``s`` ``L_s`` layers, e.g. fewer to the last stage, which also runs the head and loss.  SPMD
needs one shape per device, so the stacked leaves are held padded to ``[P Lmax, ...]``
(:func:`pad_layers`; ``Lmax = max L_s``): stage ``s``'s rows ``[s Lmax, s Lmax + L_s)`` are its
layers, the rest zeros.  A padded row computes nothing in any slot (forward, backward with or
without recompute, the fused last slot, eval: ``dense.apply_layers_with_aux``'s ``live``), gets an
exactly zero gradient, and so stays zero under every optimizer (zero gradient, zero weight: zero
update).  The padding costs ``(P Lmax - L) / L`` of the layer stack over the mesh (params,
optimizer moments, the ``2bw`` weight version), nothing per device beyond the largest stage.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.models.moe import is_expert_weight
from asyncpp_jax.pipeline.stage import join_params, split_params

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


def is_vocab_table(path) -> bool:
    """Whether a leaf is a vocabulary-sized table: the embedding, or an untied ``lm_head``."""
    return path[0].key in ("embed", "lm_head")


def vocab_spec(path, params) -> P:
    """A table's vocabulary axis over ``stage`` (:mod:`asyncpp_jax.pipeline.vocab_parallel`): the
    columns of a ``[D, V]`` matrix (the head's, and a tied table, held in that layout by
    :func:`to_engine_layout`), the rows of an untied ``[V, D]`` embedding."""
    if path[0].key == "lm_head" or "lm_head" not in params:
        return P(None, "stage")
    return P("stage", None)


def param_specs(params, expert_parallel: bool = False, vocab_parallel: bool = False) -> Any:
    """``layers/...`` sharded on the leading (layer) axis over ``stage``, routed experts also on
    their expert axis over ``data`` with ``expert_parallel``; with ``vocab_parallel`` each
    vocabulary-sized table split along its vocabulary over ``stage`` (:func:`vocab_spec`); the
    rest replicated."""

    def spec(path, _):
        if path[0].key != "layers":
            return vocab_spec(path, params) if vocab_parallel and is_vocab_table(path) else P()
        return P("stage", "data") if expert_parallel and is_expert_weight(path) else P("stage")

    return jax.tree_util.tree_map_with_path(spec, params)


def update_specs(params, n_stages: int, expert_parallel: bool = False, vocab_parallel: bool = False) -> Any:
    """Where each leaf's gradient, optimizer state and update live: as :func:`param_specs`, except
    that each replicated leaf (embedding, head, final norm) is split over ``stage`` along its first
    axis divisible by ``P``.  Its gradient then arrives reduce-scattered and the optimizer updates
    it once over the mesh, not once per device (ZeRO-1 for the leaves every stage holds); only the
    new weights are gathered.  A leaf with no divisible axis stays replicated.  A table split
    over its vocabulary (``vocab_parallel``) stays where it is: each device updates its block."""
    layer_specs = param_specs(params, expert_parallel, vocab_parallel)

    def spec(path, x, layer_spec):
        if path[0].key == "layers" or (vocab_parallel and is_vocab_table(path)):
            return layer_spec
        for axis, n in enumerate(x.shape):
            if n % n_stages == 0:
                return P(*([None] * axis + ["stage"]))
        return P()

    return jax.tree_util.tree_map_with_path(spec, params, layer_specs)


def local_over_data(path, expert_parallel: bool) -> bool:
    """Whether a leaf's in-flight partial gradient is held per data replica: every leaf but an
    expert weight under ``expert_parallel`` (never reduced over ``data``; its layout already is)."""
    return not (expert_parallel and is_expert_weight(path))


def partial_specs(params, n_stages: int, expert_parallel: bool = False, vocab_parallel: bool = False) -> Any:
    """Where 2bw's in-flight partial gradient lives: reduced over ``stage`` (laid out as
    :func:`update_specs`) but not over ``data``, so a leading ``data`` axis holds each replica's
    own.  It joins its tail at the next step and the whole gradient is reduced over ``data`` once."""
    def spec(path, _, u):
        return P("data", *u) if local_over_data(path, expert_parallel) else u

    return jax.tree_util.tree_map_with_path(spec, params, update_specs(params, n_stages, expert_parallel,
                                                                       vocab_parallel))


def on_data_axis(tree, expert_parallel: bool, add: bool):
    """Inside ``shard_map``: add (or strip) the per-replica ``data`` axis of :func:`partial_specs`."""
    def one(path, x):
        if not local_over_data(path, expert_parallel):
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


def interleave_index(rows: int, n_stages: int, chunks: int) -> np.ndarray:
    """Row ``i`` of the model's stack -> its row in the interleaved layout of ``chunks`` virtual
    stages per device (Megatron's: virtual stage ``u = c P + d`` on device ``d``, chunk ``c``).
    Each of the ``P v`` virtual stages holds ``rows / (P v)`` consecutive model rows; device ``d``'s
    shard of the stack (``rows / P`` rows, the ``stage`` split) holds its chunks in order, so chunk
    ``c`` is the local rows ``[c rows/(P v), (c+1) rows/(P v))``."""
    per = rows // (n_stages * chunks)
    u, offset = np.divmod(np.arange(rows), per)
    chunk, device = np.divmod(u, n_stages)
    return (device * chunks * per + chunk * per + offset).astype(np.int32)


def check_interleave(rows: int, n_stages: int, chunks: int, stage_rows: tuple | None = None) -> None:
    """An interleaved layout needs an even split into ``P v`` virtual stages."""
    if stage_rows is not None:
        raise ValueError("config.pipeline.stage_layers (an uneven split) and config.pipeline.schedule='interleaved' "
                         "cannot be combined: the interleaved layout splits the layers evenly over "
                         "stages x virtual_stages. Set stage_layers=() or another schedule.")
    if rows % (n_stages * chunks):
        raise ValueError(f"{rows} rows of the layer stack do not split into config.pipeline.stages={n_stages} x "
                         f"config.pipeline.virtual_stages={chunks} equal chunks; pick n_layers (in scanned units) "
                         f"divisible by {n_stages * chunks}.")


def _stack_index(params, stage_rows: tuple | None, interleave: tuple | None):
    """``(dst, rows)`` of the engine's layer stack (model row ``i`` at row ``dst[i]`` of ``rows``),
    or None when the engine holds the model's stack as it is."""
    if interleave is not None and interleave[1] > 1:
        rows = jax.tree.leaves(params["layers"])[0].shape[0]
        check_interleave(rows, *interleave, stage_rows)
        return interleave_index(rows, *interleave), rows
    return None if stage_rows is None else _pad_index(stage_rows)


def pad_layers(params, stage_rows: tuple | None, interleave: tuple | None = None):
    """The model's params -> the engine's layer stack: for an uneven split each stacked layer leaf
    ``[L, ...]`` becomes ``[P * Lmax, ...]`` with stage ``s``'s layers at rows
    ``[s Lmax, s Lmax + stage_rows[s])`` and exact zeros elsewhere; for ``interleave = (P, v)`` its
    rows are permuted by :func:`interleave_index`.  Identity for neither.  Works on abstract shapes
    under ``jax.eval_shape``."""
    index = _stack_index(params, stage_rows, interleave)
    if index is None:
        return params
    dst, rows = index
    pad = lambda x: jnp.zeros((rows,) + x.shape[1:], x.dtype).at[dst].set(x)  # noqa: E731
    return join_params(jax.tree.map(pad, params["layers"]), split_params(params)[1])


def unpad_layers(params, stage_rows: tuple | None, interleave: tuple | None = None):
    """Inverse of :func:`pad_layers`: the engine's params (or a tree laid out like them) -> the model's."""
    index = _stack_index(params, stage_rows, interleave)
    if index is None:
        return params
    dst, _ = index
    return join_params(jax.tree.map(lambda x: x[dst], params["layers"]), split_params(params)[1])


def _transpose_tied_table(model_cfg, params):
    if not model_cfg.tie_embeddings:
        return params
    return {**params, "embed": {**params["embed"], "embedding": params["embed"]["embedding"].T}}


def to_engine_layout(model_cfg, params, stage_rows: tuple | None = None, interleave: tuple | None = None):
    """The model's params (or a tree laid out like them: abstract shapes under ``jax.eval_shape``
    too) -> the engine's layout: the layer stack padded for an uneven split, or ordered by virtual
    stage for ``interleave = (P, v)`` (:func:`pad_layers`),
    and a tied embedding table held as the head's ``[D, V]`` matrix, the layout its heaviest user,
    the last stage's head, reads (:func:`stage.head_of`).  The lookup then takes the table's
    columns (:func:`stage.lookup`), and its gradient, its optimizer state and their reduction over
    stages stay in that one layout: no step transposes a vocabulary-sized matrix (on XLA:CPU each
    transpose of the 49152 x 576 table of ``dense135m`` is a full copy, one per weight version and
    device per step, and a reduction split along ``V`` copies the gradient into columns first).
    The values are the model's: every optimizer here treats a matrix and its transpose alike
    (the table is on the AdamW side of Muon, SOAP and MARS)."""
    return _transpose_tied_table(model_cfg, pad_layers(params, stage_rows, interleave))


def to_model_layout(model_cfg, params, stage_rows: tuple | None = None, interleave: tuple | None = None):
    """Inverse of :func:`to_engine_layout`: the engine's params -> the model's (the simulate
    runner's, ``dense.init_params``')."""
    return unpad_layers(_transpose_tied_table(model_cfg, params), stage_rows, interleave)


def engine_layout(model_cfg, stage_rows: tuple | None = None, interleave: tuple | None = None):
    """:func:`to_engine_layout` as a one-argument function (``train_state.init_state``'s ``layout``)."""
    return functools.partial(to_engine_layout, model_cfg, stage_rows=stage_rows, interleave=interleave)


def padding_of(params, stage_rows: tuple | None):
    """The padded rows of each stacked layer leaf (``[P * Lmax - L, ...]``; empty without padding):
    what must stay exactly zero through training."""
    rows = jax.tree.leaves(params["layers"])[0].shape[0]
    pad = np.setdiff1d(np.arange(rows), _pad_index(stage_rows)[0]) if stage_rows else np.zeros(0, np.int32)
    return jax.tree.map(lambda x: x[pad], params["layers"])


def check_layout(model_cfg, params_abstract, n_stages: int, stage_rows: tuple | None) -> None:
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
