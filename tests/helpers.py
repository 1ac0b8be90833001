"""Helpers shared by several test files (fixtures live in ``conftest.py``).

Import as ``from helpers import ...``: pytest puts ``tests/`` on ``sys.path`` (the rootdir-relative
"prepend" import mode, ``tests/`` has no ``__init__.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from asyncpp_jax import configs
from asyncpp_jax import train_state as state_lib
from asyncpp_jax.train import step as step_lib

# ------------------------------------------------------------------------------ corpora and CLI

STDLIB = sysconfig.get_paths()["stdlib"]
SOURCE = f"{STDLIB}/json/*.py,{STDLIB}/email/*.py"  # ~40 real files, ~400 KB: a corpus every host has
SMALL_MODEL = dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)


def small_train_config(cache_dir, name, warmup_steps, **train):
    """A 2-layer, d_model 32 byte-level run on ``SOURCE`` (batch 8 of 32 tokens, lr 1e-2) for the
    trainer and fault tests; ``train`` sets the rest of ``config.train``."""
    c = configs.base_config()
    c.name = name
    c.model.update(vocab_size=257, **SMALL_MODEL)
    c.data.update(source=SOURCE, cache_dir=cache_dir, seq_len=32, val_fraction=0.2)
    c.train.update(global_batch_size=8, log_every=1, keep_checkpoints=5, progress_bar=False)
    c.train.update(**train)
    c.optimizer.update(lr=1e-2, warmup_steps=warmup_steps)
    return c


def run_cli(args, cwd=configs.REPO_ROOT, timeout=300, env=None) -> subprocess.CompletedProcess:
    """``python -m asyncpp_jax.main *args`` with the test process's ``XLA_FLAGS`` removed, so the CLI
    has to create any fake CPU devices it needs itself (as it must for a user)."""
    env = dict(os.environ if env is None else env)
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "asyncpp_jax.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------- optimizer loops


def flat(tree, prefix=()):
    """A nested dict of arrays as ``{key path: float64 array}``, for per-leaf comparisons."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flat(v, prefix + (k,)))
        return out
    return {prefix: np.asarray(tree, np.float64)}


def run_tx(tx, params, grads, jit=False):
    """Apply ``tx`` to the given gradients in turn: (flat updates per step, final state, final params)."""
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    p = params
    out = []
    for g in grads:
        u, state = update(g, state, p)
        p = optax.apply_updates(p, u)
        out.append(flat(u))
    return out, state, p


def orbax_round_trip(state, path):
    """Save ``state`` with orbax's StandardCheckpointer and restore it into the same structure."""
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path, state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    return restored


def assert_trees_equal(a, b):
    """Bit-for-bit equality of two pytrees' leaves (and their dtypes)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------ the simulate runner on a tiny model

SEQ, BATCH, MICRO, VOCAB = 8, 4, 2, 31


def tiny_model_cfg(n_layers=2, tie=None):
    """A dense model small enough for hand-written reference loops; ``tie=None`` keeps the default."""
    m = configs.base_config().model
    m.update(vocab_size=VOCAB, d_model=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24)
    if tie is not None:
        m.tie_embeddings = tie
    return m


def token_batches(n, seed=0):
    """``n`` random batches laid out (microbatches, rows per microbatch, SEQ + 1)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(0, VOCAB, (MICRO, BATCH // MICRO, SEQ + 1)), jnp.int32) for _ in range(n)]


def run_simulate_runner(cfg, tx, data, mesh, history=False, **runner):
    """The real simulate runner (``train.step``) at lr schedule 0 (``tx`` carries its own lr).

    ``runner``: ``weight_versions=`` or ``weight_prediction=``.  Returns the final train state, or with
    ``history=True`` the params (as NumPy) before the first and after every update.
    """
    extra = next(iter(runner.values()), None)
    step = step_lib.make_train_step(cfg, tx, optax.constant_schedule(0.0), mesh, **runner)
    state = jax.device_put(state_lib.init_state(cfg, tx, jax.random.key(0), extra), state_lib.replicated(mesh))
    hist = [jax.tree.map(np.asarray, state.params)]
    for b in data:
        state, _ = step(state, jax.device_put(b, NamedSharding(mesh, state_lib.BATCH_SPEC)))
        if history:
            hist.append(jax.tree.map(np.asarray, state.params))
    return hist if history else state


# ----------------------------------------------------------------------------- the sweep runner


def no_prepare(study, log):  # sweep tests never read a corpus
    return []


def fake_sweep_run(loss_of):
    """A sweep runner that writes the files a finished CLI run leaves behind (``loss_of(run id)``)."""
    calls = []

    def run(cmd, workdir, env):
        calls.append(workdir.name)
        workdir.mkdir(parents=True, exist_ok=True)
        loss = loss_of(workdir.name)
        rows = [{"step": 5, "loss": loss + 1, "val_loss_per_byte": loss + 0.5},
                {"step": 10, "loss": loss, "val_loss_per_byte": loss}]
        (workdir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (workdir / "config.json").write_text(json.dumps({"cmd": cmd[3:]}))
        (workdir / "status.json").write_text(json.dumps({"status": "finished", "val_loss_per_byte": loss}))
        return 0

    run.calls = calls
    return run
