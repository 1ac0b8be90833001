"""Fake CPU devices come from JAX's ``jax_num_cpu_devices`` option, set by ``host_setup`` before the
backend starts, for this process only; a count the user chose wins."""

import os
import subprocess
import sys

import pytest

from asyncpp_jax import configs

_PROBE = """
import os
from asyncpp_jax import host_setup
host_setup.add_host_devices(3)
import jax
print(len(jax.devices()), os.environ.get("XLA_FLAGS", ""), os.environ.get("JAX_NUM_CPU_DEVICES", ""), sep="|")
"""


def _probe(**env_overrides) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", **env_overrides)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                         cwd=configs.REPO_ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().split("|")


@pytest.mark.parametrize("env, want", [
    ({}, "3"),  # the option, and the environment children inherit is left alone
    ({"JAX_NUM_CPU_DEVICES": "2"}, "2"),  # launch's per-process count
])
def test_add_host_devices_sets_the_option_unless_the_user_chose(env, want):
    n, xla_flags, num_cpu = _probe(**env)
    assert n == want
    assert xla_flags == env.get("XLA_FLAGS", "") and num_cpu == env.get("JAX_NUM_CPU_DEVICES", "")


def test_asyncpp_cpus_pins_the_process_and_rejects_bad_lists():
    from asyncpp_jax import host_setup

    assert host_setup.parse_cpus("0,2-3") == {0, 2, 3}
    for bad in ("x", "1-", ","):
        with pytest.raises(ValueError, match="ASYNCPP_CPUS"):
            host_setup.parse_cpus(bad)
    assert host_setup.pin_cpus({}) is None
    first = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", "import os; from asyncpp_jax import host_setup; "
                          "host_setup.pin_cpus(); print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "ASYNCPP_CPUS": str(first)})
    assert out.returncode == 0 and out.stdout.strip() == f"[{first}]", out.stderr[-1000:]
    with pytest.raises(ValueError, match="may not use"):
        host_setup.pin_cpus({"ASYNCPP_CPUS": "100000"})


def test_bench_processes_worker_keeps_to_its_core_and_refuses_without_one():
    """The processes benchmark's stages must not share cores: a worker pins itself before JAX starts."""
    first = min(os.sched_getaffinity(0))
    code = ("import os; from experiments import bench_pipeline as b; b._setup_host('processes', 1); "
            "print(sorted(os.sched_getaffinity(0)))")
    env = {k: v for k, v in os.environ.items() if k != "ASYNCPP_CPUS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=configs.REPO_ROOT, env={**env, "ASYNCPP_CPUS": str(first), "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0 and out.stdout.strip() == f"[{first}]", out.stderr[-1000:]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=configs.REPO_ROOT, env={**env, "JAX_PLATFORMS": "cpu"})
    assert out.returncode != 0 and "ASYNCPP_CPUS" in out.stderr


_HEAP_PROBE = """
import ctypes, ctypes.util, threading
from asyncpp_jax import host_setup
libc = ctypes.CDLL(ctypes.util.find_library("c"))
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def freed_kept(n=20 << 20):  # a 20 MB block, the size of a step's buffer: mmapped, or from the heap?
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    mapped = libc.mallinfo2().hblkhd >= n
    libc.free(p)
    return not mapped and libc.mallinfo2().fordblks >= n
def in_new_thread(fn, *args):  # a thread started now, as XLA's device threads start after the set-up
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start(); t.join()
    return out[0]
before = freed_kept()
print(before, host_setup.reuse_freed_memory(), freed_kept(), in_new_thread(freed_kept, 256 << 20))
"""


def test_reuse_freed_memory_keeps_a_freed_block_in_the_heap():
    """glibc's default maps a 20 MB block afresh and hands it back on ``free``, so the next call
    faults its pages in again; after ``reuse_freed_memory`` it is served from the heap and stays
    there, free for the next allocation, and so is a 256 MB block (a device's loop state) that a
    thread started afterwards allocates (a thread's own arena would map it afresh)."""
    import ctypes
    import ctypes.util

    if not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"):
        pytest.skip("not glibc >= 2.33 (no mallinfo2 to read the heap with)")
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], capture_output=True, text=True, timeout=60,
                         cwd=configs.REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "True", "True"]


@pytest.mark.parametrize("devices, cpu_host, want", [(1, True, 0), (4, True, 1), (4, False, 0)])
def test_prepare_keeps_freed_memory_only_for_several_fake_devices(monkeypatch, devices, cpu_host, want):
    """The engine on fake CPU devices faults its per-device loop state in at every step, so
    ``prepare`` keeps freed memory there; a one-device run, or an accelerator's, keeps glibc's
    defaults (resident memory would settle well above its peak for little gain)."""
    from asyncpp_jax import host_setup

    calls = []
    monkeypatch.delenv(host_setup.CPUS_ENV, raising=False)
    monkeypatch.setattr(host_setup, "cpu_only_host", lambda: cpu_host)
    monkeypatch.setattr(host_setup, "reuse_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(host_setup, "add_host_devices", lambda n: calls.append(("devices", n)))
    host_setup.prepare(devices)
    assert calls.count(1) == want and ("devices", devices) in calls
