"""A layer stack's backward split into its input-gradient half and its weight-gradient half.

Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism") run a stage's backward
as two actions: ``I``, which computes the cotangent of the stage's input (on the critical path: the
previous stage waits for it), and ``W``, which computes the weights' gradient later, in what would
otherwise be bubble.  For a linear map ``y = x A``, ``I`` is ``dx = dy A^T`` and ``W`` is
``dA = x^T dy``: ``W`` needs the map's input ``x`` and its output cotangent ``dy``, which ``I``
computes on its way to ``dx``.

A vjp with respect to the input alone computes no weight gradient (XLA drops what no output
reads), but a later vjp with respect to the weights alone would run the whole chain of input
cotangents again.  So every module that holds weights of its own (a *leaf*: ``nn.Dense``,
:class:`~asyncpp_jax.models.layers.RMSNorm`) gets a *tap*: its output plus an input of zeros.  The
cotangent of a tap is that module's output cotangent ``dy``, so one vjp with respect to the stage
input and the taps gives ``dx`` and every leaf's ``dy`` (:func:`input_grads`), and each leaf's
weight gradient is then its own small vjp at its recorded input (:func:`weight_grads`): for a
dense layer, the one matmul ``x^T dy``.  Nothing is computed twice, and the two halves equal the
full vjp up to the order of float sums (tests/test_taps.py).

The taps are put on the leaves with :func:`flax.linen.intercept_methods`, so the model's modules
are unchanged.  MoE layers hold their expert weights as raw parameters, not in leaves, so a stack
with MoE layers is refused.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from asyncpp_jax.models import dense
from asyncpp_jax.models.layers import RMSNorm

LEAF_TYPES = (nn.Dense, RMSNorm)  # the modules whose weights are their own (parameters, not submodules)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf call in a layer, in call order: its parameters' place in the layer's tree, an
    unbound copy of the module (to apply alone), its output's shape and dtype, and which of the
    layer's distinct leaf inputs it reads (the q, k and v projections read one)."""

    path: tuple
    module: nn.Module
    out: jax.ShapeDtypeStruct
    source: int


def _source(inputs: list, x) -> int:
    """The index of ``x`` in ``inputs`` (the same traced value), appending it if new."""
    for i, seen in enumerate(inputs):
        if seen is x:
            return i
    inputs.append(x)
    return len(inputs) - 1


def check_supported(cfg) -> None:
    if dense.uses_moe(cfg):
        raise ValueError("the split backward (zb-h1) taps each dense layer's matmuls, and MoE layers hold "
                         "their expert weights outside them: use config.pipeline.schedule=1f1b or "
                         "interleaved for an MoE model.")


def _apply_layer(cfg, p, h, positions, on_leaf):
    """One layer with ``on_leaf(module, x, y) -> y'`` called at every leaf call."""

    def intercept(next_fun, args, kwargs, context):
        if context.method_name != "__call__" or not isinstance(context.module, LEAF_TYPES):
            return next_fun(*args, **kwargs)
        return on_leaf(context.module, args[0], next_fun(*args, **kwargs))

    with nn.intercept_methods(intercept):
        out, _ = dense.Block(cfg).apply({"params": p}, h, positions)
    return out


_LEAVES: dict = {}  # (config text, shape, dtype) -> the leaf calls (tracing a layer once per shape)


def _find_leaves(cfg, shape, dtype) -> tuple[Leaf, ...]:
    found, inputs = [], []

    def record(module, x, y):
        found.append(Leaf(module.path, module.clone(parent=None, name=None), jax.ShapeDtypeStruct(y.shape, y.dtype),
                          _source(inputs, x)))
        return y

    layer0 = jax.eval_shape(lambda: dense.init_params(cfg, jax.random.key(0)))["layers"]
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layer0)
    positions = jax.ShapeDtypeStruct(shape[:2], jnp.int32)
    jax.eval_shape(lambda p, h, pos: _apply_layer(cfg, p, h, pos, record), one,
                   jax.ShapeDtypeStruct(shape, dtype), positions)
    return tuple(found)


def leaves(cfg, x_shape: tuple, x_dtype) -> tuple[Leaf, ...]:
    """The leaf calls of one layer on an activation of ``x_shape``, in call order."""
    check_supported(cfg)
    key = (str(cfg), tuple(x_shape), jnp.dtype(x_dtype))
    if key not in _LEAVES:
        _LEAVES[key] = _find_leaves(cfg, tuple(x_shape), jnp.dtype(x_dtype))
    return _LEAVES[key]


def input_count(cfg, x_shape: tuple, x_dtype) -> int:
    """How many distinct leaf inputs a layer records (:func:`apply_tapped`'s ``inputs``)."""
    return 1 + max(leaf.source for leaf in leaves(cfg, x_shape, x_dtype))


def zero_taps(cfg, layers, x) -> list:
    """One zeros array per leaf call, stacked over the layers of ``layers``, varying over the mesh
    axes ``x`` varies over (inside a ``shard_map``: a tap the same on every device would have its
    cotangent summed over them, a collective in what may be one device's branch)."""
    n = jax.tree.leaves(layers)[0].shape[0]
    return dense.varying_like([jnp.zeros((n,) + leaf.out.shape, leaf.out.dtype)
                               for leaf in leaves(cfg, x.shape, x.dtype)], x)


def apply_tapped(cfg, layers, x, taps):
    """``(h, inputs)``: the stack on ``x`` with each leaf call's output plus its tap, and the distinct
    inputs of its leaf calls (stacked over the layers; the normalized activation that the q, k and v
    projections share is kept once, :attr:`Leaf.source`)."""
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])

    def body(h, xs):
        p, t = xs
        it, inputs = iter(t), []

        def tap(module, x_in, y):
            _source(inputs, x_in)
            return y + next(it).astype(y.dtype)

        return _apply_layer(cfg, p, h, positions, tap), inputs

    return jax.lax.scan(body, x, (layers, taps))


def input_grads(cfg, layers, x, ct):
    """``I``: ``(h, dx, inputs, dys)``: the stack's output, its input cotangent for the output
    cotangent ``ct``, and every leaf call's input and output cotangent (stacked over layers), for
    :func:`weight_grads`.  No weight gradient is computed."""
    taps = zero_taps(cfg, layers, x)
    h, pull, inputs = jax.vjp(lambda x_, t: apply_tapped(cfg, layers, x_, t), x, taps, has_aux=True)
    dx, dys = pull(ct.astype(h.dtype))
    return h, dx, inputs, dys


def weight_grads(cfg, layers, inputs, dys):
    """``W``: the gradient of ``layers`` (same tree) from the leaf calls' inputs and each one's output
    cotangent: per layer and leaf, the vjp of the leaf alone with respect to its weights."""
    found = leaves(cfg, inputs[0].shape[1:], inputs[0].dtype)

    def one_layer(p, xs, gs):
        grads = jax.tree.map(jnp.zeros_like, p)
        for leaf, dy in zip(found, gs):
            w, x_in = _at(p, leaf.path), xs[leaf.source]
            _, pull = jax.vjp(lambda w_: leaf.module.apply({"params": w_}, x_in), w)
            grads = _set(grads, leaf.path, pull(dy.astype(leaf.out.dtype))[0])
        return grads

    return jax.vmap(one_layer)(layers, inputs, dys)


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}
