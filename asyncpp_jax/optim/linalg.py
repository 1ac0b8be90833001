"""QR and symmetric eigenvectors for jitted optimizer code, without batched LAPACK on XLA:CPU.

Why: jaxlib 0.10.2's XLA:CPU runs a batched LAPACK kernel (``jnp.linalg.qr`` -> ``lapack_sgeqrf_ffi``,
likewise ``eigh``) through ``ParallelBatchMap``, which queues the batch's pieces on XLA's own worker
pool and blocks a worker waiting for them. With two or more workers all blocked there, nobody runs
the pieces and the program hangs (seen in gdb; a standalone jitted loop of ``jnp.linalg.qr`` on
``(4, 256, 256)`` froze within 0-32 calls on 2 cores and ran 40 of 40 on one).

What: the choice is made per lowering platform with ``lax.platform_dependent`` (the compiler never
sees a conditional). On GPU/TPU the library calls stay. On CPU both run LAPACK on the host through
``jax.pure_callback``, one matrix per call, which cannot take part in the deadlock: the host's
LAPACK does not run on XLA's worker pool.

* ``qr_q``: SciPy's ``qr`` (``?geqrf`` + ``?orgqr``, LAPACK's sign convention, so ``Q`` equals
  ``jnp.linalg.qr``'s column for column where the factorization is unique). It replaced a
  Householder QR built from matmuls, whose sequential panel loop made the QR of SOAP's basis refresh
  at the ``cpu_regime`` model (52 matrices, 12 of them 344 x 344) take 265 ms against 117 ms here,
  and a SOAP update 94 ms against 70 ms on average.
* ``eigh_vectors``: NumPy's ``eigh``. SOAP needs it once, on its first update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from jax import lax


def _on_host(fn, x: jax.Array) -> jax.Array:
    """``fn`` (NumPy in, NumPy out, same shape and dtype) run on the host through ``jax.pure_callback``."""
    return jax.pure_callback(lambda a: fn(np.asarray(a)).astype(a.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                             vmap_method="expand_dims")


def _host_qr_q(x: jax.Array) -> jax.Array:
    def call(a):
        flat = a.reshape((-1,) + a.shape[-2:])
        # One matrix per LAPACK call (SciPy's ``?geqrf`` + ``?orgqr`` in the input's precision):
        # NumPy's stacked ``qr`` computes float32 in float64 and was at least 2x slower here.
        return np.stack([scipy.linalg.qr(m, mode="economic", check_finite=False)[0] for m in flat]).reshape(a.shape)

    return _on_host(call, x)


def qr_q(a: jax.Array) -> jax.Array:
    """``jnp.linalg.qr(a)[0]`` (reduced, ``[..., m, n]`` with ``m >= n``); on XLA:CPU LAPACK on the
    host (module docstring)."""
    if a.shape[-2] < a.shape[-1]:
        raise ValueError(f"qr_q needs a tall or square matrix, got shape {a.shape}")
    return lax.platform_dependent(a, cpu=_host_qr_q, default=lambda x: jnp.linalg.qr(x)[0])


def _host_eigh_vectors(x: jax.Array) -> jax.Array:
    return _on_host(lambda m: np.linalg.eigh(m)[1], x)


def eigh_vectors(a: jax.Array) -> jax.Array:
    """Eigenvectors of symmetric ``a`` [..., n, n], ascending eigenvalues (``jnp.linalg.eigh(a)[1]``).

    On XLA:CPU, NumPy's ``eigh`` on the host (module docstring); elsewhere the library call.
    """
    return lax.platform_dependent(a, cpu=_host_eigh_vectors, default=lambda x: jnp.linalg.eigh(x)[1])
