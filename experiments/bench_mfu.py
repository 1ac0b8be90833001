"""Throughput and MFU of one config's train step on the device present, and its attention kernel
against the einsum path.

    python -m experiments.bench_mfu --config=configs/dense135m.py [--set model.attention=splash ...]
        [--steps 10] [--record experiments/results/bench/bench_mfu.jsonl]

It builds the runner a training run builds (:func:`asyncpp_jax.train.runner.build`) on every device
present, with ``train.microbatches`` and ``model.remat`` decided as a run decides them on this
device's memory (:func:`asyncpp_jax.train.trainer.fitted_config`), and times ``--steps`` train steps
on random tokens after the compile and one warm-up step.  It prints, and records with ``--record``:

- ``step_s``: the median seconds per step; ``tokens_per_s``: global batch x sequence / step_s;
- ``model_tflops_per_s``: tokens/s x the model FLOPs per token of :mod:`asyncpp_jax.models.flops`
  (``6 N + 12 L T d_attn``; recomputation is not counted);
- ``mfu``: that over the devices' peak, ``configs.PEAK_TFLOPS`` of the device kind at the compute
  dtype.  A CPU has no datasheet peak here: its "peak" is the rate this process measures for a
  large fp32 matmul, and the record says so (``peak_source``);
- ``attention``: one layer's attention forward and backward at the step's microbatch shape, by the
  kernel the step runs (``config.model.attention`` on this platform) and by the ``xla`` einsum
  path, each the median of a few timed calls, and their ratio.
"""

from __future__ import annotations

import argparse
import ast
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from asyncpp_jax import configs
from asyncpp_jax.models import layers
from asyncpp_jax.models.flops import flops_per_token
from asyncpp_jax.train import fit
from asyncpp_jax.train import runner as runner_lib
from asyncpp_jax.train.trainer import fitted_config


def platform() -> str:
    """The lowering platform of the default backend: ``cuda`` for an NVIDIA GPU."""
    backend = jax.default_backend()
    return "cuda" if backend == "gpu" and "cuda" in jax.extend.backend.get_backend().platform_version.lower() \
        else backend


def with_settings(c, settings: list[str]):
    """``c`` with ``KEY=VALUE`` settings (``model.attention=splash``), each value read as a Python
    literal when it is one (``8``, ``True``), else as a string."""
    fields = {}
    for item in settings:
        key, _, text = item.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        fields[key.replace(".", "__")] = value
    return fit.with_fields(c, **fields)


def peak_tflops(device, compute_dtype: str) -> tuple[float, str]:
    """``(peak TFLOP/s of one device, where the figure comes from)``."""
    for kind, (bf16, fp32) in configs.PEAK_TFLOPS.items():
        if kind.lower() in device.device_kind.lower():
            return (bf16 if compute_dtype == "bfloat16" else fp32), f"configs.PEAK_TFLOPS[{kind!r}]"
    return _measured_matmul_tflops(device.device_kind)


@functools.cache
def _measured_matmul_tflops(device_kind: str) -> tuple[float, str]:
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = _median_seconds(lambda: f(a).block_until_ready(), 5)
    return 2 * n ** 3 / t / 1e12, f"measured: a {n}x{n} fp32 matmul on {device_kind} (no datasheet peak)"


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_seconds(c, kernel: str, rows: int, repeats: int = 5) -> float:
    """One layer's attention forward + backward (``attend``) at ``rows`` sequences of ``c``'s shape."""
    m, t = c.model, c.data.seq_len
    hd, dtype = layers.head_dim(m), layers.dtype_of(m.compute_dtype)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (rows, t, m.n_heads, hd), dtype)
    k, v = (jax.random.normal(x, (rows, t, m.n_kv_heads, hd), dtype) for x in keys[1:])
    positions = jnp.broadcast_to(jnp.arange(t), (rows, t))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(layers.attend(q, k, v, positions, kernel).astype(jnp.float32)),
                            argnums=(0, 1, 2)))
    jax.block_until_ready(grad(q, k, v))
    return _median_seconds(lambda: jax.block_until_ready(grad(q, k, v)), repeats)


def measure(c, steps: int, devices=None) -> dict:
    """The figures of the module docstring for config ``c`` on ``devices`` (default: all)."""
    devices = list(devices if devices is not None else jax.devices())
    c = fitted_config(configs.resolve(c), devices)
    runner = runner_lib.build(c, devices)
    state = runner.init_state(jax.random.key(c.seed))
    M, B, T = c.train.microbatches, c.train.global_batch_size, c.data.seq_len
    tokens = np.random.default_rng(0).integers(0, c.model.vocab_size, (M, B // M, T + 1), dtype=np.int32)
    batch = jax.device_put(tokens, runner.batch_sharding())
    t0 = time.perf_counter()
    state, _ = runner.train_step(state, batch)  # compile, and the first step
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = runner.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens_per_s = B * T / step_s
    model_tflops = tokens_per_s * flops_per_token(c.model, T) / 1e12
    peak, peak_source = peak_tflops(devices[0], c.model.compute_dtype)
    rows = max(B // (M * max(c.mesh.data, 1)), 1)
    on = platform()
    kernel = layers.auto_kernel(on, T) if c.model.attention == "auto" else c.model.attention
    kernel_s, xla_s = attention_seconds(c, c.model.attention, rows), attention_seconds(c, "xla", rows)
    return {
        "config": c.name, "platform": on, "device_kind": devices[0].device_kind, "devices": len(devices),
        "compute_dtype": c.model.compute_dtype, "seq_len": T, "global_batch": B, "microbatches": M,
        "remat": bool(c.model.remat), "runner": "pipeline" if configs.uses_pipeline(c) else "simulate",
        "steps": steps, "compile_and_first_step_s": compile_s, "step_s": step_s, "tokens_per_s": tokens_per_s,
        "model_flops_per_token": flops_per_token(c.model, T), "model_tflops_per_s": model_tflops,
        "peak_tflops_per_device": peak, "peak_source": peak_source, "mfu": model_tflops / (peak * len(devices)),
        "attention": {"setting": c.model.attention, "kernel": kernel, "rows": rows, "kernel_s": kernel_s,
                      "xla_s": xla_s, "xla_over_kernel": xla_s / kernel_s},
    }


def format_figures(f: dict) -> str:
    a = f["attention"]
    return "\n".join([
        f"{f['config']} on {f['devices']} x {f['device_kind']} ({f['platform']}), {f['compute_dtype']}, "
        f"T={f['seq_len']}, batch {f['global_batch']} in {f['microbatches']} microbatch(es), "
        f"remat {'on' if f['remat'] else 'off'}, {f['runner']} runner",
        f"  step {f['step_s'] * 1e3:.1f} ms (median of {f['steps']}; compile + first step "
        f"{f['compile_and_first_step_s']:.1f} s), {f['tokens_per_s']:,.0f} tokens/s",
        f"  model {f['model_tflops_per_s']:.3g} TFLOP/s; MFU {f['mfu']:.1%} of {f['peak_tflops_per_device']:.3g} "
        f"TFLOP/s per device ({f['peak_source']})",
        f"  attention (one layer, fwd+bwd, {a['rows']} rows): {a['kernel']} ({a['setting']}) {a['kernel_s'] * 1e3:.2f} ms, "
        f"xla {a['xla_s'] * 1e3:.2f} ms: xla / kernel = {a['xla_over_kernel']:.2f}",
    ])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(configs.DEFAULT_CONFIG))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config setting, e.g. model.attention=splash (repeatable)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--record", default="", metavar="FILE.jsonl",
                   help="append the figures, with the command, commit, date and hardware, as one JSON line")
    a = p.parse_args(argv)
    c = with_settings(configs.load_file(a.config), a.set)
    configs.validate(c)
    figures = measure(c, a.steps)
    print(format_figures(figures))
    if a.record:
        from experiments import records

        records.append(a.record, records.make("bench_mfu", figures))
    return figures


if __name__ == "__main__":
    main()
