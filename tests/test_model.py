"""Dense decoder: exact parameter counts, causality, stage slicing, GQA against a naive reference."""


import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from asyncpp_jax import configs
from asyncpp_jax.configs import base_config
from asyncpp_jax.models import dense, layers


def small_cfg(**kw) -> ml_collections.ConfigDict:
    m = base_config().model
    m.update(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48)
    m.update(**kw)
    return m


@pytest.fixture(scope="module")
def cfg_and_params():
    cfg = small_cfg()
    return cfg, dense.init_params(cfg, jax.random.key(0))


@pytest.mark.parametrize(
    "name, expected", [("dense135m", 134_515_008), ("dense360m", 361_821_120)]
)
def test_smollm2_parameter_counts_exact(name, expected):
    cfg = configs.load_file(f"configs/{name}.py").model
    assert dense.count_params(dense.abstract_params(cfg)) == expected


def _dense_layer(d, heads, kv_heads, hd, f):
    """q and o (d x heads*hd), k and v (d x kv_heads*hd), SwiGLU (3 d f), two RMSNorm scales."""
    return 2 * d * heads * hd + 2 * d * kv_heads * hd + 3 * d * f + 2 * d


def _moe_layer(d, heads, kv_heads, hd, experts, expert_f):
    """The dense layer with its MLP replaced by ``experts`` SwiGLU experts and a d x E router."""
    return _dense_layer(d, heads, kv_heads, hd, 0) + experts * 3 * d * expert_f + d * experts


# tiny: d 256, 4 layers, 4/2 heads of 64, SwiGLU 688, byte vocab 257, tied (table + final norm).
_TINY_LAYER = _dense_layer(256, 4, 2, 64, 688)
_TINY_OUTSIDE = 257 * 256 + 256


@pytest.mark.parametrize("name, expected", [
    ("tiny", 4 * _TINY_LAYER + _TINY_OUTSIDE),
    # moe_tiny: tiny with 8 experts of hidden 344 on every other layer (2 of the 4).
    ("moe_tiny", 2 * _TINY_LAYER + 2 * _moe_layer(256, 4, 2, 64, 8, 344) + _TINY_OUTSIDE),
])
def test_cpu_config_parameter_counts_by_formula(name, expected):
    cfg = configs.load_file(f"configs/{name}.py").model
    assert dense.count_params(dense.abstract_params(cfg)) == expected
    assert expected == {"tiny": 2_968_064, "moe_tiny": 6_142_464}[name]  # the table of docs/training.md, "Configs"


def test_param_count_matches_formula_and_untied_head():
    cfg = small_cfg(tie_embeddings=False)
    d, f, v, L, hd = 32, 48, 61, 3, 8
    per_layer = d * 4 * hd + 2 * d * 2 * hd + 4 * hd * d + 3 * d * f + 2 * d
    expected = v * d + L * per_layer + d + d * v
    shapes = dense.abstract_params(cfg)
    assert dense.count_params(shapes) == expected
    assert shapes["lm_head"]["kernel"].shape == (d, v)
    # Every layer leaf carries the leading layer axis: the stack slices into stages.
    assert all(x.shape[0] == L for x in jax.tree.leaves(shapes["layers"]))


def test_logits_shape_and_dtype(cfg_and_params):
    cfg, params = cfg_and_params
    logits = dense.forward(cfg, params, jnp.zeros((2, 7), jnp.int32))
    assert logits.shape == (2, 7, cfg.vocab_size) and logits.dtype == jnp.float32


def test_causality(cfg_and_params):
    cfg, params = cfg_and_params
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, cfg.vocab_size)
    base = dense.forward(cfg, params, tokens)
    t = 6
    changed = tokens.at[0, t].set((tokens[0, t] + 1) % cfg.vocab_size)
    out = dense.forward(cfg, params, changed)
    np.testing.assert_array_equal(out[0, :t], base[0, :t])  # the past cannot see the future
    assert not np.allclose(out[0, t:], base[0, t:])  # but the change is seen from t on


def test_stage_slices_compose_to_full_forward(cfg_and_params):
    cfg, params = cfg_and_params
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size)
    h = dense.embed(cfg, params, tokens)
    for a, b in ((0, 1), (1, 3)):  # two uneven stages
        h = dense.apply_layers(cfg, dense.slice_layers(params["layers"], a, b), h)
    logits = dense.logits_from_hidden(cfg, params, h)
    np.testing.assert_allclose(logits, dense.forward(cfg, params, tokens), rtol=1e-5, atol=1e-5)


def _naive_attention(cfg, p, x):
    """Reference: repeat K/V heads, full softmax with a causal mask, RoPE applied per position."""
    b, t, _ = x.shape
    hd = cfg.d_model // cfg.n_heads
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    q = (x @ p["q"]["kernel"]).reshape(b, t, cfg.n_heads, hd)
    k = (x @ p["k"]["kernel"]).reshape(b, t, cfg.n_kv_heads, hd)
    v = (x @ p["v"]["kernel"]).reshape(b, t, cfg.n_kv_heads, hd)
    q, k = layers.rope(q, pos, cfg.rope_theta), layers.rope(k, pos, cfg.rope_theta)
    rep = cfg.n_heads // cfg.n_kv_heads
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
    return o @ p["o"]["kernel"]


def test_gqa_matches_naive_reference():
    cfg = small_cfg(n_heads=4, n_kv_heads=2)
    attn = layers.Attention(cfg)
    x = jax.random.normal(jax.random.key(3), (2, 5, cfg.d_model))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    p = attn.init(jax.random.key(4), x, pos)["params"]
    np.testing.assert_allclose(attn.apply({"params": p}, x, pos), _naive_attention(cfg, p, x), rtol=2e-5, atol=2e-5)


def test_rope_is_relative():
    """<rope(q, m), rope(k, n)> depends only on m - n (Su et al. 2021, eq. 16)."""
    q = jax.random.normal(jax.random.key(5), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(6), (1, 1, 1, 8))
    dot = lambda m, n: jnp.sum(layers.rope(q, jnp.array([[m]]), 1e4) * layers.rope(k, jnp.array([[n]]), 1e4))  # noqa: E731
    np.testing.assert_allclose(dot(5, 2), dot(13, 10), rtol=1e-5)
    assert not np.isclose(dot(5, 2), dot(5, 3))


def test_z_loss_and_cross_entropy():
    logits = jnp.array([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]]])
    targets = jnp.array([[0, 2]])
    lse = jax.nn.logsumexp(logits, -1)
    ce_ref = jnp.mean(lse - jnp.array([2.0, 0.5]))
    total, (ce, z) = dense.cross_entropy(logits, targets, z_loss=1e-2)
    np.testing.assert_allclose(ce, ce_ref, rtol=1e-6)
    np.testing.assert_allclose(z, 1e-2 * jnp.mean(lse**2), rtol=1e-6)
    np.testing.assert_allclose(total, ce + z, rtol=1e-6)


def test_bf16_compute_keeps_fp32_params_and_tracks_fp32():
    cfg32, cfg16 = small_cfg(), small_cfg(compute_dtype="bfloat16")
    params = dense.init_params(cfg16, jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    tokens = jax.random.randint(jax.random.key(7), (2, 8), 0, cfg32.vocab_size)
    l32 = dense.forward(cfg32, params, tokens)
    l16 = dense.forward(cfg16, params, tokens)
    assert l16.dtype == jnp.float32
    np.testing.assert_allclose(l16, l32, atol=5e-2)
    assert not np.array_equal(l16, l32)  # bf16 really was used


def test_remat_gives_same_gradients(cfg_and_params):
    cfg, params = cfg_and_params
    batch = jax.random.randint(jax.random.key(8), (2, 9), 0, cfg.vocab_size)
    g = jax.grad(lambda p: dense.loss_fn(cfg, p, batch)[0])(params)
    cfg_r = small_cfg(remat=True)
    g_r = jax.grad(lambda p: dense.loss_fn(cfg_r, p, batch)[0])(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_r)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_layer_stack_is_scanned_not_unrolled():
    """The traced program has the same size at any depth, so compile time does not grow with it."""

    def program_size(n_layers):
        cfg = small_cfg(n_layers=n_layers)
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda p, t: dense.loss_fn(cfg, p, t)[0])(dense.abstract_params(cfg), tokens)
        return len(str(jaxpr))

    assert program_size(2) == program_size(8)
