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

from asyncpp_jax.optim.routing import path_names

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
