"""MARS-AdamW, approximate version (Yuan, Liu, Wu, Zhou & Gu 2024, arXiv:2411.10438).

MARS ("Make vAriance Reduction Shine") feeds Adam a variance-reduced gradient built from a scaled
STORM-style correction. The approximate version (MARS-approx, the official default
``is_approx=True``) replaces the gradient at the previous point on the *current* batch by the
previous step's gradient, so one step ``t = 1, 2, ...`` on gradient ``g_t`` is::

    c_t = g_t + γ · b1 / (1 - b1) · (g_t - g_{t-1})
    c_t <- c_t / ||c_t||_2          if ||c_t||_2 > 1     (per matrix; Frobenius norm)
    m_t = b1 m_{t-1} + (1 - b1) c_t
    v_t = b2 v_{t-1} + (1 - b2) c_t^2
    u_t = m̂_t / (sqrt(v̂_t) + eps),     m̂_t = m_t / (1 - b1^t),  v̂_t = v_t / (1 - b2^t)
    θ_{t+1} = θ_t - η_t (u_t + λ θ_t)                      (decoupled weight decay)

Conventions, checked against the official code (``MARS/optimizers/mars.py`` in AGI-Arena/MARS):

- First step: the stored previous gradient starts at **zero**, so ``c_1 = (1 + γ b1/(1-b1)) g_1``
  (1.475 g_1 at the defaults) before the clip. The paper's exact algorithm takes ``x_0 = x_1`` which
  would give ``c_1 = g_1``; we follow the code.
- ``g_{t-1}`` is the raw previous gradient (not the clipped ``c_{t-1}``).
- Standard Adam bias correction on ``m`` and ``v``; ``eps`` outside the square root.
- Clip only when the norm is strictly above 1. The official code takes the norm of the whole
  tensor; this project's stacked leaves ``[..., fan_in, fan_out]`` are batches of matrices, so the
  norm here is per matrix (the last two axes). Leaves with fewer than two dims use the whole tensor.
- Defaults: lr 3e-3, betas (0.95, 0.99), γ 0.025, weight decay 0, eps 1e-8.
- ``optimize_1d=False`` (official default) sends 1-D params to AdamW with betas (0.9, 0.95); here
  :func:`mars` does that through :func:`asyncpp_jax.optim.routing.partition`, which also sends
  embeddings, the LM head, norm scales and biases to AdamW (the official code uses MARS on every
  2-D tensor, embeddings included). The official AdamW side defaults to weight decay 0.1; this
  project's side branch (``side=AdamWBranch(...)``) defaults to 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asyncpp_jax.optim.adamw import AdamWBranch, takes_side_branch, with_adamw_side


class MarsState(NamedTuple):
    count: jax.Array  # int32 scalar: number of updates taken
    m: optax.Updates  # EMA of the clipped corrected gradient c
    v: optax.Updates  # EMA of c^2
    prev_grad: optax.Updates  # g_{t-1}, zero before the first step (official convention)


def _matrix_norm(x: jax.Array) -> jax.Array:
    """Frobenius norm per matrix over the last two axes (keepdims); whole-tensor norm below 2-D."""
    axes = (-2, -1) if x.ndim >= 2 else None
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=axes, keepdims=x.ndim >= 2))


def scale_by_mars(
    b1: float = 0.95, b2: float = 0.99, gamma: float = 0.025, eps: float = 1e-8
) -> optax.GradientTransformation:
    """MARS-AdamW (approximate) direction ``u_t = m̂_t / (sqrt(v̂_t) + eps)`` on the corrected gradient.

    Yuan, Liu, Wu, Zhou & Gu, "MARS: Unleashing the Power of Variance Reduction for Training Large
    Models", 2024, arXiv:2411.10438 (MARS-AdamW, approximate version). Equations and conventions
    are in the module docstring. Applies to every leaf; leaves with ``ndim >= 2`` are batches of
    matrices over the last two axes and the unit-norm clip is per matrix. Returns the unscaled
    direction (descent is ``-lr * u``).

    Args:
        b1: decay of the first moment; also sets the correction weight ``γ b1 / (1 - b1)``.
        b2: decay of the second moment.
        gamma: strength ``γ`` of the variance-reduction correction; ``0`` gives Adam.
        eps: added to ``sqrt(v̂)``.
    """
    scale = gamma * b1 / (1 - b1)

    def init_fn(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return MarsState(jnp.zeros([], jnp.int32), zeros(), zeros(), zeros())

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        bc1, bc2 = 1 - b1**t, 1 - b2**t

        def leaf(g, m, v, g_prev):
            c = g + scale * (g - g_prev)
            # Dividing by max(||c||, 1) is the paper's "normalise if the norm exceeds 1", branch-free.
            c = c / jnp.maximum(_matrix_norm(c), 1.0).astype(c.dtype)
            m = b1 * m + (1 - b1) * c
            v = b2 * v + (1 - b2) * jnp.square(c)
            u = (m / bc1.astype(m.dtype)) / (jnp.sqrt(v / bc2.astype(v.dtype)) + eps)
            return u, m, v

        out = jax.tree.map(leaf, updates, state.m, state.v, state.prev_grad)
        pick = lambda i: jax.tree.map(lambda _, o: o[i], updates, out)
        return pick(0), MarsState(count, pick(1), pick(2), updates)

    return optax.GradientTransformation(init_fn, update_fn)


@takes_side_branch
def mars(
    learning_rate: optax.ScalarOrSchedule = 3e-3,
    b1: float = 0.95,
    b2: float = 0.99,
    gamma: float = 0.025,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    side: AdamWBranch = AdamWBranch(),
) -> optax.GradientTransformation:
    """MARS-AdamW on hidden weight matrices, AdamW on everything else (Yuan et al. 2024, arXiv:2411.10438).

    Hidden matrices: ``θ <- θ - η_t (u_t + λ θ)`` with ``u_t`` from :func:`scale_by_mars` and
    decoupled weight decay ``λ = weight_decay`` (Loshchilov & Hutter 2019). Embeddings, heads, norm
    scales, biases and all leaves below 2-D (as chosen by ``side.pattern``, see
    :func:`asyncpp_jax.optim.routing.partition`) get the :class:`AdamWBranch` ``side``, its learning
    rate defaulting to ``learning_rate``, its weight decay to 0, and no decay on norm scales and
    biases. Learning rates may be floats or ``optax.Schedule``s.
    """
    hidden = optax.chain(
        scale_by_mars(b1=b1, b2=b2, gamma=gamma, eps=eps),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    return with_adamw_side(hidden, learning_rate, side, default_weight_decay=0.0)
