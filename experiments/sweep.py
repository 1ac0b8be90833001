"""Sweep runner: expand a study into runs, run them (resumably), collect one results file.

    python -m experiments.sweep optimizers --preset=cpu [--out runs/studies] [--jobs 1] [--list]

A study (``experiments/studies/<name>.py``, ``study(preset) -> Study``) is named variants (each a
dict of ``--config`` overrides) x a cartesian grid of overrides x seeds.  Each run is the real CLI,
``python -m asyncpp_jax.main --config=FILE --workdir=OUT/STUDY/RUN_ID --config.k=v ...``, in its own
process (so each gets its own fake devices, SOAP's one-core pin, a clean JAX).  A run whose
``status.json`` says ``finished`` is skipped, and an unfinished one resumes from its last
checkpoint, so an interrupted study picks up where it stopped.  ``--jobs N`` runs N at once (give
each its own accelerator with e.g. ``CUDA_VISIBLE_DEVICES``; on a 2-core CPU keep 1).

Results: ``OUT/STUDY/results.jsonl``, one line per run: study, run id, variant, grid point, seed,
overrides, final and best validation loss (nats/byte), the validation and training loss curves,
wall time, and the run's saved config.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Study:
    name: str
    config: str  # config file, relative to the repository root
    variants: dict  # variant name -> {dotted config key: value}
    grid: dict = dataclasses.field(default_factory=dict)  # dotted key -> list of values (cartesian)
    seeds: tuple = (0,)
    base: dict = dataclasses.field(default_factory=dict)  # overrides for every run
    note: str = ""  # expected compute, what the preset is for


@dataclasses.dataclass(frozen=True)
class Run:
    study: str
    variant: str
    point: tuple  # ((key, value), ...) of the grid
    seed: int
    overrides: dict

    @property
    def run_id(self) -> str:
        parts = [self.variant] + [f"{k.split('.')[-1]}={v}" for k, v in self.point] + [f"seed={self.seed}"]
        return "__".join(p.replace("/", "-") for p in parts)


def expand(study: Study) -> list[Run]:
    """Variants x grid points x seeds, in that nesting order; later overrides win (base < variant < grid)."""
    keys = list(study.grid)
    points = [tuple(zip(keys, values)) for values in itertools.product(*(study.grid[k] for k in keys))] or [()]
    runs = []
    for variant, overrides in study.variants.items():
        for point in points:
            for seed in study.seeds:
                merged = {**study.base, **overrides, **dict(point), "seed": seed}
                runs.append(Run(study.name, variant, point, seed, merged))
    ids = [r.run_id for r in runs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"study {study.name!r} expands to duplicate run ids; give variants distinct names")
    return runs


def _flag(key: str, value) -> str:
    if isinstance(value, bool):
        value = str(value)
    return f"--config.{key}={value}"


def command(study: Study, run: Run, workdir: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "asyncpp_jax.main", f"--config={study.config}", f"--workdir={workdir}",
            "--config.train.progress_bar=False", *(_flag(k, v) for k, v in run.overrides.items())]


def is_finished(workdir: pathlib.Path) -> bool:
    status = workdir / "status.json"
    return status.exists() and json.loads(status.read_text()).get("status") == "finished"


def collect(study: Study, run: Run, workdir: pathlib.Path, seconds: float | None = None) -> dict:
    """One results row from a finished run's workdir."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val_loss_per_byte"]) for r in rows if "val_loss_per_byte" in r]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    status = json.loads((workdir / "status.json").read_text())
    final = status.get("val_loss_per_byte")
    return {
        "study": study.name, "run_id": run.run_id, "variant": run.variant, "point": dict(run.point),
        "seed": run.seed, "overrides": run.overrides, "final_val": final,
        "best_val": min([v for _, v in val] + ([final] if final is not None else [])) if (val or final) else None,
        "val_curve": val, "train_curve": train, "seconds": seconds,
        "config": json.loads((workdir / "config.json").read_text()),
    }


def execute(study: Study, out: pathlib.Path, jobs: int = 1, runner=None, log=print) -> pathlib.Path:
    """Run every unfinished run of ``study`` and write ``out/<study>/results.jsonl``; returns its path.

    ``runner(cmd, workdir) -> returncode`` runs one command (default: a subprocess); tests inject one.
    """
    root = out / study.name
    root.mkdir(parents=True, exist_ok=True)
    runs = expand(study)
    runner = runner or (lambda cmd, workdir: subprocess.run(cmd, cwd=REPO_ROOT).returncode)
    seconds: dict[str, float] = {}

    def one(run: Run):
        workdir = root / run.run_id
        if is_finished(workdir):
            log(f"[{study.name}] {run.run_id}: finished before, skipped")
            return run, None
        log(f"[{study.name}] {run.run_id}: running")
        t0 = time.time()
        code = runner(command(study, run, workdir), workdir)
        if code != 0:
            raise RuntimeError(f"run {run.run_id} of study {study.name} failed with exit code {code}; "
                               f"its log is in {workdir}; rerun the study to resume")
        seconds[run.run_id] = time.time() - t0
        return run, seconds[run.run_id]

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        done = list(pool.map(one, runs))
    results = root / "results.jsonl"
    with open(results, "w") as f:
        for run, secs in done:
            f.write(json.dumps(collect(study, run, root / run.run_id, secs)) + "\n")
    log(f"[{study.name}] {len(runs)} runs -> {results}")
    return results


def load_study(name: str, preset: str) -> Study:
    return importlib.import_module(f"experiments.studies.{name}").study(preset)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", help="a module of experiments/studies: optimizers, momentum, mitigations, schemes, sensitivity")
    ap.add_argument("--preset", default="cpu", choices=("cpu", "paper"))
    ap.add_argument("--out", default="runs/studies")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--list", action="store_true", help="print the runs and exit")
    a = ap.parse_args(argv)
    study = load_study(a.study, a.preset)
    if study.note:
        print(f"{study.name} ({a.preset}): {study.note}")
    if a.list:
        for run in expand(study):
            print(" ".join(command(study, run, pathlib.Path(a.out) / study.name / run.run_id)[2:]))
        return
    t0 = time.time()
    results = execute(study, pathlib.Path(a.out), a.jobs)
    print(f"done in {(time.time() - t0) / 60:.1f} min; report: python -m experiments.report {results}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
