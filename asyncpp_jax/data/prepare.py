"""Prepare a corpus: tokenize a source's documents into a cached directory (prepare once, load many).

The directory's format, and how its key makes a changed input or setting prepare a new corpus
while an unchanged one is reused, is described in :mod:`asyncpp_jax.data.corpus`.  The directory
is built beside its final place (``<out>.partial``, locked by the process building it) and renamed
into it, so a crash never leaves a half-written corpus that looks valid.

At scale (the ``paper`` preset's 10.5B tokens):

* documents are encoded in groups (one batched ``encode_batch`` each) by ``workers`` processes
  (spawned, each with its own tokenizer and one thread), at most two groups per worker in flight,
  and written in the source's order, so the corpus does not depend on the number of workers;
* every ``checkpoint_seconds`` the build records how many documents it has written and where each
  split's stream stands (``progress.json``); an interrupted prepare, run again, cuts the streams
  back to that record and continues after those documents (read again, not tokenized again);
* a progress bar (on a terminal) counts documents, with tokens/s and, when the source's size is
  known beforehand (files, parquet row counts), the ETA; a log line repeats them every 30 s;
* each split's stream is cut into shards of ``shard_tokens`` that the reader streams in place
  (:class:`asyncpp_jax.data.stream.ShardedStream`).

Run as a module to prepare a corpus ahead of training:

    python -m asyncpp_jax.data.prepare --source=stdlib --tokenizer=byte --cache_dir=/tmp/corpora
    python -m asyncpp_jax.data.prepare --source='hf:parquet:fineweb-edu/sample/10BT/*.parquet' \
        --tokenizer=SmolLM2-135M/tokenizer.json --workers=32
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import concurrent.futures.process
import dataclasses
import fcntl
import functools
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import contextlib
import ctypes
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from asyncpp_jax import limits
from asyncpp_jax.data import sources
from asyncpp_jax.data.corpus import (FORMAT_VERSION, META_FILE, SPLITS, UNIGRAM_FILE, CorpusError, CorpusWriteError,
                                     SplitWriter, default_cache_dir, load_corpus, read_meta, token_dtype)
from asyncpp_jax.data.tokenizers import get_tokenizer

# Documents are tokenized in groups (batched ``encode_batch``) so memory stays bounded; with several
# worker processes each group is one task, at most ``_IN_FLIGHT_PER_WORKER`` per worker in flight.
_ENCODE_GROUP_DOCS = 256
_ENCODE_GROUP_BYTES = 16 << 20
_IN_FLIGHT_PER_WORKER = 2
PROGRESS_FILE = "progress.json"
_PARTIAL_UNIGRAMS = "unigram_counts.partial"


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


def default_workers(tokenizer: str) -> int:
    """Tokenizing processes: one for the byte tokenizer (cheaper than shipping text to a worker),
    else every core this process may run on, up to 32."""
    if tokenizer == "byte":
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 32))


# ----------------------------------------------------------------------------------------------
# Encoding a group: in this process, or in a worker process that holds its own tokenizer.

_WORKER_TOKENIZER = None
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this worker when its parent dies, however it dies (SIGKILL
    included), so no worker outlives a killed prepare holding its tokenizer's memory; Linux only."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pool's own shutdown is all there is
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _init_worker(tokenizer: str, eos_token: str | None, parent: int) -> None:
    global _WORKER_TOKENIZER  # pylint: disable=global-statement
    _die_with_parent(parent)
    # Ctrl-C in a terminal reaches the whole process group: the parent stops the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One thread per process: the processes are the parallelism (Rust's own pool would oversubscribe).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = get_tokenizer(tokenizer, eos_token)


def _encode_in_worker(texts: list[str], is_train: list[bool]):
    return _encode(_WORKER_TOKENIZER, texts, is_train)


def _encode(tok, texts: list[str], is_train: list[bool]):
    """``(ids per document with eos appended, in the corpus dtype; UTF-8 bytes per document; unigram
    counts of the train documents)``."""
    dtype = token_dtype(tok.vocab_size)
    ids_out, nbytes, train_ids = [], [], []
    for text, ids, train in zip(texts, tok.encode_batch(texts), is_train):
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tok.vocab_size):
            raise CorpusError(f"{tok!r} produced ids outside [0, {tok.vocab_size}); check config.data.tokenizer.")
        ids = np.concatenate([ids, [tok.eos_id]]).astype(dtype)
        ids_out.append(ids)
        nbytes.append(len(text.encode("utf-8", errors="replace")))
        if train:
            train_ids.append(ids)
    counts = np.bincount(np.concatenate(train_ids), minlength=tok.vocab_size) if train_ids else None
    return ids_out, nbytes, counts


def _encoded_groups(groups: Iterator[list], tok, tokenizer: str, eos_token: str | None, workers: int):
    """``(group, encoded)`` in the groups' order, encoded here or by ``workers`` processes."""
    args = lambda g: ([t for _, _, t in g], [s == "train" for s, _, _ in g])  # noqa: E731
    if workers <= 1:
        for g in groups:
            yield g, _encode(tok, *args(g))
        return
    # spawn, not fork: the trainer calls this with JAX's threads running.
    ctx = multiprocessing.get_context("spawn")
    others = set(multiprocessing.active_children())
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                  initargs=(tokenizer, eos_token, os.getpid()))
    pending: collections.deque = collections.deque()
    finished = False
    try:
        for g in groups:
            pending.append((g, pool.submit(_encode_in_worker, *args(g))))
            while len(pending) >= workers * _IN_FLIGHT_PER_WORKER:
                g0, f = pending.popleft()
                yield g0, f.result()
        while pending:
            g0, f = pending.popleft()
            yield g0, f.result()
        finished = True
    except concurrent.futures.process.BrokenProcessPool as e:
        raise CorpusWriteError(f"a tokenizing worker process died ({e}); out of memory?{limits.address_space_note()} "
                               "Pass fewer --workers (config: fewer cores), or free memory, and run again.") from e
    finally:
        if not finished:  # interrupted or failed: the groups in flight (seconds of work each) are not wanted
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in set(multiprocessing.active_children()) - others:
                worker.kill()
        pool.shutdown(wait=True)


# ----------------------------------------------------------------------------------------------
# Building a corpus: resumable, with progress.


class _Progress:
    """A progress bar (documents, with tokens/s) and a log line every ``every`` seconds with the
    rate and, when the number of documents is known, the ETA."""

    def __init__(self, total_docs: int | None, done_docs: int, done_tokens: int, log, bar: bool, every: float = 30.0):
        self.total, self.log, self.every = total_docs, log, every
        self.start_docs, self.start_tokens = done_docs, done_tokens
        self.docs, self.tokens = done_docs, done_tokens
        self.started = self.last_log = time.time()
        self.bar = tqdm(total=total_docs, initial=done_docs, unit=" docs", unit_scale=True, dynamic_ncols=True,
                        desc="tokenizing", disable=not bar or None, smoothing=0.05)

    def rate(self) -> float:
        return (self.tokens - self.start_tokens) / max(time.time() - self.started, 1e-9)

    def eta(self) -> str:
        new_docs = self.docs - self.start_docs
        if not self.total or not new_docs:
            return "?"
        seconds = (self.total - self.docs) * (time.time() - self.started) / new_docs
        return time.strftime("%H:%M:%S", time.gmtime(max(seconds, 0.0)))

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bar.update(docs)
        self.bar.set_postfix_str(f"{self.tokens / 1e6:.1f}M tokens, {self.rate() / 1e6:.2f}M tokens/s", refresh=False)
        if time.time() - self.last_log >= self.every:
            self.last_log = time.time()
            self.log(f"corpus: {self.docs} documents, {self.tokens} tokens, {self.rate():,.0f} tokens/s, ETA {self.eta()}")

    def close(self) -> None:
        self.bar.close()


def _save_progress(directory: str, key: str, docs_done: int, writers: dict, unigram_counts: np.ndarray) -> None:
    """What :func:`_load_progress` resumes from.  The unigram counts go to a file named after
    ``docs_done`` that ``progress.json`` names, and ``progress.json`` is replaced last, atomically:
    a kill at any point leaves a record whose parts agree."""
    states = {s: w.state() for s, w in writers.items()}
    counts_name = f"{_PARTIAL_UNIGRAMS}.{docs_done}.npy"
    np.save(os.path.join(directory, counts_name), unigram_counts)
    tmp = os.path.join(directory, PROGRESS_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format_version": FORMAT_VERSION, "key": key, "docs_done": docs_done, "splits": states,
                   "unigram_counts": counts_name}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, PROGRESS_FILE))
    for name in os.listdir(directory):
        if name.startswith(_PARTIAL_UNIGRAMS) and name != counts_name:
            os.remove(os.path.join(directory, name))


def _load_progress(directory: str, key: str) -> tuple[dict, np.ndarray] | None:
    try:
        with open(os.path.join(directory, PROGRESS_FILE), encoding="utf-8") as f:
            progress = json.load(f)
        if progress.get("format_version") != FORMAT_VERSION or progress.get("key") != key:
            return None
        counts = np.load(os.path.join(directory, progress["unigram_counts"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return progress, counts


def _write_streams(directory: str, plan: "_Plan", tok, settings: dict, log: Callable[[str], None],
                   workers: int, bar: bool, checkpoint_seconds: float) -> tuple[dict, np.ndarray]:
    """Tokenizes the plan's documents, in order, into the split streams in ``directory``, resuming
    from its ``progress.json`` if an earlier attempt left one.  Returns the per-split statistics for
    meta.json and the train unigram counts."""
    dtype = token_dtype(tok.vocab_size)
    record_names = plan.source_info["kind"] != "hf"
    writers = {s: SplitWriter(directory, s, dtype, settings["shard_tokens"], tok.vocab_size, record_names,
                              count_unigrams=False) for s in SPLITS}
    unigram_counts, docs_done = np.zeros(tok.vocab_size, np.int64), 0
    saved = _load_progress(directory, plan.key)
    if saved is not None:
        progress, unigram_counts = saved
        docs_done = int(progress["docs_done"])
        for s, w in writers.items():
            w.resume(progress["splits"][s])
        log(f"corpus: resuming after {docs_done} documents ({sum(w.num_tokens for w in writers.values())} tokens) "
            f"from {directory}")
    docs = itertools.islice(plan.documents(), docs_done, None)
    meter = _Progress(plan.total_docs, docs_done, sum(w.num_tokens for w in writers.values()), log, bar)
    # closing(): an interruption here stops the workers now, not when the generator is collected.
    encoded = contextlib.closing(_encoded_groups(_grouped(docs), tok, settings["tokenizer"], settings["eos_token"],
                                                 workers))
    try:
        with encoded as groups:
            _write_groups(groups, writers, unigram_counts, directory, plan.key, docs_done, meter, checkpoint_seconds)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        meter.close()
    log(f"corpus: tokenized {meter.docs} documents at {meter.rate():,.0f} tokens/s ({workers} process(es))")
    return {s: w.finish() for s, w in writers.items()}, unigram_counts


def _write_groups(groups, writers: dict, unigram_counts: np.ndarray, directory: str, key: str, docs_done: int,
                  meter, checkpoint_seconds: float) -> None:
    """Append each encoded group to its split's stream, recording the progress every ``checkpoint_seconds``."""
    last_save = time.time()
    for group, (ids, nbytes, counts) in groups:
        for (split, name, _), doc_ids, n in zip(group, ids, nbytes):
            writers[split].add(name, n, doc_ids)
        if counts is not None:
            unigram_counts += counts
        docs_done += len(group)
        meter.update(len(group), sum(len(x) for x in ids))
        if time.time() - last_save >= checkpoint_seconds:
            _save_progress(directory, key, docs_done, writers, unigram_counts)
            last_save = time.time()

# ----------------------------------------------------------------------------------------------
# Prepare


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "_", text).strip("_.")[:48] or "corpus"


def prepare_corpus(source: str, tokenizer: str = "byte", cache_dir: str | None = None,
                   val_fraction: float = 0.05, split_seed: int = 0, eos_token: str | None = None,
                   hf_split: str = "train", hf_text_field: str = "text", hf_max_docs: int = 0,
                   shard_tokens: int = 2**26, log: Callable[[str], None] = print, workers: int = 0,
                   progress_bar: bool = True, checkpoint_seconds: float = 30.0) -> str:
    """Tokenizes `source` into `<cache_dir>/<slug>-<key>` (see :mod:`asyncpp_jax.data.corpus`); returns it.

    Sources (`config.data.source`): `'stdlib'`; `'hf:<dataset>[:<config_name>]'` (streamed from the
    Hub); `'hf:<loader>:<files>'` with a `datasets` local loader (:data:`sources.LOCAL_HF_LOADERS`:
    parquet, json lines, arrow, csv, text) and comma-separated files or globs; or comma-separated
    files, directories (every non-hidden file below) and glob patterns. If a corpus with the same
    key already exists it is returned without tokenizing anything.

    `workers` tokenizing processes (0: :func:`default_workers`); the result does not depend on it.
    The build directory `<out>.partial` records its progress every `checkpoint_seconds`, so an
    interrupted prepare resumes where it stopped (the documents before are read, not tokenized).
    """
    sources.check_val_fraction(val_fraction)
    if shard_tokens < 1:
        raise CorpusError(f"shard_tokens={shard_tokens} must be positive.")
    tok = get_tokenizer(tokenizer, eos_token)
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    plan = _plan(source, tok, val_fraction, split_seed, hf_split, hf_text_field, hf_max_docs)
    out = os.path.join(cache_dir, f"{plan.slug}-{plan.key}")
    if _complete(out, plan.key):
        log(f"corpus: using cached {out}")
        return out
    settings = {"tokenizer": tokenizer, "eos_token": eos_token, "val_fraction": val_fraction,
                "split_seed": split_seed, "shard_tokens": shard_tokens}
    workers = workers if workers > 0 else default_workers(tokenizer)
    return _build(out, plan, tok, settings, log, workers, progress_bar, checkpoint_seconds)


def _complete(out: str, key: str) -> bool:
    meta = read_meta(out)
    return meta is not None and meta.get("format_version") == FORMAT_VERSION and meta.get("key") == key


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What to tokenize and where it is cached: ``documents()`` yields ``(split, name, text)``, in
    the same order on every call; ``total_docs`` is how many, when known beforehand (else None)."""
    source: str
    slug: str
    key: str
    documents: Callable[[], Iterable[tuple[str, str, str]]]
    source_info: dict
    total_docs: int | None = None


def _file_stats(listing) -> list:
    # The base directory is part of the key so two different trees with identical relative
    # names, sizes and mtimes can never share a cached corpus.
    stats = [os.stat(p) for p in listing.paths]
    return [listing.base] + [[n, s.st_size, s.st_mtime_ns] for n, s in zip(listing.names, stats)]


def _plan(source: str, tok, val_fraction: float, split_seed: int, hf_split: str, hf_text_field: str,
          hf_max_docs: int) -> _Plan:
    """The documents of ``source`` and the cache key: a hash of everything their tokens depend on."""
    key_material = {"format_version": FORMAT_VERSION, "source": source,
                    "tokenizer_fingerprint": tok.fingerprint, "eos_id": tok.eos_id,
                    "val_fraction": repr(float(val_fraction)), "split_seed": int(split_seed)}
    total = None
    if source.startswith("hf:"):
        dataset, config_name = sources.parse_hf_source(source)
        listing = sources.local_hf_files(dataset, config_name)
        if listing is not None:  # a datasets local loader over files: their contents are the input
            key_material["hf"] = [dataset, hf_text_field, int(hf_max_docs)]
            key_material["files"] = _file_stats(listing)
            slug = _slug(f"hf_{dataset}_{os.path.basename(listing.base)}")
            documents = functools.partial(sources.hf_local_documents, dataset, listing, hf_text_field,
                                          hf_max_docs, val_fraction, split_seed)
            source_info = {"kind": "hf", "loader": dataset, "base": listing.base, "files": len(listing.names),
                           "text_field": hf_text_field, "max_docs": int(hf_max_docs)}
            total = sources.count_rows(dataset, listing)
        else:
            key_material["hf"] = [dataset, config_name, hf_split, hf_text_field, int(hf_max_docs)]
            slug = _slug(f"hf_{dataset}_{config_name or ''}")
            documents = functools.partial(sources.hf_documents, dataset, config_name, hf_split,
                                          hf_text_field, hf_max_docs, val_fraction, split_seed)
            source_info = {"kind": "hf", "dataset": dataset, "config_name": config_name,
                           "split": hf_split, "text_field": hf_text_field, "max_docs": int(hf_max_docs)}
        if hf_max_docs > 0:
            total = hf_max_docs if total is None else min(total, hf_max_docs)
    else:
        listing = sources.list_stdlib_files() if source == "stdlib" else sources.list_local_files(source)
        key_material["files"] = _file_stats(listing)
        slug = "stdlib" if source == "stdlib" else _slug(os.path.basename(listing.base) or "files")
        is_val = sources.assign_splits(listing.names, val_fraction, split_seed)
        documents = functools.partial(sources.local_documents, listing, is_val)
        source_info = {"kind": "stdlib" if source == "stdlib" else "files", "base": listing.base}
        total = len(listing.names)
    slug = f"{slug}-{_slug(tok.fingerprint.split('-')[0])}"
    key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:16]
    return _Plan(source, slug, key, documents, source_info, total)


_HOLDER_FILE = "holder.json"  # in the build directory: who holds its lock (for a prepare that waits)


def _holder(partial: str) -> str:
    try:
        with open(os.path.join(partial, _HOLDER_FILE), encoding="utf-8") as f:
            h = json.load(f)
        return f"pid {h['pid']} on {h['host']}, since {time.strftime('%H:%M:%S', time.localtime(h['since']))}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet"


def _lock_partial(partial: str, out: str, key: str, log: Callable[[str], None] = print):
    """An exclusive lock on the build directory ``partial`` (created if need be), or None when
    ``out`` is complete by the time the lock is ours (another process built it meanwhile).  The lock
    is the directory's own (``flock`` on its descriptor), so it goes when the directory is renamed
    into place or removed; a process that waited then finds the corpus complete, or starts afresh.
    A prepare that has to wait says so, naming the holder (``holder.json``, written by each holder)."""
    while True:
        if _complete(out, key):
            return None
        os.makedirs(partial, exist_ok=True)
        fd = os.open(partial, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"corpus: waiting for another prepare of the same corpus to finish ({_holder(partial)}; it holds "
                f"the lock on {partial}); this one then uses its result")
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(partial).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same and not _complete(out, key):
            with open(os.path.join(partial, _HOLDER_FILE), "w", encoding="utf-8") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}, f)
            return fd
        os.close(fd)


class Interrupted(KeyboardInterrupt):
    """SIGTERM during a prepare: stopped as Ctrl-C stops it (the progress is kept)."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises :class:`Interrupted` (a KeyboardInterrupt) in the main thread, as Ctrl-C does,
    so a terminated prepare records where it stands and says so instead of vanishing silently."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Interrupted(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write_failure(e: OSError, where: str) -> CorpusWriteError:
    """One line for a write the machine refused (a file-size limit, a full disk, no permission)."""
    why = limits.describe(e) or f"{e.strerror or e}: pass another cache directory (config.data.cache_dir / --cache_dir)"
    return CorpusWriteError(f"preparing the corpus in {where}: {why}")


def _build(out: str, plan: _Plan, tok, settings: dict, log: Callable[[str], None], workers: int,
           progress_bar: bool, checkpoint_seconds: float) -> str:
    """Tokenizes ``plan`` into ``<out>.partial`` (resuming what an interrupted build left there) and
    renames it into place.  A build that fails before its first progress record leaves nothing."""
    partial = out + ".partial"
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        fd = _lock_partial(partial, out, plan.key, log)
    except OSError as e:
        raise _write_failure(e, os.path.dirname(out)) from e
    if fd is None:
        log(f"corpus: {out} was prepared concurrently; using it")
        return out
    done = interrupted = False
    try:
        with _sigterm_as_interrupt():
            _build_locked(out, partial, plan, tok, settings, log, workers, progress_bar, checkpoint_seconds)
        done = True
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (_sigterm_as_interrupt)
        interrupted = True
        raise
    except OSError as e:
        raise _write_failure(e, partial) from e
    finally:
        if not done:
            if os.path.exists(os.path.join(partial, PROGRESS_FILE)):
                log(f"corpus: interrupted; {partial} keeps the progress, run the same prepare again to resume")
            else:
                shutil.rmtree(partial, ignore_errors=True)
                if interrupted:
                    log(f"corpus: interrupted before its first progress record (one every {checkpoint_seconds:g} s); "
                        "nothing was kept, run the same prepare again to start over")
        os.close(fd)
    return out


def _build_locked(out: str, partial: str, plan: _Plan, tok, settings: dict, log: Callable[[str], None],
                  workers: int, progress_bar: bool, checkpoint_seconds: float) -> None:
    """The build itself, with the lock on ``partial`` held: tokenize, then seal and rename."""
    if os.path.exists(out):
        log(f"corpus: {out} exists but has no valid {META_FILE}; rebuilding it")
        shutil.rmtree(out)
    log(f"corpus: tokenizing {plan.source!r} with {settings['tokenizer']!r} into {out}")
    started = time.time()
    splits, unigram_counts = _write_streams(partial, plan, tok, settings, log, workers, progress_bar,
                                            checkpoint_seconds)
    np.save(os.path.join(partial, UNIGRAM_FILE), unigram_counts)
    for name in os.listdir(partial):
        if name.startswith(PROGRESS_FILE) or name.startswith(_PARTIAL_UNIGRAMS) or name == _HOLDER_FILE:
            os.remove(os.path.join(partial, name))
    # meta.json is written last: its presence marks the directory complete.
    with open(os.path.join(partial, META_FILE), "w", encoding="utf-8") as f:
        json.dump(_meta(plan, tok, settings, splits), f, indent=1)
    os.chmod(partial, 0o755)
    os.rename(partial, out)
    log(f"corpus: wrote {out} in {time.time() - started:.1f}s: " + ", ".join(
        f"{s} {splits[s]['num_docs']} docs / {splits[s]['num_tokens']} tokens" for s in SPLITS))


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


def prepare_corpus_for(data_config, log: Callable[[str], None] = print, progress_bar: bool = True) -> str:
    """:func:`prepare_corpus` with the settings of a config's ``data`` section: the one call the
    trainer and the sweep runner (which prepares a study's corpus before its jobs) both make, so
    they agree on the corpus key."""
    d = data_config
    return prepare_corpus(
        d.source, tokenizer=d.tokenizer, cache_dir=d.cache_dir or None, val_fraction=d.val_fraction,
        split_seed=d.split_seed, eos_token=d.eos_token or None, hf_split=d.hf_split,
        hf_text_field=d.hf_text_field, hf_max_docs=d.hf_max_docs, log=log, progress_bar=progress_bar,
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
    parser.add_argument("--workers", type=int, default=0,
                        help="tokenizing processes (0: one for 'byte', else every core up to 32)")
    parser.add_argument("--no_progress_bar", action="store_true")
    parser.add_argument("--checkpoint_seconds", type=float, default=30.0,
                        help="how often the build records its progress (an interrupted prepare resumes from it)")
    args = parser.parse_args(argv)
    try:
        path = prepare_corpus(args.source, args.tokenizer, args.cache_dir, args.val_fraction,
                              args.split_seed, args.eos_token, args.hf_split, args.hf_text_field,
                              args.hf_max_docs, args.shard_tokens,
                              log=lambda m: print(m, file=sys.stderr), workers=args.workers,
                              progress_bar=not args.no_progress_bar, checkpoint_seconds=args.checkpoint_seconds)
        corpus = load_corpus(path)
    except ValueError as e:  # CorpusError and tokenizer errors carry the fix in their message
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the build said what it kept
        return 130
    except MemoryError:
        print(f"error: preparing the corpus: {limits.describe(MemoryError())}", file=sys.stderr)
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
