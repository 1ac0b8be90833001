"""Weighted data sources in one run: deterministic, resumable exactly, each source's share logged."""

import json

import numpy as np
import pytest

from asyncpp_jax import configs
from asyncpp_jax.data import load_mixture, make_eval_batches, make_train_dataset, make_train_iterator
from asyncpp_jax.data.pipeline import PackedWindows
from helpers import SMALL_MODEL, STDLIB

SOURCES = [(3.0, f"{STDLIB}/json/*.py"), (1.0, f"{STDLIB}/email/*.py")]
SEQ, BATCH = 16, 8


@pytest.fixture(scope="module")
def mixture(cache_dir):
    d = configs.base_config().data
    d.update(cache_dir=cache_dir, val_fraction=0.2)
    return load_mixture(d, SOURCES, log=lambda m: None)


def test_config_spec_is_parsed_and_checked():
    c = configs.base_config()
    c.data.mixture = f"3:{SOURCES[0][1]}; 1:hf:user/set:cfg"
    assert configs.mixture_sources(c) == [(3.0, SOURCES[0][1]), (1.0, "hf:user/set:cfg")]
    configs.validate(c)
    c.data.mixture = "0.5:stdlib;-1:x;stdlib"
    with pytest.raises(configs.ConfigError) as e:
        configs.validate(c)
    assert "entry '-1:x' must be WEIGHT:SOURCE" in str(e.value) and "entry 'stdlib' must be" in str(e.value)


def test_batches_follow_the_weights_and_come_from_their_source(mixture):
    assert mixture.weights == [0.75, 0.25]
    data = make_train_dataset(mixture, SEQ, BATCH, seed=3)
    again = make_train_dataset(mixture, SEQ, BATCH, seed=3)
    other = make_train_dataset(mixture, SEQ, BATCH, seed=4)
    windows = [{tuple(PackedWindows(c.tokens("train"), SEQ)[i]) for i in range(len(PackedWindows(c.tokens("train"), SEQ)))}
               for c in mixture.corpora]
    for s in range(5):
        batch = data[s]
        assert np.array_equal(batch, again[s]) and batch.shape == (BATCH, SEQ + 1)
        assert mixture.shares(s, BATCH) == {"data_share/0": 0.75, "data_share/1": 0.25}
        picked = [mixture.source_of(s * BATCH + r) for r in range(BATCH)]
        assert all(tuple(row) in windows[k] for row, k in zip(batch, picked))
    assert not all(np.array_equal(data[s], other[s]) for s in range(3))  # the seed reorders each source
    # Validation mixes the sources' held-out windows in the same proportions; nats/byte use their bytes.
    val = make_eval_batches(mixture, SEQ, 4, 2)
    assert len(val) == 2 and val[0].shape == (4, SEQ + 1)
    assert mixture.bytes_per_token("val") == pytest.approx(
        0.75 * mixture.corpora[0].bytes_per_token("val") + 0.25 * mixture.corpora[1].bytes_per_token("val"))


def test_iterator_resumes_exactly(mixture):
    it = make_train_iterator(mixture, SEQ, BATCH, seed=0)
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = make_train_iterator(mixture, SEQ, BATCH, seed=0)
    resumed.set_state(state)
    assert all(np.array_equal(a, next(resumed)) for a in expected)


def test_trainer_logs_each_sources_share(cache_dir, tmp_path):
    from asyncpp_jax.train.trainer import Trainer

    c = configs.base_config()
    c.model.update(**SMALL_MODEL)
    spec = ";".join(f"{w}:{s}" for w, s in SOURCES)
    c.data.update(mixture=spec, cache_dir=cache_dir, seq_len=SEQ, val_fraction=0.2)
    c.train.update(steps=2, global_batch_size=BATCH, eval_every=2, eval_batches=1, log_every=1, progress_bar=False,
                   loggers="jsonl")
    c.optimizer.update(warmup_steps=1)
    t = Trainer(c, tmp_path)
    try:
        result = t.run()
    finally:
        t.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["data_share/0"], r["data_share/1"]) for r in rows] == [(1, 0.75, 0.25), (2, 0.75, 0.25)]
    assert result.val_loss_per_byte == pytest.approx(result.val_loss / t.corpus.bytes_per_token("val"))
    assert not (tmp_path / "tensorboard").exists()  # config.train.loggers reached the trainer: jsonl only
