"""Machine-readable records of measured runs: one JSON object a line in ``experiments/results/bench/*.jsonl``.

A record holds what a reader needs to trust or redo a figure::

    {"kind": "bench_optimizers", "command": "python -m experiments.bench_optimizers", "commit": "f979519",
     "date": "2026-12-02", "hardware": "...", "source": "measured", "figures": {...}}

``source`` is ``"measured"`` when a script wrote the record as it ran, or ``"typed by hand from <where>"``
when a figure was transcribed from an older text whose run cannot be redone now. The docs' tables are
rendered from these records by ``python -m experiments.render_docs`` (``--check`` in the tests).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "experiments" / "results" / "bench"
KEYS = ("kind", "command", "commit", "date", "hardware", "source", "figures")


def commit() -> str | None:
    """The checkout's short commit, with ``+dirty`` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def hardware() -> str:
    """The host's CPU and core count, and JAX's devices when JAX is already imported."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{platform.machine()} CPU, {cores} core(s) usable"
    jax = sys.modules.get("jax")
    if jax is not None:
        devices = jax.devices()
        text += f"; JAX {jax.__version__}, {len(devices)} {devices[0].device_kind} device(s)"
    return text


def command_line(argv: list[str] | None = None) -> str:
    """This process's command as a reader would type it: ``python -m pkg.mod ARGS`` for a module of the
    repository, ``python ARGV...`` otherwise."""
    argv = list(sys.argv if argv is None else argv)
    script = pathlib.Path(argv[0]).resolve()
    if script.suffix == ".py" and script.is_relative_to(REPO_ROOT):
        module = script.relative_to(REPO_ROOT).with_suffix("").as_posix().replace("/", ".")
        return shlex.join(["python", "-m", module, *argv[1:]])
    return shlex.join(["python", *argv])


def make(kind: str, figures: dict, command: str | None = None, **extra) -> dict:
    """A record of a run measured now: the command defaults to this process's command line."""
    if command is None:
        command = command_line()
    return {"kind": kind, "command": command, "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "hardware": hardware(),
            "source": "measured", **extra, "figures": figures}


def append(path: str | os.PathLike, record: dict) -> None:
    """Add one record as a line of ``path`` (created with its folder if missing)."""
    missing = [k for k in KEYS if k not in record]
    if missing:
        raise ValueError(f"a record needs {', '.join(missing)}")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"record appended to {path}")


def load(name: str, kind: str | None = None) -> list[dict]:
    """The records of ``experiments/results/bench/<name>.jsonl`` (of one ``kind`` if given), in file order."""
    path = BENCH_DIR / f"{name}.jsonl"
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        missing = [k for k in KEYS if k not in row]
        if missing:
            raise ValueError(f"{path}:{n}: a record needs {', '.join(missing)}")
        if kind is None or row["kind"] == kind:
            rows.append(row)
    return rows
