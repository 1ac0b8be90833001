"""A lower bound on the host memory a CPU run needs, checked before anything is allocated.

On XLA:CPU every (fake) device lives in the host's RAM and nothing bounds a run's memory up front:
an impossible size surfaces as a ``RESOURCE_EXHAUSTED`` traceback for terabytes at the first step,
or as a silent wait while the parameter init swaps.  This check sums what is certain to be held
at once (every device's shard of the train state, one microbatch's fp32 logits and one layer's
fp32 attention scores) and compares it with the host's memory (or its cgroup limit): it is a floor,
so it never refuses a run that fits, and it turns the hopeless ones into a one-line ConfigError.
"""

from __future__ import annotations

import os
import pathlib

import jax
import numpy as np

from asyncpp_jax import configs

GB = 1e9


def host_memory_bytes() -> int | None:
    """Physical memory, or the cgroup's limit if lower; None when unknown."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = pathlib.Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            sizes.append(int(text))
    return min(sizes) if sizes else None


def _state_bytes(abstract_state, n_devices: int) -> int:
    """Bytes of the state over all devices: each device's shard (a replicated leaf is held n times)."""
    total = 0
    for x in jax.tree.leaves(abstract_state):
        try:
            itemsize = np.dtype(x.dtype).itemsize
        except TypeError:  # typed PRNG keys
            itemsize = 8
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            total += int(np.prod(x.shape)) * itemsize * n_devices
            continue
        shard = sharding.shard_shape(x.shape)
        total += int(np.prod(shard)) * itemsize * len(sharding.device_set)
    return total


def estimate(c, abstract_state, n_devices: int) -> dict[str, int]:
    """The floor's parts in bytes (``c`` resolved)."""
    m = c.model
    rows = max(c.train.global_batch_size // max(c.train.microbatches, 1), 1)  # one microbatch, all replicas
    return {
        "train state": _state_bytes(abstract_state, n_devices),
        "one microbatch's logits": rows * c.data.seq_len * m.vocab_size * 4,
        "one layer's attention scores": rows * m.n_heads * c.data.seq_len ** 2 * 4,
    }


def check_fits(c, abstract_state, n_devices: int, available: int | None = None) -> None:
    """Raise :class:`configs.ConfigError` if the floor exceeds the host's memory."""
    available = host_memory_bytes() if available is None else available
    if not available:
        return
    parts = estimate(c, abstract_state, n_devices)
    need = sum(parts.values())
    if need <= available:
        return
    detail = ", ".join(f"{k} {v / GB:.3g} GB" for k, v in parts.items())
    biggest = max(parts, key=parts.get)
    fix = {"train state": "lower config.model.vocab_size / d_model / n_layers, or mesh.data (each replica "
                          "holds the whole state)",
           "one microbatch's logits": "lower config.model.vocab_size or data.seq_len, or raise "
                                      "train.microbatches",
           "one layer's attention scores": "lower config.data.seq_len or model.n_heads, or raise "
                                           "train.microbatches"}[biggest]
    raise configs.ConfigError(
        f"this run needs at least {need / GB:.3g} GB of host memory ({detail}) and this host has "
        f"{available / GB:.3g} GB; {fix}, or run on the accelerators the config is meant for "
        "(python -m asyncpp_jax.main --dry_run reports the memory per device).")
