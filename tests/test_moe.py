"""MoE layer against a NumPy re-derivation of token-choice top-k routing; configs' parameter counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncpp_jax import configs
from asyncpp_jax.configs import base_config
from asyncpp_jax.models import dense
from asyncpp_jax.models.flops import active_matmul_params, flops_per_token
from asyncpp_jax.models.moe import MoE


def moe_cfg(E=4, k=2, cf=1.25, gating="softmax", shared=0):
    m = base_config().model
    m.update(vocab_size=31, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=12)
    m.moe.update(num_experts=E, top_k=k, expert_d_ff=6, capacity_factor=cf, gating=gating, shared_experts=shared)
    return m


def np_moe(p, x, cfg):
    """Token-choice top-k with GShard slot order (all first choices, then second ...), float64."""
    mc = cfg.moe
    E, k = mc.num_experts, mc.top_k
    t = np.asarray(x, np.float64).reshape(-1, cfg.d_model)
    n = t.shape[0]
    logits = t @ np.asarray(p["router"], np.float64)
    if mc.gating == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    idx = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    gates = np.take_along_axis(scores, idx, -1)
    gates = gates / gates.sum(-1, keepdims=True)
    cap = math.ceil(mc.capacity_factor * k * n / E) if mc.capacity_factor > 0 else n * k
    fill, kept = np.zeros(E, int), np.zeros((n, k), bool)
    for r in range(k):
        for i in range(n):
            e = idx[i, r]
            kept[i, r] = fill[e] < cap
            fill[e] += 1
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    W = {name: np.asarray(p[name], np.float64) for name in ("gate", "up", "down")}
    y = np.zeros_like(t)
    for i in range(n):
        for r in range(k):
            if kept[i, r]:
                e = idx[i, r]
                h = silu(t[i] @ W["gate"][e]) * (t[i] @ W["up"][e])
                y[i] += gates[i, r] * (h @ W["down"][e])
    f = np.bincount(idx.ravel(), minlength=E) / (n * k)
    probs = scores / scores.sum(-1, keepdims=True)
    lse = np.log(np.exp(logits).sum(-1))
    aux = {"moe_lb_loss": E * np.sum(f * probs.mean(0)), "moe_router_z": np.mean(lse ** 2),
           "moe_dropped": 1 - kept.mean()}
    return y.reshape(x.shape), aux


@pytest.mark.parametrize("cf, gating", [(1.25, "softmax"), (0.5, "softmax"), (0.0, "softmax"), (1.0, "sigmoid")])
def test_moe_layer_matches_numpy(cf, gating):
    cfg = moe_cfg(cf=cf, gating=gating)
    x = jax.random.normal(jax.random.key(1), (3, 5, cfg.d_model))
    layer = MoE(cfg)
    params = layer.init(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda a: a * 10.0 if a.ndim == 2 else a, params)  # sharper routing
    y, aux = jax.jit(layer.apply)({"params": params}, x)
    want, want_aux = np_moe(params, x, cfg)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-6)
    for key in want_aux:
        np.testing.assert_allclose(aux[key], want_aux[key], rtol=1e-4, atol=1e-6, err_msg=key)
    if cf == 0.5:
        assert aux["moe_dropped"] > 0  # capacity binds: tokens were dropped and counted
    if cf <= 0:
        assert aux["moe_dropped"] == 0


def test_capacity_path_equals_dropless_when_nothing_drops():
    big, dropless = moe_cfg(cf=2.0), moe_cfg(cf=0.0)  # C = ceil(2 * 2 * N / 4) = N
    x = jax.random.normal(jax.random.key(2), (2, 4, 8))
    params = MoE(big).init(jax.random.key(0), x)["params"]
    y1, a1 = MoE(big).apply({"params": params}, x)
    y2, _ = MoE(dropless).apply({"params": params}, x)
    assert a1["moe_dropped"] == 0
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)


def test_moe_every_k_layers_and_aux_in_the_loss():
    cfg = moe_cfg(shared=1)
    cfg.update(n_layers=4)
    cfg.moe.every = 2
    params = dense.init_params(cfg, jax.random.key(0))
    assert set(params["layers"]) == {"block_0", "block_1"}  # a dense layer, then an MoE layer
    assert "mlp" in params["layers"]["block_0"] and "moe" in params["layers"]["block_1"]
    assert params["layers"]["block_1"]["moe"]["gate"].shape == (2, 4, 8, 6)  # [groups, E, D, F]
    batch = jax.random.randint(jax.random.key(1), (2, 9), 0, 31)
    total, stats = dense.loss_fn(cfg, params, batch)
    want = stats["ce"] + cfg.moe.lb_loss_coef * stats["moe_lb_loss"] + cfg.moe.router_z_loss_coef * stats["moe_router_z"]
    np.testing.assert_allclose(total, want, rtol=1e-6)
    # Stage slices compose (the pipeline's contract), aux included.
    h = dense.embed(cfg, params, batch[:, :-1])
    h1, a1 = dense.apply_layers_with_aux(cfg, dense.slice_layers(params["layers"], 0, 1), h)
    h2, a2 = dense.apply_layers_with_aux(cfg, dense.slice_layers(params["layers"], 1, 2), h1)
    h_all, a_all = dense.apply_layers_with_aux(cfg, params["layers"], h)
    np.testing.assert_allclose(h2, h_all, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a1["moe_lb_loss"] + a2["moe_lb_loss"], a_all["moe_lb_loss"], rtol=1e-6)


def test_moe10b_counts():
    c = configs.load_file("configs/moe10b.py")
    assert dense.count_params(dense.abstract_params(c.model)) == 10_119_907_328
    # Active: all but 56 of 64 experts per layer; the input lookup does no matmul.
    assert active_matmul_params(c.model) == 1_563_527_168
    assert flops_per_token(c.model, 4096) == 6 * 1_563_527_168 + 12 * 24 * 4096 * 2048


def test_dense_flops_per_token_is_6n_plus_attention():
    c = configs.load_file("configs/dense135m.py")
    assert active_matmul_params(c.model) == 134_515_008  # tied: the table is the output projection
    assert flops_per_token(c.model, 2048) == 6 * 134_515_008 + 12 * 30 * 2048 * 576


@pytest.mark.needs_devices(4)
def test_expert_parallel_equals_single_device_per_group():
    """Experts sharded over 4 devices with all_to_all == one device running each token group."""
    from jax.sharding import PartitionSpec as P

    S = 4
    cfg = moe_cfg(E=8, k=2, cf=1.0)
    x = jax.random.normal(jax.random.key(3), (S * 2, 5, cfg.d_model))  # 2 sequences per device
    r = jax.random.normal(jax.random.key(4), x.shape)
    params = MoE(cfg).init(jax.random.key(0), x[:2])["params"]
    params = jax.tree.map(lambda a: a * 10.0 if a.ndim == 2 else a, params)

    def group_loss(p, xg, rg):
        y, aux = MoE(cfg).apply({"params": p}, xg)
        return jnp.sum(y * rg), (y, aux["moe_dropped"])

    # Reference: one device, capacity per group of 2 sequences (GShard groups).
    ref = [jax.value_and_grad(group_loss, has_aux=True)(params, x[2 * i:2 * i + 2], r[2 * i:2 * i + 2])
           for i in range(S)]
    want_y = jnp.concatenate([o[0][1][0] for o in ref])
    want_g = jax.tree.map(lambda *g: sum(g), *[o[1] for o in ref])
    assert sum(float(o[0][1][1]) for o in ref) > 0  # capacity 1.0 drops some: routing must agree exactly

    ep = moe_cfg(E=8, k=2, cf=1.0)
    ep.moe.expert_axis, ep.moe.expert_shards = "data", S
    mesh = jax.make_mesh((S,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:S])
    expert_spec = {k: (P("data") if k in ("gate", "up", "down") else P()) for k in params}

    def local(p, xl, rl):
        p = {k: (v if k in ("gate", "up", "down") else jax.lax.pcast(v, ("data",), to="varying"))
             for k, v in p.items()}

        def loss(p):
            y, _ = MoE(ep).apply({"params": p}, xl)
            return jnp.sum(y * rl), y

        (_, y), g = jax.value_and_grad(loss, has_aux=True)(p)
        # Expert grads already sum every device's tokens (all_to_all's transpose); the rest psum.
        g = {k: (v if k in ("gate", "up", "down") else jax.lax.psum(v, "data")) for k, v in g.items()}
        return y, g

    y, g = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(expert_spec, P("data"), P("data")),
                                 out_specs=(P("data"), expert_spec)))(params, x, r)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    for key in params:
        np.testing.assert_allclose(g[key], want_g[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("field, value, needle", [
    ("every", 0, "config.model.moe.every=0 must be a positive integer dividing config.model.n_layers=4"),
    ("top_k", 9, "config.model.moe.top_k=9 must be an integer in [1, 8]"),
    ("gating", "relu", "config.model.moe.gating='relu' is unknown"),
])
def test_bad_moe_settings_name_the_field(field, value, needle):
    c = configs.load_file("configs/moe_tiny.py")
    c.model.moe[field] = value
    c.pipeline.stages = 2
    with pytest.raises(configs.ConfigError) as e:
        configs.validate(c)
    assert needle in str(e.value)
