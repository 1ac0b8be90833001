"""One run per workdir: ``<workdir>/run.lock``, held for the whole run.

The lock is an exclusive ``flock`` on the file, taken without waiting, by process 0 of a job (the
workdir is on the file system every process shares).  The kernel drops it when its holder exits,
however it exits (SIGKILL included), so a lock file left by a killed run is stale by construction:
the next run takes the lock at once, logs whose run it takes over, and rewrites the file with
its own host, pid and start time.  A second run while the first one lives fails the lock at once
and stops with a message naming the holder (read from the file).

The file is removed when the run ends.  A remover and a newcomer race only on the path: the
newcomer checks after locking that the path still names the inode it locked, and retries if not.
On a multi-host job process 0 decides and tells the others (one small broadcast), so every
process stops together.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import pathlib
import socket
import time

log = logging.getLogger("asyncpp_jax")

LOCK_FILE = "run.lock"


class WorkdirBusy(RuntimeError):
    """Another live run holds the workdir."""


class WorkdirUnwritable(RuntimeError):
    """The lock file cannot be created (a read-only or otherwise unwritable workdir)."""


def _holder_text(path: pathlib.Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"host {info['host']}, pid {info['pid']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a run that has not yet written its host and pid"


def _lock_soon(fd: int, tries: int = 5) -> bool:
    """The exclusive lock, retried briefly: another starter's probe holds a shared one for a moment."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if i + 1 < tries:
                time.sleep(0.05)
    return False


class WorkdirLock:
    def __init__(self, workdir: pathlib.Path):
        self.path = pathlib.Path(workdir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`WorkdirBusy` (on every process of a job)."""
        import jax  # here, so that probe() works before JAX starts
        import numpy as np

        problem, kind = None, 0  # kind: 0 taken, 1 busy, 2 unwritable
        if jax.process_index() == 0:
            try:
                problem = self._acquire_here()
                kind = 0 if problem is None else 1
            except OSError as e:
                problem, kind = (f"cannot write {self.path}: {e.strerror or e}; pass a --workdir on a writable "
                                 "file system."), 2
        if jax.process_count() > 1:  # every process stops together (none waits on a collective alone)
            from jax.experimental import multihost_utils

            kind = int(multihost_utils.broadcast_one_to_all(np.int32(kind)))
            if kind and problem is None:
                problem = f"process 0 could not take {self.path} (see its log)."
        if kind == 1:
            raise WorkdirBusy(problem)
        if kind == 2:
            raise WorkdirUnwritable(problem)

    def probe(self) -> str | None:
        """Why the workdir is held by another run now, or None; takes nothing (the CLI asks before
        JAX starts, so a second run stops in a moment rather than after its imports)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return self._busy_message()
        finally:
            os.close(fd)
        return None

    def _busy_message(self) -> str:
        return (f"the workdir {self.path.parent} is in use by another run ({_holder_text(self.path)}); "
                f"wait for it to end or stop it, or pass another --workdir. (The lock is {self.path}; it "
                "is released when that process exits, however it exits.)")

    def _acquire_here(self) -> str | None:
        for _ in range(10):  # retried only if the holder removed the file between our open and lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _lock_soon(fd):
                os.close(fd)
                return self._busy_message()
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = os.read(fd, 4096).decode(errors="replace").strip()
            if previous:
                log.warning("taking over %s, left by a run that ended without releasing it (%s)",
                            self.path, _holder_text(self.path))
            info = {"host": socket.gethostname(), "pid": os.getpid(),
                    "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            os.fsync(fd)
            self._fd = fd
            return None
        return f"could not lock {self.path}: the file kept being replaced"

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self.path.unlink()  # while still locked: a newcomer that opened it re-checks the inode
        except OSError:
            pass
        os.close(fd)

    def __del__(self):
        self.release()
