"""AdamW (Loshchilov & Hutter 2019, arXiv:1711.05101): Adam with decoupled weight decay.

    m_t = b1 m_{t-1} + (1 - b1) g_t            v_t = b2 v_{t-1} + (1 - b2) g_t^2
    w_t = w_{t-1} - lr_t (m̂_t / (sqrt(v̂_t) + eps) + wd * w_{t-1})      m̂, v̂ bias-corrected

This is ``optax.adamw`` itself (no reason to re-implement it), with this project's defaults:
b1 0.9, b2 0.999, eps 1e-8 (Kingma & Ba 2015), wd 0.01 (PyTorch's AdamW default), plain (not
Nesterov) momentum, and decay only on matrices (``decay_mask``: not on norm scales or biases).
"""

from __future__ import annotations

import jax
import optax

from asyncpp_jax.optim.routing import DEFAULT_ADAMW_PATTERN, partition, path_names

NO_DECAY_NAMES = ("scale", "bias")


def decay_mask(params):
    """True for leaves that get weight decay: everything except norm scales and biases.

    Decided by the leaf's name, never by ``ndim``: stacked norm scales are ``[layers, d]``.
    """
    return jax.tree_util.tree_map_with_path(lambda p, _: path_names(p)[-1] not in NO_DECAY_NAMES, params)


def adamw(
    learning_rate: float | optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    nesterov: bool = False,
    mask=decay_mask,
) -> optax.GradientTransformation:
    return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask,
                       nesterov=nesterov)


def with_adamw_side(
    hidden: optax.GradientTransformation,
    learning_rate: float | optax.Schedule,
    adamw_learning_rate: float | optax.Schedule | None = None,
    adamw_b1: float = 0.9,
    adamw_b2: float = 0.95,
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.0,
    adamw_pattern: str = DEFAULT_ADAMW_PATTERN,
) -> optax.GradientTransformation:
    """``hidden`` on hidden matrices, AdamW on the rest: what Muon, SOAP and MARS share.

    The side branch is ``optax.adamw`` with ``adamw_learning_rate`` (default ``learning_rate``) and
    no decay on norm scales and biases; the split is :func:`asyncpp_jax.optim.routing.partition`.
    """
    side = adamw(
        learning_rate if adamw_learning_rate is None else adamw_learning_rate,
        b1=adamw_b1,
        b2=adamw_b2,
        eps=adamw_eps,
        weight_decay=adamw_weight_decay,
    )
    return partition(hidden, side, adamw_pattern)
