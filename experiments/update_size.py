"""How far one update moves each hidden matrix, at the factor screen's tuned learning rates.

    python -m experiments.update_size [--cells width=128,width=256] [--steps N] [--every 160] [--seed 0] [--no-fixed-lr]

Under a one-step delay (PipeDream-2BW) the gradient applied at update t+1 was computed on W_{t-1},
so the weights it is stale by are exactly the last update: W_t - W_{t-1}.  The μP argument
(Yang et al. 2022, "Tensor Programs V") predicts that, at a fixed learning rate, AdamW's
per-coordinate step moves a wider matrix further relative to its size, while Muon's orthogonalized
step (Jordan et al. 2024) has a spectral norm set by the learning rate alone.  The factor screen
asks whether that makes AdamW's delay gap grow with width; this measures the premise directly.

For each cell and optimizer, the ``2bw`` arm at its pick from the ``factors_tune`` rows
(:func:`experiments.studies.factors.tuning_state`), and in the later cells also at the first
cell's pick (the premise's fixed learning rate), on measurement seed ``--seed``, trains its first
``--steps`` updates (by default the whole run: the gap is measured at its end) and, every ``--every`` updates,
takes for every layer's attention (q, k, v, o) and MLP (gate, up, down) kernel the relative
spectral step

    r_t = ||W_{t+1} - W_t||_2 / ||W_t||_2

(the largest singular value, float64 on the host), and the update's stable rank
(:func:`stable_rank`).  Prints the median over the sampled updates of
the mean over layers and kernels (and per kernel), and the ratios between widths and between
optimizers; appends a record to ``experiments/results/bench/update_size.jsonl`` (``--no-record`` to
skip), which ``python -m experiments.render_docs`` renders in docs/studies.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile

import numpy as np

KERNELS = (("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "o"), ("mlp", "gate"), ("mlp", "up"), ("mlp", "down"))
RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "cpu_regime" / "results.jsonl"


def spectral_norms(stack: np.ndarray) -> np.ndarray:
    """The largest singular value of each matrix of a ``[L, m, n]`` stack (float64)."""
    return np.linalg.norm(np.asarray(stack, np.float64), ord=2, axis=(-2, -1))


def relative_step(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """``||after - before||_2 / ||before||_2`` per matrix of a ``[L, m, n]`` stack."""
    before = np.asarray(before, np.float64)
    return spectral_norms(np.asarray(after, np.float64) - before) / spectral_norms(before)


def stable_rank(stack: np.ndarray) -> np.ndarray:
    """``||X||_F^2 / ||X||_2^2`` per matrix of a ``[L, m, n]`` stack: between 1 (rank one) and its rank.
    μP's argument has an update of a wide matrix nearly low-rank (aligned with its inputs), which is
    what makes its spectral norm grow with width under a per-coordinate step; a sign-like step of
    high stable rank behaves like a random matrix, whose norm grows as the weights' do."""
    stack = np.asarray(stack, np.float64)
    return np.square(stack).sum(axis=(-2, -1)) / np.square(spectral_norms(stack))


def hidden_kernels(params) -> dict[str, np.ndarray]:
    """``{"attn/q": [L, in, out], ...}``: the hidden matrices of the dense model's layer stack, on the host."""
    layers = params["layers"]
    return {f"{block}/{name}": np.asarray(layers[block][name]["kernel"]) for block, name in KERNELS}


def pick_of(cell: str, opt: str, tune_rows) -> float:
    """The tuned learning rate of ``cell``'s ``opt`` 2bw arm."""
    from experiments.studies import factors

    _, pick = factors.tuning_state(cell, opt, "2bw", tune_rows)
    if pick is None:
        raise SystemExit(f"update_size: {cell} {opt} 2bw has no pick yet in {RESULTS}; run the screen's tuning first")
    return pick


def arm_config(cell: str, opt: str, lr: float, seed: int):
    """The resolved config of ``cell``'s ``opt`` 2bw arm at learning rate ``lr`` and ``seed``."""
    from experiments import study as study_lib
    from experiments import sweep
    from experiments.studies import factors

    s = factors.study_of("factors", cell, [(opt, "2bw", lr)], [seed])
    (run,) = study_lib.expand(s)
    return sweep.run_config(s, run)


def measure(config, steps: int, every: int) -> tuple[list[int], dict[str, list[float]], dict[str, list[float]]]:
    """The sampled updates ``t``, ``{kernel: [mean over layers of r_t at each]}`` and the same of the
    update's stable rank, over the first ``steps`` updates."""
    from asyncpp_jax.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as workdir:
        t = Trainer(config, workdir)
        try:
            if t.pipelined:
                raise SystemExit("update_size reads the dense model's params; the screen's runs are not pipelined")
            state, iterator = t.restore_or_init()
            out: dict[str, list[float]] = {k: [] for k in (f"{b}/{n}" for b, n in KERNELS)}
            ranks: dict[str, list[float]] = {k: [] for k in out}
            sampled: list[int] = []
            for step in range(steps):
                batch = t.batch_layout.assemble(next(iterator))
                # the updates that end at a multiple of `every` (not update 1: warmup's first learning rate is 0)
                before = hidden_kernels(state.params) if (step + 1) % every == 0 else None  # the step donates the state
                state, metrics = t.train_step(state, batch)
                if before is not None:
                    after = hidden_kernels(state.params)
                    sampled.append(step + 1)
                    for k in out:
                        out[k].append(float(relative_step(before[k], after[k]).mean()))
                        ranks[k].append(float(stable_rank(after[k] - np.asarray(before[k], np.float64)).mean()))
                    loss = float(metrics["loss"])
                    if not np.isfinite(loss):
                        raise SystemExit(f"update_size: the loss is {loss} at update {step + 1}")
        finally:
            t.close()
            t.release_workdir()
    return sampled, out, ranks


def summary(series: dict[str, list[float]], sampled: list[int] | None = None, ranks=None) -> dict:
    """Median over sampled updates, per kernel and of the mean over kernels; with ``sampled``, also
    the mean over kernels at each sampled update; with ``ranks`` (as ``series``), the median of the
    update's stable rank averaged over kernels."""
    per_kernel = {k: statistics.median(v) for k, v in series.items()}
    mean = np.mean([series[k] for k in series], axis=0).tolist()
    out = {"median_relative_step": statistics.median(mean), "per_kernel": per_kernel}
    if ranks is not None:
        out["median_stable_rank"] = statistics.median(np.mean([ranks[k] for k in ranks], axis=0).tolist())
    if sampled is not None:
        out["series"] = [[t, round(m, 6)] for t, m in zip(sampled, mean)]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="width=128,width=256")
    ap.add_argument("--optimizers", default="adamw,muon")
    ap.add_argument("--steps", type=int, default=0, help="updates trained per run (0: the whole run)")
    ap.add_argument("--every", type=int, default=160, help="sample the step every this many updates")
    ap.add_argument("--seed", type=int, default=0, help="a measurement seed (the picks come from the tuning seeds)")
    ap.add_argument("--no-fixed-lr", dest="fixed_lr", action="store_false",
                    help="skip the later cells' runs at the first cell's learning rate")
    ap.add_argument("--no-record", dest="record", action="store_false")
    a = ap.parse_args(argv)
    if a.steps < 0 or a.every < 1:
        raise SystemExit("update_size: --steps must be 0 (the whole run) or more, --every at least 1")
    from experiments.studies import factors

    cells, opts = a.cells.split(","), a.optimizers.split(",")
    unknown = [c for c in cells if c not in factors.CELLS] + [o for o in opts if o not in factors.OPTIMIZERS]
    if unknown:
        raise SystemExit(f"update_size: unknown {', '.join(unknown)}; --cells takes {', '.join(factors.CELLS)} and "
                         f"--optimizers {', '.join(factors.OPTIMIZERS)}")
    tune_rows = [r for r in map(json.loads, RESULTS.read_text().splitlines()) if r["study"] == "factors_tune"]
    if any(factors.CELLS[c][0].get("data.tokenizer") == "BPE" for c in cells):
        factors.bpe_tokenizer()  # the vocabulary cell's runs read it from the cache; trained once, as the screen does
    figures = {}
    for opt in opts:
        first = pick_of(cells[0], opt, tune_rows)
        for cell in cells:
            pick = pick_of(cell, opt, tune_rows)
            # each arm at its own pick; the later cells also at the first cell's, which isolates width
            for key, lr in [(f"{cell}/{opt}", pick)] + ([(f"{cell}/{opt}/lr={first:g}", first)]
                                                        if a.fixed_lr and cell != cells[0] and pick != first else []):
                config = arm_config(cell, opt, lr, a.seed)
                steps = a.steps or config.train.steps
                sampled, series, ranks = measure(config, steps, a.every)
                s = summary(series, sampled, ranks)
                figures[key] = {"lr": lr, "steps": steps, "of": config.train.steps, **s}
                print(f"{key} 2bw at lr {lr:g}: median ||dW||_2/||W||_2 = {s['median_relative_step']:.4g}, "
                      f"stable rank of dW {s['median_stable_rank']:.3g} "
                      f"({', '.join(f'{k} {v:.3g}' for k, v in s['per_kernel'].items())})", flush=True)
    for ratio, text in ratios(figures).items():
        print(f"{ratio}: {text:.3g}")
    if a.record:
        from experiments import records

        records.append(records.BENCH_DIR / "update_size.jsonl",
                       records.make("update_size", figures, every=a.every, seed=a.seed))


def ratios(figures: dict) -> dict[str, float]:
    """AdamW's step over Muon's per cell (at their picks), and each optimizer's step at a later cell
    over its step at the first cell: at its own pick, and at the first cell's learning rate."""
    cells = list(dict.fromkeys(k.split("/")[0] for k in figures))
    opts = list(dict.fromkeys(k.split("/")[1] for k in figures))
    step = {k: v["median_relative_step"] for k, v in figures.items()}
    out = {}
    for cell in cells:
        if f"{cell}/adamw" in step and f"{cell}/muon" in step:
            out[f"{cell}: adamw / muon"] = step[f"{cell}/adamw"] / step[f"{cell}/muon"]
    for opt in opts:
        first = f"{cells[0]}/{opt}"
        for cell in cells[1:]:
            if f"{cell}/{opt}" in step and first in step:
                out[f"{opt}: {cell} / {cells[0]}"] = step[f"{cell}/{opt}"] / step[first]
            fixed = f"{cell}/{opt}/lr={figures[first]['lr']:g}" if first in figures else None
            if fixed in step:
                out[f"{opt}: {cell} / {cells[0]} at lr {figures[first]['lr']:g}"] = step[fixed] / step[first]
    return out


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
