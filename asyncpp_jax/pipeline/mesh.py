"""Device meshes.  Axis names: ``data`` (data parallel) and, for the pipeline engine, ``stage``."""

from __future__ import annotations

import jax
from jax.sharding import AxisType


def make_mesh(data: int, devices=None) -> jax.sharding.Mesh:
    """A ``('data',)`` mesh over the first ``data`` devices.

    Axis types are Explicit (the default of ``jax.make_mesh`` on this JAX); the runners place every
    input with a ``NamedSharding`` before the ``shard_map`` that names the axis.
    """
    devices = list(devices if devices is not None else jax.devices())[:data]
    return jax.make_mesh((data,), ("data",), axis_types=(AxisType.Explicit,), devices=devices)
