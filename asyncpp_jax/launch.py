"""Local multi-host launcher: N processes of the trainer on this machine form one JAX job.

    python -m asyncpp_jax.launch --processes 4 --devices_per_process 2 -- \\
        --config=configs/tiny.py --config.pipeline.stages=4 --workdir=runs/mh

Each process runs ``python -m asyncpp_jax.main <args after -->`` with the environment a cluster
scheduler would give it: ``JAX_COORDINATOR_ADDRESS=localhost:PORT``, ``JAX_NUM_PROCESSES=N`` and
``JAX_PROCESS_ID=i`` (read by ``asyncpp_jax.distributed``, which calls
``jax.distributed.initialize``), plus ``JAX_NUM_CPU_DEVICES=K`` and
``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`` (JAX reads these options from the environment when it
is imported, i.e. before anything else, as ``jax.config.update`` would set them).  The mesh then
spans N*K CPU devices, process ``i`` holding devices ``i*K .. i*K + K - 1``, and collectives cross
the processes over gloo: the program, the rows each process loads, the checkpoints and the
preemption protocol are those of a cluster job.

``--pin_cpus`` gives each process its own share of this machine's cores (``ASYNCPP_CPUS``), as
each host of a cluster has its own: on XLA:CPU one device's program already spreads over every core
it may use, so without it the processes' stages compete for the same cores and never really run at
the same time.

Each process's output is prefixed ``[i]``.  SIGTERM or SIGINT to the launcher is passed on as
SIGTERM to every process (a coordinated preemption save); SIGTERM to any one process alone does the
same.  If a process fails, the others are stopped (they would wait for it forever) and the
launcher exits with the failed process's code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from asyncpp_jax import host_setup  # no JAX import

_FAILED_GRACE_S = 20.0  # how long the others may take to stop on their own after one fails


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def port_problem(port: int) -> str | None:
    """Why the coordinator could not listen on ``port`` (None: it can).  Checked before any process
    starts: process 0's coordinator fails on a busy port deep inside JAX (a crash after "Failed to
    add port to server", the others waiting for it), with no word about the port."""
    if not 0 < port < 65536:
        return f"--port={port} is not a TCP port (1-65535); leave it out to pick a free one."
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no obstacle
        try:
            s.bind(("", port))
        except OSError as e:
            return (f"--port={port} cannot be used on this machine ({e.strerror}: another program listens there); "
                    "pass another --port, or leave it out to pick a free one.")
    return None


def process_env(base: dict, processes: int, devices_per_process: int, process_id: int, port: int,
                cpus: list[int] | None = None) -> dict:
    """The environment of process ``process_id`` of a local ``processes`` x ``devices_per_process`` job.
    ``cpus``: the cores to share out, ``len(cpus) // processes`` contiguous ones to each process
    (``ASYNCPP_CPUS``, applied by ``host_setup`` before JAX sizes its thread pools), so the hosts
    of the job do not share cores, as on a cluster."""
    env = dict(base)
    if cpus is not None:
        k = len(cpus) // processes
        if k < 1:
            raise ValueError(f"--pin_cpus needs at least one core per process: {len(cpus)} cores for "
                             f"--processes={processes}")
        env[host_setup.CPUS_ENV] = ",".join(str(c) for c in cpus[process_id * k:(process_id + 1) * k])
    # JAX_NUM_CPU_DEVICES decides the device count; a forced XLA count would only confuse a reader.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(
        XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices_per_process),
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
        JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(process_id), PYTHONUNBUFFERED="1",
    )
    return env


def spawn(main_args: list[str], processes: int, devices_per_process: int, port: int | None = None,
          cwd: str | None = None, module: str = "asyncpp_jax.main", pin_cpus: bool = False) -> list[subprocess.Popen]:
    """Start the processes (stdout and stderr merged into one pipe each); returns them in id order."""
    if processes < 1 or devices_per_process < 1:
        raise ValueError(f"--processes={processes} and --devices_per_process={devices_per_process} must be >= 1")
    port = port or free_port()
    cpus = sorted(os.sched_getaffinity(0)) if pin_cpus else None
    envs = [process_env(os.environ, processes, devices_per_process, i, port, cpus) for i in range(processes)]
    return [subprocess.Popen([sys.executable, "-m", module, *main_args], cwd=cwd, env=envs[i],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(processes)]


def _relay(i: int, proc: subprocess.Popen, out) -> None:
    for line in proc.stdout:
        out.write(f"[{i}] {line}")
        out.flush()


def wait_all(procs: list[subprocess.Popen], out=sys.stdout, grace_s: float = _FAILED_GRACE_S) -> int:
    """Relay every process's output until all exit; 0 if all exit 0, else the first failure's code."""
    relays = [threading.Thread(target=_relay, args=(i, p, out), daemon=True) for i, p in enumerate(procs)]
    for t in relays:
        t.start()
    failed_at = None
    code = 0
    while [p.poll() for p in procs].count(None):  # poll every process (any() would stop at the first)
        bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if bad and failed_at is None:
            code, failed_at = bad[0], time.monotonic()
            out.write(f"launch: a process exited with code {code}; stopping the others\n")
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    for t in relays:
        t.join(timeout=5)
    return code or next((p.returncode for p in procs if p.returncode), 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, main_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="python -m asyncpp_jax.launch [options] -- [asyncpp_jax.main flags]")
    ap.add_argument("--processes", type=int, required=True, help="processes (hosts) in the job")
    ap.add_argument("--devices_per_process", type=int, default=1, help="CPU devices per process")
    ap.add_argument("--port", type=int, default=0, help="coordinator port on localhost (default: a free one)")
    ap.add_argument("--pin_cpus", action="store_true",
                    help="give each process its own share of this machine's cores (else all share them all)")
    a = ap.parse_args(own)
    if a.port and port_problem(a.port):
        print(f"launch: error: {port_problem(a.port)}", file=sys.stderr)
        return 1
    try:
        procs = spawn(main_args, a.processes, a.devices_per_process, a.port or None, pin_cpus=a.pin_cpus)
    except ValueError as e:
        ap.error(str(e))
    for i, p in enumerate(procs):
        print(f"launch: process {i} pid {p.pid}", flush=True)

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return wait_all(procs)


if __name__ == "__main__":
    sys.exit(main())
