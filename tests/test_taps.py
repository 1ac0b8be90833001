"""The backward split into input-gradient and weight-gradient halves (asyncpp_jax/models/taps.py),
which zb-h1's I and W actions run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncpp_jax.configs import base_config
from asyncpp_jax.models import dense, taps


def _cfg(**kw):
    m = base_config().model
    m.update(vocab_size=31, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24, **kw)
    return m


def _inputs(cfg, dtype=jnp.float32):
    layers = dense.compute_view(cfg, dense.init_params(cfg, jax.random.key(0)))["layers"]
    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model)).astype(dtype)
    ct = jax.random.normal(jax.random.key(2), x.shape).astype(dtype)
    return layers, x, ct


@pytest.mark.parametrize("compute_dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_input_then_weight_half_is_the_full_vjp(compute_dtype):
    cfg = _cfg(compute_dtype=compute_dtype)
    layers, x, ct = _inputs(cfg, dense.dtype_of(compute_dtype))
    h, pull = jax.vjp(lambda lp, x_: dense.apply_layers(cfg, lp, x_), layers, x)
    g_l, g_x = pull(ct)
    h2, dx, inputs, dys = jax.jit(lambda lp, x_, c: taps.input_grads(cfg, lp, x_, c))(layers, x, ct)
    g_w = jax.jit(lambda lp, i, d: taps.weight_grads(cfg, lp, i, d))(layers, inputs, dys)
    # The same products, summed in another order where XLA fuses them differently.
    tol = dict(rtol=1e-5, atol=1e-8) if compute_dtype == "float32" else dict(rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(np.asarray(h2, np.float32), np.asarray(h, np.float32), **tol)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(g_x, np.float32), **tol)
    assert jax.tree.structure(g_w) == jax.tree.structure(g_l)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_w), jax.tree.leaves(g_l)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol,
                                   err_msg=jax.tree_util.keystr(path))


def test_nothing_is_computed_twice():
    """I has the forward's and the input cotangents' matmuls and no weight gradient; W has one matmul
    per dense leaf (its ``x^T dy``): together exactly the full vjp's matmuls."""
    cfg = _cfg()
    layers, x, ct = _inputs(cfg)

    def dots(fn, *args):
        return jax.jit(fn).lower(*args).as_text().count("stablehlo.dot_general")

    full = dots(lambda lp, x_, c: jax.vjp(lambda a, b: dense.apply_layers(cfg, a, b), lp, x_)[1](c), layers, x, ct)
    _, _, inputs, dys = taps.input_grads(cfg, layers, x, ct)
    i_dots = dots(lambda lp, x_, c: taps.input_grads(cfg, lp, x_, c)[1:], layers, x, ct)
    w_dots = dots(lambda lp, i, d: taps.weight_grads(cfg, lp, i, d), layers, inputs, dys)
    dense_leaves = sum(leaf.path[-1] not in ("attn_norm", "mlp_norm") for leaf in taps.leaves(cfg, x.shape, x.dtype))
    assert dense_leaves == 7  # q, k, v, o, gate, up, down
    assert w_dots == dense_leaves and i_dots + w_dots == full


def test_the_leaves_are_every_weight_of_a_layer():
    cfg = _cfg()
    layers, x, _ = _inputs(cfg)
    paths = {leaf.path for leaf in taps.leaves(cfg, x.shape, x.dtype)}
    one = jax.tree.map(lambda a: a[0], layers)
    owners = {tuple(k.key for k in path[:-1]) for path, _ in jax.tree_util.tree_leaves_with_path(one)}
    assert paths == owners


def test_an_moe_stack_is_refused():
    cfg = _cfg()
    cfg.moe.num_experts, cfg.moe.every = 4, 1
    with pytest.raises(ValueError, match="use config.pipeline.schedule=1f1b"):
        taps.leaves(cfg, (2, 5, cfg.d_model), jnp.float32)
