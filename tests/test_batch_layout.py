"""Rows per data replica: which rows of the global batch each process loads, read from the mesh."""

import types

import jax
import numpy as np
import pytest

from asyncpp_jax import configs
from asyncpp_jax.pipeline.mesh import make_mesh
from asyncpp_jax.pipeline.spmd.engine import make_pipeline_mesh
from asyncpp_jax.train import batch_layout as layout_lib
from asyncpp_jax.train_state import BATCH_SPEC

B, M = 8, 2  # rows per microbatch 4; over data = 2 each replica holds 2 rows of each microbatch
REPLICA_0, REPLICA_1 = [0, 1, 4, 5], [2, 3, 6, 7]


@pytest.fixture(scope="module")
def pipeline_sharding():
    mesh = make_pipeline_mesh(2, 2, jax.devices()[:4])  # [[d0, d1], [d2, d3]]: rows = data, columns = stage
    return mesh, jax.sharding.NamedSharding(mesh, BATCH_SPEC)


@pytest.mark.parametrize("held, rows", [
    ((0, 1), REPLICA_0),             # a process holding one whole replica (2 processes x 2 devices)
    ((0,), REPLICA_0), ((1,), REPLICA_0),  # stage 0 and stage 1 of replica 0 in different processes load the same rows
    ((3,), REPLICA_1),
    ((0, 2), REPLICA_0 + REPLICA_1),  # stage 0 of both replicas
    ((0, 1, 2, 3), list(range(B))),
])
@pytest.mark.needs_devices(4)
def test_rows_follow_the_replicas_a_process_holds(pipeline_sharding, held, rows):
    mesh, sharding = pipeline_sharding
    devices = [mesh.devices.flat[i] for i in held]
    assert layout_lib.replica_rows(sharding, B, M, devices).tolist() == sorted(rows)


@pytest.mark.needs_devices(4)
def test_data_parallel_rows_split_over_processes():
    mesh = make_mesh(4, jax.devices()[:4])
    sharding = jax.sharding.NamedSharding(mesh, BATCH_SPEC)
    # 16 rows, 2 microbatches of 8, 4 replicas of 2 rows each per microbatch.
    assert layout_lib.replica_rows(sharding, 16, 2, list(mesh.devices.flat[2:])).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


@pytest.mark.needs_devices(4)
def test_assembled_batch_is_the_global_batch(pipeline_sharding):
    mesh, _ = pipeline_sharding
    layout = layout_lib.batch_layout(mesh, B, M)
    assert layout.rows.tolist() == list(range(B))  # one process holds every device here
    full = np.arange(B * 5, dtype=np.int32).reshape(B, 5)
    glob = layout.assemble(full)
    np.testing.assert_array_equal(np.asarray(glob), full.reshape(M, B // M, 5))
    assert glob.sharding.spec == BATCH_SPEC
    partial = layout_lib.BatchLayout(layout.sharding, B, M, np.array(REPLICA_0))
    with pytest.raises(ValueError, match="a local device needs"):
        partial.assemble(full[REPLICA_0])


@pytest.mark.needs_devices(4)
def test_a_process_outside_the_mesh_is_a_clear_error(pipeline_sharding, monkeypatch):
    mesh, _ = pipeline_sharding
    other_host = types.SimpleNamespace(process_index=1)
    monkeypatch.setattr(layout_lib.jax, "devices", lambda: list(mesh.devices.flat) + [other_host])
    with pytest.raises(configs.ConfigError, match=r"processes \[1\] hold none of the mesh's 4 devices.*"
                                                   r"config.mesh.data=-1"):
        layout_lib.batch_layout(mesh, B, M)
