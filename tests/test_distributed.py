"""Which environments start JAX's distributed runtime (the call itself needs a real cluster)."""

import pytest

from asyncpp_jax import distributed

CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                "TPU_WORKER_HOSTNAMES")


@pytest.mark.parametrize("env, kind", [
    ({}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, None),  # one task: a single-host job
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, "slurm"),
    ({"OMPI_COMM_WORLD_SIZE": "8"}, "openmpi"),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1,t1v-2,t1v-3"}, "tpu_pod"),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),  # a single TPU VM
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "explicit"),
])
def test_cluster_kind(monkeypatch, env, kind):
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert distributed.cluster_kind() == kind
    if kind is None:
        assert distributed.maybe_initialize() is None  # and never blocks waiting for a coordinator
