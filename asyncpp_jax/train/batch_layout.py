"""Which rows of the global batch each process loads, computed from the mesh.

The train batch is ``[M, B/M, T+1]`` (microbatch, row, time), its rows split over the ``data`` mesh
axis (``train_state.BATCH_SPEC``): data replica ``d`` of ``D`` holds rows ``d*b .. d*b + b - 1`` of every
microbatch (``b = B/(M*D)``), i.e. rows ``m*B/M + d*b + j`` of the flat global batch.  Every device
of replica ``d`` (all its pipeline stages) needs those same rows.  A process therefore loads the
union of the rows of the replicas its own devices belong to, whatever the layout: stages across
processes (several processes load the same rows), replicas across processes, or both.  The mapping
is read from the sharding (``devices_indices_map``), so it follows the mesh, never the process index.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from asyncpp_jax import configs
from asyncpp_jax.train_state import BATCH_SPEC


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    sharding: NamedSharding
    global_batch: int
    microbatches: int
    rows: np.ndarray  # sorted flat row offsets (in [0, global_batch)) this process loads

    def assemble(self, local: np.ndarray) -> jax.Array:
        """This process's rows ``[len(rows), T+1]`` -> the global ``[M, B/M, T+1]`` device array."""
        if local.shape[0] != len(self.rows):
            raise ValueError(f"expected {len(self.rows)} rows from the data pipeline, got {local.shape[0]}")
        per_mb = self.global_batch // self.microbatches
        shape = (self.microbatches, per_mb, local.shape[1])

        def block(index):
            m = np.arange(self.microbatches)[index[0]]
            j = np.arange(per_mb)[index[1]]
            wanted = (m[:, None] * per_mb + j[None, :]).ravel()
            pos = np.minimum(np.searchsorted(self.rows, wanted), len(self.rows) - 1)
            if not np.array_equal(self.rows[pos], wanted):  # the layout and the loaded rows disagree
                raise ValueError(f"this process loaded rows {self.rows} but a local device needs {wanted}")
            return local[pos].reshape(len(m), len(j), -1)[..., index[2]]

        return jax.make_array_from_callback(shape, self.sharding, block)


def replica_rows(sharding: NamedSharding, global_batch: int, microbatches: int, devices) -> np.ndarray:
    """The sorted flat rows that ``devices`` hold of a ``[M, B/M, ·]`` batch laid out by ``sharding``."""
    per_mb = global_batch // microbatches
    index_map = sharding.devices_indices_map((microbatches, per_mb, 1))
    rows = set()
    for device in devices:
        m_slice, j_slice, _ = index_map[device]
        for m in range(microbatches)[m_slice]:
            rows.update(m * per_mb + j for j in range(per_mb)[j_slice])
    return np.array(sorted(rows), dtype=np.int64)


def batch_layout(mesh, global_batch: int, microbatches: int, process_index: int | None = None) -> BatchLayout:
    """The rows ``process_index`` (default: this process) loads for ``mesh``; a process that holds
    none of the mesh's devices is an impossible layout and a :class:`configs.ConfigError`."""
    pi = jax.process_index() if process_index is None else process_index
    sharding = NamedSharding(mesh, BATCH_SPEC)
    # Checked for every process, so that all of them stop with the same error.
    in_mesh = {d.process_index for d in mesh.devices.flat}
    in_job = {d.process_index for d in jax.devices()}
    if in_job - in_mesh:
        raise configs.ConfigError(
            f"processes {sorted(in_job - in_mesh)} hold none of the mesh's {mesh.devices.size} devices "
            f"({dict(mesh.shape)}); the job has {jax.device_count()} devices over {len(in_job)} processes "
            "and every process must hold part of the mesh. Set config.mesh.data=-1 to fill the job's "
            "devices, or launch fewer processes (config.mesh.data x config.pipeline.stages devices in all).")
    mine = [d for d in mesh.devices.flat if d.process_index == pi]
    return BatchLayout(sharding, global_batch, microbatches, replica_rows(sharding, global_batch, microbatches, mine))
