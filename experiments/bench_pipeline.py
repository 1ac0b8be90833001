"""Pipeline engine benchmark: wasted work, sync vs 2bw step time, the tick table's prediction, compile time.

    python experiments/bench_pipeline.py work      # all fake devices on ONE core: work ratio
    python experiments/bench_pipeline.py overlap   # one core per fake device: sync / 2bw step time
    python experiments/bench_pipeline.py compile   # compile time at 2x depth and 2x microbatches
    python -m experiments.bench_pipeline processes # sync / 2bw with each stage a process on its own core
    python experiments/bench_pipeline.py schedules # when does 2bw pay? every schedule's program, simulated
    python experiments/bench_pipeline.py conditionals # conditionals each update executes (a GPU's host syncs)

Absolute times on a shared machine are noise, so every figure is a ratio of two programs timed
side by side in alternating rounds (median of rounds); ``work`` times each program back to back
with the ``simulate`` step it is divided by, so each round's ratio sees one machine state.  Every
mode keeps freed memory for reuse (``host_setup.reuse_freed_memory``, as the tests and ``main`` on
several fake CPU devices do); ``--glibc_default`` leaves glibc's allocator as it starts, where each
compiled call faults its buffers' pages in afresh, a cost a step pays per device.

* ``work``: with every fake device pinned to the same core, a pipeline step takes the total work
  of all stages (``sync``, ``2bw`` and the ``1f1b``, ``interleaved`` and ``zb-h1`` programs, each
  also with the tables split over ``stage``, ``vocab_parallel``; ``1f1b`` and ``2bw`` also under
  the ``mpmd`` placement, with recompute; on an uneven split, whole tables of the first three only).  Divided by the single-device ``simulate`` step on the same batch it
  measures waste: 1.0 is ideal; recomputing each stage's forward costs at most ``1 + F/(F+B)``.
* ``overlap``: with one core per stage the stages really run at the same time; ``sync / 2bw``
  is compared with a textbook 1F1B's ceiling ``(M + P - 1)/M`` and with the critical path the
  tick table predicts from the measured per-slot costs (``Σ_ticks max_stages cost``).
* ``compile``: the scans over layers and slots keep the program size flat (``2bw`` at twice the
  depth and twice the microbatches); each schedule's compile time at P = 4, M = 8 without
  recompute; with ``--against CHECKOUT``, each schedule's compile time in this tree over the
  same in another checkout (an earlier commit), both in fresh processes, alternating rounds.
  ``work --against CHECKOUT`` likewise times each schedule's step (no recompute) in both trees,
  each beside its own tree's simulate step, two fresh processes per tree: the engine's own change
  between two commits, apart from a change of the model that moves the simulate step as well.
* ``schedules``: for ``P`` in {4, 8} and ``M`` in {P, 2P, 4P}, each schedule's program
  (asyncpp_jax.pipeline.schedules.programs: ``1f1b``, ``interleaved`` with v = 2, ``zb-h1``, ``2bw``) is
  validated and simulated from per-action costs (``--costs``, default F=1, B=2, I=W=1): its critical
  path per step, its bubble fraction, its peak stash per device and its lock-step path (the same
  program run by an SPMD executor: one action per device per slot, each slot as long as its
  costliest action, ``programs.lockstep``) and, for a flushed program, its path in the engine's
  slots (``slot_plan.path``: paired and unpaired, the last stage's ``F`` fused into its ``B``); then each schedule's smallest
  ``M`` and the tick tables' formulas beside what their programs give.  Pure Python, no JAX program.
* ``conditionals``: the ``lax.cond`` / ``lax.switch`` each update executes, counted in the traced
  train step (:mod:`experiments.census`; an upper bound: each conditional's costliest
  branch), for ``sync``, ``2bw``, ``1f1b``, ``interleaved`` and ``zb-h1`` (their slots) at P in {4, 8} and their smallest M,
  each with whole tables and with ``vocab_parallel``, beside the single-device
  ``simulate`` step.  XLA:GPU reads each conditional's predicate on the host, a cost this CPU does
  not show.  Traced only, nothing compiled or run.
* ``processes``: ``overlap`` where the stages surely run at the same time, with the ``1f1b``,
  ``interleaved`` and ``zb-h1`` programs (lock-step slots, :mod:`asyncpp_jax.pipeline.schedules.slot_plan`) timed beside ``sync`` and ``2bw``.  On XLA:CPU the fake
  devices of one process do not (one device's program already uses every core the process may
  use), so this mode starts one process per stage, each pinned to its own core, forming one JAX job
  over gloo (``asyncpp_jax.launch --pin_cpus``), and times ``sync`` and ``2bw`` in alternating
  rounds inside that one job: the two programs see the same machine, round by round.

``--stage_layers 26,6`` (``work`` at P = 4, ``overlap`` at P = 2) runs the engine with that uneven
split (``config.pipeline.stage_layers``) and predicts from each stage's own slot costs; ``work`` and
``overlap`` also print a balanced split computed from the measured per-layer and head+loss costs.

The model is a real-vocabulary decoder (vocab 49152, d_model 256, 8 layers; ``--vocab`` and
``--layers`` change it), the batch ``M`` microbatches of 2 x 128 tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("work", "overlap", "compile", "processes", "schedules", "conditionals")
VP = "vocab_parallel"  # a run with the vocabulary-sized tables split over stage
MPMD = "mpmd"  # a run under config.pipeline.placement='mpmd': one program per stage, dispatched by the host


def _setup_host(mode: str, devices: int, glibc_default: bool = False) -> None:
    """Before JAX starts: the fake devices, and for ``work`` one core for all of them; a
    ``processes`` worker keeps to the core the launcher gave it (``ASYNCPP_CPUS``); freed memory
    kept for reuse unless ``glibc_default`` (every program timed alike, the simulate step too)."""
    from asyncpp_jax import host_setup  # no JAX import

    if not glibc_default:
        host_setup.reuse_freed_memory()

    if mode == "processes":
        # The launcher set this process's one device and the job, and named its core; unpinned,
        # a stage waiting in its bubble would lend its core to the other stage's thread pool.
        if host_setup.pin_cpus() is None:
            raise SystemExit(f"bench_pipeline processes: a worker needs {host_setup.CPUS_ENV} (one core of its "
                             "own); start it as python -m experiments.bench_pipeline processes, not --worker")
        return
    if mode == "work":
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    host_setup.add_host_devices(devices)


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows", type=int, default=2, help="sequences per microbatch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="updates timed per round")
    ap.add_argument("--microbatches", default="2,4,8", help="overlap: the values of M to time")
    ap.add_argument("--recompute", default="True,False", help="work, overlap, processes: the recompute settings to time")
    ap.add_argument("--schedules", default="", help="work: the runs to time, comma-separated (e.g. 'zb-h1,zb-h1 "
                    f"{VP}'); default all")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # processes: one stage's process
    ap.add_argument("--profile", default="", help="processes: after the timing, trace 2 updates of each program "
                    "into this directory and print each process's device time by part (asyncpp_jax.train.profile)")
    ap.add_argument("--stage_layers", default="",
                    help="layers per stage, e.g. 26,6 (config.pipeline.stage_layers; work: 4 stages, overlap: 2); "
                         "default an even split")
    ap.add_argument("--costs", default="F=1,B=2,I=1,W=1",
                    help="schedules: per-action costs (I + W = B: the backward's two halves)")
    ap.add_argument("--p2p", type=float, default=0.0, help="schedules: point-to-point latency, in the costs' unit")
    ap.add_argument("--measure", action="store_true",
                    help="schedules: measure F, B, I (W = B - I) of a stage of --layers/P layers on this CPU instead of --costs")
    ap.add_argument("--glibc_default", action="store_true",
                    help="leave glibc's allocator as it starts (freed memory handed back to the kernel, so every "
                         "compiled call faults its buffers' pages in afresh) instead of keeping freed memory for "
                         "reuse, as the tests and main on several fake CPU devices do (host_setup.reuse_freed_memory)")
    ap.add_argument("--against", default="", metavar="CHECKOUT",
                    help="compile, work: also time each schedule's compile (compile) or step (work, without recompute) in this other checkout of the project (e.g. a "
                         "git worktree of an earlier commit), both in fresh processes in alternating rounds, and "
                         "print this tree's time over that one's")
    ap.add_argument("--record", default="", metavar="FILE.jsonl",
                    help="work, overlap, processes, compile, schedules: append the table's figures with the command, commit, date and "
                         "hardware as one JSON line to this file (experiments/results/bench/bench_pipeline.jsonl "
                         "renders docs/pipeline.md's tables)")
    ap.add_argument("--note", default="", help="with --record: what the record measures, in a sentence (rendered "
                    "beside its table, e.g. which change the --against checkout lacks)")
    args = ap.parse_args()
    try:
        args.costs = {k.strip(): float(v) for k, v in (kv.split("=") for kv in args.costs.split(","))}
        assert set(args.costs) <= {"F", "B", "I", "W"}
    except (ValueError, AssertionError):
        ap.error(f"--costs={args.costs!r} must be KIND=COST pairs of F, B, I, W, e.g. F=1,B=2,I=1,W=1")
    try:
        args.stage_layers = tuple(int(n) for n in args.stage_layers.split(",") if n.strip())
    except ValueError:
        ap.error(f"--stage_layers={args.stage_layers!r} must be comma-separated integers, e.g. 26,6")
    P = {"work": 4, "overlap": 2, "processes": 2}.get(args.mode)
    if args.stage_layers and (P is None or len(args.stage_layers) != P or sum(args.stage_layers) != args.layers
                              or min(args.stage_layers) < 0):
        ap.error(f"--stage_layers={','.join(map(str, args.stage_layers))} needs {P or 'the work or overlap mode'}"
                 f" non-negative entries summing to --layers={args.layers} (mode {args.mode!r})")
    return args


def _record(args, kind: str, figures: dict) -> None:
    """Append the figures to ``--record`` (the command without the launcher's internal ``--worker``)."""
    if args.record:
        from experiments import records

        command = records.command_line([a for a in sys.argv if a != "--worker"])
        extra = {"note": args.note} if args.note else {}
        records.append(args.record, records.make(kind, figures, command=command, **extra))


VIRTUAL_STAGES = 2  # the interleaved schedule's chunks per device, in every mode
SCHEDULES = (("sync", None), ("1f1b", None), ("interleaved", VIRTUAL_STAGES), ("zb-h1", None), ("2bw", None),
             ("pipedream", None))


def schedule_rows(costs_of, p2p: float) -> list:
    """Every schedule's program at P in {4, 8}, M in {P, 2P, 4P}: critical path, bubble, stash;
    ``costs_of(P)``: the per-action costs of a stage at that P."""
    from asyncpp_jax.pipeline.schedules import programs
    from asyncpp_jax.pipeline.schedules import slot_plan

    rows = [programs.table_row(name, P, M, v, costs_of(P), p2p)
            for P in (4, 8) for M in (P, 2 * P, 4 * P) for name, v in SCHEDULES]
    for r, (name, v) in zip(rows, SCHEDULES * 6):
        program = programs.generate(name, r["P"], r["M"], v)
        # the engine's slot placement (slot_plan; a flushless program's steady window), the last stage's F taking no slot
        r["slots_paired"], r["slots_unpaired"] = (slot_plan.path(program, x, costs_of(r["P"])) for x in (True, False))
    return rows


def formula_rows() -> list:
    """Per P: each schedule's smallest M (from its program's validity) and the stash depths of the
    eager ``sync`` order and of ``2bw`` at ``2P`` microbatches."""
    from asyncpp_jax.pipeline.schedules import programs

    out = []
    for P in (4, 8):
        out.append({"P": P, **{f"min_M {name}": programs.min_microbatches(name, P, v) for name, v in SCHEDULES},
                    "stash sync": programs.stash_depth(programs.generate("sync", P, 2 * P)),
                    "stash 2bw": programs.stash_depth(programs.generate("2bw", P, 2 * P))})
    return out


def schedules(args) -> None:
    if args.measure:
        n = max(args.layers // 4, 1)  # measured once; a stage of L/P layers costs L/(P n) of it
        c = measured_action_costs(args, n)
        per_p = {P: {k: v * args.layers / (P * n) for k, v in c.items()} for P in (4, 8)}
        unit = f"ms, measured on this CPU for a stage of {n} layers, scaled to --layers/P"
    else:
        per_p, unit = {P: args.costs for P in (4, 8)}, "given"
    rows, mins = schedule_rows(per_p.__getitem__, args.p2p), formula_rows()
    for P, c in per_p.items():
        print(f"P={P}: per-action costs ({unit}) " + ", ".join(f"{k}={v:.3g}" for k, v in c.items()))
    print(f"p2p {args.p2p:g} (interleaved: each chunk's action costs 1/v of the stage's)\n")
    print("| P | M | schedule | critical path | / ideal | bubble fraction | peak stash per device | lock-step path |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['M']} | {r['schedule']} | {r['critical_path']:.2f} | {r['critical_path'] / r['ideal']:.3f} "
              f"| {r['bubble_fraction']:.3f} | {' '.join(f'{s:g}' for s in r['stash'])} | {r['lockstep']:.2f} |")
    print()
    for m in mins:
        print(", ".join(f"{k}: {v}" for k, v in m.items()))
    figures = {"costs": args.costs, "p2p": args.p2p, "rows": rows, "formulas": mins}
    if args.measure:
        figures.update(costs={str(P): c for P, c in per_p.items()}, layers=args.layers, d_model=args.d_model,
                       rows_per_microbatch=args.rows, seq=args.seq)
    _record(args, "bench_pipeline_schedules", figures)


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.mode == "schedules" and not ARGS.measure:  # no fake devices, no JAX program
    sys.exit(schedules(ARGS))
if ARGS is not None and ARGS.mode == "processes" and not ARGS.worker:
    from asyncpp_jax import launch  # no JAX import: this parent process only starts the job

    sys.exit(launch.wait_all(launch.spawn(sys.argv[1:] + ["--worker"], processes=2, devices_per_process=1,
                                          module="experiments.bench_pipeline", pin_cpus=True,
                                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
if ARGS is not None:
    _setup_host(ARGS.mode, {"overlap": 2, "processes": 2, "conditionals": 8}.get(ARGS.mode, 4), ARGS.glibc_default)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from asyncpp_jax.configs import base_config  # noqa: E402
from asyncpp_jax.models import dense  # noqa: E402
from asyncpp_jax.pipeline import stage  # noqa: E402
from asyncpp_jax.pipeline.options import EngineOptions  # noqa: E402
from asyncpp_jax.pipeline.spmd import engine  # noqa: E402
from asyncpp_jax.pipeline.mpmd import engine as mpmd  # noqa: E402
from asyncpp_jax.pipeline.schedules import slot_plan  # noqa: E402
from asyncpp_jax.pipeline.mesh import make_mesh  # noqa: E402
from asyncpp_jax import train_state as state_lib  # noqa: E402
from asyncpp_jax.train import profile  # noqa: E402
from asyncpp_jax.train import step as step_lib  # noqa: E402

TX = optax.adamw(1e-3)
LR = optax.constant_schedule(1e-3)


def model_cfg(args, n_layers: int | None = None):
    m = base_config().model
    m.update(vocab_size=args.vocab, d_model=args.d_model, n_layers=n_layers or args.layers, n_heads=4,
             n_kv_heads=2, d_ff=int(args.d_model * 8 / 3) // 8 * 8)
    return m


def tokens(args, M: int):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.integers(0, args.vocab, (M, args.rows, args.seq + 1)), jnp.int32)


class Pipelined:
    """One compiled engine train step and its state, ready to time."""

    def __init__(self, args, P: int, M: int, schedule: str, recompute: bool = True, n_layers=None,
                 stage_layers=(), vocab_parallel: bool = False):
        cfg = model_cfg(args, n_layers)
        mesh = engine.make_pipeline_mesh(1, P)
        rows = engine.stage_split(cfg, P, stage_layers)
        v = VIRTUAL_STAGES if schedule == "interleaved" else 1
        layout = engine.engine_layout(cfg, rows, (P, v) if v > 1 else None)
        abstract = jax.eval_shape(layout, dense.abstract_params(cfg))
        options = EngineOptions(schedule=schedule, stages=P, microbatches=M, virtual_stages=v, recompute=recompute,
                                vocab_parallel=vocab_parallel, stage_rows=rows)
        self.step = engine.make_pipeline_train_step(cfg, TX, LR, mesh, abstract, options)
        state = state_lib.init_state(cfg, TX, jax.random.key(0), layout=layout)
        ps = engine.init_pipeline_state(cfg, state.params, mesh, M * args.rows, args.seq, options)
        self.state = engine.place_state(state.replace(runner_state=ps), mesh, abstract, options)
        self.batch = state_lib.from_host(engine.global_batch_sharding(mesh), np.asarray(tokens(args, M)))

    def compile_seconds(self) -> float:
        t0 = time.perf_counter()
        self.step.lower(self.state, self.batch).compile()
        return time.perf_counter() - t0

    def run(self, steps: int) -> float:
        """Seconds per update over ``steps`` updates."""
        t0 = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - t0) / steps


class Placed(Pipelined):
    """The ``mpmd`` placement's step (one program per stage and action, dispatched by the host)."""

    def __init__(self, args, P: int, M: int, schedule: str):
        cfg = model_cfg(args)
        mesh = engine.make_pipeline_mesh(1, P)
        abstract = jax.eval_shape(engine.engine_layout(cfg), dense.abstract_params(cfg))
        options = EngineOptions(schedule=schedule, stages=P, microbatches=M, placement="mpmd")
        self.step = mpmd.MpmdTrainStep(cfg, TX, LR, mesh, abstract, options, M * args.rows, args.seq)
        self.state = mpmd.init_state(cfg, self.step, jax.random.key(0))
        self.batch = state_lib.from_host(engine.global_batch_sharding(mesh), np.asarray(tokens(args, M)))


class Simulated(Pipelined):
    """The single-device ``simulate`` step on the same batch: the work a step must do."""

    def __init__(self, args, M: int):
        cfg = model_cfg(args)
        mesh = make_mesh(1, jax.devices()[:1])
        self.step = step_lib.make_train_step(cfg, TX, LR, mesh)
        self.state = jax.device_put(state_lib.init_state(cfg, TX, jax.random.key(0)), state_lib.replicated(mesh))
        self.batch = jax.device_put(tokens(args, M), NamedSharding(mesh, state_lib.BATCH_SPEC))


def time_rounds(runs: dict, rounds: int, steps: int) -> dict:
    """Seconds per update of each run in each of ``rounds`` alternating rounds, after a warm-up.
    Odd rounds run the programs in reverse order, so neither always follows the other."""
    for r in runs.values():
        r.run(1)
    times = {name: [] for name in runs}
    for k in range(rounds):
        for name in list(runs)[::-1 if k % 2 else 1]:
            times[name].append(runs[name].run(steps))
    return times


def time_paired(runs: dict, base: str, rounds: int, steps: int) -> dict:
    """Each run's time over ``base``'s, timed back to back in each of ``rounds`` rounds (odd rounds
    reverse both the programs' order and each pair's), after a warm-up: ``{name: [ratio per round]}``.

    On a shared host the machine's speed drifts over the minutes a round of many programs takes;
    a ratio of two timings seconds apart sees one machine state, so its spread is the programs'."""
    for r in runs.values():
        r.run(1)
    ratios = {name: [] for name in runs if name != base}
    for k in range(rounds):
        for name in list(ratios)[::-1 if k % 2 else 1]:
            pair = (base, name)[::-1 if k % 2 else 1]
            t = {n: runs[n].run(steps) for n in pair}
            ratios[name].append(t[name] / t[base])
    return ratios


def time_side_by_side(runs: dict, rounds: int, steps: int) -> dict:
    """Median seconds per update of each run, timed in alternating rounds after a warm-up."""
    return {name: float(np.median(t)) for name, t in time_rounds(runs, rounds, steps).items()}


# ------------------------------------------------------------------------------------ slot costs


def _timed(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


class SlotFns:
    """Each slot kind of one stage of ``n`` layers jitted on its own: the block forward ``F``, its
    backward slot (the vjp, which with recompute also reruns the forward), the last stage's fused
    slot, the embedding lookup."""

    def __init__(self, args, n: int, recompute: bool):
        cfg = model_cfg(args)
        params = dense.compute_view(cfg, engine.to_engine_layout(cfg, dense.init_params(cfg, jax.random.key(0))))
        layers, top = stage.split_params(params)
        self.mine, self.top = dense.slice_layers(layers, 0, n), top
        self.head = stage.head_of(cfg, top)
        fns = stage.StageFns(cfg, 1, recompute)
        self.toks = tokens(args, 1)[0]
        self.x = stage.lookup(cfg, top, self.toks[:, :-1])
        self.fwd = jax.jit(lambda lp, h: fns.block(lp, h)[0][0])
        vjp = jax.jit(lambda lp, h: jax.vjp(fns.block, lp, h, has_aux=True)[1]((h, jnp.float32(1.0))))
        if recompute:
            self.bwd = lambda lp, h: vjp(lp, h)
        else:  # the residuals were kept by the forward: time the vjp of a closure built once
            _, pull, _ = jax.vjp(fns.block, self.mine, self.x, has_aux=True)
            bwd = jax.jit(lambda f, h: f((h, jnp.float32(1.0))))
            self.bwd = lambda lp, h: bwd(pull, h)
        self.last = jax.jit(lambda lp, tp, h, t: fns.last(lp, tp, h, t)[:3])
        self.emb = jax.jit(lambda tp, t: stage.lookup(cfg, tp, t[:, :-1]))

    def costs(self) -> dict:
        F = _timed(self.fwd, self.mine, self.x)
        return {"F": F, "bwd_slot": _timed(self.bwd, self.mine, self.x),
                "last": _timed(self.last, self.mine, self.head, self.x, self.toks),
                "embed": _timed(self.emb, self.top, self.toks)}


def measured_action_costs(args, n: int, rounds: int = 7) -> dict:
    """Milliseconds of a stage of ``n`` layers' actions, activations kept (no recompute): ``F`` the
    block's forward, ``B`` its full backward (the pullback of the kept residuals), ``I`` the pullback
    with the weights closed over (XLA computes no weight gradient), ``W = B - I``; the median of
    ``rounds`` alternating rounds."""
    cfg = model_cfg(args)
    params = dense.compute_view(cfg, engine.to_engine_layout(cfg, dense.init_params(cfg, jax.random.key(0))))
    layers, top = stage.split_params(params)
    mine, fns = dense.slice_layers(layers, 0, n), stage.StageFns(cfg, 1, False)
    x = stage.lookup(cfg, top, tokens(args, 1)[0][:, :-1])
    fwd = jax.jit(lambda lp, h: fns.block(lp, h)[0][0])
    _, pull_b, _ = jax.vjp(fns.block, mine, x, has_aux=True)
    _, pull_i, _ = jax.vjp(lambda h: fns.block(mine, h), x, has_aux=True)
    pull = jax.jit(lambda f, h: f((h, jnp.float32(1.0))))
    calls = {"F": (fwd, mine, x), "B": (pull, pull_b, x), "I": (pull, pull_i, x)}
    times = {k: [] for k in calls}
    for r in range(rounds):  # alternating rounds, odd ones reversed: the three see the same machine
        for k in list(calls)[::-1 if r % 2 else 1]:
            times[k].append(_timed(*calls[k], reps=10) * 1e3)
    best = {k: float(np.median(v)) for k, v in times.items()}
    return {**best, "W": max(best["B"] - best["I"], 0.0)}


def slot_costs(args, n: int, recompute: bool) -> dict:
    """Seconds of each slot kind on one device for a stage of ``n`` layers (:class:`SlotFns`), and
    ``B``: the backward alone (the recompute slot's time less a forward)."""
    c = SlotFns(args, n, recompute).costs()
    c["B"] = max(c["bwd_slot"] - c["F"], 0.0) if recompute else c["bwd_slot"]
    c["layers"] = n
    return c


def split_of(args, P: int) -> tuple:
    """``--stage_layers``, or the even split of ``--layers`` over ``P`` stages."""
    return args.stage_layers or (args.layers // P,) * P


_COSTS: dict = {}


def cached_slot_costs(args, n: int, recompute: bool) -> dict:
    """:func:`slot_costs`, measured once per (layers, recompute) in a run."""
    if (n, recompute) not in _COSTS:
        _COSTS[n, recompute] = slot_costs(args, n, recompute)
    return _COSTS[n, recompute]


def stage_costs(args, split: tuple, recompute: bool) -> list:
    """:func:`slot_costs` of each stage of ``split``."""
    return [cached_slot_costs(args, n, recompute) for n in split]


def _stage_work(split: tuple, c: dict) -> list:
    """Seconds of work per microbatch of each stage of ``split``, from one stage's measured costs
    ``c`` (:func:`slot_costs`, of a ``c['layers']``-layer stage):

    * a stage ``s < P-1`` of ``n`` layers: ``n w`` with ``w = (F + bwd_slot) / layers`` (its forward
      and backward slots; with recompute the backward slot reruns the forward), plus the embedding
      on stage 0;
    * the last stage: ``n w_last + H``, its fused slot, with ``w_last = (F + B) / layers`` (no
      recompute there) and ``H = last - (F + B)``: final norm, head and loss, forward and backward.
    """
    n0 = c["layers"]
    w, w_last = (c["F"] + c["bwd_slot"]) / n0, (c["F"] + c["B"]) / n0
    head = max(c["last"] - (c["F"] + c["B"]), 0.0)
    return [n * w + (c["embed"] if i == 0 else 0.0) for i, n in enumerate(split[:-1])] + [split[-1] * w_last + head]


def balanced_split(n_layers: int, P: int, c: dict) -> tuple[tuple, float]:
    """The split of ``n_layers`` over ``P`` stages whose busiest stage (:func:`_stage_work`) has the
    least work per microbatch: ``(split, its seconds)``.  Every count of layers on the last stage is
    tried; the other stages share the rest as evenly as they can, the extra layers on stages 1, 2, ...
    (stage 0 also runs the embedding)."""
    best = None
    for last in range(n_layers + 1):
        q, r = divmod(n_layers - last, P - 1)  # r < P - 1: stages 1..r take one more
        split = tuple(q + (1 if 1 <= i <= r else 0) for i in range(P - 1)) + (last,)
        busiest = max(_stage_work(split, c))
        if best is None or busiest < best[1]:
            best = (split, busiest)
    return best


def print_balanced_split(args, P: int, c: dict, recompute: bool) -> None:
    split, busiest = balanced_split(args.layers, P, c)
    given = split_of(args, P)
    print(f"balanced split for P={P}, recompute={recompute} (from a {c['layers']}-layer stage's slot costs; per "
          f"layer F + backward slot {(c['F'] + c['bwd_slot']) / c['layers'] * 1e3:.2f} ms, head + loss "
          f"{max(c['last'] - c['F'] - c['B'], 0.0) * 1e3:.2f} ms): --stage_layers {','.join(map(str, split))}, "
          f"busiest stage {busiest * 1e3:.1f} ms per microbatch vs {max(_stage_work(given, c)) * 1e3:.1f} ms "
          f"for {','.join(map(str, given))}", flush=True)


IDLE = slot_plan.IDLE


def _busy(plan: slot_plan.SlotPlan, k: int, s: int) -> tuple[bool, bool]:
    """Whether device ``s`` runs a forward, and a backward, at slot ``k`` of ``plan``."""
    return plan.column("f")[k, s] != IDLE, plan.column("b")[k, s] != IDLE


class SlotWork:
    """Every busy slot of a step's plan run one after another, each its own jitted call: the work
    of a step with no pipeline around it (no accumulators, transfers, optimizer or threads).
    Timed in the same alternating rounds as the engine, so both see the same machine."""

    def __init__(self, args, P: int, plan: slot_plan.SlotPlan, recompute: bool):
        by_layers = {}
        fs = [by_layers.setdefault(n, SlotFns(args, n, recompute)) if n not in by_layers else by_layers[n]
              for n in split_of(args, P)]
        self.calls = []
        for k in range(plan.slots):
            for s in range(P):
                f = fs[s]
                fwd, bwd = _busy(plan, k, s)
                if s == P - 1:
                    self.calls += [(f.last, (f.mine, f.head, f.x, f.toks))] * bool(bwd)
                    continue
                if fwd and s == 0:
                    self.calls.append((f.emb, (f.top, f.toks)))
                self.calls += [(f.fwd, (f.mine, f.x))] * bool(fwd)
                self.calls += [(f.bwd, (f.mine, f.x))] * bool(bwd)

    def run(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            outs = [fn(*a) for fn, a in self.calls]
        jax.block_until_ready(outs)
        return (time.perf_counter() - t0) / steps


def _slot_seconds(plan: slot_plan.SlotPlan, costs: list, k: int, s: int) -> float:
    """Stage ``s``'s work at slot ``k`` from its own slot costs ``costs[s]`` (:func:`stage_costs`)."""
    c = costs[s]
    f, b = _busy(plan, k, s)
    if s == plan.program.devices - 1:
        return c["last"] if b else 0.0
    return (c["F"] + (c["embed"] if s == 0 else 0.0)) * f + c["bwd_slot"] * b


def total_slot_seconds(plan: slot_plan.SlotPlan, c: list) -> float:
    """The work of one step as the sum of its slots' costs measured one by one: what a step would
    take on one core with no pipeline overhead (no accumulators, no transfers, no optimizer)."""
    return sum(_slot_seconds(plan, c, k, s) for k in range(plan.slots) for s in range(plan.program.devices))


def predicted_step_seconds(plan: slot_plan.SlotPlan, c: list) -> float:
    """Critical path of a plan: the stages wait for each other at every slot's ppermute, so a slot
    lasts as long as its busiest stage."""
    P = plan.program.devices
    return sum(max(_slot_seconds(plan, c, k, s) for s in range(P)) for k in range(plan.slots))


def predicted_sync_over_2bw(P: int, M: int, c: list) -> float:
    """``sync / 2bw`` as the plans' critical paths predict it from the per-stage slot costs ``c``."""
    return (predicted_step_seconds(slot_plan.compile_schedule("sync", P, M), c)
            / predicted_step_seconds(slot_plan.compile_schedule("2bw", P, M), c))


# ------------------------------------------------------------------------------------------ modes


def predicted_program_over_2bw(name: str, P: int, M: int, c: list, recompute: bool, chunk_costs: list | None = None
                               ) -> float:
    """A program schedule's lock-step step over ``2bw``'s, from each stage's measured
    slot costs ``c`` (as :func:`predicted_sync_over_2bw` takes them): a slot lasts as long as its
    busiest device's forward plus backward (the last virtual stage's fused; the embedding in the
    first's forward).  ``interleaved`` reads ``chunk_costs``, the same measured for one chunk's layers."""
    v = VIRTUAL_STAGES if name == "interleaved" else 1
    plan = slot_plan.compile_schedule(name, P, M, recompute, v)
    cc = chunk_costs or c
    kind = lambda k: np.array([x[k] for x in cc])[None, :]  # noqa: E731  ([1, P]: one per device)
    d = np.arange(P)[None, :]
    f, b = plan.column("f") != slot_plan.IDLE, plan.column("b") != slot_plan.IDLE
    first = (d == 0) & (plan.column("f_chunk") == 0)
    last = (d == P - 1) & (plan.column("b_chunk") == v - 1)
    slots = f * (kind("F") + first * kind("embed")) + b * np.where(last, kind("last"), kind("bwd_slot"))
    return float(slots.max(axis=1).sum()) / predicted_step_seconds(slot_plan.compile_schedule("2bw", P, M, recompute), c)


def work_recompute(args) -> list[bool]:
    """``--recompute``'s settings for ``work``, without recompute first (its bound is the tight one)."""
    return sorted({v.strip() == "True" for v in args.recompute.split(",")})


WORK_SCHEDULES = ("sync", "2bw", "1f1b", "interleaved", "zb-h1", "pipedream")


def work_runs(args, P: int, M: int, recompute: bool) -> dict:
    """The engine runs ``work`` times beside ``simulate``: every schedule with whole tables and with
    ``vocab_parallel`` (even splits; an uneven one runs whole tables of the tick-table schedules and
    ``1f1b``), and the ``sync`` and ``2bw`` plans' slot kinds alone (``slots sync``, ``slots 2bw``);
    ``--schedules`` keeps those it names."""
    tick = ("sync", "2bw", "1f1b")
    made = {name: (lambda name=name: Pipelined(args, P, M, name, recompute, stage_layers=args.stage_layers))
            for name in WORK_SCHEDULES if name in tick or not args.stage_layers}
    if not args.stage_layers:
        made.update({f"{name} {VP}": (lambda name=name: Pipelined(args, P, M, name, recompute, vocab_parallel=True))
                     for name in WORK_SCHEDULES})
        if recompute:  # mpmd's backward recomputes
            made.update({f"{name} {MPMD}": (lambda name=name: Placed(args, P, M, name)) for name in mpmd.SCHEDULES
                         if name != "sync"})
    made["slots sync"] = lambda: SlotWork(args, P, slot_plan.compile_schedule("sync", P, M, recompute), recompute)
    made["slots 2bw"] = lambda: SlotWork(args, P, slot_plan.compile_schedule("2bw", P, M, recompute), recompute)
    wanted = [n.strip() for n in args.schedules.split(",")] if args.schedules else list(made)
    unknown = sorted(set(wanted) - set(made))
    if unknown:
        raise SystemExit(f"--schedules: unknown {unknown}; choose from {sorted(made)}")
    return {name: made[name]() for name in made if name in wanted}


def work(args) -> None:
    if args.against:
        return work_against(args)
    P, M = 4, 8
    rows = []
    split = split_of(args, P)
    print(f"work ratio: {jax.device_count()} fake devices on {len(os.sched_getaffinity(0))} core; "
          f"vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, P={P}, M={M}, "
          f"microbatch {args.rows} x {args.seq} tokens, stage layers {','.join(map(str, split))}, freed memory "
          f"{'returned to the kernel (glibc default)' if args.glibc_default else 'kept for reuse'}\n")
    print("| schedule | recompute | engine / simulate step | spread over rounds | slot work / simulate step | "
          "engine / slot work | bound |")
    print("|---|---|---|---|---|---|---|")
    costs = cached_slot_costs(args, max(args.layers // P, 1), True)
    f_share = costs["F"] / (costs["F"] + costs["B"])
    for recompute in work_recompute(args):
        runs = {"simulate": Simulated(args, M), **work_runs(args, P, M, recompute)}
        ratios = time_paired(runs, "simulate", args.rounds, args.steps)
        r = {name: float(np.median(v)) for name, v in ratios.items()}
        bound = 1.10 if not recompute else 1 + f_share + 0.10
        for name in (n for n in runs if n != "simulate" and not n.startswith("slots ")):
            slots = r.get(f"slots {name}")  # the sync and 2bw plans' slot kinds, timed alone
            spread = (min(ratios[name]), max(ratios[name]))
            shown = f"{slots:.3f} | {r[name] / slots:.3f}" if slots else "- | -"
            print(f"| {name} | {recompute} | {r[name]:.3f} | {spread[0]:.3f}-{spread[1]:.3f} "
                  f"| {shown} | <= {bound:.2f} |", flush=True)
            rows.append({"schedule": name, "recompute": recompute, "engine_over_simulate": r[name],
                         "spread": [float(spread[0]), float(spread[1])], "slot_work_over_simulate": slots,
                         "engine_over_slot_work": slots and r[name] / slots, "target": f"≤ {bound:.2f}"})
    print(f"\nmeasured F/(F+B) of a {costs['layers']}-layer stage's block = {f_share:.3f} (F {costs['F'] * 1e3:.1f} "
          f"ms, B {costs['B'] * 1e3:.1f} ms, last stage's fused slot {costs['last'] * 1e3:.1f} ms)")
    _record(args, "bench_pipeline_work", {
        "rows_per_microbatch": args.rows, "seq": args.seq, "stages": P, "microbatches": M, "layers": args.layers,
        "vocab": args.vocab, "d_model": args.d_model, "rounds": args.rounds, "f_over_f_plus_b": f_share,
        "freed_memory": "returned" if args.glibc_default else "kept", "rows": rows})
    for recompute in (True, False):
        print_balanced_split(args, P, cached_slot_costs(args, max(args.layers // P, 1), recompute), recompute)


def overlap(args) -> None:
    P = 2
    split = split_of(args, P)
    print(f"sync / 2bw step time: {jax.device_count()} fake devices on {len(os.sched_getaffinity(0))} cores; "
          f"vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, P={P}, stage layers "
          f"{','.join(map(str, split))}\n")
    print("| P | M | recompute | measured sync/2bw | plans' critical path | textbook (M+P-1)/M |")
    print("|---|---|---|---|---|---|")
    recomputes, rows = [v.strip() == "True" for v in args.recompute.split(",")], []
    for recompute in recomputes:
        costs = stage_costs(args, split, recompute)  # each stage's own slot costs: the split's critical path
        for M in (int(m) for m in args.microbatches.split(",")):
            runs = {"sync": Pipelined(args, P, M, "sync", recompute, stage_layers=args.stage_layers),
                    "2bw": Pipelined(args, P, M, "2bw", recompute, stage_layers=args.stage_layers)}
            t = time_side_by_side(runs, args.rounds, args.steps)
            pred = predicted_sync_over_2bw(P, M, costs)
            print(f"| {P} | {M} | {recompute} | {t['sync'] / t['2bw']:.3f} | {pred:.3f} | {(M + P - 1) / M:.3f} |",
                  flush=True)
            rows.append({"stages": P, "microbatches": M, "recompute": recompute, "sync_over_2bw": t["sync"] / t["2bw"],
                         "tick_table_critical_path": pred, "textbook": (M + P - 1) / M})
    for P4, M in ((4, 8), (8, 16)) if not args.stage_layers else ():  # even splits only
        c = [cached_slot_costs(args, args.layers // P4, True)] * P4
        pred = predicted_sync_over_2bw(P4, M, c)
        print(f"| {P4} | {M} | True | (predicted only) | {pred:.3f} | {(M + P4 - 1) / M:.3f} |")
    print()
    _record(args, "bench_pipeline_overlap", {
        "layers": args.layers, "stage_layers": list(split), "rows_per_microbatch": args.rows, "seq": args.seq,
        "vocab": args.vocab, "d_model": args.d_model, "rounds": args.rounds, "rows": rows,
        "note": "one process: the fake devices never run at the same time on XLA:CPU, so this is not overlap"})
    for recompute in recomputes:
        print_balanced_split(args, P, cached_slot_costs(args, max(args.layers // P, 1), recompute), recompute)


def processes(args) -> None:
    """``sync / 2bw`` with each of the 2 stages in its own process on its own core (one JAX job)."""
    from asyncpp_jax import distributed

    distributed.maybe_initialize()
    P, lead = 2, jax.process_index() == 0
    split = split_of(args, P)
    if lead:
        print(f"sync / 2bw step time: {jax.process_count()} processes x {jax.local_device_count()} device, each "
              f"process on its own core (cores {sorted(os.sched_getaffinity(0))} here); vocab {args.vocab}, d_model "
              f"{args.d_model}, {args.layers} layers, P={P}, stage layers {','.join(map(str, split))}, microbatch "
              f"{args.rows} x {args.seq} tokens, {args.rounds} alternating rounds of {args.steps} updates\n")
        print("| P | M | recompute | sync s/update | 2bw s/update | measured sync/2bw | spread over rounds | "
              "tick-table critical path | textbook (M+P-1)/M | 1f1b s/update | measured 1f1b/2bw | 1f1b plan |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    recomputes, rows = [v.strip() == "True" for v in args.recompute.split(",")], []
    for recompute in recomputes:
        # Every process times the slot kinds of both stages on its own core, at the same time (as
        # in the pipelined run, where both cores are busy): the prediction's per-slot costs.
        costs = stage_costs(args, split, recompute)
        # Interleaved (an even split only): each chunk's slot costs, measured as the stages' are.
        chunks = None if args.stage_layers else stage_costs(args, tuple(n // VIRTUAL_STAGES for n in split), recompute)
        for M in (int(m) for m in args.microbatches.split(",")):
            names = ("sync", "2bw", "1f1b") + (("interleaved",) if chunks and M % P == 0 else ()) + \
                (("zb-h1",) if not args.stage_layers else ())
            runs = {name: Pipelined(args, P, M, name, recompute, stage_layers=args.stage_layers) for name in names}
            rounds = time_rounds(runs, args.rounds, args.steps)
            ratios = np.array(rounds["sync"]) / np.array(rounds["2bw"])  # round by round: same machine state
            f1b = np.array(rounds["1f1b"]) / np.array(rounds["2bw"])
            pred = predicted_sync_over_2bw(P, M, costs)
            plan = predicted_program_over_2bw("1f1b", P, M, costs, recompute)
            il = np.array(rounds["interleaved"]) / np.array(rounds["2bw"]) if "interleaved" in runs else None
            il_plan = predicted_program_over_2bw("interleaved", P, M, costs, recompute, chunks) if il is not None else None
            zb = np.array(rounds["zb-h1"]) / np.array(rounds["2bw"]) if "zb-h1" in runs else None
            if lead:
                print(f"| {P} | {M} | {recompute} | {np.median(rounds['sync']):.3f} | {np.median(rounds['2bw']):.3f} "
                      f"| {np.median(ratios):.3f} | {ratios.min():.3f}-{ratios.max():.3f} | {pred:.3f} "
                      f"| {(M + P - 1) / M:.3f} | {np.median(rounds['1f1b']):.3f} | {np.median(f1b):.3f} "
                      f"| {plan:.3f} |" + (f" interleaved/2bw {np.median(il):.3f} (plan {il_plan:.3f})"
                                           if il is not None else "")
                      + (f" zb-h1/2bw {np.median(zb):.3f}" if zb is not None else ""), flush=True)
            rows.append({"rows_per_microbatch": args.rows, "seq": args.seq, "microbatches": M, "recompute": recompute,
                         "sync_s_per_update": float(np.median(rounds["sync"])),
                         "twobw_s_per_update": float(np.median(rounds["2bw"])),
                         "sync_over_2bw": float(np.median(ratios)), "spread": [float(ratios.min()), float(ratios.max())],
                         "tick_table_critical_path": pred, "textbook": (M + P - 1) / M,
                         "measured_over_textbook": float(np.median(ratios)) / ((M + P - 1) / M),
                         "f1b_s_per_update": float(np.median(rounds["1f1b"])), "f1b_over_2bw": float(np.median(f1b)),
                         "f1b_spread": [float(f1b.min()), float(f1b.max())], "f1b_plan_over_2bw": plan,
                         **({} if il is None else {"interleaved_over_2bw": float(np.median(il)),
                                                   "interleaved_spread": [float(il.min()), float(il.max())],
                                                   "interleaved_plan_over_2bw": il_plan}),
                         **({} if zb is None else {"zb_h1_over_2bw": float(np.median(zb)),
                                                   "zb_h1_spread": [float(zb.min()), float(zb.max())]})})
            for name, r in runs.items() if args.profile else ():
                out = os.path.join(args.profile, f"{name}_M{M}_recompute{recompute}")
                prof = profile.StepProfiler(out, start=0, steps=2)
                prof.before_step(0, r.step, r.state, r.batch)
                r.run(2)
                prof.after_step(2)
                print(f"== {name}, M={M}, recompute={recompute}, process {jax.process_index()} (stage "
                      f"{jax.process_index()}):\n{profile.render(profile.summarize(prof.dir))}", flush=True)
    if lead:
        _record(args, "bench_pipeline_processes", {
            "layers": args.layers, "stage_layers": list(split), "recompute": recomputes[0] if len(recomputes) == 1
            else recomputes, "vocab": args.vocab, "d_model": args.d_model, "rounds": args.rounds, "rows": rows})


# A worker runs in a fresh process with the checkout to time as its first argument and the schedules
# as its second: that checkout's own bench_pipeline (its engine, its API), so two commits build the
# same programs.  Arguments after the fourth are bench_pipeline flags (the model's shape).
_WORKER_PRELUDE = """
import json, os, sys
argv = sys.argv[1:]
tree, schedules = argv[0], argv[1].split(",")
sys.path.insert(0, tree)
os.chdir(tree)
from asyncpp_jax import host_setup
host_setup.reuse_freed_memory()
host_setup.add_host_devices(4)
sys.argv = ["bench_pipeline", "work", *argv[4:]]
import asyncpp_jax
import experiments.bench_pipeline as bp
assert os.path.realpath(asyncpp_jax.__file__).startswith(os.path.realpath(tree)), asyncpp_jax.__file__
from asyncpp_jax import configs
# the schedules this checkout's config admits (an earlier commit listed them as PIPELINE_SCHEDULES)
known = configs.pipeline_schedules() if hasattr(configs, "pipeline_schedules") else configs.PIPELINE_SCHEDULES
args = bp._args()
"""

COMPILE_WORKER = _WORKER_PRELUDE + """
print(json.dumps({s: bp.Pipelined(args, 4, 8, s, recompute=False).compile_seconds() for s in schedules if s in known}))
"""

# ``work --against``'s worker (third and fourth arguments: rounds, updates a round): the checkout's
# engine and simulate step, without recompute, each engine step timed back to back with a simulate
# step in every round (odd rounds reversed).
WORK_WORKER = _WORKER_PRELUDE + """
rounds, steps = int(argv[2]), int(argv[3])
runs = {"simulate": bp.Simulated(args, 8)}
runs.update({s: bp.Pipelined(args, 4, 8, s, recompute=False) for s in schedules if s in known})
for r in runs.values():
    r.run(1)
times = {s: {"engine": [], "simulate": []} for s in runs if s != "simulate"}
for k in range(rounds):
    for s in list(times)[::-1 if k % 2 else 1]:
        pair = ("simulate", s)[::-1 if k % 2 else 1]
        t = {n: runs[n].run(steps) for n in pair}
        times[s]["engine"].append(t[s])
        times[s]["simulate"].append(t["simulate"])
print(json.dumps(times))
"""


def _in_tree(worker: str, tree: str, schedules: list, *extra) -> dict:
    """The JSON a worker prints, run in checkout ``tree`` (a fresh process on this process's cores)."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", worker, tree, ",".join(schedules), *map(str, extra)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"bench_pipeline: the worker in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _compile_in(tree: str, schedules: list) -> dict:
    """``{schedule: seconds}`` to compile each schedule's train step in checkout ``tree``."""
    return _in_tree(COMPILE_WORKER, tree, schedules)


def work_against(args) -> None:
    """Each schedule's engine step (P = 4, M = 8, no recompute) in this tree and in ``--against``,
    each beside its own tree's simulate step: two fresh processes per tree in the order here, there,
    there, here, every one pinned to the same core.  A change elsewhere (the model's attention, say)
    moves the simulate step too; *engine here / engine there* is the engine's own change."""
    import statistics

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = [n.strip() for n in args.schedules.split(",")] if args.schedules else list(WORK_SCHEDULES)
    model_flags = [f"--{k}={getattr(args, k)}" for k in ("vocab", "layers", "d_model", "seq", "rows")]
    runs: dict = {"here": [], "there": []}
    for who, tree in (("here", here), ("there", args.against), ("there", args.against), ("here", here)):
        runs[who].append(_in_tree(WORK_WORKER, tree, names, args.rounds, args.steps, *model_flags))
        print(f"  timed {who} ({tree})", flush=True)

    def pooled(who, s, key):
        return [x for t in runs[who] if s in t for x in t[s][key]]

    rows = []
    for s in names:
        row = {"schedule": s}
        for who in ("here", "there"):
            eng, sim = pooled(who, s, "engine"), pooled(who, s, "simulate")
            row[who] = eng and {"engine_s": statistics.median(eng), "simulate_s": statistics.median(sim),
                                "engine_over_simulate": statistics.median(e / m for e, m in zip(eng, sim))}
        if row["there"]:
            row["engine_here_over_there"] = row["here"]["engine_s"] / row["there"]["engine_s"]
            row["simulate_here_over_there"] = row["here"]["simulate_s"] / row["there"]["simulate_s"]
        rows.append(row)
    commit = _commit_of(args.against)
    print(f"\n| schedule (P=4, M=8, no recompute) | engine / simulate here | at {commit} "
          "| engine here / there | simulate here / there |")
    print("|---|---|---|---|---|")
    for r in rows:
        there = r["there"]
        print(f"| {r['schedule']} | {r['here']['engine_over_simulate']:.3f} | "
              + (f"{there['engine_over_simulate']:.3f} | {r['engine_here_over_there']:.3f} | "
                 f"{r['simulate_here_over_there']:.3f} |" if there else "– | – | – |"))
    _record(args, "bench_pipeline_work_against", {
        "commit_against": commit, "stages": 4, "microbatches": 8, "recompute": False, "layers": args.layers,
        "vocab": args.vocab, "d_model": args.d_model, "rows_per_microbatch": args.rows, "seq": args.seq,
        "rounds": args.rounds, "processes_per_tree": 2, "rows": rows})


def _commit_of(tree: str) -> str:
    import subprocess

    return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def compile_times(args) -> None:
    import statistics

    base = Pipelined(args, 4, 8, "2bw", n_layers=8).compile_seconds()
    deep = Pipelined(args, 4, 8, "2bw", n_layers=16).compile_seconds()
    wide = Pipelined(args, 4, 16, "2bw", n_layers=8).compile_seconds()
    print("| 2bw step, P=4 | compile time / (8 layers, M=8) |")
    print("|---|---|")
    print(f"| 16 layers, M=8 | {deep / base:.2f} |")
    print(f"| 8 layers, M=16 | {wide / base:.2f} |")
    figures = {"schedule": "2bw", "stages": 4, "baseline": "8 layers, M = 8", "twice_depth": deep / base,
               "twice_microbatches": wide / base}
    if args.against:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        names = [n for n, _ in SCHEDULES]
        times: dict = {"here": [], "there": []}
        for r in range(args.rounds):  # alternating rounds, odd ones in reverse order
            for who, tree in [("here", here), ("there", args.against)][:: -1 if r % 2 else 1]:
                times[who].append(_compile_in(tree, names))
        rows = []
        for n in names:
            mine = statistics.median(t[n] for t in times["here"])
            there = [t[n] for t in times["there"] if n in t]
            rows.append({"schedule": n, "seconds": mine, "against_seconds": statistics.median(there) if there else None})
        print(f"\n| schedule (P=4, M=8, no recompute) | compile s here | at {_commit_of(args.against)} | ratio |")
        print("|---|---|---|---|")
        for r in rows:
            a = r["against_seconds"]
            there, ratio = ("-", "-") if a is None else (f"{a:.1f}", f"{r['seconds'] / a:.2f}")
            print(f"| {r['schedule']} | {r['seconds']:.1f} | {there} | {ratio} |")
        figures["against"] = {"commit": _commit_of(args.against), "rounds": args.rounds, "rows": rows}
    _record(args, "bench_pipeline_compile", figures)


def conditionals(args) -> None:
    from experiments.census import census

    def count(step, state, batch) -> int:
        c = census(jax.make_jaxpr(step)(state, batch))
        assert c.while_loops == 0, "a while loop's trip count is unknown: the count would be a lower bound"
        return c.conditionals

    sim = Simulated(args, 8)
    rows = [{"runner": "simulate", "P": 1, "M": 8, "conditionals": count(sim.step, sim.state, sim.batch)}]
    for P in (4, 8):
        # Split tables (``vocab_parallel``): every device joins the lookup and the loss in its slots.
        for split in (False, True):
            for schedule in WORK_SCHEDULES:
                M = 2 * (P - 1) if schedule == "2bw" else P  # 2bw's crossing, ramp-free order
                v = VIRTUAL_STAGES if schedule == "interleaved" else 1
                run = Pipelined(args, P, M, schedule, n_layers=P * v, vocab_parallel=split)
                plan = slot_plan.compile_schedule(schedule, P, M, virtual_stages=v)
                rows.append({"runner": f"pipeline {schedule}" + (f", {VP}" if split else ""), "P": P, "M": M,
                             "ticks": plan.slots, "conditionals": count(run.step, run.state, run.batch)})
    print("| runner | P | M | ticks (slots) | conditionals per update |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['runner']} | {r['P']} | {r['M']} | {r.get('ticks', '')} | {r['conditionals']} |")
    _record(args, "bench_pipeline_conditionals", {"rows": rows, "layers_per_stage": 1})


if __name__ == "__main__":
    {"work": work, "overlap": overlap, "compile": compile_times, "processes": processes,
     "schedules": schedules, "conditionals": conditionals}[ARGS.mode](ARGS)
