"""One pipeline step of any program: each device runs its rows of the program's lock-step slots,
accumulates the gradients of the batches in flight, and reduces them at the end of the step
(:func:`make_grads_fn`).

:mod:`asyncpp_jax.pipeline.schedules.slot_plan` compiles a validated program (:mod:`~asyncpp_jax.pipeline.schedules.programs`)
into rows; :class:`asyncpp_jax.pipeline.spmd.loop.SlotLoop` is the scan body that runs a row
with the slot computations of :class:`Device` here.  Everything a schedule decides is read off the
program: which microbatch a slot runs, which weight version it reads (its batch's: ``w[t+k]`` for
batch ``t+k``, ``k <= 0``), and which update its gradient joins (stage ``u``'s gradient of batch
``t+k`` is applied at update ``t+k+d_u``, ``d_u`` the program's stage delay).  A flushless program's
buffers (stash, activations and cotangents in transit), its weight versions, the tokens of the
batches in flight and the partial gradients of later updates cross the step boundary in
:class:`~asyncpp_jax.pipeline.spmd.state.PipelineState`, so they are checkpointed.

Each slot kind runs under its own ``lax.cond`` (an idle slot computes nothing, so it cannot let a
NaN through); inside a slot, further conds pick the weight version and the first stage's
embedding; each returns only activation-sized values, and the slot's cond alone writes the stash
ring and the accumulators (merged into one ``lax.switch`` whose branches each write the stash,
XLA:CPU copied the whole ring in every branch at every slot).  With ``recompute`` the backward
recomputes the stage's block from its stashed input; without, the forward stashes the block's
autodiff residuals.  The last stage's forward and backward of a microbatch run as one fused
``vjp``.  Activations, cotangents and the stash are in ``compute_dtype``, as in the simulate runner.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.pipeline.schedules.programs import Offsets
from asyncpp_jax.pipeline.schedules.slot_plan import IDLE  # no action in this column of a slot
from asyncpp_jax.pipeline.collectives import mean_over_data, reduce_top, vary
from asyncpp_jax.pipeline.options import EngineOptions
from asyncpp_jax.pipeline.layout import on_data_axis, param_specs, update_specs
from asyncpp_jax.pipeline.stage import (ResidualTemplate, StageFns, chunk_rows, head_of, is_first_virtual,
                                        is_last_virtual, join_params, split_params, stat_names)
from asyncpp_jax.pipeline.spmd.state import pipeline_state_specs
from asyncpp_jax.train_state import BATCH_SPEC


def add_at(acc, i, tree, axes=None):
    """``acc[i] += tree`` leaf by leaf, ``i`` indexing each leaf's accumulator axis: the leading one
    (``axes=None``), or per leaf as ``axes`` says (:func:`_acc_axis`); ``i`` one index, or a tree
    of them like ``acc`` (each leaf's update offset)."""
    if isinstance(i, dict):  # a prefix of acc: each subtree's offset
        i = jax.tree.map(lambda k, sub: jax.tree.map(lambda _: k, sub), i, acc)
    else:
        i = jax.tree.map(lambda _: i, acc)
    if axes is None:
        return jax.tree.map(lambda a, g, k: a.at[k].add(g.astype(a.dtype)), acc, tree, i)
    return jax.tree.map(lambda a, g, ax, k: a.at[(slice(None),) * ax + (k,)].add(g.astype(a.dtype)),
                        acc, tree, axes, i)


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


def put(ring: list, at, entry: list) -> list:
    """``ring[i][at] = entry[i]`` for each array of a buffer entry."""
    return [r.at[at].set(e.astype(r.dtype)) for r, e in zip(ring, entry)]


def scoped(name: str):
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
class Device:
    """One device's view of a step inside the ``shard_map``: its stage, the weight versions in
    flight (in ``compute_dtype``, the head as ``[D, V]``), the batches in flight, and the slot
    computations.  Each method is one slot kind, run under the caller's cond."""

    fns: StageFns
    stage: Any  # this device's stage index (traced)
    n_stages: int
    versions: tuple  # (layers, top, head) of w[t], w[t-1], ..., w[t-D]: version k of batch t-k
    batches: jax.Array  # [D + 1, M, B, T + 1]: the tokens of batch t, t-1, ..., t-D
    live: jax.Array  # bool [D + 1]: whether batch t-k ran this program (k > 0: else its actions are skipped)
    offsets: Offsets
    act_dtype: Any
    top_axes: Any  # the replicated leaves' accumulator axes (:func:`_acc_axis`), a tree like their accumulators
    template: ResidualTemplate = dataclasses.field(default_factory=ResidualTemplate)
    chunks: int = 1  # model chunks on this device (interleaved: virtual stage chunk * P + stage)
    tables: Any = None  # where the vocabulary-sized tables live (:mod:`asyncpp_jax.pipeline.spmd.tables`)

    @property
    def tied(self) -> bool:
        return self.fns.cfg.tie_embeddings

    @property
    def is_first(self):
        return self.stage == 0

    @property
    def is_last(self):
        return self.stage == self.n_stages - 1

    @property
    def cur(self) -> tuple:
        return self.versions[0]

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
            return add_at(acc_l, i, g)

        def one(a, x):
            start = (i, chunk * x.shape[0]) + (0,) * (x.ndim - 1)
            return jax.lax.dynamic_update_slice(
                a, jax.lax.dynamic_slice(a, start, (1,) + x.shape) + x[None].astype(a.dtype), start)

        return jax.tree.map(one, acc_l, g)

    # ---- what a microbatch's step-relative index j says (j < 0: an earlier batch's)

    def age(self, j):
        """``-k`` for microbatch ``j`` of batch ``t + k`` (0 for this step's), clipped to the versions held."""
        return jnp.clip(-jnp.floor_divide(j, self.fns.microbatches), 0, len(self.versions) - 1)

    def is_live(self, j):
        """Whether microbatch ``j`` runs: a slot's action (not ``IDLE``) of a batch this program started."""
        return (j != IDLE) & self.live[self.age(j)]

    def tokens_of(self, j):
        return self.batches[self.age(j), jnp.mod(j, self.fns.microbatches)]

    def run(self, j, fn, part=None):
        """``fn`` of microbatch ``j``'s weights, its batch's version (``part`` 0: layers, 1: top,
        2: head; None: the whole tuple), read in place: a ``lax.cond`` (two versions) or
        ``lax.switch`` on the version, not an elementwise select over the weights at every slot."""
        pick = (lambda v: v) if part is None else (lambda v: v[part])
        if len(self.versions) == 1:
            return fn(pick(self.versions[0]))
        if len(self.versions) == 2:
            return jax.lax.cond(j < 0, lambda: fn(pick(self.versions[1])), lambda: fn(pick(self.versions[0])))
        return jax.lax.switch(self.age(j), [functools.partial(lambda v: fn(pick(v)), v) for v in self.versions])

    def offset(self, j, delay):
        """The update offset of a gradient of microbatch ``j`` on a stage of ``delay``."""
        return jnp.floor_divide(j, self.fns.microbatches) + delay

    def slot(self, group: str, offset):
        """The accumulator of ``group`` that holds update ``offset``: its place among the offsets the
        program reaches (:meth:`Offsets.slots`); one past them (an add that is dropped) for an
        offset it never reaches, which only a skipped action computes."""
        reached = self.offsets.slots(group)
        if reached == tuple(range(len(reached))):
            return offset
        table = [reached.index(o) if o in reached else len(reached) for o in range(reached[-1] + 1)]
        inside = (offset >= 0) & (offset <= reached[-1])
        return jnp.where(inside, jnp.asarray(table, jnp.int32)[jnp.clip(offset, 0, reached[-1])], len(reached))

    def layer_slot(self, j, chunk):
        delay = jnp.asarray(self.offsets.delays, jnp.int32)[chunk * self.n_stages + self.stage]
        return self.slot("layers", self.offset(j, delay))

    def head_slots(self, j) -> dict:
        return {k: self.slot(g, self.offset(j, self.offsets.delay(g))) for k, g in self.offsets.head_groups().items()}

    def stats_slot(self, j):
        return self.slot("stats", self.offset(j, self.offsets.delay("stats")))

    def embed_slot(self, j):
        return self.slot("embed", self.offset(j, self.offsets.delay("embed")))

    def embed(self, j, tokens):
        return self.run(j, lambda top: self.fns.embed(top, tokens), 1).astype(self.act_dtype)

    def _input(self, j, received, chunk, embedded=None):
        """The block's input: the embedded tokens on the first virtual stage, else ``received``."""
        if embedded is not None:
            return jnp.where(self.first(chunk), embedded, received)
        return jax.lax.cond(self.first(chunk), lambda: self.embed(j, self.tokens_of(j)), lambda: received)

    @scoped("pp_fwd")
    def forward(self, j, fwd_buf, at, stash, sums, chunk=0, embedded=None):
        """Stages ``0..P-2``: the block (of ``chunk``) on the embedded tokens or the received
        activation; the backward's entry into entry ``at`` of the stash ring.  ``embedded``: the
        first stage's input when the caller has looked it up (the vocabulary-parallel lookup is a
        collective, run outside this device's cond)."""
        x = self._input(j, fwd_buf, chunk, embedded)
        h, entry, stats = self.run(j, lambda lp: self.fns.forward(self.chunk_of(lp, chunk), x, self.template), 0)
        stash = put(stash, at, entry)
        return stash, add_at(sums, self.stats_slot(j), stats), h.astype(self.act_dtype)

    @scoped("pp_bwd")
    def backward(self, j, bwd_buf, at, stash, acc_l, chunk=0, embedded=None):
        """Stages ``0..P-2``: the block's (``chunk``'s) vjp from stash entry ``at``; on stage 0 the
        input cotangent goes into the embedding's gradient (the lookup's transpose, by the loop)."""
        entry = [ring[at] for ring in stash]
        x_again = lambda: self._input(j, entry[0], chunk, embedded)  # noqa: E731
        g_l, g_x = self.run(j, lambda lp: self.fns.backward(self.chunk_of(lp, chunk), entry, x_again, bwd_buf,
                                                            self.template), 0)
        return self.add_layers(acc_l, self.layer_slot(j, chunk), g_l, chunk), g_x.astype(self.act_dtype)

    @scoped("pp_bwd")
    def input_grad(self, j, bwd_buf, at, stash, save, save_at, chunk=0, embedded=None):
        """``I`` on stages ``0..P-2``: the input cotangent from stash entry ``at``, no weight
        gradient; what its ``W`` needs goes into entry ``save_at`` of the ``save`` ring."""
        entry = [ring[at] for ring in stash]
        x_again = lambda: self._input(j, entry[0], chunk, embedded)  # noqa: E731
        g_x, kept = self.run(j, lambda lp: self.fns.input_grad(self.chunk_of(lp, chunk), entry, x_again, bwd_buf,
                                                               self.template), 0)
        return put(save, save_at, kept), g_x.astype(self.act_dtype)

    @scoped("pp_last")
    def last_input(self, j, fwd_buf, acc_t, sums, save, save_at):
        """``I`` on the last stage: block, head and loss as one vjp (the head's gradient included);
        the layers' ``W`` input into entry ``save_at``."""
        tokens, c = self.tokens_of(j), self.chunks - 1
        g_h, g_x, kept, stats = self.run(
            j, lambda w: self.fns.last_input(self.chunk_of(w[0], c), w[2], fwd_buf, tokens))
        acc_t = {**acc_t, "head": add_at(acc_t["head"], self.head_slots(j), g_h, self.top_axes["head"])}
        return acc_t, add_at(sums, self.stats_slot(j), stats), put(save, save_at, kept), g_x.astype(self.act_dtype)

    @scoped("pp_bwd")
    def weight_grad(self, j, save, at, acc_l, chunk=0):
        """``W``: the layers' gradient from entry ``at`` of the ``save`` ring, into ``acc_l``."""
        entry = [ring[at] for ring in save]
        g_l = self.run(j, lambda lp: self.fns.weight_grad(self.chunk_of(lp, chunk), entry), 0)
        return self.add_layers(acc_l, self.layer_slot(j, chunk), g_l, chunk)

    @scoped("pp_last")
    def last(self, j, fwd_buf, acc_l, acc_t, sums):
        """Stage ``P-1`` (its last chunk): block, final norm, head and loss of microbatch ``j`` as
        one fused vjp."""
        tokens, c = self.tokens_of(j), self.chunks - 1
        g_l, g_h, g_x, stats = self.run(j, lambda w: self.fns.last(self.chunk_of(w[0], c), w[2], fwd_buf, tokens))
        acc_t = {**acc_t, "head": add_at(acc_t["head"], self.head_slots(j), g_h, self.top_axes["head"])}
        return (self.add_layers(acc_l, self.layer_slot(j, c), g_l, c), acc_t,
                add_at(sums, self.stats_slot(j), stats), g_x.astype(self.act_dtype))

    @scoped("pp_embed_grad")
    def lookup_transpose_add(self, acc_t, tokens, ct, i, keep):
        """Stage 0's embedding gradient, added to accumulator ``i`` (of a tied table: in the head's
        ``[D, V]`` accumulator, which the last stage also adds to), as the tables' layout adds it
        (``keep``: whether this device ran the first stage's backward in this slot)."""
        add = self.tables.lookup_transpose_add
        if self.tied:
            w = add(acc_t["head"]["w"], tokens, ct, i, self.top_axes["head"]["w"], True, keep)
            return {**acc_t, "head": {**acc_t["head"], "w": w}}
        table = add(acc_t["embed"]["embedding"], tokens, ct, i, self.top_axes["embed"]["embedding"], False, keep)
        return {**acc_t, "embed": {"embedding": table}}


@scoped("pp_versions")
def _versions(model_cfg, params):
    """(layers, top, head) of a weight version in ``compute_dtype``, device-varying; the head
    ``[D, V]`` (:func:`stage.head_of`: a tied table is held in that layout, so nothing is
    transposed)."""
    layers, top = split_params(vary(dense.compute_view(model_cfg, params)))
    return layers, top, head_of(model_cfg, top)



def make_grads_fn(model_cfg, mesh, loop, params_abstract, options: EngineOptions, carries_state: bool):
    """``shard_map``-ped ``(versions, batch, pstate, live, step) -> (grads, stats, pstate)``.

    ``loop`` (:class:`asyncpp_jax.pipeline.spmd.loop.SlotLoop`) is a compiled program: its
    ``rows()`` are scanned, each device taking its column (every device's, when
    through ``body(dev)``.  ``versions``: ``w[t], ..., w[t-D]`` (``D`` the
    program's delay), in the engine's layout; ``live``: bool ``[D + 1]``, whether step ``t - k``
    ran this program (``optim.DelaySchedule.in_force``).  ``carries_state``: the run hands a
    :class:`PipelineState` from step to step (a flushless program, or a flushed one standing in
    for it at a synchronous start or cooldown).  ``options``: the recompute, the uneven split and
    expert parallelism; ``loop.tables``: where the vocabulary-sized tables live, which the specs
    and reductions follow."""
    program = loop.plan.program
    n_stages, M, flushless = program.devices, program.microbatches, program.flushless
    expert_parallel = options.expert_parallel
    fns = StageFns(model_cfg, M, options.recompute, options.stage_rows, split=loop.split)
    act_dtype = dense.dtype_of(model_cfg.compute_dtype)
    split_tables = loop.tables.split
    offsets = Offsets.of(program, model_cfg.tie_embeddings)
    pspec = param_specs(params_abstract, expert_parallel, split_tables)
    uspec = update_specs(params_abstract, n_stages, expert_parallel, split_tables)
    tied = model_cfg.tie_embeddings
    top_specs = _top_acc_specs(model_cfg, uspec)
    rows = loop.rows()

    def local(versions, batch, pstate, live, step):
        s = jax.lax.axis_index("stage")
        versions_v = tuple(_versions(model_cfg, v) for v in versions)
        b, T = batch.shape[1], batch.shape[2] - 1
        if flushless:
            strip = lambda x: x[0, 0]  # noqa: E731
            stash, fwd_buf, bwd_buf = [strip(r) for r in pstate.stash], strip(pstate.fwd_buf), strip(pstate.bwd_buf)
            batches = jnp.concatenate([batch[None], pstate.batches])
        else:
            stash, fwd_buf, bwd_buf = loop.buffers(fns, versions_v[0][0],
                                                   vary(jnp.zeros((b, T, model_cfg.d_model), act_dtype)))
            batches = batch[None]
        # The embedding's lookup gradient (stage 0) and the head's (stage P-1, as [D, V]); a tied
        # table has one accumulator, in its (the head's) layout, for both.  Each replicated leaf's
        # accumulators (one per update offset it reaches) are stacked along the axis _acc_axis
        # gives it, the layers' in front.
        cur = versions_v[0]
        top_acc = {"head": cur[2]} if tied else {"embed": cur[1]["embed"], "head": cur[2]}
        top_counts = jax.tree.map(lambda g: len(offsets.slots(g)), _top_groups(offsets))
        top_axes = jax.tree.map(lambda x, sp: _acc_axis(sp, x.ndim), top_acc, top_specs)
        stacked = lambda x, ax, n: jnp.zeros(x.shape[:ax] + (n,) + x.shape[ax:], jnp.float32)  # noqa: E731
        acc_l = vary(jax.tree.map(lambda x: stacked(x, 0, len(offsets.slots("layers"))), cur[0]))
        acc_t = vary(jax.tree.map(lambda n, x, ax: jax.tree.map(lambda y, a: stacked(y, a, n), x, ax),
                                  top_counts, top_acc, top_axes))
        dev = Device(fns, s, n_stages, versions_v, batches, live, offsets, act_dtype, top_axes,
                     chunks=program.chunks, tables=loop.tables)
        sums0 = vary({k: jnp.zeros((len(offsets.slots("stats")),), jnp.float32) for k in stat_names(model_cfg)})
        carry = (stash, fwd_buf, bwd_buf, acc_l, acc_t, sums0)
        xs = jnp.take(rows, s, axis=1)
        carry, _ = jax.lax.scan(loop.body(dev, step), carry, xs)
        return _finish(model_cfg, carry, pstate, offsets, live, flushless, carries_state, top_specs, top_axes,
                       expert_parallel, split_tables)

    def grads_fn(versions, batch, pstate, live, step):
        sspec = pipeline_state_specs(params_abstract, pstate, options)
        vspec = tuple(pspec for _ in versions)
        fn = jax.shard_map(local, mesh=mesh, in_specs=(vspec, BATCH_SPEC, sspec, P(), P()),
                           out_specs=(uspec, P(), sspec))
        return fn(versions, batch, pstate, live, step)

    return grads_fn

def _top_acc_specs(model_cfg, uspec) -> dict:
    """Where each replicated leaf's update lives (:func:`update_specs`), laid out like the
    accumulators of the engine's top leaves: ``{'head': {'final_norm', 'w'}}`` (and ``'embed'`` for
    an untied model, whose head ``w`` is the ``lm_head`` kernel)."""
    if model_cfg.tie_embeddings:
        return {"head": {"final_norm": uspec["final_norm"], "w": uspec["embed"]["embedding"]}}
    return {"head": {"final_norm": uspec["final_norm"], "w": uspec["lm_head"]["kernel"]}, "embed": uspec["embed"]}


def _top_groups(offsets: Offsets) -> dict:
    """Each top accumulator's group (:data:`Offsets.GROUPS`), a prefix of the accumulators laid
    out as :func:`_top_acc_specs`: a tied table's one accumulator is the embedding's group."""
    groups = {"head": offsets.head_groups()}
    return groups if offsets.tied else {**groups, "embed": {"embedding": "embed"}}


def _is_table_accumulator(path) -> bool:
    """Whether an accumulator (laid out as :func:`_top_acc_specs`) is a vocabulary-sized table's:
    the embedding's, or the head's ``w`` (a tied table's one accumulator among them)."""
    return path[0].key == "embed" or path[-1].key == "w"


def _reduce_accumulators(model_cfg, acc_l, acc_t, sums, offsets: Offsets, top_specs, top_axes,
                         vocab_parallel=False):
    """The step's accumulators -> ``[(this replica's gradient laid out as update_specs, loss sums)]``,
    one per update offset, each gradient holding the groups that have that offset
    (:meth:`Offsets.count`).  The replicated leaves are reduced over ``stage`` once for all
    offsets (a table split over its vocabulary is not: each device's block is whole); the
    reduction over ``data`` is the caller's, once per batch's whole gradient."""
    def reduce(path, acc, spec, axis):
        own_block = vocab_parallel and _is_table_accumulator(path)
        return acc if own_block else reduce_top(acc, spec, axis)

    summed = jax.tree_util.tree_map_with_path(reduce, acc_t, top_specs, top_axes)

    def at(a, group, x, axis):
        """Offset ``a`` of a stacked accumulator: zeros where the program reaches it in no step."""
        reached = offsets.slots(group)
        if a in reached:
            return jax.lax.index_in_dim(x, reached.index(a), axis, keepdims=False)
        return jnp.zeros(x.shape[:axis] + x.shape[axis + 1:], x.dtype)

    groups = _top_groups(offsets)
    out = []
    for k in range(offsets.carried + 1):
        t = jax.tree.map(lambda g, x, ax: jax.tree.map(functools.partial(at, k, g), x, ax), groups, summed, top_axes)
        if model_cfg.tie_embeddings:  # both uses of the table, in its one [D, V] accumulator
            top = {"final_norm": t["head"]["final_norm"], "embed": {"embedding": t["head"]["w"]}}
        else:
            top = {**dense.grads_from_head(model_cfg, t["head"]), "embed": t["embed"]}
        grads = join_params(jax.tree.map(lambda x: at(k, "layers", x, 0), acc_l), top)
        grads = {g: v for g, v in grads.items() if offsets.count(g) > k}
        sums_k = {n: jax.lax.pmean(jax.lax.psum(at(k, "stats", v, 0), "stage"), "data") for n, v in sums.items()}
        out.append((grads, sums_k))
    return out


@scoped("pp_reduce")
def _finish(model_cfg, carry, pstate, offsets: Offsets, live, flushless: bool, carries_state: bool, top_specs,
            top_axes, expert_parallel, vocab_parallel=False):
    """The end of a step: the gradient and loss of update offset 0 (joined with what earlier steps
    carried for it), and the in-flight state to hand on: the buffers, and the partial gradients
    and loss sums of later updates (offsets ``1..``), each held per data replica.  A flushed
    program inside a flushless run (a synchronous start or cooldown step) hands on zeros: what
    was in flight is dropped, as ``optim.delay`` drops it."""
    stash, fwd_buf, bwd_buf, acc_l, acc_t, sums = carry
    reduced = _reduce_accumulators(model_cfg, acc_l, acc_t, sums, offsets, top_specs, top_axes, vocab_parallel)
    new = None
    if carries_state:
        if flushless:  # what earlier steps made for these updates joins before the reduction over data
            came = [on_data_axis(g, expert_parallel, add=False) for g in pstate.grad_partial]
            keep = lambda x, p: x + jnp.where(live[1], p, jnp.zeros_like(p))  # noqa: E731  (zeros: a fresh run)
            for a, (g_in, s_in) in enumerate(zip(came, pstate.stats_partial)):
                g, s = reduced[a]
                reduced[a] = ({k: jax.tree.map(keep, v, g_in[k]) if k in g_in else v for k, v in g.items()},
                              jax.tree.map(keep, s, s_in))
            partial = [on_data_axis(g, expert_parallel, add=True) for g, _ in reduced[1:]]
            partial_sums = [s for _, s in reduced[1:]]
            stash = [x[None, None] for x in stash]
            fwd_buf, bwd_buf = fwd_buf[None, None], bwd_buf[None, None]
        else:
            partial = jax.tree.map(jnp.zeros_like, list(pstate.grad_partial))
            partial_sums = jax.tree.map(jnp.zeros_like, list(pstate.stats_partial))
            stash, fwd_buf, bwd_buf = pstate.stash, pstate.fwd_buf, pstate.bwd_buf  # untouched: none is live next
        new = pstate._replace(stash=list(stash), fwd_buf=fwd_buf, bwd_buf=bwd_buf, grad_partial=tuple(partial),
                              stats_partial=tuple(partial_sums))
    grads, totals = reduced[0]
    grads = mean_over_data(grads, expert_parallel)  # once per batch: every part of it together
    count = totals.pop("count")  # 0 at a fill update: no batch's loss was finished, so none is logged
    stats = {k: v / count for k, v in totals.items()}
    stats["loss_microbatches"] = count
    return grads, stats, new
