"""The attention kernels (``config.model.attention``) compute the same function as the einsum path.

Whole decoders (MHA and GQA, tied and untied) are compared on their logits and on the gradient of
a scalar of the logits with respect to every parameter: ``dot_product`` and ``splash`` (run by
Pallas's interpreter on CPU, under -m slow) against ``xla``, within 1e-5 of the reference's
largest magnitude in fp32 and within bf16's rounding in bf16.  ``auto`` is ``xla`` on CPU, bit
for bit.

Checked by mutation when written: dropping the causal mask (``is_causal=False``; splash's
``CausalMask`` as a ``FullMask``) or swapping K and V makes each parity test fail.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncpp_jax import configs
from asyncpp_jax.configs import base_config
from asyncpp_jax.models import dense, layers

FP32_REL = 1e-5
BF16_REL = 2e-2  # a few bf16 roundings (eps 2^-8) of the largest value, through two layers


def _cfg(kv_heads: int, tied: bool, dtype: str, attention: str):
    m = base_config().model
    m.update(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads, d_ff=48,
             tie_embeddings=tied, compute_dtype=dtype, attention=attention)
    return m


@functools.cache
def _params(kv_heads: int, tied: bool):
    """fp32 master weights, shared by every kernel and compute dtype of a shape."""
    cfg = _cfg(kv_heads, tied, "float32", "xla")
    return jax.jit(lambda key: dense.init_params(cfg, key))(jax.random.key(0))


@functools.cache
def _logits_and_grads(kv_heads: int, tied: bool, dtype: str, attention: str, seq_len: int):
    cfg = _cfg(kv_heads, tied, dtype, attention)
    params = _params(kv_heads, tied)
    tokens = jax.random.randint(jax.random.key(1), (2, seq_len), 0, cfg.vocab_size)
    weights = jax.random.normal(jax.random.key(2), (2, seq_len, cfg.vocab_size))

    def scalar(p):
        logits = dense.Decoder(cfg).apply({"params": p}, tokens)
        return jnp.sum(logits * weights), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(scalar, has_aux=True))(params)
    return np.asarray(logits), jax.tree.map(np.asarray, grads)


def _assert_close(got, want, rel, what):
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = want
        for key in path:
            b = b[key.key]
        err, scale = np.max(np.abs(a - b)), np.max(np.abs(b))
        assert err <= rel * scale, f"{what} {jax.tree_util.keystr(path)}: max error {err:.3g} > {rel} x {scale:.3g}"


SHAPES = [(4, True), (2, True), (4, False), (2, False)]  # (kv heads of 4, tied): MHA/GQA x tied/untied
SHAPE_IDS = ["mha-tied", "gqa-tied", "mha-untied", "gqa-untied"]
DTYPES = [("float32", FP32_REL), ("bfloat16", BF16_REL)]
# Every (shape, dtype) is a case; GQA untied in fp32 (the strict 1e-5) runs in the default suite,
# the rest (two compiles each) under -m slow.
DEFAULT_CASES = {("gqa-untied", "fp32")}


def _cases():
    for shape, sid in zip(SHAPES, SHAPE_IDS):
        for (dtype, rel), did in zip(DTYPES, ("fp32", "bf16")):
            marks = () if (sid, did) in DEFAULT_CASES else (pytest.mark.slow,)
            yield pytest.param(*shape, dtype, rel, id=f"{sid}-{did}", marks=marks)


@pytest.mark.parametrize("kv_heads, tied, dtype, rel", list(_cases()))
def test_dot_product_equals_xla(kv_heads, tied, dtype, rel):
    want_logits, want_grads = _logits_and_grads(kv_heads, tied, dtype, "xla", 16)
    logits, grads = _logits_and_grads(kv_heads, tied, dtype, "dot_product", 16)
    _assert_close({"logits": logits}, {"logits": want_logits}, rel, f"{dtype} logits")
    _assert_close(grads, want_grads, rel, f"{dtype} gradient")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="auto is the einsum path on CPU only")
def test_auto_is_the_einsum_path_on_cpu_bit_for_bit():
    want_logits, want_grads = _logits_and_grads(2, False, "float32", "xla", 16)
    logits, grads = _logits_and_grads(2, False, "float32", "auto", 16)
    np.testing.assert_array_equal(logits, want_logits)
    jax.tree.map(np.testing.assert_array_equal, grads, want_grads)


def _splash_case(kv_heads, tied, dtype, rel):
    want_logits, want_grads = _logits_and_grads(kv_heads, tied, dtype, "xla", 128)
    logits, grads = _logits_and_grads(kv_heads, tied, dtype, "splash", 128)
    _assert_close({"logits": logits}, {"logits": want_logits}, rel, f"splash {dtype} logits")
    _assert_close(grads, want_grads, rel, f"splash {dtype} gradient")


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads, tied, dtype, rel", [p.values for p in _cases()], ids=[p.id for p in _cases()])
def test_splash_interpreted_equals_xla(kv_heads, tied, dtype, rel):
    """Splash's smallest block is 128 tokens, so these run at T = 128, through Pallas's interpreter
    (slow: all under -m slow; in the default suite tests/test_lowering.py holds the TPU module of
    this kernel to one built from the library's causal mask)."""
    _splash_case(kv_heads, tied, dtype, rel)


def test_splash_refuses_a_length_off_its_block():
    q = jnp.zeros((1, 100, 2, 8))
    with pytest.raises(ValueError, match="multiple of 128"):
        layers.splash_attention_kernel(q, q, q, interpret=True)


@pytest.mark.parametrize("platform, kernel", [("cpu", "xla"), ("cuda", "dot_product"), ("tpu", "splash")])
def test_auto_names_the_kernel_of_each_platform(platform, kernel):
    assert layers.auto_kernel(platform, 2048) == kernel
    assert layers.auto_kernel(platform, 100) == ("dot_product" if platform == "tpu" else kernel)


@pytest.mark.parametrize("hardware, dtype, stand_in", [
    ("tpu-v5p-95gb", "float32", "splash"), ("h100-80gb", "bfloat16", "splash"), ("h100-80gb", "float32", "xla"),
    ("t4-16gb", "bfloat16", "xla"), ("cpu", "bfloat16", "xla")])
def test_the_dry_run_compiles_a_blockwise_stand_in_where_the_target_fuses(hardware, dtype, stand_in):
    """auto on a TPU is splash; on an H100 in bf16 it is cuDNN's flash kernel (fp32 and a T4's
    Turing are XLA's attention); on CPU the einsum path."""
    from asyncpp_jax.train import dry_run

    c = configs.load_file("configs/tiny.py")
    c.hardware, c.model.compute_dtype, c.data.seq_len = hardware, dtype, 512
    assert dry_run.attention_stand_in(c) == stand_in
    c.data.seq_len = 500  # splash's blocks do not divide it: the einsum path, an over-estimate
    assert dry_run.attention_stand_in(c) == "xla"


@pytest.mark.slow
def test_the_dry_run_of_a_fused_target_holds_no_score_buffer():
    """The same step's dry run for an H100 (bf16: cuDNN's flash kernel) against the einsum path:
    the fused estimate is smaller by more than one layer's [B, K, G, T, T] fp32 scores."""
    from asyncpp_jax.train import dry_run

    c = configs.load_file("configs/tiny.py")
    c.model.update(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, compute_dtype="bfloat16")
    c.data.seq_len = 256
    c.train.update(global_batch_size=4, microbatches=1)
    c.hardware = "h100-80gb"
    peaks = {}
    for attention in ("auto", "xla"):
        c.model.attention = attention
        report = dry_run.dry_run(configs.resolve(c), jax.devices()[:1])
        assert report["attention_memory_stand_in"] == ("splash" if attention == "auto" else "xla")
        peaks[attention] = report["train_peak_bytes_per_device"]
    scores = 4 * c.model.n_heads * c.data.seq_len ** 2 * 4
    assert peaks["xla"] - peaks["auto"] > scores, peaks
