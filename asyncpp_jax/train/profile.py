"""Where a training step's device time goes: trace a window of updates and attribute it.

``config.train.profile_steps = N`` (with ``profile_start = S``) traces updates ``S+1 .. S+N`` with
``jax.profiler`` (a Perfetto trace under ``WORKDIR/profile``) and saves the compiled step's HLO beside
it.  ``python -m asyncpp_jax.train.profile WORKDIR`` then reads the trace's XLA thunk events (each
names its HLO instruction), takes each one's *self* time (its duration minus the thunks nested in it:
a ``while`` or ``conditional`` thunk contains its body's), maps the instruction to the source
``op_name`` the compiler recorded (where it recorded none, the scope its operands share), and
sums the time by the named scope it ran under (the pipeline engine's slots, transfers and
reduction; the optimizer update; see :data:`PARTS`).  It lists the compiled step's matmuls that
run under no named part, and splits each traced update's wall clock into three phases
(:func:`phases`): before the first slot (weight versions, zeroed accumulators), the slots (the
ticks, waiting included), and after the last slot (reductions, the optimizer): a schedule's fixed
per-update work, beside its bubble.

Why our own reader: TensorBoard's profile plugin shows the trace but does not group XLA:CPU thunks
by ``jax.named_scope``, and that grouping is the question (which part of the step costs what).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import logging
import os
import pathlib
import re
import sys

import jax

log = logging.getLogger(__name__)

# (named scope in the op_name, what it is), first match wins; set by `jax.named_scope` in
# pipeline/spmd/executor.py (pp_*) and the runners (optimizer_update, sim_grad).  Anything else is "other".
PARTS = (
    ("pp_fwd", "engine: forward slots (stages 0..P-2)"),
    ("pp_bwd", "engine: backward slots (stages 0..P-2)"),
    ("pp_last", "engine: last stage's fused forward + backward"),
    ("pp_embed_grad", "engine: embedding lookup's transpose (stage 0)"),
    ("pp_send", "engine: ppermute of activations / cotangents, waiting for the peer stage included"),
    ("pp_versions", "engine: weight versions (casts, tied head transpose)"),
    ("pp_reduce", "engine: accumulators reduced over stage and data"),
    ("pp_tick", "engine: slot bookkeeping (conds, stash ring, accumulator adds)"),
    ("sim_grad", "simulate runner: forward + backward"),
    ("optimizer_update", "optimizer update (and staleness transforms)"),
)
SUBDIR = "profile"
_HLO_DIR = "hlo"
_META = "window.json"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
_MATMUL = re.compile(r"\S+\s+(?:dot|convolution)\(")  # a matmul's shape (one array, no spaces), its opcode
_OP_NAME = re.compile(r"op_name=\"([^\"]*)\"")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")


class StepProfiler:
    """Starts a ``jax.profiler`` trace before update ``start + 1`` and stops it after ``start + steps``."""

    def __init__(self, workdir: pathlib.Path, start: int, steps: int):
        self.dir = pathlib.Path(workdir) / SUBDIR / f"process_{jax.process_index()}"
        self.start, self.steps, self.active = start, steps, False

    def before_step(self, done: int, step_fn, *args) -> bool:
        """Called with ``done`` updates finished, before the next one runs ``step_fn(*args)``;
        whether the trace started here."""
        if self.steps <= 0 or self.active or done != self.start:
            return False
        hlo = self.dir / _HLO_DIR
        hlo.mkdir(parents=True, exist_ok=True)
        # The jitted step is already compiled for these arguments: lower().compile() is a cache hit.
        # (The mpmd placement's step is many programs, dispatched by the host: its time is read by
        # the trace's program names alone.)
        if hasattr(step_fn, "lower"):
            (hlo / "train_step.txt").write_text(step_fn.lower(*args).compile().as_text())
        (self.dir / _META).write_text(json.dumps({"first_update": done + 1, "updates": self.steps}))
        jax.block_until_ready(args)  # the updates before the window have finished (metrics come one update late)
        jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
        self.active = True
        log.info("profile: tracing updates %d-%d into %s", done + 1, done + self.steps, self.dir)
        return True

    def after_step(self, done: int, *outputs) -> bool:
        """Called with ``done`` updates dispatched (``outputs``: the last one's results); whether the
        trace stopped (and was written) here, once the window's last update has finished."""
        if self.active and done >= self.start + self.steps:
            jax.block_until_ready(outputs)
            self.close()
            return True
        return False

    def close(self) -> None:
        """Stop and write the trace if one is running (also on an error or a preemption)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            log.info("profile: trace written; summary: python -m asyncpp_jax.train.profile %s", self.dir)


# The parts that are a microbatch's forward/backward work: where an update's slot phase begins and ends.
SLOT_PARTS = ("pp_fwd", "pp_bwd", "pp_last", "sim_grad")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One traced update's wall clock (ms): ``before`` its first slot, the ``slots`` (first slot's
    start to last slot's end), ``after`` its last slot; ``wall`` their sum."""

    wall: float
    before: float
    slots: float
    after: float


@dataclasses.dataclass
class Summary:
    updates: int
    devices: int
    ms: dict  # part -> milliseconds per update, summed over devices
    top_other: list  # [(op_name, ms per update)] of the largest unattributed instructions
    phases: list = dataclasses.field(default_factory=list)  # [Phase], one per traced update
    unscoped_matmuls: list = dataclasses.field(default_factory=list)  # op_names, see :meth:`_Hlo.unscoped_matmuls`


@dataclasses.dataclass
class _Hlo:
    names: dict  # (module, instruction) -> op_name
    matmuls: list  # the op_name each matmul runs under ("" where none is known)

    def unscoped_matmuls(self) -> list[str]:
        """The matmuls (``dot``, ``convolution``) that run under none of :data:`PARTS` (``""``: under
        no known scope): the step's FLOPs that the table files under "other".  Read from the
        program, not the trace, so it does not depend on how busy the host was."""
        return sorted({op for op in self.matmuls if part_of(op) == "other"})


def _operands(rest: str) -> list[str]:
    """The instructions named between the opcode's parentheses of ``rest`` (``shape opcode(...)...``)."""
    i = rest.find("(", rest.find(" "))
    if i < 0:
        return []
    depth, j = 0, i
    for j in range(i, len(rest)):
        depth += {"(": 1, ")": -1}.get(rest[j], 0)
        if depth == 0:
            break
    return _OPERAND.findall(rest[i:j])


def _common_scope(op_names: list[str]) -> str:
    """The scope the named instructions share, cut at a whole ``/`` component."""
    prefix = os.path.commonprefix(op_names)
    return prefix if prefix in op_names else prefix.rpartition("/")[0]


def _parse_hlo(hlo_dir: pathlib.Path) -> _Hlo:
    """The saved compiled HLO: each instruction's ``op_name``, and those of its matmuls.

    Some instructions carry no ``op_name``: XLA:CPU's YNNPACK fusions (the attention's batched
    matmuls among them) drop it.  Such an instruction takes the scope its operands share, since it
    computes from them where they were computed; a matmul fused into another instruction runs as the
    fusion that calls its computation, and takes that one's."""
    names: dict[tuple[str, str], str] = {}
    fused = set()  # the (module, computation)s holding a matmul without an op_name
    callers = collections.defaultdict(list)  # (module, computation) -> the (module, instruction)s calling it
    matmuls: list = []  # the op_name of each matmul that has one
    for path in sorted(hlo_dir.glob("*.txt")):
        module = computation = None
        for line in path.read_text().splitlines():
            if line.startswith("HloModule "):
                module = line.split()[1].rstrip(",")
                continue
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                computation = line.removeprefix("ENTRY ").split()[0].lstrip("%")
                continue
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            key, rest = (module, m.group(1)), line[m.end():]
            op = _OP_NAME.search(line)
            if op:
                names[key] = op.group(1)
            else:
                scopes = [names[(module, o)] for o in _operands(rest) if (module, o) in names]
                if scopes:
                    names[key] = _common_scope(scopes)
            for called in _CALLS.findall(line):
                callers[(module, called)].append(key)
            if _MATMUL.match(rest):
                if op:
                    matmuls.append(op.group(1))
                else:
                    fused.add((module, computation))
    for comp in fused:
        matmuls += [names.get(c, "") for c in callers[comp]] or [""]
    return _Hlo(names, matmuls)


def part_of(op_name: str) -> str:
    """The first of :data:`PARTS` whose scope ``op_name`` ran under (a scope may be wrapped by
    autodiff, e.g. ``transpose(jvp(pp_last))``), else ``"other"``."""
    scopes = set(re.findall(r"[A-Za-z_]\w*", op_name))
    for part, _ in PARTS:
        if part in scopes:
            return part
    return "other"


def _complete_events(trace_file: pathlib.Path) -> list[dict]:
    with gzip.open(trace_file, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def _is_thunk(e: dict) -> bool:
    return "hlo_op" in (e.get("args") or {})


def _runs(thunks: list[dict]) -> list[list[dict]]:
    """The thunks grouped into runs of a program (one run spans every device of the process): by
    the ``run_id`` the runtime records on each thunk, else (a trace without it) those whose spans
    overlap in time.  Time alone is not enough where the id is recorded: with asynchronous dispatch
    one device may start the next update before another has finished this one."""
    by_id, loose = collections.defaultdict(list), []
    for e in thunks:
        run_id = (e.get("args") or {}).get("run_id")
        (by_id[run_id] if run_id is not None else loose).append(e)
    runs = list(by_id.values())
    end = None
    for e in sorted(loose, key=lambda e: e["ts"]):
        if end is not None and e["ts"] <= end:
            runs[-1].append(e)
            end = max(end, e["ts"] + e["dur"])
        else:
            runs.append([e])
            end = e["ts"] + e["dur"]
    return sorted(runs, key=lambda r: min(e["ts"] for e in r))


def phases(thunks: list[dict], is_slot) -> list[Phase]:
    """Per update: its run's thunks (:func:`_runs`) span its wall clock, from the first one's start to
    the last one's end; those for which ``is_slot`` holds (the work of :data:`SLOT_PARTS`) mark where
    its ticks begin and end.  A run with no slot (another program, e.g. an eval step) is not an
    update.  Why not the runtime's per-execution event: XLA:CPU records it only when the caller had
    to wait for the execution, so a short update, or one on a busy host, may have none."""
    out = []
    ms = lambda us: us / 1e3  # noqa: E731
    for run in _runs(thunks):
        inside = [e for e in run if is_slot(e)]
        if not inside:
            continue
        start, end = min(e["ts"] for e in run), max(e["ts"] + e["dur"] for e in run)
        first, last = min(e["ts"] for e in inside), max(e["ts"] + e["dur"] for e in inside)
        out.append(Phase(ms(end - start), ms(first - start), ms(last - first), ms(end - last)))
    return out


def self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """Each thunk event with its duration minus its direct children's (nesting per thread by time)."""
    out = []
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, child time]
        for e in evs:
            while stack and e["ts"] >= stack[-1][1]:
                done = stack.pop()
                out.append((done[0], done[0]["dur"] - done[2]))
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e, e["ts"] + e["dur"], 0.0])
        out.extend((s[0], s[0]["dur"] - s[2]) for s in stack)
    return out


def summarize(profile_dir: str | pathlib.Path) -> Summary:
    """Device time per update by part, from one process's ``profile`` directory."""
    d = pathlib.Path(profile_dir)
    if (d / SUBDIR).is_dir():  # a run's workdir: its first process
        d = d / SUBDIR / "process_0"
    traces = sorted(d.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces or not (d / _META).exists():
        raise FileNotFoundError(f"no profile in {d}: run with --config.train.profile_steps=N (and "
                                "--config.train.profile_start=S to skip the first S updates)")
    updates = json.loads((d / _META).read_text())["updates"]
    hlo = _parse_hlo(d / _HLO_DIR)
    names = hlo.names
    total = collections.defaultdict(lambda: collections.defaultdict(float))
    other = collections.defaultdict(float)
    thunks = [e for e in _complete_events(traces[-1]) if _is_thunk(e)]
    slots = set()  # id() of the slot thunks
    for e, self_us in self_times(thunks):
        a = e["args"]
        op = names.get((a.get("hlo_module"), a["hlo_op"]), "")
        part = part_of(op)
        total[part][a.get("device_ordinal", "0")] += self_us / 1e3 / updates
        if part == "other":
            other[op or a["hlo_op"]] += self_us / 1e3 / updates
        if part in SLOT_PARTS:
            slots.add(id(e))
    devices = {dev for per in total.values() for dev in per}
    return Summary(updates, len(devices), {p: sum(v.values()) for p, v in total.items()},
                   sorted(other.items(), key=lambda kv: -kv[1])[:8],
                   phases(thunks, lambda e: id(e) in slots),
                   hlo.unscoped_matmuls())


def render(s: Summary) -> str:
    whole = sum(s.ms.values()) or 1.0
    described = dict(PARTS) | {"other": "everything else (see below)"}
    lines = [f"device time per update, {s.updates} update(s) traced, summed over {s.devices} device(s):", "",
             "| part | ms / update | share | what |", "|---|---|---|---|"]
    for part, ms in sorted(s.ms.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {part} | {ms:.1f} | {ms / whole:.1%} | {described[part]} |")
    lines.append(f"| total | {whole:.1f} | 100% | |")
    if s.top_other:
        lines += ["", "largest unattributed instructions (op_name: ms / update):"]
        lines += [f"  {ms:8.2f}  {op[-110:]}" for op, ms in s.top_other]
    if s.unscoped_matmuls:
        lines += ["", f"matmuls under no named part ({len(s.unscoped_matmuls)}; their time is in \"other\"):"]
        lines += [f"  {op[-110:]}" for op in s.unscoped_matmuls]
    if s.phases:
        lines += ["", "wall clock of each traced update (ms; the slots include waiting between them):", "",
                  "| update | wall | before the first slot | slots | after the last slot |", "|---|---|---|---|---|"]
        lines += [f"| {i + 1} | {p.wall:.1f} | {p.before:.1f} | {p.slots:.1f} | {p.after:.1f} |"
                  for i, p in enumerate(s.phases)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a run's workdir (its first process) or one process's profile directory")
    args = p.parse_args(argv)
    try:
        print(render(summarize(args.path)))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
