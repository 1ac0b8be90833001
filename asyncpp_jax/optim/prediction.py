"""Weight prediction: take a delayed batch's gradient at the weights it will be applied to.

SpecTrain (Chen et al. 2018, "Efficient and Robust Parallel DNN Training through Model Parallelism
on Multi-GPU Platform", arXiv:1809.02839) and PipeMare's discrepancy correction (Yang et al. 2021,
MLSys, arXiv:1910.05124) both extrapolate the weights along the recent update direction by the
number of updates the gradient will be late, and compute the gradient there instead of at the
stale weights.  Under :func:`~asyncpp_jax.optim.staleness.delay`'s conventions batch ``t``'s
gradient, computed during update ``t``, is applied at update ``t + d``; so the runner computes it at

    ŵ_t = w_t + d * δ_t          δ_t = β δ_{t-1} + (1 - β) (w_t - w_{t-1}),   δ_0 = 0

instead of at ``w_t``.  ``β = smoothing``: 0 extrapolates the last update itself (``ŵ_t`` is then
the linear prediction of ``w_{t+d}``); ``0 < β < 1`` extrapolates an exponential moving average of
the updates, PipeMare's smoothed velocity.  SpecTrain extrapolates ``lr * (Adam's m)`` instead, which
is the same direction for SGD with momentum but not for adaptive optimizers; using the realised
update makes the rule optimizer-agnostic.

Where the delay is not in force at update ``t`` (synchronous start and cooldown, :class:`DelaySchedule`)
the gradient is applied at once and is taken at ``w_t``; ``δ`` keeps being updated, so the first
delayed update after a synchronous start already extrapolates the last synchronous update.  At the
very first update ``δ = 0`` and ``ŵ_0 = w_0``.  Only the gradient's point moves: the update is
still applied to ``w_t`` (never to ``ŵ_t``), and the optimizer chain is unchanged.

State: the counter and one params-sized tree ``δ``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from asyncpp_jax.optim.staleness import DelaySchedule


class WeightPredictionState(NamedTuple):
    count: jax.Array  # int32: updates so far
    velocity: Any  # δ_t: the (smoothed) last update w_t - w_{t-1}, like the params


class WeightPrediction:
    """The runner's side of weight prediction (module docstring): ``predicted_point`` and ``push``."""

    def __init__(self, schedule: DelaySchedule, smoothing: float = 0.0):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"WeightPrediction smoothing={smoothing!r} must lie in [0, 1).")
        self.schedule = schedule
        self.smoothing = float(smoothing)

    def init(self, params) -> WeightPredictionState:
        return WeightPredictionState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def predicted_point(self, params, state: WeightPredictionState):
        """``ŵ_t = w_t + d δ_t`` while the delay is in force at update ``t``, else ``w_t``."""
        on = self.schedule.in_force(state.count)
        d = float(self.schedule.steps)
        return jax.tree.map(lambda w, v: jnp.where(on, w + d * v.astype(w.dtype), w), params, state.velocity)

    def push(self, old_params, new_params, state: WeightPredictionState) -> WeightPredictionState:
        """Fold the update ``w_{t+1} - w_t`` into ``δ`` and advance the counter."""
        b = self.smoothing
        velocity = jax.tree.map(lambda v, new, old: (b * v + (1.0 - b) * (new - old)).astype(v.dtype),
                                state.velocity, new_params, old_params)
        return WeightPredictionState(optax.safe_increment(state.count), velocity)
