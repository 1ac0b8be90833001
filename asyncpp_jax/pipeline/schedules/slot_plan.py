"""A validated program compiled into the static tables the engine's program executor scans.

The executor (:mod:`asyncpp_jax.pipeline.spmd.loop`) is SPMD: every device runs the same
code in lock-step slots, each slot at most one backward and one forward per device followed by one
exchange of activations to the next device and of input gradients to the previous one.  This
module places a :class:`~asyncpp_jax.pipeline.schedules.programs.Program`'s per-device lists into those slots
(:func:`asyncpp_jax.pipeline.schedules.programs.lockstep`'s rule: an action runs in the first slot after
every action it depends on; paired, a device also runs the action after it in the same slot when
that one is of the other kind and ready) and assigns every buffer entry statically, so nothing
about the schedule is decided while tracing:

* ``stash``: the stage's saved input (or autodiff residuals) from a microbatch's ``F`` to its ``B``;
  stage 0 with recompute re-embeds the tokens and saves nothing;
* ``fwd``: an activation from the previous device, from its arrival to the ``F`` that reads it; the
  last virtual stage keeps it until its ``B``, which runs the fused block + head + loss ``vjp``
  (its ``F`` computes nothing: the full-vocabulary logits exist in one slot only);
* ``bwd``: an input gradient from the next device, from its arrival to the ``B`` that reads it;
* ``save`` (a split backward, ``zb-h1``): what an ``I`` keeps for its ``W``, every leaf call's input
  and output cotangent (:mod:`asyncpp_jax.models.taps`), from the ``I`` to the ``W``.  The ``I``
  takes the ``B``'s columns (and frees the stash entry); the last stage's ``I`` runs the fused vjp
  with respect to the head, the input and the taps.

Each buffer's depth is the peak number of entries the plan holds at once on any device, plus one
write-only entry (the last) that a slot's exchange writes when nothing arrives.  Entries are reused
as soon as they are read: within a slot the backward runs before the forward, and both read before
the exchange writes.

A slot lasts as long as its costliest device (:meth:`SlotPlan.step_time`).  One action per slot
(unpaired) lets a forward-only slot be short; pairing lets a forward hide beside a backward (a
forward and a backward per slot, in the eager and crossing orders).  :func:`compile_program` keeps whichever placement is faster at ``B = 2F``.

A table row (:data:`COLUMNS`) per device and slot: the forward's microbatch (or ``IDLE``), chunk,
stash entry and ``fwd`` entry; the backward's microbatch (or ``IDLE``), chunk, stash entry, ``fwd``
entry (the last stage's input) and ``bwd`` entry; and where the slot's arrivals land; for a split
backward, the ``I``'s ``save`` entry and the ``W``'s microbatch (or ``IDLE``), chunk and ``save`` entry.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncpp_jax.pipeline.schedules import programs

IDLE = np.iinfo(np.int32).min  # no forward (or no backward) in this slot
COLUMNS = ("f", "f_chunk", "f_stash", "f_fwd", "b", "b_chunk", "b_stash", "b_fwd", "b_bwd", "fwd_store", "bwd_store",
           "b_save", "w", "w_chunk", "w_save")
BUFFERS = ("stash", "fwd", "bwd", "save")
INDEX = {name: i for i, name in enumerate(COLUMNS)}  # a column's place in a row


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """``rows[k, d]``: device ``d``'s row at slot ``k`` (:data:`COLUMNS`); ``depth``: entries per
    buffer (``stash``, ``fwd``, ``bwd``), the write-only one included; ``paired``: whether a slot
    may hold a forward and a backward."""

    program: programs.Program
    rows: np.ndarray  # int32 [slots, devices, len(COLUMNS)]
    depth: dict
    paired: bool
    # A flushless program's entries are kept across steps: entry ``(rows value + step * M) mod
    # (depth - 1)`` holds microbatch ``step * M + m`` (the last entry stays the write-only one).
    # False: a flushed plan's entries are the rows' values as they are.
    cyclic: bool = False

    @property
    def slots(self) -> int:
        return self.rows.shape[0]

    def column(self, name: str) -> np.ndarray:
        return self.rows[..., INDEX[name]]

    def held(self, name: str) -> int:
        """Peak entries of buffer ``name`` that hold something (the depth less the write-only one)."""
        return self.depth[name] - 1

    def slot_costs(self, costs: dict | None = None) -> np.ndarray:
        """``[slots, devices]``: each row's cost at ``costs`` (``programs.DEFAULT_COSTS``: ``F = 1``,
        ``B = 2``), split over an interleaved device's chunks; the last stage's ``B`` runs its
        forward too (``F + B``)."""
        return _row_costs(self.program, self.rows, costs)

    def step_time(self, costs: dict | None = None) -> float:
        """A lock-step step's length: every slot lasts as long as its costliest row."""
        return float(self.slot_costs(costs).max(axis=1).sum())

    def useful_fraction(self, costs: dict | None = None) -> float:
        """The devices' busy share of a lock-step step (1 - the bubble)."""
        return float(self.slot_costs(costs).sum()) / (self.program.devices * self.step_time(costs))

    @property
    def split(self) -> bool:
        """Whether the program's backward is split into ``I`` and ``W`` actions."""
        return is_split(self.program)

    def render(self) -> str:
        """Slot x device picture: ``F3`` forward of microbatch 3, ``B0c1`` backward on chunk 1
        (``I``/``W`` for a split backward), ``B0/F4`` both in one slot, ``.`` idle."""
        f, b, w = self.column("f"), self.column("b"), self.column("w")
        fc, bc, wc = self.column("f_chunk"), self.column("b_chunk"), self.column("w_chunk")
        b_kind = "I" if self.split else "B"

        def cell(k, d):
            parts = [f"{kind}{m[k, d]}" + (f"c{c[k, d]}" if c[k, d] else "")
                     for kind, m, c in ((b_kind, b, bc), ("W", w, wc), ("F", f, fc)) if m[k, d] != IDLE]
            return "/".join(parts) or "."

        P = self.program.devices
        width = max(len(cell(k, d)) for k in range(self.slots) for d in range(P)) + 1
        head = (f"{self.program.name}: P={P}, M={self.program.microbatches}, {self.slots} "
                f"{'paired ' if self.paired else ''}slots, useful {self.useful_fraction():.0%}; entries held: "
                + ", ".join(f"{b} {self.held(b)}" for b in BUFFERS if b != "save" or self.split))
        lines = [head, "slot  " + "".join(f"d{d}".ljust(width) for d in range(P))]
        lines += [f"{k:<6d}" + "".join(cell(k, d).ljust(width) for d in range(P)) for k in range(self.slots)]
        return "\n".join(lines)


def is_split(program: programs.Program) -> bool:
    return any(a.kind == "I" for acts in program.actions for a in acts)


def _row_costs(program, rows, costs: dict | None) -> np.ndarray:
    c = {**programs.DEFAULT_COSTS, **(costs or {})}
    d = np.arange(program.devices)[None, :]
    f, b, w = rows[..., INDEX["f"]], rows[..., INDEX["b"]], rows[..., INDEX["w"]]
    last = rows[..., INDEX["b_chunk"]] * program.devices + d == program.stages - 1
    backward = c["I"] if is_split(program) else c["B"]
    cost = (np.where(f != IDLE, c["F"], 0.0) + np.where(b != IDLE, backward + np.where(last, c["F"], 0.0), 0.0)
            + np.where(w != IDLE, c["W"], 0.0))
    return cost / program.chunks


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


def place(program: programs.Program, paired: bool = False) -> list[list[list]]:
    """The program's actions in lock-step slots: ``slots[k][d]`` lists device ``d``'s actions at
    slot ``k`` (:class:`~asyncpp_jax.pipeline.schedules.programs.Op`: none, one, or with ``paired`` one
    backward and one forward).  The last virtual stage's ``F`` computes nothing (its ``B`` runs the
    fused vjp), so it takes no slot: it is done as soon as its input has arrived.  A flushless
    program is placed in its steady state: the window of step ``delay`` (every batch it touches
    exists), whose dependencies on earlier windows were met before it began."""
    window = program.delay
    unrolled = programs.unroll(program, window + 1)
    lists = [[op for op in ops if op.step == window] for ops in unrolled]
    nxt, slots = [0] * program.devices, []
    slot_of = {op.key: -1 for ops in unrolled for op in ops if op.step < window}

    def ready(op, k):
        return all((e := programs.ended(slot_of, *dep)) is not None and e < k
                   for dep in programs.deps(op, program.stages))

    while any(nxt[d] < len(ops) for d, ops in enumerate(lists)):
        k, row = len(slots), [[] for _ in range(program.devices)]
        for d, ops in enumerate(lists):
            while nxt[d] < len(ops):
                op = ops[nxt[d]]
                if op.kind == "F" and op.stage == program.stages - 1 and program.training and ready(op, k):
                    slot_of[op.key] = k - 0.5  # ended before this slot: what follows may run in it
                elif (len(row[d]) < (2 if paired else 1) and ready(op, k)
                      and all((o.kind == "F") != (op.kind == "F") for o in row[d])):
                    row[d].append(op)
                else:
                    break
                nxt[d] += 1
        if not any(row):
            if all(nxt[d] == len(ops) for d, ops in enumerate(lists)):
                break  # only a last-stage F was left
            raise programs.ProgramError(f"{program.name}: rule 'dataflow': no action can run at slot {k}")
        for op in (o for ops in row for o in ops):
            slot_of[op.key] = k
        slots.append(row)
    return slots


def path(program: programs.Program, paired: bool, costs: dict | None = None) -> float:
    """The lock-step path of ``program`` placed by :func:`place` (any program: chunks and split
    backwards too): each slot lasts as long as its busiest device's actions, an interleaved chunk's
    costing ``1/v`` of the stage's and the last stage's ``B`` its ``F`` too."""
    c = {**programs.DEFAULT_COSTS, **(costs or {})}

    def cost(op):
        return (c[op.kind] + (c["F"] if op.kind in programs.BACKWARDS and op.stage == program.stages - 1 else 0.0)
                ) / program.chunks

    return float(sum(max(sum(cost(op) for op in ops) for ops in row) for row in place(program, paired)))


def compile_schedule(name: str, n_stages: int, microbatches: int, recompute: bool = True,
                     virtual_stages: int = 1) -> SlotPlan:
    """The plan of schedule ``name`` (``programs.generate``; ``virtual_stages`` chunks per device
    under ``interleaved``)."""
    v = virtual_stages if name == "interleaved" else None
    return compile_program(programs.generate(name, n_stages, microbatches, v), recompute)


def compile_program(program: programs.Program, recompute: bool = True, paired: bool | None = None) -> SlotPlan:
    """Validate ``program`` and compile it into a :class:`SlotPlan`, paired or not as ``paired``
    says (None: the faster at the default costs, unpaired on a tie).  Flushed programs
    (``delay = 0``) with ``F`` and ``B`` actions, or ``F``, ``I`` and ``W`` (a split backward), on
    any number of chunks per device; flushless ones (``delay > 0``) with ``F`` and ``B`` on one
    chunk per device, their buffers kept across steps (:func:`_compile_flushless`)."""
    programs.validate(program)
    kinds = {a.kind for acts in program.actions for a in acts}
    if not (kinds <= {"F", "B"} or kinds <= {"F", "I", "W"}):
        raise programs.ProgramError(f"{program.name}: the program executor runs F with either B or I and W "
                                    f"actions, not {', '.join(sorted(kinds))} in one program")
    if program.flushless and not (kinds <= {"F", "B"} and program.chunks == 1):
        raise programs.ProgramError(f"{program.name}: a flushless program runs F and B actions on one chunk per "
                                    f"device, not {', '.join(sorted(kinds))} on {program.chunks}")
    build = _compile_flushless if program.flushless else _compile
    if paired is None:
        plans = [build(program, recompute, p) for p in (False, True)]
        return min(plans, key=lambda plan: (plan.step_time(), plan.paired))
    return build(program, recompute, paired)


def _compile(program: programs.Program, recompute: bool, paired: bool) -> SlotPlan:
    P, last = program.devices, program.stages - 1
    slots = place(program, paired)
    pools = {name: _Pool(P) for name in BUFFERS}
    rows = np.full((len(slots), P, len(COLUMNS)), -1, np.int32)
    rows[..., INDEX["f"]] = rows[..., INDEX["b"]] = rows[..., INDEX["w"]] = IDLE
    saves = lambda u: u < last and (u > 0 or not recompute)  # noqa: E731  (what a stage's F stashes)
    stores = []  # per slot: (buffer, device, index) of its arrivals
    for k, row in enumerate(slots):
        frees, arrivals = [], []
        # Backward first: an entry it frees may take the forward's write in the same slot.
        for d, op in sorted(((d, op) for d, ops in enumerate(row) for op in ops), key=lambda x: x[1].kind == "F"):
            u, m, r = op.stage, op.g, rows[k, d]
            if op.kind == "W":
                r[[INDEX["w"], INDEX["w_chunk"]]] = m, op.action.chunk
                r[INDEX["w_save"]] = pools["save"].index(d, (u, m))
                frees.append(("save", d, (u, m)))
            elif op.kind in programs.BACKWARDS:
                if op.kind == "I":
                    r[INDEX["b_save"]] = pools["save"].take(d, (u, m))
                r[[INDEX["b"], INDEX["b_chunk"]]] = m, op.action.chunk
                if u == last:
                    r[INDEX["b_fwd"]] = pools["fwd"].index(d, (u - 1, m))
                    frees.append(("fwd", d, (u - 1, m)))
                else:
                    if saves(u):  # freed now: this device's forward may take the entry in this slot
                        r[INDEX["b_stash"]] = pools["stash"].give(d, (u, m))
                    r[INDEX["b_bwd"]] = pools["bwd"].index(d, (u + 1, m))
                    frees.append(("bwd", d, (u + 1, m)))
                if u > 0:
                    arrivals.append(("bwd", program.device_of(u - 1), (u, m)))
            else:  # the last stage's F only in a forward-only program (place() gives it no slot otherwise)
                r[[INDEX["f"], INDEX["f_chunk"]]] = m, op.action.chunk
                if u > 0:
                    r[INDEX["f_fwd"]] = pools["fwd"].index(d, (u - 1, m))
                    frees.append(("fwd", d, (u - 1, m)))
                if saves(u) and program.training:
                    r[INDEX["f_stash"]] = pools["stash"].take(d, (u, m))
                if u < last:
                    arrivals.append(("fwd", program.device_of(u + 1), (u, m)))
        for name, d, key in frees:
            pools[name].give(d, key)
        stores.append([(name, d, pools[name].take(d, key)) for name, d, key in arrivals])
    depth = {name: pool.peak + 1 for name, pool in pools.items()}
    for name in BUFFERS:  # unused reads point at the write-only entry
        cols = [INDEX[c] for c in COLUMNS if c.endswith("_" + name) and c != f"{name}_store"]
        rows[..., cols] = np.where(rows[..., cols] < 0, depth[name] - 1, rows[..., cols])
    rows[..., INDEX["fwd_store"]], rows[..., INDEX["bwd_store"]] = depth["fwd"] - 1, depth["bwd"] - 1
    for k, arrived in enumerate(stores):
        for name, d, i in arrived:
            rows[k, d, INDEX[f"{name}_store"]] = i
    return SlotPlan(program, rows, depth, paired)


def _intervals(program: programs.Program, slots: list, recompute: bool, windows: int) -> dict:
    """Per buffer, per device: ``{g: [first, last]}``, the times an entry for global microbatch ``g``
    is held over ``windows`` repetitions of the steady window ``slots`` (a message lands half a slot
    after its sender's slot; an entry is held through the slot that reads it)."""
    P, last, M, K = program.devices, program.stages - 1, program.microbatches, len(slots)
    held = {name: [dict() for _ in range(P)] for name in ("stash", "fwd", "bwd")}

    def mark(name, d, g, t):
        lo, hi = held[name][d].get(g, (t, t))
        held[name][d][g] = (min(lo, t), max(hi, t))

    for n in range(windows):
        for k, row in enumerate(slots):
            t = n * K + k
            for d, ops in enumerate(row):
                for op in ops:
                    g, u = op.g + (n - program.delay) * M, op.stage
                    if op.kind == "F":
                        if 0 < u < last or (u == 0 and not recompute):
                            mark("stash", d, g, t)
                        if u > 0:
                            mark("fwd", d, g, t)
                        if u < last:
                            mark("fwd", program.device_of(u + 1), g, t + 0.5)
                    else:
                        if 0 < u < last or (u == 0 and not recompute):
                            mark("stash", d, g, t)
                        mark("fwd" if u == last else "bwd", d, g, t)
                        if u > 0:
                            mark("bwd", program.device_of(u - 1), g, t + 0.5)
    return held


def _modulus(entries: list[dict]) -> int:
    """The fewest entries ``S`` such that no two microbatches held at once on a device share
    ``g mod S``."""
    pairs = [(g1, g2) for per in entries for g1, (a1, b1) in per.items() for g2, (a2, b2) in per.items()
             if g1 < g2 and a1 <= b2 and a2 <= b1]
    S = max([1] + [len({g for g, (a, b) in per.items() if a <= t <= b}) for per in entries
                   for t in {a for a, _ in per.values()}])
    while any((g2 - g1) % S == 0 for g1, g2 in pairs):
        S += 1
    return S


def _compile_flushless(program: programs.Program, recompute: bool, paired: bool) -> SlotPlan:
    """A flushless program's steady window as rows whose entries are kept across steps: microbatch
    ``g`` of the stream has entry ``g mod S`` of each buffer (``S`` the fewest entries for which no
    two microbatches a device holds at once collide, found over ``delay + 3`` windows), so the
    stash, the activations and the cotangents a step leaves behind are where the next step reads
    them.  The rows hold ``m mod S`` for step-relative ``m``; the executor adds ``step * M``."""
    P, last, M = program.devices, program.stages - 1, program.microbatches
    slots = place(program, paired)
    held = _intervals(program, slots, recompute, program.delay + 3)
    S = {name: _modulus(held[name]) for name in ("stash", "fwd", "bwd")}
    S["save"] = 1
    rows = np.full((len(slots), P, len(COLUMNS)), -1, np.int32)
    rows[..., INDEX["f"]] = rows[..., INDEX["b"]] = rows[..., INDEX["w"]] = IDLE
    for k, row in enumerate(slots):
        for d, ops in enumerate(row):
            for op in ops:
                m, u, r = op.g - program.delay * M, op.stage, rows[k, d]
                if op.kind == "F":
                    r[[INDEX["f"], INDEX["f_chunk"]]] = m, 0
                    if u > 0:
                        r[INDEX["f_fwd"]] = m % S["fwd"]
                    if 0 < u < last or (u == 0 and not recompute):
                        r[INDEX["f_stash"]] = m % S["stash"]
                    if u < last:
                        rows[k, program.device_of(u + 1), INDEX["fwd_store"]] = m % S["fwd"]
                else:
                    r[[INDEX["b"], INDEX["b_chunk"]]] = m, 0
                    if u == last:
                        r[INDEX["b_fwd"]] = m % S["fwd"]
                    else:
                        r[INDEX["b_bwd"]] = m % S["bwd"]
                        if u > 0 or not recompute:
                            r[INDEX["b_stash"]] = m % S["stash"]
                    if u > 0:
                        rows[k, program.device_of(u - 1), INDEX["bwd_store"]] = m % S["bwd"]
    depth = {name: s + 1 for name, s in S.items()}
    for name in BUFFERS:  # unused reads, and stores where nothing arrives, point at the write-only entry
        cols = [INDEX[c] for c in COLUMNS if c.endswith("_" + name) or c == f"{name}_store"]
        rows[..., cols] = np.where(rows[..., cols] < 0, depth[name] - 1, rows[..., cols])
    return SlotPlan(program, rows, depth, paired, cyclic=True)
