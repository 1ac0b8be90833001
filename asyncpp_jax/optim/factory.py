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
from asyncpp_jax.optim.adamw import AdamWBranch, adamw
from asyncpp_jax.optim.adan import adan
from asyncpp_jax.optim.lion import lion
from asyncpp_jax.optim.mars import mars
from asyncpp_jax.optim.muon import muon
from asyncpp_jax.optim.soap import soap
from asyncpp_jax.optim.lr_schedules import make_schedule
from asyncpp_jax.optim.delay_lr import delay_aware_lr
from asyncpp_jax.optim.lookahead import nesterov_lookahead
from asyncpp_jax.optim.muon import scale_by_muon
from asyncpp_jax.optim.prediction import WeightPrediction
from asyncpp_jax.optim.staleness import (
    DelaySchedule,
    WeightVersions,
    delay,
    error_feedback,
    pipedream_leaf_delays,
    taylor_compensation,
)

MATRIX_OPTIMIZERS = ("muon", "soap", "mars")


def side_branch(o, schedule) -> AdamWBranch:
    """The AdamW side branch under ``config.optimizer``: ``side.*`` and ``adamw_pattern``.

    Its lr is ``side.lr_ratio`` times the main schedule; ``side.weight_decay = -1`` follows
    ``optimizer.weight_decay``.
    """
    s = o.side
    side_lr = schedule if s.lr_ratio == 1.0 else (lambda step: s.lr_ratio * schedule(step))
    side_wd = o.weight_decay if s.weight_decay == -1 else s.weight_decay
    return AdamWBranch(learning_rate=side_lr, b1=s.b1, b2=s.b2, eps=s.eps, weight_decay=side_wd,
                       pattern=o.adamw_pattern)


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
                    weight_decay=wd, side=side_branch(o, schedule))
    if name == "soap":
        s = o.soap
        return soap(schedule, b1=s.b1, b2=s.b2, shampoo_beta=s.shampoo_beta, eps=s.eps, weight_decay=wd,
                    precondition_frequency=s.precondition_frequency, max_precond_dim=s.max_precond_dim,
                    side=side_branch(o, schedule))
    if name == "mars":
        m = o.mars
        return mars(schedule, b1=m.b1, b2=m.b2, gamma=m.gamma, eps=m.eps, weight_decay=wd,
                    side=side_branch(o, schedule))
    raise ValueError(
        f"config.optimizer.name={name!r} is unknown; choose one of adamw, muon, soap, adan, lion, mars"
    )


def build_nesterov_main(o, schedule, st) -> optax.GradientTransformation:
    """``config.staleness.nesterov``: Ajanthan et al. 2025's look-ahead (:mod:`asyncpp_jax.optim.lookahead`).

    AdamW becomes NAdamW with ``b1 = st.nesterov_b1`` (its b2, eps and decay kept).  Muon keeps its
    Nesterov-momentum orthogonalized update with ``mu = st.nesterov_b1``, and its AdamW side branch
    becomes NAdamW likewise.  Other optimizers are rejected by config validation.
    """
    look = dict(b1=st.nesterov_b1, momentum_decay=st.nesterov_momentum_decay)
    if o.name == "adamw":
        return nesterov_lookahead(schedule, b2=o.adamw.b2, eps=o.adamw.eps, weight_decay=o.weight_decay, **look)
    if o.name == "muon":
        m, side = o.muon, side_branch(o, schedule)
        hidden = optax.chain(
            scale_by_muon(mu=st.nesterov_b1, nesterov=True, ns_steps=m.ns_steps, scaling=m.scaling),
            optax.add_decayed_weights(o.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
        adamw_side = nesterov_lookahead(side.learning_rate, b2=side.b2, eps=side.eps,
                                        weight_decay=side.weight_decay, **look)
        return routing.partition(hidden, adamw_side, side.pattern)
    raise ValueError(f"config.staleness.nesterov=True is defined for adamw and muon, not {o.name!r}.")


def weight_prediction(st, total_steps: int) -> WeightPrediction | None:
    """The simulate runner's weight prediction under ``config.staleness``, or None when off."""
    if st is None or not st.weight_prediction or st.mode == "sync":
        return None
    return WeightPrediction(delay_schedule(st, total_steps), st.weight_prediction_smoothing)


def _delay_kwargs(st, total_steps: int, params_shapes) -> dict:
    leaf_delays = pipedream_leaf_delays(params_shapes, st.pipedream_stages) if st.mode == "pipedream" else None
    return dict(steps=1, sync_start_steps=st.sync_start_steps, sync_cooldown_steps=st.sync_cooldown_steps,
                total_steps=total_steps, leaf_delays=leaf_delays)


def delay_schedule(st, total_steps: int) -> DelaySchedule | None:
    """The delay in force per update under ``config.staleness`` (for metrics); None when sync."""
    if st is None or st.mode == "sync":
        return None
    steps = st.pipedream_stages - 1 if st.mode == "pipedream" else 1
    return DelaySchedule(steps=steps, sync_start_steps=st.sync_start_steps,
                         sync_cooldown_steps=st.sync_cooldown_steps, total_steps=total_steps)


def _mixed_point(st) -> bool:
    return st.mode == "pipedream" and st.pipedream_gradient == "mixed"


def weight_versions(st, total_steps: int, params_shapes) -> WeightVersions | None:
    """The runner's weight history for PipeDream's exact mixed-version gradient, or None.

    Only for ``staleness.mode='pipedream'`` with ``pipedream_gradient='mixed'``; otherwise the
    delay lives in the optimizer chain (:func:`build_optimizer`).
    """
    if st is None or not _mixed_point(st):
        return None
    kw = _delay_kwargs(st, total_steps, params_shapes)
    return WeightVersions(kw["leaf_delays"], DelaySchedule(
        steps=1, sync_start_steps=kw["sync_start_steps"], sync_cooldown_steps=kw["sync_cooldown_steps"],
        total_steps=total_steps))


def build_optimizer(o, total_steps: int, staleness=None, params_shapes=None, delay_in_chain: bool = True,
                    clip: bool = True):
    """Returns ``(optimizer, lr_schedule)``; the schedule is also used to log the lr.

    With ``staleness`` (``config.staleness``) in mode ``2bw`` or ``pipedream`` the chain simulates
    the pipeline's delay (the simulate runner):

        clip -> delay -> [taylor_compensation] -> optimizer -> [error_feedback]

    ``pipedream`` gives each pipeline stage's parameters the delay ``P-1-s`` and needs the
    parameter shapes (``params_shapes``, e.g. ``models.abstract_params``) to assign stages.  With
    ``pipedream_gradient='mixed'`` the delay comes from where the runner takes the gradient
    (:func:`weight_versions`), so the chain has no ``delay`` and the mitigations keep their
    per-stage schedule.  ``delay_in_chain=False`` is for the pipeline engine, whose delay is
    physical: the chain keeps the mitigations and their schedule but has no ``delay``.
    ``staleness.nesterov`` swaps the optimizer for :func:`build_nesterov_main`, and
    ``staleness.lr_rescheduling_steps > 0`` wraps the lr schedule in PipeMare's
    :func:`~asyncpp_jax.optim.delay_lr.delay_aware_lr` (the returned schedule is the wrapped one).
    ``clip=False`` leaves the global-norm clip out, for a runner that applies the chain to groups
    of parameters separately and clips with the norm over all of them itself (the pipeline's
    ``mpmd`` placement).
    """
    schedule = make_schedule(o, total_steps)
    parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip and clip else []
    if staleness is None or staleness.mode == "sync":
        return optax.chain(*parts, build_main(o, schedule)), schedule
    if staleness.lr_rescheduling_steps:
        schedule = delay_aware_lr(schedule, delay_schedule(staleness, total_steps), staleness.lr_rescheduling_steps)
    main = build_nesterov_main(o, schedule, staleness) if staleness.nesterov else build_main(o, schedule)
    if staleness.mode == "pipedream" and params_shapes is None:
        raise ValueError("staleness.mode='pipedream' needs params_shapes to assign parameters to stages")
    kw = _delay_kwargs(staleness, total_steps, params_shapes)
    if delay_in_chain and not _mixed_point(staleness):
        parts.append(delay(**kw))
    if staleness.mitigation == "taylor":
        parts.append(taylor_compensation(
            lam=staleness.taylor_lam, adaptive=staleness.taylor_adaptive, lam0=staleness.taylor_lam0,
            ema_decay=staleness.taylor_ema_decay, **kw))
    parts.append(main)
    if staleness.mitigation == "ef":
        parts.append(error_feedback(staleness.ef_strength, **kw))
    return optax.chain(*parts), schedule


def describe_routing(o, params) -> str:
    """Which parameter goes to which branch under ``config.optimizer`` (a printable table)."""
    if o.name in MATRIX_OPTIMIZERS:
        return routing.describe(params, o.adamw_pattern, {routing.HIDDEN: o.name, routing.ADAMW: "adamw (side)"})
    return f"all parameters -> {o.name}"
