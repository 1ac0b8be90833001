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


_TAIL_BLOCK = 1 << 16  # bytes read at a time, from the end


def _lines_from_the_end(f, end: int):
    """``(offset, line)`` of each newline-separated line of ``f[:end]``, the last first."""
    pos, rest = end, b""
    while pos > 0:
        n = min(_TAIL_BLOCK, pos)
        pos -= n
        f.seek(pos)
        chunk = f.read(n) + rest
        lines = chunk.split(b"\n")
        offset = pos + len(chunk)
        for line in reversed(lines[1:]):  # each begins after a newline: whole
            offset -= len(line)
            yield offset, line
            offset -= 1
        rest = lines[0]  # may begin before pos
    yield 0, rest


def _row_step(line: bytes):
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def drop_rows_after(path: pathlib.Path, step: int) -> int:
    """Cut ``path`` after its last row with ``step <= step`` (rows are appended in step order), which
    drops the rows logged after that step and a torn last line; returns how many rows were dropped.
    Only the tail it cuts is read (from the end, in blocks), so a resume costs the same however
    long the run has been; one truncate, so a crash leaves one version or the other."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, os.SEEK_END)
        keep, dropped = 0, 0
        for offset, line in _lines_from_the_end(f, end):
            if not line.strip():
                continue
            row_step = _row_step(line)
            if isinstance(row_step, (int, float)) and row_step <= step:
                keep = offset + len(line)
                break
            dropped += 1
        f.seek(keep)
        newline = keep < end and f.read(1) == b"\n"
        if keep + newline < end:
            f.truncate(keep + newline)
        if keep and not newline:  # a kept row needs its newline before the next is appended
            f.seek(keep)
            f.write(b"\n")
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
