"""--print_config: every field with its value and a one-line meaning; --help points there."""

import subprocess
import sys

from asyncpp_jax import config_help, configs


def test_every_field_has_one_line_meaning():
    c = configs.base_config()
    missing = [name for name, _ in config_help.leaves(c) if not config_help.meaning(name)]
    assert not missing, f"give these fields a comment in configs.py (or a line in config_help.MEANINGS): {missing}"
    long = [name for name, _ in config_help.leaves(c) if len(config_help.meaning(name)) > config_help.MAX_MEANING]
    assert not long, f"shorten these fields' meanings (config_help.MEANINGS): {long}"
    stale = set(config_help.MEANINGS) - {name for name, _ in config_help.leaves(c)}
    assert not stale, f"config_help.MEANINGS names fields that do not exist: {stale}"


def test_meanings_come_from_the_comments_beside_the_defaults():
    found = config_help.comments()
    assert found["optimizer.lr"] == "peak learning rate of the main branch"  # on the field's line
    assert found["train.microbatches"].startswith("gradient accumulation steps per update; -1 = auto")  # above it
    assert "optimizer.adamw.b2" not in found  # several fields on one line share no comment


def test_print_config_lists_every_field_with_value_and_meaning(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncpp_jax.main", "--config=moe_tiny", "--config.train.steps=7",
                           "--print_config"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "moe_tiny" in lines[0] and "--config.FIELD=VALUE" in lines[0]
    body = {line.split(" = ")[0]: line for line in lines[1:]}
    c = configs.load_file("moe_tiny")
    assert list(body) == [name for name in config_help.source_order() if name in body]
    assert set(body) == {name for name, _ in config_help.leaves(c)}
    assert body["train.steps"].split("#")[0].strip() == "train.steps = 7"
    assert body["train.steps"].endswith("# optimizer updates in the run")
    assert body["model.moe.num_experts"].split("#")[0].strip() == "model.moe.num_experts = 8"
    assert all(" # " in line for line in lines[1:])
    helped = subprocess.run([sys.executable, "-m", "asyncpp_jax.main", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert "--print_config" in helped.stdout and "preset's name" in helped.stdout
