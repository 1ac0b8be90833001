"""Tokenized corpora on disk: prepare once (cached by content), load many times as memmaps.

A prepared corpus is a directory `<cache_dir>/<slug>-<key>` holding, per split (`train`, `val`),
one token stream (documents tokenized and each followed by the tokenizer's `eos_id`, GPT-2 /
nanoGPT style) cut into raw little-endian shards `train-00000.bin`, `val-00000.bin`, ..., plus

- `meta.json`: format version, source, tokenizer (spec, fingerprint, vocab size, eos id), dtype,
  split settings, and per split the shards (name, token count, sha256), document count, token
  count, UTF-8 byte count (so a loss in nats/token converts to nats/byte) and, for file sources,
  the document names;
- `unigram_counts.npy`: int64 count of every token id over the train split, which gives the
  unigram baselines a trained model must beat.

`key` hashes everything the token streams depend on (format version, source spec, the input files'
relative paths, sizes and mtimes or the dataset spec, the tokenizer fingerprint and eos id, and the
split settings), so a changed input or setting prepares a new corpus and an unchanged one is reused.
The directory is built beside its final place and renamed into it, so a crash never leaves a
half-written corpus that looks valid.

This module is the format: its constants, the shard writer and the reader (:class:`Corpus`,
:func:`load_corpus`, which checks a directory before trusting it).  Where documents come from is
:mod:`asyncpp_jax.data.sources`; tokenizing them into a cached directory is
:mod:`asyncpp_jax.data.prepare`, also the command line that prepares a corpus ahead of training:

    python -m asyncpp_jax.data.prepare --source=stdlib --tokenizer=byte --cache_dir=/tmp/corpora
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import numpy as np

from asyncpp_jax.data.stream import ShardedStream
from asyncpp_jax.data.tokenizers import get_tokenizer

FORMAT_VERSION = 1
SPLITS = ("train", "val")
META_FILE = "meta.json"
UNIGRAM_FILE = "unigram_counts.npy"


class CorpusError(ValueError):
    """A corpus source, setting or prepared directory is unusable; the message says the fix."""


class CorpusWriteError(CorpusError):
    """The machine stopped a prepare (a file-size limit, a full disk, a worker out of memory): the
    environment's doing, not a setting's."""


def default_cache_dir() -> str:
    """`$ASYNCPP_JAX_CACHE` if set, else `~/.cache/asyncpp_jax/corpora`."""
    return os.environ.get("ASYNCPP_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "asyncpp_jax", "corpora")


def _fix_message(path: str) -> str:
    return (f"Delete {path} and re-run the prepare step (`python -m asyncpp_jax.data.prepare "
            "--source=...`, or start training again, which prepares the corpus).")

# ----------------------------------------------------------------------------------------------
# Writing


def token_dtype(vocab_size: int) -> np.dtype:
    # Explicit little-endian so shards read the same on any host.
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


_DTYPE_NAMES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class SplitWriter:
    """Appends documents' tokens to one split's stream, starting a new shard every `shard_tokens`.
    """

    def __init__(self, directory: str, split: str, dtype: np.dtype, shard_tokens: int,
                 vocab_size: int, record_names: bool, count_unigrams: bool):
        self._directory, self._split, self._dtype = directory, split, dtype
        self._shard_tokens = shard_tokens
        self._file = None
        self._hasher = None
        self._in_shard = 0
        self.shards: list[dict] = []
        self.num_docs = self.num_tokens = self.num_bytes = 0
        self.doc_names: list[str] | None = [] if record_names else None
        self.unigram_counts = np.zeros(vocab_size, np.int64) if count_unigrams else None

    def add(self, name: str, num_bytes: int, ids: np.ndarray) -> None:
        self.num_docs += 1
        self.num_bytes += num_bytes
        if self.doc_names is not None:
            self.doc_names.append(name)
        if self.unigram_counts is not None:
            self.unigram_counts += np.bincount(ids, minlength=len(self.unigram_counts))
        self._write(ids.astype(self._dtype))

    def _write(self, ids: np.ndarray) -> None:
        while ids.size:
            if self._file is None:
                name = f"{self._split}-{len(self.shards):05d}.bin"
                self._file = open(os.path.join(self._directory, name), "wb")
                self._hasher = hashlib.sha256()
                self.shards.append({"name": name, "num_tokens": 0, "sha256": None})
                self._in_shard = 0
            chunk = ids[: self._shard_tokens - self._in_shard]
            data = chunk.tobytes()
            self._file.write(data)
            self._hasher.update(data)
            self._in_shard += chunk.size
            self.num_tokens += chunk.size
            ids = ids[chunk.size:]
            if self._in_shard == self._shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._file.close()
        self.shards[-1].update(num_tokens=self._in_shard, sha256=self._hasher.hexdigest())
        self._file = None

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def state(self) -> dict:
        """Everything written so far, flushed to disk: what :meth:`resume` continues from."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        return {"shards": [dict(s) for s in self.shards], "in_shard": self._in_shard if self._file else 0,
                "num_docs": self.num_docs, "num_tokens": self.num_tokens, "num_bytes": self.num_bytes,
                "doc_names": list(self.doc_names) if self.doc_names is not None else None}

    def resume(self, state: dict) -> None:
        """Continue after :meth:`state` was taken (in another process): the open shard is cut back
        to the tokens the state counts and re-hashed, and any later shard file is removed."""
        self.shards = [dict(s) for s in state["shards"]]
        self.num_docs, self.num_tokens, self.num_bytes = state["num_docs"], state["num_tokens"], state["num_bytes"]
        if self.doc_names is not None:
            self.doc_names = list(state["doc_names"] or [])
        keep = {s["name"] for s in self.shards}
        for name in os.listdir(self._directory):
            if name.startswith(f"{self._split}-") and name.endswith(".bin") and name not in keep:
                os.remove(os.path.join(self._directory, name))
        if state["in_shard"]:
            open_shard = self.shards[-1]
            path = os.path.join(self._directory, open_shard["name"])
            self._file = open(path, "r+b")
            self._file.truncate(state["in_shard"] * self._dtype.itemsize)
            self._hasher = hashlib.sha256()
            while block := self._file.read(1 << 22):
                self._hasher.update(block)
            self._in_shard = state["in_shard"]

    def finish(self) -> dict:
        if self._file is not None:
            self._close_shard()
        stats = {"shards": self.shards, "num_docs": self.num_docs, "num_tokens": self.num_tokens,
                 "num_bytes": self.num_bytes}
        if self.doc_names is not None:
            stats["doc_names"] = self.doc_names
        return stats


def read_meta(path: str) -> dict | None:
    try:
        with open(os.path.join(path, META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None

# ----------------------------------------------------------------------------------------------
# Reading


class Corpus:
    """A prepared corpus opened for reading; token streams are read-only memmaps (no copy)."""

    def __init__(self, path: str, meta: dict):
        self.path = path
        self.meta = meta
        self.vocab_size = int(meta["tokenizer"]["vocab_size"])
        self.eos_id = int(meta["tokenizer"]["eos_id"])
        self.dtype = _DTYPE_NAMES[meta["dtype"]]
        self._tokens: dict[str, np.ndarray] = {}

    def _split(self, split: str) -> dict:
        if split not in self.meta["splits"]:
            raise ValueError(
                f"Unknown split {split!r}; this corpus has {sorted(self.meta['splits'])}."
            )
        return self.meta["splits"][split]

    def tokens(self, split: str) -> np.ndarray | ShardedStream:
        """The split's whole token stream (documents each followed by eos), read-only and read in
        place: one shard's memmap, or a :class:`ShardedStream` over several (never concatenated)."""
        if split not in self._tokens:
            arrays = [
                np.memmap(os.path.join(self.path, s["name"]), dtype=self.dtype, mode="r",
                          shape=(int(s["num_tokens"]),))
                for s in self._split(split)["shards"]
            ]
            self._tokens[split] = arrays[0] if len(arrays) == 1 else ShardedStream(arrays)
        return self._tokens[split]

    def num_tokens(self, split: str) -> int:
        return int(self._split(split)["num_tokens"])

    def num_bytes(self, split: str) -> int:
        return int(self._split(split)["num_bytes"])

    def num_docs(self, split: str) -> int:
        return int(self._split(split)["num_docs"])

    def bytes_per_token(self, split: str) -> float:
        """UTF-8 bytes per token: nats/token = nats/byte x bytes_per_token."""
        return self.num_bytes(split) / self.num_tokens(split)

    def unigram_counts(self) -> np.ndarray:
        return np.load(os.path.join(self.path, UNIGRAM_FILE))

    def unigram_entropy_nats_per_byte(self) -> dict:
        """Baselines a language model must beat, in nats per UTF-8 byte.

        `train_entropy`: Shannon entropy of the train unigram distribution (nats/token) times train
        tokens / train bytes. `val_cross_entropy`: cross-entropy, on the val tokens, of the add-one
        smoothed train unigram model (so unseen ids have finite loss), over val bytes.
        """
        counts = self.unigram_counts().astype(np.float64)
        n_train = counts.sum()
        p = counts[counts > 0] / n_train
        entropy_per_token = float(-(p * np.log(p)).sum())
        log_q = np.log((counts + 1.0) / (n_train + self.vocab_size))
        val = self.tokens("val")
        val_counts = (val.bincount(self.vocab_size) if isinstance(val, ShardedStream)
                      else np.bincount(val, minlength=self.vocab_size)).astype(np.float64)
        val_nats = float(-(val_counts * log_q).sum())
        return {
            "train_entropy": entropy_per_token * self.num_tokens("train") / self.num_bytes("train"),
            "val_cross_entropy": val_nats / self.num_bytes("val"),
        }

    @property
    def fingerprint(self) -> str:
        """16 hex digits of a SHA-256 over the corpus key (its sources, tokenizer and split settings)
        and every shard's recorded SHA-256: the same only for the same token streams of the same
        sources (a resume compares it, train/resume.py)."""
        shards = {s: [x["sha256"] for x in self._split(s)["shards"]] for s in SPLITS}
        material = json.dumps({"key": self.meta.get("key"), "shards": shards}, sort_keys=True)
        return hashlib.sha256(material.encode()).hexdigest()[:16]

    def tokenizer(self):
        """The tokenizer this corpus was prepared with (for decoding samples)."""
        tok_meta = self.meta["tokenizer"]
        return get_tokenizer(tok_meta["spec"], tok_meta.get("eos_token"))

    def __repr__(self) -> str:
        return (f"Corpus({self.path!r}, train={self.num_tokens('train')} tokens, "
                f"val={self.num_tokens('val')} tokens)")


def _sha256_file(path: str) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            hasher.update(block)
    return hasher.hexdigest()


def load_corpus(path: str, verify: bool = True) -> Corpus:
    """Opens a prepared corpus, checking that it is complete (and, if `verify`, its checksums)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise CorpusError(f"No prepared corpus at {path}: the directory does not exist. Run the "
                          "prepare step (`python -m asyncpp_jax.data.prepare --source=...`) first.")

    def corrupt(what: str) -> CorpusError:
        return CorpusError(
            f"Corpus at {path} is corrupt or incomplete: {what}. {_fix_message(path)}"
        )

    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise corrupt(f"{META_FILE} is missing")
    meta = read_meta(path)
    if meta is None:
        raise corrupt(f"{META_FILE} is not valid JSON")
    if meta.get("format_version") != FORMAT_VERSION:
        raise corrupt(f"format_version is {meta.get('format_version')!r}, this code reads "
                      f"{FORMAT_VERSION}")
    try:
        corpus = Corpus(path, meta)
        for split in SPLITS:
            _check_split(path, split, meta["splits"][split], corpus.dtype.itemsize, verify, corrupt)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CorpusError):
            raise
        raise corrupt(f"{META_FILE} lacks or mangles a field ({type(e).__name__}: {e})") from e
    _check_unigrams(corpus, corrupt)
    return corpus


def _check_split(path: str, split: str, stats: dict, itemsize: int, verify: bool,
                 corrupt: Callable[[str], CorpusError]) -> None:
    shards = stats["shards"]
    if not shards or sum(int(s["num_tokens"]) for s in shards) != int(stats["num_tokens"]):
        raise corrupt(f"the {split} shard token counts do not add up to num_tokens")
    for shard in shards:
        shard_path = os.path.join(path, shard["name"])
        if not os.path.isfile(shard_path):
            raise corrupt(f"shard {shard['name']} is missing")
        expected = int(shard["num_tokens"]) * itemsize
        actual = os.path.getsize(shard_path)
        if actual != expected:
            raise corrupt(f"shard {shard['name']} has {actual} bytes, expected {expected} "
                          f"({shard['num_tokens']} tokens x {itemsize} bytes)")
        if verify and _sha256_file(shard_path) != shard["sha256"]:
            raise corrupt(f"shard {shard['name']} fails its sha256 checksum")


def _check_unigrams(corpus: Corpus, corrupt: Callable[[str], CorpusError]) -> None:
    try:
        counts = corpus.unigram_counts()
    except (OSError, ValueError) as e:
        raise corrupt(f"{UNIGRAM_FILE} is missing or unreadable ({e})") from e
    if counts.shape != (corpus.vocab_size,) or int(counts.sum()) != corpus.num_tokens("train"):
        raise corrupt(f"{UNIGRAM_FILE} does not match the train split")
