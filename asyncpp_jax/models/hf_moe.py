"""MoE runs out as Hugging Face Mixtral or Qwen2-MoE checkpoints (export only).

The MoE layer of :mod:`asyncpp_jax.models.moe` with softmax gating is the sparse block of two
``transformers`` architectures:

* **Mixtral** (``MixtralForCausalLM``; Jiang et al. 2024): every layer is MoE, no shared expert,
  the top-k softmax scores renormalised to sum to 1.  Chosen when ``moe.shared_experts = 0``,
  ``moe.every = 1`` and ``moe.normalize_gates``.
* **Qwen2-MoE** (``Qwen2MoeForCausalLM``): MoE on every ``decoder_sparse_step``-th layer (our
  ``moe.every``: layer ``i`` is MoE when ``(i + 1) % every == 0``, the dense layers use
  ``d_ff``), ``norm_topk_prob`` = ``moe.normalize_gates``, and a shared expert whose output is
  scaled by ``sigmoid(x W_g)``.  Ours has no such gate (scale 1): the export writes ``W_g = 0``
  (``sigmoid(0) = 1/2``) and the shared expert's down projection doubled, exactly the same function
  (both factors are powers of two).  Its attention has q/k/v biases (``qkv_bias``): written as zeros.
  Chosen when ``moe.shared_experts > 0``.

Anything else (sigmoid gating; no shared expert with ``every > 1`` or unnormalised gates) has no
counterpart in either and is refused by :func:`architecture` with the settings named.

Tensors (Mixtral's and Qwen2-MoE's per-expert layout, which ``transformers`` 4.57 loads as is and
5.x converts on load), per layer ``l`` on top of the Llama names of :mod:`asyncpp_jax.models.hf_llama`::

    mixtral    model.layers.{l}.block_sparse_moe.gate.weight             [E, D]   moe/router [D, E] (.T)
               model.layers.{l}.block_sparse_moe.experts.{j}.w1.weight   [F, D]   moe/gate[j] (.T)
               model.layers.{l}.block_sparse_moe.experts.{j}.w3.weight   [F, D]   moe/up[j] (.T)
               model.layers.{l}.block_sparse_moe.experts.{j}.w2.weight   [D, F]   moe/down[j] (.T)
    qwen2_moe  model.layers.{l}.mlp.gate.weight                          [E, D]   moe/router (.T)
               model.layers.{l}.mlp.experts.{j}.{gate,up,down}_proj.weight        moe/{gate,up,down}[j] (.T)
               model.layers.{l}.mlp.shared_expert.{gate,up,down}_proj.weight      moe/shared/... (.T; down x2)
               model.layers.{l}.mlp.shared_expert_gate.weight            [1, D]   zeros
               model.layers.{l}.mlp.{gate,up,down}_proj.weight (dense layers)     mlp/... (.T)

The exported model routes every token to its top-k experts without a capacity limit (as both
``transformers`` implementations do, and as this project's generation and evaluation do).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from asyncpp_jax.models import hf_llama
from asyncpp_jax.models.hf_llama import HFCheckpointError

MIXTRAL, QWEN2_MOE = "mixtral", "qwen2_moe"


def uses_moe(model_cfg) -> bool:
    return bool(model_cfg.get("moe") and model_cfg.moe.num_experts)
ARCHITECTURES = {MIXTRAL: "MixtralForCausalLM", QWEN2_MOE: "Qwen2MoeForCausalLM"}


def architecture(model_cfg) -> str:
    """``'mixtral'`` or ``'qwen2_moe'`` for ``config.model`` (module docstring), or an
    :class:`HFCheckpointError` naming the settings with no Hugging Face counterpart."""
    moe = model_cfg.moe
    errs = []
    if moe.gating != "softmax":
        errs.append(f"config.model.moe.gating={moe.gating!r} (Mixtral and Qwen2-MoE route by softmax)")
    if not moe.shared_experts:
        if moe.every != 1:
            errs.append(f"config.model.moe.every={moe.every} without shared experts (Mixtral has an MoE layer in "
                        "every layer; Qwen2-MoE, which has sparse steps, always has a shared expert)")
        if not moe.normalize_gates:
            errs.append("config.model.moe.normalize_gates=False without shared experts (Mixtral always "
                        "renormalises the top-k gates)")
    if errs:
        raise HFCheckpointError("this MoE run has no Hugging Face counterpart: " + "; ".join(errs) + ".")
    return QWEN2_MOE if moe.shared_experts else MIXTRAL


def hf_config(model_cfg, max_position_embeddings: int, eos_token_id: int | None = None,
              bos_token_id: int | None = None, torch_dtype: str = "float32") -> dict:
    """The ``config.json`` of the Mixtral or Qwen2-MoE model that computes ``config.model``."""
    arch, moe = architecture(model_cfg), model_cfg.moe
    llama = hf_llama.hf_config(model_cfg, max_position_embeddings, eos_token_id, bos_token_id, torch_dtype)
    common = {k: llama[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
                                    "rms_norm_eps", "rope_theta", "tie_word_embeddings", "attention_dropout",
                                    "initializer_range", "bos_token_id", "eos_token_id", "torch_dtype", "use_cache")}
    common.update(architectures=[ARCHITECTURES[arch]], model_type=arch, num_experts_per_tok=int(moe.top_k),
                  router_aux_loss_coef=float(moe.lb_loss_coef), output_router_logits=False)
    if arch == MIXTRAL:
        return {**common, "intermediate_size": int(moe.expert_d_ff), "num_local_experts": int(moe.num_experts),
                "sliding_window": None, "router_jitter_noise": 0.0}
    return {**common, "intermediate_size": int(model_cfg.d_ff), "num_experts": int(moe.num_experts),
            "moe_intermediate_size": int(moe.expert_d_ff),
            "shared_expert_intermediate_size": int(moe.shared_experts * moe.expert_d_ff),
            "decoder_sparse_step": int(moe.every), "norm_topk_prob": bool(moe.normalize_gates),
            "mlp_only_layers": [], "qkv_bias": True, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": int(model_cfg.n_layers)}


def hf_tensors(model_cfg, params: dict, dtype=np.float32) -> list[tuple[str, tuple, np.dtype, Callable]]:
    """``(HF name, shape, dtype, make)`` for every tensor of the export of ``params`` (the model's
    layout: ``layers`` stacked by rows of ``moe.every`` layers), each made on demand."""
    arch, moe, dtype = architecture(model_cfg), model_cfg.moe, np.dtype(dtype)
    out: list = []

    def add(name, leaf, index=(), transposed=False, scale=1.0):
        """``leaf[index]``, sliced only when made (the caller's parameters are never copied whole)."""
        shape = tuple(leaf.shape[len(index):])
        shape = tuple(reversed(shape)) if transposed else shape

        def make():
            x = np.asarray(leaf[index] if index else leaf)
            x = np.ascontiguousarray(x.T if transposed else x, dtype=dtype)
            return x * dtype.type(scale) if scale != 1.0 else x

        out.append((name, shape, dtype, make))

    add("model.embed_tokens.weight", params["embed"]["embedding"])
    add("model.norm.weight", params["final_norm"]["scale"])
    if not model_cfg.tie_embeddings:
        add("lm_head.weight", params["lm_head"]["kernel"], transposed=True)
    every = moe.every
    for l in range(model_cfg.n_layers):
        row, i = divmod(l, every)
        block = params["layers"] if every == 1 else params["layers"][f"block_{i}"]
        p = f"model.layers.{l}."
        add(p + "input_layernorm.weight", block["attn_norm"]["scale"], (row,))
        add(p + "post_attention_layernorm.weight", block["mlp_norm"]["scale"], (row,))
        for ours in "qkvo":
            kernel = block["attn"][ours]["kernel"]
            add(p + f"self_attn.{ours}_proj.weight", kernel, (row,), transposed=True)
            if arch == QWEN2_MOE and ours != "o":
                add(p + f"self_attn.{ours}_proj.bias", np.zeros(kernel.shape[-1], np.float32))
        if i != every - 1:  # a dense layer of a Qwen2-MoE group
            for w in ("gate", "up", "down"):
                add(p + f"mlp.{w}_proj.weight", block["mlp"][w]["kernel"], (row,), transposed=True)
            continue
        m = block["moe"]
        sparse = p + ("block_sparse_moe." if arch == MIXTRAL else "mlp.")
        add(sparse + "gate.weight", m["router"], (row,), transposed=True)
        names = {"gate": "w1", "up": "w3", "down": "w2"} if arch == MIXTRAL else \
            {w: f"{w}_proj" for w in ("gate", "up", "down")}
        for j in range(moe.num_experts):
            for w, hf in names.items():
                add(sparse + f"experts.{j}.{hf}.weight", m[w], (row, j), transposed=True)
        if arch == QWEN2_MOE:
            for w in ("gate", "up", "down"):  # the HF gate sigmoid(0) = 1/2 is undone by doubling down
                add(sparse + f"shared_expert.{w}_proj.weight", m["shared"][w]["kernel"], (row,), transposed=True,
                    scale=2.0 if w == "down" else 1.0)
            add(sparse + "shared_expert_gate.weight", np.zeros((1, model_cfg.d_model), np.float32))
    return out


def write_checkpoint(directory: str, model_cfg, params: dict, max_position_embeddings: int,
                     eos_token_id: int | None = None, bos_token_id: int | None = None,
                     dtype: str = "float32", max_shard_bytes: int = hf_llama.SHARD_BYTES) -> list[str]:
    """Write ``params`` of an MoE model as a Mixtral or Qwen2-MoE directory; returns the weight files."""
    np_dtype = hf_llama.np_dtype_of(dtype)
    cfg = hf_config(model_cfg, max_position_embeddings, eos_token_id, bos_token_id, dtype)
    return hf_llama.write_directory(directory, hf_tensors(model_cfg, params, np_dtype), cfg, max_shard_bytes)
