"""One command for a lent GPU or TPU: what runs there, how fast, and whether it agrees with the CPU.

    python -m experiments.device_check                  # on the accelerator, ~8 minutes at most
    python -m experiments.device_check --tiny --out /tmp/dc.jsonl   # the same code at toy size (CPU test)

In order, each part timed, a failing part recorded and the next one run:

1. ``tests``: the backend-neutral test files (``BACKEND_NEUTRAL_TESTS``, ``-m "not slow"``) on the
   device (tests/conftest.py runs them on the accelerator when one is present): pass/fail counts.
2. ``bench_mfu``: :mod:`experiments.bench_mfu` for ``configs/dense135m.py`` (bf16,
   ``model.attention='auto'``: splash on a TPU, cuDNN's flash kernel on a GPU; remat decided by the
   device's memory, ``train.auto_remat``) and for a small MoE (``configs/moe_tiny.py`` at bf16):
   step time, tokens/s, model TFLOP/s, MFU, and the attention kernel against the einsum path.
3. ``engine``: the pipeline engine on every device present (``pipeline.stages`` = the device count)
   under ``sync`` and ``2bw``, a few updates of a small model: its step time, and the largest
   difference of its parameters from the simulate runner's after the same updates (``sync``
   against no delay, ``2bw`` against ``delay(1)``; fp32, matmuls at full precision).  The engine
   needs two stages: on one device (one GPU) the part is recorded as skipped.
4. ``notebook``: the quickstart notebook's accelerator preset (``notebooks/quickstart.ipynb``) for
   ``NOTEBOOK_UPDATES`` updates through the trainer: status, validation loss, tokens/s.
5. ``lowering``: on a GPU, whether the step's attention holds cuDNN's fused kernel (its custom
   call in the compiled program); on a TPU, splash's ``tpu_custom_call``.

No part starts once the check has run ``BUDGET_S`` (7 minutes); it is recorded as skipped.
One ``device_check`` record (``--out``, default ``experiments/results/bench/device_check.jsonl``)
holds every part; ``python -m experiments.render_docs`` turns the accelerator records into the
tables of docs/accelerators.md.  ``--tiny`` shrinks every part (a 2-layer model, one test file,
two updates) so that the CPU test suite runs this very code in seconds.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import traceback

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "experiments" / "results" / "bench" / "device_check.jsonl"
BACKEND_NEUTRAL_TESTS = ("tests/test_attention.py", "tests/test_model.py", "tests/test_moe.py",
                         "tests/test_staleness.py", "tests/test_optim_muon.py", "tests/test_optim_adan.py",
                         "tests/test_optim_mars.py", "tests/test_delay_corrections.py")
TINY_TESTS = ("tests/test_report_stats.py",)
NOTEBOOK_UPDATES = 50
TESTS_TIMEOUT_S = 180
ENGINE_UPDATES = 3
BUDGET_S = 420  # no part starts after 7 minutes, so that the check ends within about 8
TINY_MODEL = dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)


def notebook_presets() -> dict:
    """The PRESETS of the notebook's preset cell, built by that cell's own top-level assignments
    and loops (the notebook is generated, not imported; nothing else of the cell runs)."""
    nb = json.loads((REPO_ROOT / "notebooks" / "quickstart.ipynb").read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if "PRESETS = {" in src:
            body = [n for n in ast.parse(src).body if isinstance(n, (ast.Assign, ast.For))
                    and ("PRESETS" in ast.unparse(n) or "MODEL" in ast.unparse(n)) and "get(" not in ast.unparse(n)]
            scope: dict = {}
            exec(compile(ast.Module(body=body, type_ignores=[]), "quickstart", "exec"), {}, scope)
            return scope["PRESETS"]
    raise ValueError("notebooks/quickstart.ipynb has no cell defining PRESETS")


def _notebook_preset(backend: str) -> tuple[str, list[str], int]:
    """``(config file, overrides, steps)`` of the notebook's preset for ``backend`` (gpu, tpu, cpu)."""
    presets = notebook_presets()
    preset = presets.get(backend, presets["cpu"])
    return preset["config"], list(preset["overrides"]), preset["steps"]


def run_tests(tiny: bool) -> dict:
    files = TINY_TESTS if tiny else BACKEND_NEUTRAL_TESTS
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-n", "0", *files]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
        text, rc = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
    failed = re.findall(r"^FAILED (\S+)", text, re.M)
    return {"files": list(files), "returncode": rc, "counts": counts, "failed": failed[:20],
            "seconds": time.perf_counter() - t0}


def _load(path: str, settings: list[str]):
    from asyncpp_jax import configs
    from experiments import bench_mfu

    return bench_mfu.with_settings(configs.load_file(REPO_ROOT / path), settings)


def run_bench(tiny: bool) -> list[dict]:
    from experiments import bench_mfu

    small = [f"model.{k}={v}" for k, v in TINY_MODEL.items()] + ["data.seq_len=16", "train.global_batch_size=4",
                                                                  "train.microbatches=1", "model.vocab_size=257"]
    cases = [("configs/dense135m.py", ["model.compute_dtype=bfloat16", "model.attention=auto", "model.remat=False",
                                       "train.auto_remat=True"]),
             ("configs/moe_tiny.py", ["model.compute_dtype=bfloat16", "model.attention=auto"])]
    out = []
    for path, settings in cases:
        if tiny:
            settings = settings + small + ["hardware=cpu"]
        out.append(bench_mfu.measure(_load(path, settings), steps=2 if tiny else 5))
        print(bench_mfu.format_figures(out[-1]), flush=True)
    return out


def _engine_config(schedule: str, stages: int, runner: str, staleness: str):
    from asyncpp_jax import configs

    c = configs.load_file(REPO_ROOT / "configs" / "tiny.py")
    c.model.update(**dict(TINY_MODEL, n_layers=2 * stages))
    c.data.seq_len = 32
    c.train.update(global_batch_size=8 * stages, microbatches=2 * stages)
    c.runner = runner
    if runner == "pipeline":
        c.pipeline.update(stages=stages, schedule=schedule)
    else:
        c.staleness.mode = staleness
    return configs.resolve(c)


def run_engine(devices) -> list[dict] | dict:
    """Each schedule on all of ``devices`` against the simulate runner on the first one.  The
    engine needs two stages, so one device (one GPU) skips it, saying so."""
    import jax

    if len(devices) < 2:
        return {"skipped": f"the pipeline engine needs 2 or more devices; {len(devices)} present"}
    with jax.default_matmul_precision("highest"):  # fp32 parity: no TF32 or bf16 passes
        return [_engine_against_simulate(devices, schedule, staleness)
                for schedule, staleness in (("sync", "sync"), ("2bw", "2bw"))]


def _engine_against_simulate(devices, schedule: str, staleness: str) -> dict:
    """``ENGINE_UPDATES`` updates of the engine on ``devices`` and of the simulate runner (with the
    delay ``staleness``) on the first, from the same init and batches; the engine's step time."""
    import jax
    import numpy as np

    from asyncpp_jax.pipeline.spmd import engine
    from asyncpp_jax.train import runner as runner_lib

    stages, params, seconds, loss = len(devices), {}, [], None
    for runner_name in ("pipeline", "simulate"):
        c = _engine_config(schedule, stages, runner_name, staleness)
        r = runner_lib.build(c, devices if runner_name == "pipeline" else devices[:1])
        state = r.init_state(jax.random.key(c.seed))
        rng = np.random.default_rng(0)
        M, B, T = c.train.microbatches, c.train.global_batch_size, c.data.seq_len
        for _ in range(ENGINE_UPDATES):
            batch = jax.device_put(rng.integers(0, c.model.vocab_size, (M, B // M, T + 1), dtype=np.int32),
                                   r.batch_sharding())
            t0 = time.perf_counter()
            state, metrics = r.train_step(state, batch)
            jax.block_until_ready(state)
            if runner_name == "pipeline":
                seconds.append(time.perf_counter() - t0)
                loss = float(metrics["loss"])
        params[runner_name] = (engine.to_model_layout(c.model, state.params) if runner_name == "pipeline"
                               else state.params)
    return {"schedule": schedule, "stages": stages, "updates": ENGINE_UPDATES, "loss": loss,
            "step_s_after_compile": min(seconds[1:]),
            "max_abs_param_difference_vs_simulate": _max_param_difference(params["pipeline"], params["simulate"])}


def _max_param_difference(a, b) -> float:
    import jax
    import numpy as np

    return float(max(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                     for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def run_notebook(tiny: bool, workdir: pathlib.Path) -> dict:
    import jax

    from asyncpp_jax import configs
    from asyncpp_jax.train.trainer import Trainer
    from experiments import bench_mfu

    backend = jax.default_backend()  # the notebook's own key: gpu, tpu or cpu
    path, overrides, _ = _notebook_preset(backend)
    settings = [o.removeprefix("--config.") for o in overrides]
    updates = 2 if tiny else NOTEBOOK_UPDATES
    # as the notebook's make_config shortens a run: warmup over a twentieth of the updates
    settings += [f"train.steps={updates}", f"train.eval_every={updates}", f"train.checkpoint_every={updates}",
                 f"optimizer.warmup_steps={max(updates // 20, 1)}", "train.eval_batches=2",
                 "train.progress_bar=False", "train.log_every=1"]
    if tiny:
        settings += [f"model.{k}={v}" for k, v in TINY_MODEL.items()] + [
            "data.seq_len=32", "train.global_batch_size=8", f"data.source={_tiny_source()}", "data.val_fraction=0.2"]
    c = bench_mfu.with_settings(configs.load_file(REPO_ROOT / path), settings)
    c.name = "device_check_notebook"
    configs.validate(c)
    t0 = time.perf_counter()
    result = Trainer(c, workdir).run()
    seconds = time.perf_counter() - t0
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    tps = [r["tokens_per_sec"] for r in rows if isinstance(r.get("tokens_per_sec"), (int, float))]
    return {"preset": backend, "config": path, "settings": settings, "status": result.status, "updates": result.step,
            "val_loss_per_byte": result.val_loss_per_byte, "seconds": seconds,
            "tokens_per_s_median": sorted(tps)[len(tps) // 2] if tps else None}


def _tiny_source() -> str:
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    return f"{stdlib}/json/*.py"


def run_lowering(platform: str) -> dict:
    """Whether the compiled attention of a bf16 step at T = 512 holds the fused kernel's custom call."""
    import jax
    import jax.numpy as jnp

    from asyncpp_jax.models import layers

    q = jnp.zeros((2, 512, 8, 64), jnp.bfloat16)
    k = jnp.zeros((2, 512, 4, 64), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(512), (2, 512))
    grad = jax.jit(jax.grad(lambda q, k: jnp.sum(layers.attend(q, k, k, positions, "auto").astype(jnp.float32)),
                            argnums=(0, 1)))
    text = grad.lower(q, k).compile().as_text()
    marks = {"cuda": "__cudnn$fmha", "tpu": "tpu_custom_call"}
    mark = marks.get(platform)
    return {"platform": platform, "auto_kernel": layers.auto_kernel(platform, 512), "looked_for": mark,
            "found": (mark in text) if mark else None}


def _part(figures: dict, name: str, fn):
    t0 = time.perf_counter()
    try:
        figures[name] = fn()
    except Exception as e:  # noqa: BLE001 - a failing part is a finding: record it, run the rest
        figures[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
    figures.setdefault("seconds", {})[name] = time.perf_counter() - t0
    print(f"[device_check] {name}: {time.perf_counter() - t0:.0f} s"
          + (f" FAILED {figures[name]['error'][:300]}" if isinstance(figures[name], dict)
             and "error" in figures[name] else ""), flush=True)


def check(tiny: bool, out: pathlib.Path, parts=("tests", "bench_mfu", "engine", "notebook", "lowering")) -> dict:
    """Run the parts, append one record to ``out``, and return it."""
    import jax

    from experiments import bench_mfu, records

    # The fit and the benchmark compile the same step: the second compile is a cache hit.
    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(tempfile.gettempdir()) / "asyncpp_jax_xla_cache"))
    devices = jax.devices()
    figures: dict = {"tiny": tiny, "platform": bench_mfu.platform(), "device_kind": devices[0].device_kind,
                     "devices": len(devices)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        steps = {"tests": lambda: run_tests(tiny), "bench_mfu": lambda: run_bench(tiny),
                 "engine": lambda: run_engine(devices[:2] if tiny else devices),
                 "notebook": lambda: run_notebook(tiny, pathlib.Path(tmp) / "notebook"),
                 "lowering": lambda: run_lowering(figures["platform"])}
        for name in parts:
            if time.perf_counter() - t0 > BUDGET_S:
                figures[name] = {"skipped": f"the check had run {BUDGET_S} s, its budget before this part"}
                continue
            _part(figures, name, steps[name])
    figures["total_s"] = time.perf_counter() - t0
    record = records.make("device_check", figures)
    records.append(out, record)
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="every part at toy size (what the CPU test runs)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the JSONL file the record is appended to")
    a = p.parse_args(argv)
    record = check(a.tiny, pathlib.Path(a.out))
    failed = [k for k, v in record["figures"].items() if isinstance(v, dict) and "error" in v]
    print(f"[device_check] wrote a record to {a.out}; {record['figures']['total_s']:.0f} s"
          + (f"; parts that failed: {', '.join(failed)}" if failed else "; every part ran"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
