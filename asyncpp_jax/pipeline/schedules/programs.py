"""Pipeline schedules as programs: one list of actions per device, validated before anything compiles.

A schedule is data.  ``Program.actions[d]`` is the ordered list of what device ``d`` runs in one
step; an :class:`Action` names its kind (``F`` forward, ``B`` full backward, or its two halves
``I`` input gradient and ``W`` weight gradient), the microbatch, the model chunk on that device
(interleaved schedules hold ``v`` chunks per device: virtual stage ``chunk * P + device``, Megatron's
layout) and the weight version it reads.  The vocabulary follows torch.distributed.pipelining's
``_Action`` (``F``, ``B``, ``I``, ``W``), its ``_validate_schedule`` and its lowering into
send/recv pairs; the schedules are

* ``1f1b``: textbook 1F1B with a flush (PipeDream-Flush, Narayanan et al. 2021; 1F1B is PipeDream's,
  Narayanan et al. 2019): device ``s`` runs
  ``P - 1 - s`` warm-up forwards, then one forward and one backward in turn, so it holds at most
  ``P - s`` microbatches;
* ``interleaved``: Megatron's interleaved 1F1B with ``v`` chunks per device (Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters"), bubble ``(P - 1)/(v M)``;
* ``zb-h1``: zero bubble H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with ``B``
  split into ``I`` (on the critical path) and ``W`` (deferred into the cool-down bubble; device
  ``s`` defers ``s`` of them, so every device holds at most ``P`` microbatches, 1F1B's peak);
* ``sync``: 1F1B with a flush whose backwards run as early as the lock-step dataflow allows:
  device ``s`` runs ``2(P - 1 - s)`` warm-up forwards, then one forward and one backward in turn
  (the eager order of GPipe-style "backward as soon as possible" tables; it holds up to
  ``2(P - s) - 1`` microbatches, ``1f1b`` at most ``P - s``);
* ``2bw``: PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training"): 1F1B that never flushes; a microbatch uses its batch's weights for its forward and
  its backward, and update ``t`` applies batch ``t - 1`` (two weight versions, one-step delay);
* ``pipedream``: PipeDream's per-stage delay (Narayanan et al. 2019, "PipeDream: Generalized
  Pipeline Parallelism for DNN Training") with vertical sync: a batch reads one weight version on
  every stage, runs its forwards in its own step, and stage ``s`` runs its backwards ``P - 1 - s``
  steps later, so update ``t`` applies stage ``s``'s gradient of batch ``t - (P - 1 - s)`` and
  stage ``s`` keeps ``P - s`` weight versions (weight stashing).

Microbatches are step-relative: ``m`` in ``[0, M)`` is this step's batch, ``m < 0`` the microbatch
``m mod M`` of batch ``t + m // M`` (``-1``: the previous batch's last).  A program with ``delay = 0``
is one flushed step; with ``delay > 0`` it is one window of a steady state that repeats every step
(the first steps' references to batches before the first are the fill: nothing runs there).
Versions are relative too: ``0`` reads ``w[t]``, ``-1`` reads ``w[t-1]``.  Each virtual stage ``u``
has a delay ``d_u`` (``stage_delays``; by default every stage the program's ``delay``): update
``t`` applies stage ``u``'s gradient of batch ``t - d_u``.  This is the one place the engine's delay
lives: the executor reads the versions and the stage delays off the program, nothing else.

:func:`validate` checks, naming the device, the action and the rule:

* ``shape``: one list per device, known kinds, chunks in range;
* ``version``: a microbatch reads its batch's weights in every action (one version for its F and
  its B/I/W), and stage ``u`` touches no batch older than its delay ``d_u`` (sync: the step's
  weights; 2bw: one step stale, two versions live; pipedream: stage ``s`` ``P - 1 - s`` stale);
* ``once``: every (virtual stage, microbatch) gets one ``F`` and either one ``B`` or one ``I`` and
  one ``W`` per step;
* ``order``: on each device a microbatch's ``F`` precedes its ``B``/``I``, and ``I`` precedes ``W``;
* ``dataflow``: stage ``u + 1``'s ``F`` of ``m`` waits for stage ``u``'s, stage ``u``'s ``B``/``I``
  of ``m`` for stage ``u + 1``'s; run as a list schedule, the program must not deadlock;
* ``channels``: lowered to send/recv pairs, each device-to-device channel receives its messages in
  the order they were sent (what one ``ppermute`` per slot, or ordered point-to-point, needs).

Derived from a program, not from formulas: :func:`stash_depth` (peak microbatches whose activations
a device holds), :func:`simulate` (a discrete-event run of the per-device lists with point-to-point
dependencies and the weight update as a collective at each step's end, from per-action costs),
:func:`step_time` (a flushed step's critical path, or the steady-state period of a flushless one),
:func:`bubble_fraction`, :func:`buffers` (peak messages in transit per channel) and
:func:`min_microbatches` (the smallest ``M`` whose generated program validates).

The engine executes every valid program: :mod:`asyncpp_jax.pipeline.schedules.slot_plan` places it into
lock-step slots and assigns every buffer entry (a flushless program's entries are kept across
steps, in the checkpointed state), :mod:`asyncpp_jax.pipeline.spmd.loop` runs the rows.
Flushed programs run ``F`` with ``B``, or with ``I`` and ``W``, on any number of chunks per device;
flushless ones ``F`` and ``B`` on one chunk per device.  docs/design.md, section 6.1, says what
constrains the lock-step executor (slots last as long as their costliest action,
:func:`lockstep`; a message crosses a device boundary in one slot; on XLA:CPU a conditional whose
branches both write the stash ring copies it at every slot).
"""

from __future__ import annotations

import collections
import dataclasses

KINDS = ("F", "B", "I", "W")
BACKWARDS = ("B", "I")  # the actions that send a gradient to the previous stage
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class ProgramError(ValueError):
    """A program that breaks a rule; the message names the device, the action and the rule."""


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of work on a device: ``kind`` of step-relative ``microbatch`` on model ``chunk``,
    reading weight ``version`` (0: ``w[t]``, -1: ``w[t-1]``)."""

    kind: str
    microbatch: int
    chunk: int = 0
    version: int = 0

    def __str__(self) -> str:
        return (f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")
                + (f"@w[t{self.version:+d}]" if self.version else ""))


@dataclasses.dataclass(frozen=True)
class Program:
    """``actions[d]``: device ``d``'s actions in order for one step (one window when ``delay > 0``)."""

    name: str
    devices: int
    microbatches: int
    actions: tuple
    chunks: int = 1
    delay: int = 0
    training: bool = True  # False: a forward-only program (eval): one F per stage and microbatch, nothing else
    stage_delays: tuple | None = None  # d_u per virtual stage (None: every stage ``delay``); delay = max(d_u)

    @property
    def stages(self) -> int:
        """Virtual stages: ``chunks * devices``."""
        return self.chunks * self.devices

    @property
    def delays(self) -> tuple:
        """``d_u`` per virtual stage: update ``t`` applies stage ``u``'s gradient of batch ``t - d_u``."""
        return tuple(self.stage_delays) if self.stage_delays is not None else (self.delay,) * self.stages

    @property
    def flushless(self) -> bool:
        """Whether batches cross step boundaries (the state carries what is in flight)."""
        return self.delay > 0

    def stage_of(self, device: int, chunk: int) -> int:
        return chunk * self.devices + device

    def device_of(self, stage: int) -> int:
        return stage % self.devices

    def render(self) -> str:
        return "\n".join(f"d{d}: " + " ".join(map(str, acts)) for d, acts in enumerate(self.actions))

    def useful_fraction(self) -> float:
        """``1 -`` :func:`bubble_fraction` at the default costs (as a tick table's)."""
        return 1.0 - bubble_fraction(self)


@dataclasses.dataclass(frozen=True)
class Op:
    """An action placed in an unrolled run: global microbatch ``g = step * M + microbatch``, its
    virtual ``stage``, its ``batch`` (the step whose batch it is) and the step window it runs in."""

    kind: str
    g: int
    stage: int
    batch: int
    step: int
    action: Action

    @property
    def key(self):
        return (self.kind, self.stage, self.g)


def _batch(m: int, M: int) -> int:
    """The batch of step-relative microbatch ``m``: 0 this step's, -1 the previous one's."""
    return m // M


def _act(kind: str, m: int, M: int, chunk: int = 0) -> Action:
    """An action reading its batch's weights (the rule every generator follows)."""
    return Action(kind, m, chunk, _batch(m, M))


# ------------------------------------------------------------------------------------- generators


def one_f_one_b(P: int, M: int) -> Program:
    """Textbook 1F1B with a flush: ``P - 1 - s`` warm-up forwards on device ``s``, then F/B in turn,
    then the cool-down backwards (PipeDream-Flush, Narayanan et al. 2021)."""
    lists = []
    for s in range(P):
        warm = min(P - 1 - s, M)
        acts = [_act("F", m, M) for m in range(warm)]
        for i in range(M - warm):
            acts += [_act("F", warm + i, M), _act("B", i, M)]
        acts += [_act("B", m, M) for m in range(M - warm, M)]
        lists.append(tuple(acts))
    return Program("1f1b", P, M, tuple(lists))


def zb_h1(P: int, M: int) -> Program:
    """ZB-H1 (Qi et al. 2024): 1F1B with each ``B`` split into ``I`` then ``W``; device ``s`` runs its
    first ``s`` steady-state iterations without a ``W`` (as torch's ZB1P does), so the deferred
    ``W``s fill the cool-down bubble and no device holds more than ``P`` microbatches."""
    lists = []
    for s in range(P):
        warm = min(P - 1 - s, M)
        acts, w_next = [_act("F", m, M) for m in range(warm)], 0
        for i in range(M - warm):
            acts += [_act("F", warm + i, M), _act("I", i, M)]
            if i >= s:
                acts.append(_act("W", w_next, M))
                w_next += 1
        for m in range(M - warm, M):
            acts += [_act("I", m, M), _act("W", w_next, M)]
            w_next += 1
        acts += [_act("W", m, M) for m in range(w_next, M)]
        lists.append(tuple(acts))
    return Program("zb-h1", P, M, tuple(lists))


def _interleaved_order(k: int, P: int, v: int, backward: bool) -> tuple[int, int]:
    """Megatron's ``k``-th forward (or backward) on a device: microbatches go in groups of ``P``
    through chunk 0, 1, ..., v-1 (backwards through v-1, ..., 0); ``(microbatch, chunk)``."""
    group, chunk = divmod(k, P * v)
    chunk //= P
    return group * P + k % P, (v - 1 - chunk if backward else chunk)


def interleaved(P: int, M: int, v: int = 2) -> Program:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): device ``d`` holds chunks ``d, d + P, ...``,
    runs ``2(P - 1 - d) + (v - 1) P`` warm-up forwards, then one forward and one backward in turn.
    Needs ``M`` a multiple of ``P`` (the groups of ``P`` microbatches)."""
    if M % P:
        raise ProgramError(f"interleaved: microbatches={M} must be a multiple of devices={P} (Megatron's groups of P)")
    total = M * v
    lists = []
    for d in range(P):
        warm = min(2 * (P - 1 - d) + (v - 1) * P, total)

        def f(k):
            m, c = _interleaved_order(k, P, v, False)
            return _act("F", m, M, c)

        def b(k):
            m, c = _interleaved_order(k, P, v, True)
            return _act("B", m, M, c)

        acts = [f(k) for k in range(warm)]
        for i in range(total - warm):
            acts += [f(warm + i), b(i)]
        acts += [b(k) for k in range(total - warm, total)]
        lists.append(tuple(acts))
    return Program(f"interleaved v={v}", P, M, tuple(lists), chunks=v)


def two_bw(P: int, M: int) -> Program:
    """PipeDream-2BW (Narayanan et al. 2021) in steady state: 1F1B that never flushes; a negative
    microbatch is the previous batch's and reads ``w[t-1]``.  With ``M >= 2(P - 1)`` stage ``s``
    runs, at each of the step's ``M`` ticks ``k``, the forward of ``k - s`` and the backward of
    ``k - 2(P - 1) + s`` (forwards and backwards both cross the step boundary, so in lock-step every
    stage is busy at every tick: no ramp).  With ``P - 1 <= M < 2(P - 1)`` that order would reach two
    batches back, so stage ``s`` runs this step's forward ``k`` and the backward of the microbatch
    ``P - 1 - s`` behind it (the backwards alone cross the boundary).  Valid (two versions) from
    ``M >= P - 1``."""
    if M >= 2 * (P - 1):
        lists = [tuple(a for k in range(M) for a in (_act("F", k - s, M), _act("B", k - 2 * (P - 1) + s, M)))
                 for s in range(P)]
    else:
        lag = [P - 1 - s for s in range(P)]
        lists = [tuple(a for k in range(M) for a in (_act("F", k, M), _act("B", k - lag[s], M))) for s in range(P)]
    return Program("2bw", P, M, tuple(lists), delay=1)


def sync(P: int, M: int) -> Program:
    """A flushed step in the eager order: stage ``s`` runs the forward of ``m`` at tick ``m + s`` and
    its backward at tick ``m + 2(P - 1) - s`` (each tick's forward, then its backward), so it starts
    with ``2(P - 1 - s)`` warm-up forwards; its gradient is the unpipelined model's."""
    lists = []
    for s in range(P):
        acts = []
        for k in range(M + 2 * P - 2):
            f, b = k - s, k - 2 * (P - 1) + s
            acts += [_act("F", f, M)] * (0 <= f < M) + [_act("B", b, M)] * (0 <= b < M)
        lists.append(tuple(acts))
    return Program("sync", P, M, tuple(lists))


def pipedream(P: int, M: int) -> Program:
    """PipeDream (Narayanan et al. 2019) with vertical sync, per batch: step ``t`` runs every stage's
    forward of batch ``t`` at ``w[t]``; stage ``s`` runs its backwards of batch ``t - d_s``,
    ``d_s = P - 1 - s``, at that batch's weights ``w[t - d_s]``, so update ``t`` applies each stage's
    gradient with the stage's own delay (the simulate runner's ``staleness.mode=pipedream``,
    ``pipedream_gradient='per_leaf'``).  Stage ``s`` keeps ``P - s`` weight versions and the
    activations of ``P - s`` batches; the last stage's forward and backward of a microbatch are one
    fused step.  On stage ``s < P - 1`` each backward of the old batch comes before the forward it is
    paired with: the old batch's cotangents are all waiting when the step starts, so the stage works
    while this step's forwards ripple down the stages."""
    lists = []
    for s in range(P):
        lag = (P - 1 - s) * M
        acts = [a for k in range(M) for a in ((_act("B", k - lag, M), _act("F", k, M)) if lag
                                               else (_act("F", k, M), _act("B", k, M)))]
        lists.append(tuple(acts))
    return Program("pipedream", P, M, tuple(lists), delay=P - 1, stage_delays=tuple(range(P - 1, -1, -1)))


def forward_only(P: int, M: int, v: int = 1) -> Program:
    """Eval: every device runs the forward of each microbatch in turn; the last stage's forward
    ends in the loss.  In lock-step slots, stage ``s`` runs microbatch ``m`` at slot ``m + s``.
    With ``v`` chunks per device, microbatches go through the chunks in groups of ``P``, as in
    :func:`interleaved`'s forwards (any ``M``: the last group may be short)."""
    if v == 1:
        order = [(m, 0) for m in range(M)]
    else:
        order = [mc for k in range(-(-M // P) * P * v) if (mc := _interleaved_order(k, P, v, False))[0] < M]
    lists = tuple(tuple(_act("F", m, M, c) for m, c in order) for _ in range(P))
    return Program("forward" if v == 1 else f"forward v={v}", P, M, lists, chunks=v, training=False)


GENERATORS = {
    "sync": lambda P, M, v=1: sync(P, M),
    "1f1b": lambda P, M, v=1: one_f_one_b(P, M),
    "interleaved": lambda P, M, v=2: interleaved(P, M, v),
    "zb-h1": lambda P, M, v=1: zb_h1(P, M),
    "2bw": lambda P, M, v=1: two_bw(P, M),
    "pipedream": lambda P, M, v=1: pipedream(P, M),
    "forward": lambda P, M, v=1: forward_only(P, M, v),
}


def register(name: str, generator) -> None:
    """Add schedule ``name``: ``generator(P, M, v=1) -> Program``.  The engine runs it as it runs the
    built-in ones (``config.pipeline.schedule=name``, or ``EngineOptions(schedule=name, ...)``): a new
    schedule is a generator and nothing else (docs/pipeline.md, "Add a schedule")."""
    if name in GENERATORS:
        raise ProgramError(f"a schedule named {name!r} exists already; pick another name")
    GENERATORS[name] = generator


def generate(name: str, P: int, M: int, v: int | None = None) -> Program:
    """The program of schedule ``name`` (a key of ``GENERATORS``) for ``P`` devices and ``M`` microbatches."""
    if name not in GENERATORS:
        raise ProgramError(f"no schedule named {name!r}; known: {', '.join(GENERATORS)}")
    return GENERATORS[name](P, M) if v is None else GENERATORS[name](P, M, v)


# ---------------------------------------------------------------------------------- update offsets


@dataclasses.dataclass(frozen=True)
class Offsets:
    """Which update each gradient a program's step makes joins, as an offset from this step's.

    Stage ``u``'s gradient of batch ``t + k`` (``k <= 0``, the batch offset of its microbatch) is
    applied at update ``t + k + d_u`` (:attr:`Program.delays`), offset ``k + d_u``: 0 now,
    ``a > 0`` carried ``a`` steps in :class:`~asyncpp_jax.pipeline.spmd.state.PipelineState`.  Each group
    of leaves has its own delay: the layer rows their stage's, the embedding table the first
    stage's (a tied table both of its uses, as the simulate runner's per-leaf delays give it), the
    final norm and an untied head the last stage's; the loss sums are logged with the batch
    whose loss the last stage computed (offset ``k + d_last``).  ``reached``: per group, the
    offsets the program's actions add to (the accumulators held in a step); :meth:`count`: how
    many offsets it spans (``0 .. max``: the partial gradients carried across steps).  They differ
    where a group skips offsets: under ``pipedream`` a tied table's lookup gradient joins offset 0
    and its head gradient offset ``P - 1``, and nothing joins those between."""

    delays: tuple  # d_u per virtual stage
    microbatches: int
    tied: bool
    reached: tuple  # ((group, (offset, ...)), ...) for GROUPS, each ascending from 0

    GROUPS = ("layers", "embed", "final_norm", "lm_head", "stats")

    @classmethod
    def of(cls, program: Program, tied: bool) -> "Offsets":
        d, M, last = program.delays, program.microbatches, program.stages - 1
        reach = {g: {0} for g in cls.GROUPS}
        for dev, acts in enumerate(program.actions):
            for act in acts:
                u, k = program.stage_of(dev, act.chunk), act.microbatch // M
                if act.kind != "F":
                    reach["layers"].add(k + d[u])
                if act.kind in ("B", "I") and u == 0:
                    reach["embed"].add(k + d[0])
                if act.kind in ("B", "I") and u == last:
                    reach["final_norm"].add(k + d[last])
                    reach["embed" if tied else "lm_head"].add(k + d[0 if tied else last])
                if act.kind == "F" or u == last:
                    reach["stats"].add(k + d[last])
        return cls(tuple(d), M, tied, tuple((g, tuple(sorted(reach[g]))) for g in cls.GROUPS))

    def count(self, group: str) -> int:
        """How many update offsets ``group`` spans: ``0`` to the farthest its gradients join."""
        return self.slots(group)[-1] + 1

    def slots(self, group: str) -> tuple:
        """The offsets ``group``'s gradients join in a step, ascending: accumulator ``i`` of the
        group holds offset ``slots(group)[i]``."""
        return dict(self.reached)[group]

    def delay(self, group: str, stage: int | None = None) -> int:
        """A group's delay: the layer rows' their (virtual) ``stage``'s, the embedding's the first
        stage's, the final norm's, an untied head's and the loss sums' the last stage's."""
        if group == "layers":
            return self.delays[stage]
        return self.delays[0] if group == "embed" else self.delays[-1]

    @property
    def carried(self) -> int:
        """How many later updates' partial gradients a step hands on (0 for a flushed program)."""
        return max(offsets[-1] for _, offsets in self.reached)

    def group_of(self, path) -> str:
        """The group of a leaf of the params tree (model layout), by its top-level key."""
        return path[0].key

    def head_groups(self) -> dict:
        """The engine's head accumulator ``{'final_norm', 'w'}``: each leaf's group."""
        return {"final_norm": "final_norm", "w": "embed" if self.tied else "lm_head"}


# ---------------------------------------------------------------------------------------- unroll


def unroll(program: Program, steps: int) -> list[list[Op]]:
    """Each device's ops over ``steps`` consecutive steps of the program, in order; ops of a batch
    before the first step (the fill of a flushless program) are dropped."""
    M = program.microbatches
    lists = [[] for _ in range(program.devices)]
    for n in range(steps):
        for d, acts in enumerate(program.actions):
            for a in acts:
                g = n * M + a.microbatch
                if g >= 0:
                    lists[d].append(Op(a.kind, g, program.stage_of(d, a.chunk), g // M, n, a))
    return lists


def _fail(program: Program, device: int, action, rule: str, why: str):
    where = f"device {device}" + (f", action {action}" if action is not None else "")
    raise ProgramError(f"{program.name} (P={program.devices}, M={program.microbatches}): {where}: rule '{rule}': {why}")


# ------------------------------------------------------------------------------------- validator


def _check_shape(p: Program) -> None:
    if len(p.actions) != p.devices:
        raise ProgramError(f"{p.name}: rule 'shape': {len(p.actions)} action lists for {p.devices} devices")
    for d, acts in enumerate(p.actions):
        for a in acts:
            if a.kind not in KINDS:
                _fail(p, d, a, "shape", f"unknown kind {a.kind!r} (known: {', '.join(KINDS)})")
            if not 0 <= a.chunk < p.chunks:
                _fail(p, d, a, "shape", f"chunk {a.chunk} outside [0, {p.chunks})")


def _check_versions(p: Program) -> None:
    """The delay rule: ``version == batch`` of the microbatch, and ``-d_u <= batch <= 0`` on stage ``u``."""
    if len(p.delays) != p.stages or max(p.delays) != p.delay or min(p.delays) < 0:
        raise ProgramError(f"{p.name}: rule 'version': stage_delays {p.stage_delays} must give each of the "
                           f"{p.stages} stages a delay in [0, delay={p.delay}], the largest equal to delay")
    for d, acts in enumerate(p.actions):
        for a in acts:
            b, du = _batch(a.microbatch, p.microbatches), p.delays[p.stage_of(d, a.chunk)]
            if not -du <= b <= 0:
                older = "only this step's batch" if du == 0 else \
                    f"batches at most {du} step(s) old ({du + 1} weight versions)"
                _fail(p, d, a, "version", f"microbatch {a.microbatch} is of batch t{b:+d}, but the schedule keeps {older}")
            if a.version != b:
                _fail(p, d, a, "version", f"microbatch {a.microbatch} is of batch t{b:+d}, so every action of it reads "
                      f"w[t{b:+d}] (one version for its F and its backward); this one reads w[t{a.version:+d}]")


def _check_once(p: Program) -> None:
    """One F and either one B or one I and one W per (virtual stage, microbatch) per step; one F and
    nothing else in a forward-only program."""
    M, seen = p.microbatches, collections.Counter()
    for d, acts in enumerate(p.actions):
        for a in acts:
            key = (a.kind, p.stage_of(d, a.chunk), a.microbatch % M)
            seen[key] += 1
            if seen[key] > 1:
                _fail(p, d, a, "once", f"stage {key[1]} runs {a.kind} of microbatch {key[2]} twice in a step")
    for d in range(p.devices):
        for c in range(p.chunks):
            u = p.stage_of(d, c)
            for m in range(M):
                n = {k: seen[(k, u, m)] for k in KINDS}
                if not p.training:
                    if n != {"F": 1, "B": 0, "I": 0, "W": 0}:
                        _fail(p, d, None, "once", f"stage {u} (chunk {c}), microbatch {m}: {n}; a forward-only "
                              "program runs one F and nothing else")
                    continue
                if n["F"] != 1 or not (n["B"] == 1 and n["I"] + n["W"] == 0 or n["B"] == 0 and n["I"] == n["W"] == 1):
                    _fail(p, d, None, "once", f"stage {u} (chunk {c}), microbatch {m}: {n}; needs one F and one B, "
                          "or one F, one I and one W")


def _check_order(p: Program, lists: list[list[Op]]) -> None:
    """On each device: F before B/I, I before W, for every microbatch and stage."""
    need = {"B": "F", "I": "F", "W": "I"}
    for d, ops in enumerate(lists):
        done = set()
        for op in ops:
            if op.kind in need and (need[op.kind], op.stage, op.g) not in done:
                _fail(p, d, op.action, "order", f"{op.kind} of microbatch {op.g} on stage {op.stage} (step {op.step}) "
                      f"runs before its {need[op.kind]}")
            done.add(op.key)


def deps(op: Op, n_stages: int) -> list[tuple]:
    """The ops ``op`` waits for, as ``(kind, stage, g)``: the previous stage's F (for an F); the
    same stage's F and the next stage's backward, ``B/I`` (either, for a B or I); the same stage's I
    (for a W)."""
    if op.kind == "F":
        return [("F", op.stage - 1, op.g)] if op.stage > 0 else []
    if op.kind == "W":
        return [("I", op.stage, op.g)]
    return [("F", op.stage, op.g)] + ([("B/I", op.stage + 1, op.g)] if op.stage + 1 < n_stages else [])


def ended(done: dict, kind: str, stage: int, g: int):
    """When op ``(kind, stage, g)`` ended (``B/I``: whichever of the two ran), or None."""
    for k in (BACKWARDS if kind == "B/I" else (kind,)):
        if (k, stage, g) in done:
            return done[(k, stage, g)]
    return None


def _check_channels(p: Program, lists: list[list[Op]], complete: bool) -> None:
    """Lowered to sends and receives, every channel ``(kind, src, dst)`` receives in send order."""
    sent, recv = collections.defaultdict(list), collections.defaultdict(list)
    for d, ops in enumerate(lists):
        for op in ops:
            if op.kind == "F" and op.stage + 1 < p.stages:
                sent["activation", d, p.device_of(op.stage + 1)].append((op.stage, op.g))
            if op.kind == "F" and op.stage > 0:
                recv["activation", p.device_of(op.stage - 1), d].append((op.stage - 1, op.g, op))
            if op.kind in BACKWARDS and op.stage > 0:
                sent["gradient", d, p.device_of(op.stage - 1)].append((op.stage, op.g))
            if op.kind in BACKWARDS and op.stage + 1 < p.stages:
                recv["gradient", p.device_of(op.stage + 1), d].append((op.stage + 1, op.g, op))
    for ch in sorted(set(sent) | set(recv)):
        s, r = sent[ch], recv[ch]
        for i, (src_stage, g, op) in enumerate(r):
            if i >= len(s) or s[i] != (src_stage, g):
                got = f"stage {s[i][0]}'s microbatch {s[i][1]}" if i < len(s) else "nothing"
                _fail(p, ch[2], op.action, "channels", f"the {ch[0]} channel {ch[1]}->{ch[2]}: message {i} is {got}, "
                      f"but {op.kind} of microbatch {g} receives stage {src_stage}'s microbatch {g}")
        if complete and len(s) > len(r):
            _fail(p, ch[1], s[len(r)], "channels", f"the {ch[0]} channel {ch[1]}->{ch[2]}: stage {s[len(r)][0]}'s "
                  f"microbatch {s[len(r)][1]} is sent and never received")


def validate(program: Program) -> Program:
    """Check every rule of the module docstring; return the program, or raise :class:`ProgramError`."""
    _check_shape(program)
    _check_versions(program)
    _check_once(program)
    steps = 1 if program.delay == 0 else program.delay + 3
    lists = unroll(program, steps)
    _check_order(program, lists)
    simulate(program, steps=steps)  # raises on a deadlock (rule 'dataflow')
    _check_channels(program, lists, complete=program.delay == 0)
    return program


def is_valid(program: Program) -> bool:
    try:
        validate(program)
        return True
    except ProgramError:
        return False


# ------------------------------------------------------------------------------------ simulation


@dataclasses.dataclass
class Run:
    """A simulated run: each op's (start, end), each device's step-end update time, the ops in order."""

    lists: list
    start: dict
    end: dict
    update_end: dict  # (device, step) -> time the update at the end of that step's window finished


def _cost(op: Op, costs: dict, chunks: int) -> float:
    """An op's time: its kind's cost, split over the ``chunks`` of an interleaved device."""
    return costs[op.kind] / chunks


def _ready(op: Op, done: dict, p: Program, p2p: float):
    """The earliest start allowed by ``op``'s dependencies, or None if one has not run yet."""
    t = 0.0
    for kind, stage, g in deps(op, p.stages):
        end = ended(done, kind, stage, g)
        if end is None:
            return None
        t = max(t, end + (p2p if p.device_of(stage) != p.device_of(op.stage) else 0.0))
    return t


def _update_ready(p: Program, n: int, last_of_batch: dict, pos) -> float | None:
    """The update closing step ``n``'s window applies batch ``n - delay`` and reduces over every
    device (global norm, replicated leaves): it waits for that batch's last op on every device."""
    applied, t = n - p.delay, 0.0
    if applied < 0:
        return 0.0
    for e in range(p.devices):
        last = last_of_batch.get((e, applied))
        if last is not None and last not in pos[e]:
            return None
        if last is not None:
            t = max(t, pos[e][last])
    return t


def simulate(p: Program, costs: dict | None = None, steps: int = 1, p2p: float = 0.0, update: float = 0.0) -> Run:
    """Run the per-device lists of ``steps`` steps as a list schedule: an op starts when its device is
    free and its dependencies have ended (``p2p`` later across devices); each window ends with the
    update (cost ``update``), a collective over the devices.  Raises rule 'dataflow' on a deadlock."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    lists = unroll(p, steps)
    last_of_batch = {}
    for d, ops in enumerate(lists):
        for i, op in enumerate(ops):
            last_of_batch[(d, op.batch)] = i
    start, end, done, upd = {}, {}, {}, {}
    pos = [dict() for _ in range(p.devices)]  # index in the list -> end time
    nxt, free, window = [0] * p.devices, [0.0] * p.devices, [0] * p.devices
    while True:
        progressed = False
        for d in range(p.devices):
            progressed |= _advance(p, d, lists, nxt, free, window, steps, done, start, end, pos, upd,
                                   last_of_batch, costs, p2p, update)
        if all(nxt[d] == len(lists[d]) and window[d] == steps for d in range(p.devices)):
            return Run(lists, start, end, upd)
        if not progressed:
            _deadlock(p, lists, nxt, done)


def _advance(p, d, lists, nxt, free, window, steps, done, start, end, pos, upd, last_of_batch, costs, p2p, update):
    """Run device ``d``'s next op (or its window's closing update) if it can start; True if it did."""
    ops = lists[d]
    if window[d] < steps and (nxt[d] == len(ops) or ops[nxt[d]].step > window[d]):
        t = _update_ready(p, window[d], last_of_batch, pos)
        if t is None:
            return False
        free[d] = max(free[d], t) + update
        upd[(d, window[d])] = free[d]
        window[d] += 1
        return True
    if nxt[d] == len(ops):
        return False
    op = ops[nxt[d]]
    t = _ready(op, done, p, p2p)
    if t is None:
        return False
    start[(d, nxt[d])] = max(free[d], t)
    free[d] = end[(d, nxt[d])] = start[(d, nxt[d])] + _cost(op, costs, p.chunks)
    done[op.key] = pos[d][nxt[d]] = free[d]
    nxt[d] += 1
    return True


def _deadlock(p: Program, lists, nxt, done):
    stuck = [(d, lists[d][nxt[d]]) for d in range(p.devices) if nxt[d] < len(lists[d])]

    def waits(o):
        missing = [f"{k} of {g} on stage {u}" for k, u, g in deps(o, p.stages) if ended(done, k, u, g) is None]
        return ", ".join(missing) or "the step's update"

    text = "; ".join(f"device {e} at {o.kind} of microbatch {o.g} on stage {o.stage} (step {o.step}) waits for "
                     f"{waits(o)}" for e, o in stuck)
    _fail(p, stuck[0][0], stuck[0][1].action, "dataflow", f"deadlock: {text}")


def lockstep(p: Program, costs: dict | None = None, steps: int = 1, update: float = 0.0) -> list[float]:
    """Each window's duration when an SPMD executor runs the program in lock-step slots: in each slot
    every device runs its next action if each of its dependencies ended in an earlier slot (a message
    sent in a slot lands for the next: one exchange per slot), or idles; a slot lasts as long as its
    costliest action, since the devices meet at its exchange.  A window ends with the update (cost
    ``update``), a barrier: no device starts the next window's actions before it.  Raises rule
    'dataflow' on a deadlock.

    Unlike :func:`simulate`, a fast action waits for the slowest one beside it: with ``B = 2F``, a
    slot where one device runs a ``B`` and another an ``F`` costs ``2F`` on both."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    lists = unroll(p, steps)
    nxt, slot_of, durations = [0] * p.devices, {}, []
    for n in range(steps):
        elapsed = 0.0
        while True:
            k = len(slot_of) and max(slot_of.values()) + 1
            ran = []
            for d, ops in enumerate(lists):
                op = ops[nxt[d]] if nxt[d] < len(ops) and ops[nxt[d]].step == n else None
                if op is not None and all((e := ended(slot_of, *dep)) is not None and e < k
                                          for dep in deps(op, p.stages)):
                    ran.append(op)
                    nxt[d] += 1
            if not ran:
                break
            for op in ran:
                slot_of[op.key] = k
            elapsed += max(_cost(op, costs, p.chunks) for op in ran)
        if any(nxt[d] < len(ops) and ops[nxt[d]].step == n for d, ops in enumerate(lists)):
            _deadlock(p, lists, nxt, slot_of)
        durations.append(elapsed + update)
    return durations


def lockstep_time(p: Program, costs: dict | None = None, update: float = 0.0) -> float:
    """:func:`step_time` for the lock-step executor (:func:`lockstep`): a flushed program's one
    window, or a flushless one's steady-state window (the last of ``delay + 5``)."""
    return lockstep(p, costs, 1 if p.delay == 0 else p.delay + 5, update)[-1]


# ------------------------------------------------------------------------------------ derived


def stash_depth(p: Program, steps: int | None = None) -> list[float]:
    """Peak microbatches whose activations each device holds (from its F to its last backward, ``B``
    or ``W``), read off the list order; an interleaved device's chunks count ``1/v`` each."""
    steps = steps or (1 if p.delay == 0 else p.delay + 3)
    peaks = []
    for ops in unroll(p, steps):
        held, peak = set(), 0
        for op in ops:
            if op.kind == "F":
                held.add((op.stage, op.g))
            peak = max(peak, len(held))
            if op.kind in ("B", "W"):
                held.discard((op.stage, op.g))
        peaks.append(peak / p.chunks)
    return peaks


def _window_end(run: Run, n: int) -> float:
    return max(t for (d, k), t in run.update_end.items() if k == n)


def step_time(p: Program, costs: dict | None = None, p2p: float = 0.0, update: float = 0.0) -> float:
    """The critical path of a step: a flushed program's makespan, or a flushless one's steady-state
    period (the time between the last two of ``delay + 5`` simulated windows' ends)."""
    if p.delay == 0:
        return _window_end(simulate(p, costs, 1, p2p, update), 0)
    steps = p.delay + 5
    run = simulate(p, costs, steps, p2p, update)
    return _window_end(run, steps - 1) - _window_end(run, steps - 2)


def work(p: Program, costs: dict | None = None) -> float:
    """The busy time of one step summed over devices."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    return sum(costs[a.kind] / p.chunks for acts in p.actions for a in acts)


def bubble_fraction(p: Program, costs: dict | None = None, p2p: float = 0.0) -> float:
    """Idle share of the devices' time in a step: ``1 - work / (P * step_time)``."""
    return 1.0 - work(p, costs) / (p.devices * step_time(p, costs, p2p))


def buffers(p: Program, costs: dict | None = None, p2p: float = 0.0) -> dict:
    """Peak messages in transit per channel ``(kind, src, dst)`` in a simulated run: sent when the
    producing op ends, held until the consuming op starts."""
    steps = 1 if p.delay == 0 else p.delay + 3
    run = simulate(p, costs, steps, p2p)
    events = collections.defaultdict(list)
    ends = {ops[i].key: run.end[(d, i)] for d, ops in enumerate(run.lists) for i in range(len(ops))}
    for d, ops in enumerate(run.lists):
        for i, op in enumerate(ops):
            for kind, u, g in deps(op, p.stages):
                src = p.device_of(u)
                sent = ended(ends, kind, u, g)
                if u != op.stage and src != d and sent is not None:
                    ch = ("activation" if op.kind == "F" else "gradient", src, d)
                    events[ch] += [(sent, 1), (run.start[(d, i)], -1)]
    return {ch: _peak(ev) for ch, ev in sorted(events.items())}


def _peak(events: list) -> int:
    level = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], -e[1])):  # a message lands, then is consumed
        level += delta
        peak = max(peak, level)
    return peak


def min_microbatches(name: str, P: int, v: int | None = None, limit: int | None = None) -> int | None:
    """The smallest ``M`` for which schedule ``name``'s generator yields a valid program (None up to
    ``limit``, default ``4 P``)."""
    for M in range(1, (limit or 4 * P) + 1):
        try:
            validate(generate(name, P, M, v))
            return M
        except ProgramError:
            continue
    return None


def table_row(name: str, P: int, M: int, v: int | None = None, costs: dict | None = None, p2p: float = 0.0) -> dict:
    """One schedule's figures at ``(P, M)``: critical path, ideal (work / P), bubble fraction, peak
    stash per device (experiments/bench_pipeline.py's ``schedules`` table)."""
    p = validate(generate(name, P, M, v))
    return {"P": P, "M": M, "schedule": p.name, "critical_path": step_time(p, costs, p2p),
            "lockstep": lockstep_time(p, costs), "ideal": work(p, costs) / P,
            "bubble_fraction": bubble_fraction(p, costs, p2p), "stash": stash_depth(p)}
