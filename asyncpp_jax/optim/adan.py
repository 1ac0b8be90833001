"""Adan: adaptive Nesterov momentum (Xie et al. 2022/2024, arXiv:2208.06677, Algorithm 1).

Notation. The paper writes the decay rates as small numbers ``β1=0.02, β2=0.08, β3=0.01`` that weight
the *new* term of each moving average. This module, like the official PyTorch code
(github.com/sail-sg/Adan) and optax, exposes the complementary "large" rates

    b1 = 1 - β1 = 0.98,    b2 = 1 - β2 = 0.92,    b3 = 1 - β3 = 0.99.

In those rates, one step ``k = 1, 2, ...`` on gradient ``g_k`` is (all operations elementwise)::

    d_k   = g_k - g_{k-1}                          (d_1 = 0: the first step has no previous gradient)
    m_k   = b1 m_{k-1} + (1 - b1) g_k
    v_k   = b2 v_{k-1} + (1 - b2) d_k
    n_k   = b3 n_{k-1} + (1 - b3) (g_k + b2 d_k)^2
    u_k   = (m̂_k + b2 v̂_k) / (sqrt(n̂_k) + eps),   x̂_k = x_k / (1 - b^k)  (bias correction)

and the parameter step with learning rate ``η_k`` and weight decay ``λ`` is

    proximal (paper, default):  θ_{k+1} = (θ_k - η_k u_k) / (1 + η_k λ)
    decoupled (``no_prox``):    θ_{k+1} = θ_k - η_k (u_k + λ θ_k)   (= (1 - η_k λ) θ_k - η_k u_k)

Conventions, checked against the official implementation (``adan.py`` in sail-sg/Adan):

- First step: the stored previous gradient is set to the first gradient, so ``d_1 = 0``.
- Bias correction: ``m``, ``v`` and ``n`` start at zero and are divided by ``1 - b^k``
  (``n`` inside the square root). The paper's Algorithm 1 instead initialises
  ``m_0 = g_0, v_1 = g_1 - g_0, n_0 = g_0^2``; bias correction gives the same first update
  (``m̂_1 = g_1, v̂_1 = 0, n̂_1 = g_1^2``) without a special first step.
- ``eps`` is added outside the square root.
- ``no_prox=True`` in the official code is ``weight_decay_mode='decoupled'`` here.

Difference from ``optax.scale_by_adan`` (optax 0.2.8), which this module does not use: optax weights
the gradient difference by ``1 - b2`` (= the paper's small ``β2``) in *two* places where the paper
and the official code use ``b2`` (= ``1 - β2``):

    optax:  n_k = b3 n_{k-1} + (1 - b3) (g_k + (1 - b2) d_k)^2,   u_k = (m̂_k + (1 - b2) v̂_k) / (...)
    here:   n_k = b3 n_{k-1} + (1 - b3) (g_k + b2 d_k)^2,         u_k = (m̂_k + b2 v̂_k) / (...)

``m`` and ``v`` themselves agree, as does the first step (``d_1 = 0``), so the two differ from the
second step on. With the default ``b2 = 0.92`` optax's Nesterov correction is 11.5x weaker.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from asyncpp_jax.optim.adamw import decay_mask

WEIGHT_DECAY_MODES = ("proximal", "decoupled")


class AdanState(NamedTuple):
    count: jax.Array  # int32 scalar: number of updates taken
    m: optax.Updates  # EMA of gradients
    v: optax.Updates  # EMA of gradient differences
    n: optax.Updates  # EMA of the squared Nesterov-corrected gradient
    prev_grad: optax.Updates  # g_{k-1}; unused (d forced to 0) while count == 0


def scale_by_adan(
    b1: float = 0.98, b2: float = 0.92, b3: float = 0.99, eps: float = 1e-8
) -> optax.GradientTransformation:
    """Adan's direction ``u_k = (m̂_k + b2 v̂_k) / (sqrt(n̂_k) + eps)`` (see the module docstring).

    Xie, Zhou, Li, Lin & Yan, "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep
    Models", 2022/2024, arXiv:2208.06677, Algorithm 1, with the official code's bias correction.
    Elementwise, so it applies unchanged to every leaf, stacked or not. The output is the
    unscaled direction (descent is ``-lr * u``, added by ``optax.scale_by_learning_rate``).

    Args:
        b1: decay of the gradient EMA ``m`` (paper ``1 - β1``).
        b2: decay of the gradient-difference EMA ``v`` (paper ``1 - β2``); also the weight of the
            gradient difference in ``n`` and of ``v̂`` in the update.
        b3: decay of the second-moment EMA ``n`` (paper ``1 - β3``).
        eps: added to ``sqrt(n̂)``.
    """

    def init_fn(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return AdanState(jnp.zeros([], jnp.int32), zeros(), zeros(), zeros(), zeros())

    def update_fn(updates, state, params=None):
        del params
        first = state.count == 0
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        bc1, bc2, bc3 = 1 - b1**t, 1 - b2**t, 1 - b3**t

        def leaf(g, m, v, n, g_prev):
            # The first step has no g_{k-1}: the official code sets it to g_1, so the difference is 0.
            d = jnp.where(first, jnp.zeros_like(g), g - g_prev)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * d
            n = b3 * n + (1 - b3) * jnp.square(g + b2 * d)
            denom = jnp.sqrt(n / bc3.astype(n.dtype)) + eps
            u = (m / bc1.astype(m.dtype) + b2 * v / bc2.astype(v.dtype)) / denom
            return u, m, v, n

        out = jax.tree.map(leaf, updates, state.m, state.v, state.n, state.prev_grad)
        pick = lambda i: jax.tree.map(lambda _, o: o[i], updates, out)
        new_state = AdanState(count, pick(1), pick(2), pick(3), updates)
        return pick(0), new_state

    return optax.GradientTransformation(init_fn, update_fn)


class ProximalDecayState(NamedTuple):
    count: jax.Array  # steps taken; kept in lockstep with scale_by_learning_rate's schedule count


def _proximal_decay(
    learning_rate: optax.ScalarOrSchedule, weight_decay: float
) -> optax.GradientTransformation:
    """Turns an lr-scaled step ``s = -η_k u_k`` into the proximal step of Adan's Algorithm 1.

    Must come after ``scale_by_learning_rate`` in a chain. It returns the update ``Δ`` for which
    ``θ + Δ = (θ + s) / (1 + η_k λ)``, i.e. ``Δ = (s - η_k λ θ) / (1 + η_k λ)``. The weight decay
    needs ``η_k`` itself, so a schedule is evaluated here at the same step count that
    ``scale_by_learning_rate`` used for ``s`` (both counters start at 0 and advance once per update).
    """

    def init_fn(params):
        del params
        return ProximalDecayState(jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("Adan's proximal weight decay needs the params: call update(g, state, params)")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        lam = jnp.asarray(lr, jnp.float32) * weight_decay
        new = jax.tree.map(
            lambda s, p: ((s - lam * p) / (1 + lam)).astype(s.dtype), updates, params
        )
        return new, ProximalDecayState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def adan(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.98,
    b2: float = 0.92,
    b3: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.02,
    weight_decay_mode: str = "proximal",
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
) -> optax.GradientTransformation:
    """Adan on every parameter, with proximal (paper) or decoupled weight decay.

    Xie et al. 2022/2024, arXiv:2208.06677. The direction is :func:`scale_by_adan`; then, with
    ``η_k = learning_rate(k)``:

    - ``'proximal'`` (Algorithm 1; official default ``no_prox=False``):
      ``θ <- (θ - η_k u) / (1 + η_k λ)``.
    - ``'decoupled'`` (official ``no_prox=True``; AdamW-style, Loshchilov & Hutter 2019):
      ``θ <- θ - η_k (u + λ θ)``.

    Adan is applied to all leaves (no routing to AdamW); only the weight decay is masked.

    Args:
        learning_rate: float or ``optax.Schedule``.
        b1, b2, b3, eps: see :func:`scale_by_adan` (large-beta convention, ``b = 1 - β_paper``).
        weight_decay: ``λ``.
        weight_decay_mode: ``'proximal'`` or ``'decoupled'``.
        mask: tree of bools (or a callable on params returning one); True leaves decay. ``None``
            means :func:`asyncpp_jax.optim.adamw.decay_mask` (no decay for norm scales and biases).
    """
    if weight_decay_mode not in WEIGHT_DECAY_MODES:
        raise ValueError(
            f"config.optimizer.adan.weight_decay_mode={weight_decay_mode!r} is unknown; "
            f"choose one of {WEIGHT_DECAY_MODES}"
        )
    mask = decay_mask if mask is None else mask
    if weight_decay_mode == "decoupled":
        return optax.chain(
            scale_by_adan(b1, b2, b3, eps),
            optax.add_decayed_weights(weight_decay, mask),
            optax.scale_by_learning_rate(learning_rate),
        )
    return optax.chain(
        scale_by_adan(b1, b2, b3, eps),
        optax.scale_by_learning_rate(learning_rate),
        optax.masked(_proximal_decay(learning_rate, weight_decay), mask),
    )
