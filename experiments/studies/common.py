"""Presets shared by the studies.

``cpu_regime``: the paper's regime at CPU size: the ``cpu`` preset's model (0.76M parameters)
trained with many small updates (3,200 updates of 2 x 128 byte tokens), the paper's schedule shape
(warmup over 10% of the updates, cosine to 10% of the peak, weight decay 0.1, clip 1.0).  ``cpu``:
the few-update regime, kept as a study of its own: the same model, 200 updates of 16 x 128 tokens.  ``gpu``: the SmolLM2-135M shape (``configs/dense135m.py``)
on the offline corpus with the byte tokenizer, sized so one run (one variant, one seed) takes about
an hour on one H100 (see :data:`GPU_NOTE`).  ``paper``: the SmolLM2-360M shape for the headline
studies (optimizers, mitigations), SmolLM2-135M for the sweeps (momentum, schemes, sensitivity),
on FineWeb-Edu through the prepare step with the SmolLM2 tokenizer (its tokenizer.json path in
``ASYNCPP_TOKENIZER``).

Learning rates: :func:`optimizer` takes each optimizer's peak learning rate from ``TUNED_LR[preset]``
when the preset has a tuned table (picked by the ``lr`` study, :mod:`experiments.tuning`), else from
the untuned defaults ``LR``.  The ``lr`` study itself always sweeps around ``LR``.
"""

from __future__ import annotations

import os

# 0.76M parameters (759,040), 200 updates of 16 x 128 byte tokens (409,600 tokens, 0.54 per parameter)
# with a cosine to 10% of the peak: about 100 s per run on one core (`--jobs 2` on 2 cores).  Sized
# so a synchronous run ends >= 1 nat/byte below the corpus's unigram entropy (3.25) with its
# validation loss flat over the last 10% of updates; validation every 20 updates for the gap over
# training.
CPU = {
    "model.d_model": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 344,
    "data.seq_len": 128, "train.global_batch_size": 16, "train.steps": 200, "train.eval_every": 20,
    "train.eval_batches": 8, "train.checkpoint_every": 200, "optimizer.warmup_steps": 20,
}
CPU_SEEDS = (0, 1, 2)
CPU_NOTE = "about 100 s per run on one CPU core; --jobs 2 runs two at once on 2 cores"

# One run = 5000 updates of 128 x 2048 byte tokens (1.31e9 tokens) of the dense135m body with a
# byte vocabulary (106,351,488 parameters): asyncpp_jax.models.flops gives 1.063e9 model FLOPs per
# token, so 1.39e18 per run, 0.98 H100-hours at 40% MFU of 989 bf16 TFLOP/s.  The offline corpus is
# the Python standard library (~30M train bytes): a run repeats it ~44 times, so the validation loss
# is that of a heavily repeated corpus.  ASYNCPP_GPU_SOURCE points the preset at a larger local text
# corpus (a glob or directory; still the byte tokenizer, so no other setting changes).
GPU = {
    "data.source": os.environ.get("ASYNCPP_GPU_SOURCE", "stdlib"),
    "data.tokenizer": "byte", "model.vocab_size": 257, "model.compute_dtype": "bfloat16", "model.remat": True,
    "data.seq_len": 2048, "train.global_batch_size": 128, "train.microbatches": 2, "train.steps": 5000,
    "train.eval_every": 500, "train.eval_batches": 16, "train.checkpoint_every": 1000,
    "optimizer.warmup_steps": 250, "train.peak_tflops_per_device": 989.0,
}
GPU_SEEDS = (0, 1, 2)
GPU_NOTE = ("dense135m body, byte vocabulary (106.4M parameters), 5000 x 128 x 2048 = 1.31e9 tokens per run: "
            "1.39e18 model FLOPs, ~1.0 H100-hour at 40% MFU; the offline stdlib corpus repeats ~44 times "
            "(ASYNCPP_GPU_SOURCE for a larger one); learning rates untuned (common.LR)")

# The paper's regime at CPU size.  A one-step delay costs about as much as one update moves the
# weights, so what matters is the number of updates, not the tokens: the paper's small models take
# ~10^4 updates.  Here the `cpu` model takes 3,200 updates of 2 x 128 byte tokens (819,200 tokens,
# 1.08 per parameter: the paper's 20 would be 15.2M tokens, ~19x this run's cost), warmup over the
# first 10% of the updates, cosine to 10% of the peak, weight decay 0.1, clip 1.0 (the config
# defaults), validation every 10% of the run on the same 256 held-out sequences at every rung of
# the `ladder` study (eval_batches x batch = 256).
REGIME_MODEL = {k: v for k, v in CPU.items() if k.startswith("model.")}
REGIME_SEQUENCES_EVAL = 256


def regime_rung(batch: int, updates: int) -> dict:
    """The `cpu_regime` model at ``updates`` updates of ``batch`` x 128 tokens, in the paper's schedule shape."""
    return {**REGIME_MODEL, "data.seq_len": 128, "train.global_batch_size": batch, "train.steps": updates,
            "optimizer.warmup_steps": updates // 10, "optimizer.schedule": "cosine", "optimizer.min_lr_ratio": 0.1,
            "optimizer.weight_decay": 0.1, "optimizer.grad_clip": 1.0,
            "train.eval_every": updates // 10, "train.eval_batches": REGIME_SEQUENCES_EVAL // batch,
            "train.checkpoint_every": updates // 4}


CPU_REGIME = regime_rung(2, 3200)
CPU_REGIME_SEEDS = (0, 1, 2)
CPU_REGIME_NOTE = ("cpu model, 3,200 updates of 2 x 128 byte tokens (819,200 tokens, 1.08 per parameter), warmup "
                   "10%, cosine to 10%: about 2 min per run on one CPU core; --jobs 2 runs two at once")

PAPER = {
    "data.source": "hf:HuggingFaceFW/fineweb-edu:sample-10BT",
    "data.tokenizer": os.environ.get("ASYNCPP_TOKENIZER", "tokenizer.json"),
    "train.steps": 20000,
}
PAPER_SEEDS = (0, 1, 2)
# Model FLOPs per run (asyncpp_jax.models.flops: 6N + attention, 20k updates x 256 x 2048 tokens =
# 10.5B tokens), and H100-hours at 40% MFU of 989 bf16 TFLOP/s.
PAPER_MODELS = {
    "135m": ("configs/dense135m.py", "dense135m, 10.5B tokens per run: 1.29e19 model FLOPs, ~9 H100-hours at 40% MFU"),
    "360m": ("configs/dense360m.py", "dense360m, 10.5B tokens per run: 3.07e19 model FLOPs, ~22 H100-hours at 40% MFU"),
}
PRESETS = ("cpu", "cpu_regime", "gpu", "paper")

# Untuned defaults: one peak learning rate per optimizer (Lion's 10x lower, as its update is a sign).
LR = {"adamw": 3e-3, "muon": 3e-3, "soap": 3e-3, "adan": 3e-3, "lion": 3e-4, "mars": 3e-3}
# Per preset, each optimizer's best synchronous learning rate from that preset's `lr` study
# (experiments.tuning.pick_lrs; tests/test_tuning.py holds the table to its committed evidence).
# A preset without a table (gpu, paper) trains at the untuned LR above.
TUNED_LR = {
    # experiments/results/cpu: the lr study, 2 seeds (python -m experiments.tuning prints these)
    "cpu": {"adamw": 0.003, "muon": 0.016, "soap": 0.009, "adan": 0.0052, "lion": 0.0009, "mars": 0.003},
}
WD = {"lion": 1.0}
# Per preset and study, every arm's learning rate, tuned on one grid per arm ({variant: lr}; see
# experiments/studies/tuned.py): the picks (experiments.tuning.pick_arm_lrs) of the STUDY_tune rows
# committed in experiments/results/<preset>/results.jsonl, which tests/test_regime.py holds it to.
TUNED_ARMS: dict[str, dict[str, dict[str, float]]] = {"cpu_regime": {
    "optimizers": {"adamw/sync": 0.0011, "adamw/2bw": 0.00061, "adamw/ef": 0.00061,
                   "muon/sync": 0.0012, "muon/2bw": 0.002, "muon/ef": 0.002,
                   "soap/sync": 0.0018, "soap/2bw": 0.0018, "soap/ef": 0.0032,
                   "adan/sync": 0.0018, "adan/2bw": 0.0018, "lion/sync": 0.00034, "lion/2bw": 0.00019,
                   "mars/sync": 0.0018, "mars/2bw": 0.0011},
    "momentum": {"adamw/beta=0.8/sync": 0.00061, "adamw/beta=0.8/2bw": 0.0011,
                 "adamw/beta=0.9/sync": 0.0011, "adamw/beta=0.9/2bw": 0.00061,
                 "adamw/beta=0.95/sync": 0.0018, "adamw/beta=0.95/2bw": 0.0011,
                 "adamw/beta=0.98/sync": 0.0011, "adamw/beta=0.98/2bw": 0.0011,
                 "muon/beta=0.8/sync": 0.0035, "muon/beta=0.8/2bw": 0.0035,
                 "muon/beta=0.9/sync": 0.002, "muon/beta=0.9/2bw": 0.002,
                 "muon/beta=0.95/sync": 0.0012, "muon/beta=0.95/2bw": 0.002,
                 "muon/beta=0.98/sync": 0.0012, "muon/beta=0.98/2bw": 0.002},
    "mitigations": {"adamw/sync": 0.0011, "adamw/none": 0.00061, "adamw/ef": 0.00061, "adamw/taylor": 0.00061,
                    "adamw/sync_start": 0.0011, "adamw/sync_cooldown": 0.00061, "adamw/ef+sync_start": 0.0011,
                    "adamw/nesterov": 0.00061, "adamw/weight_prediction": 0.00061,
                    "muon/sync": 0.0012, "muon/none": 0.002, "muon/ef": 0.002, "muon/taylor": 0.0012,
                    "muon/sync_start": 0.002, "muon/sync_cooldown": 0.002, "muon/ef+sync_start": 0.002,
                    "muon/nesterov": 0.002, "muon/weight_prediction": 0.002},
    "schemes": {"adamw/sync": 0.00061, "adamw/2bw": 0.00061, "adamw/pipedream/P=2": 0.00061,
                "adamw/pipedream/P=4": 0.0011, "adamw/pipedream/P=8": 0.00035},
}}
# The ladder's per-arm picks: {'u=UPDATES/OPT': {arm: lr}} from the `ladder_tune` study's rows
# (experiments.tuning.complete_picks; tests/test_regime.py holds the table to the committed rows).
# The `ladder` study refuses to expand until every rung has its picks.
TUNED_LADDER: dict[str, dict[str, float]] = {
    "u=200/adamw": {"sync": 0.0042, "2bw": 0.00082, "ef": 0.00082},
    "u=200/muon": {"sync": 0.018, "2bw": 0.011, "ef": 0.011},
    "u=200/soap": {"sync": 0.0073, "2bw": 0.0042, "ef": 0.0042},
    "u=800/adamw": {"sync": 0.0021, "2bw": 0.00071, "ef": 0.0021},
    "u=800/muon": {"sync": 0.0027, "2bw": 0.0027, "ef": 0.0027},
    "u=800/soap": {"sync": 0.0037, "2bw": 0.0037, "ef": 0.0037},
    "u=3200/adamw": {"sync": 0.0011, "2bw": 0.00061, "ef": 0.00061},
    "u=3200/muon": {"sync": 0.0012, "2bw": 0.002, "ef": 0.002},
    "u=3200/soap": {"sync": 0.0018, "2bw": 0.0018, "ef": 0.0032},
    "u=6400/adamw": {"sync": 0.00061, "2bw": 0.00061, "ef": 0.00061},
    "u=6400/muon": {"sync": 0.0012, "2bw": 0.002, "ef": 0.0012},
    "u=6400/soap": {"sync": 0.0032, "2bw": 0.0018, "ef": 0.0018},
}


# Optimizers whose update has a fixed size whatever the gradient's scale (Muon's orthogonalized
# direction, Lion's sign): their learning rate follows the batch linearly, as SGD's does (Goyal et al.
# 2017, "Accurate, Large Minibatch SGD"); Adam-type updates follow its square root (Malladi et al.
# 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms").  At cpu_regime the square
# root put Muon's grid above its optimum (its best sync run sat on the grid's low edge).
LINEAR_LR_SCALING = ("muon", "lion")


def lr_centre(opt: str, batch: int | None = None) -> float:
    """The centre of ``opt``'s learning-rate grid at a ``cpu_regime`` rung of ``batch`` sequences
    (default: the preset's): its ``cpu`` pick scaled by ``batch / 16`` (:data:`LINEAR_LR_SCALING`) or
    by its square root (the others).  Only the grid's centre: each arm's learning rate is then tuned on it."""
    batch = CPU_REGIME["train.global_batch_size"] if batch is None else batch
    ratio = batch / CPU["train.global_batch_size"]
    return TUNED_LR["cpu"][opt] * (ratio if opt in LINEAR_LR_SCALING else ratio**0.5)


# Per preset, settings beside the learning rate that a study of their own tuned for one optimizer
# (experiments.tuning.pick_lion over the `lion` study's rows; tests/test_tuning.py holds them to it).
# Lion at cpu: the paper's b1 0.9 and the preset's cosine left it short of the preset's aim (see
# experiments/studies/lion.py).
TUNED_SETTINGS = {
    "cpu": {"lion": {"optimizer.lion.b1": 0.7, "optimizer.schedule": "constant"}},
}


def preset(name: str, paper_model: str = "135m") -> tuple[str, dict, tuple, str]:
    """(config file, base overrides, seeds, note) for a name of :data:`PRESETS` (``paper`` at ``paper_model``)."""
    if name == "cpu":
        return "configs/tiny.py", dict(CPU), CPU_SEEDS, CPU_NOTE
    if name == "cpu_regime":
        return "configs/tiny.py", dict(CPU_REGIME), CPU_REGIME_SEEDS, CPU_REGIME_NOTE
    if name == "gpu":
        return "configs/dense135m.py", dict(GPU), GPU_SEEDS, GPU_NOTE
    if name == "paper":
        config, note = PAPER_MODELS[paper_model]
        return config, dict(PAPER), PAPER_SEEDS, note + "; learning rates untuned (common.LR)"
    raise ValueError(f"unknown preset {name!r}; choose one of {PRESETS}")


def lr_of(name: str, preset_name: str | None) -> float:
    """``name``'s peak learning rate at ``preset_name``: the tuned one if that preset has a table, else LR's."""
    return TUNED_LR.get(preset_name, LR)[name]


def optimizer(name: str, preset_name: str | None) -> dict:
    """The overrides that select optimizer ``name`` at its learning rate for ``preset_name``
    (:func:`lr_of`; ``None``: the untuned default), its weight decay, and the settings tuned for it
    at that preset (:data:`TUNED_SETTINGS`)."""
    out = {"optimizer.name": name, "optimizer.lr": lr_of(name, preset_name)}
    if name in WD:
        out["optimizer.weight_decay"] = WD[name]
    out.update(TUNED_SETTINGS.get(preset_name, {}).get(name, {}))
    return out
