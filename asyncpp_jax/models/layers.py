"""Building blocks shared by the dense decoder and the MoE layer: dtypes, RMSNorm, RoPE, GQA
attention (with its choice of kernel, :func:`attend`) and the SwiGLU MLP.

Kept apart from :mod:`asyncpp_jax.models.dense` so that :mod:`asyncpp_jax.models.moe` (whose
experts are SwiGLU MLPs) and the dense decoder (whose blocks may be MoE) both depend on this
module and not on each other.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.extend.backend
import jax.numpy as jnp
import ml_collections
from jax.experimental.pallas.ops.tpu import splash_attention
from jax.sharding import PartitionSpec as P

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


SPLASH_BLOCK_MULTIPLE = 128  # splash's blocks are multiples of a TPU vreg's 128 lanes


def attend(q: Array, k: Array, v: Array, positions: Array, kernel: str) -> Array:
    """Causal grouped-query softmax attention, by the kernel ``config.model.attention`` names.

    ``q``: [B, T, N, d]; ``k``, ``v``: [B, T, K, d] with ``N % K == 0``; query head ``h`` reads K/V
    head ``h // (N / K)``, never a repeated copy.  Returns [B, T, N, d]:

        out[b, t, h] = sum_{s <= t} softmax_s(q[b, t, h] . k[b, s, h // G] / sqrt(d)) v[b, s, h // G]

    Kernels (each the same function; only the memory and the speed differ):

    - ``xla``: two einsums around an fp32 softmax (:func:`xla_attention`); it builds the
      [B, K, G, T, T] fp32 logits.  The reference the others are tested against.
    - ``dot_product``: ``jax.nn.dot_product_attention(is_causal=True)``, cuDNN's fused flash
      kernel on a CUDA GPU where cuDNN takes the shape (:func:`cudnn_fits`), XLA's own otherwise.
    - ``splash``: Pallas's splash attention (:func:`splash_attention_kernel`), TPU's fused kernel,
      run by Pallas's interpreter on other platforms (exact, and slow).
    - ``auto``: chosen by the platform the step is lowered for (``lax.platform_dependent``, so a
      step exported for ``tpu`` from a CPU host holds splash): ``splash`` on ``tpu`` when T is a
      multiple of 128 (else ``dot_product``), ``dot_product`` on ``cuda``, ``xla`` elsewhere (on
      CPU both of the others are XLA's einsums too, and ``xla`` keeps every CPU record bit for bit).
    """
    if kernel == "auto":
        t = q.shape[1]
        on = {"xla": lambda q, k, v: xla_attention(q, k, v, positions), "dot_product": dot_product_attention,
              "splash": splash_attention_kernel}
        return jax.lax.platform_dependent(q, k, v, tpu=on[auto_kernel("tpu", t)], cuda=on[auto_kernel("cuda", t)],
                                          default=on[auto_kernel("cpu", t)])
    if kernel == "xla":
        return xla_attention(q, k, v, positions)
    if kernel == "dot_product":
        return dot_product_attention(q, k, v)
    if kernel == "splash":
        return jax.lax.platform_dependent(q, k, v, tpu=splash_attention_kernel,
                                          default=functools.partial(splash_attention_kernel, interpret=True))
    raise ValueError(f"config.model.attention={kernel!r} is not one of auto, xla, dot_product, splash.")


def auto_kernel(platform: str, seq_len: int) -> str:
    """The kernel ``attention='auto'`` runs on ``platform`` (a lowering platform: cpu, cuda, rocm,
    tpu) at sequence length ``seq_len``: see :func:`attend`."""
    if platform == "tpu":
        return "splash" if seq_len % SPLASH_BLOCK_MULTIPLE == 0 else "dot_product"
    return "dot_product" if platform == "cuda" else "xla"


def is_fused(kernel: str, platform: str, seq_len: int, compute_dtype: str, head_dim: int,
             cuda_flash: bool = True) -> bool:
    """Whether ``kernel`` on ``platform`` runs blockwise, holding no [T, T] scores: splash (on a
    TPU, or interpreted), or ``dot_product`` where it becomes cuDNN's flash kernel (a CUDA GPU with
    flash attention, ``cuda_flash``, and the shapes of :func:`cudnn_fits`)."""
    kernel = auto_kernel(platform, seq_len) if kernel == "auto" else kernel
    if kernel == "splash":
        return True
    return (kernel == "dot_product" and platform == "cuda" and cuda_flash
            and compute_dtype in ("bfloat16", "float16") and head_dim % 8 == 0 and head_dim <= 128)


def memory_stand_in(kernel: str, platform: str, seq_len: int, compute_dtype: str, head_dim: int,
                    cuda_flash: bool = True) -> str:
    """The kernel whose XLA:CPU compile has the memory of ``kernel``'s on ``platform``: interpreted
    splash for a fused kernel (blockwise: block-sized temporaries, and for the backward at most q,
    k, v, the output and its row statistics), the einsum path otherwise.  At a length splash's blocks do not divide
    it is the einsum path, an over-estimate of a fused kernel's memory."""
    fused = is_fused(kernel, platform, seq_len, compute_dtype, head_dim, cuda_flash)
    return "splash" if fused and seq_len % SPLASH_BLOCK_MULTIPLE == 0 else "xla"


def xla_attention(q: Array, k: Array, v: Array, positions: Array) -> Array:
    """:func:`attend` as two einsums: fp32 logits [B, K, G, T, T], masked where the key's position
    is after the query's, an fp32 softmax, then probabilities (in the compute dtype) times V."""
    b, t, n, hd = q.shape
    kv_heads = k.shape[2]
    # GQA: group query heads over their shared KV head instead of materialising repeated K/V.
    q = q.reshape(b, t, kv_heads, n // kv_heads, hd)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(hd))
    causal = positions[:, None, None, :, None] >= positions[:, None, None, None, :]
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, t, n, hd)


def cudnn_fits(q: Array) -> bool:
    """Whether cuDNN's flash attention takes ``q`` here: a CUDA backend (the kernel cannot even be
    traced without cuDNN) of compute capability 8.0 or more, a 16-bit dtype, and a head dimension
    that is a multiple of 8 and at most 128 (the limit before Hopper; jax's
    ``check_is_flash_attention``)."""
    if jax.default_backend() != "gpu" or "cuda" not in jax.extend.backend.get_backend().platform_version.lower():
        return False
    ampere = float(getattr(jax.devices()[0], "compute_capability", "0")) >= 8.0  # flash needs sm80+
    return ampere and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128


def dot_product_attention(q: Array, k: Array, v: Array) -> Array:
    """:func:`attend` by ``jax.nn.dot_product_attention``, which takes the K/V heads as they are."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation="cudnn" if cudnn_fits(q) else "xla")


def splash_block(seq_len: int) -> int:
    """Splash's block size along the sequence: the largest of 512, 256, 128 dividing T."""
    if seq_len % SPLASH_BLOCK_MULTIPLE:
        raise ValueError(f"splash attention needs a sequence length that is a multiple of {SPLASH_BLOCK_MULTIPLE}, "
                         f"not {seq_len}: set config.data.seq_len to one, or config.model.attention='auto'.")
    return math.gcd(seq_len, 4 * SPLASH_BLOCK_MULTIPLE)


def splash_attention_kernel(q: Array, k: Array, v: Array, interpret: bool = False) -> Array:
    """:func:`attend` by Pallas's splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``,
    as MaxText runs it): a causal ``CausalMask`` per query head, GQA through the kernel's own
    ``num_q_heads % num_kv_heads`` grouping, one kernel call per sequence (``vmap`` over B).
    The kernel does not scale the logits, so ``q`` is scaled by ``1/sqrt(d)`` first."""
    _, t, n, hd = q.shape
    block = splash_block(t)
    sizes = splash_attention.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
        block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = splash_attention.MultiHeadMask([splash_attention.CausalMask((t, t)) for _ in range(n)])
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 - [B, T, H, d] <-> [B, H, T, d]

    def call(q, k, v):
        # Built in the trace that calls it: the kernel holds its mask's block tables as arrays.
        kernel = splash_attention.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                                  interpret=interpret)
        q = q * jnp.asarray(1.0 / math.sqrt(hd), q.dtype)
        return heads_first(jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v)))

    if jax.sharding.get_abstract_mesh().manual_axes:
        return _outside_vma_checks(call)(q, k, v)
    return call(q, k, v)


def _outside_vma_checks(fn):
    """``fn(q, k, v) -> out`` for a body of a checked ``shard_map`` (every runner's), with the
    same derivative.

    A Pallas kernel's outputs do not say over which mesh axes they vary, which a ``shard_map``
    with ``check_vma=True`` refuses.  So the kernel, and its vjp, run inside a nested
    ``shard_map`` over no new axes with the checks off, and their results are marked as varying
    over the axes ``q`` varies over.  The derivative is spelled out (``custom_vjp``): transposing
    the nested ``shard_map`` would treat the results as the same on every device.  The backward
    keeps only ``q, k, v`` and runs the kernel's forward again for its vjp (its residuals cannot
    cross between the two traces): one more attention forward per layer, no T x T buffer.
    """
    def unchecked(f):
        # Under check_vma=False an op's result has no varying axes in its type, as the kernel's
        # outputs have none; ``x + 0`` gives every input that type too, so that the vjp traced
        # inside agrees with itself.
        def body(*args):
            return f(*jax.tree.map(lambda x: x + jnp.zeros((), x.dtype), args))

        return jax.shard_map(body, in_specs=P(), out_specs=P(), axis_names=set(), check_vma=False)

    def varying_like(x, like):
        axes = tuple(sorted(jax.typeof(like).manual_axis_type.varying - jax.typeof(x).manual_axis_type.varying))
        return jax.lax.pcast(x, axes, to="varying") if axes else x

    def forward(q, k, v):
        return varying_like(unchecked(fn)(q, k, v), q), (q, k, v)

    def backward(qkv, ct):
        grads = unchecked(lambda q, k, v, ct: jax.vjp(fn, q, k, v)[1](ct))(*qkv, ct)
        return tuple(varying_like(g, ct) for g in grads)

    @jax.custom_vjp
    def call(q, k, v):
        return forward(q, k, v)[0]

    call.defvjp(forward, backward)
    return call


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
        # The kernel holds no parameters; initialising through the reference lets any length init.
        kernel = "xla" if self.is_initializing() else cfg.attention
        out = attend(q, k, v, positions, kernel).reshape(b, t, cfg.n_heads * hd)
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
