"""Writes notebooks/quickstart.ipynb (run from the repository root); edit this, not the JSON."""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
nb.cells = [
    md("""# asyncpp_jax quickstart: a one-step gradient delay, and error feedback

Trains the same small model three ways and plots the validation loss:

* **sync**: ordinary training;
* **2bw**: every update applies the gradient of the previous weights (PipeDream-2BW's one-step delay);
* **2bw + EF**: the same delay with update-level error feedback.

Runs on Colab (TPU or GPU) or a CPU. The preset is picked from the accelerator found."""),
    code("""# Install (skipped when the package is already importable, e.g. in CI or a local checkout).
# On Colab set ASYNCPP_REPO to the git URL of your copy of this repository: it is cloned and
# installed editable, because the runs below read their config files from its configs/ directory
# (config files are not part of the installed package).
import importlib.util, os, subprocess, sys
ASYNCPP_REPO = os.environ.get("ASYNCPP_REPO", "")
if importlib.util.find_spec("asyncpp_jax") is None:
    if not ASYNCPP_REPO:
        raise SystemExit("asyncpp_jax is not installed: set ASYNCPP_REPO to its git URL and rerun this cell")
    subprocess.run(["git", "clone", "-q", ASYNCPP_REPO, "asyncpp_jax_repo"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "asyncpp_jax_repo"], check=True)
    sys.path.insert(0, os.path.abspath("asyncpp_jax_repo"))  # this kernel started before the install"""),
    code("""# Pick a preset from the accelerator. QUICKSTART_STEPS (set by CI) shrinks everything.
import json, pathlib, tempfile
import jax

backend = jax.default_backend()
# Each preset names the smallest accelerator it is for (config.hardware; a Colab T4 or TPU v5e has
# 16 GB): dense135m with remat and 32 microbatches of 8 sequences (tests/test_shipped_configs_fit.py
# checks its dry-run peak against that memory). On a larger device train.microbatches=-1 would
# choose fewer microbatches from the device's own memory.
PRESETS = {
    "tpu": {"config": "configs/dense135m.py", "steps": 2000, "overrides": [
        "--config.hardware=tpu-v5e-16gb", "--config.model.remat=True", "--config.train.microbatches=32"]},
    "gpu": {"config": "configs/dense135m.py", "steps": 2000, "overrides": [
        "--config.hardware=t4-16gb", "--config.model.remat=True", "--config.train.microbatches=32"]},
    "cpu": {"config": "configs/tiny.py", "steps": 300, "overrides": []},
}
preset = PRESETS.get(backend, PRESETS["cpu"])
if os.environ.get("QUICKSTART_STEPS"):
    preset = dict(config="configs/tiny.py", steps=int(os.environ["QUICKSTART_STEPS"]), overrides=[
        "--config.model.d_model=32", "--config.model.n_heads=2", "--config.model.n_kv_heads=1",
        "--config.model.d_ff=64", "--config.data.seq_len=32", "--config.train.global_batch_size=8",
        "--config.train.eval_batches=2"] + json.loads(os.environ.get("QUICKSTART_OVERRIDES", "[]")))
print(f"backend {backend}: {preset['config']}, {preset['steps']} updates")"""),
    code("""# Train sync, 2bw and 2bw + EF with the real CLI (each run resumes if interrupted).
import asyncpp_jax
repo_root = pathlib.Path(asyncpp_jax.__file__).resolve().parent.parent
out = pathlib.Path(os.environ.get("QUICKSTART_OUT", tempfile.mkdtemp(prefix="quickstart-")))
steps = preset["steps"]
arms = {"sync": [], "2bw": ["--config.staleness.mode=2bw"],
        "2bw + EF": ["--config.staleness.mode=2bw", "--config.staleness.mitigation=ef"]}
for name, flags in arms.items():
    cmd = [sys.executable, "-m", "asyncpp_jax.main", f"--config={preset['config']}",
           f"--workdir={out / name.replace(' ', '')}", f"--config.train.steps={steps}",
           f"--config.train.eval_every={max(steps // 6, 1)}", f"--config.optimizer.warmup_steps={max(steps // 10, 1)}",
           "--config.train.progress_bar=False", *preset["overrides"], *flags]
    subprocess.run(cmd, cwd=repo_root, check=True, capture_output=True, text=True)
    status = json.loads((out / name.replace(' ', '') / "status.json").read_text())
    print(f"{name:9s} final validation loss {status['val_loss_per_byte']:.4f} nats/byte")"""),
    code("""# Plot the validation curves.
import matplotlib
if "ipykernel" not in sys.modules or os.environ.get("QUICKSTART_STEPS"):
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 4))
for name in arms:
    rows = [json.loads(l) for l in (out / name.replace(' ', '') / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val_loss_per_byte"]) for r in rows if "val_loss_per_byte" in r]
    ax.plot(*zip(*val), marker="o", label=name)
ax.set(xlabel="update", ylabel="validation loss (nats/byte)", title="one-step delay and error feedback")
ax.legend()
fig.savefig(out / "curves.png")
print("saved", out / "curves.png")"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "notebooks/quickstart.ipynb")
