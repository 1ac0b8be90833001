"""Process set-up that must happen before JAX starts (so nothing here imports JAX).

* ``--xla_force_host_platform_device_count=N`` in ``XLA_FLAGS``: fake CPU devices for a mesh on a
  CPU-only host.  Added only when the user has not set it.
"""

from __future__ import annotations

import os

FORCE_DEVICES = "--xla_force_host_platform_device_count"


def add_host_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices unless ``XLA_FLAGS`` already says how many."""
    now = os.environ.get("XLA_FLAGS", "")
    if n > 1 and FORCE_DEVICES not in now:
        os.environ["XLA_FLAGS"] = f"{now} {FORCE_DEVICES}={n}".strip()


def prepare(host_devices: int = 1) -> None:
    """Everything above, for a run with ``host_devices`` mesh devices."""
    add_host_devices(host_devices)
