"""Cost of one optimizer update on the real SmolLM2-135M parameter shapes.

Params and gradients are random (no training): what is measured is the optimizer alone. For each
optimizer this prints, measured side by side in one run:
- the time of one jitted ``update + apply_updates``, as a ratio to AdamW's (and, where optax ships
  the same method, to optax's implementation), each pair timed in alternating rounds;
- the optimizer-state memory in bytes per parameter (from ``jax.eval_shape``, nothing allocated).

Times average over ``--steps`` updates after a warm-up, so SOAP's periodic basis refresh is
amortised as in training (keep ``--steps`` a multiple of its precondition frequency, 10).

    python -m experiments.bench_optimizers [--config configs/dense135m.py] [--steps 10] [--layers N]
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
from experiments import records

LR = 1e-3


def _optax_muon_dims(params):
    """optax's Muon on the same hidden matrices as ours (stacked: batch over the layer axis)."""
    labels = optim.label_params(params)
    dims = lambda p, lab: (  # noqa: E731
        optax.contrib.MuonDimensionNumbers(reduction_axis=p.ndim - 2, output_axis=p.ndim - 1)
        if lab == "hidden" else None
    )
    return jax.tree.map(dims, params, labels)


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
        "optax.contrib.muon": optax.contrib.muon(LR, muon_weight_dimension_numbers=_optax_muon_dims),
        "optax.adan": optax.adan(LR),
        "optax.lion": optax.lion(LR),
    }
    return {**ours, **theirs}


def state_bytes(tx, params) -> int:
    shapes = jax.eval_shape(tx.init, params)
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes)))


class Runner:
    """One optimizer's compiled update and live state, timed ``steps`` updates at a time."""

    def __init__(self, tx, params, grads):
        @jax.jit
        def step(p, s, g):  # g is an argument: closed over, XLA would constant-fold the update
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        self.step, self.grads = step, grads
        self.params, self.state = params, jax.jit(tx.init)(params)
        self.time(2)  # compile + one warm step

    def time(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.params, self.state = self.step(self.params, self.state, self.grads)
        jax.block_until_ready(self.params)
        return (time.perf_counter() - t0) / steps


def side_by_side(a: Runner, b: Runner, steps: int, rounds: int) -> tuple[float, float]:
    """Median seconds per update of ``a`` and ``b``, measured in alternating rounds."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(a.time(steps))
        tb.append(b.time(steps))
    return float(np.median(ta)), float(np.median(tb))


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("bench_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/dense135m.py")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated subset of optimizer names")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (same matrix shapes, less "
                    "memory: SOAP at all 30 dense135m layers holds ~14 GB here)")
    ap.add_argument("--record", default="", metavar="FILE.jsonl",
                    help="append the figures, command, commit, date and hardware as one JSON line to this file "
                         "(experiments/results/bench/bench_optimizers.jsonl renders docs/optimizers.md's table)")
    a = ap.parse_args()
    cfg = load_config(a.config).model
    if a.layers:
        cfg.n_layers = a.layers
    shapes = dense.abstract_params(cfg)
    n_params = dense.count_params(shapes)
    keys = iter(jax.random.split(jax.random.key(0), 2 * len(jax.tree.leaves(shapes))))
    rand = lambda s: 0.02 * jax.random.normal(next(keys), s.shape, jnp.float32)  # noqa: E731
    params = jax.tree.map(rand, shapes)
    grads = jax.tree.map(rand, shapes)

    txs = candidates()
    ours = [k for k in txs if not k.startswith("optax")]
    if a.only:
        ours = [k for k in ours if k in a.only.split(",")]
    pairs = {"adamw": "optax.adamw", "muon": "optax.contrib.muon", "adan": "optax.adan", "lion": "optax.lion"}
    base = Runner(txs["adamw"], params, grads)
    rows = []
    # Only two optimizer states live at a time: SOAP's alone is ~30 bytes per parameter.
    for name in ours:
        mine = Runner(txs[name], params, grads)
        t_base, t_mine = side_by_side(base, mine, a.steps, a.rounds)
        vs_optax = "-"
        if name in pairs:
            theirs = Runner(txs[pairs[name]], params, grads)
            t_m, t_o = side_by_side(mine, theirs, a.steps, a.rounds)
            vs_optax = f"{t_m / t_o:.2f}"
            del theirs
        rows.append((name, t_mine, t_mine / t_base, vs_optax, state_bytes(txs[name], params) / n_params))
        print(f"  measured {name}", flush=True)
        del mine

    print(f"\nbackend={jax.default_backend()}  model={a.config} ({n_params:,} params)  "
          f"median of {a.rounds} rounds x {a.steps} updates")
    print(f"{'optimizer':<10} {'ms/update':>10} {'vs adamw':>9} {'vs optax':>9} {'state B/param':>14}")
    for name, t, r, vo, b in rows:
        print(f"{name:<10} {t * 1e3:>10.1f} {r:>9.2f} {vo:>9} {b:>14.2f}")
    if a.record:
        records.append(a.record, records.make("bench_optimizers", {
            "shape": f"{a.config} ({n_params:,} params" + (f", {a.layers} layers)" if a.layers else ")"),
            "rounds": a.rounds, "updates_per_round": a.steps,
            "rows": {name: {"time_vs_adamw": r, "time_vs_optax": None if vo == "-" else float(vo),
                            "optax_reference": pairs.get(name), "state_bytes_per_param": b, "s_per_update": t}
                     for name, t, r, vo, b in rows}}))


if __name__ == "__main__":
    main()
