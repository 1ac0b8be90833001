"""Tests of the data layer: tokenizers, corpus preparation/caching/verification, grain pipelines.

All corpora here are tiny and built in tmp_path, so the file runs in seconds.
"""

import json
import math
import os

import numpy as np
import pytest

from asyncpp_jax.data import prepare as prepare_lib
from asyncpp_jax.data import sources as sources_lib
from asyncpp_jax.data.stream import ShardedStream
from asyncpp_jax.data import (
    ByteTokenizer,
    CorpusError,
    HFTokenizer,
    PackedWindows,
    assign_splits,
    get_tokenizer,
    list_local_files,
    list_stdlib_files,
    load_corpus,
    make_eval_batches,
    make_train_dataset,
    make_train_iterator,
    prepare_corpus,
)

# ------------------------------------------------------------------------------------------------
# Helpers


def _write_random_text_files(root, num_files=24, seed=0):
    """Random-letter documents, so every packed window has distinct content (windows are
    identified by content in the pipeline tests)."""
    rng = np.random.default_rng(seed)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz \n"))
    paths = []
    for i in range(num_files):
        sub = root / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"doc{i:02d}.txt"
        path.write_text("".join(rng.choice(alphabet, size=int(rng.integers(500, 1500)))))
        paths.append(path)
    return paths


@pytest.fixture
def text_dir(tmp_path):
    src = tmp_path / "src"
    _write_random_text_files(src)
    return src


@pytest.fixture
def prepared(tmp_path, text_dir):
    logs = []
    path = prepare_corpus(str(text_dir), cache_dir=str(tmp_path / "cache"), val_fraction=0.25,
                          log=logs.append)
    return path, logs


def _window_index(corpus, seq_len, split="train"):
    windows = PackedWindows(corpus.tokens(split), seq_len)
    index = {windows[i].tobytes(): i for i in range(len(windows))}
    assert len(index) == len(windows), "test corpus must have distinct windows"
    return windows, index


def _rows_to_indices(batches, index):
    return [index[row.tobytes()] for b in batches for row in b]


def _train_bpe(path, texts, special_tokens):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return str(path)


# ------------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    text = "héllo wörld ✓ 🚀\n\tend"
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    # eos separates documents and is dropped by decode.
    joined = np.concatenate([tok.encode("ab"), [tok.eos_id], tok.encode("cd")])
    assert tok.decode(joined) == "abcd"
    assert [a.tolist() for a in tok.encode_batch(["x", "yz"])] == [[120], [121, 122]]
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)


def test_get_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="config.data.tokenizer"):
        get_tokenizer("gpt2")
    with pytest.raises(ValueError, match="config.data.tokenizer"):
        get_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="config.data.tokenizer"):
        get_tokenizer(str(bad))
    with pytest.raises(ValueError, match="config.data.eos_token"):
        get_tokenizer("byte", eos_token="</s>")


def test_hf_tokenizer_round_trip_and_eos(tmp_path):
    texts = ["the quick brown fox jumps over the lazy dog", "hello world, héllo wörld"] * 20
    path = _train_bpe(tmp_path / "tokenizer.json", texts, ["<unk>", "</s>", "<|endoftext|>"])
    tok = get_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    # <|endoftext|> comes before </s> in the preference order.
    assert tok.eos_token == "<|endoftext|>" and tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
    assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)
    text = "the lazy fox says héllo ✓"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(np.concatenate([ids, [tok.eos_id]])) == text
    batch = tok.encode_batch([text, "hello"])
    assert batch[0].tolist() == ids.tolist() and batch[1].tolist() == tok.encode("hello").tolist()
    # A directory holding tokenizer.json also works; the fingerprint hashes the file's bytes.
    assert get_tokenizer(str(tmp_path)).fingerprint == tok.fingerprint
    assert tok.fingerprint.startswith("hf-") and len(tok.fingerprint) == 19

    explicit = get_tokenizer(path, eos_token="</s>")
    assert explicit.eos_id == tok._tok.token_to_id("</s>") != tok.eos_id
    with pytest.raises(ValueError, match="config.data.eos_token"):
        get_tokenizer(path, eos_token="<nope>")

    no_eos = _train_bpe(tmp_path / "other.json", texts, ["<unk>"])
    with pytest.raises(ValueError, match="config.data.eos_token"):
        get_tokenizer(no_eos)
    assert HFTokenizer(no_eos, eos_token="<unk>").fingerprint != tok.fingerprint


def test_prepare_with_hf_tokenizer(tmp_path, text_dir):
    texts = [p.read_text() for p in sorted(text_dir.rglob("*.txt"))]
    tok_path = _train_bpe(tmp_path / "tokenizer.json", texts, ["</s>"])
    corpus = load_corpus(prepare_corpus(str(text_dir), tokenizer=tok_path,
                                        cache_dir=str(tmp_path / "cache"), log=lambda m: None))
    tok = get_tokenizer(tok_path)
    assert corpus.meta["dtype"] == "uint16" and corpus.eos_id == tok.eos_id
    assert corpus.meta["tokenizer"]["fingerprint"] == tok.fingerprint
    stream = np.asarray(corpus.tokens("train"))
    docs = np.split(stream, np.flatnonzero(stream == tok.eos_id)[:-1] + 1)
    names = corpus.meta["splits"]["train"]["doc_names"]
    assert len(docs) == len(names)
    for doc, name in zip(docs, names):
        assert doc[-1] == tok.eos_id
        assert tok.decode(doc) == (text_dir / name).read_text()
    assert corpus.bytes_per_token("train") > 1.0  # BPE merges compress even random letters a bit


# ------------------------------------------------------------------------------------------------
# Corpus preparation


def test_prepared_format_matches_the_files(prepared, text_dir):
    path, logs = prepared
    corpus = load_corpus(path)
    assert os.path.basename(path).startswith("src-byte-")
    assert len(os.path.basename(path).rsplit("-", 1)[1]) == 16
    for split in ("train", "val"):
        names = corpus.meta["splits"][split]["doc_names"]
        data = [(text_dir / n).read_bytes() for n in names]
        expected = np.concatenate([np.append(np.frombuffer(d, np.uint8), 256) for d in data])
        np.testing.assert_array_equal(corpus.tokens(split), expected)
        assert corpus.num_bytes(split) == sum(len(d) for d in data)
        assert corpus.num_tokens(split) == corpus.num_bytes(split) + len(names)
        assert corpus.tokens(split).dtype == np.uint16
        assert not corpus.tokens(split).flags.writeable
    counts = np.load(os.path.join(path, "unigram_counts.npy"))
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts, np.bincount(corpus.tokens("train"), minlength=257))


def test_prepare_caches_and_key_tracks_inputs(tmp_path, prepared, text_dir):
    path, logs = prepared
    assert any("tokenizing" in m for m in logs)
    meta_mtime = os.stat(os.path.join(path, "meta.json")).st_mtime_ns
    logs2 = []
    again = prepare_corpus(str(text_dir), cache_dir=str(tmp_path / "cache"), val_fraction=0.25,
                           log=logs2.append)
    assert again == path
    assert any("using cached" in m for m in logs2) and not any("tokenizing" in m for m in logs2)
    assert os.stat(os.path.join(path, "meta.json")).st_mtime_ns == meta_mtime
    # Nothing but finished corpora is left in the cache dir.
    assert os.listdir(tmp_path / "cache") == [os.path.basename(path)]

    changed = text_dir / "part0" / "doc00.txt"
    changed.write_text(changed.read_text() + " more text")
    new_path = prepare_corpus(str(text_dir), cache_dir=str(tmp_path / "cache"), val_fraction=0.25,
                              log=lambda m: None)
    assert new_path != path
    def total_bytes(p):
        c = load_corpus(p)
        return c.num_bytes("train") + c.num_bytes("val")

    assert total_bytes(new_path) == total_bytes(path) + len(" more text")
    # Split settings are part of the key too.
    other = prepare_corpus(str(text_dir), cache_dir=str(tmp_path / "cache"), val_fraction=0.3,
                           log=lambda m: None)
    assert other not in (path, new_path)


def test_prepare_crash_leaves_no_corpus(tmp_path, text_dir, monkeypatch):
    real_documents = sources_lib.local_documents

    def crashing_documents(*args):
        gen = real_documents(*args)
        yield next(gen)
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(sources_lib, "local_documents", crashing_documents)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_corpus(str(text_dir), cache_dir=str(cache), log=lambda m: None)
    assert os.listdir(cache) == []  # neither a final directory nor the temp one survives
    monkeypatch.setattr(sources_lib, "local_documents", real_documents)
    load_corpus(prepare_corpus(str(text_dir), cache_dir=str(cache), log=lambda m: None))


def test_split_by_document_is_disjoint_and_deterministic(tmp_path, prepared, text_dir):
    path, _ = prepared
    meta = load_corpus(path).meta
    train = meta["splits"]["train"]["doc_names"]
    val = meta["splits"]["val"]["doc_names"]
    all_names = list_local_files(str(text_dir)).names
    assert val and train
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(all_names) and len(all_names) == 24
    # The documented rule: val iff sha256(f"{seed}:{name}") maps below val_fraction.
    assert set(val) == {n for n in all_names if sources_lib.unit_hash(0, n) < 0.25}
    # Same split from a fresh preparation elsewhere, and a different one for another seed.
    elsewhere = load_corpus(prepare_corpus(str(text_dir), cache_dir=str(tmp_path / "c2"),
                                           val_fraction=0.25, log=lambda m: None))
    assert elsewhere.meta["splits"]["val"]["doc_names"] == val
    assert assign_splits(all_names, 0.25, 0) == assign_splits(all_names, 0.25, 0)
    assert assign_splits(all_names, 0.25, 0) != assign_splits(all_names, 0.25, 1)


def _corpus_of(tmp_path, docs, **prepare):
    """A corpus prepared from the given ``{file name: text}`` documents."""
    src = tmp_path / "src"
    src.mkdir()
    for name, text in docs.items():
        (src / name).write_text(text)
    return load_corpus(prepare_corpus(str(src), cache_dir=str(tmp_path / "cache"), log=lambda m: None, **prepare))


def test_tiny_corpus_still_gets_a_val_split(tmp_path):
    corpus = _corpus_of(tmp_path, {"a.txt": "first document", "b.txt": "second document"}, val_fraction=1e-6)
    assert corpus.num_docs("train") == 1 and corpus.num_docs("val") == 1
    assert assign_splits(["a", "b"], 0.999999, 0).count(True) == 1  # train kept non-empty too
    src = tmp_path / "src"
    (src / "b.txt").unlink()
    with pytest.raises(CorpusError, match="at least 2"):
        prepare_corpus(str(src), cache_dir=str(tmp_path / "cache"), log=lambda m: None)
    with pytest.raises(CorpusError, match="config.data.val_fraction"):
        assign_splits(["a", "b"], 0.0, 0)


def test_local_source_forms(tmp_path, text_dir):
    (text_dir / ".hidden").write_text("skip me")
    by_dir = list_local_files(str(text_dir))
    assert len(by_dir.names) == 24 and ".hidden" not in by_dir.names
    assert by_dir.names == tuple(sorted(by_dir.names))
    assert by_dir.names[0] == os.path.join("part0", "doc00.txt")
    by_glob = list_local_files(str(text_dir / "**" / "doc0*.txt"))
    assert len(by_glob.names) == 10
    single = str(text_dir / "part1" / "doc01.txt")
    combined = list_local_files(f"{text_dir / 'part0'},{single},{single}")
    assert len(combined.names) == 8 + 1  # deduplicated
    assert os.path.join("part1", "doc01.txt") in combined.names
    with pytest.raises(CorpusError, match="config.data.source"):
        list_local_files(str(tmp_path / "nothing" / "*.txt"))
    with pytest.raises(CorpusError, match="config.data.source"):
        prepare_corpus(str(tmp_path / "missing_dir"), cache_dir=str(tmp_path / "c"), log=print)


def test_hf_source_without_datasets_says_how_to_install(tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(CorpusError, match="pip install datasets"):
        prepare_corpus("hf:HuggingFaceFW/fineweb-edu:sample-10BT", cache_dir=str(tmp_path),
                       log=lambda m: None)
    assert os.listdir(tmp_path) == []  # the temp build directory was cleaned up


def test_hf_source_streams_rows_and_splits_by_text(tmp_path, monkeypatch):
    import sys
    import types
    calls = []
    rows = [{"text": f"row {i % 40} " * (1 + i % 5), "id": i} for i in range(100)]

    def load_dataset(name, config_name, split, streaming):
        calls.append((name, config_name, split, streaming))
        return iter(rows)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    path = prepare_corpus("hf:org/set:cfg", cache_dir=str(tmp_path), val_fraction=0.2,
                          hf_split="train", hf_max_docs=80, log=lambda m: None)
    assert calls == [("org/set", "cfg", "train", True)]
    corpus = load_corpus(path)
    assert os.path.basename(path).startswith("hf_org_set_cfg-byte-")
    assert corpus.num_docs("train") + corpus.num_docs("val") == 80
    assert corpus.num_docs("val") > 0
    # Rows go by the hash of their text, so duplicates (row i and row i + 40) share a split.
    texts = {s: ByteTokenizer().decode(corpus.tokens(s)) for s in ("train", "val")}
    for i in range(40):
        in_val = f"row {i} " in texts["val"]
        assert in_val != (f"row {i} " in texts["train"])
        assert in_val == (sources_lib.unit_hash(0, rows[i]["text"]) < 0.2)
    # Two rows and a tiny val_fraction: the held-back row keeps the val split non-empty.
    tiny = load_corpus(prepare_corpus("hf:org/set", cache_dir=str(tmp_path), val_fraction=1e-9,
                                      hf_max_docs=2, log=lambda m: None))
    assert tiny.num_docs("train") == 1 and tiny.num_docs("val") == 1
    with pytest.raises(CorpusError, match="config.data.hf_text_field"):
        prepare_corpus("hf:org/set", cache_dir=str(tmp_path), hf_text_field="content",
                       log=lambda m: None)


def test_stdlib_listing_and_split():
    listing = list_stdlib_files()
    assert len(listing.names) > 1000
    assert all(n.endswith(".py") for n in listing.names)
    assert not any("site-packages" in n or "dist-packages" in n for n in listing.names)
    assert list(listing.names) == sorted(listing.names)
    assert "os.py" in listing.names and os.path.join("json", "decoder.py") in listing.names
    is_val = assign_splits(listing.names, 0.05, 0)
    assert 0.02 < sum(is_val) / len(is_val) < 0.09
    assert is_val == assign_splits(listing.names, 0.05, 0)


def test_cli_prints_path_and_stats(tmp_path, text_dir, capsys):
    rc = prepare_lib.main([f"--source={text_dir}", "--tokenizer=byte",
                          f"--cache_dir={tmp_path / 'cache'}"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    load_corpus(out[0])
    assert out[1].startswith("train: ") and out[2].startswith("val: ")
    assert "val_cross_entropy" in out[-1]


# ------------------------------------------------------------------------------------------------
# Corrupt corpora


def _edit_meta(path, fn):
    meta_path = os.path.join(path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    fn(meta)
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def _truncate_shard(path):
    shard = os.path.join(path, "train-00000.bin")
    os.truncate(shard, os.path.getsize(shard) - 2)


def _flip_byte(path):
    shard = os.path.join(path, "val-00000.bin")
    with open(shard, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))


def _bump_tokens(meta):
    meta["splits"]["train"]["shards"][0]["num_tokens"] += 1
    meta["splits"]["train"]["num_tokens"] += 1


CORRUPTIONS = {
    "truncated shard": (_truncate_shard, "has .* bytes, expected"),
    "deleted shard": (lambda p: os.remove(os.path.join(p, "val-00000.bin")), "missing"),
    "checksum mismatch": (_flip_byte, "sha256"),
    "edited meta token count": (lambda p: _edit_meta(p, _bump_tokens), "expected"),
    "edited meta shard list": (lambda p: _edit_meta(p, lambda m: m["splits"]["val"]["shards"]
                                                    .append(dict(m["splits"]["val"]["shards"][0]))),
                               "do not add up"),
    "meta missing field": (lambda p: _edit_meta(p, lambda m: m.pop("splits")), "field"),
    "unparseable meta": (lambda p: open(os.path.join(p, "meta.json"), "w").write("{"), "JSON"),
    "deleted meta": (lambda p: os.remove(os.path.join(p, "meta.json")), "meta.json is missing"),
    "deleted unigram counts": (lambda p: os.remove(os.path.join(p, "unigram_counts.npy")),
                               "unigram_counts"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_corpus_is_rejected(prepared, kind):
    path, _ = prepared
    load_corpus(path)  # intact before the damage
    damage, detail = CORRUPTIONS[kind]
    damage(path)
    with pytest.raises(CorpusError, match=detail) as info:
        load_corpus(path)
    message = str(info.value)
    assert path in message and "Delete" in message and "re-run" in message


def test_checksum_only_checked_with_verify(prepared):
    path, _ = prepared
    _flip_byte(path)
    load_corpus(path, verify=False)  # sizes still match; only the hash catches a flipped bit
    with pytest.raises(CorpusError, match="sha256"):
        load_corpus(path, verify=True)


def test_missing_corpus_path(tmp_path):
    with pytest.raises(CorpusError, match="does not exist") as info:
        load_corpus(str(tmp_path / "nope"))
    assert str(tmp_path / "nope") in str(info.value)


def test_multiple_shards_are_read_in_place(tmp_path, text_dir):
    """A many-shard split is its shards' memmaps end to end: windows inside a shard are views of
    that shard's memmap, nothing holds a concatenated copy, and the batches equal a one-shard corpus's."""
    one = load_corpus(prepare_corpus(str(text_dir), cache_dir=str(tmp_path / "a"),
                                     log=lambda m: None))
    many = load_corpus(prepare_corpus(str(text_dir), cache_dir=str(tmp_path / "b"),
                                      shard_tokens=1000, log=lambda m: None))
    shards = many.meta["splits"]["train"]["shards"]
    assert len(shards) > 3 and all(s["num_tokens"] == 1000 for s in shards[:-1])
    assert os.path.isfile(os.path.join(many.path, "train-00003.bin"))
    stream = many.tokens("train")
    assert isinstance(stream, ShardedStream) and len(stream.shards) == len(shards)
    assert all(isinstance(s, np.memmap) and not s.flags.writeable for s in stream.shards)
    # Nothing but the memmaps holds tokens: no attribute is an array as long as the stream.
    assert not [k for k, v in vars(stream).items() if isinstance(v, np.ndarray) and len(v) >= len(stream)]
    np.testing.assert_array_equal(np.asarray(stream), one.tokens("train"))
    L = 64
    for start in range(0, len(stream) - L - 1, L):
        window = stream[start:start + L + 1]
        np.testing.assert_array_equal(window, one.tokens("train")[start:start + L + 1])
        k = start // 1000
        inside = start // 1000 == (start + L) // 1000
        assert np.shares_memory(window, stream.shards[k]) == inside  # a view unless it crosses a boundary
    assert stream[2500] == one.tokens("train")[2500] and stream[-1] == one.tokens("train")[-1]
    np.testing.assert_array_equal(stream.bincount(257), np.bincount(one.tokens("train"), minlength=257))
    a = make_train_dataset(one, L, 8, seed=3)
    b = make_train_dataset(many, L, 8, seed=3)
    for step in range(5):
        np.testing.assert_array_equal(a[step], b[step])
    assert many.unigram_entropy_nats_per_byte() == one.unigram_entropy_nats_per_byte()


# ------------------------------------------------------------------------------------------------
# Unigram baselines


def test_unigram_entropy_hand_computed(tmp_path):
    # Two identical documents, so train and val hold the same tokens whichever way they split:
    # a, a, b, eos over 3 bytes.
    corpus = _corpus_of(tmp_path, {"x.txt": "aab", "y.txt": "aab"})
    got = corpus.unigram_entropy_nats_per_byte()
    # p = (1/2, 1/4, 1/4): H = 1.5 ln 2 nats/token, x 4 tokens / 3 bytes = 2 ln 2 nats/byte.
    assert got["train_entropy"] == pytest.approx(2 * math.log(2), rel=1e-12)
    # Add-one smoothing over 257 ids: q(a) = 3/261, q(b) = q(eos) = 2/261.
    expected_val = -(2 * math.log(3 / 261) + 2 * math.log(2 / 261)) / 3
    assert got["val_cross_entropy"] == pytest.approx(expected_val, rel=1e-12)
    assert corpus.bytes_per_token("val") == pytest.approx(0.75)


# ------------------------------------------------------------------------------------------------
# Pipelines

SEQ_LEN = 16


@pytest.fixture
def corpus(prepared):
    return load_corpus(prepared[0])


def test_windows_line_up_with_the_stream(corpus):
    stream = np.asarray(corpus.tokens("train")).astype(np.int32)
    windows = PackedWindows(corpus.tokens("train"), SEQ_LEN)
    assert len(windows) == (len(stream) - 1) // SEQ_LEN
    for i in range(len(windows)):
        w = windows[i]
        assert w.dtype == np.int32 and w.shape == (SEQ_LEN + 1,)
        np.testing.assert_array_equal(w[:-1], stream[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN])
        np.testing.assert_array_equal(w[1:], stream[i * SEQ_LEN + 1:i * SEQ_LEN + SEQ_LEN + 1])
    # Every covered token is a target exactly once.
    targets = np.concatenate([windows[i][1:] for i in range(len(windows))])
    np.testing.assert_array_equal(targets, stream[1:len(windows) * SEQ_LEN + 1])
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_train_batches_deterministic_by_seed(corpus):
    def first(seed, n=5):
        ds = make_train_dataset(corpus, SEQ_LEN, 8, seed)
        return [ds[i] for i in range(n)]

    a, b, c = first(0), first(0), first(1)
    assert a[0].shape == (8, SEQ_LEN + 1) and a[0].dtype == np.int32
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    it = make_train_iterator(corpus, SEQ_LEN, 8, 0)
    for x in a:
        np.testing.assert_array_equal(next(it), x)


def test_each_epoch_is_a_new_permutation(corpus):
    _, index = _window_index(corpus, SEQ_LEN)
    n = len(index)
    batch = 8
    ds = make_train_dataset(corpus, SEQ_LEN, batch, seed=3)
    order = _rows_to_indices([ds[i] for i in range(-(-2 * n // batch))], index)
    epoch1, epoch2 = order[:n], order[n:2 * n]
    assert sorted(epoch1) == list(range(n)) and sorted(epoch2) == list(range(n))
    assert epoch1 != epoch2 and epoch1 != list(range(n))


def test_process_shards_are_disjoint_and_make_up_the_global_batch(corpus):
    _, index = _window_index(corpus, SEQ_LEN)
    whole = make_train_dataset(corpus, SEQ_LEN, 8, seed=5)
    parts = [make_train_dataset(corpus, SEQ_LEN, 8, seed=5, process_index=p, process_count=2)
             for p in range(2)]
    seen = [set(), set()]
    steps = len(index) // 8  # one epoch: no window may repeat across processes
    for step in range(steps):
        local = [_rows_to_indices([parts[p][step]], index) for p in range(2)]
        assert all(len(x) == 4 for x in local)
        assert sorted(local[0] + local[1]) == sorted(_rows_to_indices([whole[step]], index))
        for p in range(2):
            seen[p].update(local[p])
    assert not seen[0] & seen[1]
    assert parts[1][0].shape == (4, SEQ_LEN + 1)


def test_pipeline_errors(corpus):
    with pytest.raises(ValueError, match="config.train.global_batch_size"):
        make_train_dataset(corpus, SEQ_LEN, 9, 0, process_index=0, process_count=2)
    with pytest.raises(CorpusError, match="config.data.seq_len"):
        make_train_dataset(corpus, 4096, 8, 0)
    with pytest.raises(CorpusError, match="config.data.seq_len"):
        make_eval_batches(corpus, 4096, 8, 2)


def test_mid_epoch_resume_with_get_set_state(corpus):
    it = make_train_iterator(corpus, SEQ_LEN, 8, seed=7)
    for _ in range(3):
        next(it)
    state = it.get_state()
    json.dumps(state)  # what grain's orbax handler writes
    expected = [next(it) for _ in range(4)]
    fresh = make_train_iterator(corpus, SEQ_LEN, 8, seed=7)
    fresh.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(fresh), want)


def test_orbax_checkpoint_round_trip(tmp_path, corpus):
    import grain
    import orbax.checkpoint as ocp

    it = make_train_iterator(corpus, SEQ_LEN, 8, seed=11)
    for _ in range(5):
        next(it)
    model_state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as manager:
        manager.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(model_state),
                                                data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
    expected = [next(it) for _ in range(4)]

    fresh = make_train_iterator(corpus, SEQ_LEN, 8, seed=11)
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as manager:
        assert manager.latest_step() == 5
        restored = manager.restore(5, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(model_state),
            data=grain.checkpoint.CheckpointRestore(fresh)))
    np.testing.assert_array_equal(restored["state"]["w"], model_state["w"])
    for want in expected:
        np.testing.assert_array_equal(next(restored["data"]), want)


def test_eval_batches_are_fixed_and_in_stream_order(corpus):
    windows = PackedWindows(corpus.tokens("val"), SEQ_LEN)
    a = make_eval_batches(corpus, SEQ_LEN, 4, 3)
    b = make_eval_batches(corpus, SEQ_LEN, 4, 3)
    assert len(a) == 3
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert a[0].shape == (4, SEQ_LEN + 1) and a[0].dtype == np.int32
    np.testing.assert_array_equal(a[1][2], windows[4 + 2])
    # More batches than the split holds: only the full ones.
    everything = make_eval_batches(corpus, SEQ_LEN, 4, 10**6)
    assert len(everything) == len(windows) // 4
    train_eval = make_eval_batches(corpus, SEQ_LEN, 4, 1, split="train")
    np.testing.assert_array_equal(train_eval[0][0], PackedWindows(corpus.tokens("train"),
                                                                  SEQ_LEN)[0])


def test_test_batches_are_the_last_full_batches_disjoint_from_the_first(corpus):
    windows = PackedWindows(corpus.tokens("val"), SEQ_LEN)
    full = len(windows) // 4
    test = make_eval_batches(corpus, SEQ_LEN, 4, 2, from_end=True)
    assert len(test) == 2
    np.testing.assert_array_equal(test[-1][-1], windows[full * 4 - 1])
    np.testing.assert_array_equal(test[0][0], windows[(full - 2) * 4])
    if full >= 4:
        first = make_eval_batches(corpus, SEQ_LEN, 4, 2)
        assert not {w.tobytes() for b in first for w in b} & {w.tobytes() for b in test for w in b}


def test_rows_of_a_process_are_its_rows_of_the_global_batch(corpus):
    whole = make_train_dataset(corpus, SEQ_LEN, 8, seed=5)
    replica = make_train_dataset(corpus, SEQ_LEN, 8, seed=5, rows=[2, 3, 6, 7])
    for step in range(3):
        np.testing.assert_array_equal(replica[step], whole[step][[2, 3, 6, 7]])
    with pytest.raises(ValueError, match="rows must be distinct sorted offsets"):
        make_train_dataset(corpus, SEQ_LEN, 8, seed=5, rows=[3, 2])
