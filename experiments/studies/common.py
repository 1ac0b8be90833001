"""Presets shared by the studies.

``cpu``: the tiny byte-level model, shortened so one run takes about a minute on 2 CPU cores
(d_model 128, 4 layers, seq 64, batch 16, 150 updates).  ``paper``: SmolLM2-135M shapes on
FineWeb-Edu through the prepare step, with the SmolLM2 tokenizer; pass its path in
``ASYNCPP_TOKENIZER`` (a tokenizer.json).
"""

from __future__ import annotations

import os

CPU = {
    "model.d_model": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 344,
    "data.seq_len": 64, "train.global_batch_size": 16, "train.steps": 150, "train.eval_every": 50,
    "train.eval_batches": 8, "train.checkpoint_every": 150, "optimizer.warmup_steps": 15,
}
CPU_SEEDS = (0, 1)

PAPER = {
    "data.source": "hf:HuggingFaceFW/fineweb-edu:sample-10BT",
    "data.tokenizer": os.environ.get("ASYNCPP_TOKENIZER", "tokenizer.json"),
    "train.steps": 20000,
}
PAPER_SEEDS = (0, 1, 2)
PAPER_NOTE = ("dense135m, 20k updates of 256 x 2048 tokens (10.5B tokens, ~8.5e18 model FLOPs) per run: "
              "about 10 GPU-hours per run on one H100 at 40% MFU")

LR = {"adamw": 3e-3, "muon": 3e-3, "soap": 3e-3, "adan": 3e-3, "lion": 3e-4, "mars": 3e-3}
WD = {"lion": 1.0}


def preset(name: str) -> tuple[str, dict, tuple, str]:
    """(config file, base overrides, seeds, note) for ``cpu`` or ``paper``."""
    if name == "cpu":
        return "configs/tiny.py", dict(CPU), CPU_SEEDS, "about 1 min per run on 2 CPU cores"
    if name == "paper":
        return "configs/dense135m.py", dict(PAPER), PAPER_SEEDS, PAPER_NOTE
    raise ValueError(f"unknown preset {name!r}; choose cpu or paper")


def optimizer(name: str) -> dict:
    out = {"optimizer.name": name, "optimizer.lr": LR[name]}
    if name in WD:
        out["optimizer.weight_decay"] = WD[name]
    return out
