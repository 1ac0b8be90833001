"""Preemption: a stop signal to any one process stops every process at the same step, after a save.

One process: SIGTERM (preemption) and SIGINT (Ctrl-C) set a flag that the loop polls between
steps (Python handlers, main thread only); a second signal restores the previous handlers and
re-sends itself, so it stops at once.  Several processes (``jax.distributed``): a flag is not
enough, since a host that leaves the loop alone and starts a collective checkpoint save waits
forever for the others.  JAX's distributed runtime installs a SIGTERM notifier at
``jax.distributed.initialize`` and runs a preemption sync protocol: the notified process tells the
coordinator, every process learns of it, and they agree on the safe step ``max(step of every
process) + 1``.  ``reached(step)`` then asks orbax's ``CheckpointManager.reached_preemption(step)``
(``multihost_utils.reached_preemption_sync_point``), which is True on every process at that same
step; each process must call it at every step.  No Python SIGTERM handler is installed then,
because it would replace the runtime's notifier; SIGINT keeps its default there (a Ctrl-C on one
host of a cluster job is not a coordinated stop).
"""

from __future__ import annotations

import logging
import signal
import threading

import jax

log = logging.getLogger("asyncpp_jax")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # preemption, Ctrl-C: the same orderly stop


class StopFlag:
    """SIGTERM and SIGINT -> ``self.set`` (handlers only in the main thread).  A second signal
    restores the previous handlers and re-sends itself: stop at once."""

    def __init__(self):
        self.set = False
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.set:
            self._restore()
            signal.raise_signal(signum)
            return
        self.set = True
        log.warning("%s: stopping after this step with a checkpoint (send it again to stop at once)",
                    signal.Signals(signum).name)

    def _restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc):
        self._restore()


class Preemption:
    """Context manager; ``reached(step)`` says whether to save at ``step`` and stop (call it every step)."""

    def __init__(self, checkpoint_manager):
        self._manager = checkpoint_manager
        self._flag = None if jax.process_count() > 1 else StopFlag()

    def __enter__(self):
        if self._flag is not None:
            self._flag.__enter__()
        return self

    def interruptible(self) -> bool:
        """Whether this process's own signal handlers set the flag (one process, main thread): then a
        long step (the first one's compile) can be watched from here and abandoned on a stop signal."""
        return self._flag is not None and bool(self._flag._previous)

    def reached(self, step: int) -> bool:
        if self._flag is None:
            return bool(self._manager.reached_preemption(step))
        return self._flag.set

    def __exit__(self, *exc):
        if self._flag is not None:
            self._flag.__exit__(*exc)
