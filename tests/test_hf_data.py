"""The ``hf:`` data path offline: local parquet / JSON lines through ``datasets``' own loaders, a
trained byte-level BPE tokenizer of SmolLM2's kind, parallel and resumable preparation, and the
whole path from a parquet file to a per-byte validation loss and an exported model."""

import importlib.util
import json
import math
import os

import numpy as np
import pytest

from asyncpp_jax.data import corpus as corpus_lib
from asyncpp_jax.data import prepare as prepare_lib
from asyncpp_jax.data import sources as sources_lib
from asyncpp_jax.data import get_tokenizer, load_corpus, prepare_corpus
from asyncpp_jax.data.tokenizers import train_bpe
from helpers import STDLIB

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("datasets")


def stdlib_texts(n=120):
    """Real documents: paragraphs of a few stdlib modules (some repeated, as web text repeats)."""
    texts = []
    for name in ("json/decoder.py", "json/encoder.py", "email/utils.py", "email/message.py", "textwrap.py"):
        with open(os.path.join(STDLIB, name), encoding="utf-8") as f:
            texts += [p for p in f.read().split("\n\n") if p.strip()]
    return (texts * 2)[:n]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two parquet files and the same rows as JSON lines and as an Arrow stream (FineWeb-Edu's
    layout: a ``text`` column beside others), and a BPE tokenizer of vocabulary 384 trained on them."""
    root = tmp_path_factory.mktemp("hfdata")
    texts = stdlib_texts()
    (root / "parquet").mkdir()
    for k, part in enumerate((texts[:70], texts[70:])):
        table = pa.table({"id": [f"doc{k}-{i}" for i in range(len(part))], "text": part,
                          "score": [float(i % 5) for i in range(len(part))]})
        pq.write_table(table, root / "parquet" / f"train-{k:05d}.parquet")
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "url": "x"}) + "\n")
    table = pa.table({"text": texts, "url": ["x"] * len(texts)})
    with pa.OSFile(str(root / "docs.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)  # the Arrow stream format datasets writes
    tok = train_bpe(texts, 384, str(root / "tokenizer.json"))
    return root, texts, tok


def documents(corpus, split, tok):
    stream = np.asarray(corpus.tokens(split)).astype(np.int64)
    ends = np.flatnonzero(stream == tok.eos_id)
    return [tok.decode(d) for d in np.split(stream, ends + 1)[:-1]]


def test_parquet_jsonl_and_arrow_prepare_the_same_corpus(data, tmp_path):
    root, texts, tok_path = data
    tok = get_tokenizer(tok_path)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_id == 0 and tok.vocab_size == 384
    path = prepare_corpus(f"hf:parquet:{root}/parquet/*.parquet", tokenizer=tok_path, cache_dir=str(tmp_path),
                          val_fraction=0.2, log=lambda m: None, workers=1)
    corpus = load_corpus(path)
    assert os.path.basename(path).startswith("hf_parquet_parquet-hf-")
    assert corpus.meta["source_info"]["loader"] == "parquet" and corpus.meta["source_info"]["files"] == 2
    got = documents(corpus, "train", tok) + documents(corpus, "val", tok)
    assert sorted(got) == sorted(texts)  # every row once, byte-level BPE decodes exactly
    assert corpus.num_docs("val") > 0 and corpus.num_docs("train") > corpus.num_docs("val")
    # The split hashes the text (so duplicate rows never straddle it).
    assert all(sources_lib.unit_hash(0, t) < 0.2 for t in documents(corpus, "val", tok))
    assert all(sources_lib.unit_hash(0, t) >= 0.2 for t in documents(corpus, "train", tok))
    assert corpus.num_bytes("train") + corpus.num_bytes("val") == sum(len(t.encode()) for t in texts)
    for loader, files in (("json", "docs.jsonl"), ("arrow", "docs.arrow")):
        other = load_corpus(prepare_corpus(f"hf:{loader}:{root}/{files}", tokenizer=tok_path, cache_dir=str(tmp_path),
                                           val_fraction=0.2, log=lambda m: None, workers=1))
        assert other.path != corpus.path
        for split in ("train", "val"):
            assert other.meta["splits"][split]["shards"] == corpus.meta["splits"][split]["shards"]
    with pytest.raises(corpus_lib.CorpusError, match="hf_text_field"):
        prepare_corpus(f"hf:parquet:{root}/parquet/*.parquet", tokenizer=tok_path, cache_dir=str(tmp_path),
                       hf_text_field="body", log=lambda m: None, workers=1)
    with pytest.raises(corpus_lib.CorpusError, match="matches no file"):
        prepare_corpus(f"hf:parquet:{root}/nothing/*.parquet", cache_dir=str(tmp_path), log=lambda m: None)


def test_workers_and_an_interruption_change_nothing(data, tmp_path, monkeypatch):
    """Two tokenizing processes, or a prepare killed half way and run again (which resumes, not
    restarts), write the same shards as one uninterrupted process."""
    root, _, tok_path = data
    source = f"hf:parquet:{root}/parquet/*.parquet"
    monkeypatch.setattr(prepare_lib, "_ENCODE_GROUP_DOCS", 16)
    kw = dict(tokenizer=tok_path, val_fraction=0.2, shard_tokens=1500, log=lambda m: None)
    serial = load_corpus(prepare_corpus(source, cache_dir=str(tmp_path / "serial"), workers=1, **kw))
    assert len(serial.meta["splits"]["train"]["shards"]) > 2  # the stream crosses shards
    parallel = load_corpus(prepare_corpus(source, cache_dir=str(tmp_path / "parallel"), workers=2, **kw))

    real = sources_lib.hf_local_documents

    def dies_after_70(*args):
        for i, doc in enumerate(real(*args)):
            if i == 70:
                raise KeyboardInterrupt
            yield doc

    monkeypatch.setattr(sources_lib, "hf_local_documents", dies_after_70)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(source, cache_dir=str(tmp_path / "resumed"), workers=1, checkpoint_seconds=0, **kw)
    partial = [p for p in os.listdir(tmp_path / "resumed") if p.endswith(".partial")]
    assert len(partial) == 1 and "progress.json" in os.listdir(tmp_path / "resumed" / partial[0])
    monkeypatch.setattr(sources_lib, "hf_local_documents", real)
    logs = []
    resumed = load_corpus(prepare_corpus(source, cache_dir=str(tmp_path / "resumed"), workers=1,
                                         checkpoint_seconds=0, **{**kw, "log": logs.append}))
    assert any("resuming after 64 documents" in m for m in logs), logs  # 4 groups of 16 were recorded
    assert os.listdir(tmp_path / "resumed") == [os.path.basename(resumed.path)]
    for other in (parallel, resumed):
        assert other.meta["splits"] == serial.meta["splits"]
        assert np.array_equal(other.unigram_counts(), serial.unigram_counts())


def test_parquet_to_trained_model_to_hf_directory(data, tmp_path):
    """prepare (parquet, trained BPE) -> 20 updates -> validation loss per byte -> export with the
    tokenizer files."""
    from asyncpp_jax import configs, export
    from asyncpp_jax.train.trainer import Trainer

    root, _, tok_path = data
    c = configs.base_config()
    c.model.update(vocab_size=384, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
    c.data.update(source=f"hf:parquet:{root}/parquet/*.parquet", tokenizer=tok_path, cache_dir=str(tmp_path / "c"),
                  seq_len=32, val_fraction=0.2)
    c.train.update(steps=20, global_batch_size=8, eval_every=20, eval_batches=2, checkpoint_every=20,
                   progress_bar=False)
    c.optimizer.update(lr=1e-2, warmup_steps=2)
    t = Trainer(c, tmp_path / "run")
    result = t.run()
    t.close()
    assert result.status == "finished" and result.step == 20
    bpt = t.corpus.bytes_per_token("val")
    assert bpt > 1.5  # BPE tokens, not bytes
    assert result.val_loss_per_byte == pytest.approx(result.val_loss / bpt, rel=1e-12)
    assert result.val_loss < math.log(384)  # learned something beyond a uniform guess
    rows = [json.loads(x) for x in (t.workdir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 20 and rows[-1]["val_loss_per_byte"] == pytest.approx(result.val_loss_per_byte)

    out = tmp_path / "hf"
    export.export(t.workdir, out, log=lambda _: None)
    assert (out / "tokenizer.json").read_bytes() == open(tok_path, "rb").read()
    hf = json.loads((out / "config.json").read_text())
    assert hf["eos_token_id"] == 0 and hf["vocab_size"] == 384
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"


# ------------------------------------------------------------------------------ the paper preset, rehearsed


def test_rehearsal_is_the_paper_preset_with_its_data_offline(tmp_path):
    """The rehearsal's command is the paper preset's 135M run (its config file, its data settings'
    kinds: an hf: source through datasets and a tokenizer.json) with the source moved to local
    parquet and only size settings changed; the model keeps dense135m's shape but its depth."""
    from asyncpp_jax import configs, rehearse
    from experiments.studies import common

    config_file, paper, _, _ = common.preset("paper", "135m")
    assert rehearse.CONFIG == config_file
    over = rehearse.rehearsal_overrides(str(tmp_path), vocab=49152, layers=2, steps=4, batch=4, seq_len=256)
    assert paper["data.source"].startswith("hf:") and over["data.source"].startswith("hf:parquet:")
    assert over["data.tokenizer"].endswith("tokenizer.json") and "data.tokenizer" in paper
    assert set(paper) - {"train.steps"} <= set(over)  # every other setting of the preset is a data setting
    size = {"model.vocab_size", "model.n_layers", "data.seq_len", "train.global_batch_size", "train.microbatches",
            "train.steps", "optimizer.warmup_steps", "train.eval_every", "train.eval_batches",
            "train.checkpoint_every", "hardware", "data.cache_dir"}
    assert set(over) - set(paper) <= size
    full = configs.load_file(config_file)
    c = configs.load_file(config_file)
    for k, v in over.items():
        section, _, field = k.rpartition(".")
        (c[section] if section else c)[field] = v
    configs.validate(configs.resolve(c))
    keep = ("d_model", "n_heads", "n_kv_heads", "d_ff", "rope_theta", "tie_embeddings", "compute_dtype", "remat",
            "vocab_size")
    assert {k: c.model[k] for k in keep} == {k: full.model[k] for k in keep}
    assert c.model.n_layers == 2 < full.model.n_layers


@pytest.mark.slow  # ~1 min on 2 busy cores: parquet, a BPE, prepare, compile and 2 updates of the dense135m width
def test_rehearsal_command_runs_the_paper_data_path(tmp_path):
    import subprocess
    import sys

    from asyncpp_jax import configs

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-m", "asyncpp_jax.rehearse", f"--workdir={tmp_path}", "--vocab=512",
                          "--max_files=40", "--steps=2", "--batch=2", "--seq_len=32"],
                         cwd=configs.REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "finished at step 2/2" in out.stdout and "nats/byte" in out.stdout
    assert "--config=configs/dense135m.py" in out.stderr and "hf:parquet:" in out.stderr
    (corpus_dir,) = [p for p in (tmp_path / "corpora").iterdir()]
    corpus = load_corpus(str(corpus_dir))
    assert corpus.meta["source_info"]["loader"] == "parquet" and corpus.vocab_size == 512
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["d_model"] == 576


def test_progress_reports_tokens_per_second_and_eta(data, monkeypatch):
    """The total comes from the parquet files' metadata (no read); the log line gives the rate and
    the ETA from the documents left."""
    root, texts, _ = data
    listing = sources_lib.list_local_files(f"{root}/parquet/*.parquet")
    assert sources_lib.count_rows("parquet", listing) == len(texts)
    assert sources_lib.count_rows("json", listing) is None
    calls = []
    monkeypatch.setattr(prepare_lib.time, "time", lambda: 100.0 if not calls.append(1) and len(calls) == 1 else 110.0)
    logs = []
    meter = prepare_lib._Progress(len(texts), 0, 0, logs.append, bar=False, every=0.0)
    meter.update(30, 50_000)  # 10 s for 30 of 120 documents: 5,000 tokens/s, 30 s to go
    meter.close()
    assert logs == ["corpus: 30 documents, 50000 tokens, 5,000 tokens/s, ETA 00:00:30"]


@pytest.mark.slow  # imports torch and transformers, and trains 2 updates: ~30 s
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
                    reason="transformers and torch are not installed (pip install torch transformers); the exported "
                    "tokenizer files are compared with the run's tokenizer.json without them")
def test_transformers_loads_a_bpe_run_export(data, tmp_path):
    """AutoTokenizer on a BPE run's export encodes as the run's tokenizer did, leaves out
    token_type_ids, and generate(**tok(text, return_tensors='pt')) runs on the exported model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncpp_jax import configs, export
    from asyncpp_jax.train.trainer import Trainer

    root, texts, tok_path = data
    c = configs.base_config()
    c.model.update(vocab_size=384, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
    c.data.update(source=f"hf:parquet:{root}/parquet/*.parquet", tokenizer=tok_path, cache_dir=str(tmp_path / "c"),
                  seq_len=32, val_fraction=0.2)
    c.train.update(steps=2, global_batch_size=8, eval_every=2, eval_batches=1, checkpoint_every=2, progress_bar=False)
    c.optimizer.update(lr=1e-2, warmup_steps=1)
    t = Trainer(c, tmp_path / "run")
    t.run()
    t.close()
    export.export(t.workdir, tmp_path / "hf", log=lambda _: None)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = get_tokenizer(tok_path)
    for text in texts[:20]:
        assert tok(text)["input_ids"] == ours.encode(text).tolist()
    inputs = tok("def main(", return_tensors="pt")
    assert "token_type_ids" not in inputs
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] > inputs["input_ids"].shape[1]
