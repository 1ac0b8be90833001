"""The ``pipeline`` runner: one ``jax.shard_map`` over ``('data', 'stage')``, a ``lax.scan`` over ticks.

Stage ``s`` holds layers ``[s L/P, (s+1) L/P)`` (the stacked layer leaves are sharded on their
leading axis over ``stage``); the embedding, final norm and head are replicated, used by stage 0
(embedding) and stage ``P-1`` (norm, head, loss) only, and their gradients are summed over
``stage`` (with tied embeddings both uses add up, as in the unsplit model).

Per tick (:mod:`asyncpp_jax.pipeline.schedules` says which microbatch), every stage runs

* a forward slot: ``h_out = layers_s(h_in)`` with ``h_in`` the embedded tokens on stage 0, else
  the activation received from ``s-1``; ``h_in`` goes into the stash ring; ``h_out`` is sent to
  ``s+1`` with ``lax.ppermute``;
* a backward slot: ``jax.vjp`` of the stage, recomputed from the stashed ``h_in``, with the
  cotangent received from ``s+1`` (on stage ``P-1``: the loss, scaled by ``1/M``); parameter
  gradients are added to the accumulator of the microbatch's batch; the input cotangent is sent to
  ``s-1``.

Idle slots compute on whatever is in the buffers and are discarded with ``jnp.where`` (never by
multiplying with a mask, which would let a NaN through).  Gradients are averaged over ``data``
once per update, after the tick loop.

``sync`` flushes each step: the gradient of batch ``t`` at ``w[t]`` is applied at update ``t``,
as in the ``simulate`` runner.  ``2bw`` never flushes: the stash ring, the activations and
cotangents in transit, the partial gradient of the batch in flight, the previous weight version
and the previous batch's tokens live in :class:`PipelineState` (so they are checkpointed), each
microbatch uses its batch's weight version for both its forward and its backward, and update
``t`` applies the gradient of batch ``t-1`` taken at ``w[t-1]``: ``optim.delay``'s conventions
exactly (fill at the first delayed update, in-flight batch dropped at a cooldown switch).  The
optimizer chain has no ``delay`` transform; mitigations (error feedback) follow the same schedule.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.models.moe import is_expert_weight, with_expert_parallel
from asyncpp_jax.optim.staleness import DelaySchedule
from asyncpp_jax.pipeline import schedules
from asyncpp_jax.train.step import TrainState, apply_update

BATCH_SPEC = P(None, "data")  # [microbatch, batch, time + 1]
DEVICE = P("data", "stage")  # per-device in-flight state: leading [data, stage] axes


def make_pipeline_mesh(data: int, stages: int, devices=None) -> jax.sharding.Mesh:
    """A ``('data', 'stage')`` mesh.  Auto axes: the optimizer update outside the ``shard_map``
    is partitioned by XLA (each stage updates its own layer shard)."""
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < data * stages:
        raise ValueError(
            f"config.mesh.data={data} x config.pipeline.stages={stages} needs {data * stages} devices, "
            f"found {len(devices)}; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{data * stages} before JAX starts (python -m asyncpp_jax.main does).")
    return jax.make_mesh((data, stages), ("data", "stage"), axis_types=(AxisType.Auto,) * 2,
                         devices=devices[: data * stages])


def param_specs(params, expert_parallel: bool = False) -> Any:
    """``layers/...`` sharded on the leading (layer) axis over ``stage``, routed experts also on
    their expert axis over ``data`` with ``expert_parallel``; the rest replicated."""

    def spec(path, _):
        if path[0].key != "layers":
            return P()
        return P("stage", "data") if expert_parallel and is_expert_weight(path) else P("stage")

    return jax.tree_util.tree_map_with_path(spec, params)


def _local_shape(x, spec: P, mesh_shape: dict) -> tuple:
    shape = list(x.shape)
    for i, axis in enumerate(spec):
        if axis is not None:
            shape[i] //= mesh_shape[axis]
    return tuple(shape)


class PipelineState(NamedTuple):
    """What crosses ``train_step`` calls under ``2bw`` (zeros, and unused, under ``sync``)."""

    prev_params: Any  # w[t-1]: the weight version of the batch still draining
    stash: jax.Array  # [D, P, 2P-1, b, T, d]: stage inputs awaiting their backward
    fwd_buf: jax.Array  # [D, P, b, T, d]: activation received from stage s-1
    bwd_buf: jax.Array  # [D, P, b, T, d]: cotangent received from stage s+1
    grad_partial: Any  # the in-flight batch's gradient so far; leaves [D, P, *local shape]
    prev_batch: jax.Array  # [M, B, T+1]: the in-flight batch's tokens (the last stage needs targets)


def init_pipeline_state(model_cfg, params, data: int, n_stages: int, microbatches: int,
                        global_batch: int, seq_len: int, expert_parallel: bool = False) -> PipelineState:
    b = global_batch // microbatches // data
    act = jnp.zeros((data, n_stages, b, seq_len, model_cfg.d_model), jnp.float32)
    mesh_shape = {"data": data, "stage": n_stages}
    partial = jax.tree.map(lambda x, spec: jnp.zeros((data, n_stages) + _local_shape(x, spec, mesh_shape), jnp.float32),
                           params, param_specs(params, expert_parallel))
    return PipelineState(
        prev_params=jax.tree.map(jnp.copy, params),
        stash=jnp.zeros((data, n_stages, schedules.stash_slots(n_stages), b, seq_len, model_cfg.d_model),
                        jnp.float32),
        fwd_buf=act, bwd_buf=act, grad_partial=partial,
        prev_batch=jnp.zeros((microbatches, global_batch // microbatches, seq_len + 1), jnp.int32),
    )


def pipeline_state_specs(params, expert_parallel: bool = False) -> PipelineState:
    return PipelineState(
        prev_params=param_specs(params, expert_parallel), stash=DEVICE, fwd_buf=DEVICE, bwd_buf=DEVICE,
        grad_partial=jax.tree.map(lambda _: DEVICE, params), prev_batch=BATCH_SPEC)


def _select(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _vary(tree, axes=("data", "stage")):
    """Cast to device-varying over ``axes``: differentiating w.r.t. a value that is invariant over an
    axis would make shard_map's transpose sum the gradient over that axis."""
    def one(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)


def _make_grads_fn(model_cfg, mesh, table: schedules.TickTable, is_async: bool, params_abstract,
                   expert_parallel: bool = False):
    """``shard_map``-ped ``(cur, prev, batch, pstate, prev_live, step) -> (grads, stats, pstate)``."""
    n_stages, M = table.n_stages, table.microbatches
    S = schedules.stash_slots(n_stages)
    fwd_tbl, bwd_tbl = jnp.asarray(table.forward), jnp.asarray(table.backward)
    fwd_perm = [(i, i + 1) for i in range(n_stages - 1)]
    bwd_perm = [(i + 1, i) for i in range(n_stages - 1)]
    axes = ("data", "stage")

    def local(cur, prev, batch, pstate, prev_live, step):
        s = jax.lax.axis_index("stage")
        is_first, is_last = s == 0, s == n_stages - 1
        strip = lambda x: x[0, 0]  # noqa: E731
        stash, fwd_buf, bwd_buf = strip(pstate.stash), strip(pstate.fwd_buf), strip(pstate.bwd_buf)
        acc_prev = jax.tree.map(strip, pstate.grad_partial)
        # The in-flight batch's partial gradient counts only if the previous step was asynchronous;
        # at the first 2bw step it is a fill (zero) gradient, whatever the buffer holds.
        acc_prev = jax.tree.map(lambda a: jnp.where(prev_live, a, jnp.zeros_like(a)), acc_prev)
        acc_cur = jax.tree.map(jnp.zeros_like, acc_prev)
        prev_batch = pstate.prev_batch

        def tokens_of(j):
            m = jnp.mod(j, M)
            return jnp.where(j < 0, prev_batch[m], batch[m])

        def stage_fn(p, h_recv, tokens):
            h_in = jnp.where(is_first, dense.embed(model_cfg, p, tokens[:, :-1]).astype(h_recv.dtype), h_recv)
            return h_in, dense.apply_layers(model_cfg, p["layers"], h_in)

        def stage_with_loss(p, h_stash, tokens):
            """``(h_out, this stage's loss)``: the LM loss on stage P-1, plus every stage's MoE terms."""
            h_in = jnp.where(is_first, dense.embed(model_cfg, p, tokens[:, :-1]).astype(h_stash.dtype), h_stash)
            h_out, aux = dense.apply_layers_with_aux(model_cfg, p["layers"], h_in)
            logits = dense.logits_from_hidden(model_cfg, p, h_out)
            lm, (ce, z) = dense.cross_entropy(logits, tokens[:, 1:], model_cfg.z_loss)
            last = lambda x: jnp.where(is_last, x, jnp.zeros_like(x))  # noqa: E731
            loss = last(lm) + dense.aux_loss(model_cfg, aux)
            return (h_out, loss), dense.loss_stats(model_cfg, last(ce), last(z), aux)

        def live(j):
            return (j != schedules.IDLE) & ((j >= 0) | prev_live)

        def tick(carry, row):
            stash, fwd_buf, bwd_buf, acc_prev, acc_cur, sums = carry
            jf, jb = row[0], row[1]
            # Forward slot.
            p_f = _select(jf < 0, prev, cur)
            h_in, h_out = stage_fn(p_f, fwd_buf, tokens_of(jf))
            slot_f = jnp.mod(step * M + jf, S)
            stash = stash.at[slot_f].set(jnp.where(live(jf), h_in, stash[slot_f]))
            # Backward slot: recompute the stage from the stashed input, then its vjp.
            p_b = _vary(_select(jb < 0, prev, cur))
            h_stash = stash[jnp.mod(step * M + jb, S)]
            (_, loss), vjp, stats = jax.vjp(lambda p, h: stage_with_loss(p, h, tokens_of(jb)), p_b, h_stash,
                                            has_aux=True)
            ct_out = jnp.where(is_last, jnp.zeros_like(bwd_buf), bwd_buf)
            ct_loss = jnp.ones_like(loss) / M
            g_p, g_h = vjp((ct_out, ct_loss))
            ok = live(jb)
            into_prev = ok & (jb < 0)
            into_cur = ok & (jb >= 0)
            acc_prev = jax.tree.map(lambda a, g: jnp.where(into_prev, a + g, a), acc_prev, g_p)
            acc_cur = jax.tree.map(lambda a, g: jnp.where(into_cur, a + g, a), acc_cur, g_p)
            # Every stage adds its share of each finished microbatch's loss; the last stage counts them.
            sums = jax.tree.map(lambda a, v: jnp.where(ok, a + v, a), sums,
                                {"loss": loss, **stats, "count": jnp.where(is_last, 1.0, 0.0) * jnp.ones_like(loss)})
            # Send: activations forward, cotangents backward (stage 0 / P-1 receive zeros).
            fwd_buf = jax.lax.ppermute(h_out.astype(fwd_buf.dtype), "stage", fwd_perm)
            bwd_buf = jax.lax.ppermute(g_h.astype(bwd_buf.dtype), "stage", bwd_perm)
            return (stash, fwd_buf, bwd_buf, acc_prev, acc_cur, sums), None

        zero = jax.lax.pcast(jnp.zeros((), jnp.float32), axes, to="varying")
        rows = jnp.stack([jnp.take(fwd_tbl, s, axis=1), jnp.take(bwd_tbl, s, axis=1)], axis=1)
        stat_names = ["loss", "ce", "z_loss"] + (list(dense.MOE_METRICS) if dense.uses_moe(model_cfg) else [])
        carry = (stash, fwd_buf, bwd_buf, acc_prev, acc_cur, {k: zero for k in stat_names + ["count"]})
        (stash, fwd_buf, bwd_buf, acc_prev, acc_cur, sums), _ = jax.lax.scan(tick, carry, rows)

        done, partial = (acc_prev, acc_cur) if is_async else (acc_cur, jax.tree.map(jnp.zeros_like, acc_cur))
        data_size = jax.lax.axis_size("data")

        def finish(path, g):
            if path[0].key != "layers":  # replicated params: each stage holds only its own uses' gradient
                g = jax.lax.psum(g, "stage")
            if expert_parallel and is_expert_weight(path):
                # This device's experts already got every data shard's tokens (all_to_all's
                # transpose sums them): divide for the mean, no reduction.
                return g / data_size
            return jax.lax.pmean(g, "data")

        grads = jax.tree_util.tree_map_with_path(finish, done)
        sums = {k: jax.lax.psum(v, "stage") for k, v in sums.items()}
        count = jnp.maximum(sums.pop("count"), 1.0)
        stats = {k: jax.lax.pmean(v / count, "data") for k, v in sums.items()}
        grow = lambda x: x[None, None]  # noqa: E731
        new = PipelineState(prev_params=cur, stash=grow(stash), fwd_buf=grow(fwd_buf), bwd_buf=grow(bwd_buf),
                            grad_partial=jax.tree.map(grow, partial), prev_batch=batch)
        return grads, stats, new

    pspec = param_specs(params_abstract, expert_parallel)
    sspec = pipeline_state_specs(params_abstract, expert_parallel)
    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(pspec, pspec, BATCH_SPEC, sspec, P(), P()),
        out_specs=(pspec, P(), sspec),
    )


def make_pipeline_train_step(model_cfg, optimizer, schedule: optax.Schedule, mesh, params_abstract,
                             microbatches: int, pipeline_schedule: str, delay_schedule: DelaySchedule | None = None,
                             expert_parallel: bool = False):
    """Jitted ``train_step(state, batch) -> (state, metrics)`` with ``state.runner_state`` a
    :class:`PipelineState`.  ``pipeline_schedule`` is ``sync`` or ``2bw``; under ``2bw`` the
    ``delay_schedule`` (``optim.delay_schedule``) says which updates are synchronous (start,
    cooldown): those run the flushed ``sync`` table and drop what is in flight, as ``delay`` does."""
    n_stages = mesh.shape["stage"]
    if expert_parallel:  # experts sharded over ``data``: the MoE layers exchange tokens with all_to_all
        model_cfg = with_expert_parallel(model_cfg, "data", mesh.shape["data"])
    ep = expert_parallel
    sync_fn = _make_grads_fn(model_cfg, mesh, schedules.sync_table(n_stages, microbatches), False, params_abstract, ep)
    async_fn = None
    if pipeline_schedule == "2bw":
        async_fn = _make_grads_fn(model_cfg, mesh, schedules.async_table(n_stages, microbatches), True,
                                  params_abstract, ep)
        delay_schedule = delay_schedule or DelaySchedule(1)

    def train_step(state: TrainState, batch):
        ps = state.runner_state
        args = (state.params, ps.prev_params, batch, ps)
        if async_fn is None:
            grads, stats, ps = sync_fn(*args, jnp.bool_(False), state.step)
        else:
            on = delay_schedule.in_force(state.step)
            prev_live = delay_schedule.in_force(state.step - 1)
            grads, stats, ps = jax.lax.cond(
                on, lambda: async_fn(*args, prev_live, state.step), lambda: sync_fn(*args, prev_live, state.step))
        return apply_update(state, grads, stats, ps, optimizer, schedule, delay_schedule)

    return jax.jit(train_step, donate_argnums=0)


def state_shardings(state, mesh, params_abstract, expert_parallel: bool = False):
    """NamedShardings for a (possibly abstract) pipeline TrainState: layers and their optimizer
    moments over ``stage`` (experts also over ``data`` with expert parallelism), the in-flight
    state per device, the rest replicated."""
    shard = functools.partial(NamedSharding, mesh)
    pspecs = param_specs(params_abstract, expert_parallel)
    n_layers = {x.shape[0] for x in jax.tree.leaves(params_abstract["layers"])}.pop()
    # Optimizer moments mirror their params' shapes: an expert-shaped moment is sharded like the
    # experts, a stacked-layer one like the layers.
    expert_shapes = {tuple(x.shape) for x, sp in zip(jax.tree.leaves(params_abstract), jax.tree.leaves(pspecs))
                     if len(sp) > 1}

    def opt_leaf(x):
        if tuple(x.shape) in expert_shapes:
            return shard(P("stage", "data"))
        stacked = len(x.shape) >= 2 and x.shape[0] == n_layers
        return shard(P("stage") if stacked else P())

    return TrainState(step=shard(P()), params=jax.tree.map(shard, pspecs),
                      opt_state=jax.tree.map(opt_leaf, state.opt_state),
                      runner_state=jax.tree.map(shard, pipeline_state_specs(params_abstract, expert_parallel)))


def place_state(state: TrainState, mesh, params_abstract, expert_parallel: bool = False) -> TrainState:
    """Put a fresh state on the pipeline mesh (layers over ``stage``)."""
    return jax.device_put(state, state_shardings(state, mesh, params_abstract, expert_parallel))


def global_batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, BATCH_SPEC)


