"""Metric sinks: one JSON object per line in ``metrics.jsonl`` and TensorBoard event files.

Only process 0 writes.  JSONL is appended to, so a resumed run continues the same file.
"""

from __future__ import annotations

import json
import pathlib

import jax


class MetricWriter:
    def __init__(self, workdir: str | pathlib.Path, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        if not self.enabled:
            return
        workdir = pathlib.Path(workdir)
        self._jsonl = open(workdir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter  # lazy: only the writer needs it

            self._tb = SummaryWriter(str(workdir / "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, int(step))

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
