"""Metric sinks, chosen by ``config.train.loggers``: ``jsonl`` (one JSON object per line in
``metrics.jsonl``), ``tensorboard`` (event files under ``tensorboard/``) and ``wandb`` (Weights &
Biases, the ``wandb`` extra); and the console's plain progress line.

Only process 0 writes.  JSONL is appended to, so a resumed run continues the same file; rows past
the step it resumes from (logged after that checkpoint by a run that was then killed) are dropped
first, so the file holds exactly one row per logged step.  TensorBoard event files are append-only
and keep such rows (TensorBoard shows the newest value of a step).  W&B continues the same run after
a restart: its id is kept in ``wandb_run_id`` in the workdir, and W&B ignores the redone steps
(a step at or below the last one it holds), whose values an exact resume repeats anyway.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import secrets
import string
import sys
import time

import jax


from asyncpp_jax.configs import LOGGERS  # noqa: F401 - the loggers config.train.loggers may name
# The module each logger needs, and the install line that brings it.
_NEEDS = {"tensorboard": ("tensorboardX", "pip install tensorboardX"),
          "wandb": ("wandb", "pip install '.[wandb]' from the source checkout (or pip install wandb)")}
WANDB_RUN_ID = "wandb_run_id"  # the file in the workdir holding the W&B run's id


class LoggerUnavailable(RuntimeError):
    """A logger named in ``config.train.loggers`` needs a package this environment lacks."""


def check_available(loggers) -> None:
    """Raise :class:`LoggerUnavailable` naming the install line for each chosen logger whose package is missing."""
    missing = [(name, *_NEEDS[name]) for name in loggers if name in _NEEDS
               and importlib.util.find_spec(_NEEDS[name][0]) is None]
    if missing:
        raise LoggerUnavailable("; ".join(
            f"config.train.loggers includes {name!r}, but {module} is not installed: {fix}, or leave {name!r} "
            "out of config.train.loggers" for name, module, fix in missing) + ".")
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
    """Writes each logged step's metrics to the loggers ``config.train.loggers`` names."""

    def __init__(self, workdir: str | pathlib.Path, loggers=("jsonl", "tensorboard"), resume_step: int = 0,
                 config=None):
        self.enabled = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self.dropped = 0  # rows dropped on resume (process 0 rewrites the file; the others write nothing)
        if not self.enabled:
            return
        workdir = pathlib.Path(workdir)
        if "jsonl" in loggers:
            self.dropped = drop_rows_after(workdir / "metrics.jsonl", resume_step)
            self._jsonl = open(workdir / "metrics.jsonl", "a", buffering=1)
        if "tensorboard" in loggers:
            from tensorboardX import SummaryWriter  # lazy: only the writer needs it

            self._tb = SummaryWriter(str(workdir / "tensorboard"))
        if "wandb" in loggers:
            self._wandb = _wandb_run(workdir, config)

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, int(step))
        if self._wandb is not None:
            self._wandb.log(clean, step=int(step))

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_run(workdir: pathlib.Path, config):
    """The W&B run of this workdir: a new one on a fresh start, the same one (same id) after a restart.
    ``WANDB_MODE=offline`` (or ``disabled``) and W&B's other environment variables apply as usual."""
    import wandb  # lazy: the optional extra

    id_file = workdir / WANDB_RUN_ID
    run_id = id_file.read_text().strip() if id_file.exists() else ""
    if not run_id:
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id form
        id_file.write_text(run_id + "\n")
    t = config.train if config is not None else None
    return wandb.init(project=(t.get("wandb_project", "") if t else "") or "asyncpp_jax",
                      entity=(t.get("wandb_entity", "") if t else "") or None,
                      name=config.name if config is not None else None, id=run_id, resume="allow",
                      dir=str(workdir), config=config.to_dict() if config is not None else None)


def _duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ConsoleLine:
    """A plain progress line every ``log_every`` updates, for a console that is not a terminal (a SLURM
    log, a pipe), where a progress bar would be one unreadable line:

        step 120/500  loss 3.1234  lr 2.99e-03  tokens/s 12,345  ETA 4m12s

    The ETA is the updates left times the mean time per update since the first logged update of this
    process (so the first update's compilation is not counted in it); a line with a validation loss
    also shows it.  ``enabled=None`` decides from ``stream.isatty()`` (process 0 only)."""

    def __init__(self, total_steps: int, log_every: int, stream=None, enabled: bool | None = None,
                 clock=time.perf_counter):
        self.stream = stream if stream is not None else sys.stdout
        if enabled is None:
            enabled = jax.process_index() == 0 and not _isatty(self.stream)
        self.enabled, self.total, self.every, self.clock = enabled, total_steps, log_every, clock
        self._first: tuple[int, float] | None = None  # (step, time) of the first update seen

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if self._first is None:  # timed from its end: the first update's time includes the compilation
            self._first = (step, now)
        if step % self.every and step != self.total:
            return
        first_step, first_t = self._first
        per_update = (now - first_t) / (step - first_step) if step > first_step else float(metrics.get("step_time", 0.0))
        parts = [f"step {step}/{self.total}"]
        if "loss" in metrics:
            parts.append(f"loss {float(metrics['loss']):.4f}")
        if "val_loss" in metrics:
            parts.append(f"val_loss {float(metrics['val_loss']):.4f}")
        if "lr" in metrics:
            parts.append(f"lr {float(metrics['lr']):.3g}")
        if "tokens_per_sec" in metrics:
            parts.append(f"tokens/s {float(metrics['tokens_per_sec']):,.0f}")
        parts.append(f"ETA {_duration(per_update * (self.total - step))}")
        print("  ".join(parts), file=self.stream, flush=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
