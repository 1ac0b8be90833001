"""The fault battery: damaged checkpoints, unwritable or full checkpoint directories, a resume with
changed settings, signals, and the records a run leaves behind.

One sealed 4-step run (checkpoints at steps 2 and 4) is made once; each test damages a copy.
"""

import json
import logging
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

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
    # a compatible change (more steps) resumes; config.json holds the settings of this latest start,
    # and each checkpoint keeps those it was trained under
    c = fault_config(cache_dir, steps=6)
    t = Trainer(c, damaged_copy)
    held = {k: v for k, v in snapshot(damaged_copy).items() if k != "run.lock"}  # the open trainer's lock
    assert held == before  # config.json is written when the run starts, not when it is set up
    t.run(until_step=4)
    t.close()
    assert json.loads((damaged_copy / "config.json").read_text())["train"]["steps"] == 6
    assert ckpt_lib.read_manifest(damaged_copy / "checkpoints" / "4")["run"]["config"]["train"]["steps"] == 4


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


def sigint_after_update(train_step, update: int):
    """``train_step`` that sends this process SIGINT (Ctrl-C) once update ``update`` is done."""
    def step(state, batch):
        n = int(state.step)
        out = train_step(state, batch)
        if n == update - 1:
            os.kill(os.getpid(), signal.SIGINT)
        return out
    return step


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
    t.train_step = sigint_after_update(t.train_step, 3)
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


def _bytes_read() -> int:
    return int(next(line.split()[1] for line in open("/proc/self/io") if line.startswith("rchar:")))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts the bytes read through /proc/self/io")
def test_a_resume_reads_only_the_tail_of_metrics_jsonl(tmp_path):
    """Before: the whole file was read (and rewritten) at every start.  Now: 24 MB of rows, of which
    the last two are dropped, cost well under one MB of reads, and the head is left as it was."""
    path = tmp_path / "metrics.jsonl"
    row = lambda s: json.dumps({"step": s, "loss": 1.0, "note": "x" * 200}) + "\n"  # noqa: E731
    path.write_text("".join(row(s) for s in range(1, 100_001)) + '{"step": 100001, "lo')
    before = _bytes_read()
    assert drop_rows_after(path, 99_998) == 3
    assert _bytes_read() - before < 1 << 20
    with open(path, "rb") as f:
        f.seek(-2 * len(row(99_998)), os.SEEK_END)
        assert f.read().decode() == row(99_997) + row(99_998)


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


# ------------------------------------------------------------------------------------------------
# Issue 31: the faults a training engineer meets.  Each case failed before the fix named beside it.

def _rows(workdir) -> dict:
    """``{step: (loss, grad_norm)}`` of a run's metrics.jsonl."""
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r.get("loss"), r["grad_norm"]) for r in rows}


def test_nan_in_a_state_the_loss_does_not_show_is_never_saved(trainer, tmp_path, cache_dir):
    """Non-finite optimizer state behind a finite loss (as the 2bw engine's in-flight gradient is at
    lr=1e4): the save at step 3 is refused, step 2 stays the last good checkpoint, and a resume from it
    trains on.  Before: step 3 was saved with the NaN and called good."""
    t = trainer(tmp_path)
    inner = t.train_step
    t.config.train.checkpoint_every = 1

    def poison_state(state, batch):
        n = int(state.step)
        new, metrics = inner(state, batch)
        if n == 2:  # the state after update 3 carries a NaN; its metrics are finite
            new = new.replace(opt_state=jax.tree.map(
                lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim else x, new.opt_state))
        return new, metrics

    t.train_step = poison_state
    with pytest.raises(TrainingDiverged, match=r"state after step 3 holds non-finite values .*\.opt_state.*"
                                               r"last good checkpoint is step 2"):
        t.run()
    t.close()
    assert t.checkpointer.sealed_steps() == [1, 2]
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "diverged"
    t = trainer(tmp_path)
    assert t.run().status == "finished"
    t.close()
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(t.state)) if x.dtype.kind == "f")


def test_2bw_at_a_huge_lr_names_a_checkpoint_that_trains_on_at_a_sane_lr(cache_dir, tmp_path):
    """The issue's case under the simulate runner: 2bw at lr=1e4 leaves finite weights whose gradient is
    exactly 0 from update 3 (saturated), then a NaN at update 5.  Checkpoints 2-4 were never followed by
    live updates: they are set aside, step 1 is named good, and a rerun at lr=1e-2 from it trains on.
    (Before: step 4 was named good, and every resume from it died again.)"""
    c = small_train_config(cache_dir, "huge_lr", 1, steps=8, microbatches=1, eval_every=100, eval_batches=1,
                           checkpoint_every=1)
    c.staleness.mode = "2bw"
    c.optimizer.lr = 1e4
    t = Trainer(c, tmp_path)
    with pytest.raises(TrainingDiverged, match=r"last good checkpoint is step 1 .*Checkpoint\(s\) 2, 3, 4 were not "
                                               r"proven .*stopped being live at update 3: grad norm exactly 0"):
        t.run()
    t.close()
    assert json.loads((tmp_path / "status.json").read_text())["last_checkpoint"] == 1
    assert t.checkpointer.sealed_steps() == [1]
    assert sorted(p.name for p in (tmp_path / ckpt_lib.UNUSABLE_DIR).iterdir()) == ["2", "3", "4"]
    c.optimizer.lr = 1e-2
    t = Trainer(c, tmp_path)
    assert t.run().status == "finished"
    t.close()
    rows = _rows(tmp_path)
    assert all(rows[s][1] > 0 and math.isfinite(rows[s][0]) for s in range(2, 9))
    assert rows[8][0] < rows[2][0] - 0.5  # it learns: more than half a nat below the loss it resumed at


def test_a_model_that_dies_mid_run_stops_and_keeps_its_good_checkpoint(trainer, tmp_path):
    """The gradient norm exactly 0 from update 3 on (the loss finite): the run stops at update 5 saying
    the model died.  Retention keeps only 1 checkpoint, yet step 1, the newest good one, is kept beside
    the newer unproven ones, and a rerun resumes from it.  (Before: trained on to exit 0, and
    retention deleted every good checkpoint.)"""
    t = trainer(tmp_path)
    t.config.train.update(checkpoint_every=1, steps=6)  # the loop's bounds; the compiled step is the 4-step run's
    t.checkpointer.keep = 1
    inner = t.train_step

    def dies_at_3(state, batch):
        n = int(state.step)
        new, metrics = inner(state, batch)
        return new, (dict(metrics, grad_norm=jnp.float32(0.0)) if n >= 2 else metrics)

    t.train_step = dies_at_3
    with pytest.raises(TrainingDiverged, match=r"the model died: grad norm exactly 0 over the last 3 updates "
                                               r"\(stopped at step 5\)\. The last good checkpoint is step 1"):
        t.run()
    t.close()
    assert t.checkpointer.sealed_steps() == [1]
    assert sorted(p.name for p in (tmp_path / ckpt_lib.UNUSABLE_DIR).iterdir()) == ["4"]  # 2, 3: retention
    status = json.loads((tmp_path / "status.json").read_text())
    assert (status["status"], status["step"], status["last_checkpoint"]) == ("diverged", 5, 1)
    t = trainer(tmp_path)
    assert t.run().status == "finished"
    t.close()


@pytest.mark.slow  # compiles the 2-stage engine (~1 min on the 2-core machine)
def test_2bw_engine_never_saves_nan_in_flight_state(cache_dir, tmp_path):
    """The issue's case: the engine at 2 stages, lr=1e4, a checkpoint every step.  The in-flight state
    (runner_state.bwd_buf, grad_partial) turns NaN after update 5 while the logged loss (update t-1's) is
    finite; the run stops naming those leaves, and every checkpoint it keeps is finite in every leaf.
    (Before: step 5 was saved with 10 NaN leaves and named the last good checkpoint.)"""
    c = small_train_config(cache_dir, "nan2bw", 1, steps=8, microbatches=2, eval_every=100, eval_batches=1,
                           checkpoint_every=1)
    c.pipeline.update(stages=2, schedule="2bw")
    c.optimizer.lr = 1e4
    t = Trainer(c, tmp_path)
    with pytest.raises(TrainingDiverged, match=r"holds non-finite values .*runner_state\.bwd_buf"):
        t.run()
    t.close()
    sealed = t.checkpointer.sealed_steps()
    assert sealed and json.loads((tmp_path / "status.json").read_text())["last_checkpoint"] == sealed[-1]
    abstract = t.runner.abstract_state(jax.random.key(c.seed))
    checkpointer = ckpt_lib.Checkpointer(tmp_path / "checkpoints", keep=10)
    for step in sealed:
        state, _ = checkpointer.restore(step, abstract, t._new_iterator())
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(state)) if x.dtype.kind == "f"), step
    checkpointer.close()
    # Finite is not enough: from update 4 the gradient is exactly 0 (saturated weights), so only step 1
    # stays good, and resumed from it at a sane lr the run trains on.  (Before: step 5 was resumed from
    # and died again at step 6, every time.)
    assert sealed == [1]
    c.optimizer.lr = 1e-2
    t = Trainer(c, tmp_path)
    assert t.run().status == "finished"
    t.close()
    rows = _rows(tmp_path)
    assert all(rows[s][1] > 0 for s in range(2, 9)) and rows[8][0] < rows[2][0] - 0.5


def test_one_run_per_workdir(trainer, tmp_path, caplog):
    """A second run on a held workdir stops at once naming the holder; a lock left by a killed run is
    taken over.  Before: both ran (metrics interleaved, or orbax hanging on its tmp directory)."""
    from asyncpp_jax.train.workdir_lock import LOCK_FILE, WorkdirBusy

    first = trainer(tmp_path)
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(WorkdirBusy) as e:
        trainer(tmp_path)
    message = str(e.value)
    assert f"pid {os.getpid()}" in message and holder["host"] in message and holder["started"] in message
    assert "another --workdir" in message
    first.close()
    assert not (tmp_path / LOCK_FILE).exists()
    # a stale lock: its file left behind by a run killed with SIGKILL (the kernel dropped its flock)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "gone", "pid": 999999, "started": "yesterday"}))
    with caplog.at_level(logging.WARNING, logger="asyncpp_jax"):
        t = trainer(tmp_path)
    assert "taking over" in caplog.text and "pid 999999" in caplog.text
    t.run()
    t.close()


@pytest.mark.slow
def test_cli_second_run_on_a_held_workdir_exits_at_once(cache_dir, tmp_path):
    from asyncpp_jax.train.workdir_lock import WorkdirLock

    workdir = tmp_path / "run"
    workdir.mkdir()
    lock = WorkdirLock(workdir)
    lock.acquire()
    try:
        out = run_cli(cli_args(cache_dir, workdir))
    finally:
        lock.release()
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"is in use by another run (host " in out.stderr and f"pid {os.getpid()}" in out.stderr
    assert not (workdir / "checkpoints").exists()


def _kill_during_save(cache_dir, workdir, step, phase, keep=5):
    out = subprocess.run([sys.executable, str(configs.REPO_ROOT / "tests" / "kill_harness.py"), str(workdir),
                          cache_dir, str(step), phase, str(keep)], cwd=configs.REPO_ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == -signal.SIGKILL, (out.stdout[-2000:], out.stderr[-3000:])


@pytest.mark.parametrize("step, phase", [
    (4, "begin"),
    pytest.param(4, "writing", marks=pytest.mark.slow),
    pytest.param(4, "commit", marks=pytest.mark.slow),
    pytest.param(4, "seal", marks=pytest.mark.slow),
    pytest.param(2, "begin", marks=pytest.mark.slow),
    pytest.param(2, "writing", marks=pytest.mark.slow),
    pytest.param(2, "commit", marks=pytest.mark.slow),
    pytest.param(2, "seal", marks=pytest.mark.slow),
])
def test_a_kill_during_a_save_costs_at_most_one_interval(sealed_run, trainer, cache_dir, tmp_path, step, phase):
    """SIGKILL at each phase of the save of step 4 (or of the first save, step 2), with sealing slow
    (a large checkpoint): the resume starts from the previous save (or afresh), and every loss and the
    final parameters equal the uninterrupted run's.  Before: the previous step's seal ran on a worker
    thread while step 4's write began, the kill left it unsealed, and no checkpoint was intact."""
    workdir = tmp_path / "run"
    _kill_during_save(cache_dir, workdir, step, phase)
    t = trainer(workdir)
    result = t.run()
    t.close()
    assert result.status == "finished" and result.step == 4
    assert _rows(workdir) == _rows(sealed_run[0])
    for a, b in zip(jax.tree.leaves(sealed_run[1]), jax.tree.leaves(jax.device_get(t.state.params))):
        np.testing.assert_array_equal(a, b)


def test_retention_keeps_the_newest_sealed_steps(trainer, tmp_path):
    t = trainer(tmp_path)
    t.checkpointer.keep = 1
    t.run()
    t.close()
    assert ckpt_lib.step_dirs(tmp_path / "checkpoints").keys() == {4}
    assert ckpt_lib.verify(tmp_path / "checkpoints" / "4") is None


@pytest.mark.slow
def test_a_kill_before_the_seal_with_keep_1_resumes_from_the_previous_step(sealed_run, trainer, cache_dir, tmp_path):
    """keep_checkpoints=1: orbax's own max_to_keep deleted step 2 as soon as step 4 was renamed into place,
    before 4 was sealed, so a kill there left nothing; now step 2 goes only once step 4 is sealed."""
    workdir = tmp_path / "run"
    _kill_during_save(cache_dir, workdir, 4, "commit", keep=1)
    assert ckpt_lib.verify(workdir / "checkpoints" / "2") is None
    t = trainer(workdir)
    t.run()
    t.close()
    assert _rows(workdir) == _rows(sealed_run[0])


def test_manifest_without_its_file_table_is_named_not_a_traceback(damaged_copy):
    step_dir = damaged_copy / "checkpoints" / "4"
    (step_dir / ckpt_lib.MANIFEST).write_text(json.dumps({"step": 4, "layout": {}}))
    assert "unreadable or lacks its table of files" in ckpt_lib.verify(step_dir)  # before: KeyError 'files'
    assert ckpt_lib.Checkpointer(damaged_copy / "checkpoints", keep=5).select_intact()[0] == 2


_CONFIG_FILES = {
    "syntax.py": ("def get_config(:\n", "has a syntax error at line 1"),
    "raises.py": ("def get_config():\n    raise ValueError('boom')\n", "get_config() raised ValueError: boom"),
    "empty.py": ("x = 1\n", "defines no get_config() function"),
    "number.py": ("def get_config():\n    return 5\n", "returned a int, not an ml_collections.ConfigDict"),
}


def test_config_mistakes_are_one_line_errors(tmp_path):
    """A config file that does not load, or an override naming no field: one line, exit 2 (before:
    tracebacks from ml_collections, exit 1)."""
    for name, (text, needle) in _CONFIG_FILES.items():
        (tmp_path / name).write_text(text)
    args = [f"--config={tmp_path / name}" for name in _CONFIG_FILES] + ["--config.model.dmodel=64"]
    code = ("import json, os, sys\nfrom asyncpp_jax import main\n"  # argv empty: main checks nothing at import
            "for a in json.loads(os.environ['ARGS']):\n"
            "    try:\n"
            "        main.preflight([a])\n"
            "    except SystemExit as e:\n"
            "        print('exit', e.code, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=configs.REPO_ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, ARGS=json.dumps(args)))
    assert "Traceback" not in out.stderr, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    for (name, (_, needle)), line in zip(_CONFIG_FILES.items(), lines):
        assert str(tmp_path / name) in line and needle in line, line
    assert "--config.model.dmodel: no such setting; did you mean config.model.d_model?" in lines[4]
    assert out.stderr.count("exit 2") == len(args)


def test_cli_unknown_field_and_parent_workdir_exit_2(tmp_path):
    out = run_cli(["--config.model.dmodel=64", f"--workdir={tmp_path}"])
    assert out.returncode == 2 and "Traceback" not in out.stderr and "did you mean config.model.d_model" in out.stderr
    out = run_cli(["--config.name=.."], cwd=tmp_path)  # runs/.. is the current directory itself
    assert out.returncode == 2 and "Traceback" not in out.stderr and "config.name='..'" in out.stderr
    assert not list(tmp_path.iterdir())


def test_workdir_that_is_the_cwd_or_a_parent_is_refused(cache_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for workdir in (".", "..", "/"):
        with pytest.raises(configs.ConfigError, match="pass a new directory"):
            Trainer(fault_config(cache_dir), workdir)
    assert not list(tmp_path.iterdir())


def test_read_only_workdir_is_an_environment_error(cache_dir, tmp_path, monkeypatch):
    import errno

    from asyncpp_jax.train.trainer import WorkdirError

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    with pytest.raises(WorkdirError, match=f"cannot create the workdir {tmp_path / 'run'}: Read-only file system"):
        Trainer(fault_config(cache_dir), tmp_path / "run")


def test_impossible_size_on_cpu_is_refused_before_allocation(cache_dir, tmp_path):
    """seq_len=65536 needs terabytes for attention scores: a ConfigError naming the setting before any
    allocation (before: RESOURCE_EXHAUSTED traceback at the first step, or a silent wait on the init)."""
    from asyncpp_jax.train import host_memory

    c = fault_config(cache_dir)
    c.data.seq_len = 65536
    with pytest.raises(configs.ConfigError, match=r"needs at least .* GB of host memory.*config.data.seq_len"):
        Trainer(c, tmp_path)
    c = configs.resolve(fault_config(cache_dir))
    c.model.vocab_size = 200_000_000
    with pytest.raises(configs.ConfigError, match="config.model.vocab_size"):
        host_memory.check_fits(c, {}, 1, available=10 * 2**30)
    host_memory.check_fits(configs.resolve(fault_config(cache_dir)), {}, 4, available=10 * 2**30)  # fits


def test_second_ctrl_c_stops_at_once_and_never_claims_an_unsealed_save(trainer, tmp_path, default_sigint, caplog):
    """Ctrl-C at update 3, then again while its checkpoint is written: KeyboardInterrupt at once,
    status 'interrupted' naming step 2 as the last sealed checkpoint, and no "saved a checkpoint at
    step 3" (before: logged before the save had landed, then a traceback)."""
    t = trainer(tmp_path)
    inner, wait = t.train_step, t.checkpointer.wait

    def interrupted_wait():
        os.kill(os.getpid(), signal.SIGINT)
        wait()

    t.train_step, t.checkpointer.wait = sigint_after_update(t.train_step, 3), interrupted_wait
    with caplog.at_level(logging.WARNING, logger="asyncpp_jax"), pytest.raises(KeyboardInterrupt):
        t.run()
    t.checkpointer.wait = wait
    t.close()
    assert "saved a checkpoint" not in caplog.text
    status = json.loads((tmp_path / "status.json").read_text())
    assert status == {"status": "interrupted", "step": 3, "last_checkpoint": 2}


def test_dead_start_is_stopped_naming_the_settings(sealed_run, tmp_path, cache_dir):
    """init_std=1e6 saturates every layer: gradient norm exactly 0 and the loss at log(vocab) from the
    start.  Before: trained to exit 0."""
    from asyncpp_jax.train.trainer import DeadStart

    c = fault_config(cache_dir)
    c.model.init_std = 1e6  # the init only: the compiled steps of the sealed run apply
    t = Trainer(c, tmp_path)
    t.train_step, t.eval_step = sealed_run[2]
    with pytest.raises(DeadStart, match=r"over the first 3 updates .*config.model.init_std=1000000.0.*norm_eps"):
        t.run()
    t.close()
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "dead_start"


def test_stop_signal_during_the_first_compile_stops_at_once(trainer, tmp_path):
    """SIGTERM while the first step compiles (here: a step that blocks, as a long compile does):
    run() returns 'preempted' at once with status.json written.  Before: ignored until the compile ended."""
    import threading

    t = trainer(tmp_path)
    release = threading.Event()

    def compiling(state, batch):  # on the first-step thread; the signal goes to the main thread's handler
        os.kill(os.getpid(), signal.SIGTERM)
        release.wait(60)
        raise RuntimeError("abandoned")

    t.train_step = compiling
    start = time.perf_counter()
    result = t.run()
    took = time.perf_counter() - start
    release.set()
    t.close()
    assert result.status == "preempted" and result.step == 0 and t.compile_abandoned
    assert took < 30
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "preempted"


@pytest.mark.parametrize("tokenizer, needle", [("/nonexistent/tokenizer.json", "is not understood"),
                                               ("BAD_FILE", "could not load a Hugging Face tokenizer")])
def test_missing_or_invalid_tokenizer_is_a_setting_error(cache_dir, tmp_path, tokenizer, needle):
    """Before: a ValueError traceback from the corpus preparation (exit 1); now a ConfigError (exit 2)."""
    if tokenizer == "BAD_FILE":
        tokenizer = tmp_path / "tokenizer.json"
        tokenizer.write_text("{not json")
    c = fault_config(cache_dir)
    c.data.tokenizer = str(tokenizer)
    with pytest.raises(configs.ConfigError, match=f"config.data.tokenizer.*{needle}"):
        Trainer(c, tmp_path / "run")


def _fetch_order(t, monkeypatch, nan_at=None):
    """Run ``t`` recording, in order, each update dispatched ("run", n) and each fetch of an update's
    metrics to the host ("get", n); update ``nan_at`` reports a NaN loss."""
    inner, events = t.train_step, []

    def step(state, batch):
        n = int(state.step) + 1
        new, metrics = inner(state, batch)
        events.append(("run", n))
        return new, dict(metrics, probe_step=n, **({"loss": jnp.float32(np.nan)} if n == nan_at else {}))

    real_get = jax.device_get

    def get(x):
        if isinstance(x, dict) and "probe_step" in x:
            events.append(("get", x["probe_step"]))
        return real_get(x)

    t.train_step = step
    monkeypatch.setattr(jax, "device_get", get)
    return events


def test_metrics_are_fetched_one_update_late(trainer, tmp_path, monkeypatch):
    """The host fetches update n's metrics only once update n + 1 is queued, so it never stalls the
    device between updates; at a save (here only the last step) the update's own metrics come first.
    (Before: a device_get after every update, before the next was dispatched.)"""
    t = trainer(tmp_path)
    t.config.train.update(eval_every=100, checkpoint_every=100)  # the loop's bounds: one save, at step 4
    events = _fetch_order(t, monkeypatch)
    assert t.run().status == "finished"
    t.close()
    assert events == [("run", 1), ("run", 2), ("get", 1), ("run", 3), ("get", 2), ("run", 4), ("get", 3),
                      ("get", 4)]


def test_a_nan_seen_one_update_late_still_stops_before_the_save(trainer, tmp_path, monkeypatch):
    """A NaN loss at update 3, fetched while update 4 runs: the run stops at step 3 and the save due
    at step 4 never happens."""
    t = trainer(tmp_path)
    t.config.train.update(eval_every=100, checkpoint_every=4)
    events = _fetch_order(t, monkeypatch, nan_at=3)
    with pytest.raises(TrainingDiverged, match=r"non-finite loss \(nan\) .* at step 3; stopped without saving"):
        t.run()
    t.close()
    assert events[-2:] == [("run", 4), ("get", 3)]
    assert t.checkpointer.sealed_steps() == []
    assert json.loads((tmp_path / "status.json").read_text())["step"] == 3


# ---------------------------------------------------------------------------------------------- identity

def _small_bpe(path, texts) -> str:
    """A word-piece BPE under 257 ids (the fault config's model.vocab_size), so only the tokenizer differs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|endoftext|>"],
                                                       limit_alphabet=100, show_progress=False))
    tok.save(str(path))
    return str(path)


def _run_reusing(sealed_run, c, workdir, until=None):
    """Run ``c`` (the fault config's shapes) in ``workdir`` with the sealed run's compiled steps."""
    t = Trainer(c, workdir)
    t.train_step, t.eval_step = sealed_run[2]
    result = t.run(until_step=until)
    t.close()
    return result


def _stdlib_texts() -> list[str]:
    return [p.read_text() for p in sorted(pathlib.Path(SOURCE.split(",")[0].rsplit("/", 1)[0]).glob("*.py"))]


def test_resume_refuses_a_changed_identity_in_one_line(damaged_copy, cache_dir, tmp_path):
    """Before: a new tokenizer, seq_len or head arrangement of the same layout resumed with a warning
    (every embedding row then meant another token).  Now: one line naming the setting, both values
    and the flag that accepts it; nothing in the workdir changes."""
    before = snapshot(damaged_copy)
    bpe = _small_bpe(tmp_path / "tokenizer.json", _stdlib_texts())
    cases = [
        ("tokenizer", lambda c: c.data.update(tokenizer=bpe), ["config.data.tokenizer", "trained on bytes",
                                                               f"this config gives sha256:", bpe]),
        ("seq_len", lambda c: c.data.update(seq_len=16), ["config.data.seq_len: the checkpoint was trained on 32, "
                                                          "this config gives 16"]),
        # 4 heads of 8 over 2 K/V heads: the same [32, 32] and [32, 16] kernels as 2 heads of 16 over 1
        ("model", lambda c: c.model.update(n_heads=4, n_kv_heads=2),
         ["config.model.n_heads: the checkpoint was trained with 2, this config has 4"]),
    ]
    for item, change, needles in cases:
        c = fault_config(cache_dir)
        change(c)
        with pytest.raises(ResumeRefused) as e:
            Trainer(c, damaged_copy)
        message = str(e.value)
        assert "\n" not in message and f"pass --config.train.accept_changed={item};" in message, message
        assert all(n in message for n in needles), message
    assert snapshot(damaged_copy) == before
    Trainer(fault_config(cache_dir, global_batch_size=16), damaged_copy).close()  # not part of the identity


def test_new_data_resumes_only_when_accepted_and_from_its_start(sealed_run, cache_dir, tmp_path, caplog):
    """Files added to a local data.source directory make another corpus under an unchanged config.
    Before: the run resumed on it silently, at the saved data position.  Now: refused, naming both
    corpora; with accept_changed=corpus it resumes and reads the new data from its start; the
    checkpoints record which corpus each was trained on."""
    stdlib = pathlib.Path(SOURCE.split(",")[0].rsplit("/", 1)[0]).parent
    src = tmp_path / "src"
    src.mkdir()
    for p in sorted((stdlib / "json").glob("*.py")):
        shutil.copy(p, src / p.name)
    run = lambda c, until=None: _run_reusing(sealed_run, c, tmp_path / "run", until)  # noqa: E731
    c = fault_config(cache_dir)
    c.data.source = str(src)
    assert run(c, until=2).step == 2
    for p in sorted((stdlib / "email").glob("*.py"))[:4]:
        shutil.copy(p, src / p.name)
    with pytest.raises(ResumeRefused) as e:
        Trainer(c, tmp_path / "run")
    message = str(e.value)
    assert "the corpus of config.data.source: the checkpoint was trained on" in message and "train tokens" in message
    assert "continue training on the new data on purpose, pass --config.train.accept_changed=corpus" in message
    c.train.accept_changed = "corpus"
    with caplog.at_level(logging.INFO, logger="asyncpp_jax"):
        assert run(c).step == 4
    assert "the data changed on purpose, so its iterator starts afresh" in caplog.text
    corpora = [ckpt_lib.read_manifest(tmp_path / "run" / "checkpoints" / s)["run"]["identity"]["corpus"] for s in "24"]
    assert corpora[0] != corpora[1]


def test_export_describes_the_checkpoint_it_holds(sealed_run, cache_dir, tmp_path):
    """A run trained on bytes to step 2, then (accepted) on a BPE to step 4.  Before: the export read
    config.json, kept from the start, so step 4's export got eos_token_id 256 and no tokenizer.json.
    Now each export follows its checkpoint's own config; a tokenizer file replaced since is refused."""
    from tokenizers import Tokenizer

    from asyncpp_jax import export

    bpe = _small_bpe(tmp_path / "tokenizer.json", _stdlib_texts())
    c = fault_config(cache_dir)
    _run_reusing(sealed_run, c, tmp_path / "run", until=2)
    c.data.tokenizer, c.train.accept_changed = bpe, "tokenizer"
    assert _run_reusing(sealed_run, c, tmp_path / "run").step == 4
    quiet = lambda _: None  # noqa: E731
    info = export.export(tmp_path / "run", tmp_path / "e4", log=quiet)
    hf = json.loads((tmp_path / "e4" / "config.json").read_text())
    assert info["step"] == 4 and info["tokenizer"] == bpe and (tmp_path / "e4" / "tokenizer.json").is_file()
    assert hf["eos_token_id"] == Tokenizer.from_file(bpe).token_to_id("<|endoftext|>") != 256
    info = export.export(tmp_path / "run", tmp_path / "e2", step=2, log=quiet)
    hf = json.loads((tmp_path / "e2" / "config.json").read_text())
    assert info["tokenizer"] == "byte" and hf["eos_token_id"] == 256  # step 2 was trained on bytes
    assert Tokenizer.from_file(str(tmp_path / "e2" / "tokenizer.json")).get_vocab_size() == 257  # bytes + eos, not the BPE
    _small_bpe(bpe, _stdlib_texts()[:2])  # another tokenizer at the same path
    with pytest.raises(export.ExportError, match="the file changed since"):
        export.export(tmp_path / "run", tmp_path / "e4b", log=quiet)
