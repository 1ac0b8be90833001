"""Building blocks shared by the dense decoder and the MoE layer: dtypes, RMSNorm, RoPE, GQA
attention and the SwiGLU MLP.

Kept apart from :mod:`asyncpp_jax.models.dense` so that :mod:`asyncpp_jax.models.moe` (whose
experts are SwiGLU MLPs) and the dense decoder (whose blocks may be MoE) both depend on this
module and not on each other.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

Array = jax.Array

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    return _DTYPES[name]


@jax.custom_vjp
def scale_last(y: Array, scale: Array) -> Array:
    """``y * scale`` over the last axis, with the autodiff rule JAX derives for it, except that
    the backward keeps ``scale`` itself rather than its broadcast: the residual of a stacked
    layer's norm is then its weight row, which a kept-residual pipeline stash reads back from the
    weights instead of storing (``pipeline.stage.ResidualTemplate``)."""
    return y * scale


def _scale_last_fwd(y, scale):
    return y * scale, (y, scale)


def _scale_last_bwd(res, g):
    y, scale = res
    return g * scale, jnp.sum(g * y, axis=tuple(range(g.ndim - 1)))


scale_last.defvjp(_scale_last_fwd, _scale_last_bwd)


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * scale`` (Zhang & Sennrich 2019); statistics in fp32."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale_last(y, scale.astype(jnp.float32)).astype(self.dtype)


def rope(x: Array, positions: Array, theta: float) -> Array:
    """Rotary embedding (Su et al. 2021), half-split convention as in Llama/HF.

    ``x``: [..., T, H, d] with d even; ``positions``: [..., T].  Pair ``(x_i, x_{i+d/2})`` is rotated
    by angle ``pos * theta^(-2i/d)``.
    """
    d = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angles = positions[..., :, None].astype(jnp.float32) * inv_freq  # [..., T, d/2]
    sin = jnp.sin(angles)[..., None, :]
    cos = jnp.cos(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention: ``n_heads`` query heads share ``n_kv_heads`` K/V heads."""

    cfg: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, x: Array, positions: Array) -> Array:
        cfg = self.cfg
        dtype, pdtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
        hd = head_dim(cfg)
        init = nn.initializers.normal(cfg.init_std)
        dense = lambda feats, name, std_init=init: nn.Dense(  # noqa: E731
            feats, use_bias=False, dtype=dtype, param_dtype=pdtype, kernel_init=std_init, name=name
        )
        b, t, _ = x.shape
        q = dense(cfg.n_heads * hd, "q")(x).reshape(b, t, cfg.n_heads, hd)
        k = dense(cfg.n_kv_heads * hd, "k")(x).reshape(b, t, cfg.n_kv_heads, hd)
        v = dense(cfg.n_kv_heads * hd, "v")(x).reshape(b, t, cfg.n_kv_heads, hd)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        # GQA: group query heads over their shared KV head instead of materialising repeated K/V.
        groups = cfg.n_heads // cfg.n_kv_heads
        q = q.reshape(b, t, cfg.n_kv_heads, groups, hd)
        logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
        logits = logits / jnp.sqrt(jnp.float32(hd))
        causal = positions[:, None, None, :, None] >= positions[:, None, None, None, :]
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, t, cfg.n_heads * hd)
        # Scaled init of the residual output projection (GPT-2 / OLMo practice): std / sqrt(2 L).
        out_init = nn.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        return dense(cfg.d_model, "o", out_init)(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    cfg: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        dtype, pdtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
        init = nn.initializers.normal(cfg.init_std)
        out_init = nn.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        kw = dict(use_bias=False, dtype=dtype, param_dtype=pdtype)
        gate = nn.Dense(cfg.d_ff, kernel_init=init, name="gate", **kw)(x)
        up = nn.Dense(cfg.d_ff, kernel_init=init, name="up", **kw)(x)
        return nn.Dense(cfg.d_model, kernel_init=out_init, name="down", **kw)(nn.silu(gate) * up)


def head_dim(cfg) -> int:
    return cfg.head_dim if cfg.get("head_dim") else cfg.d_model // cfg.n_heads
