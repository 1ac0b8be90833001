"""Build the optimizer chain from ``config.optimizer``.

The chain is ``clip_by_global_norm -> optimizer(schedule)``.  Weight decay is decoupled
(Loshchilov & Hutter 2019) and applied to matrices only: embeddings and linear kernels decay;
norm scales and biases do not.  Stacked layer leaves keep their leading layer axis, so routing is by
parameter name, never by ``ndim``.
"""

from __future__ import annotations

import jax
import optax

from asyncpp_jax.optim.schedules import make_schedule

_NO_DECAY_NAMES = ("scale", "bias")


def _path_names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def decay_mask(params):
    """True for leaves that get weight decay: everything except norm scales and biases."""
    return jax.tree_util.tree_map_with_path(lambda p, _: _path_names(p)[-1] not in _NO_DECAY_NAMES, params)


def build_optimizer(opt_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns ``(optimizer, lr_schedule)``; the schedule is also used to log the lr."""
    schedule = make_schedule(opt_cfg, total_steps)
    if opt_cfg.name == "adamw":
        opt = optax.adamw(
            schedule,
            b1=opt_cfg.b1,
            b2=opt_cfg.b2,
            eps=opt_cfg.eps,
            weight_decay=opt_cfg.weight_decay,
            mask=decay_mask,
            nesterov=opt_cfg.nesterov,
        )
    else:
        raise ValueError(f"config.optimizer.name={opt_cfg.name!r} is unknown; choose 'adamw'")
    parts = [optax.clip_by_global_norm(opt_cfg.grad_clip)] if opt_cfg.grad_clip else []
    return optax.chain(*parts, opt), schedule
