"""The machine's limits on this process (``ulimit -v``, ``ulimit -f``, a full disk), each as one line.

A run that hits one of them is the environment's doing (exit code 1), not a setting's, and the fix
is the limit: so the message names it and its value instead of a traceback from wherever the
allocation or the write happened to fail.

* :func:`start_problem`: checked before JAX starts.  JAX's runtime reserves address space far
  beyond what it touches: under ``ulimit -v`` of 1 GB importing it and running one op segfaults,
  and the tiny config's run failed at 2 and 3 GB (an XLA abort, or RESOURCE_EXHAUSTED) and
  finished at 5 GB (jax 0.10.2 on a 2-core x86 CPU host).  Below :data:`MIN_ADDRESS_SPACE` a run is
  refused at once; above it a failed allocation that Python sees is reported by :func:`describe`.
  An abort inside XLA's C++ (``Fatal Python error: Aborted``) cannot be caught: that is why the
  floor is checked first.
* :func:`describe`: the one-line message for an exception that is a limit's doing (MemoryError,
  a write refused with EFBIG / ENOSPC / EDQUOT, XLA's RESOURCE_EXHAUSTED), else None.
* :func:`file_size_note`: the limit named beside a message that reports a write refused for
  its size (orbax's checkpoint writes report it as text, not as an OSError).

No JAX import here: ``main`` asks before JAX starts.
"""

from __future__ import annotations

import errno
import resource

MIN_ADDRESS_SPACE = 4 << 30  # bytes of address space below which a run is refused (see above)
_WRITE_ERRORS = {errno.EFBIG, errno.ENOSPC, errno.EDQUOT}


class LimitError(RuntimeError):
    """A limit of the machine on this process stops the work; the message names it and the fix."""


def _soft(which: int) -> int | None:
    soft = resource.getrlimit(which)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def start_problem() -> str | None:
    """Why this process cannot start JAX under its address-space limit (None: no such limit, or a
    large enough one)."""
    limit = _soft(resource.RLIMIT_AS)
    if limit is None or limit >= MIN_ADDRESS_SPACE:
        return None
    return (f"the address-space limit of this shell (ulimit -v) is {_gib(limit)}; JAX's runtime alone reserves "
            f"more than that (a run needs at least {_gib(MIN_ADDRESS_SPACE)}, more for larger models): raise it "
            "(ulimit -v unlimited) and run again.")


def address_space_note() -> str:
    """`` (ulimit -v is ...)`` when an address-space limit is set, else ``''``."""
    limit = _soft(resource.RLIMIT_AS)
    return "" if limit is None else f" (the address-space limit, ulimit -v, is {_gib(limit)}: raise it)"


def describe(e: BaseException) -> str | None:
    """The one line for ``e`` if a limit of the machine caused it, else None."""
    if isinstance(e, MemoryError):
        return f"out of memory{address_space_note() or ' (free memory, or run a smaller config)'}."
    if isinstance(e, OSError) and e.errno in _WRITE_ERRORS:
        where = f" to {e.filename}" if e.filename else ""
        size = _soft(resource.RLIMIT_FSIZE)
        fix = (f"a file may hold at most {size:,} bytes in this shell (ulimit -f): raise that limit"
               if e.errno == errno.EFBIG and size is not None else "free space on that file system")
        return f"a write{where} was refused ({e.strerror}): {fix}, and run again."
    if type(e).__name__ == "JaxRuntimeError" and "RESOURCE_EXHAUSTED" in str(e):
        first = str(e).strip().splitlines()[0]
        return f"{first}{address_space_note() or ' (free memory, or run a smaller config)'}."
    return None


def file_size_note(text: str) -> str:
    """`` (... ulimit -f ...)`` when ``text`` reports a write refused for its size (EFBIG, as the OS or
    a C++ library words it) under a file-size limit, else ``''``."""
    size = _soft(resource.RLIMIT_FSIZE)
    if size is None or not ("File too large" in text or f"os_error_code='{errno.EFBIG}'" in text):
        return ""
    return f" (a file may hold at most {size:,} bytes in this shell: ulimit -f; raise that limit and run again)"
