"""A non-editable ``pip install .`` into a fresh venv runs the default job from any directory."""

import os
import subprocess
import sys

import pytest

from asyncpp_jax import configs
from helpers import SMALL_MODEL, SOURCE


@pytest.mark.slow
def test_non_editable_install_runs_from_another_directory(tmp_path, cache_dir):
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The venv sees the installed dependencies (jax, ...), not this checkout: no PYTHONPATH, no editable finder first.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    pip = subprocess.run([python, "-m", "pip", "install", "-q", str(configs.REPO_ROOT)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]

    def run(*args, exe=(python, "-m", "asyncpp_jax.main")):
        return subprocess.run([*exe, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)

    where = run("-c", "import asyncpp_jax, importlib.util; print(asyncpp_jax.__file__, "
                "importlib.util.find_spec('configs'))", exe=(python,))
    assert where.stdout.split() == [str(venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
                                        / "site-packages" / "asyncpp_jax" / "__init__.py"), "None"], where.stdout
    shown = run("--config=configs/moe_tiny.py", "--print_config", exe=(str(venv / "bin" / "asyncpp-train"),))
    assert shown.returncode == 0 and "model.moe.num_experts = 8" in shown.stdout, shown.stderr
    small = [f"--config.model.{k}={v}" for k, v in SMALL_MODEL.items()]
    job = run("--config=tiny", *small, f"--config.data.source={SOURCE}", f"--config.data.cache_dir={cache_dir}",
              "--config.data.seq_len=32", "--config.train.steps=4", "--config.train.eval_every=2",
              "--config.train.eval_batches=1", "--config.train.global_batch_size=8", "--config.optimizer.warmup_steps=1")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "finished at step 4/4; outputs in runs/tiny" in job.stdout
    assert (elsewhere / "runs" / "tiny" / "metrics.jsonl").exists()
