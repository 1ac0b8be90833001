"""Where the vocabulary-sized tables live, as a layout the slot loop reads.

The embedding and the head (a tied table is one ``[D, V]`` matrix for both) are read at two points
of a program: the first virtual stage's lookup and the last one's head and loss.  Everything else
a slot does is the same whatever the tables' layout; :class:`~asyncpp_jax.pipeline.spmd.loop.SlotLoop`
asks its ``tables`` what to do at those points:

* :class:`WholeTables` (the default): each table whole on every device, read by the device that
  runs the first or last virtual stage, under that device's cond; the gradients are reduced over
  ``stage`` at the end of the step.
* :class:`SplitTables` (``config.pipeline.vocab_parallel``; :mod:`asyncpp_jax.pipeline.vocab_parallel`
  has the algebra): each table split along its vocabulary over ``stage``, so every device joins
  every read (a collective cannot run inside one device's cond).  In a slot:

  1. the first virtual stage's forward input (and, recomputing, its backward's) is looked up by
     every device from its vocabulary block and summed over ``stage``;
  2. the stages' backward and forward run under their conds, as with whole tables;
  3. the last virtual stage runs its block's forward under its cond, the block output is broadcast,
     every device applies the final norm, its head block and its share of the loss and its
     gradient (:func:`~asyncpp_jax.pipeline.vocab_parallel.head_loss_grads`), and the last stage runs
     the block's backward (or, for a split backward, its input gradient: :func:`last_input`, its
     ``W`` later from the ``save`` ring) from the summed cotangent under a second cond;
  4. the first stage's input cotangent is broadcast and every device adds it to its block's rows.

  Each table's gradient is then whole on its block's device: nothing is reduced over ``stage``.
  Which microbatch the first and last virtual stages work on is carried on every device's row
  (:func:`vocab_columns`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from asyncpp_jax.pipeline import vocab_parallel as vp
from asyncpp_jax.pipeline.collectives import vary
from asyncpp_jax.pipeline.schedules import slot_plan
from asyncpp_jax.pipeline.spmd.executor import Device, add_at, put, scoped
from asyncpp_jax.pipeline.stage import lookup_transpose_add, stat_names, table_size


def _zeros_like_tree(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def embedded(dev: Device, j):
    """Stage 0's input for microbatch ``j``, looked up by every device (zeros when ``j`` is idle)."""
    tokens = dev.tokens_of(j)[:, :-1]
    b, T = tokens.shape
    zero = vary(jnp.zeros((b, T, dev.fns.cfg.d_model), dev.act_dtype))
    # The predicate is the same on every device (the slot's row names it everywhere), so all of them take the
    # branch with the collective.
    return jax.lax.cond(dev.is_live(j),
                        lambda: vary(dev.run(j, lambda top: vp.lookup(dev.fns.cfg, top, tokens), 1)
                                     .astype(dev.act_dtype)),
                        lambda: zero)


def _block_and_head(dev: Device, j, fwd_buf, entry_like, acc_t):
    """Microbatch ``j``'s last block forward (the last stage's cond) and the head and loss on every
    device.  Returns ``(on_last, entry, g_h, acc_t, stats)``: ``entry`` the block's
    stash entry (for its backward), ``g_h`` the cotangent of its output, ``stats`` what the loss
    sums gain (added by the caller, inside its block's conditional).  ``entry_like``: the stash's
    arrays (for their shapes)."""
    on_last = dev.is_live(j) & dev.is_last
    c = dev.chunks - 1

    def block_forward():
        h, entry, stats = dev.run(j, lambda lp: dev.fns.forward(dev.chunk_of(lp, c), fwd_buf, dev.template), 0)
        return vary((h.astype(dev.act_dtype), entry, stats))

    zero_entry = [vary(jnp.zeros(e.shape[1:], e.dtype)) for e in entry_like]
    h, entry, block_stats = jax.lax.cond(
        on_last, block_forward,
        lambda: (jnp.zeros_like(fwd_buf), zero_entry, vary(_zeros_like_tree(_stat_zeros(dev)))))
    h_all = jax.lax.psum(jnp.where(on_last, h, jnp.zeros_like(h)), "stage")
    targets = dev.tokens_of(j)[:, 1:]

    def head():
        loss, stats, g_head, g_h = dev.run(
            j, lambda head_w: vp.head_loss_grads(dev.fns.cfg, head_w, h_all, targets, 1.0 / dev.fns.microbatches), 2)
        return vary((stats, g_head, g_h))

    zeros = vary(({k: jnp.zeros((), jnp.float32) for k in HEAD_STATS}, _zeros_like_tree(dev.cur[2]),
                  jnp.zeros_like(h)))
    # The predicate is the slot's, the same on every device: all of them join the head's collectives.
    head_stats, g_head, g_h = jax.lax.cond(dev.is_live(j), head, lambda: zeros)
    # Every device adds its head block's gradient; the final norm's, the same on every device, and
    # the loss statistics are added by the last stage only (both are summed over stage later).
    mine = lambda t: jax.tree.map(lambda x: jnp.where(dev.is_last, x, jnp.zeros_like(x)), t)  # noqa: E731
    g_head = {"final_norm": mine(g_head["final_norm"]), "w": g_head["w"]}
    acc_t = {**acc_t, "head": add_at(acc_t["head"], dev.head_slots(j), g_head, dev.top_axes["head"])}
    stats = dict(block_stats)
    stats.update(head_stats, loss=block_stats["loss"] + head_stats["loss"])
    return on_last, entry, g_h.astype(dev.act_dtype), acc_t, mine(stats)


@scoped("pp_last")
def last(dev: Device, j, fwd_buf, entry_like, acc_l, acc_t, sums, g_x):
    """Microbatch ``j`` on the last (virtual) stage: block forward (its cond), head and loss on
    every device, block backward (its cond)."""
    on_last, entry, g_h, acc_t, stats = _block_and_head(dev, j, fwd_buf, entry_like, acc_t)
    c = dev.chunks - 1
    # The loss sums are added inside the block's backward cond, which runs after the slot's
    # backward: the slot's forward takes these sums and writes the stash in place, so this orders
    # it after the backward's reads. Added outside, the two conds are unordered and XLA copies
    # every stash array twice a slot (docs/design.md, section 6.1).

    def block_backward(al, _, su):
        g_l, g = dev.run(j, lambda lp: dev.fns.backward(dev.chunk_of(lp, c), entry, lambda: entry[0], g_h,
                                                        dev.template), 0)
        return (dev.add_layers(al, dev.layer_slot(j, c), g_l, c), g.astype(dev.act_dtype),
                add_at(su, dev.stats_slot(j), stats))

    acc_l, g_x, sums = jax.lax.cond(on_last, block_backward, lambda al, gx, su: (al, gx, su), acc_l, g_x, sums)
    return acc_l, acc_t, sums, g_x


@scoped("pp_last")
def last_input(dev: Device, j, fwd_buf, entry_like, acc_t, sums, save, save_at, g_x):
    """``I`` of microbatch ``j`` on the last stage (a split backward): as :func:`last`, but the
    block's input cotangent only, what its ``W`` needs into entry ``save_at`` of ``save``."""
    on_last, entry, g_h, acc_t, stats = _block_and_head(dev, j, fwd_buf, entry_like, acc_t)
    c = dev.chunks - 1

    def block_input_grad(sv, _, su):  # the loss sums added here, inside the cond, as in last()
        g, kept = dev.run(j, lambda lp: dev.fns.input_grad(dev.chunk_of(lp, c), entry, lambda: entry[0], g_h,
                                                           dev.template), 0)
        return put(sv, save_at, kept), g.astype(dev.act_dtype), add_at(su, dev.stats_slot(j), stats)

    save, g_x, sums = jax.lax.cond(on_last, block_input_grad, lambda sv, gx, su: (sv, gx, su), save, g_x, sums)
    return acc_t, sums, save, g_x


HEAD_STATS = ("loss", "ce", "z_loss", "count")  # what head_loss_grads reports


def _stat_zeros(dev: Device) -> dict:
    return {k: jnp.zeros((), jnp.float32) for k in stat_names(dev.fns.cfg)}


VOCAB_COLUMNS = ("first_f", "first_b", "last_b")  # the slot's microbatches at the tables, on every device's row


def vocab_columns(plan: slot_plan.SlotPlan) -> np.ndarray:
    """``[slots, devices, 3]``: each slot's first-virtual-stage forward and backward microbatch and
    last-virtual-stage backward (``I``) microbatch, or ``IDLE``, the same on every device's row (a
    device runs at most one of each kind a slot, so there is at most one of each)."""
    col, idle, v = slot_plan.INDEX, slot_plan.IDLE, plan.program.chunks
    rows = plan.rows

    def at(d, kind, chunk):
        j = rows[:, d, col[kind]]
        return np.where((j != idle) & (rows[:, d, col[kind + "_chunk"]] == chunk), j, idle)

    out = np.stack([at(0, "f", 0), at(0, "b", 0), at(-1, "b", v - 1)], axis=-1).astype(rows.dtype)
    return np.broadcast_to(out[:, None], (rows.shape[0], rows.shape[1], len(VOCAB_COLUMNS)))


def ran_first_backward(dev: Device, r: dict):
    """Whether this device ran the first virtual stage's ``B`` (or ``I``) in the slot."""
    return dev.first(r["b_chunk"]) & dev.is_live(r["b"])


def _first_cotangent(dev: Device, r: dict, g_x):
    """This device's input cotangent where it ran the first virtual stage's ``B``, else zeros."""
    return jnp.where(ran_first_backward(dev, r), g_x, jnp.zeros_like(g_x)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class WholeTables:
    """Each table whole on every device, read only by the first and last virtual stages."""

    split = False
    columns = ()  # nothing added to a slot's row

    @staticmethod
    def rows(plan: slot_plan.SlotPlan) -> np.ndarray:
        return plan.rows

    @staticmethod
    def embedded(dev: Device, r: dict):
        """The first virtual stage's looked-up input for the slot's forward and backward; ``None``:
        each looks its tokens up under its own cond."""
        return None, None

    @staticmethod
    def embedding_cotangent(dev: Device, r: dict, g_x):
        """``(ct, j)``: the cotangent of the embedding's output for microbatch ``j`` (``IDLE``:
        none), this device's ``g_x`` where it ran the first virtual stage's ``B``, else zeros."""
        return _first_cotangent(dev, r, g_x), r["b"]

    @staticmethod
    def lookup_transpose_add(acc, tokens, ct, i, axis: int, tied: bool, keep):
        """The lookup's transpose into accumulator ``i`` (``axis``: the accumulator axis).  Only
        where ``keep`` (this device ran the first stage's backward; ``ct`` is zeros elsewhere): the
        ids of the others point past the table and are dropped, so they skip the scatter's strided
        writes (~1 ms per call into ``[D, V]`` on a CPU core)."""
        return lookup_transpose_add(acc, jnp.where(keep, tokens, table_size(acc, tied, i, axis)), ct, tied, i, axis)

    @staticmethod
    def final_backward(dev: Device, r, stash, fwd, acc_l, acc_t, sums, g_x):
        """The last virtual stage's ``B``: block, head and loss as one fused vjp under its cond."""
        jb, has_b = r["b"], dev.is_live(r["b"])
        return jax.lax.cond(has_b & dev.final(r["b_chunk"]),
                            lambda al, at, su, _: dev.last(jb, fwd[r["b_fwd"]], al, at, su),
                            lambda *a: a, acc_l, acc_t, sums, g_x)

    @staticmethod
    def final_input_grad(dev: Device, r, stash, fwd, acc_t, sums, save, g_x):
        """The last virtual stage's ``I``: the fused vjp with respect to the head, input and taps."""
        jb, has_b = r["b"], dev.is_live(r["b"])
        return jax.lax.cond(
            has_b & dev.final(r["b_chunk"]),
            lambda at, su, sv, _: dev.last_input(jb, fwd[r["b_fwd"]], at, su, sv, r["b_save"]),
            lambda *a: a, acc_t, sums, save, g_x)


@dataclasses.dataclass(frozen=True)
class SplitTables:
    """Each table split along its vocabulary over ``stage``: every row carries the slot's
    :data:`VOCAB_COLUMNS`, so every device joins the first virtual stage's lookups and the last
    one's head and loss in the slots that have them; the stages' blocks run under their conds."""

    split = True
    columns = VOCAB_COLUMNS

    @staticmethod
    def rows(plan: slot_plan.SlotPlan) -> np.ndarray:
        return np.concatenate([plan.rows, vocab_columns(plan)], axis=-1)

    @staticmethod
    def embedded(dev: Device, r: dict):
        x_b = embedded(dev, r["first_b"]) if dev.fns.recompute else None
        return embedded(dev, r["first_f"]), x_b

    @staticmethod
    def embedding_cotangent(dev: Device, r: dict, g_x):
        # Every device adds its shard's rows, so the device that ran the B shares its cotangent.
        return jax.lax.psum(_first_cotangent(dev, r, g_x), "stage"), r["first_b"]

    @staticmethod
    def lookup_transpose_add(acc, tokens, ct, i, axis: int, tied: bool, keep):
        """Every device adds its own block's tokens (``keep`` unused: the cotangent is everyone's)."""
        return vp.lookup_transpose_add(acc, tokens, ct, i, axis, tied)

    @staticmethod
    def final_backward(dev: Device, r, stash, fwd, acc_l, acc_t, sums, g_x):
        return last(dev, r["last_b"], fwd[r["b_fwd"]], stash, acc_l, acc_t, sums, g_x)

    @staticmethod
    def final_input_grad(dev: Device, r, stash, fwd, acc_t, sums, save, g_x):
        return last_input(dev, r["last_b"], fwd[r["b_fwd"]], stash, acc_t, sums, save, r["b_save"], g_x)


Tables = WholeTables | SplitTables


def tables_of(vocab_parallel: bool) -> Tables:
    """The layout ``config.pipeline.vocab_parallel`` names."""
    return SplitTables() if vocab_parallel else WholeTables()
