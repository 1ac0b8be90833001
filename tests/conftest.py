"""Shared fixtures.  Four fake CPU devices for the data-parallel tests: set before JAX starts."""

import os

from asyncpp_jax import host_setup  # noqa: E402  (no JAX import)

host_setup.add_host_devices(4)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
