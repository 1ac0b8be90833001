"""The engine's one loop: any schedule, given as a program (:mod:`asyncpp_jax.pipeline.schedules.programs`).

:func:`asyncpp_jax.pipeline.schedules.slot_plan.compile_program` places the program's actions in lock-step
slots and assigns every buffer entry; :class:`SlotLoop` is the loop body that
:func:`asyncpp_jax.pipeline.spmd.executor.make_grads_fn` scans over those slots.  In a slot each device
runs its row's backward, then its forward (either may be absent), with the slot computations of
:class:`~asyncpp_jax.pipeline.spmd.executor.Device`; an action of a batch that did not run this
program (a flushless program's first steps, or after a synchronous start) is skipped:

* ``F`` on stages ``0..P-2``: the block on the embedded tokens (stage 0) or on the activation in
  its ``fwd`` entry; the backward's entry goes to its stash entry;
* ``B`` on stages ``0..P-2``: the block's vjp from the stash entry and the cotangent in its ``bwd``
  entry; stage 0 adds its input cotangent to the embedding's gradient rows;
* ``F`` on the last stage computes nothing (its input waits in its ``fwd`` entry); its ``B`` runs
  the fused block + head + loss vjp.

With ``v`` chunks per device (``interleaved``) an action runs on the layer rows of the chunk its
row names (``stage.chunk_rows``), "stage 0" and "the last stage" mean the first and last virtual
stage, and the exchange is a ring: the last device's chunk ``c`` feeds device 0's chunk ``c + 1``.

Each kind runs under its own ``lax.cond`` taking only the buffers it writes (on XLA:CPU a buffer
that several branches write, or that a branch passes through, is copied at every slot:
docs/design.md, section 6.1).  After the slot, one ``ppermute`` carries the activation to the
next device and one the cotangent to the previous; each lands in the entry its row names (or in
the write-only last entry).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from asyncpp_jax.pipeline.schedules import slot_plan
from asyncpp_jax.pipeline.collectives import hop_perms, vary
from asyncpp_jax.pipeline.spmd.tables import Tables, ran_first_backward
from asyncpp_jax.pipeline.stage import StageFns, chunk_rows, residual_shapes, save_shapes

ENTRY_COLUMNS = {"stash": ("f_stash", "b_stash"), "fwd": ("f_fwd", "b_fwd", "fwd_store"),
                 "bwd": ("b_bwd", "bwd_store")}  # the columns naming an entry of a buffer kept across steps


@dataclasses.dataclass(frozen=True)
class SlotLoop:
    """A compiled program as :func:`~asyncpp_jax.pipeline.spmd.executor.make_grads_fn`'s loop."""

    plan: slot_plan.SlotPlan
    tables: Tables  # where the vocabulary-sized tables live: what a slot does where one is read

    @property
    def n_stages(self) -> int:
        return self.plan.program.devices

    @property
    def microbatches(self) -> int:
        return self.plan.program.microbatches

    @property
    def chunks(self) -> int:
        return self.plan.program.chunks

    @property
    def split(self) -> bool:
        """Whether the backward runs as ``I`` and ``W`` (``zb-h1``)."""
        return self.plan.split

    def rows(self) -> np.ndarray:
        """``[slots, devices, columns]``: the plan's rows, with the columns the tables' layout adds."""
        return self.tables.rows(self.plan)

    def buffers(self, fns: StageFns, layers, x):
        """``(stash, fwd, bwd)``, each with the plan's depth of entries; ``x`` one activation.  For
        a split backward the ``save`` ring's arrays follow the stash's in ``stash``
        (:meth:`stash_arrays` of them are the stash)."""
        d = self.plan.depth
        layers = chunk_rows(layers, 0, self.chunks)  # every chunk's entries have one chunk's shapes
        stash = [vary(jnp.zeros((d["stash"],) + e.shape, e.dtype)) for e in residual_shapes(fns, layers, x)]
        if self.split:
            stash += [vary(jnp.zeros((d["save"],) + e.shape, e.dtype)) for e in save_shapes(fns, layers, x)]
        entries = lambda n: jnp.zeros((n,) + x.shape, x.dtype)  # noqa: E731
        return stash, vary(entries(d["fwd"])), vary(entries(d["bwd"]))

    def stash_arrays(self, fns: StageFns, layers, x) -> int:
        """How many of :meth:`buffers`' ``stash`` arrays are the stash (the rest: the ``save`` ring)."""
        return len(residual_shapes(fns, chunk_rows(layers, 0, self.chunks), x))

    @property
    def columns(self) -> tuple:
        """What a row of :meth:`rows` holds, in order."""
        return slot_plan.COLUMNS + self.tables.columns

    def entries(self, r: dict, step) -> dict:
        """A flushless plan's entries as this step finds them (:attr:`slot_plan.SlotPlan.cyclic`):
        microbatch ``step * M + m`` is entry ``(m mod S + step * M) mod S`` of a ring of ``S``
        entries (the last, write-only entry stays); a flushed plan's rows name them as they are."""
        if not self.plan.cyclic:
            return r
        r = dict(r)
        for name, cols in ENTRY_COLUMNS.items():
            S = self.plan.depth[name] - 1
            shift = jnp.mod(step * self.microbatches, S)
            for c in cols:
                r[c] = jnp.where(r[c] >= S, r[c], jnp.mod(r[c] + shift, S))
        return r

    def body(self, dev, step):
        n = self.n_stages
        # An interleaved device's chunks are a ring: the last device's chunk c feeds device 0's c + 1.
        fwd_perm, bwd_perm = hop_perms(n, ring=self.chunks > 1)
        b, T = dev.batches.shape[2], dev.batches.shape[3] - 1
        x = vary(jnp.zeros((b, T, dev.fns.cfg.d_model), dev.act_dtype))
        if not dev.fns.recompute:
            # The backward runs first in a slot but rebuilds its vjp closure from the layout the
            # forward's trace records: record it now (the result is dead code, dropped by XLA).
            dev.fns.forward(dev.chunk_of(dev.cur[0], 0), x, dev.template)
        n_stash = self.stash_arrays(dev.fns, dev.cur[0], x)
        backward = self._split_backward if self.split else self._backward

        def slot(carry, row):
            stash, fwd, bwd, acc_l, acc_t, sums = carry
            stash, save = stash[:n_stash], stash[n_stash:]
            r = self.entries({name: row[i] for i, name in enumerate(self.columns)}, step)
            jf, has_f = r["f"], dev.is_live(r["f"])
            x_f = fwd[r["f_fwd"]]
            zeros = jnp.zeros_like(x_f)
            emb_f, emb_b = self.tables.embedded(dev, r)
            # The backward first: the stash entry it reads may be the one the forward writes.
            acc_l, acc_t, sums, save, g_x = backward(dev, r, stash, save, fwd, bwd, acc_l, acc_t, sums, zeros, emb_b)
            stash, sums, h_out = jax.lax.cond(
                has_f & ~dev.final(r["f_chunk"]),
                lambda st, su: dev.forward(jf, x_f, r["f_stash"], st, su, r["f_chunk"], embedded=emb_f),
                lambda st, su: (st, su, zeros), stash, sums)
            acc_t = self.embedding_grad(dev, r, acc_t, g_x)
            with jax.named_scope("pp_send"):
                h_in = jax.lax.ppermute(h_out, "stage", fwd_perm)
                g_in = jax.lax.ppermute(g_x, "stage", bwd_perm)
            return (stash + save, fwd.at[r["fwd_store"]].set(h_in), bwd.at[r["bwd_store"]].set(g_in), acc_l, acc_t,
                    sums), None

        return slot

    def embedding_grad(self, dev, r, acc_t, g_x):
        """The first virtual stage's input cotangent into the embedding's gradient rows, outside
        the conds: updated inside a cond branch, XLA copies the whole vocabulary-sized accumulator
        at every backward slot."""
        ct, jb = self.tables.embedding_cotangent(dev, r, g_x)
        jb_live = jnp.where(jb != slot_plan.IDLE, jb, 0)
        return dev.lookup_transpose_add(acc_t, dev.tokens_of(jb_live)[:, :-1], ct,
                                        dev.embed_slot(jb_live), ran_first_backward(dev, r))

    def _backward(self, dev, r, stash, save, fwd, bwd, acc_l, acc_t, sums, zeros, embedded):
        """A slot's ``B``: the block's vjp (stages ``0..P-2``), or the last stage's."""
        jb, has_b, b_last = r["b"], dev.is_live(r["b"]), dev.final(r["b_chunk"])
        acc_l, g_x = jax.lax.cond(
            has_b & ~b_last,
            lambda al: dev.backward(jb, bwd[r["b_bwd"]], r["b_stash"], stash, al, r["b_chunk"], embedded=embedded),
            lambda al: (al, zeros), acc_l)
        acc_l, acc_t, sums, g_x = self.tables.final_backward(dev, r, stash, fwd, acc_l, acc_t, sums, g_x)
        return acc_l, acc_t, sums, save, g_x

    def _split_backward(self, dev, r, stash, save, fwd, bwd, acc_l, acc_t, sums, zeros, embedded):
        """A slot's ``I`` (into the ``save`` ring; on the last stage with the head's gradient) and
        ``W`` (from it, into the layers' accumulator), each under its own cond."""
        jb, has_b, b_last = r["b"], dev.is_live(r["b"]), dev.final(r["b_chunk"])
        save, g_x = jax.lax.cond(
            has_b & ~b_last,
            lambda sv: dev.input_grad(jb, bwd[r["b_bwd"]], r["b_stash"], stash, sv, r["b_save"], r["b_chunk"],
                                      embedded=embedded),
            lambda sv: (sv, zeros), save)
        acc_t, sums, save, g_x = self.tables.final_input_grad(dev, r, stash, fwd, acc_t, sums, save, g_x)
        jw = r["w"]
        acc_l = jax.lax.cond(dev.is_live(jw), lambda al: dev.weight_grad(jw, save, r["w_save"], al, r["w_chunk"]),
                             lambda al: al, acc_l)
        return acc_l, acc_t, sums, save, g_x
