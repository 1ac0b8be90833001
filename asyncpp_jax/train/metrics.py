"""Metric sinks: one JSON object per line in ``metrics.jsonl`` and TensorBoard event files.

Only process 0 writes.  JSONL is appended to, so a resumed run continues the same file; rows past
the step it resumes from (logged after that checkpoint by a run that was then killed) are dropped
first, so the file holds exactly one row per logged step.  TensorBoard event files are append-only
and keep such rows (TensorBoard shows the newest value of a step).
"""

from __future__ import annotations

import json
import os
import pathlib

import jax


def drop_rows_after(path: pathlib.Path, step: int) -> int:
    """Keep the rows of ``path`` with ``step <= step`` (and drop a torn last line); returns how many
    rows were dropped.  Rewritten through a temporary file, so a crash leaves one version or the other."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


class MetricWriter:
    def __init__(self, workdir: str | pathlib.Path, tensorboard: bool = True, resume_step: int = 0):
        self.enabled = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        self.dropped = 0  # rows dropped on resume (process 0 rewrites the file; the others write nothing)
        if not self.enabled:
            return
        workdir = pathlib.Path(workdir)
        self.dropped = drop_rows_after(workdir / "metrics.jsonl", resume_step)
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
