"""Writes notebooks/quickstart.ipynb (run from the repository root); edit this, not the JSON."""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
nb.cells = [
    md("""# asyncpp_jax quickstart: a one-step gradient delay, and error feedback

Trains the same model three ways, in this Python process (config -> `Trainer` -> metrics), so every
trainer, its state and its curves stay inspectable between cells:

* **sync**: ordinary training;
* **2bw**: every update applies the gradient of the previous weights (PipeDream-2BW's one-step delay);
* **2bw + EF**: the same delay with update-level error feedback.

**Size.** On an accelerator (one GPU or TPU core): a dense byte-level Llama of **29,142,016
parameters** (d_model 512, 10 layers, 8 query / 4 KV heads, SwiGLU 1376, vocab 257, tied), sequence
512, batch 128 (65,536 tokens per update), bf16 compute, **7,000 updates per arm**, so 458.8M tokens
per arm and 1.38B tokens for the three. Estimate: 6 x N x tokens = 6 x 29.14M x 1.376B = 2.41e17
FLOPs; at 40% of an H100's 990 TFLOP/s dense bf16 (396 TFLOP/s) that is **about 10 minutes** on one
H100 (attention and evaluation add a little; a smaller chip takes proportionally longer: lower
`STEPS` below). The corpus is the Python standard library's sources (offline), seen for several
epochs at this size.

On a CPU: `configs/tiny.py` (2,968,064 parameters, sequence 128, batch 32) for 300 updates per
arm, about 3 minutes per arm on one core. Progress: a progress bar per run (its postfix shows the
training and the last validation loss), and each arm's final loss and time when it ends."""),
    code("""# Install (skipped when the package is already importable, e.g. in CI or a local checkout).
# On Colab set ASYNCPP_REPO to the git URL of your copy of this repository (or upload it and
# `pip install -e` it); the config files are read from the clone.
import importlib.util, os, subprocess, sys
ASYNCPP_REPO = os.environ.get("ASYNCPP_REPO", "")
if importlib.util.find_spec("asyncpp_jax") is None:
    if not ASYNCPP_REPO:
        raise SystemExit("asyncpp_jax is not installed: set ASYNCPP_REPO to its git URL and rerun this cell")
    subprocess.run(["git", "clone", "-q", ASYNCPP_REPO, "asyncpp_jax_repo"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "asyncpp_jax_repo"], check=True)
    sys.path.insert(0, os.path.abspath("asyncpp_jax_repo"))  # this kernel started before the install
    os.chdir("asyncpp_jax_repo")  # the config files are read from the repository"""),
    code("""# The config: configs/tiny.py, grown to the accelerator preset when one is present.
# QUICKSTART_STEPS (set by the tests) shrinks everything to a few updates of a 2-layer model.
import ast, json, logging, pathlib, tempfile, time
import jax
from asyncpp_jax import configs
from asyncpp_jax.models import count_params, dense
from asyncpp_jax.train.trainer import Trainer

logging.basicConfig(format="%(message)s")
logging.getLogger("asyncpp_jax").setLevel(logging.INFO)  # the trainer's model and routing summary
backend = jax.default_backend()
# The accelerator preset, as config overrides of configs/tiny.py. config.hardware is the device it
# is sized for: tests/test_shipped_configs_fit.py dry-runs this preset at full size and checks its
# peak memory against that device.
MODEL = ["--config.model.d_model=512", "--config.model.n_layers=10", "--config.model.n_heads=8",
         "--config.model.n_kv_heads=4", "--config.model.d_ff=1376", "--config.model.compute_dtype=bfloat16",
         "--config.data.seq_len=512", "--config.train.global_batch_size=128", "--config.train.eval_batches=8",
         "--config.train.log_every=50"]
PRESETS = {
    "gpu": {"config": "configs/tiny.py", "steps": 7000, "overrides": ["--config.hardware=h100-80gb"]},
    "tpu": {"config": "configs/tiny.py", "steps": 7000, "overrides": ["--config.hardware=tpu-v5p-95gb"]},
    "cpu": {"config": "configs/tiny.py", "steps": 300, "overrides": []},
}
for accelerator in ("gpu", "tpu"):
    PRESETS[accelerator]["overrides"] += MODEL
PRESET = PRESETS.get(backend, PRESETS["cpu"])
STEPS = PRESET["steps"]


def set_field(c, dotted, value):
    *path, last = dotted.split(".")
    for part in path:
        c = c[part]
    c[last] = value


def flag_value(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a plain string, e.g. bfloat16


def make_config(**overrides):
    c = configs.load_file(PRESET["config"])
    c.name = "quickstart"
    steps = STEPS
    for flag in PRESET["overrides"]:
        key, value = flag.removeprefix("--config.").split("=", 1)
        set_field(c, key, flag_value(value))
    if os.environ.get("QUICKSTART_STEPS"):
        steps = int(os.environ["QUICKSTART_STEPS"])
        c.model.update(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
        c.data.seq_len = 32
        c.train.update(global_batch_size=8, eval_batches=2, progress_bar=False)
        overrides = {**json.loads(os.environ.get("QUICKSTART_OVERRIDES", "{}")), **overrides}
    c.train.update(steps=steps, eval_every=max(steps // 7, 1), checkpoint_every=steps)
    c.optimizer.warmup_steps = max(steps // 20, 1)
    for key, value in overrides.items():
        set_field(c, key, value)
    return c


c = make_config()
n_params = count_params(dense.abstract_params(c.model))
tokens = c.train.steps * c.train.global_batch_size * c.data.seq_len
print(f"backend {backend}: {n_params:,} parameters, {c.train.steps} updates of "
      f"{c.train.global_batch_size} x {c.data.seq_len} tokens ({tokens / 1e6:.1f}M tokens per arm)")"""),
    code("""# Train the three arms in this process. Each keeps its Trainer: state, optimizer and metrics.
out = pathlib.Path(os.environ.get("QUICKSTART_OUT") or tempfile.mkdtemp(prefix="quickstart-"))
ARMS = {"sync": {}, "2bw": {"staleness.mode": "2bw"},
        "2bw + EF": {"staleness.mode": "2bw", "staleness.mitigation": "ef"}}
trainers, results = {}, {}
for name, overrides in ARMS.items():
    t0 = time.time()
    trainer = Trainer(make_config(**overrides), out / name.replace(" ", ""))  # resumes if rerun
    try:
        results[name] = trainer.run()
    finally:
        trainer.close()
    trainers[name] = trainer
    print(f"{name:9s} final validation loss {results[name].val_loss_per_byte:.4f} nats/byte "
          f"({time.time() - t0:.0f} s)")"""),
    md("""Everything is still here: `trainers[name].state` is the final train state (params, optimizer
state, step), `trainers[name].routing` says which optimizer each parameter got, and each run's
metrics are in `trainers[name].workdir / "metrics.jsonl"` (one JSON row per logged update)."""),
    code("""t = trainers["2bw + EF"]
print(t.routing.splitlines()[0] if t.routing else "")
print("step", int(t.state.step), "| params", count_params(t.state.params))
print("embedding table (tied to the output head)", t.state.params["embed"]["embedding"].shape,
      "| mean |w|", float(abs(t.state.params["embed"]["embedding"]).mean()))


def curves(trainer):
    rows = [json.loads(line) for line in (trainer.workdir / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss_per_byte"]) for r in rows if "val_loss_per_byte" in r]
    return train, val


for name, trainer in trainers.items():
    _, val = curves(trainer)
    print(f"{name:9s} validation (nats/byte) by update:", ", ".join(f"{s}: {v:.3f}" for s, v in val))"""),
    code("""# Plot the training and validation curves.
import matplotlib
if "ipykernel" not in sys.modules or os.environ.get("QUICKSTART_STEPS"):
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
for name, trainer in trainers.items():
    train, val = curves(trainer)
    ax_train.plot(*zip(*train), label=name, alpha=0.8)
    ax_val.plot(*zip(*val), marker="o", label=name)
ax_train.set(xlabel="update", ylabel="training loss (nats/token)", title="training")
ax_val.set(xlabel="update", ylabel="validation loss (nats/byte)", title="one-step delay and error feedback")
ax_val.legend()
fig.tight_layout()
fig.savefig(out / "curves.png")
print("saved", out / "curves.png")"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "notebooks/quickstart.ipynb")
