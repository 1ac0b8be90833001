"""grain input pipelines over a prepared corpus: packed windows, shuffled, sharded, batched.

Packing follows GPT-2 / nanoGPT: a split's documents are already concatenated into one token
stream with an eos token after each document, and the stream is cut into fixed windows with no
padding and no attention reset at document boundaries. Window i is
`stream[i*L : i*L + L + 1]` (L = seq_len), so windows overlap by one token: inputs are `w[:-1]`,
targets `w[1:]`, and each stream token after the first is a target exactly once per epoch (the
last `(len - 1) % L` tokens, less than one window, are never used).

The train pipeline is a `grain.MapDataset` (random access, so its iterator state is just a
position and checkpoints are tiny and exact):

    source(windows) -> shuffle(seed) -> repeat() -> global batch s = samples[s*B : s*B + B]
                                                  -> this process's rows of it

Grain's `ShuffleMapDataset` maps index `e * n + k` to epoch `e`'s permutation drawn with seed
`seed + e`, so shuffling before an infinite `repeat()` gives every epoch a fresh order. Each process
reads only the rows of the global batch that its devices hold (computed from the mesh by
`train.batch_layout`), so the global batch is the same array whatever the number of processes.
"""

from __future__ import annotations

import functools
import hashlib

import grain
import numpy as np

from asyncpp_jax.data.corpus import Corpus, CorpusError


class PackedWindows:
    """Random-access view of a token stream as windows of `seq_len + 1` tokens (see module doc).

    Reads straight from the corpus memmap; an item is a fresh int32 array, so callers may mutate it.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"config.data.seq_len={seq_len} must be positive.")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self._len = max(0, (len(tokens) - 1) // self.seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} windows")
        start = index * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)

    def __repr__(self) -> str:
        return f"PackedWindows({self._len} windows of {self.seq_len}+1 tokens)"


def _shuffle_seed(seed: int, source: int = 0) -> int:
    # grain wants a 32-bit seed and reuses seed+e for epoch e; hashing the user's seed keeps runs
    # with adjacent seeds (0, 1, 2, ...) from sharing epoch orders shifted by one epoch.  A
    # mixture's source k > 0 gets its own orders (data/mixture.py).
    suffix = f"/{int(source)}" if source else ""
    digest = hashlib.sha256(f"asyncpp_jax/train-shuffle/{int(seed)}{suffix}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def batch_rows(global_batch_size: int, process_index: int = 0, process_count: int = 1,
               rows=None) -> np.ndarray:
    """The sorted row offsets, in ``[0, global_batch_size)``, of every global batch this process loads.

    ``rows`` as given (the trainer computes them from the mesh: ``train.batch_layout``), else the
    ``process_index``-th of ``process_count`` equal contiguous blocks.
    """
    if global_batch_size < 1:
        raise ValueError(f"config.train.global_batch_size={global_batch_size} must be positive.")
    if rows is not None:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or not len(rows) or np.any(np.diff(rows) <= 0) or rows[0] < 0 \
                or rows[-1] >= global_batch_size:
            raise ValueError(f"rows must be distinct sorted offsets in [0, {global_batch_size}), got {rows}.")
        return rows
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index={process_index} must be in [0, process_count={process_count})."
        )
    if global_batch_size % process_count:
        raise ValueError(
            f"config.train.global_batch_size={global_batch_size} must be divisible by the number "
            f"of processes ({process_count}) so every process loads the same number of sequences."
        )
    n = global_batch_size // process_count
    return np.arange(process_index * n, (process_index + 1) * n)


def _gather_rows(samples: grain.MapDataset, global_batch_size: int, rows: np.ndarray, step: int) -> np.ndarray:
    return np.stack([samples[int(step) * global_batch_size + int(r)] for r in rows])


def make_train_dataset(corpus: Corpus, seq_len: int, global_batch_size: int, seed: int,
                       process_index: int = 0, process_count: int = 1, rows=None) -> grain.MapDataset:
    """Infinite, shuffled train batches for this process: int32 `[len(rows), seq_len + 1]` (inputs
    `b[:, :-1]`, targets `b[:, 1:]`), where `rows` are :func:`batch_rows`.

    Global batch `s` is samples `s*B .. s*B + B - 1` of the shuffled, repeated window order (B =
    `global_batch_size`); a process reads only its rows of it, so the global batch is the same
    array whatever the number of processes. Deterministic given `seed`; every epoch is a new
    permutation of all windows. Batches may span an epoch boundary, so every batch is full.
    A :class:`~asyncpp_jax.data.mixture.Mixture` gives the samples of its weighted sources instead.
    """
    rows = batch_rows(global_batch_size, process_index, process_count, rows)
    if hasattr(corpus, "train_samples"):  # a data/mixture.Mixture of several corpora
        samples = corpus.train_samples(seq_len, seed, PackedWindows, _shuffle_seed)
        return grain.MapDataset.range(len(samples) // global_batch_size).map(
            functools.partial(_gather_rows, samples, global_batch_size, rows))
    windows = PackedWindows(corpus.tokens("train"), seq_len)
    if len(windows) < global_batch_size:
        raise CorpusError(
            f"The train split of {corpus.path} has {corpus.num_tokens('train')} tokens, i.e. "
            f"{len(windows)} windows of config.data.seq_len={seq_len}, fewer than one batch of "
            f"config.train.global_batch_size={global_batch_size}. Lower config.data.seq_len or the "
            "batch size, or use a larger config.data.source.")
    samples = grain.MapDataset.source(windows).shuffle(seed=_shuffle_seed(seed)).repeat()
    steps = grain.MapDataset.range(len(samples) // global_batch_size)
    return steps.map(functools.partial(_gather_rows, samples, global_batch_size, rows))


def make_train_iterator(corpus: Corpus, seq_len: int, global_batch_size: int, seed: int,
                        process_index: int = 0, process_count: int = 1, rows=None, *,
                        num_threads: int = 2, prefetch_batches: int = 4) -> grain.DatasetIterator:
    """A checkpointable iterator over `make_train_dataset(...)`.

    `get_state()` / `set_state()` (and `grain.checkpoint.CheckpointSave/Restore` in an orbax
    `CheckpointManager`) save and restore the position exactly, mid-epoch included. A few batches
    are prefetched in threads; grain's default (500 elements) would hold 500 whole batches.
    """
    dataset = make_train_dataset(corpus, seq_len, global_batch_size, seed, process_index,
                                 process_count, rows)
    read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_batches)
    return iter(dataset.to_iter_dataset(read_options))


def make_eval_batches(corpus: Corpus, seq_len: int, batch_size: int, num_batches: int,
                      split: str = "val", from_end: bool = False) -> list[np.ndarray]:
    """The first `num_batches` full batches of `split`'s windows, in stream order (no shuffle);
    with `from_end`, the last ones instead (a held-out test set disjoint from the first ones as
    long as the split holds both).

    The same fixed set every call, so evaluations at different steps and in different runs are
    comparable. Uses fewer batches if the split is too short, never a partial batch.
    """
    if batch_size < 1 or num_batches < 1:
        raise ValueError(
            f"eval batch_size={batch_size} and config.train.eval_batches={num_batches} must be "
            "positive."
        )
    windows = (corpus.eval_windows(split, seq_len, PackedWindows) if hasattr(corpus, "eval_windows")
               else PackedWindows(corpus.tokens(split), seq_len))
    available = min(num_batches, len(windows) // batch_size)
    if available == 0:
        raise CorpusError(
            f"The {split} split of {corpus.path} has {corpus.num_tokens(split)} tokens, i.e. "
            f"{len(windows)} windows of config.data.seq_len={seq_len}: not one full eval batch of "
            f"{batch_size}. Lower config.data.seq_len or the eval batch size, raise "
            "config.data.val_fraction, or use a larger config.data.source; "
            "config.train.eval_batches cannot help."
        )
    first = len(windows) // batch_size - available if from_end else 0
    return [np.stack([windows[(first + b) * batch_size + j] for j in range(batch_size)])
            for b in range(available)]
