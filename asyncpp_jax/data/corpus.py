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

Train/val are split by document (a file, or a dataset row), never inside one, so no text is shared
between the two. Run as a module to prepare a corpus ahead of training:

    python -m asyncpp_jax.data.corpus --source=stdlib --tokenizer=byte --cache_dir=/tmp/corpora
"""

from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from asyncpp_jax.data.stream import ShardedStream
from asyncpp_jax.data.tokenizers import get_tokenizer

FORMAT_VERSION = 1
SPLITS = ("train", "val")
META_FILE = "meta.json"
UNIGRAM_FILE = "unigram_counts.npy"
# Directories that hold installed third-party packages, not the standard library itself.
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_GLOB_CHARS = re.compile(r"[*?[]")
# Documents are tokenized in groups so the HF tokenizer can batch in Rust while memory stays
# bounded.
_ENCODE_GROUP_DOCS = 256
_ENCODE_GROUP_BYTES = 16 << 20


class CorpusError(ValueError):
    """A corpus source, setting or prepared directory is unusable; the message says the fix."""


def default_cache_dir() -> str:
    """`$ASYNCPP_JAX_CACHE` if set, else `~/.cache/asyncpp_jax/corpora`."""
    return os.environ.get("ASYNCPP_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "asyncpp_jax", "corpora")


def _fix_message(path: str) -> str:
    return (f"Delete {path} and re-run the prepare step (`python -m asyncpp_jax.data.corpus "
            "--source=...`, or start training again, which prepares the corpus).")


# ----------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class FileListing:
    """Local input files: `names` are paths relative to `base`, sorted; `paths` are absolute."""
    base: str
    names: tuple[str, ...]
    paths: tuple[str, ...]


def list_stdlib_files() -> FileListing:
    """Every `*.py` file of this interpreter's standard library, excluding installed packages.

    Real, varied text that is present on every machine, hence the default corpus (no download).
    """
    root = os.path.realpath(sysconfig.get_paths()["stdlib"])
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        for filename in filenames:
            if filename.endswith(".py"):
                names.append(os.path.relpath(os.path.join(dirpath, filename), root))
    names.sort()
    return FileListing(root, tuple(names), tuple(os.path.join(root, n) for n in names))


def _files_under(directory: str) -> list[str]:
    # Hidden entries (.git, .venv, editor swap files) are tooling, not corpus text.
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.extend(os.path.join(dirpath, f) for f in filenames if not f.startswith("."))
    return found


def list_local_files(source: str) -> FileListing:
    """Files named by `source`: comma-separated globs (`**` allowed), files and directories.

    Names are relative to the deepest directory containing all files, so they stay the same when
    the whole tree moves (and the train/val split, which hashes them, stays the same too).
    """
    paths: set[str] = set()
    for entry in (e.strip() for e in source.split(",")):
        if not entry:
            continue
        entry = os.path.expanduser(entry)
        if os.path.isdir(entry):
            matches = _files_under(entry)
        elif _GLOB_CHARS.search(entry):
            matches = []
            for m in glob.glob(entry, recursive=True):
                matches.extend(_files_under(m) if os.path.isdir(m) else [m])
        else:
            matches = [entry] if os.path.isfile(entry) else []
        paths.update(os.path.abspath(m) for m in matches if os.path.isfile(m))
    if not paths:
        raise CorpusError(
            f"config.data.source={source!r} matches no file. Use 'stdlib' (the Python standard "
            "library, no download), 'hf:<dataset>[:<config>]', or comma-separated files, "
            "directories or glob patterns (e.g. 'data/**/*.txt') that exist on this machine."
        )
    base = os.path.commonpath([os.path.dirname(p) for p in paths])
    named = sorted((os.path.relpath(p, base), p) for p in paths)
    return FileListing(base, tuple(n for n, _ in named), tuple(p for _, p in named))


def _parse_hf_source(source: str) -> tuple[str, str | None]:
    spec = source[len("hf:"):]
    dataset, _, config_name = spec.partition(":")
    if not dataset:
        raise CorpusError(
            f"config.data.source={source!r}: expected 'hf:<dataset>[:<config_name>]', e.g. "
            "'hf:HuggingFaceFW/fineweb-edu:sample-10BT'.")
    return dataset, (config_name or None)


# ----------------------------------------------------------------------------------------------
# Train/val split


def _unit_hash(split_seed: int, key: str | bytes) -> float:
    """A stable number in [0, 1) for `key`: same on every run, machine and Python version."""
    if isinstance(key, str):
        key = key.encode("utf-8", errors="surrogatepass")
    digest = hashlib.sha256(f"{split_seed}:".encode() + key).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _check_val_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(
            f"config.data.val_fraction={val_fraction} must be strictly between 0 and 1, so that "
            "both the train and the validation split get documents."
        )


def assign_splits(names: Sequence[str], val_fraction: float, split_seed: int) -> list[bool]:
    """For each document name, True if it belongs to the validation split.

    A document is in validation iff sha256(f"{split_seed}:{name}") maps below `val_fraction`: a
    deterministic, order-independent choice that does not move when other files are added. When a
    small corpus leaves a split empty, the document closest to the threshold is moved into it.
    """
    _check_val_fraction(val_fraction)
    if len(names) < 2:
        raise CorpusError(
            f"The corpus has {len(names)} document(s); at least 2 are needed to get a non-empty "
            "train and validation split. Point config.data.source at more files."
        )
    scores = [_unit_hash(split_seed, n) for n in names]
    is_val = [s < val_fraction for s in scores]
    if not any(is_val):
        is_val[int(np.argmin(scores))] = True
    if all(is_val):
        is_val[int(np.argmax(scores))] = False
    return is_val


# ----------------------------------------------------------------------------------------------
# Writing


def _token_dtype(vocab_size: int) -> np.dtype:
    # Explicit little-endian so shards read the same on any host.
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


_DTYPE_NAMES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class _SplitWriter:
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

    def finish(self) -> dict:
        if self._file is not None:
            self._close_shard()
        stats = {"shards": self.shards, "num_docs": self.num_docs, "num_tokens": self.num_tokens,
                 "num_bytes": self.num_bytes}
        if self.doc_names is not None:
            stats["doc_names"] = self.doc_names
        return stats


def _grouped(docs: Iterable[tuple[str, str, str]]) -> Iterator[list[tuple[str, str, str]]]:
    group, size = [], 0
    for doc in docs:
        group.append(doc)
        size += len(doc[2])
        if len(group) >= _ENCODE_GROUP_DOCS or size >= _ENCODE_GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


def _write_streams(directory: str, docs: Iterable[tuple[str, str, str]], tok, shard_tokens: int,
                   record_names: bool, log: Callable[[str], None]) -> tuple[dict, np.ndarray]:
    """Tokenizes `(split, name, text)` documents, in order, into the split streams in `directory`.

    Returns the per-split statistics for meta.json and the train unigram counts.
    """
    dtype = _token_dtype(tok.vocab_size)
    writers = {s: _SplitWriter(directory, s, dtype, shard_tokens, tok.vocab_size, record_names,
                               count_unigrams=(s == "train")) for s in SPLITS}
    try:
        _tokenize_into(writers, docs, tok, log)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    return {s: w.finish() for s, w in writers.items()}, writers["train"].unigram_counts


def _tokenize_into(writers: dict, docs: Iterable[tuple[str, str, str]], tok,
                   log: Callable[[str], None]) -> None:
    eos = np.array([tok.eos_id], np.int32)
    started, next_report = time.time(), 10_000
    for group in _grouped(docs):
        for (split, name, text), ids in zip(group, tok.encode_batch([t for _, _, t in group])):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tok.vocab_size):
                raise CorpusError(
                    f"{tok!r} produced ids outside [0, {tok.vocab_size}) for {name!r}; check "
                    "config.data.tokenizer."
                )
            num_bytes = len(text.encode("utf-8", errors="replace"))
            writers[split].add(name, num_bytes, np.concatenate([ids.astype(np.int32), eos]))
        done = sum(w.num_docs for w in writers.values())
        if done >= next_report:
            log(f"corpus: tokenized {done} documents ({time.time() - started:.0f}s)")
            next_report += 10_000


def _local_documents(listing: FileListing, is_val: Sequence[bool]):
    for name, path, val in zip(listing.names, listing.paths, is_val):
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        yield ("val" if val else "train"), name, text


def _hf_documents(dataset: str, config_name: str | None, hf_split: str, text_field: str,
                  max_docs: int, val_fraction: float, split_seed: int):
    """Streams `(split, name, text)` rows from a Hugging Face dataset without downloading it whole.

    A row goes to validation iff the hash of its TEXT falls below `val_fraction`, so exact duplicate
    rows always land in the same split (no train/val leakage through duplicates) and the choice does
    not depend on the order the server streams rows in. To guarantee both splits are non-empty
    without a second pass, the first train row and the first val row are held back until the end:
    each is released into its own split, unless the other split would otherwise be empty.
    """
    try:
        import datasets  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise CorpusError(
            f"config.data.source='hf:{dataset}' needs the Hugging Face `datasets` package: "
            "pip install datasets") from e
    stream = datasets.load_dataset(dataset, config_name, split=hf_split, streaming=True)
    held = {"train": None, "val": None}
    emitted = {"train": 0, "val": 0}
    for index, row in enumerate(stream):
        if max_docs > 0 and index >= max_docs:
            break
        if text_field not in row:
            raise CorpusError(
                f"config.data.hf_text_field={text_field!r} is not a column of {dataset}; its "
                f"columns are {sorted(row)}. Set config.data.hf_text_field to the one holding the "
                "text."
            )
        text = row[text_field] or ""
        split = "val" if _unit_hash(split_seed, text) < val_fraction else "train"
        doc = (split, f"{hf_split}[{index}]", text)
        if held[split] is None:
            held[split] = doc
            continue
        emitted[split] += 1
        yield doc
    total = sum(emitted.values()) + sum(d is not None for d in held.values())
    if total < 2:
        raise CorpusError(
            f"config.data.source='hf:{dataset}' gave {total} document(s) (split {hf_split!r}, "
            f"config.data.hf_max_docs={max_docs}); at least 2 are needed for a train and a val "
            "split."
        )
    for split, other in (("train", "val"), ("val", "train")):
        doc = held[split]
        if doc is None:
            continue
        if held[other] is None and emitted[other] == 0:
            yield (other,) + doc[1:]  # the other split would be empty: this row moves there
        else:
            yield doc


# ----------------------------------------------------------------------------------------------
# Prepare


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "_", text).strip("_.")[:48] or "corpus"


def _read_meta(path: str) -> dict | None:
    try:
        with open(os.path.join(path, META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def prepare_corpus(source: str, tokenizer: str = "byte", cache_dir: str | None = None,
                   val_fraction: float = 0.05, split_seed: int = 0, eos_token: str | None = None,
                   hf_split: str = "train", hf_text_field: str = "text", hf_max_docs: int = 0,
                   shard_tokens: int = 2**26, log: Callable[[str], None] = print) -> str:
    """Tokenizes `source` into `<cache_dir>/<slug>-<key>` (see the module docstring); returns it.

    Sources (`config.data.source`): `'stdlib'`; `'hf:<dataset>[:<config_name>]'`; or comma-separated
    files, directories (every non-hidden file below) and glob patterns. If a corpus with the same
    key already exists it is returned without tokenizing anything.
    """
    _check_val_fraction(val_fraction)
    if shard_tokens < 1:
        raise CorpusError(f"shard_tokens={shard_tokens} must be positive.")
    tok = get_tokenizer(tokenizer, eos_token)
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    key_material = {"format_version": FORMAT_VERSION, "source": source,
                    "tokenizer_fingerprint": tok.fingerprint, "eos_id": tok.eos_id,
                    "val_fraction": repr(float(val_fraction)), "split_seed": int(split_seed)}
    if source.startswith("hf:"):
        dataset, config_name = _parse_hf_source(source)
        key_material["hf"] = [dataset, config_name, hf_split, hf_text_field, int(hf_max_docs)]
        slug = _slug(f"hf_{dataset}_{config_name or ''}")
        documents = functools.partial(_hf_documents, dataset, config_name, hf_split,
                                      hf_text_field, hf_max_docs, val_fraction, split_seed)
        source_info = {"kind": "hf", "dataset": dataset, "config_name": config_name,
                       "split": hf_split, "text_field": hf_text_field, "max_docs": int(hf_max_docs)}
    else:
        listing = list_stdlib_files() if source == "stdlib" else list_local_files(source)
        stats = [os.stat(p) for p in listing.paths]
        # The base directory is part of the key so two different trees with identical relative
        # names, sizes and mtimes can never share a cached corpus.
        key_material["files"] = [listing.base] + [
            [n, s.st_size, s.st_mtime_ns] for n, s in zip(listing.names, stats)]
        slug = "stdlib" if source == "stdlib" else _slug(os.path.basename(listing.base) or "files")
        is_val = assign_splits(listing.names, val_fraction, split_seed)
        documents = functools.partial(_local_documents, listing, is_val)
        source_info = {"kind": "stdlib" if source == "stdlib" else "files", "base": listing.base}
    slug = f"{slug}-{_slug(tok.fingerprint.split('-')[0])}"
    key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:16]
    out = os.path.join(cache_dir, f"{slug}-{key}")

    meta = _read_meta(out)
    if meta is not None and meta.get("format_version") == FORMAT_VERSION and meta.get("key") == key:
        log(f"corpus: using cached {out}")
        return out
    if os.path.exists(out):
        log(f"corpus: {out} exists but has no valid {META_FILE}; rebuilding it")
        shutil.rmtree(out)

    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{slug}-{key}-", dir=cache_dir)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        log(f"corpus: tokenizing {source!r} with {tokenizer!r} into {out}")
        started = time.time()
        splits, unigram_counts = _write_streams(tmp, documents(), tok, shard_tokens,
                                                record_names=source_info["kind"] != "hf", log=log)
        np.save(os.path.join(tmp, UNIGRAM_FILE), unigram_counts)
        meta = {
            "format_version": FORMAT_VERSION, "key": key, "source": source,
            "source_info": source_info,
            "tokenizer": {"spec": getattr(tok, "path", tokenizer), "fingerprint": tok.fingerprint,
                          "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                          "eos_token": getattr(tok, "eos_token", None)},
            "dtype": "uint16" if _token_dtype(tok.vocab_size).itemsize == 2 else "uint32",
            "val_fraction": float(val_fraction), "split_seed": int(split_seed),
            "created_unix": time.time(), "splits": splits,
        }
        # meta.json is written last: its presence marks the directory complete.
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process finished the same corpus first; theirs is identical by construction.
            if _read_meta(out) is None:
                raise
            log(f"corpus: {out} was prepared concurrently; using it")
            return out
        log(f"corpus: wrote {out} in {time.time() - started:.1f}s: " + ", ".join(
            f"{s} {splits[s]['num_docs']} docs / {splits[s]['num_tokens']} tokens" for s in SPLITS))
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare_corpus_for(data_config, log: Callable[[str], None] = print) -> str:
    """:func:`prepare_corpus` with the settings of a config's ``data`` section: the one call the
    trainer and the sweep runner (which prepares a study's corpus before its jobs) both make, so
    they agree on the corpus key."""
    d = data_config
    return prepare_corpus(
        d.source, tokenizer=d.tokenizer, cache_dir=d.cache_dir or None, val_fraction=d.val_fraction,
        split_seed=d.split_seed, eos_token=d.eos_token or None, hf_split=d.hf_split,
        hf_text_field=d.hf_text_field, hf_max_docs=d.hf_max_docs, log=log,
    )


# ----------------------------------------------------------------------------------------------
# Load


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
                          "prepare step (`python -m asyncpp_jax.data.corpus --source=...`) first.")

    def corrupt(what: str) -> CorpusError:
        return CorpusError(
            f"Corpus at {path} is corrupt or incomplete: {what}. {_fix_message(path)}"
        )

    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise corrupt(f"{META_FILE} is missing")
    meta = _read_meta(path)
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


# ----------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncpp_jax.data.corpus",
        description="Prepare (tokenize and cache) a corpus, then print its path and statistics.")
    parser.add_argument("--source", default="stdlib",
                        help="'stdlib', 'hf:<dataset>[:<config>]', or files/dirs/globs, "
                        "comma-separated")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a path to tokenizer.json")
    parser.add_argument("--cache_dir", default=None, help=f"default: {default_cache_dir()}")
    parser.add_argument("--val_fraction", type=float, default=0.05)
    parser.add_argument("--split_seed", type=int, default=0)
    parser.add_argument("--eos_token", default=None)
    parser.add_argument("--hf_split", default="train")
    parser.add_argument("--hf_text_field", default="text")
    parser.add_argument("--hf_max_docs", type=int, default=0)
    parser.add_argument("--shard_tokens", type=int, default=2**26)
    args = parser.parse_args(argv)
    try:
        path = prepare_corpus(args.source, args.tokenizer, args.cache_dir, args.val_fraction,
                              args.split_seed, args.eos_token, args.hf_split, args.hf_text_field,
                              args.hf_max_docs, args.shard_tokens,
                              log=lambda m: print(m, file=sys.stderr))
        corpus = load_corpus(path)
    except ValueError as e:  # CorpusError and tokenizer errors carry the fix in their message
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    for split in SPLITS:
        print(f"{split}: {corpus.num_docs(split)} docs, {corpus.num_tokens(split)} tokens, "
              f"{corpus.num_bytes(split)} bytes, {corpus.bytes_per_token(split):.3f} bytes/token")
    baselines = corpus.unigram_entropy_nats_per_byte()
    print(f"vocab_size={corpus.vocab_size} eos_id={corpus.eos_id} dtype={corpus.meta['dtype']}")
    print("unigram baselines (nats/byte): " + ", ".join(
        f"{k}={v:.4f}" for k, v in baselines.items()) + f"; log(2)={math.log(2):.4f} nats = 1 bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
