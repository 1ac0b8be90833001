"""Static tick tables for the pipeline engine, built in Python and printable.

Both schedules run one forward slot and one backward slot per stage per tick ("1F1B, backward as
soon as possible").  Microbatch ``j`` (counted in one stream across steps: ``j = n M + m`` for
microbatch ``m`` of step ``n``) enters stage 0 at tick ``j``; stage ``s`` runs its forward at
tick ``j + s`` and its backward at tick ``j + 2(P-1) - s`` (the last stage does both in one tick).

* ``sync`` (flush every step): ticks ``0 .. M + 2P - 3`` of one step, microbatches ``0..M-1`` only;
  a stage is busy in ``M`` of the ``M + 2P - 2`` ticks.
* ``2bw`` (no flush): step ``n`` owns ticks ``[nM, (n+1)M)``; in steady state every stage does a
  forward and a backward at every tick.  Step ``n``'s window holds the tail of batch ``n-1``
  (stage ``s`` finishes its backwards of batch ``n-1`` at tick ``nM + 2P - 3 - s``) and the head of
  batch ``n``.  For a ONE-step delay batch ``n``'s last backward (stage 0, tick
  ``nM + M - 1 + 2P - 2``) must fall inside window ``n+1``, i.e. ``M >= 2(P-1)``; with fewer
  microbatches a batch would span three windows and need three weight versions.

Tables hold the microbatch index relative to the step (``j - nM``; negative = the previous batch)
or ``IDLE``.  The stash of a stage holds the inputs of the microbatches between their forward and
backward: at most ``2P - 1`` (stage 0), so the stash ring has ``2P - 1`` slots, indexed ``j mod (2P-1)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

IDLE = np.iinfo(np.int32).min  # no work in this slot


def min_microbatches_2bw(n_stages: int) -> int:
    """The fewest microbatches per step for which the ``2bw`` schedule has a one-step delay."""
    return max(2 * (n_stages - 1), 1)


def stash_slots(n_stages: int, first_stage_stashes: bool = True) -> int:
    """Ring slots for the stage inputs (or residuals) awaiting their backward.

    Stage ``s`` holds a microbatch from its forward (tick ``j + s``) to its backward (tick
    ``j + 2(P-1) - s``), so ``2(P-1-s) + 1`` at once: ``2P - 1`` on stage 0.  When stage 0
    recomputes from the tokens instead (``first_stage_stashes=False``) stage 1 is the deepest
    ring: ``2P - 3``.  The last stage never stashes (its forward and backward share a tick).
    """
    return 2 * n_stages - 1 if first_stage_stashes else max(2 * n_stages - 3, 1)


@dataclasses.dataclass(frozen=True)
class TickTable:
    """``forward[k, s]`` / ``backward[k, s]``: step-relative microbatch at tick ``k`` on stage ``s``."""

    name: str
    n_stages: int
    microbatches: int
    forward: np.ndarray  # int32 [ticks, P]
    backward: np.ndarray  # int32 [ticks, P]

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    def useful_fraction(self) -> float:
        """Share of the (forward + backward) slots doing real work (1 - the bubble)."""
        busy = np.sum(self.forward != IDLE) + np.sum(self.backward != IDLE)
        return float(busy) / (2 * self.forward.size)

    def render(self) -> str:
        """Tick x stage picture: ``F3`` forward of microbatch 3, ``B-1`` backward of the previous
        batch's last microbatch, ``.`` idle."""

        def cell(f, b):
            parts = [f"F{f}" if f != IDLE else "", f"B{b}" if b != IDLE else ""]
            return "/".join(p for p in parts if p) or "."

        rows = [f"{self.name}: P={self.n_stages} stages, M={self.microbatches} microbatches, "
                f"{self.ticks} ticks/step, useful {self.useful_fraction():.0%}"]
        width = max(len(cell(f, b)) for f, b in zip(self.forward.ravel(), self.backward.ravel())) + 1
        rows.append("tick  " + "".join(f"s{s}".ljust(width) for s in range(self.n_stages)))
        for k in range(self.ticks):
            rows.append(f"{k:<6d}" + "".join(cell(self.forward[k, s], self.backward[k, s]).ljust(width)
                                             for s in range(self.n_stages)))
        return "\n".join(rows)


def sync_table(n_stages: int, microbatches: int) -> TickTable:
    """One flushed step: forward of ``m`` on ``s`` at ``m + s``, backward at ``m + 2(P-1) - s``."""
    P, M = n_stages, microbatches
    ticks = M + 2 * P - 2
    fwd = np.full((ticks, P), IDLE, np.int32)
    bwd = np.full((ticks, P), IDLE, np.int32)
    for s in range(P):
        for m in range(M):
            fwd[m + s, s] = m
            bwd[m + 2 * (P - 1) - s, s] = m
    return TickTable("sync", P, M, fwd, bwd)


def async_table(n_stages: int, microbatches: int, check: bool = True) -> TickTable:
    """One steady-state ``2bw`` window of ``M`` ticks (no flush); see the module docstring.
    ``check=False`` builds the window below ``min_microbatches_2bw`` too, for
    asyncpp_jax.pipeline.programs to show which rule it breaks there."""
    P, M = n_stages, microbatches
    if check and M < min_microbatches_2bw(P):
        raise ValueError(
            f"config.train.microbatches={M} is too few for the 2bw schedule with config.pipeline.stages={P}: "
            f"a one-step delay needs microbatches >= 2*(stages-1) = {min_microbatches_2bw(P)}, else a batch's "
            "backward spills into a third step and needs a third weight version.")
    k = np.arange(M)[:, None]
    s = np.arange(P)[None, :]
    fwd = (k - s).astype(np.int32)
    bwd = (k - (2 * (P - 1) - s)).astype(np.int32)
    return TickTable("2bw", P, M, fwd, bwd)


class OneStepDelay:
    """Where the ``2bw`` delay lives: which weight version a slot uses, which gradient it feeds.

    Microbatch ``j`` of a step's tick table is step-relative: ``j < 0`` belongs to batch ``t-1``
    (in flight since the previous step), ``j >= 0`` to batch ``t``.  A microbatch uses its batch's
    weights for both its forward and its backward, and its gradient lands in its batch's
    accumulator, so that

        w[t+1] = w[t] - U_t( sum_m grad L(w[t-1]; batch[t-1]_m) / M )       (PipeDream-2BW)

    accumulator 0 is applied at this update (batch ``t-1``: its head was carried in from the
    previous step as ``grad_partial``, its tail is finished here), accumulator 1 is carried to
    update ``t+1`` (batch ``t``'s head).  The ``sync`` schedule (``is_async=False``) has one
    accumulator and one weight version: every microbatch is batch ``t`` at ``w[t]``.  A batch's
    microbatches count only if their step ran the delayed schedule (``prev_live``): at the first
    delayed update accumulator 0 is empty and nothing is applied (the fill, as ``optim.delay``).
    """

    def __init__(self, is_async: bool, prev_live):
        self.is_async, self.prev_live = is_async, prev_live
        self.accumulators = 2 if is_async else 1

    def live(self, j):
        return (j != IDLE) & ((j >= 0) | self.prev_live)

    def run(self, j, fn, cur, prev):
        """``fn(weights of microbatch j)``, reading the version in place (a ``lax.cond`` on the
        version, not an elementwise select over the weights at every slot)."""
        if not self.is_async:
            return fn(cur)
        return jax.lax.cond(j < 0, lambda: fn(prev), lambda: fn(cur))

    def accumulator(self, j):
        return (j >= 0).astype(jnp.int32) if self.is_async else jnp.int32(0)
