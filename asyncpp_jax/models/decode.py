"""Autoregressive decoding with a key/value cache, and sampling (greedy, temperature, top-p).

The decoder of :mod:`asyncpp_jax.models.dense` recomputes every position's keys and values on each
call: generating ``n`` tokens after a prompt of ``T`` costs ``O((T + n)^2)`` layer work.  Here each
layer's keys and values are written once into a cache ``[B, S, n_kv_heads, head_dim]`` of ``S``
positions, and a call on the tokens at positions ``start .. start + t - 1`` computes only those::

    K[:, start:start+t], V[:, start:start+t] = rope(x W_k, pos), x W_v
    attn(q_i) = softmax_j( q_i . K_j / sqrt(hd) ) V_j   over j <= start + i  (the causal mask)

Every other part of a layer (norms, projections, the SwiGLU MLP or the MoE layer, RoPE) is the
model's own module applied to its slice of the params tree, so a cached call computes the same
function as :func:`asyncpp_jax.models.dense.forward`: greedy decoding with the cache equals, token
for token, greedy decoding by re-running the full forward on the growing sequence
(``tests/test_generate.py``).

Mixture-of-experts layers run without a capacity limit here (:func:`inference_config`): a token's
output then does not depend on which other tokens share its call, as in Mixtral's and Qwen2-MoE's
inference, and the cached and full forwards agree.

Sampling (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", for top-p):
``temperature = 0`` is greedy (argmax); otherwise ``p = softmax(logits / temperature)`` restricted
to the smallest set of most probable tokens whose mass reaches ``top_p`` (``top_p = 1``: all),
renormalised.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from asyncpp_jax.models import dense
from asyncpp_jax.models.layers import MLP, RMSNorm, dtype_of, head_dim, rope
from asyncpp_jax.models.moe import MoE

Array = jax.Array


class Sampling(NamedTuple):
    """How to pick each new token."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the most probable tokens up to this mass (1: all)
    seed: int = 0  # the PRNG seed for temperature > 0


def inference_config(model_cfg) -> ml_collections.ConfigDict:
    """``model_cfg`` for inference: no rematerialisation, and MoE layers without a capacity limit
    (every token reaches its top-k experts, whatever else shares its call)."""
    cfg = ml_collections.ConfigDict(model_cfg.to_dict())
    cfg.remat = False
    if dense.uses_moe(cfg):
        cfg.moe.capacity_factor = 0.0
        cfg.moe.expert_shards, cfg.moe.expert_axis = 1, ""
    return cfg


def _blocks(cfg) -> tuple[tuple[str, ...], ...]:
    """Each scanned row's layers as params-tree paths: ``((),)`` for a plain stack, or
    ``(('block_0',), ..., ('block_{every-1}',))`` for MoE groups."""
    if dense.uses_moe(cfg) and cfg.moe.every > 1:
        return tuple((f"block_{i}",) for i in range(cfg.moe.every))
    return ((),)


def init_cache(cfg, batch: int, length: int) -> dict:
    """Zeros for ``length`` positions of keys and values, per layer: ``{'k', 'v'}`` leaves of shape
    ``[rows, B, S, n_kv_heads, head_dim]`` (one pair per block of a scanned row)."""
    shape = (dense.scan_length(cfg), batch, length, cfg.n_kv_heads, head_dim(cfg))
    dtype = dtype_of(cfg.compute_dtype)
    return {"/".join(path) or "layer": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            for path in _blocks(cfg)}


def _dense(cfg, kernel: Array, x: Array) -> Array:
    dtype, pdtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
    layer = nn.Dense(kernel.shape[-1], use_bias=False, dtype=dtype, param_dtype=pdtype)
    return layer.apply({"params": {"kernel": kernel}}, x)


def _cached_attention(cfg, p: dict, x: Array, k_cache: Array, v_cache: Array, start: Array):
    """:class:`asyncpp_jax.models.layers.Attention` on ``x [B, t, D]`` at positions ``start ..
    start + t - 1``, reading earlier keys and values from the cache; returns ``(out, k, v)``."""
    b, t, _ = x.shape
    hd, H, K = head_dim(cfg), cfg.n_heads, cfg.n_kv_heads
    positions = jnp.broadcast_to(start + jnp.arange(t), (b, t))
    q = _dense(cfg, p["q"]["kernel"], x).reshape(b, t, H, hd)
    k = _dense(cfg, p["k"]["kernel"], x).reshape(b, t, K, hd)
    v = _dense(cfg, p["v"]["kernel"], x).reshape(b, t, K, hd)
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
    q = q.reshape(b, t, K, H // K, hd)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k_cache, preferred_element_type=jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(hd))
    # Slots past the newest position hold zeros (or a longer earlier sequence's keys): masked.
    visible = jnp.arange(k_cache.shape[1])[None, :] <= positions[0][:, None]  # [t, S]
    logits = jnp.where(visible[None, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(dtype_of(cfg.compute_dtype))
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v_cache).reshape(b, t, H * hd)
    return _dense(cfg, p["o"]["kernel"], out), k_cache, v_cache


def _block(cfg, p: dict, h: Array, cache: dict, start: Array, moe: bool):
    """One pre-norm layer (:class:`asyncpp_jax.models.dense.Block`) with its cache."""
    dtype, pdtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
    norm = RMSNorm(cfg.norm_eps, dtype, pdtype)
    a, k, v = _cached_attention(cfg, p["attn"], norm.apply({"params": p["attn_norm"]}, h), cache["k"], cache["v"],
                                start)
    h = h + a
    x = norm.apply({"params": p["mlp_norm"]}, h)
    y = MoE(cfg).apply({"params": p["moe"]}, x)[0] if moe else MLP(cfg).apply({"params": p["mlp"]}, x)
    return h + y, {"k": k, "v": v}


def forward_cached(cfg, params: dict, tokens: Array, cache: dict, start: Array):
    """Logits ``[B, t, V]`` (fp32) of ``tokens [B, t]`` at positions ``start ..``, and the cache with
    their keys and values written.  ``cfg`` is an :func:`inference_config`."""
    model = dense.Decoder(cfg)
    h = model.apply({"params": params}, tokens, method=lambda m, x: m.embed(x))
    paths = _blocks(cfg)
    names = ["/".join(path) or "layer" for path in paths]
    every = len(paths)

    def row(h, xs):
        p, c = xs
        out = {}
        for i, (path, name) in enumerate(zip(paths, names)):
            bp = p
            for key in path:
                bp = bp[key]
            h, out[name] = _block(cfg, bp, h, c[name], start, dense.uses_moe(cfg) and i == every - 1)
        return h, out

    h, cache = jax.lax.scan(row, h, (params["layers"], cache))
    return model.apply({"params": params}, h, method=dense.Decoder.logits), cache


def sample(logits: Array, key: Array, temperature, top_p) -> Array:
    """Token ids ``[B]`` from ``logits [B, V]``: argmax where ``temperature`` is 0, else a draw from
    the temperature-scaled distribution cut to its top-``top_p`` mass (module docstring).  Both
    settings may be traced, so one compiled program serves every setting."""
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each
    keep = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: the most probable always stays
    keep = jnp.where(top_p >= 1.0, ordered.shape[-1], keep)  # all, even where the cumsum rounds to 1 early
    threshold = jnp.take_along_axis(ordered, keep - 1, axis=-1)
    drawn = jax.random.categorical(key, jnp.where(scaled >= threshold, scaled, -jnp.inf), axis=-1)
    return jnp.where(temperature <= 0, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)


def bucket_length(n: int, floor: int = 16) -> int:
    """``n`` rounded up to a power of two (at least ``floor``): one compilation per bucket."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


class Generator:
    """``generate(prompts, sampling, stop_ids)`` on fixed parameters; compiled programs are kept
    per (batch, cache length, prompt bucket), so repeated calls do not recompile."""

    def __init__(self, model_cfg, params: dict):
        self.cfg = inference_config(model_cfg)
        self.params = params
        cfg = self.cfg
        self._prefill = jax.jit(lambda p, tokens, cache: forward_cached(cfg, p, tokens, cache, jnp.int32(0)))

        def step(p, token, cache, pos, key, temperature, top_p):
            logits, cache = forward_cached(cfg, p, token[:, None], cache, pos)
            return sample(logits[:, -1], key, temperature, top_p), cache

        self._step = jax.jit(step)
        self._first = jax.jit(sample)

    def generate(self, prompts: list[list[int]], sampling: Sampling, stop_ids=()) -> list[list[int]]:
        """New tokens after each prompt (all of one length; a batch samples independently), at most
        ``sampling.max_new_tokens``, cut after the first of ``stop_ids`` (which is kept)."""
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError("generate() takes non-empty prompts of one length (one prompt repeated for samples)")
        n, b = lengths.pop(), len(prompts)
        padded = bucket_length(n)
        length = bucket_length(padded + sampling.max_new_tokens, 64)
        tokens = np.zeros((b, padded), np.int32)
        tokens[:, :n] = np.asarray(prompts, np.int32)
        # Positions past the prompt get pad tokens' keys now; each is overwritten by the generated
        # token at that position before any query can see it (the causal mask).
        logits, cache = self._prefill(self.params, tokens, init_cache(self.cfg, b, length))
        key = jax.random.key(sampling.seed)
        opts = dict(temperature=jnp.float32(sampling.temperature), top_p=jnp.float32(sampling.top_p))
        out, done = [], np.zeros(b, bool)
        stop = np.asarray(sorted(set(int(s) for s in stop_ids)), np.int64)
        token = None
        for i in range(sampling.max_new_tokens):
            key, sub = jax.random.split(key)
            if token is None:
                token = self._first(logits[:, n - 1], sub, **opts)
            else:
                token, cache = self._step(self.params, token, cache, jnp.int32(n + i - 1), sub, **opts)
            ids = np.asarray(token)
            out.append(np.where(done, -1, ids))
            done |= np.isin(ids, stop)
            if done.all():
                break
        rows = np.stack(out, axis=1) if out else np.zeros((b, 0), np.int64)
        return [[int(t) for t in row if t >= 0] for row in rows]
