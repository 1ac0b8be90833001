"""Llama-style dense decoder (RMSNorm, RoPE, causal GQA, SwiGLU), with stacked layers.

The architecture follows Llama (Touvron et al. 2023) as used by SmolLM2 (Allal et al. 2025):
pre-norm residual blocks ``h = h + Attn(RMSNorm(h)); h = h + MLP(RMSNorm(h))``, rotary position
embeddings (Su et al. 2021), grouped-query attention (Ainslie et al. 2023), a SwiGLU MLP
(Shazeer 2020), no biases, and optionally tied input/output embeddings.

Parameter layout (``params`` of :class:`Decoder`)::

    embed/embedding          [V, D]
    layers/...               every leaf has a leading layer axis of size L
    final_norm/scale         [D]
    lm_head/kernel           [D, V]     (only when embeddings are untied)

The layer stack runs under ``nn.scan`` so compile time does not grow with depth, and any contiguous
slice ``layers[a:b]`` is itself a valid stack for :func:`apply_layers`: that is how the pipeline
engine gives each stage its share of the model.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from asyncpp_jax import configs
from asyncpp_jax.models.layers import MLP, Attention, RMSNorm, dtype_of
from asyncpp_jax.models.moe import MoE

Array = jax.Array

MOE_METRICS = ("moe_lb_loss", "moe_router_z", "moe_dropped")


def no_moe_aux() -> dict:
    return {k: jnp.zeros((), jnp.float32) for k in MOE_METRICS}


class Block(nn.Module):
    """One pre-norm decoder layer, ``(h, positions) -> (h, aux)`` so it scans; ``aux`` holds the
    MoE losses and drop fraction (zeros for a dense layer)."""

    cfg: ml_collections.ConfigDict
    moe: bool = False

    @nn.compact
    def __call__(self, h: Array, positions: Array):
        cfg = self.cfg
        norm = lambda name: RMSNorm(  # noqa: E731
            cfg.norm_eps, dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype), name=name
        )
        h = h + Attention(cfg, name="attn")(norm("attn_norm")(h), positions)
        if self.moe:

            y, aux = MoE(cfg, name="moe")(norm("mlp_norm")(h))
        else:
            y, aux = MLP(cfg, name="mlp")(norm("mlp_norm")(h)), no_moe_aux()
        return h + y, aux


class Group(nn.Module):
    """``moe.every = k`` consecutive layers, the last one MoE: the scanned unit of such a model."""

    cfg: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, h: Array, positions: Array):
        every = self.cfg.moe.every
        total = no_moe_aux()
        for i in range(every):
            h, aux = Block(self.cfg, moe=i == every - 1, name=f"block_{i}")(h, positions)
            total = jax.tree.map(jnp.add, total, aux)
        return h, total


class MoEBlock(Block):
    moe: bool = True


def uses_moe(cfg) -> bool:
    return bool(cfg.get("moe") and cfg.moe.num_experts)


def scan_length(cfg) -> int:
    """Length of the stacked layer axis: ``n_layers``, or ``n_layers / moe.every`` groups."""
    return configs.scanned_units(cfg) if uses_moe(cfg) else cfg.n_layers


def _block_cls(cfg):
    if uses_moe(cfg) and cfg.moe.every > 1:
        cls = Group
    elif uses_moe(cfg):
        cls = MoEBlock
    else:
        cls = Block
    # Rematerialise each layer in the backward pass when asked: memory O(1) layers of activations.
    return nn.remat(cls, prevent_cse=False) if cfg.remat else cls


class Decoder(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, V]`` (fp32)."""

    cfg: ml_collections.ConfigDict

    def setup(self):
        cfg = self.cfg
        pdtype = dtype_of(cfg.param_dtype)
        self.embed = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            embedding_init=nn.initializers.normal(cfg.init_std),
            param_dtype=pdtype,
            dtype=dtype_of(cfg.compute_dtype),
            name="embed",
        )
        self.layers = nn.scan(
            _block_cls(cfg),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=scan_length(cfg),
        )(cfg, name="layers")
        self.final_norm = RMSNorm(cfg.norm_eps, dtype_of(cfg.compute_dtype), pdtype, name="final_norm")
        if not cfg.tie_embeddings:
            self.lm_head = nn.Dense(
                cfg.vocab_size,
                use_bias=False,
                dtype=dtype_of(cfg.compute_dtype),
                param_dtype=pdtype,
                kernel_init=nn.initializers.normal(cfg.init_std),
                name="lm_head",
            )

    def __call__(self, tokens: Array) -> Array:
        return self.forward_with_aux(tokens)[0]

    def forward_with_aux(self, tokens: Array):
        """Logits and the per-layer MoE aux values summed over layers."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        h, aux = self.layers(self.embed(tokens), positions)
        return self.logits(h), jax.tree.map(jnp.sum, aux)

    def logits(self, h: Array) -> Array:
        h = self.final_norm(h)
        flat = h.reshape(-1, h.shape[-1])  # one 2-D matmul (see logits_from_head)
        if self.cfg.tie_embeddings:
            out = self.embed.attend(flat)
        else:
            out = self.lm_head(flat)
        return out.astype(jnp.float32).reshape(*h.shape[:-1], out.shape[-1])



# ---------------------------------------------------------------------------------------------
# Functional entry points on a params tree: what the runners call.  The pipeline engine calls
# embed / apply_layers / logits separately on its stage's slice of the tree.
# ---------------------------------------------------------------------------------------------


def init_params(cfg, rng: Array) -> dict:
    tokens = jnp.zeros((1, 8), jnp.int32)
    return Decoder(cfg).init(rng, tokens)["params"]


def abstract_params(cfg) -> dict:
    """Shapes and dtypes of the parameters, without allocating them."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def count_params(tree) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))


def embed(cfg, params: dict, tokens: Array) -> Array:
    return Decoder(cfg).apply({"params": params}, tokens, method=lambda m, t: m.embed(t))


def apply_layers(cfg, layer_params: dict, h: Array, live: Array | None = None) -> Array:
    """Run a contiguous slice of the layer stack (leading axis = its layers) with ``lax.scan``."""
    return apply_layers_with_aux(cfg, layer_params, h, live)[0]


def apply_layers_with_aux(cfg, layer_params: dict, h: Array, live: Array | None = None):
    """:func:`apply_layers`, also returning the slice's MoE aux values summed over its layers.

    ``live`` (an int, possibly traced): only the first ``live`` rows of the stack are layers; the
    rest are padding (the pipeline engine's uneven split, :func:`asyncpp_jax.pipeline.spmd.engine.pad_layers`).
    Each padded row is skipped (:func:`_skippable`): it computes nothing in the forward or the
    backward, passes ``h`` through, adds no aux, and gets an exactly zero gradient.
    """
    block = _block_cls(cfg)(cfg)
    positions = jnp.broadcast_to(jnp.arange(h.shape[1]), h.shape[:2])

    def body(carry, p):
        return block.apply({"params": p}, carry, positions)

    if live is None:
        h, aux = jax.lax.scan(body, h, layer_params)
        return h, jax.tree.map(jnp.sum, aux)

    layer = _skippable(lambda p, c: body(c, p))
    rows = jax.tree.leaves(layer_params)[0].shape[0]
    h, aux = jax.lax.scan(lambda c, xs: layer(xs[0], c, xs[1] < live), h, (layer_params, jnp.arange(rows)))
    return h, jax.tree.map(jnp.sum, aux)


def _skippable(layer):
    """``layer(p, h) -> (h, aux)`` as ``f(p, h, run) -> (h, aux)`` that computes nothing when ``run``
    is False: ``(h, 0)``, with cotangents ``(0, ct_h)``.

    A plain ``lax.cond`` would do, except that its linearization copies every residual out of the
    branch: under ``lax.scan`` the weights would then be stacked as new residuals instead of
    forwarded (the pipeline engine's kept-residual stash would hold a copy of the stage's weights
    per microbatch), and so would the residuals that depend on neither the weights nor ``h`` (the
    RoPE tables and the causal mask, functions of the positions), which a plain scan computes once
    and shares across its layers.  Here the forward returns the weights ``p`` themselves (forwarded
    by the scan), computes the input-free residuals outside the ``cond`` (hoisted by the scan), and
    only the other residuals come out of the ``cond`` (zeros from a skipped layer); the backward
    rebuilds the layer's vjp from the three, under a ``cond`` too.
    """
    where = {}  # the vjp closure's structure, recorded while tracing

    def layer_v(p, h):  # inside a shard_map both branches must vary over the same mesh axes: the aux as h
        out, aux = layer(p, h)
        return out, varying_like(aux, h)

    def vjp_residuals(p, h):
        """``(out, residuals)``: the vjp closure's leaves other than the weights, each once.  Traced
        with jitted helpers inlined (``jnp.where`` is a ``jit``), so that :func:`_input_free_outputs`
        sees each residual's own dependencies, not those of the ``jit`` call it comes out of."""
        with jax.disable_jit():
            out, vjp_fn = jax.vjp(layer_v, p, h)
        weights = {id(w): i for i, w in enumerate(jax.tree.leaves(p))}
        leaves, where["treedef"] = jax.tree.flatten(vjp_fn)
        kept = {}
        for x in leaves:
            if id(x) not in weights:
                kept.setdefault(id(x), (len(kept), x))
        where["leaves"] = [("w", weights[id(x)]) if id(x) in weights else ("r", kept[id(x)][0]) for x in leaves]
        return out, [x for _, x in kept.values()]

    def split(residuals):
        return [x for x, s in zip(residuals, where["shared"]) if not s]

    def merge(own, shared):
        own, shared = iter(own), iter(shared)
        return [next(shared) if s else next(own) for s in where["shared"]]

    def run(p, h):
        out, residuals = vjp_residuals(p, h)
        own = split(residuals)
        where["avals"] = [jax.typeof(x) for x in own]
        return out, own

    def skip(p, h):
        # lax.cond traces the true branch (``run``) first: its outputs' types are known here.
        return (h, varying_like(no_moe_aux(), h)), [_zeros_as(a) for a in where["avals"]]

    def rebuild(p, residuals):
        weights = jax.tree.leaves(p)
        return jax.tree.unflatten(where["treedef"],
                                  [weights[i] if kind == "w" else residuals[i] for kind, i in where["leaves"]])

    @jax.custom_vjp
    def f(p, h, on):
        return jax.lax.cond(on, layer_v, lambda p, h: (h, varying_like(no_moe_aux(), h)), p, h)

    def f_fwd(p, h, on):
        closed = jax.make_jaxpr(lambda p, h: vjp_residuals(p, h)[1])(p, h)
        where["shared"] = _input_free_outputs(closed)
        shared = _eval_outputs(closed, where["shared"], jax.tree.leaves((p, h)))
        out, own = jax.lax.cond(on, run, skip, p, h)
        return out, (p, on, own, shared)

    def f_bwd(res, ct):
        p, on, own, shared = res
        g_p, g_h = jax.lax.cond(on, lambda p, o, ct: rebuild(p, merge(o, shared))(ct),
                                lambda p, o, ct: (jax.tree.map(jnp.zeros_like, p), ct[0]), p, own, ct)
        return g_p, g_h, None

    f.defvjp(f_fwd, f_bwd)
    return f


def _input_free_outputs(closed) -> list[bool]:
    """For each output of a closed jaxpr: whether it depends on none of its inputs (only on its
    constants, e.g. values captured from an enclosing trace)."""
    from jax.extend.core import Var

    jaxpr = closed.jaxpr
    tainted = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return [not (isinstance(v, Var) and v in tainted) for v in jaxpr.outvars]


def _eval_outputs(closed, which: list[bool], args: list) -> list:
    """The outputs ``which`` of a closed jaxpr, evaluated with only the equations they need."""
    from jax.extend.core import ClosedJaxpr, Var, jaxpr_as_fun

    jaxpr = closed.jaxpr
    outs = [v for v, w in zip(jaxpr.outvars, which) if w]
    need, eqns = {v for v in outs if isinstance(v, Var)}, []
    for eqn in reversed(jaxpr.eqns):
        if any(o in need for o in eqn.outvars):
            eqns.append(eqn)
            need.update(v for v in eqn.invars if isinstance(v, Var))
    pruned = ClosedJaxpr(jaxpr.replace(eqns=eqns[::-1], outvars=outs), closed.consts)
    return list(jaxpr_as_fun(pruned)(*args))


def _zeros_as(aval):
    """Zeros of ``aval``'s shape and dtype, varying over the mesh axes it varies over."""
    z = jnp.zeros(aval.shape, aval.dtype)
    axes = tuple(aval.manual_axis_type.varying) if hasattr(aval, "manual_axis_type") else ()
    return jax.lax.pcast(z, axes, to="varying") if axes else z


def varying_like(tree, like: Array):
    """``tree`` cast to vary over every manual mesh axis ``like`` varies over (a no-op outside a
    ``shard_map``)."""
    axes = tuple(jax.typeof(like).manual_axis_type.varying)

    def one(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def aux_loss(cfg, aux: dict) -> Array:
    """The MoE terms of the training loss: ``lb_coef * sum lb + router_z_coef * sum z`` over layers."""
    if not uses_moe(cfg):
        return jnp.zeros((), jnp.float32)
    return cfg.moe.lb_loss_coef * aux["moe_lb_loss"] + cfg.moe.router_z_loss_coef * aux["moe_router_z"]


def logits_from_hidden(cfg, params: dict, h: Array) -> Array:
    return Decoder(cfg).apply({"params": params}, h, method=Decoder.logits)


def _read_in_compute_dtype(path) -> bool:
    """Whether the model casts this leaf to ``compute_dtype`` before using it: matmul kernels, the
    embedding table and routed experts' weights (norm scales and the MoE router stay fp32)."""
    names = [getattr(k, "key", getattr(k, "name", str(k))) for k in path]
    return names[-1] in ("kernel", "embedding") or (len(names) >= 2 and names[-2] == "moe"
                                                    and names[-1] in ("gate", "up", "down"))


def compute_view(cfg, params: dict) -> dict:
    """``params`` with every leaf the model reads in ``compute_dtype`` already cast to it.

    The model's own casts then return their input unchanged, so a ``jax.vjp`` taken w.r.t. this
    view keeps the weights themselves (not per-call bf16 copies) as residuals, and its gradient,
    cast back to fp32, is exactly the fp32 gradient (the transpose of a cast is the cast back).
    """
    dtype = dtype_of(cfg.compute_dtype)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(dtype) if _read_in_compute_dtype(path) else x, params)


def head_params(cfg, params: dict) -> dict:
    """What the output side reads: ``{'final_norm': ..., 'w': [D, V]}``, with ``w`` the head as a
    ``[D, V]`` matrix (the transposed embedding when tied).  A caller that applies the head to
    many microbatches transposes the embedding once here, not once per call."""
    w = params["embed"]["embedding"].T if cfg.tie_embeddings else params["lm_head"]["kernel"]
    return {"final_norm": params["final_norm"], "w": w}


def grads_from_head(cfg, g_head: dict) -> dict:
    """The gradient of :func:`head_params`' output as a gradient of the params it was read from."""
    if cfg.tie_embeddings:
        return {"final_norm": g_head["final_norm"], "embed": {"embedding": g_head["w"].T}}
    return {"final_norm": g_head["final_norm"], "lm_head": {"kernel": g_head["w"]}}


def logits_from_head(cfg, head: dict, h: Array) -> Array:
    """:meth:`Decoder.logits` from :func:`head_params`: final norm, then ``h @ w`` in
    ``compute_dtype``, logits in fp32."""
    dtype = dtype_of(cfg.compute_dtype)
    norm = RMSNorm(cfg.norm_eps, dtype, dtype_of(cfg.param_dtype))
    h = norm.apply({"params": head["final_norm"]}, h)
    # One 2-D matmul: XLA:CPU runs ``[b, T, D] @ [D, V]`` and its weight gradient (a contraction
    # over two axes) about 1.8x slower than the same product with ``b x T`` flattened to one axis.
    flat = h.reshape(-1, h.shape[-1]).astype(dtype)
    logits = jnp.dot(flat, head["w"].astype(dtype)).astype(jnp.float32)
    return logits.reshape(*h.shape[:-1], logits.shape[-1])


def slice_layers(layer_params: dict, start: int, stop: int) -> dict:
    """Layers ``[start, stop)`` of a stacked layer tree: a stage's share of the model."""
    return jax.tree.map(lambda x: x[start:stop], layer_params)


def forward(cfg, params: dict, tokens: Array) -> Array:
    return Decoder(cfg).apply({"params": params}, tokens)


def cross_entropy(logits: Array, targets: Array, z_loss: float = 0.0):
    """Mean next-token cross-entropy, plus the PaLM z-loss ``z * mean(logsumexp(logits)^2)``.

    Returns ``(total, (ce, z_term))``; ``ce`` is in nats per token.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.mean(lse - target_logit)
    z_term = z_loss * jnp.mean(lse**2) if z_loss else jnp.zeros((), jnp.float32)
    return ce + z_term, (ce, z_term)


def loss_fn(cfg, params: dict, batch: Array):
    """Loss on a packed batch ``[B, T+1]``: inputs ``batch[:, :-1]``, targets ``batch[:, 1:]``.

    Returns ``(total, stats)``: ``total = ce + z_loss + MoE aux terms`` (:func:`aux_loss`), and
    ``stats`` the scalars to log (:func:`loss_stats`).
    """
    logits, aux = Decoder(cfg).apply({"params": params}, batch[:, :-1], method=Decoder.forward_with_aux)
    total, (ce, z) = cross_entropy(logits, batch[:, 1:], cfg.z_loss)
    return total + aux_loss(cfg, aux), loss_stats(cfg, ce, z, aux)


def loss_stats(cfg, ce, z, aux) -> dict:
    """What to log: ``ce``, ``z_loss``; for MoE the aux losses summed over layers (as they enter the
    loss) and ``moe_dropped`` as the mean over MoE layers of the dropped fraction of assignments."""
    stats = {"ce": ce, "z_loss": z}
    if uses_moe(cfg):
        stats.update(aux)
        stats["moe_dropped"] = aux["moe_dropped"] / (cfg.n_layers // cfg.moe.every)
    return stats
