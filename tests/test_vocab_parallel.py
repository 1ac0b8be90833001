"""Vocabulary parallelism (:mod:`asyncpp_jax.pipeline.vocab_parallel`) against the dense path: the
lookup, its transpose, and the head's loss and gradients from ``V/P`` blocks over ``stage``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import test_pipeline as tp
from test_compiled_step import vocab_moves_in_loops
from asyncpp_jax import configs
from asyncpp_jax.models import dense
from asyncpp_jax.pipeline.spmd import engine
from asyncpp_jax.pipeline.mesh import make_mesh
from asyncpp_jax.pipeline import vocab_parallel as vp
from asyncpp_jax.pipeline.layout import make_pipeline_mesh
from asyncpp_jax.pipeline.stage import StageFns
from asyncpp_jax.train import step as step_lib
from helpers import tiny_model_cfg

pytestmark = pytest.mark.needs_devices(4)
STAGES = 4


def _cfg(z_loss=0.0, tied=True):
    cfg = tiny_model_cfg(tie=tied)
    cfg.update(vocab_size=64, z_loss=z_loss)  # 16 ids a device
    return cfg


def _setup(cfg, seed=0, b=2, T=6):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    head = {"final_norm": {"scale": 1.0 + 0.1 * jax.random.normal(k[0], (cfg.d_model,))},
            "w": 0.3 * jax.random.normal(k[1], (cfg.d_model, cfg.vocab_size))}
    h = jax.random.normal(k[2], (b, T, cfg.d_model))
    tokens = jax.random.randint(k[3], (b, T + 1), 0, cfg.vocab_size)
    return head, h, tokens


def _on_mesh(fn, in_specs, out_specs):
    mesh = make_pipeline_mesh(1, STAGES)
    # Unchecked: outputs the functions leave varying are the same on every device by construction.
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_head_loss_and_grads_match_the_dense_head(z_loss):
    cfg = _cfg(z_loss)
    head, h, tokens = _setup(cfg)
    ct = 0.25
    fns = StageFns(cfg, microbatches=4, recompute=True)
    loss, vjp_fn, stats = jax.vjp(lambda hp, x: fns._head_loss(hp, x, tokens), head, h, has_aux=True)
    g_head, g_h = vjp_fn(jnp.float32(ct))

    def local(hp, x, toks):
        loss, stats, g, gx = vp.head_loss_grads(cfg, hp, x, toks[:, 1:], ct)
        return loss, stats["ce"], g, gx

    head_spec = {"final_norm": {"scale": P()}, "w": P(None, "stage")}
    fn = _on_mesh(local, (head_spec, P(), P()), (P(), P(), head_spec, P()))
    got_loss, got_ce, got_g, got_gh = fn(head, h, tokens)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(got_ce, stats["ce"], rtol=1e-6)
    np.testing.assert_allclose(got_g["w"], g_head["w"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_g["final_norm"]["scale"], g_head["final_norm"]["scale"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_gh, g_h, rtol=1e-5, atol=1e-7)


def test_eval_loss_sum_matches_the_dense_head():
    cfg = _cfg()
    head, h, tokens = _setup(cfg, seed=1)
    logits = dense.logits_from_head(cfg, head, h)
    want = jnp.sum(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0])
    head_spec = {"final_norm": {"scale": P()}, "w": P(None, "stage")}
    fn = _on_mesh(lambda hp, x, t: vp.head_loss_sum(cfg, hp, x, t[:, 1:]), (head_spec, P(), P()), (P(), P()))
    total, count = fn(head, h, tokens)
    np.testing.assert_allclose(total, want, rtol=1e-6)
    assert count == tokens[:, 1:].size


@pytest.mark.parametrize("tied", [True, False])
def test_lookup_and_its_transpose_match_the_dense_embedding(tied):
    cfg = _cfg(tied=tied)
    V, D = cfg.vocab_size, cfg.d_model
    table = jax.random.normal(jax.random.PRNGKey(2), (D, V) if tied else (V, D))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 7), 0, V)
    ct = jax.random.normal(jax.random.PRNGKey(4), (2, 7, D))
    model_table = table.T if tied else table
    want, vjp_fn = jax.vjp(lambda t: dense.embed(cfg, {"embed": {"embedding": t}}, tokens), model_table)
    (want_g,) = vjp_fn(ct)
    spec = P(None, "stage") if tied else P("stage", None)
    acc_spec = P(None, None, "stage") if tied else P(None, "stage", None)

    def local(t, toks, c):
        x = vp.lookup(cfg, {"embed": {"embedding": t}}, toks)
        if tied:  # the engine's tied accumulator [D, n, V/P] (axis 1)
            acc = jnp.zeros((t.shape[0], 2, t.shape[1]), jnp.float32)
            acc = vp.lookup_transpose_add(acc, toks, c, 1, axis=1, tied=True)
            return x, acc[:, 1]
        acc = jnp.zeros((2,) + t.shape, jnp.float32)  # untied [n, V/P, D] (axis 0)
        acc = vp.lookup_transpose_add(acc, toks, c, 1, axis=0, tied=False)
        return x, acc[1][None]

    out_g = P(None, "stage") if tied else P(None, "stage", None)
    fn = _on_mesh(local, (spec, P(), P()), (P(), out_g))
    x, g = fn(table, tokens, ct)
    np.testing.assert_array_equal(x, want)
    g = g if tied else g[0]
    np.testing.assert_allclose(g.T if tied else g, want_g, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ in the engine

def _engine_cfg(vocab=32, tie=True):
    cfg = tp.model_cfg()
    cfg.update(vocab_size=vocab, tie_embeddings=tie)
    return cfg


def _data(vocab, n, M, B, seed):
    return [d % vocab for d in tp.batches(n, M, B, seed=seed)]


@pytest.mark.parametrize("schedule, tie, stages, data_size", [
    # by default: 2bw (tied, P = 4) and two programs, one of them untied with data parallelism
    pytest.param("sync", True, 4, 1, marks=pytest.mark.slow), ("2bw", True, 4, 1),
    pytest.param("2bw", False, 2, 2, marks=pytest.mark.slow),
    pytest.param("sync", False, 2, 2, marks=pytest.mark.slow), ("zb-h1", True, 4, 1), ("interleaved", False, 2, 2),
    pytest.param("1f1b", True, 4, 1, marks=pytest.mark.slow)])
def test_split_tables_equal_simulate(schedule, tie, stages, data_size):
    """Split over their vocabulary, the tables train exactly as the simulate runner's (the flushed
    schedules against sync, 2bw against ``delay(1)``): the loss, the lookup and the head's gradient
    assembled from ``V/P`` blocks, in the tick loop and in a program's slots (``zb-h1``'s last
    stage splitting its backward into ``I`` and ``W``; ``interleaved``'s first and last virtual
    stages on chunks 0 and 1)."""
    cfg = _engine_cfg(tie=tie)
    v = 2 if schedule == "interleaved" else 1
    cfg.n_layers *= v
    M = 6 if stages == 4 and schedule in ("sync", "2bw") else 4
    data = _data(32, 3, M, 2 * M, seed=3)
    chain = optax.chain(tp.delay(1), tp.make_opt("adamw")) if schedule == "2bw" else tp.make_opt("adamw")
    want, want_m = tp.run_simulate(cfg, chain, data, data_size)
    got, got_m = tp.run_pipeline(cfg, tp.make_opt("adamw"), data, stages, schedule, data_size,
                                 virtual_stages=v, vocab_parallel=True)
    interleave = (stages, v) if v > 1 else None
    tp.assert_params_close(engine.to_model_layout(cfg, got.params, None, interleave), want.params)
    # Under 2bw update t logs batch t-1's loss (at the weights it was taken at); simulate logs batch t's.
    lag = 2 if schedule == "2bw" else 1
    np.testing.assert_allclose(got_m[-1]["loss"], want_m[-lag]["loss"], rtol=1e-5)
    table = got.params["embed"]["embedding"]
    block = 32 // stages  # each device's share of the vocabulary
    assert table.sharding.shard_shape(table.shape) == ((16, block) if tie else (block, 16))


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False])
@pytest.mark.parametrize("schedule", ["2bw", "zb-h1", "1f1b"])
def test_split_tables_with_kept_residuals_equal_simulate(recompute, schedule):
    cfg, data = _engine_cfg(), _data(32, 2, 6, 12, seed=5)
    chain = optax.chain(tp.delay(1), tp.make_opt("adamw")) if schedule == "2bw" else tp.make_opt("adamw")
    want, _ = tp.run_simulate(cfg, chain, data)
    got, _ = tp.run_pipeline(cfg, tp.make_opt("adamw"), data, 4, schedule, recompute=recompute, vocab_parallel=True)
    tp.assert_params_close(engine.to_model_layout(cfg, got.params), want.params)


@pytest.mark.slow  # ~1 min; the tick loop is the same as the dense 2bw cases
def test_split_tables_with_moe_equal_simulate():
    """An MoE model (aux losses on every stage, the last stage's among them) with split tables, 2bw."""
    cfg = _engine_cfg()
    cfg.moe.update(num_experts=4, top_k=2, expert_d_ff=8, every=2, capacity_factor=1.25)
    data = _data(32, 4, 2, 4, seed=5)
    want, _ = tp.run_simulate(cfg, optax.chain(tp.delay(1), tp.make_opt("adamw")), data)
    got, metrics = tp.run_pipeline(cfg, tp.make_opt("adamw"), data, 2, "2bw", vocab_parallel=True)
    tp.assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert metrics[-1]["moe_lb_loss"] > 0 and "moe_dropped" in metrics[-1]


@pytest.mark.slow
def test_split_tables_in_bf16_equal_simulate():
    cfg, data = _engine_cfg(), _data(32, 3, 4, 8, seed=10)
    cfg.compute_dtype = "bfloat16"
    lr, tx = 0.5, optax.sgd(0.5)
    want, want_m = tp.run_simulate(cfg, optax.chain(tp.delay(1), tx), data)
    got, _ = tp.run_pipeline(cfg, tx, data, 2, "2bw", vocab_parallel=True)
    tol = lr * len(data) * 8 * tp.BF16_U * max(float(m["grad_norm"]) for m in want_m)  # as test_pipeline's bf16 bound
    tp.assert_params_close(engine.to_model_layout(cfg, got.params), want.params, rtol=0, atol=tol)


@pytest.mark.parametrize("stages, chunks", [(4, 1), (2, 2)])
def test_split_tables_eval_equals_simulate(stages, chunks):
    """The forward-only program with split tables, one chunk a device or two (``interleaved``:
    the loss on device ``P-1``'s second chunk)."""
    cfg = _engine_cfg(tie=False)
    cfg.n_layers *= chunks
    params = dense.init_params(cfg, jax.random.key(3))
    batch = jnp.asarray(np.random.default_rng(12).integers(0, 32, (8, tp.T + 1)), jnp.int32)
    mesh1 = make_mesh(1, jax.devices()[:1])
    want = step_lib.make_eval_step(cfg, mesh1)(params, jax.device_put(batch, step_lib.eval_sharding(mesh1)))
    mesh = engine.make_pipeline_mesh(1, stages)
    interleave = (stages, chunks) if chunks > 1 else None
    abstract = tp.engine_shapes(cfg, interleave)
    specs = engine.param_specs(abstract, vocab_parallel=True)
    sharded = jax.device_put(engine.to_engine_layout(cfg, params, None, interleave),
                             jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs))
    options = tp.engine_options("interleaved" if chunks > 1 else "sync", stages, stages, virtual_stages=chunks,
                                vocab_parallel=True)
    fn = engine.make_pipeline_eval_step(cfg, mesh, abstract, 2, options)
    got = fn(sharded, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


V_SPLIT = 116  # 4 x 29: no other dimension of the model is 116 or 29


def whole_tables(text: str, table_size: int) -> list:
    """The HLO's array shapes with the whole vocabulary along an axis and at least a whole table's
    elements (``[D/P, V]`` is only a view XLA may take of a ``[D, V/P]`` block: the same size)."""
    out = []
    for dims in re.findall(r"\b[a-z]+\d*\[([\d,]+)\]", text):
        shape = [int(d) for d in dims.split(",")]
        if V_SPLIT in shape and np.prod(shape) >= table_size:
            out.append(shape)
    return out


@pytest.mark.parametrize("schedule, tie", [("2bw", True), pytest.param("sync", False, marks=pytest.mark.slow),
                                           pytest.param("zb-h1", False, marks=pytest.mark.slow)])
def test_no_device_holds_a_whole_table(schedule, tie):
    """The compiled step (XLA's per-device program: the tick loop, the update, the gathers it would
    need) has no array with the whole vocabulary along any axis: every device's params, weight
    version, optimizer state, accumulators and logits hold its ``V/P`` block."""
    cfg = _engine_cfg(V_SPLIT, tie)
    mesh, tx, M = engine.make_pipeline_mesh(1, STAGES), tp.make_opt("adamw"), 6
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V_SPLIT, (M, 2, tp.T + 1)), jnp.int32)

    def compiled(split):
        step = engine.make_pipeline_train_step(cfg, tx, tp.SCHED, mesh, tp.engine_shapes(cfg),
                                               tp.engine_options(schedule, STAGES, M, vocab_parallel=split))
        state = tp.init_pipeline(cfg, tx, mesh, M, 12, schedule, vocab_parallel=split)
        return state, step.lower(state, jax.device_put(tokens, engine.global_batch_sharding(mesh))).compile().as_text()

    state, text = compiled(True)
    block = V_SPLIT // STAGES
    assert re.search(rf"\[16,(\d+,)?{block}\]", text), "no vocabulary block found: the test would check nothing"
    assert whole_tables(text, 16 * V_SPLIT) == []
    assert vocab_moves_in_loops(text, block) == []  # nor is a block copied inside the tick loop
    assert whole_tables(compiled(False)[1], 16 * V_SPLIT), "the reader finds the replicated tables"
    for leaf in jax.tree.leaves(state):
        if V_SPLIT in leaf.shape:  # each vocabulary-sized leaf of the state is split along its vocabulary
            assert leaf.sharding.shard_shape(leaf.shape)[leaf.shape.index(V_SPLIT)] == block


def test_a_vocabulary_the_stages_do_not_divide_is_refused():
    """The rule is checked once, by the config's validator; the engine relies on it."""
    c = configs.base_config()
    c.model.vocab_size = 31
    c.pipeline.update(stages=STAGES, schedule="2bw", vocab_parallel=True)
    with pytest.raises(configs.ConfigError, match=r"vocab_parallel=True .* does not divide config.model.vocab_size=31"):
        configs.validate(configs.resolve(c))

