"""Process set-up that must happen before JAX starts (so nothing here imports JAX).

* ``cpu_only_host()``: whether JAX will run on XLA:CPU (the config checks how many fake devices it can have).
* ``--xla_force_host_platform_device_count=N`` in ``XLA_FLAGS``: fake CPU devices for a mesh on a
  CPU-only host.  Added only when the user has not set it.
"""

from __future__ import annotations

import importlib.util
import os

FORCE_DEVICES = "--xla_force_host_platform_device_count"
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def cpu_only_host() -> bool:
    """Whether JAX will run on XLA:CPU: ``JAX_PLATFORMS=cpu``, or no accelerator backend installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(_installed(name) for name in _ACCELERATOR_PLUGINS)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        return False


def add_host_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices unless ``XLA_FLAGS`` already says how many."""
    now = os.environ.get("XLA_FLAGS", "")
    if n > 1 and FORCE_DEVICES not in now:
        os.environ["XLA_FLAGS"] = f"{now} {FORCE_DEVICES}={n}".strip()


def prepare(host_devices: int = 1) -> None:
    """Everything above, for a run with ``host_devices`` mesh devices."""
    add_host_devices(host_devices)
