"""Preemption: SIGTERM to any one process stops every process at the same step, after a save.

One process: SIGTERM sets a flag that the loop polls between steps (a Python handler, main thread
only).  Several processes (``jax.distributed``): a flag is not enough, since a host that leaves the
loop alone and starts a collective checkpoint save waits forever for the others.  JAX's distributed
runtime installs a SIGTERM notifier at ``jax.distributed.initialize`` and runs a preemption sync
protocol: the notified process tells the coordinator, every process learns of it, and they agree on
the safe step ``max(step of every process) + 1``.  ``reached(step)`` then asks orbax's
``CheckpointManager.reached_preemption(step)`` (``multihost_utils.reached_preemption_sync_point``),
which is True on every process at that same step; each process must call it at every step.  No
Python handler is installed then, because it would replace the runtime's notifier.
"""

from __future__ import annotations

import signal
import threading

import jax


class Preemption:
    """Context manager; ``reached(step)`` says whether to save at ``step`` and stop (call it every step)."""

    def __init__(self, checkpoint_manager):
        self._manager = checkpoint_manager
        self._multi_process = jax.process_count() > 1
        self._signalled = False
        self._previous = None

    def __enter__(self):
        if not self._multi_process and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self._signalled = True

    def reached(self, step: int) -> bool:
        if self._multi_process:
            return bool(self._manager.reached_preemption(step))
        return self._signalled

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
