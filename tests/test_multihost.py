"""Several local processes as one multi-host job, started by the launcher exactly as a user would.

Each launch is ``python -m asyncpp_jax.launch --processes N --devices_per_process K -- ...``: N JAX
processes joined by ``jax.distributed`` (gloo collectives) into one N*K-device mesh.  The same
config must end with the same parameters whatever N x K is, and SIGTERM to any one process must
stop all of them at one saved step from which a rerun ends where an uninterrupted run does.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from asyncpp_jax import configs

STDLIB = sysconfig.get_paths()["stdlib"]
SOURCE = f"{STDLIB}/json/*.py,{STDLIB}/email/*.py"


def _args(cache_dir, workdir, **overrides) -> list[str]:
    settings = {
        "data.source": SOURCE, "data.cache_dir": cache_dir, "data.seq_len": 16, "data.val_fraction": 0.2,
        "model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 1, "model.d_ff": 64, "model.n_layers": 4,
        "train.steps": 3, "train.eval_every": 1000, "train.eval_batches": 1, "train.log_every": 1,
        "train.checkpoint_every": 1000, "train.progress_bar": False, "optimizer.warmup_steps": 1,
        "optimizer.lr": 1e-2, **overrides,
    }
    return ["--config=configs/tiny.py", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in settings.items())]


def _launch_cmd(processes, devices, args) -> list[str]:
    return [sys.executable, "-m", "asyncpp_jax.launch", f"--processes={processes}",
            f"--devices_per_process={devices}", "--", *args]


def _launch(processes, devices, args, timeout=600) -> subprocess.CompletedProcess:
    out = subprocess.run(_launch_cmd(processes, devices, args), cwd=configs.REPO_ROOT, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    return out


def _params(workdir, step) -> list[np.ndarray]:
    """The saved params at ``step``, as host arrays (whatever mesh wrote them)."""
    path = pathlib.Path(workdir) / "checkpoints" / str(step) / "state"
    ckpt = ocp.PyTreeCheckpointer()
    tree = ckpt.metadata(path).item_metadata
    state = ckpt.restore(path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    return jax.tree.leaves(state["params"])


def _assert_same_params(reference, other, what):
    assert len(reference) == len(other)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, other))
    print(f"{what}: max |param difference| = {worst:.3g}")
    for a, b in zip(reference, other):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=what)


LAYOUTS = [(1, 8), (2, 4), (4, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", [
    # simulate runner, data parallel over all 8 devices: replicas across processes
    ("simulate", {"mesh.data": 8, "train.global_batch_size": 32, "train.microbatches": 2}),
    # the pipeline engine under 2bw, data 2 x stage 4: at 4 x 2 each replica's stages span two
    # processes (which must load the same rows); at 2 x 4 each process holds one replica
    ("pipeline_2bw", {"mesh.data": 2, "pipeline.stages": 4, "pipeline.schedule": "2bw",
                      "train.global_batch_size": 24, "train.microbatches": 6}),
])
def test_same_params_for_1x8_2x4_4x2(cache_dir, tmp_path, name, overrides):
    params = {}
    for processes, devices in LAYOUTS:
        workdir = tmp_path / f"{processes}x{devices}"
        out = _launch(processes, devices, _args(cache_dir, workdir, **overrides))
        assert out.stdout.count("finished at step 3/3") == processes
        params[processes, devices] = _params(workdir, 3)
    reference = params[LAYOUTS[0]]
    initial_change = max(float(np.max(np.abs(a))) for a in reference)
    assert initial_change > 0
    for layout in LAYOUTS[1:]:
        _assert_same_params(reference, params[layout], f"{name} {layout[0]}x{layout[1]} vs 1x8")


def _wait_for_steps(metrics: pathlib.Path, proc, n: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {n} logged steps in {metrics} within {timeout}s")


@pytest.mark.slow
def test_sigterm_to_one_process_saves_the_same_step_everywhere_and_resumes_exactly(cache_dir, tmp_path):
    steps = 600  # long enough that the signal lands mid-run on an idle machine (a few ms a step)
    overrides = {"mesh.data": 4, "train.global_batch_size": 8, "train.microbatches": 1, "train.steps": steps}
    args = _args(cache_dir, tmp_path / "preempted", **overrides)
    proc = subprocess.Popen(_launch_cmd(2, 2, args), cwd=configs.REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    pids = {}
    while len(pids) < 2:
        m = re.match(r"launch: process (\d+) pid (\d+)", proc.stdout.readline())
        if m:
            pids[int(m.group(1))] = int(m.group(2))
    _wait_for_steps(tmp_path / "preempted" / "metrics.jsonl", proc, 3)
    os.kill(pids[1], signal.SIGTERM)  # one process only, not process 0 and not the launcher
    output = proc.stdout.read()
    assert proc.wait(timeout=300) == 0, output[-4000:]
    stopped = dict(re.findall(r"\[(\d)\] preempted at step (\d+)/", output))
    assert set(stopped) == {"0", "1"} and len(set(stopped.values())) == 1, output[-3000:]
    step = int(stopped["0"])
    assert 3 <= step < steps
    status = json.loads((tmp_path / "preempted" / "status.json").read_text())
    assert status == {**status, "status": "preempted", "step": step}
    assert sorted(p.name for p in (tmp_path / "preempted" / "checkpoints").iterdir() if p.name.isdigit()) == [str(step)]

    resumed = _launch(2, 2, args)  # the same command again
    assert resumed.stdout.count(f"finished at step {steps}/{steps}") == 2
    _launch(2, 2, _args(cache_dir, tmp_path / "uninterrupted", **overrides))
    a, b = _params(tmp_path / "uninterrupted", steps), _params(tmp_path / "preempted", steps)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


# Not slow (~15 s): the default run's one multi-host launch (two processes form a job, both stop).
def test_a_mesh_that_leaves_a_process_out_stops_every_process_with_a_clear_error(cache_dir, tmp_path):
    # data 2 on 2 processes x 2 devices: the mesh is process 0's two devices; process 1 holds none.
    args = _args(cache_dir, tmp_path / "run", **{"mesh.data": 2, "train.global_batch_size": 8})
    out = subprocess.run(_launch_cmd(2, 2, args), cwd=configs.REPO_ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 2, out.stdout[-3000:]
    for i in (0, 1):
        assert f"[{i}] error: processes [1] hold none of the mesh's 2 devices" in out.stdout
    assert "config.mesh.data=-1" in out.stdout and "Traceback" not in out.stdout
