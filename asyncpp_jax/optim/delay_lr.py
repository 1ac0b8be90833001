"""Delay-aware learning rate: PipeMare's learning-rate rescheduling (Yang et al. 2021, MLSys).

    schedule = delay_aware_lr(optax.cosine_decay_schedule(3e-3, 1000), DelaySchedule(steps=3), 200)

PipeMare ("PipeMare: Asynchronous Pipeline Parallel DNN Training", Yang, Zhang, Li, Ré, Aberger,
De Sa; arXiv:1910.05124) shrinks the step size of a weight updated with delay ``tau`` by ``tau``
early in training and anneals the shrinkage away over ``K`` updates::

    lr'_t = lr_t * tau_t^(-p_t),        p_t = 1 - min(t / K, 1)

so ``lr'_0 = lr_0 / tau`` and ``lr'_t = lr_t`` from ``t = K`` on.  The rule as implemented was
checked against the PipeMare correction in Ajanthan et al.'s official code
(github.com/PluralisResearch/AsyncPP, ``adjust_learning_rate``: ``lr / tau ** (1 - min(t / K, 1))``);
the PipeMare paper's own text could not be retrieved here.  PipeMare applies the rule per stage
with that stage's delay; an optax schedule is one scalar per update, so ``tau_t`` here is the delay
``DelaySchedule.delay_at(t)`` the chain runs under (the LARGEST stage delay under PipeDream's
per-stage delays, i.e. the most cautious choice for every stage).

``t`` is the 0-indexed update count.  Where ``tau_t <= 1`` (synchronous phases, and any one-step
delay such as 2BW) the factor is exactly 1: at delay 1 the rescheduling is the identity.
"""

from __future__ import annotations

import operator

import jax.numpy as jnp
import optax

from asyncpp_jax.optim.staleness import DelaySchedule


def delay_aware_lr(schedule: optax.Schedule | float, delay: DelaySchedule | int, anneal_steps: int) -> optax.Schedule:
    """``schedule`` times PipeMare's ``tau_t^(-(1 - min(t / K, 1)))`` (module docstring), ``K = anneal_steps``."""
    if not isinstance(delay, DelaySchedule):
        delay = DelaySchedule(steps=delay)
    k = operator.index(anneal_steps)
    if k < 1:
        raise ValueError(f"delay_aware_lr: anneal_steps={anneal_steps!r} must be a positive integer.")
    base = schedule if callable(schedule) else optax.constant_schedule(schedule)

    def scheduled(count):
        tau = jnp.maximum(delay.delay_at(count), 1).astype(jnp.float32)
        p = 1.0 - jnp.minimum(jnp.asarray(count, jnp.float32) / k, 1.0)
        return base(count) * jnp.power(tau, -p)

    return scheduled
