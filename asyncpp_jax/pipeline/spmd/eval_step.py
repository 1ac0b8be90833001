"""The pipeline's eval step: the forward-only program, each stage with its own layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.models.moe import with_expert_parallel
from asyncpp_jax.pipeline.schedules import programs
from asyncpp_jax.pipeline.schedules import slot_plan
from asyncpp_jax.pipeline import vocab_parallel as vp
from asyncpp_jax.pipeline.collectives import hop_perms, vary
from asyncpp_jax.pipeline.layout import check_layout, param_specs
from asyncpp_jax.pipeline.options import EngineOptions
from asyncpp_jax.pipeline.stage import (chunk_rows, head_of, is_first_virtual, is_last_virtual, lookup,
                                        split_params)


def make_pipeline_eval_step(model_cfg, mesh, params_abstract, microbatch_rows: int, options: EngineOptions):
    """Jitted ``eval_step(params, batch[B, T+1]) -> (sum of token losses, token count)`` on the
    pipeline mesh: forward only, each stage with its own layers (the model is never gathered).

    Each data replica's rows are cut into microbatches of ``microbatch_rows`` (the training
    microbatch, so activations match what training holds) and streamed through the stages as the
    forward-only program (:func:`asyncpp_jax.pipeline.schedules.programs.forward_only`) compiled into
    lock-step slots (:mod:`asyncpp_jax.pipeline.schedules.slot_plan`: stage ``s`` runs microbatch ``m`` at
    slot ``m + s``; each activation lands in the entry its row names): stage 0 embeds, stage
    ``P-1`` applies the head and sums the token losses.  Idle slots compute nothing, nor do padded
    layer rows (``options.stage_rows``, :func:`stage_split`).  With ``c`` chunks per device (the
    ``interleaved`` layout, ``options.virtual_stages``) each microbatch passes every device ``c`` times, the
    last device's chunk ``k`` feeding device 0's chunk ``k + 1``.  With ``options.vocab_parallel``
    (the tables split over ``stage``) every device joins stage 0's lookup and the last stage's loss
    in each slot (:func:`_vocab_parallel_slot`).
    """
    expert_parallel, vocab_parallel = options.expert_parallel, options.vocab_parallel
    stage_rows, chunks = options.stage_rows, options.virtual_stages
    n_stages = mesh.shape["stage"]
    check_layout(model_cfg, params_abstract, n_stages, stage_rows)
    if expert_parallel:
        model_cfg = with_expert_parallel(model_cfg, "data", mesh.shape["data"])
    fwd_perm, _ = hop_perms(n_stages, ring=chunks > 1)
    act_dtype = dense.dtype_of(model_cfg.compute_dtype)
    col = slot_plan.INDEX

    def local(params, batch):
        s = jax.lax.axis_index("stage")
        live = None if stage_rows is None else jnp.asarray(stage_rows, jnp.int32)[s]
        layers, top = split_params(vary(dense.compute_view(model_cfg, params)))
        head = head_of(model_cfg, top)
        rows, width = batch.shape
        b = min(microbatch_rows, rows)
        mbs = batch.reshape(rows // b, b, width)
        plan = slot_plan.compile_program(programs.forward_only(n_stages, mbs.shape[0], chunks))

        def slot(carry, row):
            fwd, total, count = carry
            j, chunk = row[col["f"]], row[col["f_chunk"]]
            tokens = mbs[jnp.where(j == slot_plan.IDLE, 0, j)]
            is_first, is_last = is_first_virtual(s, chunk, chunks), is_last_virtual(s, n_stages, chunk, chunks)

            def work(fwd):
                x = jax.lax.cond(is_first, lambda: lookup(model_cfg, top, tokens[:, :-1]).astype(act_dtype),
                                 lambda: fwd[row[col["f_fwd"]]])
                h = dense.apply_layers(model_cfg, chunk_rows(layers, chunk, chunks), x, live).astype(act_dtype)

                def loss_sum():
                    logits = dense.logits_from_head(model_cfg, head, h)
                    lse = jax.nn.logsumexp(logits, axis=-1)
                    tgt = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
                    return jnp.zeros_like(h), vary(jnp.sum(lse - tgt)), vary(jnp.float32(tgt.size))

                zero = vary(jnp.zeros((), jnp.float32))
                return jax.lax.cond(is_last, loss_sum, lambda: (h, zero, zero))

            def idle(fwd):
                zero = vary(jnp.zeros((), jnp.float32))
                return jnp.zeros_like(fwd[0]), zero, zero

            h_out, loss, n = jax.lax.cond(j != slot_plan.IDLE, work, idle, fwd)
            h_in = jax.lax.ppermute(h_out, "stage", fwd_perm)
            return (fwd.at[row[col["fwd_store"]]].set(h_in), total + loss, count + n), None

        zero = vary(jnp.zeros((), jnp.float32))
        fwd = vary(jnp.zeros((plan.depth["fwd"], b, width - 1, model_cfg.d_model), act_dtype))
        if vocab_parallel:  # every device reads the slot's whole row (stage 0's and the last stage's too)
            body = _vocab_parallel_slot(model_cfg, s, n_stages, chunks, layers, top, head, mbs, live, fwd_perm)
            xs = plan.rows
        else:
            body, xs = slot, jnp.take(plan.rows, s, axis=1)
        (_, total, count), _ = jax.lax.scan(body, (fwd, zero, zero), xs)
        return jax.lax.psum(total, ("data", "stage")), jax.lax.psum(count, ("data", "stage"))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(param_specs(params_abstract, expert_parallel, vocab_parallel),
                                                   P("data")), out_specs=(P(), P()))
    return jax.jit(fn)


def _vocab_parallel_slot(model_cfg, s, n_stages, chunks, layers, top, head, mbs, live, fwd_perm):
    """The eval's slot with the tables split over ``stage``: the first virtual stage's lookup and
    the last one's loss are collectives every device joins (predicates from the slot's whole row,
    the same on every device); each stage's block runs under its own cond."""
    col, act_dtype = slot_plan.INDEX, dense.dtype_of(model_cfg.compute_dtype)
    idle = slot_plan.IDLE

    def at(row, chunk):  # the row's forward microbatch when it runs ``chunk``, else idle
        return jnp.where(row[col["f_chunk"]] == chunk, row[col["f"]], idle)

    def slot(carry, rows):
        fwd, total, count = carry
        row, first_j, last_j = rows[s], at(rows[0], 0), at(rows[n_stages - 1], chunks - 1)
        j, chunk = row[col["f"]], row[col["f_chunk"]]
        is_first, is_last = is_first_virtual(s, chunk, chunks), is_last_virtual(s, n_stages, chunk, chunks)
        zero_x = jnp.zeros_like(fwd[0])
        x0 = jax.lax.cond(first_j != idle, lambda: vary(vp.lookup(model_cfg, top, mbs[first_j][:, :-1])
                                                         .astype(act_dtype)), lambda: zero_x)
        x = jnp.where(is_first, x0, fwd[row[col["f_fwd"]]])
        h = jax.lax.cond(j != idle, lambda: dense.apply_layers(model_cfg, chunk_rows(layers, chunk, chunks), x, live)
                         .astype(act_dtype), lambda: zero_x)
        last_here = is_last & (j != idle)
        h_last = jax.lax.psum(jnp.where(last_here, h, jnp.zeros_like(h)), "stage")
        zero = vary(jnp.zeros((), jnp.float32))
        loss, n = jax.lax.cond(last_j != idle,
                               lambda: vary(vp.head_loss_sum(model_cfg, head, h_last, mbs[last_j][:, 1:])),
                               lambda: (zero, zero))
        keep = lambda v: jnp.where(last_here, v, jnp.zeros_like(v))  # noqa: E731  (the loss is the same everywhere)
        h_in = jax.lax.ppermute(jnp.where(is_last, zero_x, h), "stage", fwd_perm)
        return (fwd.at[row[col["fwd_store"]]].set(h_in), total + keep(loss), count + keep(n)), None

    return slot
