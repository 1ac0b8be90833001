"""Multi-host start: call ``jax.distributed.initialize()`` when the environment is a cluster.

JAX's ``initialize()`` with no arguments detects the coordinator, process count and process id
itself for SLURM (``srun``), Open MPI (``mpirun``) and Cloud TPU pod slices; this module only
decides *whether* the job spans several processes, so a single-host run never waits for a
coordinator.  After it, ``jax.devices()`` lists every host's devices; each process loads the rows
of the data replicas its devices hold (``train.batch_layout``, computed from the mesh), orbax writes
checkpoints from all processes, and SIGTERM to one process stops all at one step
(``train.preemption``).

On one CPU machine, ``python -m asyncpp_jax.launch`` sets the ``explicit`` variables for N local
processes, plus ``JAX_NUM_CPU_DEVICES`` and ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``, which JAX
reads as the ``jax_num_cpu_devices`` / ``jax_cpu_collectives_implementation`` options when it is
imported, i.e. before the backend starts.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "") or 0)
    except ValueError:
        return 0


def cluster_kind() -> str | None:
    """``explicit``, ``slurm``, ``openmpi`` or ``tpu_pod`` if this process is one of several, else None."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return "explicit"
    if os.environ.get("SLURM_JOB_ID") and _int_env("SLURM_NTASKS") > 1:
        return "slurm"
    if _int_env("OMPI_COMM_WORLD_SIZE") > 1:
        return "openmpi"
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if len(hosts) > 1:
        return "tpu_pod"
    return None


def maybe_initialize() -> str | None:
    """Initialize JAX's distributed runtime if :func:`cluster_kind` finds a cluster; returns the kind."""
    kind = cluster_kind()
    if kind is None:
        return None
    import jax

    if kind == "explicit":
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=_int_env("JAX_NUM_PROCESSES") or None,
            process_id=_int_env("JAX_PROCESS_ID") if "JAX_PROCESS_ID" in os.environ else None,
        )
    else:
        jax.distributed.initialize()
    log.info("distributed (%s): process %d of %d, %d local / %d global devices", kind, jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return kind
