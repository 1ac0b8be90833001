"""Cost of one optimizer update on the real SmolLM2-135M parameter shapes.

Params and gradients are random (no training): what is measured is the optimizer alone. For each
optimizer this prints, measured side by side in one run:
- the time of one jitted ``update + apply_updates``, as a ratio to AdamW's (and, where optax ships
  the same method, to optax's implementation);
- the optimizer-state memory in bytes per parameter (from ``jax.eval_shape``, nothing allocated).

Times average over ``--steps`` updates after a warm-up, so SOAP's periodic basis refresh is
amortised as in training (keep ``--steps`` a multiple of its precondition frequency, 10).

    python -m experiments.bench_optimizers [--config configs/dense135m.py] [--steps 10]
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asyncpp_jax import optim
from asyncpp_jax.models import dense
from asyncpp_jax.optim.adan import adan
from asyncpp_jax.optim.mars import mars
from asyncpp_jax.optim.muon import muon
from asyncpp_jax.optim.soap import soap

LR = 1e-3


def candidates() -> dict[str, optax.GradientTransformation]:
    ours = {
        "adamw": optim.adamw(LR),
        "muon": muon(LR),
        "soap": soap(LR),
        "adan": adan(LR),
        "lion": optim.lion(LR),
        "mars": mars(LR),
    }
    theirs = {
        "optax.adamw": optax.adamw(LR),
        "optax.contrib.muon": optax.contrib.muon(LR),
        "optax.adan": optax.adan(LR),
        "optax.lion": optax.lion(LR),
    }
    return {**ours, **theirs}


def state_bytes(tx, params) -> int:
    shapes = jax.eval_shape(tx.init, params)
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes)))


def time_update(tx, params, grads, steps: int) -> float:
    @jax.jit
    def step(p, s):
        u, s = tx.update(grads, s, p)
        return optax.apply_updates(p, u), s

    state = jax.jit(tx.init)(params)
    p = params
    for _ in range(2):  # compile + one warm step
        p, state = step(p, state)
    jax.block_until_ready(p)
    t0 = time.perf_counter()
    for _ in range(steps):
        p, state = step(p, state)
    jax.block_until_ready(p)
    return (time.perf_counter() - t0) / steps


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("bench_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/dense135m.py")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated subset of optimizer names")
    a = ap.parse_args()
    cfg = load_config(a.config).model
    shapes = dense.abstract_params(cfg)
    n_params = dense.count_params(shapes)
    keys = iter(jax.random.split(jax.random.key(0), 2 * len(jax.tree.leaves(shapes))))
    rand = lambda s: 0.02 * jax.random.normal(next(keys), s.shape, jnp.float32)  # noqa: E731
    params = jax.tree.map(rand, shapes)
    grads = jax.tree.map(rand, shapes)

    txs = candidates()
    if a.only:
        keep = set(a.only.split(","))
        txs = {k: v for k, v in txs.items() if k in keep or k == "adamw"}
    results = {}
    for name, tx in txs.items():
        results[name] = (time_update(tx, params, grads, a.steps), state_bytes(tx, params) / n_params)
        print(f"  measured {name}: {results[name][0] * 1e3:.1f} ms/update", flush=True)

    base = results["adamw"][0]
    print(f"\nbackend={jax.default_backend()}  model={a.config} ({n_params:,} params)  steps={a.steps}")
    print(f"{'optimizer':<20} {'ms/update':>10} {'vs adamw':>9} {'vs optax':>9} {'state B/param':>14}")
    pairs = {"adamw": "optax.adamw", "muon": "optax.contrib.muon", "adan": "optax.adan", "lion": "optax.lion"}
    for name, (t, b) in results.items():
        ref = pairs.get(name)
        vs_optax = f"{t / results[ref][0]:.2f}" if ref in results else "-"
        print(f"{name:<20} {t * 1e3:>10.1f} {t / base:>9.2f} {vs_optax:>9} {b:>14.2f}")


if __name__ == "__main__":
    main()
