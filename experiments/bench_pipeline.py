"""Pipeline engine benchmark: wasted work, sync vs 2bw step time, the tick table's prediction, compile time.

    python experiments/bench_pipeline.py work      # all fake devices on ONE core: work ratio
    python experiments/bench_pipeline.py overlap   # one core per fake device: sync / 2bw step time
    python experiments/bench_pipeline.py compile   # compile time at 2x depth and 2x microbatches

Absolute times on a shared machine are noise, so every figure is a ratio of two programs timed
side by side in alternating rounds (median of rounds).

* ``work``: with every fake device pinned to the same core, a pipeline step takes the total work
  of all stages.  Divided by the single-device ``simulate`` step on the same batch it measures
  waste: 1.0 is ideal; recomputing each stage's forward costs at most ``1 + F/(F+B)``.
* ``overlap``: with one core per stage the stages really run at the same time; ``sync / 2bw``
  is compared with a textbook 1F1B's ceiling ``(M + P - 1)/M`` and with the critical path the
  tick table predicts from the measured per-slot costs (``Σ_ticks max_stages cost``).
* ``compile``: the scans over layers and ticks keep the program size flat.

The model is a real-vocabulary decoder (vocab 49152, d_model 256, 8 layers; ``--vocab`` and
``--layers`` change it), the batch ``M`` microbatches of 2 x 128 tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("work", "overlap", "compile")


def _setup_host(mode: str, devices: int) -> None:
    """Before JAX starts: the fake devices, and for ``work`` one core for all of them."""
    if mode == "work":
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    from asyncpp_jax import host_setup  # no JAX import

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
    ap.add_argument("--recompute", default="True,False", help="overlap: the recompute settings to time")
    return ap.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:
    _setup_host(ARGS.mode, 4 if ARGS.mode != "overlap" else 2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from asyncpp_jax.configs import base_config  # noqa: E402
from asyncpp_jax.models import dense  # noqa: E402
from asyncpp_jax.pipeline import engine, make_mesh, tick_tables, stage  # noqa: E402
from asyncpp_jax import train_state as state_lib  # noqa: E402
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

    def __init__(self, args, P: int, M: int, schedule: str, recompute: bool = True, n_layers=None):
        cfg = model_cfg(args, n_layers)
        mesh = engine.make_pipeline_mesh(1, P)
        abstract = dense.abstract_params(cfg)
        self.step = engine.make_pipeline_train_step(cfg, TX, LR, mesh, abstract, M, schedule, recompute=recompute)
        state = state_lib.init_state(cfg, TX, jax.random.key(0))
        ps = engine.init_pipeline_state(cfg, state.params, mesh, M, M * args.rows, args.seq, schedule, recompute)
        self.state = engine.place_state(state.replace(runner_state=ps), mesh, abstract)
        self.batch = jax.device_put(tokens(args, M), engine.global_batch_sharding(mesh))

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


class Simulated(Pipelined):
    """The single-device ``simulate`` step on the same batch: the work a step must do."""

    def __init__(self, args, M: int):
        cfg = model_cfg(args)
        mesh = make_mesh(1, jax.devices()[:1])
        self.step = step_lib.make_train_step(cfg, TX, LR, mesh)
        self.state = jax.device_put(state_lib.init_state(cfg, TX, jax.random.key(0)), state_lib.replicated(mesh))
        self.batch = jax.device_put(tokens(args, M), NamedSharding(mesh, state_lib.BATCH_SPEC))


def time_side_by_side(runs: dict, rounds: int, steps: int) -> dict:
    """Median seconds per update of each run, timed in alternating rounds after a warm-up."""
    for r in runs.values():
        r.run(1)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, r in runs.items():
            times[name].append(r.run(steps))
    return {name: float(np.median(t)) for name, t in times.items()}


# ------------------------------------------------------------------------------------ slot costs


def _timed(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


class SlotFns:
    """Each slot kind of one stage jitted on its own: a stage's block forward ``F``, its backward
    slot (the vjp, which with recompute also reruns the forward), the last stage's fused slot, the
    embedding lookup."""

    def __init__(self, args, P: int, recompute: bool):
        cfg = model_cfg(args)
        params = dense.compute_view(cfg, dense.init_params(cfg, jax.random.key(0)))
        layers, top = stage.split_params(params)
        self.mine, self.top = dense.slice_layers(layers, 0, args.layers // P), top
        self.head = dense.head_params(cfg, top)
        fns = stage.StageFns(cfg, 1, recompute)
        self.toks = tokens(args, 1)[0]
        self.x = dense.embed(cfg, top, self.toks[:, :-1])
        self.fwd = jax.jit(lambda lp, h: fns.block(lp, h)[0][0])
        vjp = jax.jit(lambda lp, h: jax.vjp(fns.block, lp, h, has_aux=True)[1]((h, jnp.float32(1.0))))
        if recompute:
            self.bwd = lambda lp, h: vjp(lp, h)
        else:  # the residuals were kept by the forward: time the vjp of a closure built once
            _, pull, _ = jax.vjp(fns.block, self.mine, self.x, has_aux=True)
            bwd = jax.jit(lambda f, h: f((h, jnp.float32(1.0))))
            self.bwd = lambda lp, h: bwd(pull, h)
        self.last = jax.jit(lambda lp, tp, h, t: fns.last(lp, tp, h, t)[:3])
        self.emb = jax.jit(lambda tp, t: dense.embed(cfg, tp, t[:, :-1]))

    def costs(self) -> dict:
        F = _timed(self.fwd, self.mine, self.x)
        return {"F": F, "bwd_slot": _timed(self.bwd, self.mine, self.x),
                "last": _timed(self.last, self.mine, self.head, self.x, self.toks),
                "embed": _timed(self.emb, self.top, self.toks)}


def slot_costs(args, P: int, recompute: bool) -> dict:
    """Seconds of each slot kind on one device (:class:`SlotFns`), and ``B``: the backward alone
    (the recompute slot's time less a forward)."""
    c = SlotFns(args, P, recompute).costs()
    c["B"] = max(c["bwd_slot"] - c["F"], 0.0) if recompute else c["bwd_slot"]
    return c


class SlotWork:
    """Every busy slot of a step's tick table run one after another, each its own jitted call: the
    work of a step with no pipeline around it (no accumulators, transfers, optimizer or threads).
    Timed in the same alternating rounds as the engine, so both see the same machine."""

    def __init__(self, args, P: int, table: tick_tables.TickTable, recompute: bool):
        self.f = SlotFns(args, P, recompute)
        self.calls = []
        for k in range(table.ticks):
            for s in range(P):
                fwd, bwd = table.forward[k, s] != tick_tables.IDLE, table.backward[k, s] != tick_tables.IDLE
                if s == P - 1:
                    self.calls += [(self.f.last, (self.f.mine, self.f.head, self.f.x, self.f.toks))] * bool(bwd)
                    continue
                if fwd and s == 0:
                    self.calls.append((self.f.emb, (self.f.top, self.f.toks)))
                self.calls += [(self.f.fwd, (self.f.mine, self.f.x))] * bool(fwd)
                self.calls += [(self.f.bwd, (self.f.mine, self.f.x))] * bool(bwd)

    def run(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            outs = [fn(*a) for fn, a in self.calls]
        jax.block_until_ready(outs)
        return (time.perf_counter() - t0) / steps


def _slot_seconds(table: tick_tables.TickTable, c: dict, k: int, s: int) -> float:
    f, b = table.forward[k, s] != tick_tables.IDLE, table.backward[k, s] != tick_tables.IDLE
    if s == table.n_stages - 1:
        return c["last"] if b else 0.0
    return (c["F"] + (c["embed"] if s == 0 else 0.0)) * f + c["bwd_slot"] * b


def total_slot_seconds(table: tick_tables.TickTable, c: dict) -> float:
    """The work of one step as the sum of its slots' costs measured one by one: what a step would
    take on one core with no pipeline overhead (no accumulators, no transfers, no optimizer)."""
    return sum(_slot_seconds(table, c, k, s) for k in range(table.ticks) for s in range(table.n_stages))


def predicted_step_seconds(table: tick_tables.TickTable, c: dict) -> float:
    """Critical path of the tick table: the stages wait for each other at every tick's ppermute,
    so a tick lasts as long as its busiest stage."""
    return sum(max(_slot_seconds(table, c, k, s) for s in range(table.n_stages)) for k in range(table.ticks))


# ------------------------------------------------------------------------------------------ modes


def work(args) -> None:
    P, M = 4, 8
    print(f"work ratio: {jax.device_count()} fake devices on {len(os.sched_getaffinity(0))} core; "
          f"vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, P={P}, M={M}, "
          f"microbatch {args.rows} x {args.seq} tokens\n")
    print("| schedule | recompute | engine / simulate step | slot work / simulate step | engine / slot work | bound |")
    print("|---|---|---|---|---|---|")
    costs = slot_costs(args, P, True)
    f_share = costs["F"] / (costs["F"] + costs["B"])
    for recompute in (False, True):
        runs = {"simulate": Simulated(args, M), "sync": Pipelined(args, P, M, "sync", recompute),
                "2bw": Pipelined(args, P, M, "2bw", recompute),
                "slots sync": SlotWork(args, P, tick_tables.sync_table(P, M), recompute),
                "slots 2bw": SlotWork(args, P, tick_tables.async_table(P, M), recompute)}
        t = time_side_by_side(runs, args.rounds, args.steps)
        bound = 1.10 if not recompute else 1 + f_share + 0.10
        for name in ("sync", "2bw"):
            slots = t[f"slots {name}"]
            print(f"| {name} | {recompute} | {t[name] / t['simulate']:.3f} | {slots / t['simulate']:.3f} "
                  f"| {t[name] / slots:.3f} | <= {bound:.2f} |", flush=True)
        print(f"(simulate step {t['simulate']:.2f} s)", flush=True)
    print(f"\nmeasured F/(F+B) of one stage's block = {f_share:.3f} (F {costs['F'] * 1e3:.1f} ms, "
          f"B {costs['B'] * 1e3:.1f} ms, last stage's fused slot {costs['last'] * 1e3:.1f} ms)")


def overlap(args) -> None:
    P = 2
    print(f"sync / 2bw step time: {jax.device_count()} fake devices on {len(os.sched_getaffinity(0))} cores; "
          f"vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, P={P}\n")
    print("| P | M | recompute | measured sync/2bw | tick-table critical path | textbook (M+P-1)/M |")
    print("|---|---|---|---|---|---|")
    for recompute in (v.strip() == "True" for v in args.recompute.split(",")):
        costs = slot_costs(args, P, recompute)
        for M in (int(m) for m in args.microbatches.split(",")):
            runs = {"sync": Pipelined(args, P, M, "sync", recompute), "2bw": Pipelined(args, P, M, "2bw", recompute)}
            t = time_side_by_side(runs, args.rounds, args.steps)
            pred = (predicted_step_seconds(tick_tables.sync_table(P, M), costs)
                    / predicted_step_seconds(tick_tables.async_table(P, M), costs))
            print(f"| {P} | {M} | {recompute} | {t['sync'] / t['2bw']:.3f} | {pred:.3f} | {(M + P - 1) / M:.3f} |",
                  flush=True)
    for P, M in ((4, 8), (8, 16)):
        c = slot_costs(args, P, True)
        pred = (predicted_step_seconds(tick_tables.sync_table(P, M), c)
                / predicted_step_seconds(tick_tables.async_table(P, M), c))
        print(f"| {P} | {M} | True | (predicted only) | {pred:.3f} | {(M + P - 1) / M:.3f} |")


def compile_times(args) -> None:
    base = Pipelined(args, 4, 8, "2bw", n_layers=8).compile_seconds()
    deep = Pipelined(args, 4, 8, "2bw", n_layers=16).compile_seconds()
    wide = Pipelined(args, 4, 16, "2bw", n_layers=8).compile_seconds()
    print("| 2bw step, P=4 | compile time / (8 layers, M=8) |")
    print("|---|---|")
    print(f"| 16 layers, M=8 | {deep / base:.2f} |")
    print(f"| 8 layers, M=16 | {wide / base:.2f} |")


if __name__ == "__main__":
    {"work": work, "overlap": overlap, "compile": compile_times}[ARGS.mode](ARGS)
