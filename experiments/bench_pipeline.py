"""Pipeline engine: ``2bw`` vs ``sync`` updates/s, and compile time against depth and microbatches.

    python experiments/bench_pipeline.py [--rounds 3] [--steps 4]

On fake CPU devices (``--xla_force_host_platform_device_count``).  For each ``P`` in {2, 4} and
``M`` in {4, 8, 16} it times both schedules in alternating rounds (absolute times on a shared
machine are noise; the ratio is measured side by side) and prints the ratio beside the tick-table
ratio ``(M + 2P - 2) / M`` and each table's share of useful stage-ticks.  Then it compiles the
``2bw`` step at 1x and 2x layers and 1x and 2x microbatches: the scans over layers and ticks keep
the program size, so the compile time should stay about flat.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncpp_jax import host_setup  # noqa: E402  (no JAX import)

host_setup.add_host_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from asyncpp_jax.configs import base_config  # noqa: E402
from asyncpp_jax.models import dense  # noqa: E402
from asyncpp_jax.pipeline import engine, schedules  # noqa: E402
from asyncpp_jax.train import step as step_lib  # noqa: E402

SEQ, PER_MICROBATCH = 64, 2


def model_cfg(n_layers: int):
    m = base_config().model
    m.update(vocab_size=257, d_model=128, n_layers=n_layers, n_heads=4, n_kv_heads=2, d_ff=344)
    return m


class Setup:
    """One compiled pipeline train step and its state, ready to time."""

    def __init__(self, n_stages: int, microbatches: int, schedule: str, n_layers: int = 8):
        self.cfg = cfg = model_cfg(n_layers)
        self.mesh = mesh = engine.make_pipeline_mesh(1, n_stages)
        abstract = dense.abstract_params(cfg)
        tx = optax.adamw(1e-3)
        B = microbatches * PER_MICROBATCH
        self.step = engine.make_pipeline_train_step(cfg, tx, optax.constant_schedule(1e-3), mesh, abstract,
                                                    microbatches, schedule)
        state = step_lib.init_state(cfg, tx, jax.random.key(0))
        state = state.replace(runner_state=engine.init_pipeline_state(
            cfg, state.params, 1, n_stages, microbatches, B, SEQ))
        self.state = engine.place_state(state, mesh, abstract)
        tokens = np.random.default_rng(0).integers(0, 257, (microbatches, PER_MICROBATCH, SEQ + 1))
        self.batch = jax.device_put(jnp.asarray(tokens, jnp.int32), engine.global_batch_sharding(mesh))

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


def throughput_table(rounds: int, steps: int) -> None:
    print("| P | M | 2bw/sync updates/s (measured) | theory (M+2P-2)/M | useful ticks sync | useful ticks 2bw |")
    print("|---|---|---|---|---|---|")
    for P in (2, 4):
        for M in (4, 8, 16):
            sync_t = schedules.sync_table(P, M)
            theory = sync_t.ticks / M
            if M < schedules.min_microbatches_2bw(P):
                print(f"| {P} | {M} | n/a (2bw needs M >= {schedules.min_microbatches_2bw(P)}) | {theory:.2f} "
                      f"| {sync_t.useful_fraction():.0%} | - |")
                continue
            runs = {name: Setup(P, M, name) for name in ("sync", "2bw")}
            for r in runs.values():
                r.run(1)  # compile + warm-up
            times = {name: [] for name in runs}
            for _ in range(rounds):
                for name, r in runs.items():
                    times[name].append(r.run(steps))
            ratio = np.median(times["sync"]) / np.median(times["2bw"])
            useful_2bw = schedules.async_table(P, M).useful_fraction()
            print(f"| {P} | {M} | {ratio:.2f} | {theory:.2f} | {sync_t.useful_fraction():.0%} | {useful_2bw:.0%} |",
                  flush=True)


def compile_table() -> None:
    base = Setup(4, 8, "2bw", n_layers=8).compile_seconds()
    deep = Setup(4, 8, "2bw", n_layers=16).compile_seconds()
    wide = Setup(4, 16, "2bw", n_layers=8).compile_seconds()
    print("\n| 2bw step, P=4 | compile time / (8 layers, M=8) |")
    print("|---|---|")
    print(f"| 16 layers, M=8 | {deep / base:.2f} |")
    print(f"| 8 layers, M=16 | {wide / base:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print(f"{jax.device_count()} fake {jax.default_backend()} devices on {os.cpu_count()} cores; "
          f"model d128 x 8 layers, microbatch {PER_MICROBATCH} x {SEQ} tokens\n")
    throughput_table(args.rounds, args.steps)
    compile_table()


if __name__ == "__main__":
    main()
