"""The ``simulate`` runner: one jitted program, data parallel over the ``data`` mesh axis.

Contract shared with the pipeline runner: ``train_step(state, batch) -> (state, metrics)``
where ``batch`` is ``[microbatches, global_batch // microbatches, seq_len + 1]`` int32 tokens.

Gradient accumulation: ``g = (1/M) Σ_m ∇L(w; batch_m)``, summed locally on each device inside a
``shard_map``, then averaged over ``data`` with a single ``pmean`` per update (not per microbatch).
Every microbatch holds the same number of tokens, so this equals the gradient of the mean loss over
the whole global batch.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.train_state import BATCH_SPEC, TrainState, apply_update, replicated

def _accumulate_grads(model_cfg, params, batch):
    """Per-device: mean loss and gradient over the local microbatches ``batch[m]``."""
    grad_fn = jax.value_and_grad(functools.partial(dense.loss_fn, model_cfg), has_aux=True)
    # Differentiate w.r.t. a device-varying view of the replicated params: the gradient is then
    # this device's own, and the one explicit pmean below is the only cross-device reduction.
    # (W.r.t. the invariant params, shard_map's transpose would psum every microbatch's gradient.)
    params = jax.lax.pcast(params, ("data",), to="varying")

    def one(carry, mb):
        g_sum, loss_sum, stat_sums = carry
        with jax.named_scope("sim_grad"):  # a part of the step in train/profile.py
            (loss, stats), g = grad_fn(params, mb)
        return (jax.tree.map(jnp.add, g_sum, g), loss_sum + loss, jax.tree.map(jnp.add, stat_sums, stats)), None

    # Scalar accumulators become device-varying once a batch shard is added; start them varying.
    zero = jax.lax.pcast(jnp.zeros((), jnp.float32), ("data",), to="varying")
    stat_zeros = {k: zero for k in jax.eval_shape(grad_fn, params, batch[0])[0][1]}
    init = (jax.tree.map(jnp.zeros_like, params), zero, stat_zeros)
    (g_sum, loss, stat_sums), _ = jax.lax.scan(one, init, batch)
    m = batch.shape[0]
    grads = jax.tree.map(lambda g: jax.lax.pmean(g / m, "data"), g_sum)
    stats = {k: jax.lax.pmean(v / m, "data") for k, v in {"loss": loss, **stat_sums}.items()}
    return grads, stats


def make_train_step(model_cfg, optimizer, schedule: optax.Schedule, mesh, delay_schedule=None,
                    weight_versions=None, weight_prediction=None) -> Callable:
    """Jitted ``train_step(state, batch) -> (state, metrics)``; the state buffer is donated.

    With a ``delay_schedule`` (simulated asynchrony), metrics also record the delay in force at
    this update and how many in-flight gradients a cooldown switch dropped.  With
    ``weight_versions`` (``optim.WeightVersions``, PipeDream's exact simulation) the gradient is
    taken at the mixed point ``w_mix[t]`` of past stage weights, its fill slices are zeroed, and
    ``w[t]`` joins the history: ``w[t+1] = w[t] - U_t(∇L(w_mix[t]; batch t))``.  With
    ``weight_prediction`` (``optim.WeightPrediction``, with the chain's ``delay``) batch ``t``'s
    gradient is taken at the extrapolated ``ŵ_t = w_t + d δ_t`` and the update joins ``δ``.
    """
    grads_fn = jax.shard_map(
        functools.partial(_accumulate_grads, model_cfg),
        mesh=mesh,
        in_specs=(P(), BATCH_SPEC),
        out_specs=(P(), P()),
    )

    def train_step(state: TrainState, batch):
        versions = state.runner_state
        if weight_prediction is not None:
            grads, stats = grads_fn(weight_prediction.predicted_point(state.params, versions), batch)
            new, metrics = apply_update(state, grads, stats, versions, optimizer, schedule, delay_schedule)
            return new.replace(runner_state=weight_prediction.push(state.params, new.params, versions)), metrics
        if weight_versions is None:
            grads, stats = grads_fn(state.params, batch)
        else:
            grads, stats = grads_fn(weight_versions.mixed_point(state.params, versions), batch)
            grads = weight_versions.mask_fill(grads, versions)
            versions = weight_versions.push(state.params, versions)
        return apply_update(state, grads, stats, versions, optimizer, schedule, delay_schedule)

    rep = replicated(mesh)
    return jax.jit(
        train_step,
        in_shardings=(rep, NamedSharding(mesh, BATCH_SPEC)),
        out_shardings=(rep, rep),
        donate_argnums=0,
    )


def make_eval_step(model_cfg, mesh) -> Callable:
    """Jitted ``eval_step(params, batch[B, T+1]) -> (sum of token losses, token count)``."""

    def local(params, batch):
        logits = dense.forward(model_cfg, params, batch[:, :-1])
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]
        total = jax.lax.psum(jnp.sum(lse - tgt), "data")
        count = jax.lax.psum(jnp.float32(tgt.size), "data")
        return total, count

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    # Under the pipeline engine the params arrive sharded over ``stage``; shard_map gathers them.
    params_sharding = replicated(mesh) if "stage" not in mesh.axis_names else None
    return jax.jit(fn, in_shardings=(params_sharding, eval_sharding(mesh)))


def eval_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data"))


def to_global_batch(mesh, local_batch, microbatches: int, spec=BATCH_SPEC):
    """Host ``[B_local, T+1]`` -> global device array ``[M, B/M, T+1]`` sharded over ``data``.

    ``local_batch`` is the whole batch in a single process.  Several processes must each pass the
    rows of the replicas their devices hold: ``train.batch_layout`` computes them and assembles the
    batch for any layout of the mesh over processes (what the trainer uses).
    """
    b, t = local_batch.shape
    local = local_batch.reshape(microbatches, b // microbatches, t)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)
