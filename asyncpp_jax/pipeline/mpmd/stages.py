"""The compiled actions of the ``mpmd`` placement: one small program per stage and action kind.

Each is a ``jax.jit`` of a ``shard_map`` over its own stage's devices (a ``('data', 'stage')``
mesh whose ``stage`` axis has size 1, so :class:`~asyncpp_jax.pipeline.stage.StageFns` runs as
it does inside the ``spmd`` engine), and takes only what that stage holds: stage 0's programs
the embedding, stage ``P-1``'s the final norm and head, the middle stages' their layers alone.

Arrays that differ per device (activations, cotangents, accumulators, loss sums) carry leading
``[data, 1]`` axes (``mpmd_placement.DEVICE``); the accumulators are each replica's own, summed
over ``data`` once per update (:mod:`asyncpp_jax.pipeline.mpmd.update`).  The backward recomputes
its block from the stashed input (``config.pipeline.recompute=True``), so the stash holds one
activation per microbatch and no weights.  With expert parallelism a routed expert's weights (and
their accumulators) are split over ``data`` on the stage's devices, and the MoE layers exchange
tokens with ``all_to_all`` over ``data``, as in the ``spmd`` engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.models.moe import is_expert_weight, with_expert_parallel
from asyncpp_jax.pipeline.collectives import vary
from asyncpp_jax.pipeline.mpmd.placement import DEVICE, Placement
from asyncpp_jax.pipeline.stage import (ResidualTemplate, StageFns, head_of, lookup_transpose_add, split_params,
                                        stat_names)

TOKENS = P(None, "data")  # a stage's view of the batch [M, B, T+1]


def _strip(tree):
    return jax.tree.map(lambda x: x[0, 0], tree)


def _grow(tree):
    return jax.tree.map(lambda x: x[None, None], tree)


def _add(acc, g):
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g)


class _PerParamsTree:
    """A jitted action compiled for the structure of its params argument (the specs follow the
    leaves); ``lower`` as ``jax.jit``'s, for the dry run."""

    def __init__(self, make):
        self._make, self._fns = make, {}

    def jitted(self, params):
        """The ``jax.jit`` for this params tree (``jax.export`` takes it)."""
        key = jax.tree.structure(params)
        if key not in self._fns:
            self._fns[key] = self._make(params)
        return self._fns[key]

    def __call__(self, params, *args):
        return self.jitted(params)(params, *args)

    def lower(self, params, *args):
        return self.jitted(params).lower(params, *args)


class StagePrograms:
    """The jitted actions of stage ``s`` (built once per runner; each compiles at first use)."""

    def __init__(self, model_cfg, placement: Placement, s: int, microbatches: int, expert_parallel: bool = False):
        self.s, self.mesh, self.expert_parallel = s, placement.stage_meshes[s], expert_parallel
        self.data = self.mesh.shape["data"]
        self.cfg = with_expert_parallel(model_cfg, "data", self.data) if expert_parallel else model_cfg
        self.n_stages = placement.n_stages
        self.fns = StageFns(self.cfg, microbatches, recompute=True)
        self.act = dense.dtype_of(model_cfg.compute_dtype)
        self.tied = bool(model_cfg.tie_embeddings)
        self.is_first, self.is_last = s == 0, s == self.n_stages - 1

    def param_spec(self, path, _=None):
        """A stage's view of a parameter: a routed expert's split over ``data``, the rest whole."""
        return P(None, "data") if self.expert_parallel and is_expert_weight(path) else P()

    def _jit(self, fn, in_specs, out_specs, donate=()):
        # The params (argument 0) are laid out leaf by leaf: specs from the first call's tree.
        def make(params):
            specs = (jax.tree_util.tree_map_with_path(self.param_spec, params),) + tuple(in_specs[1:])
            return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=specs, out_specs=out_specs),
                           donate_argnums=donate)

        return _PerParamsTree(make)

    def _view(self, params):
        """``(layers, top)`` in ``compute_dtype``, device-varying (their vjp is this device's own)."""
        return split_params(vary(dense.compute_view(self.cfg, params)))

    def _embed(self, top, batch, m):
        return self.fns.embed(top, batch[m]).astype(self.act)

    # ------------------------------------------------------------------------------ forward
    def forward(self):
        """Stage 0: ``(params, batch, m, sums) -> (h, sums)``; a middle stage:
        ``(params, x, sums) -> (h, sums)``; ``h`` goes to stage ``s+1``."""
        def first(params, batch, m, sums):
            layers, top = self._view(params)
            h, _, stats = self.fns.forward(layers, self._embed(top, batch, m), ResidualTemplate())
            return _grow(h.astype(self.act)), _grow(_add(_strip(sums), stats))

        def middle(params, x, sums):
            layers, _ = self._view(params)
            h, _, stats = self.fns.forward(layers, x[0, 0], ResidualTemplate())
            return _grow(h.astype(self.act)), _grow(_add(_strip(sums), stats))

        if self.is_first:
            return self._jit(first, (P(), TOKENS, P(), DEVICE), (DEVICE, DEVICE), donate=(3,))
        return self._jit(middle, (P(), DEVICE, DEVICE), (DEVICE, DEVICE), donate=(2,))

    # ----------------------------------------------------------------------------- backward
    def backward(self):
        """Stage 0: ``(params, batch, m, ct, acc) -> acc`` (the block's gradient and the lookup's
        transpose into the table's); a middle stage: ``(params, x, ct, acc) -> (g_x, acc)``."""
        def first(params, batch, m, ct, acc):
            layers, top = self._view(params)
            acc = _strip(acc)
            tokens = batch[m]
            g_l, g_x = self.fns.backward(layers, None, lambda: self._embed(top, batch, m), ct[0, 0],
                                         ResidualTemplate())
            table = lookup_transpose_add(acc["table"], tokens[:, :-1], g_x.astype(jnp.float32), self.tied)
            return _grow({"layers": _add(acc["layers"], g_l), "table": table})

        def middle(params, x, ct, acc):
            layers, _ = self._view(params)
            g_l, g_x = self.fns.backward(layers, None, lambda: x[0, 0], ct[0, 0], ResidualTemplate())
            return _grow(g_x.astype(self.act)), _add(acc, _grow({"layers": g_l}))

        if self.is_first:
            return self._jit(first, (P(), TOKENS, P(), DEVICE, DEVICE), DEVICE, donate=(4,))
        return self._jit(middle, (P(), DEVICE, DEVICE, DEVICE), (DEVICE, DEVICE), donate=(3,))

    def last(self):
        """Stage ``P-1``: ``(params, x, batch, m, acc, sums) -> (g_x, acc, sums)``: block, final
        norm, head and loss of one microbatch as one fused vjp (its forward runs once)."""
        def fn(params, x, batch, m, acc, sums):
            layers, top = self._view(params)
            g_l, g_h, g_x, stats = self.fns.last(layers, head_of(self.cfg, top), x[0, 0], batch[m])
            acc = _add(acc, _grow({"layers": g_l, "head": g_h}))
            return _grow(g_x.astype(self.act)), acc, _grow(_add(_strip(sums), stats))

        return self._jit(fn, (P(), DEVICE, TOKENS, P(), DEVICE, DEVICE), (DEVICE, DEVICE, DEVICE), donate=(4, 5))

    # ---------------------------------------------------------------------------- eval
    def eval_forward(self, microbatch_rows: int):
        """Forward only, on a replica's rows cut into microbatches of ``microbatch_rows``: stage 0
        ``(params, batch, m) -> h``, a middle stage ``(params, x) -> h``, the last
        ``(params, x, batch, m) -> (sum of token losses, tokens)`` per replica."""
        def rows(batch, m):
            b = min(microbatch_rows, batch.shape[0])
            return batch.reshape(-1, b, batch.shape[-1])[m]

        def first(params, batch, m):
            layers, top = self._view(params)
            (h, _), _ = self.fns.block(layers, self.fns.embed(top, rows(batch, m)).astype(self.act))
            return _grow(h.astype(self.act))

        def middle(params, x):
            layers, _ = self._view(params)
            (h, _), _ = self.fns.block(layers, x[0, 0])
            return _grow(h.astype(self.act))

        def last(params, x, batch, m):
            layers, top = self._view(params)
            (h, _), _ = self.fns.block(layers, x[0, 0])
            logits = dense.logits_from_head(self.cfg, head_of(self.cfg, top), h).astype(jnp.float32)
            targets = rows(batch, m)[:, 1:]
            lse = jax.nn.logsumexp(logits, axis=-1)
            tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
            return _grow(vary(jnp.sum(lse - tgt))), _grow(vary(jnp.float32(tgt.size)))

        if self.is_first:
            return self._jit(first, (P(), P("data"), P()), DEVICE)
        if self.is_last:
            return self._jit(last, (P(), DEVICE, P("data"), P()), (DEVICE, DEVICE))
        return self._jit(middle, (P(), DEVICE), DEVICE)

    # ---------------------------------------------------------------------- buffers
    def zeros(self, params_abstract, data: int):
        """``() -> (acc, sums)``: this stage's accumulators and loss sums for one batch, zero."""
        layers_abs, top_abs = split_params(params_abstract)
        n = self.n_stages

        def local_layers(path, x):
            shape = (x.shape[0] // n,) + x.shape[1:]
            if self.expert_parallel and is_expert_weight(path):  # this device's experts only
                shape = (shape[0], shape[1] // data) + shape[2:]
            return jax.ShapeDtypeStruct((data, 1) + shape, jnp.float32)

        shapes = {"layers": jax.tree_util.tree_map_with_path(local_layers, layers_abs)}
        if self.is_first:
            table = top_abs["embed"]["embedding"]
            shapes["table"] = jax.ShapeDtypeStruct((data, 1) + table.shape, jnp.float32)
        if self.is_last:
            head = jax.eval_shape(lambda t: head_of(self.cfg, t), top_abs)
            shapes["head"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct((data, 1) + x.shape, jnp.float32), head)
        sums = {k: jax.ShapeDtypeStruct((data, 1), jnp.float32) for k in stat_names(self.cfg)}
        sharding = NamedSharding(self.mesh, DEVICE)
        out = (shapes, sums)
        make = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), out),
                       out_shardings=jax.tree.map(lambda _: sharding, out))
        return make, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), out)

    def activation(self, rows: int, seq_len: int, data: int) -> jax.ShapeDtypeStruct:
        """One activation (or cotangent) held on this stage: ``[data, 1, b, T, D]``."""
        return jax.ShapeDtypeStruct((data, 1, rows, seq_len, self.cfg.d_model), self.act,
                                    sharding=NamedSharding(self.mesh, DEVICE))
