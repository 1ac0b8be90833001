"""The factor screen: what makes the delay gap large?  The ``cpu_regime`` contrast (AdamW's and Muon's
delay gap, and error feedback's share of it) along the axes the updates ladder holds fixed.

Each cell is the ``cpu_regime`` run (3,200 updates in the paper's schedule shape) with one factor
changed, in the issue's order of priority:

- **width** (``width=128/256/512``): d_model 128 -> 256 -> 512 at 4 layers, heads and the MLP
  scaled with it (0.76M -> 3.0M -> 11.7M parameters), the same 819,200 byte tokens.  The μP
  argument (Yang et al. 2022) predicts that at a tuned learning rate AdamW's per-coordinate step
  moves a wider matrix further in spectral norm, Muon's orthogonalized step does not, so AdamW's
  delay cost may grow with width and Muon's may not.
- the ladder's rungs under this protocol (``updates=200/800``: the same tokens in fewer, larger
  updates) and the 3,200-update run at the 200-update rung's absolute warmup (``warmup=20``), to
  separate warmup from the number of updates;
- **tokens per update** (``seqs=8/32``): 3,200 updates of 8 and 32 sequences, the last at ~17
  tokens per parameter;
- **vocabulary** (``vocab=bpe4096``): a byte-level BPE of 4,096 tokens trained on the train
  split (:func:`bpe_tokenizer`) against bytes, in nats/byte.

Per cell: AdamW and Muon (:data:`OPTIMIZERS`, the contrast), each sync, 2bw and 2bw + EF, every arm
tuned on its own grid under :mod:`experiments.protocol` (tuning seeds :data:`TUNE_SEEDS` per cell,
measured at seeds 0-2, 3-4 where the gap is unresolved, a test split on every run).  The width=128
cell is also the ``optimizers`` comparison under that protocol: it holds SOAP (with EF, as the
paper's Table 2), Adan, Lion and MARS-AdamW (sync and 2bw) too (:data:`MORE_OPTIMIZERS`), which the
screen runs after every cell's contrast.  A cell's arms are the keys of its grid guesses (:func:`arms`).  ``python -m experiments.screen`` runs the
queue (:data:`QUEUE`) in order, resumably; to fit the budget (:data:`SCREEN_HOURS`), every cell
after width=128 tunes on one seed and the cells in :data:`CUT` are not queued.

Variants: ``CELL/OPT/lr=VALUE/ARM`` in two studies, ``factors_tune`` (the tuning seeds) and
``factors`` (the measurement seeds).
"""

from __future__ import annotations

import os
import pathlib

from experiments import protocol
from experiments.studies import lr as lr_study
from experiments.studies.common import lr_centre, optimizer, regime_rung
from experiments.study import Study

CONFIG = "configs/tiny.py"
OPTIMIZERS = ("adamw", "muon")  # the contrast every cell measures: G_AdamW / G_Muon
ARMS = ("sync", "2bw", "ef")
MORE_OPTIMIZERS = ("soap", "adan", "lion", "mars")  # the rest of the optimizers study, at width=128 only
BPE_VOCAB = 4096


def width(d: int) -> dict:
    """The ``cpu_regime`` body at width ``d``: heads of 32 dimensions (half as many KV heads), MLP 2.6875 d."""
    return {"model.d_model": d, "model.n_heads": d // 32, "model.n_kv_heads": d // 64, "model.d_ff": 344 * d // 128}


def parameters(cell: str) -> int:
    """The cell's model parameters: :data:`CONFIG` with the cell's ``model.*`` overrides (not through
    ``sweep.run_config``, which would need a whole run and import the sweep that loads this module)."""
    from asyncpp_jax import configs
    from asyncpp_jax.models import dense

    c = configs.load_file(CONFIG)
    for key, value in CELLS[cell][0].items():
        if key.startswith("model."):
            c.model[key.split(".", 1)[1]] = value
    return dense.count_params(dense.abstract_params(c.model))


def tokenizer_path() -> pathlib.Path:
    cache = os.environ.get("ASYNCPP_JAX_CACHE") or os.path.expanduser("~/.cache/asyncpp_jax")
    return pathlib.Path(cache) / "tokenizers" / f"stdlib-train-bpe{BPE_VOCAB}.json"


def bpe_tokenizer(log=print) -> str:
    """The vocabulary cell's tokenizer: ``asyncpp_jax.data.tokenizers.train_bpe`` at :data:`BPE_VOCAB`
    on the stdlib corpus's train documents only (the split ``data.sources.assign_splits`` makes at
    the config's defaults), saved once under the cache; returns its path."""
    path = tokenizer_path()
    if not path.exists():
        from asyncpp_jax import configs
        from asyncpp_jax.data.sources import assign_splits, list_stdlib_files
        from asyncpp_jax.data.tokenizers import train_bpe

        d = configs.base_config().data
        listing = list_stdlib_files()
        is_val = assign_splits(listing.names, d.val_fraction, d.split_seed)
        texts = (open(p, encoding="utf-8", errors="replace").read()
                 for p, val in zip(listing.paths, is_val) if not val)
        path.parent.mkdir(parents=True, exist_ok=True)
        train_bpe(texts, BPE_VOCAB, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        log(f"factors: trained a BPE of {BPE_VOCAB} tokens on the stdlib train split -> {path}")
    return str(path)


def _cell(batch: int = 2, updates: int = 3200, **extra) -> dict:
    base = {**regime_rung(batch, updates), **extra}
    base["train.test_batches"] = protocol.TEST_SEQUENCES // batch
    return base


# cell -> (overrides, tuning seeds, {(opt, arm): k0}): k0 is the starting lattice point of the arm's
# grid around lr.grid's centre at the cell's batch (common.lr_centre), a guess from the seed-0 picks
# of the cpu_regime studies: AdamW's one lattice step (sqrt 3) lower per doubling of width (its
# per-coordinate step does not shrink with width), Muon's unchanged (Moonlight's RMS matching).
_K128 = {("adamw", "sync"): 0, ("adamw", "2bw"): -1, ("adamw", "ef"): -1,
         ("muon", "sync"): -1, ("muon", "2bw"): 0, ("muon", "ef"): 0}


# SOAP, Adan, Lion and MARS at width=128: the same guesses from the seed-0 picks of the cpu_regime
# `optimizers` study (common.TUNED_ARMS), EF only for the optimizers of the paper's Table 2
# (studies.optimizers.EF_NAMES).
_K128_MORE = {("soap", "sync"): -1, ("soap", "2bw"): -1, ("soap", "ef"): 0,
              ("adan", "sync"): 0, ("adan", "2bw"): 0,
              ("lion", "sync"): 2, ("lion", "2bw"): 1,
              ("mars", "sync"): 1, ("mars", "2bw"): 0}


def _shift(ks: dict, adamw: int, muon: int = 0) -> dict:
    return {(o, a): k + (adamw if o == "adamw" else muon) for (o, a), k in ks.items()}


# Every cell after width=128 tunes on one seed: the screen is sized to SCREEN_HOURS (below), and a
# second tuning seed would double a cell's tuning runs to sharpen a pick whose loss is measured on
# other seeds anyway.
CELLS = {
    "width=128": (_cell(), protocol.TUNE_SEEDS, {**_K128, **_K128_MORE}),
    "width=256": (_cell(**width(256)), protocol.TUNE_SEEDS[:1], _shift(_K128, -1)),
    "width=512": (_cell(**width(512)), protocol.TUNE_SEEDS[:1], _shift(_K128, -2)),
    "updates=800": (_cell(8, 800), protocol.TUNE_SEEDS[:1],
                    {("adamw", "sync"): 0, ("adamw", "2bw"): -2, ("adamw", "ef"): 0,
                     ("muon", "sync"): -2, ("muon", "2bw"): -2, ("muon", "ef"): -2}),
    "updates=200": (_cell(32, 200), protocol.TUNE_SEEDS[:1],
                    {("adamw", "sync"): 0, ("adamw", "2bw"): -3, ("adamw", "ef"): -3,
                     ("muon", "sync"): -1, ("muon", "2bw"): -2, ("muon", "ef"): -2}),
    # the 3,200-update run warmed up over the 200-update rung's 20 updates instead of 320
    "warmup=20": (_cell(**{"optimizer.warmup_steps": 20}), protocol.TUNE_SEEDS[:1], _K128),
    "seqs=8": (_cell(8), protocol.TUNE_SEEDS[:1],
               {("adamw", "sync"): -1, ("adamw", "2bw"): -2, ("adamw", "ef"): -2,
                ("muon", "sync"): -2, ("muon", "2bw"): -2, ("muon", "ef"): -2}),
    "vocab=bpe4096": (_cell(**{"data.tokenizer": "BPE", "model.vocab_size": BPE_VOCAB}), protocol.TUNE_SEEDS[:1],
                      _K128),
    "seqs=32": (_cell(32), protocol.TUNE_SEEDS[:1],
                {("adamw", "sync"): -1, ("adamw", "2bw"): -3, ("adamw", "ef"): -3,
                 ("muon", "sync"): -2, ("muon", "2bw"): -3, ("muon", "ef"): -3}),
}
# The cell that also holds the rest of the optimizers study (MORE_OPTIMIZERS): the cpu_regime run itself.
OPTIMIZERS_CELL = next(c for c, (_, _, k0) in CELLS.items() if any(o in MORE_OPTIMIZERS for o, _ in k0))
# The screen's budget: about this many hours of wall time on 2 cores (`--jobs 2`), all cells
# together.  The pilot (`python -m experiments.screen --pilot`, rendered in docs/studies.md) prices
# every cell; the cells that do not fit beside the queue are cut and stay defined, so
# `--cells` can still run it where more CPU is at hand.
SCREEN_HOURS = 12
CUT = {
    "width=512": "with the queued cells it would take the screen well past its budget; model size is left to "
                 "the GPU plan, which prices it at the paper's scale",
    "seqs=32": "its runs are the screen's costliest (16x width=128's tokens): the cell alone would take more "
               "than the whole budget",
}
# The order the screen runs the cells in: the width axis first (the hypothesis), then the ladder under
# this protocol, tokens per update, vocabulary.
QUEUE = ("width=128", "width=256", "updates=800", "updates=200", "warmup=20", "seqs=8", "vocab=bpe4096")
ORDER = QUEUE + tuple(CUT)  # every cell, in the order the report and the docs list them


def arms(cell: str) -> list[tuple[str, str]]:
    """``cell``'s arms as ``(optimizer, arm)``: the contrast's first, each optimizer's in :data:`ARMS` order."""
    k0 = CELLS[cell][2]
    opts = OPTIMIZERS + tuple(o for o in MORE_OPTIMIZERS if any(k[0] == o for k in k0))
    return [(o, a) for o in opts for a in ARMS if (o, a) in k0]


def optimizers_of(cell: str) -> list[str]:
    """The optimizers ``cell`` measures, the contrast's first."""
    return list(dict.fromkeys(o for o, _ in arms(cell)))


def overrides(cell: str, opt: str, arm: str, lr_value: float) -> dict:
    base = dict(CELLS[cell][0])
    if base.get("data.tokenizer") == "BPE":
        base["data.tokenizer"] = str(tokenizer_path())
    return {**base, **optimizer(opt, "cpu_regime"), "optimizer.lr": lr_value, **lr_study.ARMS[arm]}


def centre(cell: str, opt: str) -> float:
    return lr_centre(opt, CELLS[cell][0]["train.global_batch_size"])


def variant(cell: str, opt: str, arm: str, lr_value: float) -> str:
    return f"{cell}/{opt}/lr={lr_value:g}/{arm}"


def study_of(name: str, cell: str, entries, seeds) -> Study:
    """A study (``factors_tune`` or ``factors``) of ``cell``'s ``(opt, arm, lr)`` entries at ``seeds``."""
    return Study(name, CONFIG, {variant(cell, o, a, v): overrides(cell, o, a, v) for o, a, v in entries},
                 seeds=tuple(seeds))


def tune_means(rows, cell: str, opt: str, arm: str, seeds) -> dict[float, float | None]:
    """``{lr: mean final val over the tuning seeds (None if one diverged)}`` for the learning rates
    whose runs at every tuning seed are done."""
    by_lr: dict = {}
    for r in rows:
        parsed = r["variant"].split("/")
        if parsed[0] == cell and parsed[1] == opt and parsed[3] == arm and r["seed"] in seeds:
            by_lr.setdefault(float(r["overrides"]["optimizer.lr"]), {})[r["seed"]] = r.get("final_val")
    out = {}
    for lr_value, vals in by_lr.items():
        if set(vals) >= set(seeds):
            finite = [v for v in vals.values() if v is not None]
            out[lr_value] = sum(finite) / len(finite) if len(finite) == len(vals) else None
    return out


def tuning_state(cell: str, opt: str, arm: str, tune_rows) -> tuple[list[float], float | None]:
    """``(grid, pick)`` of an arm from the tuning rows so far (:func:`experiments.protocol.tune_state`)."""
    _, seeds, k0 = CELLS[cell]
    return protocol.tune_state(centre(cell, opt), k0[(opt, arm)], tune_means(tune_rows, cell, opt, arm, seeds))


def study(preset: str) -> Study:
    raise ValueError("the factors screen picks each arm's learning rate from its own tuning runs as they "
                     "finish; run it with `python -m experiments.screen` (it resumes where it stopped)")
