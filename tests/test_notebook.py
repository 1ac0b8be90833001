"""The notebooks run headlessly on CPU at a tiny size, so they cannot rot."""

import json
import os

import nbclient
import nbformat

from asyncpp_jax import configs
from helpers import STDLIB


def _execute(name, env):
    nb = nbformat.read(configs.REPO_ROOT / "notebooks" / name, as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(configs.REPO_ROOT)}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_quickstart_notebook_executes(tmp_path, cache_dir):
    outputs = _execute("quickstart.ipynb", {
        "QUICKSTART_STEPS": "4", "QUICKSTART_OUT": str(tmp_path),
        "QUICKSTART_OVERRIDES": json.dumps({"data.source": f"{STDLIB}/json/*.py", "data.cache_dir": cache_dir,
                                            "data.val_fraction": 0.2})})
    for arm in ("sync", "2bw", "2bw + EF"):
        assert f"{arm:9s} final validation loss" in outputs
        assert (tmp_path / arm.replace(" ", "") / "metrics.jsonl").exists()
    assert "step 4 | params" in outputs  # the trainer's state, inspected in the kernel
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_optax_delay_notebook_executes(tmp_path):
    outputs = _execute("optax_delay.ipynb", {"OPTAX_DELAY_STEPS": "150", "OPTAX_DELAY_OUT": str(tmp_path)})
    for opt in ("AdamW", "Muon"):
        for arm in ("sync", "delay(1)", "delay(1) + EF"):
            assert f"{opt:5s} {arm:13s} held-out loss" in outputs
        assert f"{opt:5s} delay gap" in outputs
    assert (tmp_path / "optax_delay.png").stat().st_size > 1000
