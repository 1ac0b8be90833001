"""The tick loop of one pipeline step: each device runs its stage's forward and backward slots
as the tick table says, accumulates the gradients of the batches in flight, and reduces them at
the end of the step (:func:`make_grads_fn`).

Per tick (:mod:`asyncpp_jax.pipeline.tick_tables` says which microbatch), each stage runs a
forward slot and a backward slot, each under a ``lax.cond`` on whether the tick table gives it
work: an idle slot computes nothing (and so cannot let a NaN through).  Inside a slot, further
conds pick the weight version (:meth:`~asyncpp_jax.pipeline.tick_tables.OneStepDelay.run`) and
stage 0's embedding; each returns only activation-sized values, and the slot's cond alone writes
the stash ring and the accumulators.  Merged into one ``lax.switch`` whose branches each write the
stash (idle / stage 0 / other stages, or one per weight version), XLA:CPU copied the whole ring in
every branch at every slot (25 copies of the stash entries per forward slot in the benchmark's
compiled step, against none).

Activations go to ``s+1`` and input cotangents to ``s-1`` with ``lax.ppermute`` once per tick.  With
``recompute`` the backward slot recomputes the stage's block from its stashed input; without,
the forward slot stashes the block's autodiff residuals.  The last stage's forward and backward
of a microbatch share a tick and run as one fused ``vjp``.  Activations, cotangents and the stash
are in ``compute_dtype``, as in the simulate runner.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.pipeline import tick_tables, vocab_parallel
from asyncpp_jax.pipeline.collectives import hop_perms, mean_over_data, reduce_top, vary
from asyncpp_jax.pipeline.layout import on_data_axis, param_specs, update_specs
from asyncpp_jax.pipeline.stage import (ResidualTemplate, StageFns, chunk_rows, head_of, is_first_virtual,
                                        is_last_virtual, join_params, lookup_transpose_add, residual_shapes,
                                        split_params, stat_names, table_size)
from asyncpp_jax.pipeline.state import PipelineState, pipeline_state_specs
from asyncpp_jax.pipeline.tick_tables import OneStepDelay
from asyncpp_jax.train_state import BATCH_SPEC


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


def _put(ring: list, at, entry: list) -> list:
    """``ring[i][at] = entry[i]`` for each array of a buffer entry."""
    return [r.at[at].set(e.astype(r.dtype)) for r, e in zip(ring, entry)]


def _lookup_transpose_add(acc, tokens, ct, i, axis: int, tied: bool, keep):
    """:func:`~asyncpp_jax.pipeline.stage.lookup_transpose_add` into accumulator ``i`` of a whole
    table (``axis``: :func:`_acc_axis`).  Where ``keep`` is false nothing is added: the ids point
    past the table and are dropped, so a device with no embedding gradient in this slot skips the
    scatter's strided writes."""
    return lookup_transpose_add(acc, jnp.where(keep, tokens, table_size(acc, tied, i, axis)), ct, tied, i, axis)


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
    chunks: int = 1  # model chunks on this device (interleaved: virtual stage chunk * P + stage)
    vocab_parallel: bool = False  # the tables split over stage (:mod:`asyncpp_jax.pipeline.vocab_parallel`)

    @property
    def tied(self) -> bool:
        return self.fns.cfg.tie_embeddings

    @property
    def is_first(self):
        return self.stage == 0

    @property
    def is_last(self):
        return self.stage == self.n_stages - 1

    def first(self, chunk):
        """Whether ``chunk`` of this device is the first virtual stage (it embeds the tokens)."""
        return is_first_virtual(self.stage, chunk, self.chunks)

    def final(self, chunk):
        """Whether ``chunk`` of this device is the last virtual stage (head and loss)."""
        return is_last_virtual(self.stage, self.n_stages, chunk, self.chunks)

    def chunk_of(self, layers, chunk):
        """The rows of ``chunk`` in this device's layer stack (:func:`layout.interleave_index`)."""
        return chunk_rows(layers, chunk, self.chunks)

    def add_layers(self, acc_l, i, g, chunk):
        """``acc_l[i] += g``, a chunk's gradient added to that chunk's rows of the stack."""
        if self.chunks == 1:
            return _add_at(acc_l, i, g)

        def one(a, x):
            start = (i, chunk * x.shape[0]) + (0,) * (x.ndim - 1)
            return jax.lax.dynamic_update_slice(
                a, jax.lax.dynamic_slice(a, start, (1,) + x.shape) + x[None].astype(a.dtype), start)

        return jax.tree.map(one, acc_l, g)

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

    def _input(self, j, received, chunk, embedded=None):
        """The block's input: the embedded tokens on the first virtual stage, else ``received``."""
        if embedded is not None:
            return jnp.where(self.first(chunk), embedded, received)
        return jax.lax.cond(self.first(chunk), lambda: self.embed(j, self.tokens_of(j)), lambda: received)

    @_scoped("pp_fwd")
    def forward(self, j, fwd_buf, at, stash, sums, chunk=0, embedded=None):
        """Stages ``0..P-2``: the block (of ``chunk``) on the embedded tokens or the received
        activation; the backward's entry into entry ``at`` of the stash ring.  ``embedded``: the
        first stage's input when the caller has looked it up (the vocabulary-parallel lookup is a
        collective, run outside this device's cond)."""
        x = self._input(j, fwd_buf, chunk, embedded)
        h, entry, stats = self.run(j, lambda lp: self.fns.forward(self.chunk_of(lp, chunk), x, self.template), 0)
        stash = _put(stash, at, entry)
        return stash, _add_at(sums, self.delay.accumulator(j), stats), h.astype(self.act_dtype)

    @_scoped("pp_bwd")
    def backward(self, j, bwd_buf, at, stash, acc_l, chunk=0, embedded=None):
        """Stages ``0..P-2``: the block's (``chunk``'s) vjp from stash entry ``at``; on stage 0 the
        input cotangent goes into the embedding's gradient (the lookup's transpose, in :meth:`tick`)."""
        i = self.delay.accumulator(j)
        entry = [ring[at] for ring in stash]
        x_again = lambda: self._input(j, entry[0], chunk, embedded)  # noqa: E731
        g_l, g_x = self.run(j, lambda lp: self.fns.backward(self.chunk_of(lp, chunk), entry, x_again, bwd_buf,
                                                            self.template), 0)
        return self.add_layers(acc_l, i, g_l, chunk), g_x.astype(self.act_dtype)

    @_scoped("pp_bwd")
    def input_grad(self, j, bwd_buf, at, stash, save, save_at, chunk=0, embedded=None):
        """``I`` on stages ``0..P-2``: the input cotangent from stash entry ``at``, no weight
        gradient; what its ``W`` needs goes into entry ``save_at`` of the ``save`` ring."""
        entry = [ring[at] for ring in stash]
        x_again = lambda: self._input(j, entry[0], chunk, embedded)  # noqa: E731
        g_x, kept = self.run(j, lambda lp: self.fns.input_grad(self.chunk_of(lp, chunk), entry, x_again, bwd_buf,
                                                               self.template), 0)
        return _put(save, save_at, kept), g_x.astype(self.act_dtype)

    @_scoped("pp_last")
    def last_input(self, j, fwd_buf, acc_t, sums, save, save_at):
        """``I`` on the last stage: block, head and loss as one vjp (the head's gradient included);
        the layers' ``W`` input into entry ``save_at``."""
        i, tokens, c = self.delay.accumulator(j), self.tokens_of(j), self.chunks - 1
        g_h, g_x, kept, stats = self.delay.run(
            j, lambda w: self.fns.last_input(self.chunk_of(w[0], c), w[2], fwd_buf, tokens), self.cur, self.prev)
        acc_t = {**acc_t, "head": _add_at(acc_t["head"], i, g_h, self.top_axes["head"])}
        return acc_t, _add_at(sums, i, stats), _put(save, save_at, kept), g_x.astype(self.act_dtype)

    @_scoped("pp_bwd")
    def weight_grad(self, j, save, at, acc_l, chunk=0):
        """``W``: the layers' gradient from entry ``at`` of the ``save`` ring, into ``acc_l``."""
        entry = [ring[at] for ring in save]
        g_l = self.run(j, lambda lp: self.fns.weight_grad(self.chunk_of(lp, chunk), entry), 0)
        return self.add_layers(acc_l, self.delay.accumulator(j), g_l, chunk)

    @_scoped("pp_last")
    def last(self, j, fwd_buf, acc_l, acc_t, sums):
        """Stage ``P-1`` (its last chunk): block, final norm, head and loss of microbatch ``j`` as
        one fused vjp."""
        i, tokens, c = self.delay.accumulator(j), self.tokens_of(j), self.chunks - 1
        g_l, g_h, g_x, stats = self.delay.run(
            j, lambda w: self.fns.last(self.chunk_of(w[0], c), w[2], fwd_buf, tokens), self.cur, self.prev)
        acc_t = {**acc_t, "head": _add_at(acc_t["head"], i, g_h, self.top_axes["head"])}
        return self.add_layers(acc_l, i, g_l, c), acc_t, _add_at(sums, i, stats), g_x.astype(self.act_dtype)

    @_scoped("pp_embed_grad")
    def lookup_transpose_add(self, acc_t, tokens, ct, i, keep):
        """Stage 0's embedding gradient, added to accumulator ``i`` (of a tied table: in the head's
        ``[D, V]`` accumulator, which the last stage also adds to).  Whole tables: only where
        ``keep`` (this device ran the first stage's backward in this slot; ``ct`` is zeros
        elsewhere).  Split tables: on every device (``keep`` unused), each its own block's rows."""
        if self.vocab_parallel:  # split over its vocabulary, every device adds its own block's tokens
            add = vocab_parallel.lookup_transpose_add
        else:  # whole tables: the scatter's column writes into [D, V] cost ~1 ms per call on a CPU core
            add = functools.partial(_lookup_transpose_add, keep=keep)
        if self.tied:
            w = add(acc_t["head"]["w"], tokens, ct, i, self.top_axes["head"]["w"], True)
            return {**acc_t, "head": {**acc_t["head"], "w": w}}
        table = add(acc_t["embed"]["embedding"], tokens, ct, i, self.top_axes["embed"]["embedding"], False)
        return {**acc_t, "embed": {"embedding": table}}

    @_scoped("pp_tick")
    def tick(self, carry, row):
        """One tick: a forward slot and a backward slot, each a ``lax.cond`` on the table (idle
        slots compute nothing), then the activation to ``s+1`` and the cotangent to ``s-1``."""
        stash, fwd_buf, bwd_buf, acc_l, acc_t, sums = carry
        jf, jb = row[0], row[1]
        stash, sums, h_out = jax.lax.cond(
            self.delay.live(jf) & ~self.is_last, lambda st, su: self.forward(jf, fwd_buf, self.slot(jf), st, su),
            lambda st, su: (st, su, jnp.zeros_like(fwd_buf)), stash, sums)
        live = self.delay.live(jb)
        # Two conds, not one with a branch per slot kind: a buffer that a branch passes through
        # unchanged is copied by XLA at the branch's end, so each cond takes only what its slot
        # writes (the head's vocabulary-sized accumulator goes through the last stage's alone).
        acc_l, g_x = jax.lax.cond(live & ~self.is_last, lambda al: self.backward(jb, bwd_buf, self.slot(jb), stash, al),
                                  lambda al: (al, jnp.zeros_like(bwd_buf)), acc_l)
        acc_l, acc_t, sums, g_x = jax.lax.cond(live & self.is_last,
                                               lambda al, at, su, _: self.last(jb, fwd_buf, al, at, su),
                                               lambda *a: a, acc_l, acc_t, sums, g_x)
        # Stage 0's input cotangent into the embedding's gradient rows, outside the conds (on every
        # stage; where ``keep`` is false the indices are dropped): updated inside a cond branch, XLA
        # copies the whole vocabulary-sized accumulator at every backward slot.
        keep = self.is_first & live
        ct = jnp.where(keep, g_x, jnp.zeros_like(g_x)).astype(jnp.float32)
        acc_t = self.lookup_transpose_add(acc_t, self.tokens_of(jb)[:, :-1], ct, self.delay.accumulator(jb), keep)
        fwd_buf, bwd_buf = send(self.n_stages, h_out, g_x)
        return (stash, fwd_buf, bwd_buf, acc_l, acc_t, sums), None


def send(n_stages: int, h_out, g_x):
    """One tick's hops: each stage's forward output to the next stage, its input cotangent to the
    previous one; returns what each stage receives."""
    with jax.named_scope("pp_send"):
        fwd_perm, bwd_perm = hop_perms(n_stages)
        return jax.lax.ppermute(h_out, "stage", fwd_perm), jax.lax.ppermute(g_x, "stage", bwd_perm)


@_scoped("pp_versions")
def _versions(model_cfg, params):
    """(layers, top, head) of a weight version in ``compute_dtype``, device-varying; the head
    ``[D, V]`` (:func:`stage.head_of`: a tied table is held in that layout, so nothing is
    transposed)."""
    layers, top = split_params(vary(dense.compute_view(model_cfg, params)))
    return layers, top, head_of(model_cfg, top)


@dataclasses.dataclass(frozen=True)
class TickLoop:
    """The tick tables' loop: one forward and one backward slot per tick (:meth:`_Device.tick`), a
    stash ring of ``stash_slots`` entries indexed by the microbatch's place in the stream, one
    activation and one cotangent in transit."""

    table: tick_tables.TickTable
    recompute: bool = True

    @property
    def n_stages(self) -> int:
        return self.table.n_stages

    @property
    def microbatches(self) -> int:
        return self.table.microbatches

    @property
    def schedule(self) -> tick_tables.TickTable:
        return self.table

    @property
    def chunks(self) -> int:
        return 1

    @property
    def split(self) -> bool:
        return False

    def rows(self) -> np.ndarray:
        """``[ticks, P, 2]``: each tick's (forward, backward) microbatch per stage."""
        return np.stack([self.table.forward, self.table.backward], axis=-1)

    def buffers(self, fns: StageFns, layers, x):
        """``(stash, fwd_buf, bwd_buf)`` of a step that starts empty; ``x`` one activation."""
        S = tick_tables.stash_slots(self.n_stages, first_stage_stashes=not self.recompute)
        stash = [vary(jnp.zeros((S,) + e.shape, e.dtype)) for e in residual_shapes(fns, layers, x)]
        return stash, x, x

    def body(self, dev: "_Device"):
        return dev.tick


def make_grads_fn(model_cfg, mesh, loop, is_async: bool, carries_state: bool, params_abstract,
                  expert_parallel: bool = False, recompute: bool = True, stage_rows: tuple | None = None):
    """``shard_map``-ped ``(cur, prev, batch, pstate, prev_live, step) -> (grads, stats, pstate)``.

    ``loop`` says how the step's slots run: :class:`TickLoop`, or a program's lock-step slots
    (:class:`asyncpp_jax.pipeline.program_executor.SlotLoop`): its ``rows()`` are scanned, each
    stage taking its column (every stage's, when ``loop.whole_rows``), through ``body(dev)``, from
    the buffers ``buffers(...)`` makes.  A loop with ``vocab_parallel``
    (:class:`asyncpp_jax.pipeline.vocab_loop.VocabTickLoop`) runs the vocabulary-sized tables split
    over ``stage``, and the specs and reductions here follow it."""
    n_stages, M = loop.n_stages, loop.microbatches
    fns = StageFns(model_cfg, M, recompute, stage_rows, split=loop.split)
    act_dtype = dense.dtype_of(model_cfg.compute_dtype)
    vocab_parallel = getattr(loop, "vocab_parallel", False)
    pspec = param_specs(params_abstract, expert_parallel, vocab_parallel)
    uspec = update_specs(params_abstract, n_stages, expert_parallel, vocab_parallel)
    tied = model_cfg.tie_embeddings
    top_specs = _top_acc_specs(model_cfg, uspec)
    rows = loop.rows()

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
            stash, fwd_buf, bwd_buf = loop.buffers(fns, cur_v[0], vary(jnp.zeros((b, T, model_cfg.d_model), act_dtype)))
            prev_batch = batch
        delay = OneStepDelay(is_async, prev_live)
        n_acc = delay.accumulators
        # The embedding's lookup gradient (stage 0) and the head's (stage P-1, as [D, V]); a tied
        # table has one accumulator, in its (the head's) layout, for both.  Each replicated leaf's
        # accumulators are stacked along the axis _acc_axis gives it, the layers' in front.
        top_acc = {"head": cur_v[2]} if tied else {"embed": cur_v[1]["embed"], "head": cur_v[2]}
        top_axes = jax.tree.map(lambda x, sp: _acc_axis(sp, x.ndim), top_acc, top_specs)
        stacked = lambda x, ax: jnp.zeros(x.shape[:ax] + (n_acc,) + x.shape[ax:], jnp.float32)  # noqa: E731
        acc_l = vary(jax.tree.map(lambda x: stacked(x, 0), cur_v[0]))
        acc_t = vary(jax.tree.map(stacked, top_acc, top_axes))
        slots = stash[0].shape[0]
        dev = _Device(fns, delay, s, n_stages, cur_v, prev_v, batch, prev_batch, step, slots, act_dtype, top_axes,
                      chunks=loop.chunks, vocab_parallel=vocab_parallel)
        sums0 = vary({k: jnp.zeros((n_acc,), jnp.float32) for k in stat_names(model_cfg)})
        carry = (stash, fwd_buf, bwd_buf, acc_l, acc_t, sums0)
        xs = rows if getattr(loop, "whole_rows", False) else jnp.take(rows, s, axis=1)
        carry, _ = jax.lax.scan(loop.body(dev), carry, xs)
        return _finish(model_cfg, carry, pstate, cur, batch, prev_live, is_async, carries_state, top_specs,
                       top_axes, expert_parallel, vocab_parallel)

    def grads_fn(cur, prev, batch, pstate, prev_live, step):
        sspec = pipeline_state_specs(params_abstract, pstate, expert_parallel, vocab_parallel)
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


def _is_table_accumulator(path) -> bool:
    """Whether an accumulator (laid out as :func:`_top_acc_specs`) is a vocabulary-sized table's:
    the embedding's, or the head's ``w`` (a tied table's one accumulator among them)."""
    return path[0].key == "embed" or path[-1].key == "w"


def _reduce_accumulators(model_cfg, acc_l, acc_t, sums, n_acc, top_specs, top_axes, vocab_parallel=False):
    """The step's accumulators -> ``[(this replica's gradient laid out as update_specs, loss sums)]``,
    one per batch they hold.  The replicated leaves are reduced over ``stage`` once for all
    batches (a table split over its vocabulary is not: each device's block is whole); the
    reduction over ``data`` is the caller's, once per batch's whole gradient."""
    def reduce(path, acc, spec, axis):
        own_block = vocab_parallel and _is_table_accumulator(path)
        return acc if own_block else reduce_top(acc, spec, axis)

    summed = jax.tree_util.tree_map_with_path(reduce, acc_t, top_specs, top_axes)
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
            expert_parallel, vocab_parallel=False):
    """The end of a step: the applied batch's gradient and loss (accumulator 0, joined under
    ``2bw`` with its head carried in as ``grad_partial``), and the in-flight state to carry."""
    stash, fwd_buf, bwd_buf, acc_l, acc_t, sums = carry
    n_acc = jax.tree.leaves(acc_l)[0].shape[0]  # OneStepDelay.accumulators: 2 under the delayed table
    reduced = _reduce_accumulators(model_cfg, acc_l, acc_t, sums, n_acc, top_specs, top_axes, vocab_parallel)
    grads, totals = reduced[0]
    new = None
    if carries_state:
        if is_async:  # batch t-1's head, carried from the previous step, joins its tail before the reduction
            keep = lambda a, p: a + jnp.where(prev_live, p, jnp.zeros_like(p))  # noqa: E731
            grads = jax.tree.map(keep, grads, on_data_axis(pstate.grad_partial, expert_parallel, add=False))
            totals = jax.tree.map(keep, totals, pstate.stats_partial)
            partial, partial_sums = reduced[1]
        else:
            partial = jax.tree.map(jnp.zeros_like, grads)
            partial_sums = jax.tree.map(jnp.zeros_like, totals)
        partial = on_data_axis(partial, expert_parallel, add=True)
        grow = lambda x: x[None, None]  # noqa: E731
        new = PipelineState(prev_params=cur, stash=[grow(r) for r in stash], fwd_buf=grow(fwd_buf),
                            bwd_buf=grow(bwd_buf), grad_partial=partial, stats_partial=partial_sums,
                            prev_batch=batch)
    grads = mean_over_data(grads, expert_parallel)  # once per batch: its head and tail together
    count = totals.pop("count")  # 0 at a fill update: no batch's gradient is applied, so no loss
    stats = {k: v / count for k, v in totals.items()}
    stats["loss_microbatches"] = count
    return grads, stats, new
