"""The quickstart notebook runs headlessly on CPU at a tiny size, so it cannot rot."""

import json
import os
import sysconfig

import nbclient
import nbformat

from asyncpp_jax import configs

STDLIB = sysconfig.get_paths()["stdlib"]


def test_quickstart_notebook_executes(tmp_path, cache_dir):
    nb = nbformat.read(configs.REPO_ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    env = {"QUICKSTART_STEPS": "4", "QUICKSTART_OUT": str(tmp_path),
           "QUICKSTART_OVERRIDES": json.dumps([f"--config.data.source={STDLIB}/json/*.py",
                                               f"--config.data.cache_dir={cache_dir}",
                                               "--config.data.val_fraction=0.2"])}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(configs.REPO_ROOT)}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    for arm in ("sync", "2bw", "2bw + EF"):
        assert f"{arm:9s} final validation loss" in outputs
    assert (tmp_path / "curves.png").stat().st_size > 1000
