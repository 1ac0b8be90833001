"""Vocabulary parallelism over ``stage``: each device holds ``V / P`` of every vocabulary-sized
table, and the lookup and the head's loss run as collectives over ``stage``.

Device ``s`` holds the vocabulary block ``[s V/P, (s+1) V/P)``: columns of the head's ``[D, V]``
matrix (a tied table is held in that layout, :func:`asyncpp_jax.pipeline.layout.to_engine_layout`)
and rows of an untied ``[V, D]`` embedding.  Its weight versions, its compute-dtype casts, its
gradient accumulators and its optimizer state are those blocks too, so no device holds a whole
vocabulary-sized tensor and every device holds the same ``1/P`` of each (Yeung et al. 2024,
"Balancing Pipeline Parallelism with Vocabulary Parallelism").  In one SPMD program every device
has the same shapes, so this, not "the table on stage 0 only", is how a middle stage stops holding
whole tables; it also spreads the head's matmuls, which otherwise fall on the last stage alone.

* **Lookup** (:func:`lookup`): each device gathers the rows of the tokens in its block (zeros for
  the rest) and a ``psum`` over ``stage`` assembles the embedding: exact, as each token's row comes
  from one device and the others add zeros.
* **Its transpose** (:func:`lookup_transpose_add`): the first stage's input cotangent, broadcast
  over ``stage``, is added by each device to the rows of its own block's tokens.
* **Head and loss** (:func:`head_loss_grads`): the last stage's block output ``h`` is broadcast;
  each device applies the final norm and its ``[D, V/P]`` block of the head, and the cross-entropy
  with the PaLM z-loss is assembled from per-device partial sums (Megatron's vocab-parallel
  cross-entropy, Shoeybi et al. 2019)::

      m   = pmax_s max_v z_sv                  (stability only; cancels exactly)
      lse = m + log psum_s sum_v exp(z_sv - m)
      y   = psum_s z_s[target]                 (the device whose block holds the target)
      L   = mean(lse - y) + zeta mean(lse^2)
      dL/dz_sv = (exp(z_sv - lse) (1 + 2 zeta lse) - 1[v = target]) / N

  The head's and the norm's input cotangents are linear in ``dL/dz``, so each device's share is
  summed over ``stage``; each device keeps its block's weight gradient.

Every function here runs inside the engine's ``shard_map`` on every device of ``stage`` (the
collectives need all of them): the caller masks what a stage that did not use a value adds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asyncpp_jax.models import dense
from asyncpp_jax.pipeline import stage
from asyncpp_jax.pipeline.collectives import vary

Array = jax.Array


def block_start(v_local: int):
    """This device's first vocabulary id (traced)."""
    return jax.lax.axis_index("stage") * v_local


def _local_ids(tokens: Array, v_local: int):
    """``(ids, inside)``: each token's index in this device's block (``v_local`` when outside it,
    an index that a ``mode='drop'`` scatter drops and a ``mode='fill'`` gather fills with zeros)."""
    ids = tokens - block_start(v_local)
    inside = (ids >= 0) & (ids < v_local)
    return jnp.where(inside, ids, v_local), inside


def lookup(cfg, top_local: dict, tokens: Array) -> Array:
    """``dense.embed`` of ``tokens`` from vocabulary blocks: each device gathers its block's rows
    (columns of a tied ``[D, V/P]`` table), zeros elsewhere, and a ``psum`` over ``stage`` joins
    them.  The result is the same on every device."""
    dtype = dense.dtype_of(cfg.compute_dtype)
    if cfg.tie_embeddings:
        table = top_local["embed"]["embedding"].astype(dtype)  # [D, V/P]
        ids, _ = _local_ids(tokens, table.shape[1])
        part = jnp.moveaxis(jnp.take(table, ids, axis=1, mode="fill", fill_value=0), 0, -1)
    else:
        table = top_local["embed"]["embedding"].astype(dtype)  # [V/P, D]
        ids, _ = _local_ids(tokens, table.shape[0])
        part = jnp.take(table, ids, axis=0, mode="fill", fill_value=0)
    # Exact in any dtype: each token's row comes from one device, the others add zeros.
    return jax.lax.psum(part, "stage")


def lookup_transpose_add(acc, tokens: Array, ct: Array, i, axis: int, tied: bool):
    """``acc[i] += (d lookup / d block)^T ct`` for this device's block: ``ct`` (``[b, T, D]``, the
    same on every device) added to the rows (columns of a tied ``[D, n, V/P]`` accumulator) of
    the tokens in the block; the others are dropped.  ``axis``: the accumulator axis."""
    ids, _ = _local_ids(tokens, stage.table_size(acc, tied, i, axis))  # this device's V/P
    return stage.lookup_transpose_add(acc, ids, ct, tied, i, axis)


def _lse_and_target(logits: Array, targets: Array):
    """``(local ids, logsumexp, target logit)`` over the whole vocabulary from this device's
    block of fp32 logits ``[..., V/P]``: the last two the same on every device."""
    ids, inside = _local_ids(targets, logits.shape[-1])
    m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), "stage")
    lse = m + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(logits - m[..., None]), axis=-1), "stage"))
    mine = jnp.take_along_axis(logits, jnp.minimum(ids, logits.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    return ids, lse, jax.lax.psum(jnp.where(inside, mine, 0.0), "stage")


def head_loss_grads(cfg, head_local: dict, h: Array, targets: Array, ct):
    """The final norm, this device's head block and the whole vocabulary's loss of one
    microbatch, with their gradients (see the module docstring).

    ``head_local``: ``{'final_norm', 'w': [D, V/P]}`` in ``compute_dtype`` (:func:`stage.head_of`);
    ``h``: the block output ``[b, T, D]``, the same on every device; ``ct``: the loss's cotangent
    (``1/M``).  Returns ``(loss, stats, g_head, g_h)``: the loss (``ce + z``), its statistics as
    :meth:`StageFns._head_loss`, the gradient of ``head_local`` (the norm's summed over ``stage``,
    the same on every device; ``w``'s this device's block) and the cotangent of ``h`` (summed over
    ``stage``).  Each device's logits are its ``[b T, V/P]`` block only."""
    # Differentiated as device-varying: a vjp with respect to a value invariant over ``stage``
    # would sum its cotangent over ``stage`` itself, and the sums below would count it P times.
    logits, vjp_fn = jax.vjp(lambda hp, x: dense.logits_from_head(cfg, hp, x), vary(head_local), vary(h))
    n = targets.size
    ids, lse, target_logit = _lse_and_target(logits, targets)
    ce = jnp.mean(lse - target_logit)
    z = cfg.z_loss * jnp.mean(lse**2) if cfg.z_loss else jnp.zeros((), jnp.float32)
    scale = (1.0 + 2.0 * cfg.z_loss * lse) if cfg.z_loss else jnp.ones_like(lse)
    onehot = jax.nn.one_hot(ids, logits.shape[-1], dtype=jnp.float32)  # all zero outside the block
    g_logits = (jnp.exp(logits - lse[..., None]) * scale[..., None] - onehot) * (ct / n)
    g_head, g_h = vjp_fn(g_logits)
    g_head = {"final_norm": jax.lax.psum(g_head["final_norm"], "stage"), "w": g_head["w"]}
    g_h = jax.lax.psum(g_h.astype(jnp.float32), "stage").astype(h.dtype)
    loss = ce + z
    stats = {"loss": loss, "ce": ce, "z_loss": z, "count": jnp.ones((), jnp.float32)}
    return loss, vary(stats), g_head, g_h


def head_loss_sum(cfg, head_local: dict, h: Array, targets: Array):
    """``(sum over tokens of lse - target logit, token count)`` of one microbatch (the eval's
    loss), from vocabulary blocks as :func:`head_loss_grads`."""
    _, lse, target_logit = _lse_and_target(dense.logits_from_head(cfg, head_local, h), targets)
    return jnp.sum(lse - target_logit), jnp.float32(targets.size)
