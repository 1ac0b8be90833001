"""Generation with a key/value cache (asyncpp_jax.models.decode, python -m asyncpp_jax.generate).

The reference is the model's own full forward (``dense.forward``) re-run on the growing sequence:
greedy decoding with the cache must pick the same token at every step, for a dense model and for
an MoE model with grouped layers and a shared expert.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncpp_jax import configs, generate
from asyncpp_jax.models import decode, dense


def model_cfg(**kw):
    m = configs.base_config().model
    m.update(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, rope_theta=10000.0,
             tie_embeddings=False)
    m.update(**kw)
    return m


MOE = dict(n_layers=4, moe=dict(num_experts=4, top_k=2, expert_d_ff=16, every=2, shared_experts=1,
                                 capacity_factor=1.0))


def random_params(m, seed=0, std=0.3):
    """Weights large enough that the logits have clear winners (a random model at init_std 0.02
    is nearly uniform, and a near tie could flip on float rounding alone); norm scales 1."""
    rng = np.random.default_rng(seed)
    shapes = dense.abstract_params(decode.inference_config(m))
    return jax.tree_util.tree_map_with_path(
        lambda path, s: np.ones(s.shape, np.float32) if path[-1].key == "scale"
        else rng.normal(0.0, std, s.shape).astype(np.float32), shapes)


def greedy_without_cache(m, params, prompt, n_new):
    """Greedy decoding by the full forward: position t's logits from ``forward(sequence)[t]``
    (one fixed length, zero-padded: the mask keeps later positions out of earlier ones)."""
    total = len(prompt) + n_new
    fwd = jax.jit(lambda p, x: dense.forward(decode.inference_config(m), p, x))
    seq = list(prompt)
    for _ in range(n_new):
        x = np.zeros((1, total), np.int32)
        x[0, :len(seq)] = seq
        seq.append(int(jnp.argmax(fwd(params, x)[0, len(seq) - 1])))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def dense_model():
    """A dense model and its Generator, shared so that each program compiles once."""
    m = model_cfg()
    params = random_params(m)
    return m, params, decode.Generator(m, params)


PROMPT = [3, 1, 4, 1, 5]


def test_greedy_with_the_cache_equals_the_full_forward(dense_model):
    m, params, gen = dense_model
    want = greedy_without_cache(m, params, PROMPT, 12)
    assert gen.generate([PROMPT], decode.Sampling(max_new_tokens=12))[0] == want
    assert len(set(want)) > 3  # not a constant stream, which a broken cache could also produce


@pytest.mark.slow  # ~15 s of compilation
def test_greedy_with_the_cache_equals_the_full_forward_moe():
    """MoE: grouped layers (a dense layer, then an MoE layer with a shared expert), top-2 of 4."""
    m = model_cfg(**MOE)
    params = random_params(m)
    want = greedy_without_cache(m, params, PROMPT, 8)
    assert decode.Generator(m, params).generate([PROMPT], decode.Sampling(max_new_tokens=8))[0] == want
    assert len(set(want)) > 2


@pytest.mark.slow  # ~8 s; the greedy test above fails too when the cache is broken
def test_cached_logits_equal_the_forward_at_every_position(dense_model):
    """Prefill half the sequence, then feed the rest one token at a time: every position's logits
    are the full forward's."""
    m, params, _ = dense_model
    cfg = decode.inference_config(m)
    x = np.random.default_rng(3).integers(0, m.vocab_size, (2, 10)).astype(np.int32)
    want = np.asarray(dense.forward(cfg, params, x))
    step = jax.jit(lambda p, t, c, s: decode.forward_cached(cfg, p, t, c, s))
    logits, cache = step(params, x[:, :6], decode.init_cache(cfg, 2, 16), jnp.int32(0))
    got = [np.asarray(logits)]
    for i in range(6, 10):
        logits, cache = step(params, x[:, i:i + 1], cache, jnp.int32(i))
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_stop_token_ends_a_row_and_is_kept(dense_model):
    _, _, gen = dense_model
    free = gen.generate([PROMPT], decode.Sampling(max_new_tokens=12))[0]
    stopped = gen.generate([PROMPT], decode.Sampling(max_new_tokens=12), stop_ids=[free[2]])[0]
    assert stopped == free[:free.index(free[2]) + 1]
    hot = [gen.generate([PROMPT], decode.Sampling(max_new_tokens=12, temperature=2.0, seed=k))[0] for k in (4, 5)]
    assert hot[0] != hot[1] and free not in hot  # the same compiled programs, sampling by seed


def test_top_p_keeps_the_nucleus_and_temperature_samples_it():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    keys = jax.random.key(0)
    sample = jax.jit(decode.sample)  # one program for every setting: temperature and top_p are traced
    draws = np.asarray(sample(logits, keys, temperature=1.0, top_p=0.7))
    assert set(draws.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 0.15 and 0.05 are cut
    np.testing.assert_allclose(np.bincount(draws, minlength=4)[:2] / 4000, [0.625, 0.375], atol=0.03)
    draws = np.asarray(sample(logits, keys, temperature=1.0, top_p=1.0))
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    assert set(np.asarray(sample(logits, keys, temperature=1.0, top_p=0.1)).tolist()) == {0}
    assert np.asarray(sample(logits, keys, temperature=0.0, top_p=1.0)).tolist() == [0] * 4000
    hot = np.asarray(sample(logits, keys, temperature=100.0, top_p=1.0))
    np.testing.assert_allclose(np.bincount(hot, minlength=4) / 4000, [0.25] * 4, atol=0.03)



def test_generate_command_refuses_bad_options_and_missing_runs(tmp_path, capsys):
    assert generate.main([f"--workdir={tmp_path}", "--prompt=x", "--top_p=0"]) == 2
    assert "--top_p=0.0 must be in (0, 1]" in capsys.readouterr().err
    assert generate.main([f"--workdir={tmp_path}", "--prompt=x"]) == 1
    assert "no config.json" in capsys.readouterr().err
