"""Presets shared by the studies.

``cpu``: the tiny byte-level model, shrunk so one run takes 15-25 s on 2 CPU cores (d_model 128,
4 layers, seq 64, batch 16, 150 updates).  ``paper``: the SmolLM2-360M shape for the headline
studies (optimizers, mitigations), SmolLM2-135M for the sweeps (momentum, schemes, sensitivity),
on FineWeb-Edu through the prepare step with the SmolLM2 tokenizer (its tokenizer.json path in
``ASYNCPP_TOKENIZER``).
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
# Model FLOPs per run (asyncpp_jax.models.flops: 6N + attention, 20k updates x 256 x 2048 tokens =
# 10.5B tokens), and H100-hours at 40% MFU of 989 bf16 TFLOP/s.
PAPER_MODELS = {
    "135m": ("configs/dense135m.py", "dense135m, 10.5B tokens per run: 1.29e19 model FLOPs, ~9 H100-hours at 40% MFU"),
    "360m": ("configs/dense360m.py", "dense360m, 10.5B tokens per run: 3.07e19 model FLOPs, ~22 H100-hours at 40% MFU"),
}
LR = {"adamw": 3e-3, "muon": 3e-3, "soap": 3e-3, "adan": 3e-3, "lion": 3e-4, "mars": 3e-3}
WD = {"lion": 1.0}


def preset(name: str, paper_model: str = "135m") -> tuple[str, dict, tuple, str]:
    """(config file, base overrides, seeds, note) for ``cpu`` or ``paper`` (at ``paper_model``)."""
    if name == "cpu":
        return "configs/tiny.py", dict(CPU), CPU_SEEDS, "about 15-25 s per run on 2 CPU cores"
    if name == "paper":
        config, note = PAPER_MODELS[paper_model]
        return config, dict(PAPER), PAPER_SEEDS, note
    raise ValueError(f"unknown preset {name!r}; choose cpu or paper")


def optimizer(name: str) -> dict:
    out = {"optimizer.name": name, "optimizer.lr": LR[name]}
    if name in WD:
        out["optimizer.weight_decay"] = WD[name]
    return out
