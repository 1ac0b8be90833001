"""Process set-up that must happen before JAX starts (so nothing here imports JAX).

* ``--xla_force_host_platform_device_count=N`` in ``XLA_FLAGS``: fake CPU devices for a mesh on a
  CPU-only host.  Added only when the user has not set it.
* SOAP on XLA:CPU runs on one core.  With jaxlib 0.10.2 a program holding SOAP's basis refresh
  (batched matmuls, ``eigh``/QR, gather) deadlocks within a few updates when XLA:CPU runs it on
  two or more threads: every worker idles in the thread pool while the host waits for the result
  (seen in gdb).  ``--xla_cpu_enable_concurrency_optimized_scheduler=false`` cured the bare
  optimizer update but not the full train step; restricting the process to one core (its CPU
  affinity, which sizes XLA's thread pool) cured both in every try.  So a SOAP run on a CPU-only
  host is pinned to one core, with a warning; GPU/TPU hosts are left alone.
"""

from __future__ import annotations

import importlib.util
import logging
import os

log = logging.getLogger(__name__)

FORCE_DEVICES = "--xla_force_host_platform_device_count"
# Installed JAX backends other than the CPU one; if none is present the backend is XLA:CPU.
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin",
                        "libtpu")


def cpu_only_host() -> bool:
    """Whether JAX will run on XLA:CPU: ``JAX_PLATFORMS=cpu``, or no accelerator backend installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS)


def add_host_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices unless ``XLA_FLAGS`` already says how many."""
    now = os.environ.get("XLA_FLAGS", "")
    if n > 1 and FORCE_DEVICES not in now:
        os.environ["XLA_FLAGS"] = f"{now} {FORCE_DEVICES}={n}".strip()


def pin_one_core() -> bool:
    """Restrict this process to one CPU core (the SOAP-on-XLA:CPU deadlock workaround above).

    Returns True if it pinned.  Must run before JAX starts: XLA sizes its thread pool then.
    """
    if not hasattr(os, "sched_setaffinity"):
        return False
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return False
    os.sched_setaffinity(0, {cores[0]})
    log.warning("SOAP on XLA:CPU: pinned to core %d of %d, because XLA:CPU (jaxlib 0.10.2) deadlocks in "
                "SOAP's basis refresh on more than one thread (see asyncpp_jax/host_setup.py).",
                cores[0], len(cores))
    return True


def prepare(host_devices: int = 1, optimizer_name: str | None = None) -> None:
    """Everything above, for a run with ``host_devices`` mesh devices and the named optimizer."""
    add_host_devices(host_devices)
    if optimizer_name == "soap" and cpu_only_host():
        pin_one_core()
