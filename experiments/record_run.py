"""Run a documented command and append a record of it (command, commit, date, hardware, figures).

    python -m experiments.record_run --kind main_job --out experiments/results/bench/main_job.jsonl -- \
        python -m asyncpp_jax.main
    python -m experiments.record_run --kind dry_run --out experiments/results/bench/dry_run.jsonl -- \
        python -m asyncpp_jax.main --config=configs/moe10b.py --dry_run
    python -m experiments.render_docs      # then the docs' tables show the new record

    python -m experiments.record_run --kind ci --out experiments/results/bench/ci.jsonl -- bash .ci/run

The command runs as it is (its output passes through) and is timed end to end. A training run's
figures come from its workdir (``--workdir``, else ``runs/<config.name>``): ``status.json`` (status,
step, validation loss, the corpus's unigram baselines), ``config.json`` (the optimizer, its lr and
weight decay) and ``metrics.jsonl`` (median step time and tokens/s). A dry run's figures are its report (the lines from ``dry run of`` on) and its compile
time. Any other command's are its wall time and, when it ran pytest, the counts of pytest's summary
line. A run that fails is not recorded. See experiments/records.py for the record's fields.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shlex
import statistics
import subprocess
import sys
import time

from experiments import records


def workdir_of(argv: list[str]) -> pathlib.Path:
    """The workdir a ``python -m asyncpp_jax.main`` command writes to, as the CLI resolves it."""
    for a in argv:
        if a.startswith("--workdir="):
            return pathlib.Path(a.split("=", 1)[1])
    config = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    from asyncpp_jax import configs

    return pathlib.Path("runs") / configs.load_file(config or configs.DEFAULT_CONFIG).name


def figures_from_workdir(workdir: pathlib.Path) -> dict:
    """A finished run's figures: from status.json, and the median step time and tokens/s of metrics.jsonl."""
    status = json.loads((workdir / "status.json").read_text())
    figures = {"status": status["status"], "updates": status["step"]}
    if "val_loss_per_byte" in status:
        figures["final_val_nats_per_byte"] = status["val_loss_per_byte"]
        figures["final_val_nats_per_token"] = status["val_loss"]
    unigram = status.get("unigram") or {}
    if "train_entropy" in unigram:
        figures["unigram_entropy_train_nats_per_byte"] = unigram["train_entropy"]
    if "val_cross_entropy" in unigram:
        figures["unigram_xent_val_nats_per_byte"] = unigram["val_cross_entropy"]
    settings = workdir / "config.json"  # the optimizer the run trained with, as the trainer resolved it
    if settings.exists():
        optimizer = json.loads(settings.read_text()).get("optimizer", {})
        figures.update({k: optimizer[k] for k in ("name", "lr", "weight_decay") if k in optimizer})
        if "name" in figures:
            figures["optimizer"] = figures.pop("name")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for key, name in (("step_time", "s_per_update"), ("tokens_per_sec", "tokens_per_s")):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            figures[name] = statistics.median(values)
    return figures


def figures_from_dry_run(stdout: str) -> dict:
    """A dry run's report lines and compile time."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("dry run of")), None)
    if start is None:
        raise ValueError("no dry-run report (a line starting 'dry run of') in the command's output")
    report = [line for line in lines[start:] if line.startswith(("dry run of", "  "))]
    compiled = re.search(r"compiled in (\d+(?:\.\d+)?) s", stdout)
    return {"stdout": report, **({"compile_s": float(compiled.group(1))} if compiled else {})}


def figures_from_pytest(stdout: str) -> dict:
    """The counts and time of pytest's last summary line (``569 passed, 2 skipped, 46 deselected in 710.12s``)."""
    lines = [line for line in stdout.splitlines() if re.search(r"\b(passed|failed|error|errors)\b.* in [\d.]+s", line)]
    if not lines:
        return {}
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)",
                                                      lines[-1])}
    counts["errors"] = counts.pop("error", 0) + counts.get("errors", 0)
    ran = sum(v for k, v in counts.items() if k != "deselected")
    figures = {"tests_default": ran, "passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
               "skipped": counts.get("skipped", 0), "errors": counts["errors"],
               "tests_all": ran + counts.get("deselected", 0), "tests_slow": counts.get("deselected", 0)}
    seconds = re.search(r" in ([\d.]+)s", lines[-1])
    return {**figures, "pytest_s": float(seconds.group(1))} if seconds else figures


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="python -m experiments.record_run --kind KIND --out FILE.jsonl -- COMMAND...")
    ap.add_argument("--kind", required=True, help="the record's kind, e.g. main_job or dry_run")
    ap.add_argument("--out", required=True, help="the records file to append to (experiments/results/bench/*.jsonl)")
    ap.add_argument("--note", default="", help="anything a reader should know about the run (load, idle, ...)")
    a = ap.parse_args(own)
    if not command:
        ap.error("give the command to run after --")
    t0 = time.perf_counter()
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    sys.stdout.write(out.stdout)
    if out.returncode != 0:
        print(f"record_run: the command exited {out.returncode}; nothing recorded", file=sys.stderr)
        return out.returncode
    if "--dry_run" in command:
        figures = figures_from_dry_run(out.stdout)
    elif "asyncpp_jax.main" in command:
        figures = figures_from_workdir(workdir_of(command))
    else:
        figures = figures_from_pytest(out.stdout)
    extra = {"note": a.note} if a.note else {}
    records.append(a.out, records.make(a.kind, {"wall_s": round(wall, 1), **figures},
                                       command=shlex.join(command), **extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
