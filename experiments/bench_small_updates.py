"""Where a small update's time goes at the ``cpu_regime`` preset (2 x 128 tokens an update).

    python -m experiments.bench_small_updates [--optimizers adamw,muon,soap] [--rounds 3] [--updates 60]

Measured side by side in alternating rounds on one core (the preset's runs each get one):

- ``per call``: one update per jitted call and the metrics fetched after each, as the trainer runs it;
- ``scan K``: K updates in one jitted call (``lax.scan`` over the same ``train_step``), the metrics
  fetched once a call: what folding updates into one call would save (dispatch, host round trips);
- the core's matmul rate (a jitted 512 x 512 x 512 float32 matmul), the yardstick for the model
  FLOP rate (``asyncpp_jax.models.flops``: 6N + attention per token).

Prints, per optimizer, the median ms per update of each way, the ratio per call / scan (above 1:
the host's share that folding would remove) and the model FLOP rate as a fraction of the matmul
rate; appends a record to ``experiments/results/bench/bench_small_updates.jsonl`` (``--no-record``
to skip).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def _pin_one_core():
    # Before JAX starts: the preset's runs each get one core (--jobs 2 on 2 cores).
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})


def build(opt: str):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from asyncpp_jax import configs
    from asyncpp_jax.train import runner as runner_lib
    from experiments.studies import common

    c = configs.load_file("configs/tiny.py")
    for key, value in {**common.CPU_REGIME, "optimizer.name": opt}.items():
        section, _, field = key.rpartition(".")
        c[section][field] = value
    c = configs.resolve(c)
    r = runner_lib.build(c, jax.devices())
    state = jax.jit(r.init_fn())(jax.random.key(0))
    b, t = c.train.global_batch_size, c.data.seq_len
    rng = np.random.default_rng(0)
    return c, r, state, rng, NamedSharding(r.mesh, P(None, None, "data", None)), b, t


def time_per_call(step, state, batches, jax):
    t0 = time.perf_counter()
    for batch in batches:
        state, metrics = step(state, batch)
        jax.device_get(metrics)
    return state, (time.perf_counter() - t0) / len(batches)


def time_scan(multi, state, stacked, calls, jax):
    t0 = time.perf_counter()
    for _ in range(calls):
        state, metrics = multi(state, stacked)
        jax.device_get(metrics)
    return state, (time.perf_counter() - t0) / (calls * stacked.shape[0])


def matmul_rate(jax, n: int = 512, reps: int = 40) -> float:
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        y = f(a)
    y.block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizers", default="adamw,muon,soap")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--updates", type=int, default=60, help="updates timed per way and round")
    ap.add_argument("--scan", type=int, default=20, help="K: updates per call in the scan way")
    ap.add_argument("--no-record", dest="record", action="store_false")
    a = ap.parse_args(argv)
    _pin_one_core()
    import jax

    from asyncpp_jax.models.flops import flops_per_token

    results = {}
    for opt in a.optimizers.split(","):
        c, r, state, rng, stacked_sharding, b, t = build(opt)
        multi = jax.jit(lambda s, xs: jax.lax.scan(lambda st, x: r.train_step(st, x), s, xs), donate_argnums=0)
        stacked = jax.device_put(rng.integers(0, 256, (a.scan, 1, b, t + 1), dtype=np.int32), stacked_sharding)
        singles = [jax.device_put(np.asarray(stacked[k % a.scan]), r.batch_sharding()) for k in range(a.updates)]
        state, _ = time_per_call(r.train_step, state, singles[:3], jax)  # compile, warm up
        state, _ = time_scan(multi, state, stacked, 1, jax)
        per_call, scanned, peaks = [], [], []
        for _ in range(a.rounds):
            state, dt = time_per_call(r.train_step, state, singles, jax)
            per_call.append(dt)
            state, dt = time_scan(multi, state, stacked, max(1, a.updates // a.scan), jax)
            scanned.append(dt)
            peaks.append(matmul_rate(jax))
        tokens = b * t
        flops = flops_per_token(c.model, t) * tokens
        ms, ms_scan, peak = statistics.median(per_call) * 1e3, statistics.median(scanned) * 1e3, statistics.median(peaks)
        results[opt] = {"ms_per_update": round(ms, 2), "ms_per_update_scan": round(ms_scan, 2),
                        "per_call_over_scan": round(ms / ms_scan, 3), "tokens_per_sec": round(tokens / ms * 1e3),
                        "model_gflops_per_sec": round(flops / ms * 1e3 / 1e9, 1),
                        "matmul_gflops_per_sec": round(peak / 1e9, 1),
                        "fraction_of_matmul_rate": round(flops / ms * 1e3 / peak, 3)}
        print(f"{opt}: {ms:.1f} ms/update per call, {ms_scan:.1f} in a scan of {a.scan} "
              f"(per call / scan {ms / ms_scan:.2f}); {tokens / ms * 1e3:,.0f} tokens/s = "
              f"{flops / ms * 1e3 / 1e9:.1f} model GFLOP/s, {flops / ms * 1e3 / peak:.0%} of the core's "
              f"{peak / 1e9:.0f} GFLOP/s matmul rate", flush=True)
    if a.record:
        from experiments import records

        records.append(records.BENCH_DIR / "bench_small_updates.jsonl",
                       records.make("bench_small_updates", results, rounds=a.rounds, updates=a.updates, scan=a.scan))


if __name__ == "__main__":
    main()
