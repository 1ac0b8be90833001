"""Run the factor screen (:mod:`experiments.studies.factors`) under the referee protocol
(:mod:`experiments.protocol`), resumably, the most informative cells first.

    python -m experiments.screen [--out runs/studies] [--jobs 2] [--cells REGEX] [--list]
    python -m experiments.screen --pilot [--jobs 2] [--cells REGEX]   # price every cell first

A scheduler, not a fixed list: what may run next depends on the runs already done (an arm is
measured once its tuning grid has bracketed a pick; its seeds 3-4 once the gap at seeds 0-2 is
known).  Whenever a job slot is free it starts the first run, in :data:`factors.QUEUE` order, that the
rows done so far allow: tuning of a cell, then its measurement, then its extra seeds, then the next
cell, and the optimizers beyond the contrast (width=128's SOAP, Adan, Lion and MARS) after every
cell's contrast; a slot never waits while a later cell has a run to do.  Each run is the real CLI in its own
process, in ``OUT/factors_tune/RUN_ID`` or ``OUT/factors/RUN_ID`` (as :mod:`experiments.sweep` lays
them out), and both ``results.jsonl`` are rewritten after every run that finishes, so a screen
stopped at any point has written every row it finished.  Started again, it skips the done runs and
resumes an unfinished one from its checkpoint.  ``--restore RESULTS`` lays out done runs from
committed rows first (:func:`experiments.sweep.restore`), so a screen goes on on another machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import pathlib
import queue
import re
import shlex
import shutil
import sys
import time

from experiments import protocol, records, stats, sweep
from experiments.studies import factors
from experiments.study import Run, Study

TUNE, MEASURE = "factors_tune", "factors"


# The arms whose runs go first: the gap 2bw - sync of both optimizers (their ratio is the screen's
# question) before error feedback's arm.
HEADLINE_ARMS = ("sync", "2bw")


def plan(cell: str, tune_rows, measure_rows) -> tuple[list, list, dict]:
    """``(tuning runs, measurement runs, picks)`` of ``cell`` that the rows done so far call for,
    as ``[(study, run)]``, and ``{(opt, arm): (grid, pick)}``.  An arm is measured at
    :data:`protocol.MEASURE_SEEDS` once its own pick is made; every picked arm of an optimizer also
    at :data:`protocol.MORE_SEEDS` once its gap ``2bw - sync`` at those seeds is under
    :data:`protocol.RESOLVE_T` standard errors.  Runs come in the order to run them: the sync and
    2bw arms of every optimizer (tuned, then measured) before the EF arms, extra seeds last."""
    seeds = factors.CELLS[cell][1]
    tune, measure, more, picks = [], [], [], {}
    arms_measured = stats.arms_of([r for r in measure_rows if r["seed"] in protocol.MEASURE_SEEDS])
    for opt in factors.optimizers_of(cell):
        opt_arms = [a for o, a in factors.arms(cell) if o == opt]
        for arm in opt_arms:
            grid, pick = factors.tuning_state(cell, opt, arm, tune_rows)
            picks[(opt, arm)] = (grid, pick)
            study = factors.study_of(TUNE, cell, [(opt, arm, v) for v in grid], seeds)
            tune += [(arm not in HEADLINE_ARMS, study, r) for r in sweep.expand(study)]
            if pick is not None:
                study = factors.study_of(MEASURE, cell, [(opt, arm, pick)], protocol.MEASURE_SEEDS)
                measure += [(arm not in HEADLINE_ARMS, study, r) for r in sweep.expand(study)]
        names = {arm: factors.variant(cell, opt, arm, picks[(opt, arm)][1]) for arm in HEADLINE_ARMS
                 if picks[(opt, arm)][1] is not None}
        if len(names) == len(HEADLINE_ARMS) and \
                all(len(arms_measured.get(n, [])) == len(protocol.MEASURE_SEEDS) for n in names.values()) and \
                protocol.needs_more_seeds(stats.gap(arms_measured, names["2bw"], names["sync"])):
            entries = [(opt, arm, picks[(opt, arm)][1]) for arm in opt_arms if picks[(opt, arm)][1] is not None]
            study = factors.study_of(MEASURE, cell, entries, protocol.MORE_SEEDS)
            more += [(study, r) for r in sweep.expand(study)]

    def first(runs, late: bool):
        return [(s, r) for is_late, s, r in runs if is_late == late]

    tune_runs = first(tune, False) + first(tune, True)
    measure_runs = first(measure, False) + first(measure, True) + more
    return tune_runs, measure_runs, picks


def ordered(tune_runs, measure_runs) -> list:
    """One cell's runs in the order to run them: headline arms' tuning, their measurement, then the
    EF arms' tuning and measurement, extra seeds last."""
    head = [x for x in tune_runs if x[1].variant.rsplit("/", 1)[-1] in HEADLINE_ARMS]
    head_m = [x for x in measure_runs if x[1].variant.rsplit("/", 1)[-1] in HEADLINE_ARMS
              and x[1].seed in protocol.MEASURE_SEEDS]
    rest = [x for x in tune_runs + measure_runs if x not in head and x not in head_m]
    return head + head_m + rest


class Screen:
    """The queue's state on disk under ``out``: done rows, and the runs they call for next."""

    def __init__(self, out: pathlib.Path, cells):
        self.out, self.cells = out, list(cells)
        self.rows: dict[str, dict] = {}  # "STUDY/RUN_ID" -> row of every done run

    def refresh(self) -> None:
        for name in (TUNE, MEASURE):
            root = self.out / name
            for status in root.glob("*/status.json") if root.exists() else ():
                key = f"{name}/{status.parent.name}"
                if key not in self.rows and sweep.is_finished(status.parent):
                    self.rows[key] = None  # filled by the plan below, which knows each run's study

    def rows_of(self, name: str) -> list[dict]:
        return [r for k, r in self.rows.items() if k.startswith(name + "/") and r is not None]

    def _fill(self, runs) -> None:
        for study, run in runs:
            key = f"{study.name}/{run.run_id}"
            if key in self.rows and self.rows[key] is None:
                self.rows[key] = sweep.collect(study, run, self.out / study.name / run.run_id)

    def next_runs(self) -> list[tuple[Study, Run]]:
        """Every run the done rows call for and that is not done, in queue order: every cell's contrast
        (:data:`factors.OPTIMIZERS`) before the other optimizers (:data:`factors.MORE_OPTIMIZERS`)."""
        wanted = []
        for cell in self.cells:
            while True:  # filling rows can open the next step of a plan: plan again until it is stable
                tune_runs, measure_runs, _ = plan(cell, self.rows_of(TUNE), self.rows_of(MEASURE))
                before = sum(r is not None for r in self.rows.values())
                self._fill(tune_runs + measure_runs)
                if sum(r is not None for r in self.rows.values()) == before:
                    break
            wanted += [(s, r) for s, r in ordered(tune_runs, measure_runs) if f"{s.name}/{r.run_id}" not in self.rows]
        return sorted(wanted, key=lambda sr: sr[1].variant.split("/")[1] not in factors.OPTIMIZERS)  # stable

    def write_results(self) -> None:
        for name in (TUNE, MEASURE):
            rows = sorted(self.rows_of(name), key=lambda r: (self.cells.index(r["variant"].split("/")[0])
                                                           if r["variant"].split("/")[0] in self.cells else 99,
                                                           r["run_id"]))
            (self.out / name).mkdir(parents=True, exist_ok=True)
            tmp = self.out / name / "results.jsonl.tmp"
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.replace(tmp, self.out / name / "results.jsonl")


def _run_logged(children: sweep.Children, cmd: list[str], workdir: pathlib.Path, env: dict) -> int:
    """Run ``cmd`` with ``env`` added, its output appended to ``workdir/run.log``; returns its exit code."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "run.log", "a") as log:
        return children.run(cmd, env, stdout=log)


def _run_one(children: sweep.Children, study: Study, run: Run, out: pathlib.Path, env: dict) -> int:
    workdir = out / study.name / run.run_id
    code = _run_logged(children, sweep.command(study, run, workdir), workdir, env)
    if sweep.is_finished(workdir):  # a done run is never resumed: its checkpoints (~0.4 GB at width 512) go
        shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
    return code


def execute(out: pathlib.Path, cells, jobs: int, log=print, runner=None, envs=None, prepare=None) -> None:
    """Run the screen's queue until nothing is left that the rows call for (or every run left failed).

    ``runner(study, run, out, env) -> returncode`` runs one run (default: the CLI in a subprocess),
    ``envs`` are the job slots (default :func:`experiments.sweep.job_envs` for ``jobs``), ``prepare``
    readies a study's corpora (default :func:`experiments.sweep.prepare_corpora`); tests inject them."""
    children = sweep.Children()
    runner, prepare = runner or functools.partial(_run_one, children), prepare or sweep.prepare_corpora
    envs = envs if envs is not None else sweep.job_envs(*sweep.accelerators(), max(jobs, 1))
    screen = Screen(out, cells)
    free, running, failed, prepared, broken = list(envs), {}, set(), set(), set()
    with children.forwarding(), concurrent.futures.ThreadPoolExecutor(max_workers=len(envs)) as pool:
        while True:
            screen.refresh()
            wanted = [(s, r) for s, r in screen.next_runs() if r.variant.split("/")[0] not in broken
                      and f"{s.name}/{r.run_id}" not in running and f"{s.name}/{r.run_id}" not in failed
                      and not children.stopping]
            screen.write_results()
            while free and wanted:
                study, run = wanted.pop(0)
                cell = run.variant.split("/")[0]
                if cell not in prepared:
                    try:
                        if factors.CELLS[cell][0].get("data.tokenizer") == "BPE":
                            factors.bpe_tokenizer(log)
                        prepare(study, log)
                    except Exception as e:  # pylint: disable=broad-except  (the other cells go on)
                        log(f"[screen] cell {cell}: its data could not be prepared ({e}); its runs are skipped")
                        broken.add(cell)
                        wanted = [(s, r) for s, r in wanted if r.variant.split("/")[0] != cell]
                        continue
                    prepared.add(cell)
                env = free.pop(0)
                key = f"{study.name}/{run.run_id}"
                log(f"[screen] {key}: running" + (f" with {env}" if env else ""))
                running[key] = (pool.submit(runner, study, run, out, env), env, time.time())
            if not running:
                break
            done, _ = concurrent.futures.wait([f for f, _, _ in running.values()],
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for key, (future, env, t0) in list(running.items()):
                if future in done:
                    del running[key]
                    free.append(env)
                    workdir = out / key
                    try:
                        code = future.result()
                    except sweep.Stopped:  # SIGTERM came between its slot and its start: it never ran
                        continue
                    if children.stopping:
                        log(f"[screen] {key}: {sweep.run_status(workdir) or 'stopped'} by SIGTERM")
                    elif code != 0 and sweep.run_status(workdir) != "diverged":
                        failed.add(key)
                        log(f"[screen] {key}: failed with exit code {code}; its log is {workdir / 'run.log'}")
                    else:
                        log(f"[screen] {key}: {sweep.run_status(workdir)} in {(time.time() - t0) / 60:.1f} min")
    screen.refresh()
    screen.next_runs()
    screen.write_results()
    if children.stopping:
        log(f"[screen] stopped by SIGTERM: every running run was stopped where it can resume, and the done "
            f"ones' rows are in {out / TUNE} and {out / MEASURE}; run the same command again to resume")
        raise sweep.Stopped()
    log(f"[screen] nothing left to run ({len(failed)} failed); rows in {out / TUNE} and {out / MEASURE}")


PILOT_UPDATES = 320
PILOT_RECORDS = records.BENCH_DIR / "factors_pilot.jsonl"


def pilot_run(cell: str, opt: str = "adamw") -> tuple[Study, Run]:
    """The pilot of ``cell`` for ``opt``: the cell's sync run of ``opt`` at the grid's centre, seed 0,
    cut to :data:`PILOT_UPDATES` updates (fewer if the cell has fewer), with the run's evaluations
    scaled with it (10 validations and the test split), so its wall time is a whole run's overhead
    plus ``PILOT_UPDATES`` updates."""
    base = factors.CELLS[cell][0]
    updates = min(PILOT_UPDATES, base["train.steps"])
    o = {**factors.overrides(cell, opt, "sync", factors.centre(cell, opt)), "train.steps": updates,
         "optimizer.warmup_steps": updates // 10, "train.eval_every": updates // 10, "train.checkpoint_every": updates}
    study = Study("factors_pilot", factors.CONFIG, {f"{cell}/{opt}": o}, seeds=(0,))
    return study, sweep.expand(study)[0]


def run_pilots(cells, jobs: int, out: pathlib.Path, records_path: pathlib.Path = PILOT_RECORDS, log=print,
               runner=None, envs=None, prepare=None, optimizers=None) -> None:
    """Run every cell's pilots (:func:`pilot_run`, one per optimizer of the screen: Muon's step costs
    more than AdamW's on a CPU), ``jobs`` at a time each on its own core as the screen runs them, and
    append one ``factors_pilot`` record per pilot to ``records_path``.  ``runner(cmd, workdir, env)
    -> returncode``, ``envs`` and ``prepare`` as in :func:`execute` (tests inject them)."""
    from experiments.record_run import figures_from_workdir

    children = sweep.Children()
    runner, prepare = runner or functools.partial(_run_logged, children), prepare or sweep.prepare_corpora
    envs = envs if envs is not None else sweep.job_envs(*sweep.accelerators(), max(jobs, 1))
    slots: queue.Queue = queue.Queue()  # the job slots' environments, each held by one pilot at a time
    for env in envs:
        slots.put(env)

    def one(pilot: tuple[str, str]) -> None:
        cell, opt = pilot
        study, run = pilot_run(cell, opt)
        if factors.CELLS[cell][0].get("data.tokenizer") == "BPE":
            factors.bpe_tokenizer(log)
        prepare(study, log)
        workdir = out / "factors_pilot" / run.run_id
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        cmd = sweep.command(study, run, workdir)
        env = slots.get()
        if children.stopping:
            slots.put(env)
            return
        try:
            t0 = time.perf_counter()
            code = runner(cmd, workdir, env)
            wall = time.perf_counter() - t0
        finally:
            slots.put(env)
        if children.stopping:
            log(f"[pilot] {cell} {opt}: stopped by SIGTERM, not recorded")
            return
        if code != 0:
            log(f"[pilot] {cell} {opt}: failed with exit code {code}; its log is {workdir / 'run.log'}")
            return
        figures = {"wall_s": round(wall, 1), **figures_from_workdir(workdir), "jobs": len(envs)}
        records.append(records_path, records.make("factors_pilot", figures, command=shlex.join(
            ["python", "-m", "asyncpp_jax.main", *cmd[3:]]), cell=cell))
        log(f"[pilot] {cell} {opt}: {figures['updates']} updates in {wall:.0f} s, "
            f"{figures.get('s_per_update', 0):.3f} s per update (median)")

    with children.forwarding(), concurrent.futures.ThreadPoolExecutor(max_workers=len(envs)) as pool:
        list(pool.map(one, [(c, o) for c in cells for o in (optimizers or factors.OPTIMIZERS)
                            if o in factors.optimizers_of(c)]))
    if children.stopping:
        raise sweep.Stopped()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/studies")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--cells", metavar="REGEX", default=None,
                    help="only the cells whose name matches (a cut cell, factors.CUT, runs only when named here)")
    ap.add_argument("--pilot", action="store_true",
                    help=f"run each cell's {PILOT_UPDATES}-update pilots (every cell, cut ones included, unless "
                    "--cells) and record their cost in experiments/results/bench/factors_pilot.jsonl, then exit")
    ap.add_argument("--pilot_optimizers", metavar="NAMES", default=",".join(factors.OPTIMIZERS),
                    help="the optimizers to pilot, comma separated (default: the contrast, AdamW and Muon; "
                    "each only in the cells that measure it)")
    ap.add_argument("--list", action="store_true", help="print the runs the done rows call for next, and exit")
    ap.add_argument("--restore", metavar="RESULTS", nargs="*", default=(),
                    help="results.jsonl files whose done factors rows stand for their runs")
    ap.add_argument("--merge", metavar="RESULTS", default=None,
                    help="write the rows done so far under --out into RESULTS (e.g. experiments/results/"
                    "cpu_regime/results.jsonl), in place of its factors rows, and exit (runs nothing)")
    a = ap.parse_args(argv)
    every = factors.ORDER
    if a.cells is not None:
        cells = [c for c in every if re.search(a.cells, c)]
    else:
        cells = list(every if a.pilot else factors.QUEUE)
    if not cells:
        ap.error(f"--cells {a.cells!r} matches no cell of {', '.join(every)}")
    out = pathlib.Path(a.out)
    if a.pilot:
        try:
            sweep.job_envs(*sweep.accelerators(), max(a.jobs, 1))
        except ValueError as e:
            ap.error(str(e))
        opts = [o for o in a.pilot_optimizers.split(",") if o]
        known = factors.OPTIMIZERS + factors.MORE_OPTIMIZERS
        if not opts or set(opts) - set(known):
            ap.error(f"--pilot_optimizers {a.pilot_optimizers!r}: choose from {', '.join(known)}")
        if not any(o in factors.optimizers_of(c) for c in cells for o in opts):
            ap.error(f"--pilot_optimizers {a.pilot_optimizers!r}: no cell of --cells measures them "
                     f"({', '.join(factors.MORE_OPTIMIZERS)} are width=128's only)")
        try:
            run_pilots(cells, a.jobs, out, optimizers=opts)
        except sweep.Stopped:
            sys.exit(sweep.STOPPED_EXIT)
        return
    if a.restore:
        restore(out, cells, [json.loads(line) for p in a.restore for line in pathlib.Path(p).read_text().splitlines()
                             if line.strip()])
    if a.merge:
        print(merge(out, cells, pathlib.Path(a.merge)))
        return
    if a.list:
        screen = Screen(out, cells)
        screen.refresh()
        for study, run in screen.next_runs():
            print(f"{study.name}/{run.run_id}")
        return
    try:
        sweep.job_envs(*sweep.accelerators(), max(a.jobs, 1))
    except ValueError as e:
        ap.error(str(e))
    try:
        execute(out, cells, a.jobs)
    except sweep.Stopped:
        sys.exit(sweep.STOPPED_EXIT)


def merge(out: pathlib.Path, cells, results: pathlib.Path) -> str:
    """Replace ``results``' factors rows by the done rows under ``out`` (other studies' rows kept, in
    their order; the screen's after them); returns a line saying what was written."""
    screen = Screen(out, cells)
    screen.refresh()
    screen.next_runs()
    keep = [line for line in (results.read_text().splitlines() if results.exists() else [])
            if line.strip() and json.loads(line).get("study") not in (TUNE, MEASURE)]
    new = [json.dumps(r) for name in (TUNE, MEASURE) for r in sorted(screen.rows_of(name), key=lambda r: r["run_id"])]
    tmp = results.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep + new))
    os.replace(tmp, results)
    return (f"{results}: {len(keep)} other rows kept, {len(new)} factors rows written; now run python -m "
            f"experiments.report {results} --out {results.parent} && python -m experiments.render_docs")


def restore(out: pathlib.Path, cells, rows) -> None:
    """Lay out the done runs of ``rows`` (committed factors rows) under ``out``, step by step as the
    plan reaches them, so that the screen skips them."""
    while True:
        screen = Screen(out, cells)
        screen.refresh()
        restored = 0
        for study, run in screen.next_runs():
            restored += len(sweep.restore(Study(study.name, study.config, {run.variant: run.overrides},
                                                seeds=(run.seed,)), rows, out / study.name, log=lambda *_: None))
        if not restored:
            return


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
