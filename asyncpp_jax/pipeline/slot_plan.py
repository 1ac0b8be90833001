"""A validated program compiled into the static tables the engine's program executor scans.

The executor (:mod:`asyncpp_jax.pipeline.program_executor`) is SPMD: every device runs the same
code in lock-step slots, each slot one action per device (or none) followed by one exchange of
activations to the next device and of input gradients to the previous one.  This module places a
:class:`~asyncpp_jax.pipeline.programs.Program`'s per-device lists into those slots
(:func:`asyncpp_jax.pipeline.programs.lockstep`'s rule: an action runs in the first slot after
every action it depends on) and assigns every buffer entry statically, so nothing about the
schedule is decided while tracing:

* ``stash``: the stage's saved input (or autodiff residuals) from a microbatch's ``F`` to its ``B``;
  stage 0 with recompute re-embeds the tokens and saves nothing;
* ``fwd``: an activation from the previous device, from its arrival to the ``F`` that reads it; the
  last virtual stage keeps it until its ``B``, which runs the fused block + head + loss ``vjp``
  (its ``F`` computes nothing: the full-vocabulary logits exist in one slot only);
* ``bwd``: an input gradient from the next device, from its arrival to the ``B`` that reads it.

Each buffer's depth is the peak number of entries the plan holds at once on any device, plus one
write-only entry (the last) that a slot's exchange writes when nothing arrives.  Entries are reused
as soon as they are read: within a slot the action reads before the exchange writes.

A table row is ``[op, microbatch, chunk, stash, fwd_read, bwd_read, fwd_store, bwd_store]`` per
device; ``op`` is an index into :data:`OPS`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncpp_jax.pipeline import programs

OPS = ("idle", "F", "B")
IDLE, FWD, BWD = range(len(OPS))
COLUMNS = ("op", "microbatch", "chunk", "stash", "fwd_read", "bwd_read", "fwd_store", "bwd_store")


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """``rows[k, d]``: device ``d``'s row at slot ``k`` (:data:`COLUMNS`); ``depth``: entries per
    buffer (``stash``, ``fwd``, ``bwd``), the write-only one included."""

    program: programs.Program
    rows: np.ndarray  # int32 [slots, devices, len(COLUMNS)]
    depth: dict

    @property
    def slots(self) -> int:
        return self.rows.shape[0]

    def column(self, name: str) -> np.ndarray:
        return self.rows[..., COLUMNS.index(name)]

    def held(self, name: str) -> int:
        """Peak entries of buffer ``name`` that hold something (the depth less the write-only one)."""
        return self.depth[name] - 1

    def slot_costs(self, costs: dict | None = None) -> np.ndarray:
        """``[slots, devices]``: each row's cost at ``costs`` (``programs.DEFAULT_COSTS``: ``F = 1``,
        ``B = 2``); the last stage's ``B`` runs its forward too (``F + B``)."""
        c = {**programs.DEFAULT_COSTS, **(costs or {})}
        op, d = self.column("op"), np.arange(self.program.devices)[None, :]
        last = self.column("chunk") * self.program.devices + d == self.program.stages - 1
        return np.select([op == FWD, (op == BWD) & last, op == BWD], [c["F"], c["F"] + c["B"], c["B"]], 0.0)

    def step_time(self, costs: dict | None = None) -> float:
        """A lock-step step's length: every slot lasts as long as its costliest row."""
        return float(self.slot_costs(costs).max(axis=1).sum())

    def useful_fraction(self, costs: dict | None = None) -> float:
        """The devices' busy share of a lock-step step (1 - the bubble)."""
        return float(self.slot_costs(costs).sum()) / (self.program.devices * self.step_time(costs))

    def render(self) -> str:
        """Slot x device picture: ``F3`` forward of microbatch 3, ``B0c1`` backward on chunk 1, ``.`` idle."""
        op, mb, ch = self.column("op"), self.column("microbatch"), self.column("chunk")

        def cell(k, d):
            if op[k, d] == IDLE:
                return "."
            return f"{OPS[op[k, d]]}{mb[k, d]}" + (f"c{ch[k, d]}" if ch[k, d] else "")

        width = max(len(cell(k, d)) for k in range(self.slots) for d in range(op.shape[1])) + 1
        head = (f"{self.program.name}: P={self.program.devices}, M={self.program.microbatches}, {self.slots} slots, "
                f"useful {self.useful_fraction():.0%}; entries held: "
                + ", ".join(f"{b} {self.held(b)}" for b in ("stash", "fwd", "bwd")))
        lines = [head, "slot  " + "".join(f"d{d}".ljust(width) for d in range(op.shape[1]))]
        lines += [f"{k:<6d}" + "".join(cell(k, d).ljust(width) for d in range(op.shape[1])) for k in range(self.slots)]
        return "\n".join(lines)


class _Pool:
    """Static allocation of one buffer's entries on each device: lowest free index first."""

    def __init__(self, devices: int):
        self.where = [dict() for _ in range(devices)]  # key -> index
        self.peak = 0

    def take(self, d: int, key) -> int:
        used = set(self.where[d].values())
        i = next(i for i in range(len(used) + 1) if i not in used)
        self.where[d][key] = i
        self.peak = max(self.peak, len(self.where[d]))
        return i

    def index(self, d: int, key) -> int:
        return self.where[d][key]

    def give(self, d: int, key) -> int:
        return self.where[d].pop(key)


def place(program: programs.Program) -> list[list]:
    """The program's actions in lock-step slots: ``slots[k][d]`` is device ``d``'s action at slot
    ``k`` (an :class:`~asyncpp_jax.pipeline.programs.Op`) or None.  The last virtual stage's ``F``
    computes nothing (its ``B`` runs the fused vjp), so it takes no slot: it is done as soon as its
    input has arrived, and the action after it may run in the same slot."""
    lists = programs.unroll(program, 1)
    nxt, slot_of, slots = [0] * program.devices, {}, []

    def ready(op, k):
        return all((e := programs._ended(slot_of, *dep)) is not None and e < k
                   for dep in programs._deps(op, program.stages))

    while any(nxt[d] < len(ops) for d, ops in enumerate(lists)):
        k, row = len(slots), [None] * program.devices
        for d, ops in enumerate(lists):
            op = ops[nxt[d]] if nxt[d] < len(ops) else None
            if op is not None and op.kind == "F" and op.stage == program.stages - 1 and ready(op, k):
                slot_of[op.key] = k - 0.5  # ended before this slot: what follows may run in it
                nxt[d] += 1
                op = ops[nxt[d]] if nxt[d] < len(ops) else None
            if op is not None and ready(op, k):
                row[d] = op
                nxt[d] += 1
        if not any(row) and not any(nxt[d] < len(ops) for d, ops in enumerate(lists)):
            break  # only a last-stage F was left
        if not any(row) and all(nxt[d] == len(ops) or not ready(ops[nxt[d]], k + 1) for d, ops in enumerate(lists)):
            raise programs.ProgramError(f"{program.name}: rule 'dataflow': no action can run at slot {k}")
        for op in filter(None, row):
            slot_of[op.key] = k
        slots.append(row)
    return slots


def compile_program(program: programs.Program, recompute: bool = True) -> SlotPlan:
    """Validate ``program`` and compile it into a :class:`SlotPlan`.  Flushed programs (``delay = 0``)
    with ``F`` and ``B`` actions only, for now: a flushless program carries buffers across steps and a
    split backward (``I``, ``W``) needs the weight-gradient half kept apart from the input-gradient
    half inside the block's ``vjp``."""
    programs.validate(program)
    if program.delay:
        raise programs.ProgramError(f"{program.name}: the program executor runs flushed programs (delay 0) only; "
                                    "2bw runs on the tick tables (config.pipeline.schedule=2bw)")
    kinds = {a.kind for acts in program.actions for a in acts}
    if not kinds <= {"F", "B"}:
        raise programs.ProgramError(f"{program.name}: the program executor runs F and B actions only, not "
                                    f"{', '.join(sorted(kinds - {'F', 'B'}))}")
    if program.chunks > 1:
        raise programs.ProgramError(f"{program.name}: the program executor runs one model chunk per device, not "
                                    f"{program.chunks} (an interleaved layout of the layer stack is not built)")
    P, last = program.devices, program.stages - 1
    slots = place(program)
    pools = {name: _Pool(P) for name in ("stash", "fwd", "bwd")}
    rows = np.zeros((len(slots), P, len(COLUMNS)), np.int32)
    stores = []  # per slot: (buffer, device, key) arrivals, allocated after the slot's reads
    for k, row in enumerate(slots):
        frees, arrivals = [], []
        for d, op in enumerate(row):
            if op is None:
                continue
            u, m = op.stage, op.g
            r = rows[k, d]
            r[:3] = (FWD if op.kind == "F" else BWD, m, op.action.chunk)
            if op.kind == "F":  # never the last stage's (place() gives it no slot)
                if u > 0:
                    r[4] = pools["fwd"].index(d, (u - 1, m))
                    frees.append(("fwd", d, (u - 1, m)))
                if u > 0 or not recompute:
                    r[3] = pools["stash"].take(d, (u, m))
                arrivals.append(("fwd", program.device_of(u + 1), (u, m)))
            else:
                if u == last:
                    r[4] = pools["fwd"].index(d, (u - 1, m))
                    frees.append(("fwd", d, (u - 1, m)))
                else:
                    if u > 0 or not recompute:
                        r[3] = pools["stash"].index(d, (u, m))
                        frees.append(("stash", d, (u, m)))
                    r[5] = pools["bwd"].index(d, (u + 1, m))
                    frees.append(("bwd", d, (u + 1, m)))
                if u > 0:
                    arrivals.append(("bwd", program.device_of(u - 1), (u, m)))
        for name, d, key in frees:
            pools[name].give(d, key)
        stores.append([(name, d, pools[name].take(d, key)) for name, d, key in arrivals])
    depth = {name: pool.peak + 1 for name, pool in pools.items()}
    for k, arrived in enumerate(stores):
        rows[k, :, 6], rows[k, :, 7] = depth["fwd"] - 1, depth["bwd"] - 1  # the write-only entry
        for name, d, i in arrived:
            rows[k, d, 6 if name == "fwd" else 7] = i
    rows[..., 3] = np.where((rows[..., 0] == IDLE) | _unstashed(rows, program, recompute), depth["stash"] - 1,
                            rows[..., 3])
    return SlotPlan(program, rows, depth)


def _unstashed(rows, program, recompute: bool) -> np.ndarray:
    """The rows whose action saves nothing: the last virtual stage's, and stage 0's under recompute."""
    d = np.arange(program.devices)[None, :]
    stage = rows[..., 2] * program.devices + d
    return (stage == program.stages - 1) | ((stage == 0) & recompute)
