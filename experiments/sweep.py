"""Sweep runner: expand a study into runs, run them (resumably), collect one results file.

    python -m experiments.sweep optimizers --preset=cpu [--out runs/studies] [--jobs 1] [--list]

Studies: ``optimizers``, ``momentum``, ``mitigations``, ``schemes``, ``sensitivity``, ``lr``, ``lr_gap``,
``lion``, ``ef_causes``, ``ladder_tune``, ``ladder``, and ``STUDY_tune`` for the first four
(every arm tuned on one grid, :mod:`experiments.studies.tuned`); presets ``cpu``, ``cpu_regime``,
``gpu``, ``paper`` (``experiments/studies/common.py``).

A study (``experiments/studies/<name>.py``, ``study(preset) -> Study``) is named variants (each a
dict of ``--config`` overrides) x a cartesian grid of overrides x seeds.  Each run is the real CLI,
``python -m asyncpp_jax.main --config=FILE --workdir=OUT/STUDY/RUN_ID --config.k=v ...``, in its own
process (so each gets its own fake devices, SOAP's one-core pin, a clean JAX).  A run whose
``status.json`` says ``finished`` is skipped, and an unfinished one resumes from its last
checkpoint, so an interrupted study picks up where it stopped.  A run that diverged (status
``diverged``: a non-finite loss, e.g. a learning rate too high in the ``lr`` study) is a result, not
a failure: its row has ``status: diverged`` and no final loss, the study goes on, and a rerun skips
it (it would diverge again: a run is deterministic given its config).  ``--jobs N`` runs N at
once, each on its own accelerators (:func:`job_envs`: ``CUDA_VISIBLE_DEVICES`` on GPUs,
``TPU_VISIBLE_CHIPS`` and a process of its own on a TPU VM; on a CPU host each job gets its own cores).
Before any job starts, each distinct corpus of the study is prepared once (:func:`prepare_corpora`),
so N jobs do not all tokenize the same data.

A run that another study under the same ``--out`` has already done is not run again: if a done run
elsewhere saved the same resolved config (:func:`signature`: every setting that changes what is
computed), its metrics, status and config are copied into this run's workdir with a
``reused.json`` naming the source, and its row says ``reused_from``.  The ``momentum`` study's
b1 = 0.9 arms, for example, are the ``optimizers`` study's AdamW runs.  ``--no-reuse`` runs everything.

A done run whose saved config no longer matches what its study asks for (a tuned setting changed
since, :func:`stale_settings`) is stale: its workdir is moved aside to ``RUN_ID.stale`` (kept, never
deleted) and the run is done again, so a results file never mixes old settings under a new name.

Results: ``OUT/STUDY/results.jsonl``, one line per run: study, run id, variant, grid point, seed,
overrides, status (``finished`` or ``diverged``), final and best validation loss (nats/byte; none
for a diverged run), the test-split loss (``test_val``, nats/byte: runs with ``train.test_batches``), the validation and training loss curves, wall time (none for a skipped or
reused run), the run's saved config, and ``reused_from`` (the source run's ``STUDY/RUN_ID``, or none).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib
import glob
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from experiments.studies.common import PRESETS
from experiments.study import Run, Study, expand  # noqa: F401  (sweep.Study, sweep.expand: the names users call)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _flag(key: str, value) -> str:
    if isinstance(value, bool):
        value = str(value)
    return f"--config.{key}={value}"


def command(study: Study, run: Run, workdir: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "asyncpp_jax.main", f"--config={study.config}", f"--workdir={workdir}",
            "--config.train.progress_bar=False", *(_flag(k, v) for k, v in run.overrides.items())]


DONE = ("finished", "diverged")  # a run with either status is not run again


def run_status(workdir: pathlib.Path) -> str | None:
    status = workdir / "status.json"
    return json.loads(status.read_text()).get("status") if status.exists() else None


def is_finished(workdir: pathlib.Path) -> bool:
    return run_status(workdir) in DONE


# Settings that change how a run is watched, not what it computes: runs differing only here are one run.
_NOT_COMPUTED = {("train", "progress_bar"), ("train", "profile_start"), ("train", "profile_steps"),
                 ("train", "accept_changed"), ("train", "loggers"), ("train", "wandb_project"),
                 ("train", "wandb_entity")}


# Settings added after runs were saved, with the value that means what the code did before them
# (stage_layers: the even split, the only one there was; init_from: a random initialisation;
# virtual_stages: read by the interleaved schedule only, which came with it; vocab_parallel: the
# tables whole on every stage; mixture: none, config.data.source alone).  Any other setting a saved config lacks makes its signature differ,
# so that run is not reused: reuse does not guess at a default.
_ADDED_LATER = {("pipeline", "stage_layers"): [], ("model", "init_from"): "", ("pipeline", "virtual_stages"): 2,
                ("pipeline", "vocab_parallel"): False, ("data", "mixture"): ""}


def signature(config: dict) -> str:
    """A run's identity for reuse: its saved config (``config.json``) without :data:`_NOT_COMPUTED`,
    with :data:`_ADDED_LATER`'s settings filled in where it predates them.  Reuse trusts that the
    code still computes what it computed then; after a change to that, run with ``--no-reuse``."""
    kept = {s: ({k: v for k, v in sec.items() if (s, k) not in _NOT_COMPUTED} if isinstance(sec, dict) else sec)
            for s, sec in config.items()}
    for (s, k), value in _ADDED_LATER.items():
        if isinstance(kept.get(s), dict):
            kept[s].setdefault(k, value)
    return json.dumps(kept, sort_keys=True)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def stale_settings(saved: dict, wanted: dict) -> list[str]:
    """The settings (``section.key: saved -> wanted``) in which a done run's saved config differs
    from the config its study now resolves to.  Settings the saved config lacks are not compared:
    they were added after the run, which then computed what their defaults do (as in :func:`signature`)."""
    skip = {".".join(k) for k in _NOT_COMPUTED}
    old, new = _flat(saved), _flat(wanted)
    return [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(old.keys() & new.keys())
            if k not in skip and old[k] != new[k]]


def _wanted_config(study: Study, run: Run) -> dict:
    from asyncpp_jax import configs

    return json.loads(configs.to_json(run_config(study, run)))


def set_aside_stale(study: Study, runs: list[Run], root: pathlib.Path, log=print) -> list[str]:
    """Move each done run of ``runs`` under ``root`` whose saved config is stale to ``RUN_ID.stale``
    (``.stale2``, ... if taken); returns their run ids."""
    moved = []
    for run in runs:
        workdir = root / run.run_id
        if not is_finished(workdir):
            continue
        try:
            saved = json.loads((workdir / "config.json").read_text())
        except (OSError, ValueError):
            continue  # no saved config to compare: trust the status (runs predating config.json)
        diff = stale_settings(saved, _wanted_config(study, run))
        if not diff:
            continue
        dest, n = workdir.with_name(run.run_id + ".stale"), 1
        while dest.exists():
            n += 1
            dest = workdir.with_name(f"{run.run_id}.stale{n}")
        workdir.rename(dest)
        moved.append(run.run_id)
        log(f"[{study.name}] {run.run_id}: done with other settings ({'; '.join(diff)}); moved to {dest.name}, "
            "runs again")
    return moved


def run_signature(study: Study, run: Run) -> str:
    return signature(_wanted_config(study, run))


def done_elsewhere(out: pathlib.Path, study_name: str) -> dict[str, pathlib.Path]:
    """signature -> workdir of every done run under ``out`` outside ``study_name``, itself not a reuse."""
    index: dict[str, pathlib.Path] = {}
    for status in sorted(out.glob("*/*/status.json")):
        workdir = status.parent
        if workdir.parent.name == study_name or (workdir / "reused.json").exists() or not is_finished(workdir):
            continue
        try:
            saved = json.loads((workdir / "config.json").read_text())
        except (OSError, ValueError):
            continue
        index.setdefault(signature(saved), workdir)
    return index


def reuse(source: pathlib.Path, workdir: pathlib.Path) -> None:
    """Copy a done run's record into ``workdir``; status.json last, since it is what marks the run done."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "config.json"):
        shutil.copy2(source / name, workdir / name)
    (workdir / "reused.json").write_text(json.dumps({"from": f"{source.parent.name}/{source.name}"}) + "\n")
    shutil.copy2(source / "status.json", workdir / "status.json")


RESTORED_ROW = "restored_row.json"


def restore_with_sources(study: Study, rows, out: pathlib.Path, load, log=print) -> None:
    """:func:`restore` for ``study`` under ``out``, and for every other study with rows in
    ``rows`` that ``load(name)`` can build (``None`` or ``ValueError``: not at this preset): their
    runs are then done under ``out`` too, so a run of ``study`` that one of them already did is
    reused (the ``ladder`` study's seed 0 is ``ladder_tune``'s run) instead of run again."""
    restore(study, rows, out / study.name, log)
    for name in sorted({r.get("study") for r in rows} - {study.name, None}):
        try:
            other = load(name)
        except ValueError:
            continue
        if other is not None:
            restore(other, rows, out / name, log)


def restore(study: Study, rows, root: pathlib.Path, log=print) -> list[str]:
    """Lay out, from results rows (a committed ``results.jsonl``), the workdir of each run of
    ``study`` that is not done under ``root`` but has a done row there with the config the study now
    asks for, so the sweep skips it and its row collects as it was: a study carried over to another
    machine by its committed rows goes on where it stopped.  Returns the run ids restored."""
    done = {(r.get("study"), r.get("run_id")): r for r in rows if r.get("status") in DONE and r.get("config")}
    restored = []
    for run in expand(study):
        workdir = root / run.run_id
        row = done.get((study.name, run.run_id))
        if row is None or is_finished(workdir) or stale_settings(row["config"], _wanted_config(study, run)):
            continue
        workdir.mkdir(parents=True, exist_ok=True)
        lines = [{"step": s, "loss": v} for s, v in row.get("train_curve") or []]
        lines += [{"step": s, "val_loss_per_byte": v} for s, v in row.get("val_curve") or []]
        (workdir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (workdir / "config.json").write_text(json.dumps(row["config"]))
        (workdir / RESTORED_ROW).write_text(json.dumps(row) + "\n")  # collect() returns it as it was
        status = {"status": row["status"], "step": max([s for s, _ in row.get("train_curve") or []], default=0)}
        if row.get("final_val") is not None:
            status["val_loss_per_byte"] = row["final_val"]
        (workdir / "status.json").write_text(json.dumps(status))
        restored.append(run.run_id)
    if restored:
        log(f"[{study.name}] {len(restored)} run(s) restored from their committed rows")
    return restored


def collect(study: Study, run: Run, workdir: pathlib.Path, seconds: float | None = None) -> dict:
    """One results row from a finished run's workdir (a restored run's: its committed row, as it was)."""
    if (workdir / RESTORED_ROW).exists():
        return json.loads((workdir / RESTORED_ROW).read_text())
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val_loss_per_byte"]) for r in rows if "val_loss_per_byte" in r]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    status = json.loads((workdir / "status.json").read_text())
    final = status.get("val_loss_per_byte") if status.get("status") == "finished" else None
    return {
        "study": study.name, "run_id": run.run_id, "variant": run.variant, "point": dict(run.point),
        "seed": run.seed, "overrides": run.overrides, "status": status.get("status"), "final_val": final,
        "test_val": status.get("test_loss_per_byte") if final is not None else None,
        "best_val": min([v for _, v in val] + ([final] if final is not None else [])) if (val or final) else None,
        "val_curve": val, "train_curve": train, "seconds": seconds,
        "config": json.loads((workdir / "config.json").read_text()),
        "reused_from": json.loads(reused.read_text())["from"] if (reused := workdir / "reused.json").exists() else None,
    }


def accelerators(environ=os.environ) -> tuple[str, list[str]]:
    """``('gpu', ids)``, ``('tpu', chip ids)`` or ``('cpu', [])``: what this host offers the jobs.

    GPUs: ``CUDA_VISIBLE_DEVICES`` if set, else one id per line of ``nvidia-smi -L``.  TPU chips:
    the ``/dev/accel*`` (v2-v5e) or ``/dev/vfio/<n>`` (v5p, v6e) device files.  JAX is not imported
    here: on a GPU it would take the parent's share of every accelerator's memory.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # an empty list hides every GPU: the jobs run on the CPU
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return ("gpu", ids) if ids else ("cpu", [])
    if shutil.which("nvidia-smi"):
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        gpus = [line for line in listing.stdout.splitlines() if line.startswith("GPU ")]
        if listing.returncode == 0 and gpus:
            return "gpu", [str(i) for i in range(len(gpus))]
    chips = glob.glob("/dev/accel[0-9]*") or [p for p in glob.glob("/dev/vfio/*") if p.rsplit("/", 1)[-1].isdigit()]
    if chips:
        return "tpu", [str(i) for i in range(len(chips))]
    return "cpu", []


_TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


def job_envs(kind: str, ids: list[str], jobs: int, base_port: int = 8476, cpus=None) -> list[dict]:
    """One environment per job slot: slot ``k`` sees only accelerators ``ids[k*g : (k+1)*g]``,
    ``g = len(ids) // jobs``.  A TPU job also gets its own process bounds and mesh-controller port,
    so several single-host TPU programs run side by side.  CPU: each job its own share of the cores
    this process may use (``ASYNCPP_CPUS``, which ``host_setup`` applies before JAX starts), since
    small models run faster on one core each than with every job's thread pool on every core."""
    if kind == "cpu":
        if jobs <= 1:
            return [{}]
        cores = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
        if len(cores) < jobs:
            raise ValueError(f"--jobs {jobs} needs at least {jobs} CPU cores, found {len(cores)}; lower --jobs.")
        per = len(cores) // jobs
        return [{"ASYNCPP_CPUS": ",".join(map(str, cores[k * per:(k + 1) * per]))} for k in range(jobs)]
    if len(ids) < jobs:
        raise ValueError(f"--jobs {jobs} needs at least {jobs} accelerators ({kind}), found {len(ids)}: "
                         f"{ids}; lower --jobs.")
    per = len(ids) // jobs
    envs = []
    for k in range(jobs):
        mine = ",".join(ids[k * per:(k + 1) * per])
        if kind == "gpu":
            envs.append({"CUDA_VISIBLE_DEVICES": mine})
            continue
        if per not in _TPU_CHIP_BOUNDS:
            raise ValueError(f"--jobs {jobs} gives each job {per} of {len(ids)} TPU chips; a TPU job takes "
                             f"{sorted(_TPU_CHIP_BOUNDS)} chips, so choose --jobs accordingly.")
        port = str(base_port + k)
        envs.append({"TPU_VISIBLE_CHIPS": mine, "TPU_CHIPS_PER_PROCESS_BOUNDS": _TPU_CHIP_BOUNDS[per],
                     "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}",
                     "TPU_MESH_CONTROLLER_PORT": port})
    return envs


def run_config(study: Study, run: Run):
    """The resolved config ``run`` trains with (the config file plus its overrides)."""
    from asyncpp_jax import configs

    c = configs.load_file(study.config)  # a config file, by path (configs/ is not a package)
    for key, value in run.overrides.items():
        section, _, field = key.rpartition(".")
        target = c
        for part in filter(None, section.split(".")):
            target = target[part]
        target[field] = value
    return configs.resolve(c)


def prepare_corpora(study: Study, log=print) -> list[str]:
    """Prepare every distinct corpus the study's runs read, once, before any job starts."""
    from asyncpp_jax.data import prepare_corpus_for

    seen, paths = set(), []
    for run in expand(study):
        d = run_config(study, run).data
        # What the corpus depends on (seq_len, say, does not): the arguments of prepare_corpus_for.
        key = tuple(str(d[f]) for f in ("source", "tokenizer", "cache_dir", "val_fraction", "split_seed",
                                         "eos_token", "hf_split", "hf_text_field", "hf_max_docs"))
        if key not in seen:
            seen.add(key)
            paths.append(prepare_corpus_for(d, log=log))
    return paths


class Stopped(Exception):
    """The runner was sent SIGTERM: every run it had started saved its checkpoint and exited."""


STOPPED_EXIT = 128 + signal.SIGTERM  # a runner stopped by SIGTERM exits as a process it killed would


class Children:
    """The run processes a runner has started and not yet seen end.

    SIGTERM to the runner (:meth:`forwarding`) is passed on to each of them, so every run saves its
    preemption checkpoint and exits, instead of running on as an orphan nobody collects; the runner
    then starts nothing new.  (Ctrl-C already reaches them: a terminal signals the whole process group.)
    """

    def __init__(self):
        self._procs: set = set()
        self._lock = threading.RLock()  # re-entrant: the handler runs on the main thread, between its bytecodes
        self.stopping = False

    def run(self, cmd, env: dict, stdout=None) -> int:
        """Run ``cmd`` with ``env`` added to its end and return its exit code; :class:`Stopped` if the
        runner is stopping (the command is then not started)."""
        with self._lock:
            if self.stopping:
                raise Stopped()
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=stdout,
                                    stderr=subprocess.STDOUT if stdout is not None else None)
            self._procs.add(proc)
        try:
            return proc.wait()
        finally:
            with self._lock:
                self._procs.discard(proc)

    def stop(self, signum=None, frame=None) -> None:
        with self._lock:
            self.stopping = True
            procs = list(self._procs)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    @contextlib.contextmanager
    def forwarding(self):
        """Within: SIGTERM to this process calls :meth:`stop` (on the main thread only, where Python
        delivers signals; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGTERM, self.stop)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)


def execute(study: Study, out: pathlib.Path, jobs: int = 1, runner=None, log=print, prepare=prepare_corpora,
            envs: list[dict] | None = None, reuse_done: bool = True) -> pathlib.Path:
    """Run every unfinished run of ``study`` and write ``out/<study>/results.jsonl``; returns its path.

    ``prepare(study, log)`` readies the corpora first; ``envs`` (default :func:`job_envs` for this
    host) are the job slots' environment settings, each held by one running job at a time.
    ``runner(cmd, workdir, env) -> returncode`` runs one command (default: a subprocess); tests inject one.
    ``reuse_done``: copy a run another study under ``out`` has done with the same config (:func:`reuse`).
    """
    root = out / study.name
    root.mkdir(parents=True, exist_ok=True)
    runs = expand(study)
    children = Children()
    runner = runner or (lambda cmd, workdir, env: children.run(cmd, env))
    envs = envs if envs is not None else job_envs(*accelerators(), max(jobs, 1))
    slots: queue.Queue = queue.Queue()
    for env in envs:
        slots.put(env)
    seconds: dict[str, float] = {}
    set_aside_stale(study, runs, root, log)
    todo = [r for r in runs if not is_finished(root / r.run_id)]
    if reuse_done and todo:
        done = done_elsewhere(out, study.name)
        for run in todo:
            source = done.get(run_signature(study, run))
            if source is not None:
                reuse(source, root / run.run_id)
                log(f"[{study.name}] {run.run_id}: the same run as {source.parent.name}/{source.name}, reused")
    if any(not is_finished(root / r.run_id) for r in runs):
        prepare(study, log)

    def one(run: Run):
        workdir = root / run.run_id
        if is_finished(workdir):
            log(f"[{study.name}] {run.run_id}: {run_status(workdir)} before, skipped")
            return run, None
        env = slots.get()
        try:
            log(f"[{study.name}] {run.run_id}: running" + (f" with {env}" if env else ""))
            t0 = time.time()
            code = runner(command(study, run, workdir), workdir, env)
        finally:
            slots.put(env)
        if children.stopping:
            raise Stopped()
        if code != 0 and run_status(workdir) == "diverged":
            log(f"[{study.name}] {run.run_id}: diverged (recorded without a final loss)")
        elif code != 0:
            raise RuntimeError(f"run {run.run_id} of study {study.name} failed with exit code {code}; "
                               f"its log is in {workdir}; rerun the study to resume")
        seconds[run.run_id] = time.time() - t0
        return run, seconds[run.run_id]

    with children.forwarding(), concurrent.futures.ThreadPoolExecutor(max_workers=len(envs)) as pool:
        futures = [pool.submit(one, run) for run in runs]
        concurrent.futures.wait(futures)
    if children.stopping:
        raise Stopped()
    done = [f.result() for f in futures]
    results = root / "results.jsonl"
    with open(results, "w") as f:
        for run, secs in done:
            f.write(json.dumps(collect(study, run, root / run.run_id, secs)) + "\n")
    log(f"[{study.name}] {len(runs)} runs -> {results}")
    return results


def collect_done(study: Study, out: pathlib.Path) -> tuple[pathlib.Path, int, int]:
    """``out/<study>/results.jsonl`` from the study's done runs only (no wall time: it was not
    measured here); returns (its path, runs done, runs in the study).  For reading a long study
    while it runs, or one that was stopped: its rows are those a finished study would write."""
    root = out / study.name
    root.mkdir(parents=True, exist_ok=True)
    runs = [r for r in expand(study) if is_finished(root / r.run_id)]
    results = root / "results.jsonl"
    with open(results, "w") as f:
        for run in runs:
            f.write(json.dumps(collect(study, run, root / run.run_id)) + "\n")
    return results, len(runs), len(expand(study))


TUNABLE = ("optimizers", "momentum", "mitigations", "schemes")  # each also runs as STUDY_tune (studies/tuned.py)


def study_names() -> list[str]:
    """The study modules in ``experiments/studies`` (every module but the shared helpers), and the
    ``STUDY_tune`` step of each study tuned per arm."""
    modules = [p.stem for p in (REPO_ROOT / "experiments" / "studies").glob("*.py")
               if p.stem not in ("__init__", "common", "tuned", "factors")]  # factors: experiments.screen runs it
    return sorted(modules + [f"{name}_tune" for name in TUNABLE])


def load_study(name: str, preset: str) -> Study:
    if name not in study_names():
        screen = " (the factor screen runs with `python -m experiments.screen`)" if name.startswith("factors") else ""
        raise ValueError(f"no study {name!r}{screen}; choose one of {', '.join(study_names())}")
    if name.endswith("_tune") and name[: -len("_tune")] in TUNABLE:
        from experiments.studies import tuned

        if preset not in tuned.TUNED_PRESETS:
            raise ValueError(f"{name} tunes every arm at the {', '.join(tuned.TUNED_PRESETS)} preset; the {preset} "
                             f"preset runs {name[: -len('_tune')]} at its own learning rates")
        module = importlib.import_module(f"experiments.studies.{name[: -len('_tune')]}")
        return tuned.tune_study(module.base_study(preset), preset)
    return importlib.import_module(f"experiments.studies.{name}").study(preset)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", help="a module of experiments/studies: optimizers, momentum, mitigations, schemes, "
                    "sensitivity, lr, lr_gap, lion, ef_causes")
    ap.add_argument("--preset", default="cpu", choices=PRESETS)
    ap.add_argument("--out", default="runs/studies")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--list", action="store_true", help="print the runs and exit")
    ap.add_argument("--only", metavar="REGEX", default=None,
                    help="run only the variants whose name matches (e.g. 'u=3200/(adamw|muon)/'): a part of a "
                    "study first; the rest runs when the study is run again without it")
    ap.add_argument("--restore", metavar="RESULTS", default=None,
                    help="a results.jsonl (e.g. experiments/results/cpu_regime/results.jsonl) whose done rows "
                    "stand for their runs: they are not run again (the other studies' rows too, so that a "
                    "run one of them did is reused)")
    ap.add_argument("--collect", action="store_true",
                    help="write results.jsonl from the runs done so far and exit (runs nothing; a study "
                    "still running elsewhere keeps going)")
    ap.add_argument("--no-reuse", dest="reuse", action="store_false",
                    help="run every run, even one another study under --out has done with the same config")
    a = ap.parse_args(argv)
    try:
        study = load_study(a.study, a.preset)
    except ValueError as e:
        ap.error(str(e))
    if a.only:
        study = dataclasses.replace(study, variants={k: v for k, v in study.variants.items() if re.search(a.only, k)})
        if not study.variants:
            ap.error(f"--only {a.only!r} matches no variant of {a.study}")
    if study.note:
        print(f"{study.name} ({a.preset}): {study.note}")
    if a.list:
        for run in expand(study):
            print(" ".join(command(study, run, pathlib.Path(a.out) / study.name / run.run_id)[2:]))
        return
    if a.restore:
        rows = [json.loads(line) for line in pathlib.Path(a.restore).read_text().splitlines() if line.strip()]
        restore_with_sources(study, rows, pathlib.Path(a.out), lambda name: load_study(name, a.preset))
    if a.collect:
        results, done, total = collect_done(study, pathlib.Path(a.out))
        print(f"{done} of {total} runs done -> {results}")
        return
    try:
        envs = job_envs(*accelerators(), max(a.jobs, 1))
    except ValueError as e:
        ap.error(str(e))
    t0 = time.time()
    try:
        results = execute(study, pathlib.Path(a.out), a.jobs, envs=envs, reuse_done=a.reuse)
    except Stopped:
        print("stopped by SIGTERM: every running run was stopped where it can resume; run the same command again",
              file=sys.stderr)
        sys.exit(STOPPED_EXIT)
    print(f"done in {(time.time() - t0) / 60:.1f} min; report: python -m experiments.report {results}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
