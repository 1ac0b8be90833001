"""Muon: momentum orthogonalized by Newton–Schulz, for hidden weight matrices.

Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"
(kellerjordan.github.io/posts/muon); Liu et al. 2025, "Muon is Scalable for LLM Training"
(Moonlight), arXiv:2502.16982. For each matrix ``W`` (a leaf ``[..., fan_in, fan_out]`` is a batch
of matrices over its leading axes, each handled on its own):

    B_t = mu B_{t-1} + g_t                            (momentum buffer, B_0 = 0)
    D_t = g_t + mu B_t   (Nesterov)   or   D_t = B_t   (nesterov=False)
    O_t = NS_5(D_t)                                   (approximate orthogonalization, below)
    W_t = W_{t-1} - lr_t (s O_t + wd W_{t-1})         (decoupled weight decay, Loshchilov & Hutter 2019)

``NS_k`` normalizes ``X = D / (||D||_F + eps)``, transposes when ``fan_in > fan_out`` so that the
Gram matrix is the smaller one, then runs ``k`` quintic Newton–Schulz steps

    A = X X^T;   X <- a X + (b A + c A A) X,      (a, b, c) = (3.4445, -4.7750, 2.0315).

These coefficients trade exactness for speed: the singular values of ``NS_5(D)`` do not converge to 1
but land roughly in [0.68, 1.13] (Jordan et al. 2024), so ``O_t`` is close to, not equal to, the polar
factor ``U V^T`` of ``D_t = U S V^T``. The reference runs NS in bfloat16; here it runs in float32 with
``Precision.HIGHEST`` matmuls, so that CPU tests match a float64 reference tightly and the simulate
and pipeline runners agree exactly (default precision would silently use TF32/bf16 passes on GPU/TPU).

The update scale ``s`` (option ``scaling``):
  * ``'moonlight'`` (default): ``s = 0.2 sqrt(max(fan_in, fan_out))``. ``O_t`` has RMS about
    ``1/sqrt(max(fan_in, fan_out))``, so this gives an update RMS of ~0.2, AdamW's typical update RMS;
    AdamW's learning rate and weight decay then transfer (Liu et al. 2025).
  * ``'keller'``: ``s = sqrt(max(1, fan_out / fan_in))`` (Jordan et al. 2024).

optax.contrib.muon is not reused: its Nesterov mix of bias-corrected EMAs weights ``g`` against ``B``
differently from ``g + mu B`` in early steps, it uses eps=1e-8, and it runs NS at default precision.

Leaves with fewer than two dimensions (routing normally sends them to AdamW) are treated as a bias
would be, a ``[1, n]`` matrix (weights from a constant input): ``fan_in = 1``, ``fan_out = n``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asyncpp_jax.optim.adamw import AdamWBranch, takes_side_branch, with_adamw_side

NS_COEFFS = (3.4445, -4.7750, 2.0315)
SCALINGS = ("moonlight", "keller")


def _matmul(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)


def orthogonalize(
    x: jax.Array,
    ns_steps: int = 5,
    coeffs: tuple[float, float, float] = NS_COEFFS,
    eps: float = 1e-7,
) -> jax.Array:
    """``NS_{ns_steps}(x)`` for each matrix of ``x: [..., m, n]`` (see the module docstring).

    Computed in float32 and returned in ``x.dtype``. The leading axes are a batch: each matrix is
    normalized by its own Frobenius norm.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs a [..., m, n] array, got shape {x.shape}")
    a, b, c = coeffs
    out_dtype = x.dtype
    y = x.astype(jnp.float32)
    # NS commutes with transposition, so iterate on the wide orientation: the Gram matrix X X^T is
    # then min(m, n) square, the cheap side.
    transpose = y.shape[-2] > y.shape[-1]
    if transpose:
        y = jnp.swapaxes(y, -1, -2)
    # Frobenius normalization bounds the spectral norm by 1, inside NS's region of convergence.
    y = y / (jnp.sqrt(jnp.sum(y * y, axis=(-2, -1), keepdims=True)) + eps)
    for _ in range(ns_steps):
        gram = _matmul(y, jnp.swapaxes(y, -1, -2))
        y = a * y + _matmul(b * gram + c * _matmul(gram, gram), y)
    if transpose:
        y = jnp.swapaxes(y, -1, -2)
    return y.astype(out_dtype)


def _check_scaling(scaling: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(
            f"config.optimizer.muon.scaling={scaling!r} is unknown; choose one of {SCALINGS}"
        )


def _as_matrices(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) >= 2:
        return shape
    return (1, shape[0] if shape else 1)


def update_scale(shape: tuple[int, ...], scaling: str = "moonlight") -> float:
    """The factor ``s`` multiplying ``NS(D)`` for a leaf of this shape (fan_in, fan_out = last two)."""
    _check_scaling(scaling)
    fan_in, fan_out = _as_matrices(tuple(shape))[-2:]
    if scaling == "keller":
        # The reference keeps PyTorch's [out, in] weights and uses max(1, rows / cols) with
        # rows = fan_out, cols = fan_in; a flax kernel is [in, out], so that is fan_out / fan_in here.
        return math.sqrt(max(1.0, fan_out / fan_in))
    return 0.2 * math.sqrt(max(fan_in, fan_out))


class MuonState(NamedTuple):
    count: jax.Array  # number of updates so far, int32 scalar
    momentum: optax.Updates  # B_t, same tree and dtypes as the params


def scale_by_muon(
    mu: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    coeffs: tuple[float, float, float] = NS_COEFFS,
    eps: float = 1e-7,
    scaling: str = "moonlight",
) -> optax.GradientTransformation:
    """``g -> s NS(D)`` with Muon's momentum (module docstring); no learning rate, no weight decay."""
    _check_scaling(scaling)

    def direction_to_update(d):
        m = orthogonalize(d.reshape(_as_matrices(d.shape)), ns_steps, coeffs, eps).reshape(d.shape)
        return update_scale(d.shape, scaling) * m

    def init_fn(params):
        return MuonState(count=jnp.zeros([], jnp.int32), momentum=optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        momentum = jax.tree.map(lambda b, g: mu * b + g, state.momentum, updates)
        if nesterov:
            direction = jax.tree.map(lambda b, g: g + mu * b, momentum, updates)
        else:
            direction = momentum
        new_updates = jax.tree.map(direction_to_update, direction)
        return new_updates, MuonState(count=optax.safe_increment(state.count), momentum=momentum)

    return optax.GradientTransformation(init_fn, update_fn)


@takes_side_branch
def muon(
    learning_rate: float | optax.Schedule,
    mu: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    scaling: str = "moonlight",
    weight_decay: float = 0.1,
    side: AdamWBranch = AdamWBranch(),
) -> optax.GradientTransformation:
    """Muon on hidden matrices, AdamW on embeddings, heads, norms and biases (``routing.partition``).

    Hidden side: ``W <- W - lr (s NS(D) + weight_decay W)``. AdamW side: :class:`AdamWBranch`
    ``side``, with learning rate ``side.learning_rate`` (default: ``learning_rate``), weight decay
    ``side.weight_decay`` (default: 0.1), no decay on norm scales and biases. The defaults (wd 0.1
    on both sides, AdamW betas (0.9, 0.95)) are Moonlight's, whose ``'moonlight'`` scaling is what
    lets one lr and wd serve both sides.
    """

    hidden = optax.chain(
        scale_by_muon(mu=mu, nesterov=nesterov, ns_steps=ns_steps, scaling=scaling),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    return with_adamw_side(hidden, learning_rate, side, default_weight_decay=0.1)
