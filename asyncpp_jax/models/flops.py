"""Model FLOPs per token, for throughput and MFU reports.

``6 N + 12 L T d_attn`` per token (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B):
``N`` counts the parameters a token actually multiplies (the embedding lookup does no matmul; a
tied embedding still does the output projection; of an MoE layer's ``E`` experts only the ``k``
routed ones, plus the router and any shared experts), ``6`` is forward + backward, and the
attention term is the score and value matmuls over a context of ``T`` (not halved for the causal
mask, as in PaLM).  Recomputation (remat, the pipeline's recomputed forward) is not counted:
this is model FLOPs, not hardware FLOPs.
"""

from __future__ import annotations

from asyncpp_jax.models import dense, layers


def active_matmul_params(cfg) -> int:
    """Parameters in the matmuls one token goes through."""
    shapes = dense.abstract_params(cfg)
    total = dense.count_params(shapes)
    embed = cfg.vocab_size * cfg.d_model
    n = total - embed  # the lookup is free ...
    n += embed if cfg.tie_embeddings else 0  # ... but a tied table is also the output projection
    if dense.uses_moe(cfg):
        m = cfg.moe
        moe_layers = cfg.n_layers // m.every
        experts = moe_layers * m.num_experts * 3 * cfg.d_model * m.expert_d_ff
        n -= experts * (m.num_experts - m.top_k) // m.num_experts
    return n


def flops_per_token(cfg, seq_len: int) -> float:
    d_attn = cfg.n_heads * layers.head_dim(cfg)
    return 6.0 * active_matmul_params(cfg) + 12.0 * cfg.n_layers * seq_len * d_attn
