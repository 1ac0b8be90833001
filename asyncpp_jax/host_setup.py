"""Process set-up that must happen before JAX's backend starts.

* ``cpu_only_host()``: whether JAX will run on XLA:CPU (the config checks how many fake devices it can have).
* ``add_host_devices(n)``: ``n`` fake CPU devices for a mesh on a CPU-only host, through JAX's
  ``jax_num_cpu_devices`` option.  Left alone when the user has chosen a count already
  (``JAX_NUM_CPU_DEVICES``, which ``launch`` sets per process, or ``--xla_force_host_platform_device_count``
  in ``XLA_FLAGS``).

Importing this module does not import JAX (``main`` validates the config first, so a bad setting
costs no JAX start-up); ``add_host_devices`` imports it to set the option, which JAX accepts only
before its backend starts, i.e. before the first array or device query.
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
    """Ask JAX for ``n`` CPU devices (``jax_num_cpu_devices``) unless the user already said how many.

    Unlike editing ``XLA_FLAGS``, the option is this process's own: child processes (the tests'
    CLI runs, ``launch``'s workers) still choose their own count.
    """
    if n <= 1 or FORCE_DEVICES in os.environ.get("XLA_FLAGS", ""):
        return
    import jax  # here, not at the top: importing this module must not start JAX

    if jax.config.jax_num_cpu_devices >= 0:  # JAX_NUM_CPU_DEVICES, or an earlier call
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # the backend already runs with its device count
        raise RuntimeError(f"add_host_devices({n}) came after JAX's backend started ({e}); call it before "
                           "the first JAX array or device query, e.g. at the top of the script.") from None


def prepare(host_devices: int = 1) -> None:
    """Everything above, for a run with ``host_devices`` mesh devices."""
    add_host_devices(host_devices)
