"""Config files load, validate, and bad settings fail early with the field named."""

import pathlib
import subprocess
import sys

import pytest

from asyncpp_jax import configs

CONFIG_FILES = sorted(p.stem for p in (configs.REPO_ROOT / "configs").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_config_file_validates(name):
    c = configs.load_file(f"configs/{name}.py")
    configs.validate(c)
    assert c.name == name


def test_configs_dir_is_files_not_an_installed_package():
    import tomllib

    project = tomllib.loads((configs.REPO_ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["asyncpp_jax*"]
    assert not (configs.REPO_ROOT / "configs" / "__init__.py").exists()
    assert configs.load_file("configs/moe_tiny.py").model.d_model == configs.load_file("configs/tiny.py").model.d_model
    with pytest.raises(FileNotFoundError, match="configs/nope.py"):
        configs.load_file("configs/nope.py")


def test_default_config_is_tiny():
    assert configs.DEFAULT_CONFIG == pathlib.Path(configs.REPO_ROOT, "configs", "tiny.py")


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("optimizer.name", "sgdx", "config.optimizer.name"),
        ("model.n_heads", 3, "config.model.n_heads=3 does not divide config.model.d_model=256"),
        ("model.n_kv_heads", 3, "config.model.n_kv_heads=3 does not divide config.model.n_heads"),
        ("train.microbatches", 3, "config.train.global_batch_size=32 is not divisible"),
        ("optimizer.schedule", "step", "config.optimizer.schedule"),
        ("model.compute_dtype", "int8", "config.model.compute_dtype"),
        ("data.seq_len", 1, "config.data.seq_len"),
        ("optimizer.warmup_steps", 10_000, "config.optimizer.warmup_steps"),
        ("mesh.data", 0, "config.mesh.data"),
        ("runner", "magic", "config.runner"),
        ("pipeline.schedule", "gpipe", "config.pipeline.schedule='gpipe' is unknown"),
        ("pipeline.stages", 0, "config.pipeline.stages=0 must be a positive integer"),
        ("pipeline.stages", 3, "config.model.n_layers=4 is not divisible by config.pipeline.stages=3"),
        ("staleness.mode", "async", "config.staleness.mode='async' is unknown"),
        ("staleness.pipedream_gradient", "exact", "config.staleness.pipedream_gradient='exact' is unknown"),
        ("staleness.mitigation", "ef", "config.staleness.mitigation='ef' needs a delay"),
    ],
)
def test_validation_names_the_field(field, value, needle):
    c = configs.load_file("configs/tiny.py")
    section, _, key = field.rpartition(".")
    (c[section] if section else c)[key] = value
    with pytest.raises(configs.ConfigError) as e:
        configs.validate(c)
    assert needle in str(e.value)


def test_all_problems_reported_at_once():
    c = configs.load_file("configs/tiny.py")
    c.optimizer.name = "nope"
    c.optimizer.lr = -1.0
    with pytest.raises(configs.ConfigError) as e:
        configs.validate(c)
    assert "config.optimizer.name" in str(e.value) and "config.optimizer.lr" in str(e.value)


def test_device_and_tokenizer_checks():
    c = configs.load_file("configs/tiny.py")
    c.mesh.data = 8
    with pytest.raises(configs.ConfigError, match="config.mesh.data=8 x config.pipeline.stages=1 asks for 8 devices but 2"):
        configs.check_against_devices(c, 2)
    c.mesh.data = -1
    assert configs.check_against_devices(c, 4) == 4
    c.model.vocab_size = 100
    with pytest.raises(configs.ConfigError, match="config.model.vocab_size=100 is smaller"):
        configs.check_against_tokenizer(c, 257)


def test_pipeline_settings_resolve_and_fail_clearly():
    c = configs.load_file("configs/tiny.py")
    c.pipeline.update(stages=4, schedule="2bw")
    r = configs.resolve(c)
    assert r.train.microbatches == 8  # smallest divisor of 32 that is >= 2*(4-1)
    assert configs.devices_needed(r) == 4 and configs.uses_pipeline(r)
    assert configs.effective_staleness(r).mode == "2bw"
    configs.validate(c)
    c.train.microbatches = 2  # the 2bw program's own rule: microbatches >= stages - 1
    with pytest.raises(configs.ConfigError, match=r"microbatches=2 is too few .* it runs from config.train.microbatches=3"):
        configs.validate(c)
    c.train.microbatches = 8
    c.staleness.mode = "pipedream"
    with pytest.raises(configs.ConfigError, match="config.staleness.mode='pipedream' cannot run on the pipeline engine"):
        configs.validate(c)
    c.staleness.mode = "sync"
    with pytest.raises(configs.ConfigError, match="config.pipeline.stages=4 asks for 4 devices but 2"):
        configs.check_against_devices(c, 2)
    c.pipeline.update(stages=1, schedule="sync")
    c.staleness.mitigation = "ef"
    with pytest.raises(configs.ConfigError, match="needs a delay"):
        configs.validate(c)


def test_diff_lists_changed_fields():
    assert configs.diff({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == ["a.c: 2 -> 3"]


def test_renamed_fields_are_rejected_with_the_new_name():
    """``config.staleness.stages`` became ``config.staleness.pipedream_stages`` (it is PipeDream's
    simulated depth, not ``config.pipeline.stages``); the old name must not be silently ignored."""
    c = configs.base_config()
    c.staleness.stages = 4  # what an old config file, or ConfigDict.update(stages=4), would leave
    with pytest.raises(configs.ConfigError, match=r"config\.staleness\.stages was renamed to "
                                                   r"config\.staleness\.pipedream_stages"):
        configs.validate(c)
    assert configs.renamed_flag_errors(["--config.staleness.stages=4"]) == [
        "config.staleness.stages was renamed to config.staleness.pipedream_stages; set that instead."]
    assert configs.renamed_flag_errors(["--config.staleness.pipedream_stages=4", "--config.pipeline.stages=2"]) == []


def test_cli_names_the_new_field_of_a_renamed_override():
    proc = subprocess.run([sys.executable, "-m", "asyncpp_jax.main", "--config.staleness.stages=4", "--dry_run"],
                          capture_output=True, text=True, timeout=120, cwd=configs.REPO_ROOT)
    assert proc.returncode == 2
    assert "renamed to config.staleness.pipedream_stages" in proc.stderr
    assert "Traceback" not in proc.stderr
