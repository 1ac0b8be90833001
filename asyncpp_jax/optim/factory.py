"""Build the optimizer chain from ``config.optimizer``.

The chain is ``clip_by_global_norm(grad_clip) -> <optimizer>(lr schedule)``. ``name`` picks one of
AdamW, Muon, SOAP, Adan, Lion or MARS; its hyperparameters are ``config.optimizer.<name>.*`` (each
defaulting to its reference's values) plus the shared ``lr``, ``weight_decay`` and schedule. Muon,
SOAP and MARS send embeddings, the head, norms and biases to an AdamW side branch configured by
``config.optimizer.side`` and ``adamw_pattern`` (see :mod:`asyncpp_jax.optim.routing`).
"""

from __future__ import annotations

import optax

from asyncpp_jax.optim import routing
from asyncpp_jax.optim.adamw import adamw
from asyncpp_jax.optim.adan import adan
from asyncpp_jax.optim.lion import lion
from asyncpp_jax.optim.mars import mars
from asyncpp_jax.optim.muon import muon
from asyncpp_jax.optim.soap import soap
from asyncpp_jax.optim.schedules import make_schedule

MATRIX_OPTIMIZERS = ("muon", "soap", "mars")


def _side_kwargs(o, schedule) -> dict:
    s = o.side
    side_lr = schedule if s.lr_ratio == 1.0 else (lambda step: s.lr_ratio * schedule(step))
    side_wd = o.weight_decay if s.weight_decay == -1 else s.weight_decay
    return dict(adamw_learning_rate=side_lr, adamw_b1=s.b1, adamw_b2=s.b2, adamw_eps=s.eps,
                adamw_weight_decay=side_wd, adamw_pattern=o.adamw_pattern)


def build_main(o, schedule) -> optax.GradientTransformation:
    """The optimizer named by ``o.name``, without clipping: what a staleness chain wraps."""
    name, wd = o.name, o.weight_decay
    if name == "adamw":
        a = o.adamw
        return adamw(schedule, b1=a.b1, b2=a.b2, eps=a.eps, weight_decay=wd, nesterov=a.nesterov)
    if name == "lion":
        return lion(schedule, b1=o.lion.b1, b2=o.lion.b2, weight_decay=wd)
    if name == "adan":
        a = o.adan
        return adan(schedule, b1=a.b1, b2=a.b2, b3=a.b3, eps=a.eps, weight_decay=wd,
                    weight_decay_mode=a.weight_decay_mode)
    if name == "muon":
        m = o.muon
        return muon(schedule, mu=m.mu, nesterov=m.nesterov, ns_steps=m.ns_steps, scaling=m.scaling,
                    weight_decay=wd, **_side_kwargs(o, schedule))
    if name == "soap":
        s = o.soap
        return soap(schedule, b1=s.b1, b2=s.b2, shampoo_beta=s.shampoo_beta, eps=s.eps, weight_decay=wd,
                    precondition_frequency=s.precondition_frequency, max_precond_dim=s.max_precond_dim,
                    **_side_kwargs(o, schedule))
    if name == "mars":
        m = o.mars
        return mars(schedule, b1=m.b1, b2=m.b2, gamma=m.gamma, eps=m.eps, weight_decay=wd,
                    **_side_kwargs(o, schedule))
    raise ValueError(
        f"config.optimizer.name={name!r} is unknown; choose one of adamw, muon, soap, adan, lion, mars"
    )


def build_optimizer(o, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns ``(optimizer, lr_schedule)``; the schedule is also used to log the lr."""
    schedule = make_schedule(o, total_steps)
    main = build_main(o, schedule)
    parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip else []
    return optax.chain(*parts, main), schedule


def describe_routing(o, params) -> str:
    """Which parameter goes to which branch under ``config.optimizer`` (a printable table)."""
    if o.name in MATRIX_OPTIMIZERS:
        return routing.describe(params, o.adamw_pattern, {routing.HIDDEN: o.name, routing.ADAMW: "adamw (side)"})
    return f"all parameters -> {o.name}"
