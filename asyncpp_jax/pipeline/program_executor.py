"""The engine running a schedule given as a program (:mod:`asyncpp_jax.pipeline.programs`).

:func:`asyncpp_jax.pipeline.slot_plan.compile_program` places the program's actions in lock-step
slots and assigns every buffer entry; :class:`SlotLoop` is the loop body that
:func:`asyncpp_jax.pipeline.executor.make_grads_fn` scans over those slots.  In a slot each device
runs its row's backward, then its forward (either may be absent), with the slot computations of the
tick loop (:class:`~asyncpp_jax.pipeline.executor._Device`):

* ``F`` on stages ``0..P-2``: the block on the embedded tokens (stage 0) or on the activation in
  its ``fwd`` entry; the backward's entry goes to its stash entry;
* ``B`` on stages ``0..P-2``: the block's vjp from the stash entry and the cotangent in its ``bwd``
  entry; stage 0 adds its input cotangent to the embedding's gradient rows;
* ``F`` on the last stage computes nothing (its input waits in its ``fwd`` entry); its ``B`` runs
  the fused block + head + loss vjp, as the tick loop's last slot does.

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

from asyncpp_jax.pipeline import slot_plan
from asyncpp_jax.pipeline.collectives import hop_perms, vary
from asyncpp_jax.pipeline.stage import StageFns, chunk_rows, residual_shapes


@dataclasses.dataclass(frozen=True)
class SlotLoop:
    """A compiled program as :func:`~asyncpp_jax.pipeline.executor.make_grads_fn`'s loop."""

    plan: slot_plan.SlotPlan

    @property
    def n_stages(self) -> int:
        return self.plan.program.devices

    @property
    def microbatches(self) -> int:
        return self.plan.program.microbatches

    @property
    def schedule(self) -> slot_plan.SlotPlan:
        return self.plan

    @property
    def chunks(self) -> int:
        return self.plan.program.chunks

    def rows(self) -> np.ndarray:
        return self.plan.rows

    def buffers(self, fns: StageFns, layers, x):
        """``(stash, fwd, bwd)``, each with the plan's depth of entries; ``x`` one activation."""
        d = self.plan.depth
        layers = chunk_rows(layers, 0, self.chunks)  # every chunk's entries have one chunk's shapes
        stash = [vary(jnp.zeros((d["stash"],) + e.shape, e.dtype)) for e in residual_shapes(fns, layers, x)]
        entries = lambda n: jnp.zeros((n,) + x.shape, x.dtype)  # noqa: E731
        return stash, vary(entries(d["fwd"])), vary(entries(d["bwd"]))

    def body(self, dev):
        n = self.n_stages
        # An interleaved device's chunks are a ring: the last device's chunk c feeds device 0's c + 1.
        fwd_perm, bwd_perm = hop_perms(n, ring=self.chunks > 1)
        if not dev.fns.recompute:
            # The backward runs first in a slot but rebuilds its vjp closure from the layout the
            # forward's trace records: record it now (the result is dead code, dropped by XLA).
            b, T = dev.batch.shape[1], dev.batch.shape[2] - 1
            dev.fns.forward(dev.chunk_of(dev.cur[0], 0), vary(jnp.zeros((b, T, dev.fns.cfg.d_model), dev.act_dtype)),
                            dev.template)

        def slot(carry, row):
            stash, fwd, bwd, acc_l, acc_t, sums = carry
            r = {name: row[i] for name, i in slot_plan.INDEX.items()}
            jf, jb = r["f"], r["b"]
            has_f, has_b = jf != slot_plan.IDLE, jb != slot_plan.IDLE
            x_f, x_b, ct_in = fwd[r["f_fwd"]], fwd[r["b_fwd"]], bwd[r["b_bwd"]]
            zeros = jnp.zeros_like(x_f)
            # The backward first: the stash entry it reads may be the one the forward writes.
            b_last = dev.final(r["b_chunk"])
            acc_l, g_x = jax.lax.cond(has_b & ~b_last,
                                      lambda al: dev.backward(jb, ct_in, r["b_stash"], stash, al, r["b_chunk"]),
                                      lambda al: (al, zeros), acc_l)
            acc_l, acc_t, sums, g_x = jax.lax.cond(has_b & b_last,
                                                   lambda al, at, su, _: dev.last(jb, x_b, al, at, su),
                                                   lambda *a: a, acc_l, acc_t, sums, g_x)
            stash, sums, h_out = jax.lax.cond(
                has_f & ~dev.final(r["f_chunk"]),
                lambda st, su: dev.forward(jf, x_f, r["f_stash"], st, su, r["f_chunk"]),
                lambda st, su: (st, su, zeros), stash, sums)
            # As in the tick loop: the embedding's rows are added outside the conds (zeros off stage 0).
            ct = jnp.where(dev.first(r["b_chunk"]) & has_b, g_x, jnp.zeros_like(g_x)).astype(jnp.float32)
            jb_live = jnp.where(has_b, jb, 0)
            acc_t = dev.lookup_transpose_add(acc_t, dev.tokens_of(jb_live)[:, :-1], ct, dev.delay.accumulator(jb_live))
            with jax.named_scope("pp_send"):
                h_in = jax.lax.ppermute(h_out, "stage", fwd_perm)
                g_in = jax.lax.ppermute(g_x, "stage", bwd_perm)
            return (stash, fwd.at[r["fwd_store"]].set(h_in), bwd.at[r["bwd_store"]].set(g_in), acc_l, acc_t, sums), None

        return slot
