"""Shared fixtures.  Four fake CPU devices for the data-parallel tests: set before JAX starts."""

import os

import pytest

from asyncpp_jax import host_setup  # no JAX import

host_setup.add_host_devices(4)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One corpus cache for the whole session: each small corpus is prepared once."""
    return str(tmp_path_factory.mktemp("corpora"))
