"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675, Alg. 2).

    c_t = b1 m_{t-1} + (1 - b1) g_t
    w_t = w_{t-1} - lr_t (sign(c_t) + wd * w_{t-1})
    m_t = b2 m_{t-1} + (1 - b2) g_t

This wraps ``optax.lion``, which implements exactly these equations. Defaults are the paper's:
b1 0.9, b2 0.99. The paper advises an lr 3-10x smaller than AdamW's and a weight decay 3-10x
larger (so that lr*wd stays similar), because sign() gives every coordinate a unit-size update;
the default wd here is 0.1, applied to matrices only (``decay_mask``).
"""

from __future__ import annotations

import optax

from asyncpp_jax.optim.adamw import decay_mask


def lion(
    learning_rate: float | optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.1,
    mask=decay_mask,
) -> optax.GradientTransformation:
    return optax.lion(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask)
