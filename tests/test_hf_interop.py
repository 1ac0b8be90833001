"""Hugging Face Llama checkpoints in and out (asyncpp_jax.models.hf_llama, asyncpp_jax.export).

No torch, no transformers: the reference for the weight conventions is a NumPy float64 forward of
``LlamaForCausalLM`` written from Hugging Face's ``modeling_llama`` on the HF-named tensors
(``rotate_half`` RoPE, ``repeat_kv``, ``[out, in]`` linear weights); the reference for the file
format is the ``safetensors`` package's NumPy API.
"""

import importlib.util
import json
import os
import pathlib
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest

from asyncpp_jax import configs, export
from asyncpp_jax.models import dense, hf_llama
from asyncpp_jax.models.hf_llama import HFCheckpointError
from asyncpp_jax.pipeline.spmd import engine
from asyncpp_jax.train import runner as runner_lib


def model_cfg(**kw):
    m = configs.base_config().model
    m.update(vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, rope_theta=500000.0,
             tie_embeddings=False, norm_eps=1e-6)
    m.update(**kw)
    return m


def random_params(m, seed=0):
    """Every leaf random (the norm scales around 1), so a swapped or untransposed tensor shows."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: dense.init_params(m, jax.random.key(0)))

    def leaf(path, s):
        scale = path[-1].key == "scale"
        x = rng.normal(1.0 if scale else 0.0, 0.1 if scale else 0.2, s.shape)
        return x.astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, shapes)


def same(a, b) -> bool:
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    return [p for p, _ in la] == [p for p, _ in lb] and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for (_, x), (_, y) in zip(la, lb))


# ------------------------------------------------------------------------------ the reference


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def hf_llama_forward(hf: dict, t: dict, ids: np.ndarray) -> np.ndarray:
    """``LlamaForCausalLM(ids).logits`` in float64 from the HF config dict and the HF-named tensors."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    H, K, eps = hf["num_attention_heads"], hf["num_key_value_heads"], hf["rms_norm_eps"]
    hd = hf["head_dim"]
    T = len(ids)
    inv_freq = 1.0 / (hf["rope_theta"] ** (np.arange(0, hd, 2) / hd))
    emb = np.concatenate([np.outer(np.arange(T), inv_freq)] * 2, -1)  # [T, hd]
    cos, sin = np.cos(emb), np.sin(emb)
    h = t["model.embed_tokens.weight"][ids]
    for i in range(hf["num_hidden_layers"]):
        p = lambda n: t[f"model.layers.{i}.{n}"]  # noqa: E731
        x = _rms(h, p("input_layernorm.weight"), eps)
        q, k, v = (x @ p(f"self_attn.{n}_proj.weight").T + t.get(f"model.layers.{i}.self_attn.{n}_proj.bias", 0.0)
                   for n in "qkv")  # Qwen2-MoE's q/k/v have biases
        q, k, v = (y.reshape(T, -1, hd).transpose(1, 0, 2) for y in (q, k, v))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, H // K, axis=0), np.repeat(v, H // K, axis=0)  # repeat_kv
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = (a @ v).transpose(1, 0, 2).reshape(T, H * hd)
        h = h + o @ p("self_attn.o_proj.weight").T
        h = h + _hf_mlp(hf, t, i, _rms(h, p("post_attention_layernorm.weight"), eps))
    h = _rms(h, t["model.norm.weight"], eps)
    head = t["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else t["lm_head.weight"]
    return h @ head.T


def _swiglu(x, gate, up, down):
    g = x @ gate.T
    return (g / (1 + np.exp(-g)) * (x @ up.T)) @ down.T


def _hf_mlp(hf: dict, t: dict, i: int, x: np.ndarray) -> np.ndarray:
    """Layer ``i``'s feed-forward as ``transformers`` computes it: Llama's SwiGLU, Mixtral's sparse
    block (softmax, top-k, renormalised), or Qwen2-MoE's (sparse every ``decoder_sparse_step``-th
    layer, ``norm_topk_prob``, plus a shared expert scaled by ``sigmoid(x W_g)``)."""
    p = lambda n: t[f"model.layers.{i}.{n}"]  # noqa: E731
    kind = hf["model_type"]
    if kind == "llama" or (kind == "qwen2_moe" and (i + 1) % hf["decoder_sparse_step"]):
        return _swiglu(x, p("mlp.gate_proj.weight"), p("mlp.up_proj.weight"), p("mlp.down_proj.weight"))
    pre, (wg, wu, wd) = (("block_sparse_moe.", ("w1", "w3", "w2")) if kind == "mixtral" else
                         ("mlp.", ("gate_proj", "up_proj", "down_proj")))
    s = x @ p(pre + "gate.weight").T
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1)[:, :hf["num_experts_per_tok"]]
    w = np.take_along_axis(probs, top, -1)
    if kind == "mixtral" or hf["norm_topk_prob"]:
        w = w / w.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for n in range(len(x)):
        for r, e in enumerate(top[n]):
            e = pre + f"experts.{e}."
            y[n] += w[n, r] * _swiglu(x[n], p(e + f"{wg}.weight"), p(e + f"{wu}.weight"), p(e + f"{wd}.weight"))
    if kind == "qwen2_moe":
        shared = _swiglu(x, *(p(f"mlp.shared_expert.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")))
        y += shared / (1 + np.exp(-(x @ p("mlp.shared_expert_gate.weight").T)))
    return y


def write_hf(directory, m, params, **kw):
    hf_llama.write_checkpoint(str(directory), m, params, max_position_embeddings=64, **kw)
    return str(directory)


# ------------------------------------------------------------------------------ the format


def test_sharded_writing_holds_one_shard_and_reads_back(tmp_path):
    """Past max_shard_bytes the weights go to shards with an index (as save_pretrained writes them),
    each shard built and written alone: host allocations while writing stay within one shard plus
    bookkeeping, where one file would hold every tensor at once."""
    st = pytest.importorskip("safetensors.numpy")
    m = model_cfg(vocab_size=4096, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384)
    params = random_params(m, seed=6)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    shard = total // 4
    tracemalloc.start()
    try:
        files = hf_llama.write_checkpoint(str(tmp_path), m, params, 64, max_shard_bytes=shard)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(files) >= 4 and not (tmp_path / "model.safetensors").exists()
    largest = max(x.nbytes for x in jax.tree.leaves(params)) // m.n_layers  # a layer's row, or the table
    largest = max(largest, m.vocab_size * m.d_model * 4)
    assert peak < max(shard, largest) + (1 << 20), (peak, shard, largest, total)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(files)
    assert index["metadata"]["total_size"] == total
    tensors = {}
    for f in files:
        tensors.update(st.load_file(str(tmp_path / f)))
    assert set(tensors) == set(index["weight_map"])
    assert same(hf_llama.read_params(m, str(tmp_path)), params)
    assert hf_llama.SafetensorsFile(str(tmp_path / files[0])).metadata == {"format": "pt"}


# ------------------------------------------------------------------------------ the mapping


@pytest.mark.parametrize("tied", [False, True])
def test_imported_weights_compute_hf_llama(tmp_path, tied):
    """GQA (4 query heads on 2 K/V heads), RoPE theta 500000, tied or untied head: the dense model
    on the imported weights gives LlamaForCausalLM's logits (NumPy float64 reference)."""
    m = model_cfg(tie_embeddings=tied)
    params = random_params(m)
    d = write_hf(tmp_path, m, params)
    hf = json.loads((tmp_path / "config.json").read_text())
    f = hf_llama.SafetensorsFile(str(tmp_path / "model.safetensors"))
    tensors = {n: f.tensor(n) for n in f.names()}
    assert ("lm_head.weight" in tensors) == (not tied)
    ids = np.random.default_rng(1).integers(0, m.vocab_size, 11)
    want = hf_llama_forward(hf, tensors, ids)
    got = np.asarray(dense.forward(m, hf_llama.read_params(m, d), ids[None]))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_round_trip_is_bit_identical_also_sharded(tmp_path):
    m = model_cfg()
    params = random_params(m, seed=3)
    d = write_hf(tmp_path / "one", m, params)
    assert same(hf_llama.read_params(m, d), params)
    # The same tensors over two shards with model.safetensors.index.json, as save_pretrained shards.
    single = hf_llama.SafetensorsFile(os.path.join(d, "model.safetensors"))
    names = sorted(single.names())
    sharded = tmp_path / "two"
    sharded.mkdir()
    (sharded / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        fn = f"model-0000{k + 1}-of-00002.safetensors"
        hf_llama.write_safetensors(str(sharded / fn), [(n, single.shape(n), np.float32, lambda n=n: single.tensor(n))
                                                       for n in part])
        weight_map.update({n: fn for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert same(hf_llama.read_params(m, str(sharded)), params)


def test_bfloat16_checkpoints_widen_exactly(tmp_path):
    """SmolLM2's published weights are bfloat16: each widens to the float32 parameter exactly."""
    m = model_cfg(tie_embeddings=True)
    params = random_params(m, seed=4)
    d = write_hf(tmp_path, m, params, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    want = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    assert same(hf_llama.read_params(m, d), want)
    assert not same(want, params)


def test_loading_costs_the_parameters_not_a_copy_of_the_file(tmp_path):
    """The tensors are read one at a time from a memory map: host allocations while loading stay
    within the parameters' own bytes plus one tensor, while a whole-file read would add the file's
    size."""
    m = model_cfg(vocab_size=4096, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384)
    params = random_params(m)
    d = write_hf(tmp_path, m, params)
    del params
    total = sum(x.size * 4 for x in jax.tree.leaves(dense.abstract_params(m)))
    largest = max(x.size * 4 for x in jax.tree.leaves(dense.abstract_params(m)))
    file_size = os.path.getsize(os.path.join(d, "model.safetensors"))
    assert file_size > 0.99 * total
    tracemalloc.start()
    try:
        loaded = hf_llama.read_params(m, d)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(x.nbytes for x in jax.tree.leaves(loaded)) == total
    assert peak < total + largest + (1 << 20), (peak, total, largest)  # the destination, one tensor, bookkeeping


# ------------------------------------------------------------------------------ mismatches


def _error(m, d) -> str:
    with pytest.raises(HFCheckpointError) as e:
        hf_llama.read_params(m, d)
    return str(e.value)


def test_config_mismatch_names_each_field_and_its_flag(tmp_path):
    m = model_cfg()
    d = write_hf(tmp_path, m, random_params(m))
    msg = _error(model_cfg(d_model=64, rope_theta=10000.0, n_kv_heads=4, tie_embeddings=True), d)
    for want in ("--config.model.d_model=32", "--config.model.rope_theta=500000.0", "--config.model.n_kv_heads=2",
                 "--config.model.tie_embeddings=False"):
        assert want in msg, msg
    assert "d_ff" not in msg


def test_tensor_shape_and_dtype_mismatches_name_the_tensor(tmp_path):
    m = model_cfg()
    d = write_hf(tmp_path, m, random_params(m))
    f = hf_llama.SafetensorsFile(os.path.join(d, "model.safetensors"))
    tensors = {n: np.array(f.tensor(n)) for n in f.names()}
    del f
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)  # n_kv_heads 4's shape
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.2.mlp.up_proj.weight"].astype(np.float64)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    del tensors["model.norm.weight"]
    hf_llama.write_safetensors(os.path.join(d, "model.safetensors"),
                               [(n, x.shape, x.dtype, lambda x=x: x) for n, x in tensors.items()])
    msg = _error(m, d)
    assert "'model.layers.1.self_attn.k_proj.weight' has shape [32, 32], config.model needs [16, 32]" in msg, msg
    assert "'model.layers.2.mlp.up_proj.weight' has dtype F64" in msg
    assert "'model.norm.weight' is missing" in msg
    assert "model.layers.0.self_attn.q_proj.bias" in msg


@pytest.mark.parametrize("change, says", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "only Llama-family"),
    ({"attention_bias": True}, "no biases"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "plain RoPE"),
    ({"hidden_act": "gelu"}, "SwiGLU"),
    ({"rope_interleaved": True}, "rotate halves"),
])
def test_unsupported_architectures_are_refused(tmp_path, change, says):
    m = model_cfg()
    d = write_hf(tmp_path, m, random_params(m))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
    assert says in _error(m, d)


MOE_EXPORTS = {
    "mixtral": dict(num_experts=4, top_k=2, expert_d_ff=16, every=1, shared_experts=0),
    "qwen2_moe": dict(num_experts=4, top_k=2, expert_d_ff=16, every=2, shared_experts=1, normalize_gates=False),
}


@pytest.mark.parametrize("arch", list(MOE_EXPORTS))
def test_moe_exports_compute_mixtral_and_qwen2_moe(tmp_path, arch):
    """An MoE model's export, run by a NumPy float64 forward of the Hugging Face architecture its
    config names (softmax top-k routing; Qwen2-MoE's dense layers, sigmoid-gated shared expert and
    q/k/v biases), gives the model's own (dropless) logits."""
    from asyncpp_jax.models import decode, hf_moe

    m = model_cfg(n_layers=4, tie_embeddings=arch == "qwen2_moe")
    m.moe.update(MOE_EXPORTS[arch])
    params = random_params(decode.inference_config(m))
    hf_moe.write_checkpoint(str(tmp_path), m, params, max_position_embeddings=64, eos_token_id=1)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == arch and hf["architectures"] == [hf_moe.ARCHITECTURES[arch]]
    f = hf_llama.SafetensorsFile(str(tmp_path / "model.safetensors"))
    tensors = {n: f.tensor(n) for n in f.names()}
    ids = np.random.default_rng(2).integers(0, m.vocab_size, 9)
    want = hf_llama_forward(hf, tensors, ids)
    cfg = decode.inference_config(m)
    got = np.asarray(jax.jit(lambda p, x: dense.forward(cfg, p, x))(params, ids[None]))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("change, says", [
    (dict(gating="sigmoid", shared_experts=1), "config.model.moe.gating='sigmoid'"),
    (dict(every=2), "config.model.moe.every=2 without shared experts"),
    (dict(normalize_gates=False), "config.model.moe.normalize_gates=False without shared experts"),
])
def test_moe_runs_without_a_counterpart_are_refused_naming_the_settings(tmp_path, capsys, change, says):
    c = configs.base_config()
    c.model.update(n_layers=4)
    c.model.moe.update(num_experts=4, top_k=2, expert_d_ff=16, **change)
    (tmp_path / "config.json").write_text(configs.to_json(c))
    assert export.main([f"--workdir={tmp_path}", f"--out={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Hugging Face counterpart" in err and says in err, err
    assert not (tmp_path / "out").exists()


def test_model_overrides_read_smollm2_135m_config():
    """SmolLM2-135M's config.json (its published values) gives the dense135m shape."""
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
          "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
          "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000, "rope_scaling": None,
          "tie_word_embeddings": True, "hidden_act": "silu", "head_dim": 64, "max_position_embeddings": 8192,
          "rope_interleaved": False, "is_llama_config": True, "pretraining_tp": 1}
    c = configs.load_file("configs/dense135m.py")
    assert hf_llama.config_errors(c.model, hf, "config.json") == []
    over = hf_llama.model_overrides(hf)
    assert over == {"vocab_size": 49152, "d_model": 576, "n_layers": 30, "n_heads": 9, "d_ff": 1536, "norm_eps": 1e-5,
                    "tie_embeddings": True, "n_kv_heads": 3, "head_dim": 0, "rope_theta": 100000.0}


# ------------------------------------------------------------------------------ every runner's layout


def run_config(m, **pipeline):
    c = configs.base_config()
    c.model.update(m.to_dict())
    c.data.seq_len = 16
    c.train.update(global_batch_size=8, microbatches=2, steps=4)
    c.optimizer.warmup_steps = 1
    c.pipeline.update(**pipeline)
    return c


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("pipeline", [{}, {"stages": 2, "schedule": "2bw"},
                                      {"stages": 2, "schedule": "sync", "stage_layers": (1, 3)}])
def test_init_from_under_every_runner_layout(tmp_path, pipeline):
    """The runner's jitted init (what the trainer runs, with the state's shardings) starts from
    the checkpoint: simulate, the engine's even split and its padded uneven split, tied table."""
    m = model_cfg(n_layers=4, tie_embeddings=True)
    params = random_params(m, seed=5)
    m.init_from = "hf:" + write_hf(tmp_path, m, params)
    c = configs.resolve(run_config(m, **pipeline))
    configs.validate(c)
    r = runner_lib.build(c, jax.devices()[:c.pipeline.stages])
    key = jax.random.key(0)
    shardings = jax.tree.map(lambda x: x.sharding, r.abstract_state(key))
    state = jax.jit(r.init_fn(), out_shardings=shardings)(key)
    got = jax.device_get(state.params)
    if r.pipelined:
        assert got["embed"]["embedding"].shape == (m.d_model, m.vocab_size)  # the engine's layout
        got = engine.to_model_layout(c.model, got, r.stage_rows)
    assert same(got, params)


def test_init_from_errors_before_anything_compiles(tmp_path):
    m = model_cfg()
    d = write_hf(tmp_path, m, random_params(m))
    c = configs.resolve(run_config(model_cfg(d_ff=64, init_from="hf:" + d)))
    r = runner_lib.build(c, jax.devices()[:1])
    with pytest.raises(HFCheckpointError, match="--config.model.d_ff=48"):
        r.init_fn()
    c.model.init_from = "hf:" + str(tmp_path / "nowhere")
    with pytest.raises(HFCheckpointError, match="no config.json"):
        runner_lib.build(c, jax.devices()[:1]).init_fn()


def test_init_from_is_checked_before_any_data_is_prepared(tmp_path, monkeypatch, cache_dir):
    """At FineWeb scale the corpus takes hours to prepare: a checkpoint that does not fit the
    config is reported before that starts."""
    from helpers import small_train_config

    from asyncpp_jax.train import trainer as trainer_lib

    def prepare(*_, **__):
        raise AssertionError("the corpus was prepared before the init_from check")

    monkeypatch.setattr(trainer_lib, "prepare_corpus_for", prepare)
    c = small_train_config(cache_dir, "init_from_first", 1, steps=2)
    hf = write_hf(tmp_path / "hf", c.model, random_params(c.model))
    c.model.update(d_ff=c.model.d_ff * 2, init_from="hf:" + hf)
    with pytest.raises(HFCheckpointError, match=f"--config.model.d_ff={c.model.d_ff // 2}"):
        trainer_lib.Trainer(c, tmp_path / "run")


# ------------------------------------------------------------------------------ export a run


_RUNS = {}


@pytest.fixture
def run_of(cache_dir, tmp_path_factory):
    """``run_of(name)``: a 4-update run of a 4-layer byte model (checkpoints at 2 and 4), once per
    module: the simulate runner's, or the engine's over an uneven split (its params padded, the
    tied table held as [D, V])."""
    from asyncpp_jax.train.trainer import Trainer
    from helpers import small_train_config

    def make(name):
        if name not in _RUNS:
            c = small_train_config(cache_dir, name, 1, steps=4, microbatches=2, eval_every=4, eval_batches=1,
                                   checkpoint_every=2)
            c.model.n_layers = 4
            if name == "pipeline":
                c.pipeline.update(stages=2, schedule="sync", stage_layers=(1, 3))
            t = Trainer(c, tmp_path_factory.mktemp(name))
            t.run()
            t.close()
            _RUNS[name] = t
        return _RUNS[name]

    return make


def _model_params(t):
    params = jax.device_get(t.state.params)
    if t.runner.pipelined:
        params = engine.to_model_layout(t.config.model, params, t.runner.stage_rows)
    return params


TEXTS = ["import json\n", "h\u00e9llo  w\u00f6rld\t\U0001F600", "", " x" * 700]


def _check_byte_tokenizer_files(d):
    """A byte-level run exports a tokenizer.json that encodes as the byte tokenizer does, and a
    tokenizer_config.json whose model_input_names leave out token_type_ids."""
    import tokenizers

    from asyncpp_jax.data.tokenizers import ByteTokenizer

    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == ByteTokenizer().encode(text).tolist() and tok.decode(ids) == text
    assert tok.token_to_id("<|endoftext|>") == 256 and tok.get_vocab_size() == 257
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["model_input_names"] == ["input_ids", "attention_mask"] and cfg["eos_token"] == "<|endoftext|>"


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("name", ["simulate", pytest.param("pipeline", marks=pytest.mark.slow)])
def test_export_reads_back_bit_identically(run_of, tmp_path, name, caplog):
    t = run_of(name)
    with caplog.at_level("WARNING"):
        assert export.main([f"--workdir={t.workdir}", f"--out={tmp_path}"]) == 0
    assert not [r for r in caplog.records if "orbax" in r.pathname or r.name == "absl"], caplog.text  # no library noise
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["vocab_size"], hf["tie_word_embeddings"]) == (4, 32, 257, True)
    assert hf["eos_token_id"] == 256
    _check_byte_tokenizer_files(tmp_path)
    info = json.loads((tmp_path / export.EXPORT_INFO).read_text())
    assert info["step"] == 4 and info["runner"] == name
    assert same(hf_llama.read_params(t.config.model, str(tmp_path)), _model_params(t))


@pytest.mark.slow  # a pipeline run: ~30 s
@pytest.mark.needs_devices(2)
def test_a_pipeline_export_starts_a_simulate_run(run_of, tmp_path):
    """The trainer's own fresh start (restore_or_init) from the engine run's export."""
    from asyncpp_jax.train.trainer import Trainer

    t = run_of("pipeline")
    export.export(t.workdir, tmp_path / "hf", log=lambda _: None)
    c = configs.resolve(t.config)
    c.pipeline.update(stages=1, stage_layers=(), schedule="sync", vocab_parallel=False, placement="spmd")
    c.model.init_from = f"hf:{tmp_path / 'hf'}"
    fresh = Trainer(c, tmp_path / "run")
    try:
        state, _ = fresh.restore_or_init()
    finally:
        fresh.close()
    assert int(state.step) == 0 and same(jax.device_get(state.params), _model_params(t))


def test_export_takes_the_newest_verified_checkpoint(run_of, tmp_path):
    import shutil

    work = tmp_path / "run"
    shutil.copytree(run_of("simulate").workdir, work)
    damaged = next(p for p in sorted((work / "checkpoints" / "4" / "state").rglob("*")) if p.is_file() and p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[0] ^= 0xFF
    damaged.write_bytes(bytes(data))
    info = export.export(work, tmp_path / "out", log=lambda _: None)
    assert info["step"] == 2
    with pytest.raises(export.ExportError, match="step 4: .*checksum"):
        export.export(work, tmp_path / "out4", step=4)
    assert export.main([f"--workdir={tmp_path / 'nothing'}", f"--out={tmp_path / 'x'}"]) == 1


# ------------------------------------------------------------------------------ generate from a run


def test_generate_command_continues_the_prompt_from_the_checkpoint(run_of, capsys):
    """``python -m asyncpp_jax.generate`` on the run: greedy, with the cache, equals greedy by the
    full forward (tests/test_generate.py has the model-level tests)."""
    from test_generate import greedy_without_cache

    from asyncpp_jax import generate, trained

    t = run_of("simulate")
    assert generate.main([f"--workdir={t.workdir}", "--prompt=import json", "--max_new_tokens=8"]) == 0
    printed = capsys.readouterr().out
    model = trained.load(t.workdir)
    assert model.step == 4 and same(jax.device_get(model.params), _model_params(t))
    ids = [int(i) for i in model.tokenizer.encode("import json")]
    want = greedy_without_cache(model.model_cfg, model.params, ids, 8)
    if model.tokenizer.eos_id in want:
        want = want[:want.index(model.tokenizer.eos_id) + 1]
    assert printed == "import json" + model.tokenizer.decode(want) + "\n"


@pytest.mark.slow  # lm-eval's own start-up: ~20 s
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                    reason="lm-eval is not installed (pip install 'lm-eval>=0.4,<0.5'); tests/test_evaluate.py "
                    "checks the adapter's arithmetic without it")
def test_evaluate_command_scores_the_run_on_a_local_task(run_of, tmp_path, capsys, monkeypatch):
    from test_evaluate import TASKS, write_tasks

    from asyncpp_jax import evaluate

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = run_of("simulate")
    tasks = write_tasks(tmp_path)
    args = [f"--workdir={t.workdir}", f"--include_path={tasks}", f"--output={tmp_path / 'r.json'}"]
    assert evaluate.main(args + ["--tasks=" + ",".join(TASKS)]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    assert set(results["results"]) == set(TASKS) and results["asyncpp_jax"]["step"] == 4
    assert "tiny_choice" in capsys.readouterr().out
    assert evaluate.main(args + ["--tasks=no_such_task"]) == 2
    assert "lm-eval has no task no_such_task" in capsys.readouterr().err


@pytest.mark.slow  # imports torch and transformers: ~15 s
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
                    reason="transformers and torch are not installed (pip install torch transformers); the files are "
                    "checked against the tokenizers package and the NumPy reference without them")
def test_transformers_loads_a_byte_run_export_and_generates_as_the_run_does(run_of, tmp_path):
    """AutoTokenizer and AutoModelForCausalLM on a byte-level run's export: the tokenizer encodes as
    the run's, the logits are the model's, and ``generate(**tok(text, return_tensors='pt'))``
    (which fails on transformers 4.57 when the tokenizer also returns token_type_ids) continues
    greedily as ``python -m asyncpp_jax.generate`` does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncpp_jax import trained
    from asyncpp_jax.data.tokenizers import ByteTokenizer
    from asyncpp_jax.models import decode

    t = run_of("simulate")
    export.export(t.workdir, tmp_path, log=lambda _: None)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert tok(text)["input_ids"] == ByteTokenizer().encode(text).tolist()
    batch = tok("import json", return_tensors="pt")
    assert "token_type_ids" not in batch
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        logits = model(**batch).logits[0].numpy()
    ours = trained.load(t.workdir)
    ids = batch["input_ids"][0].tolist()
    want = np.asarray(dense.forward(ours.model_cfg, ours.params, np.asarray([ids])))[0]
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    new = decode.Generator(ours.model_cfg, ours.params).generate([ids], decode.Sampling(max_new_tokens=6), [256])[0]
    assert out[0, len(ids):].tolist()[:len(new)] == new


@pytest.mark.slow  # imports torch and transformers: ~15 s
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
                    reason="transformers and torch are not installed (pip install torch transformers); the MoE "
                    "mapping is checked against a NumPy forward of both architectures without them")
@pytest.mark.parametrize("arch", list(MOE_EXPORTS))
def test_transformers_runs_moe_exports(tmp_path, arch):
    import torch
    from transformers import AutoModelForCausalLM

    from asyncpp_jax.models import decode, hf_moe

    m = model_cfg(n_layers=4, tie_embeddings=arch == "qwen2_moe")
    m.moe.update(MOE_EXPORTS[arch])
    params = random_params(decode.inference_config(m))
    hf_moe.write_checkpoint(str(tmp_path), m, params, max_position_embeddings=64, eos_token_id=1)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(model).__name__ == hf_moe.ARCHITECTURES[arch]
    ids = np.random.default_rng(2).integers(0, m.vocab_size, 9)
    with torch.no_grad():
        logits = model(torch.as_tensor(ids[None])).logits[0].numpy()
    want = np.asarray(dense.forward(decode.inference_config(m), params, ids[None]))[0]
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_export_out_must_be_a_new_or_empty_directory(run_of, tmp_path, capsys):
    """Before: a traceback for --out on a file or below one, and an export into a non-empty directory
    mixed a stale tokenizer and shard index with the new weights.  Now exit 2 with one line; --replace
    removes the export's own files and leaves the others."""
    work = run_of("simulate").workdir
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out in (a_file, a_file / "below"):
        assert export.main([f"--workdir={work}", f"--out={out}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "an existing file, not a directory" in err and "Traceback" not in err
    out = tmp_path / "hf"
    out.mkdir()
    for stale in ("tokenizer.json", hf_llama.INDEX_FILE, "notes.txt"):
        (out / stale).write_text("{}")
    assert export.main([f"--workdir={work}", f"--out={out}"]) == 2
    assert "is not empty" in capsys.readouterr().err and not (out / "config.json").exists()
    assert export.main([f"--workdir={work}", f"--out={out}", "--replace"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", hf_llama.WEIGHTS_FILE, "notes.txt", export.EXPORT_INFO, "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json"])  # the stale index gone, the byte tokenizer's files new
    assert json.loads((out / "tokenizer.json").read_text()) != {}


def test_a_damaged_config_or_index_is_named_not_a_traceback(tmp_path):
    """Before: a JSONDecodeError or KeyError traceback for invalid JSON in config.json or an index
    without weight_map, and "config.json says 4096" (LlamaConfig's default) for a config.json
    without hidden_size.  Now an HFCheckpointError (a setting's error: one line, exit 2) naming the
    file and what is wrong with it."""
    m = model_cfg()
    d = pathlib.Path(write_hf(tmp_path, m, random_params(m)))
    good = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text('{"hidden_size": 32,')
    assert "config.json is not valid JSON" in _error(m, str(d))
    (d / "config.json").write_text(json.dumps({k: v for k, v in good.items() if k != "hidden_size"}))
    msg = _error(m, str(d))
    assert "config.json has no hidden_size" in msg and "4096" not in msg and "head_dim" not in msg, msg
    (d / "config.json").write_text(json.dumps(good))
    (d / hf_llama.INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    assert "has no weight_map" in _error(m, str(d))
