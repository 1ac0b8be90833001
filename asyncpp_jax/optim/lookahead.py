"""Nesterov look-ahead for delayed gradients (Ajanthan et al. 2025, ICML, arXiv:2505.01099).

    optax.chain(delay(1), nesterov_lookahead(3e-4))        # 2BW + the paper's NAG variant

Ajanthan et al., "Nesterov Method for Asynchronous Pipeline Parallel Optimization", modify the
look-ahead step of Nesterov's accelerated gradient (NAG) so that it absorbs the staleness of the
gradient.  **What is implemented here, and on what basis.**  The paper's own equations could not be
retrieved for this implementation (only its abstract and secondary summaries were reachable), so
this module does not claim to transcribe them.  It implements what the authors' official code runs
for "Ours" (github.com/PluralisResearch/AsyncPP, ``run.bash``: ``--optimizer nadamw --momentum
0.99``; the paper's reproducibility notes also point at PyTorch's NAdam): PyTorch's ``NAdam`` with
decoupled weight decay, i.e. Dozat's (2016) Nesterov-momentum Adam, with ``b1 = 0.99``,
``b2 = 0.999`` and momentum decay ``psi = 0.004``, fed the delayed gradient.  With ``t`` counting
updates from 1 and ``g_t`` the (stale) gradient this transform receives::

    mu_t   = b1 (1 - 0.5 * 0.96^(t psi))                   momentum schedule (Dozat 2016)
    m_t    = b1 m_{t-1} + (1 - b1) g_t                     v_t = b2 v_{t-1} + (1 - b2) g_t^2
    m̂_t   = mu_{t+1} m_t / (1 - prod_{i<=t+1} mu_i)  +  (1 - mu_t) g_t / (1 - prod_{i<=t} mu_i)
    w_t    = w_{t-1} - lr_t (m̂_t / (sqrt(v_t / (1 - b2^t)) + eps) + wd w_{t-1})

``m̂_t`` is the look-ahead: the momentum is applied with NEXT step's coefficient ``mu_{t+1}``, so
the update already contains the step the momentum is about to take.  A momentum as high as 0.99
makes that look-ahead large, which is what the authors use against the delay.  Their code also has
an optional stage-wise "adaptive momentum" ``b1 + d_s (0.99 - b1) / P`` (off in their reported run
script) and the PipeMare learning-rate correction (:mod:`asyncpp_jax.optim.delay_lr`); the former is
not implemented here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asyncpp_jax.optim.adamw import decay_mask

PAPER_B1 = 0.99  # official run.bash, "Ours": --momentum 0.99
PAPER_B2 = 0.999  # official main_with_runtime.py: betas=(momentum, 0.999)
PAPER_MOMENTUM_DECAY = 0.004  # PyTorch NAdam's default psi, kept by the official code


class NesterovLookaheadState(NamedTuple):
    count: jax.Array  # int32: updates so far
    mu_product: jax.Array  # float32: prod_{i<=t} mu_i
    mu: optax.Updates  # first moment m
    nu: optax.Updates  # second moment v


def _mu(b1: float, psi: float, t):
    return b1 * (1.0 - 0.5 * jnp.power(0.96, t * psi))


def scale_by_nesterov_lookahead(b1: float = PAPER_B1, b2: float = PAPER_B2, eps: float = 1e-8,
                                momentum_decay: float = PAPER_MOMENTUM_DECAY) -> optax.GradientTransformation:
    """The direction ``m̂_t / (sqrt(v̂_t) + eps)`` of the module docstring (to be scaled by ``-lr``)."""

    def init_fn(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return NesterovLookaheadState(jnp.zeros([], jnp.int32), jnp.ones([], jnp.float32), zeros, zeros)

    def update_fn(updates, state, params=None):
        del params
        t = (state.count + 1).astype(jnp.float32)
        mu_t, mu_next = _mu(b1, momentum_decay, t), _mu(b1, momentum_decay, t + 1.0)
        mu_product = state.mu_product * mu_t
        m = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, updates)
        v = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.nu, updates)
        c_m = mu_next / (1.0 - mu_product * mu_next)
        c_g = (1.0 - mu_t) / (1.0 - mu_product)
        bc2 = 1.0 - jnp.power(b2, t)
        out = jax.tree.map(lambda m, v, g: ((c_m * m + c_g * g) / (jnp.sqrt(v / bc2) + eps)).astype(g.dtype),
                           m, v, updates)
        return out, NesterovLookaheadState(optax.safe_increment(state.count), mu_product, m, v)

    return optax.GradientTransformation(init_fn, update_fn)


def nesterov_lookahead(learning_rate: float | optax.Schedule, b1: float = PAPER_B1, b2: float = PAPER_B2,
                       eps: float = 1e-8, weight_decay: float = 0.0,
                       momentum_decay: float = PAPER_MOMENTUM_DECAY, mask=decay_mask) -> optax.GradientTransformation:
    """NAdamW as the paper's code runs it (module docstring): the look-ahead, decoupled decay, ``-lr``.

    Place it where AdamW would go, after :func:`~asyncpp_jax.optim.staleness.delay`; like AdamW
    here, weight decay skips norm scales and biases (``mask``).
    """
    return optax.chain(
        scale_by_nesterov_lookahead(b1, b2, eps, momentum_decay),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
