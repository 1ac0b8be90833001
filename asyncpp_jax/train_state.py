"""What both runners share: the train state, the batch layout and the optimizer step.

The ``simulate`` runner (:mod:`asyncpp_jax.train.step`) and the ``pipeline`` runner
(:mod:`asyncpp_jax.pipeline.spmd.engine`) both import from here and not from each other, so the
layers stay one-way: config -> models, data, optim -> this module -> runners -> trainer.

Contract: a step is ``train_step(state, batch) -> (state, metrics)`` with ``batch`` laid out as
``BATCH_SPEC``: ``[microbatches, global_batch // microbatches, seq_len + 1]`` int32 tokens, the
batch axis split over the ``data`` mesh axis; every runner ends a step with :func:`apply_update`,
``w[t+1] = w[t] + U_t(g)``.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense

BATCH_SPEC = P(None, "data")  # [microbatch, batch, time + 1]: batch split over data


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    # What a runner carries between steps besides params and optimizer: PipeDream's weight history
    # (optim.WeightVersionsState) or the pipeline engine's in-flight PipelineState; else None.
    runner_state: Any = None


def init_state(model_cfg, optimizer: optax.GradientTransformation, rng: jax.Array,
               weight_versions=None, layout=None, params=None) -> TrainState:
    """A fresh state.  ``layout``: applied to the model's fresh params before anything else sees
    them (the pipeline engine's layout, ``engine.to_engine_layout``).  ``params``: the model's
    params in its own layout (e.g. read from a Hugging Face checkpoint) instead of a random init."""
    params = dense.init_params(model_cfg, rng) if params is None else params
    if layout is not None:
        params = layout(params)
    versions = weight_versions.init(params) if weight_versions is not None else None
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      runner_state=versions)


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def apply_update(state: TrainState, grads, stats: dict, runner_state, optimizer, schedule, delay_schedule=None):
    """The optimizer step both runners end with: ``(new state, metrics)``.  With a delay schedule
    the metrics also record the delay in force and the batches a cooldown switch dropped."""
    with jax.named_scope("optimizer_update"):  # a part of the step in train/profile.py
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
    metrics = dict(stats, grad_norm=optax.global_norm(grads), lr=schedule(state.step))
    if delay_schedule is not None:
        metrics.update(delay=delay_schedule.delay_at(state.step), skipped_batches=delay_schedule.skipped_at(state.step))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, runner_state=runner_state), metrics


def from_host(sharding: NamedSharding, array) -> jax.Array:
    """A global array from a host array every process holds whole (an eval batch, a fresh state's
    leaf): in a job of several processes each one supplies only its own devices' shards."""
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
