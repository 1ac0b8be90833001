"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner.

Vyas, Morwani, Zhao, Kwun, Shapira, Brandfonbrener, Janson, Kakade (2024), "SOAP: Improving and
Stabilizing Shampoo using Adam", arXiv:2409.11321. The behaviour follows the authors' reference
PyTorch implementation (github.com/nikhilvyas/SOAP, ``soap.py``, the original class with
``betas=(0.95, 0.95)``, ``shampoo_beta=-1``, ``precondition_frequency=10`` defaults).

Each leaf of ndim >= 2 is a batch of matrices ``G`` of shape ``[..., m, n]``; the leading axes are
batch axes (one independent preconditioner per leading index, never a preconditioner over them).
With ``beta_s = shampoo_beta if shampoo_beta >= 0 else b2`` and ``t`` the number of Adam steps taken:

    L   <- beta_s L + (1 - beta_s) G G^T                 [m, m]  (Shampoo left statistic)
    R   <- beta_s R + (1 - beta_s) G^T G                 [n, n]  (Shampoo right statistic)
    G'   = Q_L^T G Q_R                                           (gradient in the eigenbasis)
    M   <- b1 M + (1 - b1) G'                                    (first moment, kept in the eigenbasis)
    V   <- b2 V + (1 - b2) G'^2                                  (second moment, in the eigenbasis)
    U    = c_t Q_L (M / (sqrt(V) + eps)) Q_R^T,   c_t = sqrt(1 - b2^t) / (1 - b1^t)
                                                               (c_t = 1 when ``correct_bias=False``)

Reference behaviours reproduced here:

* First call: only ``L, R`` are accumulated (from zero) and the basis is set to the eigenvectors of
  ``L`` and ``R`` (``eigh``, columns in descending eigenvalue order). No Adam step happens and the
  update is exactly zero, "so that we never use the current gradients in the projection". The
  matching ``soap`` constructor also skips the weight decay on that call, as the reference does.
* Later calls: Adam step with the *current* basis, then ``L, R`` are updated with this gradient.
  When ``t % precondition_frequency == 0`` the basis is refreshed by one power iteration + QR:
  the columns of ``Q`` are sorted by the estimated eigenvalues ``diag(Q^T L Q)`` (descending),
  ``V`` is permuted along the same axis with the same order (so each entry follows its basis
  vector), and ``Q <- qr(L Q_sorted)``. ``M`` is rotated into the new basis
  (``M <- Q_L_new^T (Q_L_old M Q_R_old^T) Q_R_new``). The reference rotates ``M`` back to the
  original space and into the current basis after every step; when the basis did not change that
  round trip is the identity (orthogonal ``Q``), so it is done only on refresh steps here.
* ``eps`` is added to ``sqrt(V)`` (not to a bias-corrected ``sqrt(V_hat)``), and bias correction is
  the single step-size factor ``c_t`` above, with ``t = 1`` on the first Adam step (second call).
* A side whose dimension exceeds ``max_precond_dim`` is left unrotated: no statistic or basis is
  stored for it (a scalar zero placeholder keeps the state a valid pytree for ``jit`` and orbax).
  Leaves with ndim < 2 have no rotation at all: plain Adam with the same first-step skip, bias
  correction and ``eps`` placement, as the reference does for 1-D tensors without
  ``precondition_1d``. In this project routing sends such leaves to AdamW anyway.

On XLA:CPU the ``eigh`` and the QR avoid jaxlib 0.10.2's batched-LAPACK deadlock
(:mod:`asyncpp_jax.optim.linalg`: both run LAPACK on the host); the refresh factors all
leaves' matrices of one shape in a single QR call.

Not reproduced: ``merge_dims``, ``precondition_1d``, ``normalize_grads`` (all off by default in the
reference), and the reference's preconditioning of conv/ND tensors along every axis (leading axes
are batch axes here).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from asyncpp_jax.optim.adamw import AdamWBranch, takes_side_branch, with_adamw_side
from asyncpp_jax.optim.linalg import eigh_vectors, qr_q

# Reference defaults (SOAP README and soap.py): lr 3e-3, betas (0.95, 0.95), shampoo_beta -1 (use b2),
# eps 1e-8, weight_decay 0.01, precondition_frequency 10, max_precond_dim 10000.


class ScaleBySoapState(NamedTuple):
    """State of ``scale_by_soap``.

    ``count`` is the number of update calls so far (the first call only initializes, so the Adam
    step index is ``t = count`` during a later call). ``exp_avg``/``exp_avg_sq`` live in the rotated
    basis. ``gg_left``/``gg_right`` are ``L``/``R`` and ``q_left``/``q_right`` their bases; each is a
    scalar zero placeholder for a side that is not preconditioned (orbax cannot save zero-size
    arrays). All floating state is at least float32 (bf16 parameters get float32 statistics).
    """

    count: jax.Array
    exp_avg: optax.Updates
    exp_avg_sq: optax.Updates
    gg_left: optax.Updates
    gg_right: optax.Updates
    q_left: optax.Updates
    q_right: optax.Updates


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    # Full float32 matmuls: at default TPU/GPU precision the statistics and rotations lose the
    # accuracy eigh/QR need, and a rotation that is not orthogonal leaks into the Adam moments.
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _t(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _rotated_sides(shape: tuple[int, ...], max_precond_dim: int) -> tuple[bool, bool]:
    if len(shape) < 2:
        return False, False
    return shape[-2] <= max_precond_dim, shape[-1] <= max_precond_dim


def _state_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _project(x, q_left, q_right, rot_l, rot_r):
    """``Q_L^T X Q_R`` on the rotated sides (to the eigenbasis)."""
    if rot_l:
        x = _mm(_t(q_left), x)
    if rot_r:
        x = _mm(x, q_right)
    return x


def _project_back(x, q_left, q_right, rot_l, rot_r):
    """``Q_L X Q_R^T`` on the rotated sides (back to the parameter space)."""
    if rot_l:
        x = _mm(q_left, x)
    if rot_r:
        x = _mm(x, _t(q_right))
    return x


def _eigenbasis(gg: jax.Array) -> jax.Array:
    # The reference adds 1e-30 I before eigh and flips the columns to descending eigenvalue order.
    # On XLA:CPU both calls avoid jaxlib 0.10.2's batched-LAPACK deadlock (``linalg`` module).
    eye = jnp.eye(gg.shape[-1], dtype=gg.dtype)
    vecs = eigh_vectors(gg + 1e-30 * eye)
    return jnp.flip(vecs, axis=-1)


def _power_iteration(gg: jax.Array, q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One power iteration ``L Q[:, order]`` (QR-factored later) with ``order`` sorting ``diag(Q^T L Q)`` descending."""
    lq = _mm(gg, q)
    est_eig = jnp.sum(q * lq, axis=-2)  # diag(Q^T L Q), batched
    order = jnp.argsort(-est_eig, axis=-1)
    return jnp.take_along_axis(lq, order[..., None, :], axis=-1), order


def _grouped_qr(mats: list[jax.Array]) -> list[jax.Array]:
    """``qr_q`` of each matrix batch, with all batches of one matrix shape and dtype in a single call.

    One call per shape instead of one per leaf and side: fewer, larger library calls, and on CPU
    (where ``qr_q`` is a host callback) one host round trip per shape.
    """
    groups: dict = {}
    for i, x in enumerate(mats):
        groups.setdefault((x.shape[-2:], x.dtype), []).append(i)
    out: list = [None] * len(mats)
    for (mat, _), idx in groups.items():
        flat = [mats[i].reshape((-1,) + mat) for i in idx]
        q = qr_q(jnp.concatenate(flat, axis=0)) if len(flat) > 1 else qr_q(flat[0])
        for i, piece in zip(idx, jnp.split(q, np.cumsum([f.shape[0] for f in flat])[:-1], axis=0)):
            out[i] = piece.reshape(mats[i].shape)
    return out


@dataclasses.dataclass(frozen=True)
class _Soap:
    """``scale_by_soap``'s hyperparameters, and its per-leaf steps (see its docstring)."""

    b1: float
    b2: float
    beta_s: float  # decay of L, R
    eps: float
    max_precond_dim: int
    correct_bias: bool
    freeze_basis_identity: bool

    def sides(self, leaf) -> tuple[bool, bool]:
        return _rotated_sides(leaf.shape, self.max_precond_dim)

    def init_leaf(self, p):
        dt = _state_dtype(p.dtype)
        rot_l, rot_r = self.sides(p)
        batch = p.shape[:-2]
        left = jnp.zeros(batch + (p.shape[-2],) * 2, dt) if rot_l else jnp.zeros((), dt)
        right = jnp.zeros(batch + (p.shape[-1],) * 2, dt) if rot_r else jnp.zeros((), dt)
        return jnp.zeros(p.shape, dt), jnp.zeros(p.shape, dt), left, right, left, right

    def accumulate(self, g, gg_left, gg_right, rot_l, rot_r):
        # torch's lerp_(outer, 1 - beta_s): beta_s * old + (1 - beta_s) * outer.
        if rot_l:
            gg_left = self.beta_s * gg_left + (1.0 - self.beta_s) * _mm(g, _t(g))
        if rot_r:
            gg_right = self.beta_s * gg_right + (1.0 - self.beta_s) * _mm(_t(g), g)
        return gg_left, gg_right

    def basis(self, gg):
        if self.freeze_basis_identity:
            return jnp.broadcast_to(jnp.eye(gg.shape[-1], dtype=gg.dtype), gg.shape)
        return _eigenbasis(gg)

    def first_leaf(self, g, m, v, gg_left, gg_right, q_left, q_right):
        """The first call: statistics and the eigenbasis from this gradient, a zero update."""
        rot_l, rot_r = self.sides(g)
        gf = g.astype(m.dtype)
        gg_left, gg_right = self.accumulate(gf, gg_left, gg_right, rot_l, rot_r)
        q_left = self.basis(gg_left) if rot_l else q_left
        q_right = self.basis(gg_right) if rot_r else q_right
        return jnp.zeros_like(g), m, v, gg_left, gg_right, q_left, q_right

    def later_leaf(self, count, g, m, v, gg_left, gg_right, q_left, q_right, *, refresh_basis: bool):
        """Adam in the rotated basis; with ``refresh_basis`` also the power-iteration half of the
        basis refresh (the QR is left ``pending``, done for all leaves at once by :func:`_refreshed`)."""
        b1, b2 = self.b1, self.b2
        rot_l, rot_r = self.sides(g)
        gf = g.astype(m.dtype)
        g_rot = _project(gf, q_left, q_right, rot_l, rot_r)
        m = b1 * m + (1.0 - b1) * g_rot
        v = b2 * v + (1.0 - b2) * jnp.square(g_rot)
        t = count.astype(m.dtype)
        scale = jnp.sqrt(1.0 - b2**t) / (1.0 - b1**t) if self.correct_bias else 1.0
        u = scale * _project_back(m / (jnp.sqrt(v) + self.eps), q_left, q_right, rot_l, rot_r)
        # The statistics take this gradient only after it was used for the step (reference order).
        gg_left, gg_right = self.accumulate(gf, gg_left, gg_right, rot_l, rot_r)

        pending = {}  # side -> L Q[:, order], QR-factored for all leaves at once (``_grouped_qr``)
        if refresh_basis and (rot_l or rot_r) and not self.freeze_basis_identity:
            m = _project_back(m, q_left, q_right, rot_l, rot_r)  # to parameter space; rotated in ``_refreshed``
            if rot_l:
                pending["left"], order = _power_iteration(gg_left, q_left)
                v = jnp.take_along_axis(v, order[..., :, None], axis=-2)
            if rot_r:
                pending["right"], order = _power_iteration(gg_right, q_right)
                v = jnp.take_along_axis(v, order[..., None, :], axis=-1)
        return (u.astype(g.dtype), m, v, gg_left, gg_right, q_left, q_right), pending


def _refreshed(outs):
    """Each leaf's new basis ``Q <- qr(L Q_sorted)``, and its first moment rotated into it."""
    qs = iter(_grouped_qr([p for _, pending in outs for p in pending.values()]))
    result = []
    for (u, m, v, gg_left, gg_right, q_left, q_right), pending in outs:
        if pending:
            q_left = next(qs) if "left" in pending else q_left
            q_right = next(qs) if "right" in pending else q_right
            m = _project(m, q_left, q_right, "left" in pending, "right" in pending)
        result.append((u, m, v, gg_left, gg_right, q_left, q_right))
    return result


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float = -1.0,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    correct_bias: bool = True,
    *,
    freeze_basis_identity: bool = False,
) -> optax.GradientTransformation:
    """SOAP's preconditioned direction ``U`` (module docstring); no learning rate, no weight decay.

    Args:
      b1, b2: Adam's moment decay rates (reference default 0.95, 0.95).
      shampoo_beta: decay of the Shampoo statistics ``L, R``; negative means use ``b2``.
      eps: added to ``sqrt(V)`` in the denominator.
      precondition_frequency: refresh the basis (power iteration + QR) when ``t % f == 0``.
      max_precond_dim: a matrix side longer than this is not rotated.
      correct_bias: multiply by ``sqrt(1 - b2^t) / (1 - b1^t)``.
      freeze_basis_identity: testing/ablation switch. The basis is the identity forever (no eigh,
        no refresh, no reordering of ``V``), so the update is Adam's (with SOAP's first-step skip
        and ``eps`` placement). ``L, R`` are still accumulated so the state layout is unchanged.

    The returned direction has the sign of the gradient (optax convention: follow with
    ``scale_by_learning_rate``).
    """
    if precondition_frequency < 1:
        raise ValueError(f"precondition_frequency must be >= 1, got {precondition_frequency}")
    leafwise = _Soap(b1, b2, shampoo_beta if shampoo_beta >= 0 else b2, eps, max_precond_dim, correct_bias,
                  freeze_basis_identity)

    def init_fn(params):
        parts = [leafwise.init_leaf(p) for p in jax.tree.leaves(params)]
        treedef = jax.tree.structure(params)
        fields = [jax.tree.unflatten(treedef, [part[i] for part in parts]) for i in range(6)]
        return ScaleBySoapState(jnp.zeros([], jnp.int32), *fields)

    def update_fn(updates, state, params=None):
        del params
        treedef = jax.tree.structure(updates)
        flat = [jax.tree.leaves(x) for x in (updates, *state[1:])]
        leaves = list(zip(*flat))

        def first(_):
            return [leafwise.first_leaf(*leaf) for leaf in leaves]

        def later(refresh_basis):
            return lambda _: _refreshed([leafwise.later_leaf(state.count, *leaf, refresh_basis=refresh_basis)
                                         for leaf in leaves])

        # One switch over the three kinds of call: first (eigh, zero update), plain, refresh (QR).
        branch = jnp.where(state.count == 0, 0, jnp.where(state.count % precondition_frequency == 0, 2, 1))
        out = lax.switch(branch, [first, later(False), later(True)], None)
        fields = [jax.tree.unflatten(treedef, [o[i] for o in out]) for i in range(7)]
        new_state = ScaleBySoapState(optax.safe_int32_increment(state.count), *fields[1:])
        return fields[0], new_state

    return optax.GradientTransformation(init_fn, update_fn)


class _DecayAfterFirstState(NamedTuple):
    count: jax.Array


def _decoupled_weight_decay_after_first_step(weight_decay: float) -> optax.GradientTransformation:
    """``u + wd * w``, except on the first call, where SOAP's reference leaves the weights untouched."""

    def init_fn(params):
        del params
        return _DecayAfterFirstState(jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("decoupled weight decay needs params")
        on = (state.count > 0).astype(jnp.float32)
        updates = jax.tree.map(
            lambda u, p: u + (on * weight_decay * p).astype(u.dtype), updates, params
        )
        return updates, _DecayAfterFirstState(optax.safe_int32_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


@takes_side_branch
def soap(
    learning_rate: optax.ScalarOrSchedule = 3e-3,
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float = -1.0,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    correct_bias: bool = True,
    side: AdamWBranch = AdamWBranch(),
    *,
    freeze_basis_identity: bool = False,
) -> optax.GradientTransformation:
    """SOAP on hidden weight matrices, AdamW on the rest (Vyas et al. 2024, arXiv:2409.11321).

    Hidden side: ``W <- W - lr_k (U + weight_decay W)`` with ``U`` from ``scale_by_soap`` (zero on
    the first call, when the weight decay is skipped too, as in the reference). The reference decays
    after the step, ``W <- (W - lr c_t U')(1 - lr wd)``; the decoupled form used here differs from it
    only by ``lr^2 wd c_t U'``. ``lr_k`` is the schedule at the optax call count ``k`` (the first Adam
    step is call ``k = 1``). AdamW side: the :class:`AdamWBranch` ``side``, its learning rate
    defaulting to ``learning_rate``, its weight decay to 0, no decay on norm scales and biases. ``freeze_basis_identity`` is the
    testing/ablation switch of ``scale_by_soap``.
    """

    hidden = [
        scale_by_soap(
            b1=b1,
            b2=b2,
            shampoo_beta=shampoo_beta,
            eps=eps,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            correct_bias=correct_bias,
            freeze_basis_identity=freeze_basis_identity,
        )
    ]
    if weight_decay:
        hidden.append(_decoupled_weight_decay_after_first_step(weight_decay))
    hidden.append(optax.scale_by_learning_rate(learning_rate))
    return with_adamw_side(optax.chain(*hidden), learning_rate, side, default_weight_decay=0.0)
