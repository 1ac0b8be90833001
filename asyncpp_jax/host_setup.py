"""Process set-up that must happen before JAX's backend starts.

* ``cpu_only_host()``: whether JAX will run on XLA:CPU (the config checks how many fake devices it can have).
* ``pin_cpus()``: keep this process on the CPU ids in ``ASYNCPP_CPUS`` (e.g. ``"0"`` or ``"2-3"``), so
  that jobs sharing a CPU host (``experiments.sweep --jobs N``) each get their own cores instead of
  fighting over all of them.
* ``reuse_freed_memory()``: on a CPU host with glibc, keep freed memory in the process for reuse
  instead of handing it back to the kernel, so a jitted step's buffers do not fault fresh pages in
  at every call (``prepare`` applies it to runs on several fake devices).
* ``add_host_devices(n)``: ``n`` fake CPU devices for a mesh on a CPU-only host, through JAX's
  ``jax_num_cpu_devices`` option.  Left alone when the user has chosen a count already
  (``JAX_NUM_CPU_DEVICES``, which ``launch`` sets per process, or ``--xla_force_host_platform_device_count``
  in ``XLA_FLAGS``).

Importing this module does not import JAX (``main`` validates the config first, so a bad setting
costs no JAX start-up); ``add_host_devices`` imports it to set the option, which JAX accepts only
before its backend starts, i.e. before the first array or device query.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os

FORCE_DEVICES = "--xla_force_host_platform_device_count"
CPUS_ENV = "ASYNCPP_CPUS"
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


# glibc's mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8
_KEEP = 2**31 - 1  # mallopt takes an int: "never trim"


def reuse_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse (``mallopt``); whether it did (False off glibc).

    XLA:CPU allocates a compiled call's buffers on every call and frees them after; at the work
    benchmark's shape a pipeline step's loop state (stash, rings, accumulators) is one ~250 MB
    block per fake device.  By default glibc serves such blocks with fresh ``mmap`` pages and
    unmaps them on ``free``, so every call faults its pages in again: ~0.4 ms per MB on one core,
    about a tenth of the engine's step at that shape.  Three settings keep them:

    * ``M_MMAP_MAX = 0``: no block is mmapped (the mmap threshold caps at 32 MB);
    * ``M_ARENA_MAX = 1``: threads started afterwards (XLA's device threads) share the main heap,
      since a thread's own arena mmaps any block above its 64 MB heap whatever the settings;
    * ``M_TRIM_THRESHOLD`` never, ``M_TOP_PAD`` 64 MB: freed memory stays in the heap.

    The price is resident memory: it stays at its peak instead of returning to the kernel between
    steps, and the one heap fragments, so over the first steps it settles at 1.6-2.8 times the
    peak glibc's defaults reach (``zb-h1`` at the work benchmark's shape: 3.7 GB against 2.35 GB;
    the simulate step there: 2.1 GB against 1.2 GB).  Call it before JAX's backend starts, from an
    entry point on a CPU host (``prepare`` for several fake devices, the tests, the benchmarks),
    never on import: a library must not change its host process's allocator."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to tune
        return False
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_MAX, 0), (_M_ARENA_MAX, 1), (_M_TRIM_THRESHOLD, _KEEP), (_M_TOP_PAD, 64 << 20)))


def parse_cpus(spec: str) -> set[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}``: the cpu-list syntax of ``taskset -c``."""
    cpus = set()
    try:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, dash, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi if dash else lo) + 1))
    except ValueError:
        raise ValueError(f"{CPUS_ENV}={spec!r} is not a CPU list; write ids and ranges like '0' or '0,2-3'") from None
    if not cpus:
        raise ValueError(f"{CPUS_ENV}={spec!r} names no CPU; write ids and ranges like '0' or '0,2-3', or unset it")
    return cpus


def pin_cpus(environ=os.environ) -> set[int] | None:
    """Restrict this process to the CPUs in ``ASYNCPP_CPUS``, if set (before JAX sizes its thread pools)."""
    spec = environ.get(CPUS_ENV)
    if not spec:
        return None
    cpus = parse_cpus(spec)
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"{CPUS_ENV}={spec!r} names CPUs {sorted(cpus - allowed)} this process may not use "
                         f"(allowed: {sorted(allowed)}); choose among those")
    os.sched_setaffinity(0, cpus)
    return cpus


def prepare(host_devices: int = 1) -> None:
    """Everything above, for a run with ``host_devices`` mesh devices.

    ``reuse_freed_memory`` only for several fake devices on a CPU host, where each device's
    per-call loop state would be faulted in afresh at every step; its price in resident memory is
    in its docstring.  A one-device run gains less than it pays (120 updates of the main job: 11%
    faster, but 3.6 GB resident against 1.3 GB), and an accelerator's runtime keeps its device
    memory itself."""
    pin_cpus()
    if host_devices > 1 and cpu_only_host():
        reuse_freed_memory()
    add_host_devices(host_devices)
