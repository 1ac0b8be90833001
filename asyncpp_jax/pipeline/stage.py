"""What one pipeline stage computes in one slot of a program.

A stage holds a contiguous block of layers (``layers``: the stacked leaves, local to the stage)
and, for the stages that use them, the non-layer parameters (``top``: the embedding, the final
norm, the head).  Three kinds of work, each run only where it belongs:

* ``forward`` (every stage but the last): ``h_out = layers(x)`` with ``x`` the embedded tokens on
  stage 0 (the lookup runs there only) or the activation received from ``s-1``.  What the
  backward will need goes into the stash ring: the stage input ``x`` when ``recompute`` (the
  backward recomputes the block from it: memory of one activation per in-flight microbatch), or
  the block's autodiff residuals otherwise (no recompute: memory of every intermediate the
  backward reads, as in the unpipelined model).  The weights themselves are never stashed: the
  backward reads the same weight version from the state.
* ``backward`` (every stage but the last): the block's vjp with the cotangent received from
  ``s+1``; on stage 0 the input cotangent is added to the embedding's gradient rows (a lookup's
  transpose), elsewhere it is sent to ``s-1``.
* ``last`` (stage ``P-1``, whose forward and backward of a microbatch run in the same slot): one
  fused ``vjp`` of block + final norm + head + loss, so its forward is never run twice and the
  full-vocabulary logits exist on this stage only.

Every function here is per device (inside the engine's ``shard_map``) and pure.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from asyncpp_jax.models import dense, taps

Array = jax.Array


def split_params(params: dict) -> tuple[dict, dict]:
    """``(layers, top)``: the stacked layer tree and the rest (embedding, final norm, head)."""
    return params["layers"], {k: v for k, v in params.items() if k != "layers"}


def join_params(layers, top: dict) -> dict:
    return {**top, "layers": layers}


# The engine holds a tied embedding table in the head's ``[D, V]`` layout
# (:func:`asyncpp_jax.pipeline.spmd.engine.to_engine_layout`): the head reads it as it is, the lookup
# takes its columns, and its gradient, the table's optimizer state and the reduction over stages
# all live in that one layout, so no step ever transposes a vocabulary-sized matrix.


def head_of(cfg, top: dict) -> dict:
    """The output side of a weight version in the engine's layout, ``{'final_norm', 'w': [D, V]}``
    (as :func:`dense.head_params` reads the model's): a tied table is already ``[D, V]``."""
    if cfg.tie_embeddings:
        return {"final_norm": top["final_norm"], "w": top["embed"]["embedding"]}
    return dense.head_params(cfg, top)


def lookup(cfg, top: dict, tokens: Array) -> Array:
    """``dense.embed`` on the engine's layout: the columns of a tied ``[D, V]`` table (the same
    values as the rows of the model's ``[V, D]`` one), the rows of an untied table."""
    if not cfg.tie_embeddings:
        return dense.embed(cfg, top, tokens)
    table = top["embed"]["embedding"].astype(dense.dtype_of(cfg.compute_dtype))
    return jnp.moveaxis(jnp.take(table, tokens, axis=1), 0, -1)


def table_size(acc, tied: bool, i=None, axis: int = 0) -> int:
    """The vocabulary length of a table accumulator laid out as :func:`lookup_transpose_add` takes
    it (an id equal to it is dropped there)."""
    if tied:
        return acc.shape[-1]
    return acc.shape[1 if i is not None and axis == 0 else 0]


def lookup_transpose_add(acc, ids: Array, ct: Array, tied: bool, i=None, axis: int = 0):
    """``acc[i] += (d lookup / d table)^T ct``: each cotangent row ``ct[b, t]`` (``[b, T, D]``)
    added to row ``ids[b, t]`` of an untied ``[V, D]`` table, or to that column of a tied table held
    as the head's ``[D, V]``; ``b x T`` entries, not a dense table per call.  An id past the table is
    dropped (a caller points an id there to skip it).  ``i``: the accumulator's index along
    ``axis`` (``[n, V, D]``/``[n, D, V]`` for axis 0, ``[V, n, D]``/``[D, n, V]`` for axis 1), or
    ``None`` for one table.  (NumPy's rule places the advanced ``[b, T]`` axes first when the
    indices are apart, in place when adjacent.)"""
    ct = ct.astype(acc.dtype)
    if not tied:  # every layout indexes to [b, T, D]
        index = (ids,) if i is None else (i, ids) if axis == 0 else (ids, i)
        return acc.at[index].add(ct, mode="drop")
    if i is not None and axis == 0:  # [n, D, V]: indexes to [b, T, D]
        return acc.at[i, :, ids].add(ct, mode="drop")
    index = (slice(None), ids) if i is None else (slice(None), i, ids)  # [D, V] or [D, n, V]: to [D, b, T]
    return acc.at[index].add(jnp.moveaxis(ct, -1, 0), mode="drop")


def chunk_rows(layers, chunk, chunks: int):
    """Rows ``[chunk n, (chunk+1) n)`` of each stacked layer leaf (``n`` = rows / ``chunks``): one
    chunk of an interleaved device's stack (the whole stack when ``chunks`` is 1)."""
    if chunks == 1:
        return layers
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, chunk * (x.shape[0] // chunks),
                                                               x.shape[0] // chunks), layers)


def is_first_virtual(stage, chunk, chunks: int):
    """Whether ``chunk`` of device ``stage`` is the first virtual stage (it embeds the tokens)."""
    return stage == 0 if chunks == 1 else (stage == 0) & (chunk == 0)


def is_last_virtual(stage, n_stages: int, chunk, chunks: int):
    """Whether ``chunk`` of device ``stage`` is the last virtual stage (head and loss)."""
    return stage == n_stages - 1 if chunks == 1 else (stage == n_stages - 1) & (chunk == chunks - 1)


@dataclasses.dataclass(frozen=True)
class StageFns:
    """The per-slot computations of one stage for a model config.

    ``moe_scale``: the cotangent of the block's MoE auxiliary loss (``1/M``, as every
    microbatch's loss is scaled in the accumulated gradient).
    """

    cfg: Any
    microbatches: int
    recompute: bool
    # Uneven split (:func:`asyncpp_jax.pipeline.spmd.engine.stage_split`): stage ``s`` runs only the
    # first ``stage_rows[s]`` rows of its (padded) stack; ``None``: every row is a layer.
    stage_rows: tuple | None = None
    # The backward as two actions (zb-h1): ``I`` (:meth:`input_grad`, :meth:`last_input`) and ``W``
    # (:meth:`weight_grad`), through the taps of :mod:`asyncpp_jax.models.taps`.
    split: bool = False

    def live(self):
        """This device's number of real layer rows (traced), or ``None`` without padding."""
        if self.stage_rows is None:
            return None
        return jnp.asarray(self.stage_rows, jnp.int32)[jax.lax.axis_index("stage")]

    # ------------------------------------------------------------------ the block and the loss
    def block(self, layers, x):
        """``((h_out, aux_loss), stats)``: the stage's layers and their MoE terms."""
        h, aux = dense.apply_layers_with_aux(self.cfg, layers, x, self.live())
        # Varying like h even for a dense block (aux loss 0), so its cotangent has one known type.
        return (h, dense.varying_like(dense.aux_loss(self.cfg, aux), h)), block_stats(self.cfg, aux)

    def last_loss(self, layers, head, x, tokens):
        """``(loss, stats)``: block, final norm, head (:func:`head_of`) and next-token
        loss of one microbatch."""
        h, aux = dense.apply_layers_with_aux(self.cfg, layers, x, self.live())
        lm, head_stats = self._head_loss(head, h, tokens)
        stats = block_stats(self.cfg, aux)
        stats.update(head_stats, loss=stats["loss"] + lm)
        return lm + dense.aux_loss(self.cfg, aux), stats

    def embed(self, top, tokens):
        return lookup(self.cfg, top, tokens[:, :-1])

    # ------------------------------------------------------------------ the three slot kinds
    def forward(self, layers_c, x, template: "ResidualTemplate"):
        """``(h_out, stash_entry, stats)``; ``layers_c`` in :func:`dense.compute_view`.  The entry
        is a list of arrays: ``[x]`` when recomputing, else the residuals (``template`` records
        where they go back into the vjp closure); for a split backward without recompute, the
        residuals of the tapped stack's vjp (with respect to its input and taps) and then every
        leaf call's input."""
        if self.recompute:
            (h, _), stats = self.block(layers_c, x)
            return h, [x], stats
        if self.split:
            h, vjp_fn, inputs = jax.vjp(lambda x_, t: taps.apply_tapped(self.cfg, layers_c, x_, t), x,
                                        taps.zero_taps(self.cfg, layers_c, x), has_aux=True)
            template.record(vjp_fn, layers_c)
            return h, residuals_of(vjp_fn, layers_c) + list(inputs), self._dense_stats()
        (h, _), vjp_fn, stats = jax.vjp(self.block, layers_c, x, has_aux=True)
        template.record(vjp_fn, layers_c)
        return h, residuals_of(vjp_fn, layers_c), stats

    def backward(self, layers_c, entry: list, x_recompute: Callable[[], Array], ct: Array,
                 template: "ResidualTemplate"):
        """``(grad of layers, cotangent of x)`` from the stash entry; ``x_recompute()`` gives the
        block's input when recomputing (the stashed ``x``, or the embedding on stage 0)."""
        if self.recompute:
            x = x_recompute()
            _, vjp_fn, _ = jax.vjp(self.block, layers_c, x, has_aux=True)
        else:
            vjp_fn = template.rebuild(entry, layers_c)
        return vjp_fn((ct, self._loss_ct(ct)))

    def last(self, layers_c, head_c, x, tokens):
        """``(grad of layers, grad of head, cotangent of x, stats)`` of one microbatch."""
        fn = lambda lp, hp, h: self.last_loss(lp, hp, h, tokens)  # noqa: E731
        _, vjp_fn, stats = jax.vjp(fn, layers_c, head_c, x, has_aux=True)
        g_l, g_t, g_x = vjp_fn(self._loss_ct(x))
        return g_l, g_t, g_x, stats

    # ------------------------------------------------------------------ a split backward (I, W)
    def input_grad(self, layers_c, entry: list, x_recompute: Callable[[], Array], ct: Array,
                   template: "ResidualTemplate"):
        """``I``: ``(cotangent of x, save_entry)`` from the stash entry, no weight gradient; the
        entry for :meth:`weight_grad` is every leaf call's input, then its output cotangent."""
        if self.recompute:
            _, g_x, inputs, dys = taps.input_grads(self.cfg, layers_c, x_recompute(), ct)
        else:
            n = len(entry) - taps.input_count(self.cfg, ct.shape, ct.dtype)
            g_x, dys = template.rebuild(entry[:n], layers_c)(ct)
            inputs = entry[n:]
        return g_x, list(inputs) + list(dys)

    def weight_grad(self, layers_c, save: list):
        """``W``: the gradient of ``layers_c`` from an :meth:`input_grad` (or :meth:`last_input`) entry."""
        n = taps.input_count(self.cfg, save[0].shape[1:], save[0].dtype)
        return taps.weight_grads(self.cfg, layers_c, save[:n], save[n:])

    def last_input(self, layers_c, head_c, x, tokens):
        """The last stage's ``I``: ``(grad of head, cotangent of x, save_entry, stats)``: block, head
        and loss as one vjp with respect to the head, the input and the taps (the head's gradient is
        computed here: its ``W`` would need the full-vocabulary logits' cotangent kept)."""
        def fn(hp, x_, t):
            h, inputs = taps.apply_tapped(self.cfg, layers_c, x_, t)
            lm, stats = self._head_loss(hp, h, tokens)
            return lm, (stats, inputs)

        _, vjp_fn, (stats, inputs) = jax.vjp(fn, head_c, x, taps.zero_taps(self.cfg, layers_c, x), has_aux=True)
        g_h, g_x, dys = vjp_fn(self._loss_ct(x))
        return g_h, g_x, list(inputs) + list(dys), {**self._dense_stats(), **stats}  # a dense block adds 0 to loss

    def _head_loss(self, head, h, tokens):
        """``(lm loss, stats)`` of a block output ``h``: final norm, head, next-token loss."""
        logits = dense.logits_from_head(self.cfg, head, h)
        lm, (ce, z) = dense.cross_entropy(logits, tokens[:, 1:], self.cfg.z_loss)
        return lm, {"loss": lm, "ce": ce, "z_loss": z, "count": jnp.ones((), jnp.float32)}

    def _dense_stats(self) -> dict:
        return block_stats(self.cfg, dense.no_moe_aux())

    def _loss_ct(self, like: Array) -> Array:
        """The cotangent of a microbatch's loss, ``1/M``, device-varying like ``like``."""
        return dense.varying_like(jnp.asarray(1.0 / self.microbatches, jnp.float32), like)


def block_stats(cfg, aux) -> dict:
    """The loss statistics a block contributes: its MoE loss terms (in ``loss``) and MoE metrics."""
    stats = {"loss": dense.aux_loss(cfg, aux), "ce": jnp.zeros((), jnp.float32),
             "z_loss": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.float32)}
    if dense.uses_moe(cfg):
        stats.update({k: aux[k] for k in dense.MOE_METRICS})
        stats["moe_dropped"] = aux["moe_dropped"] / (cfg.n_layers // cfg.moe.every)
    return stats


def stat_names(cfg) -> list[str]:
    return ["loss", "ce", "z_loss", "count"] + (list(dense.MOE_METRICS) if dense.uses_moe(cfg) else [])


# ------------------------------------------------------------------------------------------
# Kept residuals: a vjp closure is a pytree whose leaves are the residuals.  The ring stores the
# leaves that are not the weights themselves; the backward puts the weights of the microbatch's
# version back in their places and rebuilds the closure.
# ------------------------------------------------------------------------------------------


def residuals_of(vjp_fn, layers_c) -> list:
    weights = {id(w) for w in jax.tree.leaves(layers_c)}
    return [leaf for leaf in jax.tree.leaves(vjp_fn) if id(leaf) not in weights]


@dataclasses.dataclass
class ResidualTemplate:
    """How to rebuild a block's vjp closure from stashed residuals plus the weights.

    ``treedef`` and ``where`` (for each closure leaf: ``('w', i)`` the i-th weight leaf, or
    ``('r', i)`` the i-th stashed residual) are read off the forward slot's trace; the backward
    slot, traced after it in the same step, uses them.
    """

    treedef: Any = None
    where: tuple = ()

    def record(self, vjp_fn, layers_c) -> None:
        weights = {id(w): i for i, w in enumerate(jax.tree.leaves(layers_c))}
        leaves, self.treedef = jax.tree.flatten(vjp_fn)
        where, r = [], 0
        for leaf in leaves:
            if id(leaf) in weights:
                where.append(("w", weights[id(leaf)]))
            else:
                where.append(("r", r))
                r += 1
        self.where = tuple(where)

    def rebuild(self, residuals: list, layers_c):
        weights = jax.tree.leaves(layers_c)
        leaves = [weights[i] if kind == "w" else residuals[i] for kind, i in self.where]
        return jax.tree.unflatten(self.treedef, leaves)


def residual_shapes(fns: StageFns, layers_c, x) -> list:
    """Shapes and dtypes of the residuals one forward slot stashes (abstract evaluation)."""
    if fns.recompute:
        return [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    if fns.split:
        return jax.eval_shape(lambda lp, h: fns.forward(lp, h, ResidualTemplate())[1], layers_c, x)
    return jax.eval_shape(lambda lp, h: residuals_of(jax.vjp(fns.block, lp, h, has_aux=True)[1], lp),
                          layers_c, x)


def save_shapes(fns: StageFns, layers_c, x) -> list:
    """Shapes and dtypes of the entry an ``I`` action keeps for its ``W`` (abstract evaluation)."""
    inputs, dys = jax.eval_shape(lambda lp, h: taps.input_grads(fns.cfg, lp, h, h)[2:], layers_c, x)
    return list(inputs) + list(dys)
