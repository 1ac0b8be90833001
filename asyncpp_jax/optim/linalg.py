"""QR and symmetric eigenvectors for jitted optimizer code, without batched LAPACK on XLA:CPU.

Why: jaxlib 0.10.2's XLA:CPU runs a batched LAPACK kernel (``jnp.linalg.qr`` -> ``lapack_sgeqrf_ffi``,
likewise ``eigh``) through ``ParallelBatchMap``, which queues the batch's pieces on XLA's own worker
pool and blocks a worker waiting for them. With two or more workers all blocked there, nobody runs
the pieces and the program hangs (seen in gdb; a standalone jitted loop of ``jnp.linalg.qr`` on
``(4, 256, 256)`` froze within 0-32 calls on 2 cores and ran 40 of 40 on one).

What: the choice is made per lowering platform with ``lax.platform_dependent`` (the compiler never
sees a conditional). On GPU/TPU the library calls stay. On CPU:

* ``qr_q`` is a blocked Householder QR built from matmuls (Golub & Van Loan, *Matrix Computations*,
  4th ed., Alg. 5.2.1 for the reflector, Sec. 5.2.3 for the compact WY form ``I - V T V^T`` of
  Schreiber & Van Loan 1989, with ``T`` accumulated as in LAPACK's ``dlarft``). It follows LAPACK's
  ``dgeqrf`` sign convention, ``beta = -sign(alpha) ||x||``, so ``Q`` matches ``jnp.linalg.qr`` column
  for column (not only up to signs) where the factorization is unique, and it stays orthogonal to
  working precision on rank-deficient input, as Householder does.
* ``eigh_vectors`` calls NumPy's (unbatched-per-matrix) ``eigh`` on the host through
  ``jax.pure_callback``: NumPy's LAPACK does not run on XLA's worker pool, so it cannot take part in
  the deadlock. SOAP needs it once, on its first update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Reflectors per block. The panel loop is sequential vector work and every block is compiled on its
# own (static shapes); 64 keeps a 1536-wide QR at 24 blocks and within ~1.4x the time of 32.
PANEL = 64


def _mm(a, b):
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def _reflector(x, i):
    """Householder vector of ``x[i:]`` (entries above ``i`` ignored): ``v`` with ``v[i] = 1``, ``tau``.

    ``H = I - tau v v^T`` maps ``x[i:]`` to ``beta e_i`` with ``beta = -sign(x_i) ||x[i:]||``;
    ``tau = 0`` (``H = I``) when ``x[i+1:]`` is already zero (LAPACK ``dlarfg``).
    """
    rows = jnp.arange(x.shape[-1])
    alpha = jnp.take(x, i, axis=-1)
    below = jnp.where(rows > i, x, 0.0)
    xnorm = jnp.sqrt(jnp.sum(below * below, axis=-1))
    zero = xnorm == 0.0
    beta = -jnp.where(alpha >= 0, 1.0, -1.0) * jnp.sqrt(alpha * alpha + xnorm * xnorm)
    safe_beta = jnp.where(zero, 1.0, beta)
    tau = jnp.where(zero, 0.0, (beta - alpha) / safe_beta)
    scale = jnp.where(zero, 0.0, 1.0 / jnp.where(zero, 1.0, alpha - beta))
    v = below * scale[..., None] + (rows == i).astype(x.dtype)
    return v, tau.astype(x.dtype)


def _panel(p):
    """Householder-reduce panel ``p`` [..., r, b]; returns ``V`` [..., r, b] and ``T`` [..., b, b]."""
    b = p.shape[-1]
    batch = p.shape[:-2]
    cols = jnp.arange(b)

    def step(i, carry):
        p, v_all, t_all = carry
        v, tau = _reflector(jnp.take(p, i, axis=-1), i)
        # Apply H = I - tau v v^T to the panel; reduced columns (< i) have zeros where v lives.
        vtp = jnp.einsum("...r,...rc->...c", v, p, precision=lax.Precision.HIGHEST)
        p = p - tau[..., None, None] * v[..., :, None] * vtp[..., None, :]
        # dlarft, forward columnwise: T[:i, i] = -tau T[:i, :i] V[:, :i]^T v, T[i, i] = tau.
        w = jnp.einsum("...rc,...r->...c", v_all, v, precision=lax.Precision.HIGHEST)
        t_col = -tau[..., None] * jnp.einsum("...ac,...c->...a", t_all, w, precision=lax.Precision.HIGHEST)
        t_col = jnp.where(cols == i, tau[..., None], t_col)
        t_all = jnp.where(cols == i, t_col[..., :, None], t_all)
        v_all = jnp.where(cols == i, v[..., :, None], v_all)
        return p, v_all, t_all

    init = (p, jnp.zeros_like(p), jnp.zeros(batch + (b, b), p.dtype))
    _, v_all, t_all = lax.fori_loop(0, b, step, init)
    return v_all, t_all


def householder_q(a: jax.Array, panel: int = PANEL) -> jax.Array:
    """The ``Q`` of ``a = Q R`` (reduced, ``[..., m, n]``, ``m >= n``) from matmuls only.

    Forward pass: for each panel of ``panel`` columns, reduce it (``_panel``) and apply its block
    reflector ``(I - V T V^T)^T`` to the columns on its right. Then ``Q = H_1 ... H_n I[:, :n]``,
    applied last block first so each block only touches the trailing rows and columns (``dorgqr``).
    """
    m, n = a.shape[-2:]
    if m < n:
        raise ValueError(f"householder_q needs a tall or square matrix, got shape {a.shape}")
    blocks = []
    for k in range(0, n, panel):
        e = min(k + panel, n)
        v, t = _panel(a[..., k:, k:e])
        blocks.append((k, v, t))
        if e < n:
            trail = a[..., k:, e:]
            trail = trail - _mm(v, _mm(_t(t), _mm(_t(v), trail)))
            a = a.at[..., k:, e:].set(trail)
    q = jnp.broadcast_to(jnp.eye(m, n, dtype=a.dtype), a.shape)
    for k, v, t in reversed(blocks):
        sub = q[..., k:, k:]
        q = q.at[..., k:, k:].set(sub - _mm(v, _mm(t, _mm(_t(v), sub))))
    return q


def qr_q(a: jax.Array) -> jax.Array:
    """``jnp.linalg.qr(a)[0]``; on XLA:CPU the matmul-only ``householder_q`` (module docstring)."""
    return lax.platform_dependent(a, cpu=householder_q, default=lambda x: jnp.linalg.qr(x)[0])


def _host_eigh_vectors(x: jax.Array) -> jax.Array:
    def call(m):
        return np.linalg.eigh(np.asarray(m))[1].astype(m.dtype)

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(call, out, x, vmap_method="expand_dims")


def eigh_vectors(a: jax.Array) -> jax.Array:
    """Eigenvectors of symmetric ``a`` [..., n, n], ascending eigenvalues (``jnp.linalg.eigh(a)[1]``).

    On XLA:CPU, NumPy's ``eigh`` on the host (module docstring); elsewhere the library call.
    """
    return lax.platform_dependent(a, cpu=_host_eigh_vectors, default=lambda x: jnp.linalg.eigh(x)[1])
