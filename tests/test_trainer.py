"""Trainer: learning, exact resume, SIGTERM, divergence, data parallelism, the CLI."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax import configs
from asyncpp_jax.optim import build_optimizer
from asyncpp_jax.pipeline.mesh import make_mesh
from asyncpp_jax import train_state as state_lib
from asyncpp_jax.train import step as step_lib
from asyncpp_jax.train.trainer import Trainer, TrainingDiverged
from helpers import SOURCE, run_cli, small_train_config



def small_config(cache_dir, **train):
    train = dict(dict(steps=8, microbatches=2, eval_every=4, eval_batches=2, checkpoint_every=4), **train)
    return small_train_config(cache_dir, "test", 2, **train)


def leaves_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def uninterrupted(cache_dir, tmp_path_factory):
    """One 8-step run that several tests compare against (with a test set, which trains nothing)."""
    t = Trainer(small_config(cache_dir, test_batches=1), tmp_path_factory.mktemp("full"))
    result = t.run()
    t.close()
    return t, result


def test_run_writes_outputs(uninterrupted):
    t, result = uninterrupted
    assert result.status == "finished" and result.step == 8
    assert json.loads((t.workdir / "config.json").read_text())["train"]["steps"] == 8
    rows = [json.loads(x) for x in (t.workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert {"loss", "grad_norm", "lr", "tokens_per_sec", "step_time"} <= set(rows[0])
    assert "val_loss" in rows[3] and "val_loss_per_byte" in rows[7]
    assert any((t.workdir / "tensorboard").iterdir())
    assert json.loads((t.workdir / "status.json").read_text())["status"] == "finished"
    assert t.checkpointer.latest_step() == 8


def test_test_split_is_reported_once_at_the_end_and_never_overlaps_validation(uninterrupted, cache_dir, tmp_path):
    from asyncpp_jax.data import CorpusError

    t, _ = uninterrupted
    status = json.loads((t.workdir / "status.json").read_text())
    assert status["test_loss_per_byte"] > 0 and status["test_loss_per_byte"] != status["val_loss_per_byte"]
    seen = {w.tobytes() for b in t.eval_batches for w in b}
    assert t.test_batches and not seen & {w.tobytes() for b in t.test_batches for w in b}
    rows = [json.loads(x) for x in (t.workdir / "metrics.jsonl").read_text().splitlines()]
    assert not any("test_loss" in r for r in rows)  # never along the way, so nothing picks by it
    with pytest.raises(CorpusError, match="test_batches"):
        Trainer(small_config(cache_dir, steps=3, test_batches=10**6), tmp_path / "b")


def test_exact_resume_after_pause(uninterrupted, cache_dir, tmp_path):
    full, _ = uninterrupted
    cfg = small_config(cache_dir)
    first = Trainer(cfg, tmp_path)
    assert first.run(until_step=3).status == "paused"  # mid-way between periodic checkpoints
    first.close()
    second = Trainer(cfg, tmp_path)
    result = second.run()
    second.close()
    assert result.step == 8
    assert leaves_equal(second.state.params, full.state.params)  # bit for bit, data order included
    assert leaves_equal(second.state.opt_state, full.state.opt_state)


def test_sigterm_saves_and_stops(cache_dir, tmp_path, uninterrupted):
    full, _ = uninterrupted
    t = Trainer(small_config(cache_dir), tmp_path)
    inner = t.train_step

    def step_then_preempt(state, batch):
        n = int(state.step)  # read before the call: the state buffer is donated
        out = inner(state, batch)
        if n == 4:  # during update 5
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    t.train_step = step_then_preempt
    result = t.run()
    t.close()
    assert result.status == "preempted" and result.step == 5
    assert t.checkpointer.latest_step() == 5
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "preempted"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    resumed = Trainer(small_config(cache_dir), tmp_path)
    resumed.run()
    resumed.close()
    assert leaves_equal(resumed.state.params, full.state.params)


def test_divergence_stops_and_keeps_last_good_checkpoint(cache_dir, tmp_path):
    cfg = small_config(cache_dir, checkpoint_every=1)
    t = Trainer(cfg, tmp_path)
    inner = t.train_step

    def poisoned(state, batch):  # a blow-up at update 3, as from a bad lr spike
        n = int(state.step)
        new, metrics = inner(state, batch)
        if n == 2:
            metrics = dict(metrics, loss=jnp.float32(np.nan))
        return new, metrics

    t.train_step = poisoned
    with pytest.raises(TrainingDiverged, match="non-finite loss .* at step 3.*last good checkpoint is step 2"):
        t.run()
    t.close()
    assert t.checkpointer.latest_step() == 2
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "diverged"


def test_real_divergence_is_caught(cache_dir, tmp_path):
    cfg = small_config(cache_dir, steps=30)
    cfg.optimizer.update(lr=1e6, grad_clip=0.0, warmup_steps=0, schedule="constant")
    cfg.optimizer.adamw.b2 = 0.0
    t = Trainer(cfg, tmp_path)
    with pytest.raises(TrainingDiverged):
        t.run()
    t.close()


def test_loss_goes_down(cache_dir, tmp_path):
    cfg = small_config(cache_dir, steps=150, eval_every=150, checkpoint_every=150, global_batch_size=16)
    cfg.optimizer.update(lr=1e-2, warmup_steps=10)
    t = Trainer(cfg, tmp_path)
    result = t.run()
    t.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] > np.log(257) - 0.5  # starts near uniform over the vocabulary
    assert result.val_loss < rows[0]["loss"] - 2.0
    # And below the unigram baseline: the model uses context.
    assert result.val_loss_per_byte < result.unigram["val_cross_entropy"]


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("n_devices", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_data_parallel_matches_single_device(cache_dir, n_devices):
    cfg = small_config(cache_dir)
    adamw, sched = build_optimizer(cfg.optimizer, cfg.train.steps)
    batches = np.random.default_rng(0).integers(0, 257, (3, cfg.train.global_batch_size, 33)).astype(np.int32)

    def run(devices, opt):
        mesh = make_mesh(len(devices), devices)
        train_step = step_lib.make_train_step(cfg.model, opt, sched, mesh)
        state = jax.device_put(state_lib.init_state(cfg.model, opt, jax.random.key(0)), state_lib.replicated(mesh))
        losses = []
        for b in batches:
            state, m = train_step(state, step_lib.to_global_batch(mesh, b, cfg.train.microbatches))
            losses.append(float(m["loss"]))
        return losses, state.params

    loss1, _ = run(jax.devices()[:1], adamw)
    lossn, _ = run(jax.devices()[:n_devices], adamw)
    np.testing.assert_allclose(lossn, loss1, rtol=1e-5)
    # Parameters through SGD (Adam's first steps amplify float noise in near-zero gradients to
    # ±lr, which would hide a real difference): the averaged gradient itself must agree.
    sgd = optax.sgd(0.5)
    _, p1 = run(jax.devices()[:1], sgd)
    _, pn = run(jax.devices()[:n_devices], sgd)
    for a, b in zip(jax.tree.leaves(pn), jax.tree.leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_microbatching_equals_one_big_batch(cache_dir):
    """Gradient accumulation over M microbatches = the gradient of the mean loss on the whole batch."""
    cfg = small_config(cache_dir)
    opt, sched = build_optimizer(cfg.optimizer, cfg.train.steps)
    batch = np.random.default_rng(1).integers(0, 257, (8, 33)).astype(np.int32)
    mesh = make_mesh(1)
    outs = []
    for m in (1, 4):
        state = state_lib.init_state(cfg.model, opt, jax.random.key(0))
        state, metrics = step_lib.make_train_step(cfg.model, opt, sched, mesh)(
            state, step_lib.to_global_batch(mesh, batch, m))
        outs.append((float(metrics["loss"]), state.params))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(outs[0][1]), jax.tree.leaves(outs[1][1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cli_rejects_bad_config_without_traceback(tmp_path):
    out = run_cli(["--config.model.n_heads=7"])
    assert out.returncode == 2
    assert "config.model.n_heads=7 does not divide config.model.d_model" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("parallel", [["--config.mesh.data=2"],
                                      pytest.param(["--config.pipeline.stages=2", "--config.pipeline.schedule=2bw"],
                                                   marks=pytest.mark.slow)])
@pytest.mark.needs_devices(2)
def test_cli_trains_with_overrides_and_fake_devices(cache_dir, tmp_path, parallel):
    """Data parallel, or the pipeline engine: the CLI makes the fake CPU devices either needs."""
    args = [
        "--config=configs/tiny.py", f"--workdir={tmp_path}/run", f"--config.data.source={SOURCE}",
        f"--config.data.cache_dir={cache_dir}", "--config.data.seq_len=32", "--config.data.val_fraction=0.2",
        "--config.model.d_model=32", "--config.model.n_heads=2", "--config.model.n_kv_heads=1",
        "--config.model.d_ff=64", "--config.train.steps=4", "--config.train.eval_every=2",
        "--config.train.eval_batches=1", "--config.train.global_batch_size=8",
        "--config.optimizer.warmup_steps=1", "--config.train.log_every=2", *parallel,
    ]
    out = run_cli(args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "validation loss" in out.stdout and "nats/byte" in out.stdout
    # stdout is a pipe: a plain line every log_every updates in place of the progress bar
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"], out.stdout
    pattern = r"step 4/4  loss \d+\.\d{4}  val_loss \d+\.\d{4}  lr [\d.e-]+  tokens/s [\d,]+  ETA 0m00s"
    assert re.fullmatch(pattern, lines[1]), lines
    assert "it/s" not in out.stderr and "step/s" not in out.stderr  # no tqdm bar
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["d_model"] == 32
    if "--config.mesh.data=2" in parallel:
        assert saved["mesh"]["data"] == 2
    else:  # microbatches=-1 resolved to 2 = 2*(stages-1); the schedule is logged
        assert saved["train"]["microbatches"] == 2 and "useful 100%" in out.stderr


def test_cli_rejects_too_few_microbatches_for_2bw(tmp_path):
    out = run_cli(["--config.pipeline.stages=4", "--config.pipeline.schedule=2bw", "--config.train.microbatches=2",
                f"--workdir={tmp_path}/run"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "config.train.microbatches=2 is too few for config.pipeline.schedule=2bw" in out.stderr
    assert "it runs from config.train.microbatches=3" in out.stderr  # the program's own validity: P - 1


def test_cli_sigterm_checkpoints_and_exits_cleanly(cache_dir, tmp_path):
    args = [
        f"--workdir={tmp_path}/run", f"--config.data.source={SOURCE}", f"--config.data.cache_dir={cache_dir}",
        "--config.data.seq_len=32", "--config.data.val_fraction=0.2", "--config.model.d_model=32",
        "--config.model.n_heads=2", "--config.model.n_kv_heads=1", "--config.model.d_ff=64",
        "--config.train.steps=100000", "--config.train.global_batch_size=8", "--config.train.log_every=1",
        "--config.train.checkpoint_every=100000", "--config.train.progress_bar=False",
    ]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-m", "asyncpp_jax.main", *args], cwd=configs.REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "preempted" in stdout
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "preempted" and status["step"] >= 3
    assert (tmp_path / "run" / "checkpoints" / str(status["step"])).is_dir()


@pytest.mark.parametrize("mode, mitigation", [("2bw", "ef"), pytest.param("pipedream", "taylor", marks=pytest.mark.slow)])
def test_staleness_modes_train_and_log_the_delay(cache_dir, tmp_path, mode, mitigation):
    cfg = small_config(cache_dir, steps=6, eval_every=6, checkpoint_every=6)
    cfg.staleness.update(mode=mode, pipedream_stages=2, mitigation=mitigation, sync_start_steps=1, sync_cooldown_steps=2)
    t = Trainer(cfg, tmp_path)
    result = t.run()
    t.close()
    assert result.status == "finished" and np.isfinite(result.val_loss)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["delay"] for r in rows] == [0, 1, 1, 1, 0, 0]  # sync start 1, cooldown 2 (P-1 = 1)
    assert [r["skipped_batches"] for r in rows] == [0, 0, 0, 0, 1, 0]  # in flight at the switch


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("runner", ["pipedream_mixed", pytest.param("pipeline_2bw", marks=pytest.mark.slow),
                                    pytest.param("pipeline_2bw_vocab_parallel", marks=pytest.mark.slow),
                                    pytest.param("pipeline_pipedream", marks=pytest.mark.slow),
                                    pytest.param("pipeline_pipedream_mpmd", marks=pytest.mark.slow),
                                    "pipeline_2bw_mpmd",
                                    pytest.param("weight_prediction", marks=pytest.mark.slow)])
def test_runner_state_resumes_exactly(cache_dir, tmp_path, runner):
    """A pause mid-run keeps PipeDream's weight history, the engine's in-flight microbatches (with
    the tables whole or split over the stages, or each stage's own under the mpmd placement), or
    the weight-prediction velocity."""
    cfg = small_config(cache_dir, steps=6, eval_every=6, checkpoint_every=6)
    if runner == "pipedream_mixed":
        cfg.staleness.update(mode="pipedream", pipedream_stages=2, pipedream_gradient="mixed", mitigation="ef")
    elif runner == "weight_prediction":
        cfg.staleness.update(mode="2bw", weight_prediction=True, weight_prediction_smoothing=0.5, nesterov=True)
    else:
        cfg.pipeline.update(stages=2, schedule="pipedream" if "pipedream" in runner else "2bw",
                            vocab_parallel=runner.endswith("vocab_parallel"),
                            placement="mpmd" if runner.endswith("mpmd") else "spmd")
        cfg.staleness.update(mitigation="ef", sync_start_steps=1)
        if cfg.pipeline.vocab_parallel:
            cfg.model.vocab_size = 258  # the bytes' 257 padded to a multiple of the stages
    runs = []
    for name, pause in (("full", None), ("paused", 3)):
        if pause:
            first = Trainer(cfg, tmp_path / name)
            assert first.run(until_step=pause).status == "paused"
            first.close()
        t = Trainer(cfg, tmp_path / name)
        assert bool(t.runner.options and t.runner.options.vocab_parallel) == runner.endswith("vocab_parallel")
        assert t.runner.mpmd == runner.endswith("mpmd")
        assert t.run().step == 6
        t.close()
        runs.append(t.state)
    full, resumed = runs
    assert full.runner_state is not None
    assert leaves_equal(resumed.params, full.params)
    assert leaves_equal(resumed.runner_state, full.runner_state)
    assert leaves_equal(resumed.opt_state, full.opt_state)


@pytest.mark.slow  # ~2 min: lowers and compiles a 10B model for 64 fake devices
def test_cli_dry_run_of_moe10b_fits_its_mesh():
    """The flagship config lowers and compiles on 64 fake CPU devices without allocating the model."""
    out = run_cli(["--config=configs/moe10b.py", "--dry_run"], env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh {'data': 16, 'stage': 4} (64 devices)" in out.stdout
    assert "10,119,907,328 total" in out.stdout
    assert "XLA memory analysis" in out.stdout and "schedule bubble 0%" in out.stdout
    assert "fits: H100 80GB yes, H200 141GB yes, TPU v5p 95GB yes" in out.stdout
    # Its stated target (configs/moe10b.py's docstring and config.hardware), checked as for every
    # config in tests/test_shipped_configs_fit.py.
    assert re.search(r"target config.hardware='h100-80gb', budget 80.00 GB per device: .*peak [\d.]+ GB per "
                     r"device of a 80.00 GB budget \(fits;", out.stdout), out.stdout
    print(out.stdout)
    # The in-flight state and checkpoint as multiples of the params, both recompute settings'
    # stash, and the eval step (forward through the stages) in the verdict.
    assert re.search(r"in-flight state per device [\d.]+ GB = [\d.]+x the params on a device; checkpoint "
                     r"[\d.]+ GB = [\d.]+x the params", out.stdout)
    assert re.search(r"stash per device: [\d.]+ GB with config.pipeline.recompute=True, [\d.]+ GB with False",
                     out.stdout)
    assert "eval step peak" in out.stdout


def test_cli_dry_run_works_for_the_default_config():
    out = run_cli(["--dry_run"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run of tiny" in out.stdout and "2,968,064 total" in out.stdout
