"""Shared fixtures, the test platform, and the ``needs_devices`` marker.

Platform rule (set here, before JAX starts):

* ``JAX_PLATFORMS`` set by the user: honoured as given (``JAX_PLATFORMS=cpu`` forces the CPU on an
  accelerator host; ``JAX_PLATFORMS=cuda`` or ``tpu`` insists on the accelerator).
* Not set: the suite runs on the accelerator when a JAX accelerator plugin is installed (CUDA, ROCm,
  TPU), else on the CPU (``JAX_PLATFORMS=cpu``).
* On an accelerator, float32 matmuls run at full precision (``JAX_DEFAULT_MATMUL_PRECISION=highest``
  unless set), as the NumPy references assume.

Compiled programs are shared through JAX's persistent compilation cache, in a directory of this
run's own (``JAX_COMPILATION_CACHE_DIR`` unless set; removed when the run ends): many tests compile
the same step (a reference runner, a trainer built again to resume), and the xdist workers and the
CLI subprocesses that tests start inherit the directory, so each program compiles once per run.

On the CPU, XLA is asked for 4 fake devices (unless ``XLA_FLAGS`` already says how many), so the
data-parallel and pipeline tests have a mesh.  Tests that need more devices than the platform has
declare it with ``@pytest.mark.needs_devices(n)`` and are skipped, with the reason, where fewer are
present (e.g. one GPU).  On the CPU, XLA compiles at optimisation level 0 (below).  Multi-process
launches (``asyncpp_jax.launch``) always use fake CPU devices in their child processes, so they run
on any host.
"""

import os
import shutil
import tempfile

import pytest

from asyncpp_jax import host_setup  # no JAX import

FAKE_CPU_DEVICES = 4

# Set before JAX starts, in the first process that imports this file (pytest itself, or xdist's
# controller, whose workers inherit it), so every worker and subprocess of the run shares the one
# directory; every program is cached (no minimum compile time or size).
_XLA_CACHE_ENV = "ASYNCPP_TEST_XLA_CACHE"
if _XLA_CACHE_ENV not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ[_XLA_CACHE_ENV] = tempfile.mkdtemp(prefix="asyncpp-jax-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_XLA_CACHE_ENV]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    # No size bound: a bound turns on eviction, which rescans the whole directory on every write,
    # quadratic over a run's thousands of programs.  Without its locks, an entry read while another
    # process writes it fails to decompress, and JAX warns and compiles the program instead.
    _OWNS_XLA_CACHE = True
else:
    _OWNS_XLA_CACHE = False

if host_setup.cpu_only_host():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    host_setup.reuse_freed_memory()  # as `main` does on a CPU host: no fresh pages per compiled call
else:  # the references are float32/float64 NumPy: no TF32 or bf16 passes in an accelerator's f32 matmuls
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
host_setup.add_host_devices(FAKE_CPU_DEVICES)  # affects the CPU backend only

# The suite compiles over a thousand small programs and runs each for a few steps, so on the CPU much
# of its time is LLVM optimising code that barely runs.  Level 0 instead of XLA's default cut the
# README's test command from 980 s (default) and 864 s (level 1) to 750 s on 2 cores, every test
# passing; the tests that train longest (the notebooks, the CLI runs) lose a few seconds, the
# compile-bound engine tests gain more.  No test's verdict rests on it (each compares programs
# compiled alike, or a reference at a tolerance).  Set in the environment, so the CLI subprocesses
# tests start inherit it; a level in the user's XLA_FLAGS wins.
_OPT_LEVEL = "--xla_backend_optimization_level"
if host_setup.cpu_only_host() and _OPT_LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OPT_LEVEL}=0".strip()


def pytest_unconfigure(config):
    if _OWNS_XLA_CACHE:
        shutil.rmtree(os.environ[_XLA_CACHE_ENV], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before fixtures build a mesh the platform cannot hold
def pytest_runtest_setup(item):
    marker = item.get_closest_marker("needs_devices")
    if marker is None:
        return
    import jax

    need, have = int(marker.args[0]), jax.device_count()
    if have < need:
        fix = ("XLA_FLAGS sets fewer fake CPU devices" if jax.default_backend() == "cpu"
               else f"run with JAX_PLATFORMS=cpu for {FAKE_CPU_DEVICES} fake CPU devices")
        pytest.skip(f"needs {need} devices, this {jax.default_backend()} platform has {have} ({fix})")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One corpus cache for the whole session: each small corpus is prepared once."""
    return str(tmp_path_factory.mktemp("corpora"))


@pytest.fixture(scope="session")
def mesh():
    """A one-device data mesh (the simulate runner on the first device)."""
    import jax

    from asyncpp_jax.pipeline.mesh import make_mesh

    return make_mesh(1, jax.devices()[:1])
