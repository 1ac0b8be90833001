"""Every shipped config fits the hardware it states (issue 17).

Each file in configs/ names its target in its docstring and in ``config.hardware``; the dry run of
it (at its real shape, compiled on fake CPU devices by the CLI) must report a peak per device
within that target's memory.  So must the studies' ``paper`` and ``gpu`` presets and the quickstart notebook's
accelerator presets.  The dry run's peak is XLA:CPU's memory analysis, an estimate of the
accelerator compiler's (see asyncpp_jax/train/dry_run.py).  The full-size configs compile for one
to several minutes each on a busy 2-core machine, hence ``slow``.
"""

import ast
import os
import re
import subprocess
import sys

import pytest

from asyncpp_jax import configs
from experiments import device_check
from experiments.studies import common

CONFIG_FILES = sorted(p.name for p in (configs.REPO_ROOT / "configs").glob("*.py") if p.name != "__init__.py")
BIG = {"dense135m.py", "dense360m.py", "llama3_8b.py", "moe10b.py", "moe_tiny.py"}  # over ~30 s each


def _notebook_presets() -> dict:
    """The PRESETS of the notebook's preset cell (the device check reads them the same way)."""
    return device_check.notebook_presets()


def _dry_run(config_file: str, flags: list[str]):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the CLI creates the fake devices the mesh needs
    out = subprocess.run([sys.executable, "-m", "asyncpp_jax.main", f"--config={config_file}", "--dry_run",
                          *flags], cwd=configs.REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    target = re.search(r"target config\.hardware='([\w-]+)', budget ([\d.]+) GB per device: (.*)", out.stdout)
    assert target, out.stdout
    print(f"\n{config_file} {' '.join(flags)}\n  {target.group(0)}")
    return target.group(1), float(target.group(2)), target.group(3), out.stdout


def _assert_fits(config_file, flags, hardware):
    got_hw, budget, verdict, stdout = _dry_run(config_file, flags)
    assert got_hw == hardware and budget == configs.HARDWARE_GB[hardware]
    peak = re.search(r"peak ([\d.]+) GB per device of a [\d.]+ GB budget \(fits;", verdict)
    assert peak, stdout
    assert float(peak.group(1)) <= budget
    return float(peak.group(1))


def _config(name):
    return configs.load_file(f"configs/{name}")


def _docstring(name) -> str:
    return ast.get_docstring(ast.parse((configs.REPO_ROOT / "configs" / name).read_text())) or ""


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in BIG else n
                                  for n in CONFIG_FILES if n != "moe10b.py"])
def test_each_config_fits_its_stated_hardware(name):
    """moe10b's dry run (64 fake devices) is tests/test_trainer.py::test_cli_dry_run_of_moe10b_fits_its_mesh."""
    hardware = _config(name).hardware
    assert f"config.hardware='{hardware}'" in _docstring(name), f"configs/{name}'s docstring must name its target"
    _assert_fits(f"configs/{name}", [], hardware)


def test_every_config_states_its_hardware():
    for name in CONFIG_FILES:
        c = _config(name)
        assert c.hardware in configs.HARDWARE_GB
        assert f"config.hardware='{c.hardware}'" in _docstring(name), name


def _flags(overrides: dict) -> list[str]:
    return [f"--config.{k}={v}" for k, v in overrides.items()]


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(common.PAPER_MODELS))
def test_paper_preset_fits(model):
    """'One run per GPU': each paper preset's run fits its config's target accelerator."""
    config_file, overrides, _, _ = common.preset("paper", model)
    hardware = _config(os.path.basename(config_file)).hardware
    _assert_fits(config_file, _flags(overrides), hardware)


@pytest.mark.slow
def test_gpu_preset_fits():
    """The studies' ``gpu`` preset (dense135m body, 2 microbatches of 64 x 2048): one run per 80 GB GPU."""
    config_file, overrides, _, _ = common.preset("gpu")
    hardware = _config(os.path.basename(config_file)).hardware
    assert hardware == "h100-80gb"
    _assert_fits(config_file, _flags(overrides), hardware)


def test_gpu_preset_note_states_its_compute():
    """The note's figures follow from the preset: tokens, model FLOPs (asyncpp_jax.models.flops) and
    H100-hours at 40% MFU of 989 TFLOP/s."""
    from asyncpp_jax.models import flops

    config_file, o, _, note = common.preset("gpu")
    c = configs.load_file(config_file)
    for key, value in o.items():
        section, _, field = key.rpartition(".")
        c[section][field] = value
    tokens = o["train.steps"] * o["train.global_batch_size"] * o["data.seq_len"]
    total = tokens * flops.flops_per_token(c.model, o["data.seq_len"])
    hours = total / (0.4 * 989e12) / 3600
    sci = lambda x: f"{x:.2e}".replace("e+0", "e").replace("e+", "e")  # noqa: E731  (1.31e9, as written)
    assert f"{sci(tokens)} tokens" in note and f"{sci(total)} model FLOPs" in note
    assert f"~{hours:.1f} H100-hour" in note and 0.8 < hours < 1.2


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_notebook_accelerator_preset_fits(backend):
    preset = _notebook_presets()[backend]
    hardware = next(f.split("=", 1)[1] for f in preset["overrides"] if f.startswith("--config.hardware="))
    _assert_fits(preset["config"], preset["overrides"], hardware)
