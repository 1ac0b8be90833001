"""The local launcher's own contract (no JAX in the children): environment, output, failures."""

import io
import subprocess
import sys
import time

import pytest

from asyncpp_jax import launch


def test_each_process_gets_the_cluster_environment():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/x", "KEEP": "1"}
    envs = [launch.process_env(base, 3, 2, i, 1234) for i in range(3)]
    assert [e["JAX_PROCESS_ID"] for e in envs] == ["0", "1", "2"]
    for e in envs:
        assert e["JAX_COORDINATOR_ADDRESS"] == "localhost:1234" and e["JAX_NUM_PROCESSES"] == "3"
        assert e["JAX_NUM_CPU_DEVICES"] == "2" and e["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
        assert e["XLA_FLAGS"] == "--xla_dump_to=/tmp/x" and e["KEEP"] == "1"
    assert base["XLA_FLAGS"].startswith("--xla_force")  # the caller's environment is untouched


def test_pin_cpus_gives_each_process_its_own_cores():
    from asyncpp_jax import host_setup

    envs = [launch.process_env({}, 2, 1, i, 1234, cpus=[0, 1, 2, 3, 5]) for i in range(2)]
    assert [host_setup.parse_cpus(e[host_setup.CPUS_ENV]) for e in envs] == [{0, 1}, {2, 3}]  # the odd core unused
    assert host_setup.CPUS_ENV not in launch.process_env({}, 2, 1, 0, 1234)  # unpinned: all share all
    with pytest.raises(ValueError, match="--pin_cpus needs at least one core per process"):
        launch.process_env({}, 3, 1, 0, 1234, cpus=[0, 1])


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_output_is_prefixed_and_success_is_zero():
    out = io.StringIO()
    assert launch.wait_all([_python("print('a')"), _python("print('b')")], out) == 0
    assert sorted(out.getvalue().splitlines()) == ["[0] a", "[1] b"]


def test_a_failed_process_stops_the_others_and_sets_the_exit_code():
    out = io.StringIO()
    t0 = time.monotonic()
    hung = _python("import time; time.sleep(600)")  # like a process waiting in a collective
    code = launch.wait_all([hung, _python("import sys; sys.exit(3)")], out, grace_s=0.5)
    assert code == 3 and hung.returncode is not None and time.monotonic() - t0 < 60
    assert "exited with code 3; stopping the others" in out.getvalue()


def test_bad_arguments_are_a_clear_error(capsys):
    try:
        launch.main(["--processes", "0", "--", "--config=configs/tiny.py"])
    except SystemExit as e:
        assert e.code == 2
    assert "--processes=0 and --devices_per_process=1 must be >= 1" in capsys.readouterr().err


def test_a_busy_port_is_one_line_before_any_process_starts(capsys, monkeypatch):
    """Before: process 0 crashed inside JAX after "Failed to add port to server" (exit 245 after
    23 s), with no word about the port.  Now the launcher checks the port first: one line, exit 1,
    and no process is started."""
    import socket

    started = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: started.append(a) or [])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert launch.main(["--processes", "2", "--port", str(port), "--", "--config=configs/tiny.py"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--port={port} cannot be used on this machine" in err and not started
