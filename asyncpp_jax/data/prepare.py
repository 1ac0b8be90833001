"""Prepare a corpus: tokenize a source's documents into a cached directory (prepare once, load many).

The directory's format, and how its key makes a changed input or setting prepare a new corpus
while an unchanged one is reused, is described in :mod:`asyncpp_jax.data.corpus`.  The directory
is built beside its final place and renamed into it, so a crash never leaves a half-written corpus
that looks valid.  Run as a module to prepare a corpus ahead of training:

    python -m asyncpp_jax.data.prepare --source=stdlib --tokenizer=byte --cache_dir=/tmp/corpora
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from asyncpp_jax.data import sources
from asyncpp_jax.data.corpus import (FORMAT_VERSION, META_FILE, SPLITS, UNIGRAM_FILE, CorpusError, SplitWriter,
                                     default_cache_dir, load_corpus, read_meta, token_dtype)
from asyncpp_jax.data.tokenizers import get_tokenizer

# Documents are tokenized in groups so the HF tokenizer can batch in Rust while memory stays
# bounded.
_ENCODE_GROUP_DOCS = 256
_ENCODE_GROUP_BYTES = 16 << 20


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
    dtype = token_dtype(tok.vocab_size)
    writers = {s: SplitWriter(directory, s, dtype, shard_tokens, tok.vocab_size, record_names,
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

# ----------------------------------------------------------------------------------------------
# Prepare


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "_", text).strip("_.")[:48] or "corpus"


def prepare_corpus(source: str, tokenizer: str = "byte", cache_dir: str | None = None,
                   val_fraction: float = 0.05, split_seed: int = 0, eos_token: str | None = None,
                   hf_split: str = "train", hf_text_field: str = "text", hf_max_docs: int = 0,
                   shard_tokens: int = 2**26, log: Callable[[str], None] = print) -> str:
    """Tokenizes `source` into `<cache_dir>/<slug>-<key>` (see :mod:`asyncpp_jax.data.corpus`); returns it.

    Sources (`config.data.source`): `'stdlib'`; `'hf:<dataset>[:<config_name>]'`; or comma-separated
    files, directories (every non-hidden file below) and glob patterns. If a corpus with the same
    key already exists it is returned without tokenizing anything.
    """
    sources.check_val_fraction(val_fraction)
    if shard_tokens < 1:
        raise CorpusError(f"shard_tokens={shard_tokens} must be positive.")
    tok = get_tokenizer(tokenizer, eos_token)
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    plan = _plan(source, tok, val_fraction, split_seed, hf_split, hf_text_field, hf_max_docs)
    out = os.path.join(cache_dir, f"{plan.slug}-{plan.key}")

    meta = read_meta(out)
    if meta is not None and meta.get("format_version") == FORMAT_VERSION and meta.get("key") == plan.key:
        log(f"corpus: using cached {out}")
        return out
    if os.path.exists(out):
        log(f"corpus: {out} exists but has no valid {META_FILE}; rebuilding it")
        shutil.rmtree(out)
    settings = {"tokenizer": tokenizer, "val_fraction": val_fraction, "split_seed": split_seed,
                "shard_tokens": shard_tokens}
    return _build(out, plan, tok, settings, log)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What to tokenize and where it is cached: ``documents()`` yields ``(split, name, text)``."""
    source: str
    slug: str
    key: str
    documents: Callable[[], Iterable[tuple[str, str, str]]]
    source_info: dict


def _plan(source: str, tok, val_fraction: float, split_seed: int, hf_split: str, hf_text_field: str,
          hf_max_docs: int) -> _Plan:
    """The documents of ``source`` and the cache key: a hash of everything their tokens depend on."""
    key_material = {"format_version": FORMAT_VERSION, "source": source,
                    "tokenizer_fingerprint": tok.fingerprint, "eos_id": tok.eos_id,
                    "val_fraction": repr(float(val_fraction)), "split_seed": int(split_seed)}
    if source.startswith("hf:"):
        dataset, config_name = sources.parse_hf_source(source)
        key_material["hf"] = [dataset, config_name, hf_split, hf_text_field, int(hf_max_docs)]
        slug = _slug(f"hf_{dataset}_{config_name or ''}")
        documents = functools.partial(sources.hf_documents, dataset, config_name, hf_split,
                                      hf_text_field, hf_max_docs, val_fraction, split_seed)
        source_info = {"kind": "hf", "dataset": dataset, "config_name": config_name,
                       "split": hf_split, "text_field": hf_text_field, "max_docs": int(hf_max_docs)}
    else:
        listing = sources.list_stdlib_files() if source == "stdlib" else sources.list_local_files(source)
        stats = [os.stat(p) for p in listing.paths]
        # The base directory is part of the key so two different trees with identical relative
        # names, sizes and mtimes can never share a cached corpus.
        key_material["files"] = [listing.base] + [
            [n, s.st_size, s.st_mtime_ns] for n, s in zip(listing.names, stats)]
        slug = "stdlib" if source == "stdlib" else _slug(os.path.basename(listing.base) or "files")
        is_val = sources.assign_splits(listing.names, val_fraction, split_seed)
        documents = functools.partial(sources.local_documents, listing, is_val)
        source_info = {"kind": "stdlib" if source == "stdlib" else "files", "base": listing.base}
    slug = f"{slug}-{_slug(tok.fingerprint.split('-')[0])}"
    key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:16]
    return _Plan(source, slug, key, documents, source_info)


def _build(out: str, plan: _Plan, tok, settings: dict, log: Callable[[str], None]) -> str:
    """Tokenizes ``plan`` into a temporary directory beside ``out`` and renames it into place."""
    cache_dir = os.path.dirname(out)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{plan.slug}-{plan.key}-", dir=cache_dir)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        log(f"corpus: tokenizing {plan.source!r} with {settings['tokenizer']!r} into {out}")
        started = time.time()
        splits, unigram_counts = _write_streams(tmp, plan.documents(), tok, settings["shard_tokens"],
                                                record_names=plan.source_info["kind"] != "hf", log=log)
        np.save(os.path.join(tmp, UNIGRAM_FILE), unigram_counts)
        # meta.json is written last: its presence marks the directory complete.
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
            json.dump(_meta(plan, tok, settings, splits), f, indent=1)
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process finished the same corpus first; theirs is identical by construction.
            if read_meta(out) is None:
                raise
            log(f"corpus: {out} was prepared concurrently; using it")
            return out
        log(f"corpus: wrote {out} in {time.time() - started:.1f}s: " + ", ".join(
            f"{s} {splits[s]['num_docs']} docs / {splits[s]['num_tokens']} tokens" for s in SPLITS))
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _meta(plan: _Plan, tok, settings: dict, splits: dict) -> dict:
    return {
        "format_version": FORMAT_VERSION, "key": plan.key, "source": plan.source,
        "source_info": plan.source_info,
        "tokenizer": {"spec": getattr(tok, "path", settings["tokenizer"]), "fingerprint": tok.fingerprint,
                      "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "eos_token": getattr(tok, "eos_token", None)},
        "dtype": "uint16" if token_dtype(tok.vocab_size).itemsize == 2 else "uint32",
        "val_fraction": float(settings["val_fraction"]), "split_seed": int(settings["split_seed"]),
        "created_unix": time.time(), "splits": splits,
    }


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
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncpp_jax.data.prepare",
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
