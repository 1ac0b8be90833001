"""AdamW (Loshchilov & Hutter 2019, arXiv:1711.05101): Adam with decoupled weight decay.

    m_t = b1 m_{t-1} + (1 - b1) g_t            v_t = b2 v_{t-1} + (1 - b2) g_t^2
    w_t = w_{t-1} - lr_t (m̂_t / (sqrt(v̂_t) + eps) + wd * w_{t-1})      m̂, v̂ bias-corrected

This is ``optax.adamw`` itself (no reason to re-implement it), with this project's defaults:
b1 0.9, b2 0.999, eps 1e-8 (Kingma & Ba 2015), wd 0.01 (PyTorch's AdamW default), plain (not
Nesterov) momentum, and decay only on matrices (``decay_mask``: not on norm scales or biases).
"""

from __future__ import annotations

import dataclasses
import functools

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


@dataclasses.dataclass(frozen=True)
class AdamWBranch:
    """The AdamW side branch of Muon, SOAP and MARS: ``optax.adamw`` on embeddings, heads, norms, biases.

    Which leaves it gets is ``pattern``, a regex on parameter path names
    (:func:`asyncpp_jax.optim.routing.partition`; leaves below 2-D always come here).  Norm scales
    and biases get no weight decay (:func:`decay_mask`).  ``learning_rate=None`` means the main
    optimizer's learning rate; ``weight_decay=None`` means the optimizer's own default for its
    side branch (0.1 for Muon, Moonlight's; 0 for SOAP and MARS), so ``AdamWBranch(pattern=...)``
    changes the routing and nothing else.

        muon(3e-3, side=AdamWBranch(learning_rate=1e-3, b2=0.99, pattern=DEFAULT_ADAMW_PATTERN + "|^Dense_0$"))
    """

    learning_rate: float | optax.Schedule | None = None
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float | None = None
    pattern: str = DEFAULT_ADAMW_PATTERN


# The keywords AdamWBranch replaced, each with its field: a call that still uses one gets a TypeError
# that says what to write instead.
_OLD_SIDE_KEYWORDS = {"adamw_learning_rate": "learning_rate", "adamw_b1": "b1", "adamw_b2": "b2",
                      "adamw_eps": "eps", "adamw_weight_decay": "weight_decay", "adamw_pattern": "pattern"}


def takes_side_branch(optimizer):
    """Decorate an optimizer with a ``side: AdamWBranch`` argument so that a call with the old
    ``adamw_*`` keywords raises a TypeError naming ``side=AdamWBranch(...)`` and its fields."""

    @functools.wraps(optimizer)
    def wrapper(*args, **kwargs):
        old = [k for k in kwargs if k in _OLD_SIDE_KEYWORDS]
        if old:
            fields = ", ".join(f"{_OLD_SIDE_KEYWORDS[k]}={kwargs[k]!r}" for k in old)
            raise TypeError(
                f"{optimizer.__name__}() no longer takes {', '.join(old)}: the AdamW side branch is one "
                f"argument now, side=AdamWBranch({fields}) (asyncpp_jax.optim.AdamWBranch).")
        return optimizer(*args, **kwargs)

    return wrapper


def with_adamw_side(
    hidden: optax.GradientTransformation,
    learning_rate: float | optax.Schedule,
    side: AdamWBranch,
    default_weight_decay: float,
) -> optax.GradientTransformation:
    """``hidden`` on hidden matrices, the AdamW ``side`` branch on the rest: what Muon, SOAP and MARS share.

    ``learning_rate`` is the main optimizer's, used where ``side.learning_rate`` is None;
    ``default_weight_decay`` is used where ``side.weight_decay`` is None.  The split is
    :func:`asyncpp_jax.optim.routing.partition` with ``side.pattern``.
    """
    if not isinstance(side, AdamWBranch):
        raise TypeError(f"side must be an asyncpp_jax.optim.AdamWBranch, got {side!r}.")
    branch = adamw(
        learning_rate if side.learning_rate is None else side.learning_rate,
        b1=side.b1,
        b2=side.b2,
        eps=side.eps,
        weight_decay=default_weight_decay if side.weight_decay is None else side.weight_decay,
    )
    return partition(hidden, branch, side.pattern)
