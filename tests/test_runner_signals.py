"""SIGTERM to a study's runner (``experiments.sweep`` or the factor screen) reaches every run it
started: each saves and exits, the runner starts nothing new and exits 143 without a traceback, and
no run is left behind as an orphan.  Real processes; each run is a stand-in script, not the trainer."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A run: records its pid, then waits; SIGTERM makes it write `saved` (its preemption checkpoint) and exit 0,
# as the trainer does.
RUN = textwrap.dedent("""
    import os, pathlib, signal, sys, time
    workdir = pathlib.Path(sys.argv[1])
    workdir.mkdir(parents=True, exist_ok=True)
    def preempted(signum, frame):
        (workdir / "saved").write_text("1")
        sys.exit(0)
    signal.signal(signal.SIGTERM, preempted)
    (workdir / "pid").write_text(str(os.getpid()))
    time.sleep(120)
""")

SWEEP = textwrap.dedent("""
    import pathlib, sys
    from experiments import sweep
    sweep.command = lambda study, run, workdir: [sys.executable, {run!r}, str(workdir)]
    study = sweep.Study("signals", "configs/tiny.py", {{"a": {{}}, "b": {{}}, "c": {{}}}}, seeds=(0,))
    try:
        sweep.execute(study, pathlib.Path({out!r}), 2, envs=[{{}}, {{}}], prepare=lambda s, log: None,
                      reuse_done=False)
    except sweep.Stopped:
        print("stopped", file=sys.stderr)
        sys.exit(sweep.STOPPED_EXIT)
""")

SCREEN = textwrap.dedent("""
    import pathlib, sys
    from experiments import screen, sweep
    sweep.command = lambda study, run, workdir: [sys.executable, {run!r}, str(workdir)]
    try:
        screen.execute(pathlib.Path({out!r}), ["width=128"], 2, envs=[{{}}, {{}}], prepare=lambda s, log: None)
    except sweep.Stopped:
        sys.exit(sweep.STOPPED_EXIT)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("runner", ["sweep", "screen"])
def test_sigterm_to_the_runner_stops_every_run_and_leaves_no_orphan(tmp_path, runner):
    run = tmp_path / "run.py"
    run.write_text(RUN)
    out = tmp_path / "out"
    source = (SWEEP if runner == "sweep" else SCREEN).format(run=str(run), out=str(out))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", source], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while len(list(out.rglob("pid"))) < 2:  # both job slots busy
            assert parent.poll() is None, parent.communicate()
            assert time.time() < deadline, "the runner never started two runs"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in out.rglob("pid")]
        parent.send_signal(signal.SIGTERM)
        _, err = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    started = sorted(p.parent for p in out.rglob("pid"))
    assert len(started) == 2, "a run started after SIGTERM"
    assert all((w / "saved").exists() for w in started), "a run was not told to save"
    assert not any(_alive(pid) for pid in pids)
