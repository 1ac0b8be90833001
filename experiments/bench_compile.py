"""Compile time vs depth: the scanned layer stack must compile in ~constant time.

Prints, measured side by side in one run, the compile time of the full train step (forward,
backward, AdamW update) at depth L and 2L, and their ratio.  With layers under ``scan`` the ratio
stays near 1; an unrolled stack would roughly double it.

    python -m experiments.bench_compile [--layers 8] [--d_model 256]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from asyncpp_jax.configs import base_config
from asyncpp_jax.optim import build_optimizer
from asyncpp_jax.pipeline.mesh import make_mesh
from asyncpp_jax import train_state as state_lib
from asyncpp_jax.train import step as step_lib


def compile_seconds(n_layers: int, d_model: int, seq_len: int, batch: int) -> float:
    c = base_config()
    c.model.update(n_layers=n_layers, d_model=d_model, n_heads=4, n_kv_heads=2, d_ff=3 * d_model)
    opt, sched = build_optimizer(c.optimizer, 100)
    mesh = make_mesh(1)
    train_step = step_lib.make_train_step(c.model, opt, sched, mesh)
    state = jax.eval_shape(lambda: state_lib.init_state(c.model, opt, jax.random.key(0)))
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=state_lib.replicated(mesh)), state)
    tokens = jax.ShapeDtypeStruct((1, batch, seq_len + 1), np.int32,
                                  sharding=jax.NamedSharding(mesh, state_lib.BATCH_SPEC))
    t0 = time.perf_counter()
    train_step.lower(state, tokens).compile()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", default="", metavar="FILE.jsonl",
                   help="append the compile times and their ratio, with the command, commit, date and hardware, "
                        "as one JSON line to this file (e.g. experiments/results/bench/bench_compile.jsonl)")
    a = p.parse_args()
    # Alternate the two depths so drift on a shared machine hits both alike; keep the best of each.
    times = {a.layers: [], 2 * a.layers: []}
    for _ in range(a.repeats):
        for n in times:
            times[n].append(compile_seconds(n, a.d_model, a.seq_len, a.batch))
    best = {n: min(v) for n, v in times.items()}
    print(f"backend={jax.default_backend()}  d_model={a.d_model}  best of {a.repeats}")
    for n, s in best.items():
        print(f"  {n:3d} layers: compile {s:.2f} s")
    print(f"compile-time ratio {2 * a.layers}/{a.layers} layers: {best[2 * a.layers] / best[a.layers]:.2f}")
    if a.record:
        from experiments import records

        records.append(a.record, records.make("bench_compile", {
            "runner": "simulate", "d_model": a.d_model, "seq_len": a.seq_len, "batch": a.batch, "repeats": a.repeats,
            "compile_s": {str(n): s for n, s in best.items()}, "twice_depth": best[2 * a.layers] / best[a.layers]}))


if __name__ == "__main__":
    main()
