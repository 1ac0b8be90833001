"""Mixture-of-Experts feed-forward: token-choice top-k routing over ``E`` SwiGLU experts.

Router (Shazeer et al. 2017; Fedus et al. 2021, "Switch Transformers"; Lepikhin et al. 2020,
"GShard"): ``s = x W_r`` (fp32), scores ``p = softmax(s)`` or ``sigmoid(s)`` (``gating``); each
token picks its top-``k`` experts; their gates are the picked scores, renormalised to sum to 1
when ``normalize_gates`` (Mixtral/DeepSeek practice).  Output
``y = sum_{e in topk} gate_e * SwiGLU_e(x)  (+ SwiGLU_shared(x))``.

Two dispatch paths:

* **capacity** (``capacity_factor > 0``): expert ``e`` takes at most
  ``C = ceil(capacity_factor * k * N / E)`` of the ``N`` tokens of a sequence batch; slots are
  filled by choice rank, then token order (GShard); tokens past ``C`` are dropped for that
  expert (their gate contributes nothing; the residual stream carries them) and counted in
  ``moe_dropped`` (fraction of the ``k N`` assignments).  Tokens are scattered into an
  ``[E, C, D]`` buffer and gathered back by slot index (memory ``O(N k D)``, not GShard's one-hot
  ``[N, E, C]``); the ``E`` axis of that buffer is what expert parallelism would split.
* **dropless** (``capacity_factor <= 0``): every expert runs on every token and the output keeps
  only the top-``k`` gates.  Exact (nothing is dropped) but ``E/k`` times the expert FLOPs: for
  tests and small models.

Expert parallelism (GShard): with ``expert_shards = S`` over the mesh axis ``expert_axis``, each
device holds ``E/S`` experts; the ``[E, C, D]`` buffer of its tokens is split by expert group and
exchanged with ``lax.all_to_all``, the local experts run on ``S C`` slots, and a second
``all_to_all`` brings the results home.  Capacity is per device (per GShard "group").

Auxiliary losses, both returned per layer and added to the training loss by the model:

* load balance (Switch, eq. 4): ``lb = E * sum_e f_e * P_e`` with ``f_e`` the fraction of the
  ``k N`` assignments that chose ``e`` and ``P_e`` the mean normalised score of ``e``; 1 when
  perfectly balanced;
* router z-loss (Zoph et al. 2022, ST-MoE, eq. 5): ``mean_n logsumexp(s_n)^2``.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from asyncpp_jax.models.layers import MLP, dtype_of

Array = jax.Array


EXPERT_WEIGHTS = ("gate", "up", "down")


def is_expert_weight(path) -> bool:
    """Whether a params-tree path (``tree_util`` keys) is a routed expert's weight ``[..., E, ...]``
    (the axis after the stacked-layer axis); shared experts and the router are not."""
    names = [getattr(k, "key", getattr(k, "name", str(k))) for k in path]
    return len(names) >= 2 and names[-2] == "moe" and names[-1] in EXPERT_WEIGHTS


def with_expert_parallel(cfg: ml_collections.ConfigDict, axis: str, shards: int) -> ml_collections.ConfigDict:
    """A copy of the model config whose MoE layers hold ``E/shards`` experts per ``axis`` index."""
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    cfg.moe.expert_axis, cfg.moe.expert_shards = axis, shards
    return cfg


def capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * top_k * n_tokens / n_experts))


def route(logits: Array, top_k: int, gating: str, normalize_gates: bool):
    """``logits [N, E]`` -> (gates [N, k], expert ids [N, k], normalised scores [N, E])."""
    if gating == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif gating == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"config.model.moe.gating={gating!r} is unknown; choose softmax or sigmoid.")
    gates, idx = jax.lax.top_k(scores, top_k)
    if normalize_gates:
        gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-9)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return gates, idx, probs


def slots(idx: Array, n_experts: int, cap: int):
    """Each assignment's flat slot ``e * C + position`` in the ``[E * C]`` expert buffer, a keep
    mask (``position < C``), and the dropped count.  ``idx``: ``[N, k]`` expert ids.

    Slot order: all first choices in token order, then all second choices, ... (GShard).  Memory
    is ``O(N k E)`` for the running counts and ``O(N k)`` after, never ``O(N^2)``."""
    n, k = idx.shape
    by_rank = jnp.swapaxes(idx, 0, 1).reshape(k * n)  # rank-major order
    onehot = jax.nn.one_hot(by_rank, n_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # slot in its expert's queue
    position = jnp.swapaxes(position.reshape(k, n), 0, 1)  # [N, k]
    keep = position < cap
    return idx * cap + jnp.minimum(position, cap - 1), keep, n * k - jnp.sum(keep)


class MoE(nn.Module):
    """Drop-in for the dense MLP: ``x [B, T, D] -> (y [B, T, D], aux dict of scalars)``."""

    cfg: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, x: Array):
        cfg, mcfg = self.cfg, self.cfg.moe

        dtype, pdtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
        E, k, F, D = mcfg.num_experts, mcfg.top_k, mcfg.expert_d_ff, cfg.d_model
        b, t, _ = x.shape
        tokens = x.reshape(b * t, D)
        n = b * t

        w_router = self.param("router", nn.initializers.normal(cfg.init_std), (D, E), pdtype)
        logits = jnp.dot(tokens.astype(jnp.float32), w_router.astype(jnp.float32))
        gates, idx, probs = route(logits, k, mcfg.gating, mcfg.normalize_gates)

        init = nn.initializers.normal(cfg.init_std)
        out_init = nn.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        # Expert parallelism: inside a shard_map, this device holds experts
        # [s E/S, (s+1) E/S) of its ``expert_axis`` index s; the runner sets both fields on its
        # copy of the model config (they are not user settings).
        axis, S = mcfg.get("expert_axis", ""), mcfg.get("expert_shards", 1)
        if S > 1 and mcfg.capacity_factor <= 0:
            raise ValueError("expert parallelism needs config.model.moe.capacity_factor > 0 (the dropless path "
                             "runs every expert on every token).")
        w_gate = self.param("gate", init, (E // S, D, F), pdtype).astype(dtype)
        w_up = self.param("up", init, (E // S, D, F), pdtype).astype(dtype)
        w_down = self.param("down", out_init, (E // S, F, D), pdtype).astype(dtype)

        experts = functools.partial(_experts, w_gate, w_up, w_down, axis, S)
        if mcfg.capacity_factor > 0:
            y, dropped = _capacity_dispatch(experts, tokens.astype(dtype), gates, idx, E,
                                            capacity(n, E, k, mcfg.capacity_factor))
        else:
            dropped = jnp.zeros((), jnp.int32)
            y = _dropless_dispatch(experts, tokens.astype(dtype), gates, idx, E)
        y = y.reshape(b, t, D).astype(dtype)
        if mcfg.shared_experts:
            shared = ml_collections.ConfigDict(cfg.to_dict())
            shared.d_ff = mcfg.shared_experts * F
            y = y + MLP(shared, name="shared")(x)

        return y, _aux_losses(logits, probs, idx, dropped, E)


def _local_experts(w_gate, w_up, w_down, xe):  # [E/S, C', D] -> [E/S, C', D]
    h = nn.silu(jnp.einsum("ecd,edf->ecf", xe, w_gate)) * jnp.einsum("ecd,edf->ecf", xe, w_up)
    return jnp.einsum("ecf,efd->ecd", h, w_down)


def _experts(w_gate, w_up, w_down, axis: str, S: int, xe):
    """``[E, C, D] -> [E, C, D]``: this device's tokens through all ``E`` experts, of which it holds
    ``E/S``; with ``S > 1`` the slots of the other groups go there and back by ``all_to_all``."""
    if S == 1:
        return _local_experts(w_gate, w_up, w_down, xe)
    E_local = w_gate.shape[0]
    _, cap_, D = xe.shape
    # Send each expert group its slots; receive [S (source), E/S, C, D] for our experts.
    recv = jax.lax.all_to_all(xe.reshape(S, E_local, cap_, D), axis, 0, 0, tiled=True)
    out = _local_experts(w_gate, w_up, w_down, jnp.swapaxes(recv, 0, 1).reshape(E_local, S * cap_, D))
    out = jnp.swapaxes(out.reshape(E_local, S, cap_, D), 0, 1)
    return jax.lax.all_to_all(out, axis, 0, 0, tiled=True).reshape(S * E_local, cap_, D)


def _capacity_dispatch(experts, tokens: Array, gates: Array, idx: Array, E: int, cap: int):
    """Tokens ``[N, D]`` through their top-k experts at capacity ``cap``: ``(y [N, D], dropped count)``.

    The kept assignments are scattered into the ``[E, C, D]`` expert buffer (dropped ones go to a
    discarded row), the experts run, and each token's ``k`` results are gathered back."""
    n, D = tokens.shape
    k = idx.shape[1]
    flat, keep, dropped = slots(idx, E, cap)  # [N, k]
    target = jnp.where(keep, flat, E * cap).reshape(-1)
    src = jnp.repeat(tokens, k, axis=0)
    xe = jnp.zeros((E * cap + 1, D), tokens.dtype).at[target].set(src)[:-1].reshape(E, cap, D)
    ye = experts(xe).reshape(E * cap, D)
    picked = jnp.take(ye, flat.reshape(-1), axis=0).reshape(n, k, D)
    w = jnp.where(keep, gates, 0.0).astype(tokens.dtype)
    return jnp.einsum("nk,nkd->nd", w, picked), dropped


def _dropless_dispatch(experts, tokens: Array, gates: Array, idx: Array, E: int) -> Array:
    """Every expert on every token; the output keeps only each token's top-k gates."""
    n, D = tokens.shape
    dense_gates = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32) * gates[..., None], axis=1)  # [N, E]
    ye = experts(jnp.broadcast_to(tokens, (E, n, D)))
    return jnp.einsum("ne,end->nd", dense_gates.astype(tokens.dtype), ye)


def _aux_losses(logits: Array, probs: Array, idx: Array, dropped: Array, E: int) -> dict:
    """Switch load balance ``E sum_e f_e P_e``, ST-MoE router z-loss, and the dropped fraction."""
    n, k = idx.shape
    assigned = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32), axis=(0, 1)) / (n * k)  # f_e
    return {
        "moe_lb_loss": E * jnp.sum(assigned * jnp.mean(probs, axis=0)),
        "moe_router_z": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "moe_dropped": dropped.astype(jnp.float32) / (n * k),
    }
