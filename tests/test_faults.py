"""The fault battery: damaged checkpoints, unwritable or full checkpoint directories, a resume with
changed settings, signals, and the records a run leaves behind.

One sealed 4-step run (checkpoints at steps 2 and 4) is made once; each test damages a copy.
"""

import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncpp_jax import configs
from asyncpp_jax.train import checkpoint as ckpt_lib
from asyncpp_jax.train.checkpoint import CheckpointError
from asyncpp_jax.train.metrics import drop_rows_after
from asyncpp_jax.train.resume import ResumeRefused
from asyncpp_jax.train.preemption import StopFlag
from asyncpp_jax.train.trainer import Trainer, TrainingDiverged
from helpers import SMALL_MODEL, SOURCE, run_cli, small_train_config



def fault_config(cache_dir, **train):
    train = dict(dict(steps=4, microbatches=1, eval_every=2, eval_batches=1, checkpoint_every=2), **train)
    return small_train_config(cache_dir, "faults", 1, **train)


def cli_args(cache_dir, workdir, *extra):
    model = [f"--config.model.{k}={v}" for k, v in SMALL_MODEL.items()]
    return [f"--workdir={workdir}", f"--config.data.source={SOURCE}",
            f"--config.data.cache_dir={cache_dir}", "--config.data.seq_len=32", "--config.data.val_fraction=0.2",
            *model, "--config.train.steps=4", "--config.train.global_batch_size=8",
            "--config.train.microbatches=1", "--config.train.eval_every=2", "--config.train.eval_batches=1",
            "--config.train.checkpoint_every=2", "--config.train.progress_bar=False",
            "--config.optimizer.warmup_steps=1", *extra]


def snapshot(root: pathlib.Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def biggest_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((p for p in step_dir.rglob("*") if p.is_file() and p.name != ckpt_lib.MANIFEST),
               key=lambda p: p.stat().st_size)


def xor_bytes(path: pathlib.Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(mid + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def sealed_run(cache_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sealed")
    t = Trainer(fault_config(cache_dir), workdir)
    t.run()
    t.close()
    return workdir, jax.device_get(t.state.params), (t.train_step, t.eval_step)


@pytest.fixture
def trainer(sealed_run, cache_dir):
    """``trainer(workdir)``: a Trainer of the default fault config that reuses the sealed run's
    compiled train and eval steps (same config and mesh), so each test compiles nothing."""
    train_step, eval_step = sealed_run[2]

    def make(workdir):
        t = Trainer(fault_config(cache_dir), workdir)
        t.train_step, t.eval_step = train_step, eval_step
        return t

    return make


@pytest.fixture
def damaged_copy(sealed_run, tmp_path):
    src = sealed_run[0]
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def test_checkpoints_are_sealed_with_checksums_and_layout(sealed_run):
    workdir = sealed_run[0]
    for step in (2, 4):
        manifest = ckpt_lib.read_manifest(workdir / "checkpoints" / str(step))
        assert manifest["step"] == step and manifest["files"] and ".params['embed']['embedding']" in manifest["layout"]
        assert ckpt_lib.verify(workdir / "checkpoints" / str(step)) is None


def test_verify_names_truncated_altered_and_missing_files(damaged_copy):
    step_dir = damaged_copy / "checkpoints" / "4"
    victim = biggest_file(step_dir)
    size = victim.stat().st_size
    os.truncate(victim, size // 2)
    assert ckpt_lib.verify(step_dir) == f"{victim} has {size // 2} bytes where {size} were written (truncated or altered)"
    step_dir = damaged_copy / "checkpoints" / "2"
    victim = biggest_file(step_dir)
    xor_bytes(victim)
    assert ckpt_lib.verify(step_dir) == f"{victim} fails its SHA-256 checksum (its bytes changed after the write)"
    victim.unlink()
    assert ckpt_lib.verify(step_dir) == f"{victim} is missing"
    (step_dir / ckpt_lib.MANIFEST).unlink()
    assert "no readable asyncpp_manifest.json" in ckpt_lib.verify(step_dir)


def test_corrupt_latest_is_skipped_for_the_newest_intact(sealed_run, damaged_copy, trainer, caplog):
    """64 XOR-ed bytes in the latest checkpoint: warned about, set aside, steps 3-4 redone, and the
    run ends on exactly the parameters of the undamaged run; metrics.jsonl keeps one row per step."""
    full_params = sealed_run[1]
    latest = damaged_copy / "checkpoints" / "4"
    xor_bytes(biggest_file(latest))
    t = trainer(damaged_copy)
    with caplog.at_level(logging.WARNING, logger="asyncpp_jax"):
        result = t.run()
    t.close()
    assert result.status == "finished" and result.step == 4
    warnings = caplog.text
    assert f"checkpoint {latest} is unusable" in warnings and "SHA-256" in warnings
    assert "resuming from step 2 instead of step 4: 2 step(s) will be redone" in warnings
    assert (damaged_copy / "checkpoints_unusable" / "4").is_dir()
    assert ckpt_lib.verify(latest) is None  # step 4 written afresh and sealed
    for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(jax.device_get(t.state.params))):
        np.testing.assert_array_equal(a, b)
    steps = [json.loads(x)["step"] for x in (damaged_copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.slow
def test_cli_no_intact_checkpoint_exits_1_and_changes_nothing(damaged_copy, cache_dir):
    for step in ("2", "4"):
        os.truncate(biggest_file(damaged_copy / "checkpoints" / step), 10)
    before = snapshot(damaged_copy)
    out = run_cli(cli_args(cache_dir, damaged_copy))
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert "none of the 2 checkpoint(s)" in out.stderr and "is intact" in out.stderr
    assert str(damaged_copy / "checkpoints" / "4") in out.stderr and "nothing was changed" in out.stderr
    assert snapshot(damaged_copy) == before


def test_resume_with_changed_layout_is_refused_before_anything_changes(damaged_copy, cache_dir):
    before = snapshot(damaged_copy)
    c = fault_config(cache_dir)
    c.model.d_model = 48
    c.optimizer.name = "lion"
    with pytest.raises(ResumeRefused) as e:
        Trainer(c, damaged_copy)
    message = str(e.value)
    assert "model.d_model: 32 -> 48" in message and "optimizer.name: 'adamw' -> 'lion'" in message
    assert "a new --workdir" in message and "Nothing in the workdir was changed" in message
    assert snapshot(damaged_copy) == before
    # a compatible change (more steps) resumes, and config.json keeps the settings the run started with
    c = fault_config(cache_dir, steps=6)
    Trainer(c, damaged_copy).close()
    assert json.loads((damaged_copy / "config.json").read_text())["train"]["steps"] == 4


def test_checkpoint_directory_lost_mid_run_fails_at_the_next_save(trainer, tmp_path):
    t = trainer(tmp_path)
    inner = t.train_step
    ckpt_dir = tmp_path / "checkpoints"

    def lose_directory(state, batch):
        if int(state.step) == 2:  # after the checkpoint of step 2 has landed
            t.checkpointer.wait()
            shutil.rmtree(ckpt_dir)
            ckpt_dir.write_text("not a directory")
        return inner(state, batch)

    t.train_step = lose_directory
    with pytest.raises(CheckpointError, match=f"cannot write checkpoints to {ckpt_dir}: cannot write {ckpt_dir}"):
        t.run()
    t.close()
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "checkpoint_failed" and status["step"] == 4
    assert str(ckpt_dir) in status["error"] and "Not a directory" in status["error"]


def test_nan_at_the_first_update_blames_the_setup_not_the_lr(trainer, tmp_path):
    t = trainer(tmp_path)
    inner = t.train_step

    def nan_from_start(state, batch):
        new, metrics = inner(state, batch)
        return new, dict(metrics, loss=jnp.float32(np.nan))

    t.train_step = nan_from_start
    with pytest.raises(TrainingDiverged) as e:
        t.run()
    t.close()
    message = str(e.value)
    assert "at step 1" in message and "No checkpoint had been saved yet" in message
    assert "initialization or a setting" in message and "None" not in message
    assert "Lower config.optimizer.lr" not in message


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test: a shell that starts the suite in the background
    gives it SIGINT ignored, and the trainer rightly restores (and defers to) what it found."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_stops_like_sigterm_and_status_holds_one_step(trainer, tmp_path, default_sigint):
    """Ctrl-C at update 3: a checkpoint at 3, status 'preempted' at 3 without step 2's val loss."""
    t = trainer(tmp_path)
    inner = t.train_step

    def interrupt_at_3(state, batch):
        n = int(state.step)
        out = inner(state, batch)
        if n == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    t.train_step = interrupt_at_3
    result = t.run()
    t.close()
    assert result.status == "preempted" and result.step == 3 and result.val_loss is None
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "preempted" and status["step"] == 3 and "val_loss" not in status
    assert ckpt_lib.verify(tmp_path / "checkpoints" / "3") is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_second_signal_stops_at_once(default_sigint):
    with pytest.raises(KeyboardInterrupt):
        with StopFlag() as flag:
            signal.raise_signal(signal.SIGINT)
            assert flag.set
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_metrics_rows_after_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join(rows) + '\n{"step": 5, "lo')  # killed mid-line after step 4
    assert drop_rows_after(path, 2) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user+mount namespaces (unshare -Urm)")
@pytest.mark.parametrize("fault", ["read_only", "full_disk"])
def test_cli_unwritable_or_full_checkpoint_directory_fails_fast(cache_dir, tmp_path, fault):
    """A read-only checkpoint directory (a read-only bind mount) or a full disk (a 256 KiB tmpfs)
    in a private mount namespace: exit 1 within the subprocess timeout, path and cause named, and
    status.json saying so (orbax alone waits on a barrier for 5 minutes, then dies)."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    cmd = " ".join(f"'{a}'" for a in [sys.executable, "-m", "asyncpp_jax.main", *cli_args(cache_dir, workdir)])
    if fault == "read_only":
        mount = (f"mount --bind {workdir}/checkpoints {workdir}/checkpoints && "
                 f"mount -o remount,ro,bind {workdir}/checkpoints")
        cause = "Read-only file system"
    else:
        mount = f"mount -t tmpfs -o size=256k none {workdir}"
        cause = "MiB free"
    script = f"{mount} && mkdir -p {workdir}/checkpoints && cd {configs.REPO_ROOT} && exec {cmd}"
    out = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert f"cannot write checkpoints to {workdir}/checkpoints" in out.stderr and cause in out.stderr
    if fault == "read_only":  # the tmpfs vanished with its namespace; the bind mount's workdir did not
        status = json.loads((workdir / "status.json").read_text())
        assert status["status"] == "checkpoint_failed" and cause in status["error"]


_MULTIHOST_WORKER = """
import sys
pid, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
import jax
jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
from asyncpp_jax.train import checkpoint as ck
if pid == 1:  # only process 1's file system refuses the write
    ck._local_write_problem = lambda d, n: f"cannot write {d}: [Errno 28] No space left on device"
c = ck.Checkpointer(directory, keep=2)
try:
    c.check_writable(1000)
    print(f"process {pid}: wrote", flush=True)
except ck.CheckpointError as e:
    print(f"process {pid}: refused: {e}", flush=True)
c.close()
"""


@pytest.mark.slow
def test_processes_agree_on_a_write_failure(tmp_path):
    """Two processes form one job (gloo on CPU); only process 1 cannot write, and both stop
    instead of process 0 writing and then waiting on a barrier for its failed peer."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"  # gloo between two CPU processes, on any host
    procs = [subprocess.Popen([sys.executable, "-c", _MULTIHOST_WORKER, str(i), str(port), str(tmp_path / "ck")],
                              cwd=configs.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert "process 0: refused: cannot write checkpoints to" in outs[0][0] and "process(es) [1]" in outs[0][0], outs[0]
    assert "process 1: refused:" in outs[1][0] and "No space left on device" in outs[1][0], outs[1]
