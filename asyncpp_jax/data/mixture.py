"""Weighted data sources in one run (``config.data.mixture = '0.7:stdlib;0.3:/data/*.txt'``).

Each source is prepared into its own cached corpus with the run's tokenizer and split settings, so a
source shared by several mixtures is tokenized once.  The train samples are grain's deterministic
mixture of the sources' window streams (``grain.MapDataset.mix``): with the weights reduced to
integer proportions ``n_k``, every run of ``sum(n_k)`` consecutive samples holds ``n_k`` windows of
source ``k``, each source's windows shuffled and repeated on their own (a fresh order every epoch
of that source).  The mixed stream is a ``MapDataset`` like a single source's, so its iterator state
is a position and a resume continues it exactly.

Global batch ``s`` is samples ``s*B .. s*B + B - 1``; :meth:`Mixture.shares` gives each source's
share of it, which the trainer logs as ``data_share/K``.  Validation mixes the sources' validation
windows in the same proportions, in stream order; its nats per byte use the mixture's bytes per
token, ``sum_k w_k * bytes_per_token_k`` (weights normalized).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Callable

import grain
import ml_collections
import numpy as np

from asyncpp_jax.data.corpus import CorpusError, load_corpus
from asyncpp_jax.data.prepare import prepare_corpus_for
from asyncpp_jax.data.stream import ShardedStream


class Mixture:
    """Several prepared corpora read as one, in the proportions ``weights`` (normalized to sum 1)."""

    def __init__(self, corpora, weights, sources):
        vocab = {c.vocab_size for c in corpora}
        if len(vocab) != 1:
            raise CorpusError(f"config.data.mixture's sources were prepared with different vocabularies ({vocab}); "
                              "every source of a mixture uses config.data.tokenizer.")
        self.corpora, self.sources = list(corpora), list(sources)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.vocab_size = corpora[0].vocab_size
        self.path = " + ".join(c.path for c in corpora)
        # Which source each mixed sample comes from: the selection depends on the proportions only.
        self._source_of = grain.MapDataset.mix(
            [grain.MapDataset.source([k]).repeat() for k in range(len(corpora))], self.weights)

    def num_tokens(self, split: str) -> int:
        return sum(c.num_tokens(split) for c in self.corpora)

    @property
    def meta(self) -> dict:
        """The first source's metadata (every source shares the tokenizer), the mixture as its source."""
        return {**self.corpora[0].meta, "source": ";".join(f"{w:g}:{s}" for w, s in zip(self.weights, self.sources))}

    @property
    def fingerprint(self) -> str:
        """16 hex digits over each source's corpus fingerprint and weight: a resume on another mix,
        or on a source whose corpus changed, is a changed corpus (``train.resume``)."""
        key = json.dumps([[round(w, 12), c.fingerprint] for w, c in zip(self.weights, self.corpora)])
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def bytes_per_token(self, split: str) -> float:
        return sum(w * c.bytes_per_token(split) for w, c in zip(self.weights, self.corpora))

    def train_samples(self, seq_len: int, seed: int, windows: Callable, shuffle_seed: Callable) -> grain.MapDataset:
        """The infinite mixed stream of train windows (``windows(tokens, seq_len)`` cuts a token stream)."""
        parents = []
        for k, (corpus, source) in enumerate(zip(self.corpora, self.sources)):
            w = windows(corpus.tokens("train"), seq_len)
            if len(w) == 0:
                raise CorpusError(f"config.data.mixture's source {k} ({source}) has {corpus.num_tokens('train')} train "
                                  f"tokens, not one window of config.data.seq_len={seq_len}; drop it or give it more text.")
            parents.append(grain.MapDataset.source(w).shuffle(seed=shuffle_seed(seed, k)).repeat())
        return grain.MapDataset.mix(parents, self.weights)

    def eval_windows(self, split: str, seq_len: int, windows: Callable) -> grain.MapDataset | list:
        """The sources' ``split`` windows mixed in the weights' proportions, in stream order (finite)."""
        parents = [grain.MapDataset.source(windows(c.tokens(split), seq_len)) for c in self.corpora]
        if any(len(p) == 0 for p in parents):
            return []
        return grain.MapDataset.mix(parents, self.weights)

    def source_of(self, sample: int) -> int:
        """The source (its position K) of mixed sample ``sample``; global batch ``s`` holds samples ``s*B ..``."""
        return self._source_of[sample]

    def shares(self, batch_index: int, global_batch_size: int) -> dict[str, float]:
        """Each source's share of global batch ``batch_index`` (``data_share/K``, K the source's position)."""
        start = batch_index * global_batch_size
        counts = np.bincount([self._source_of[start + r] for r in range(global_batch_size)],
                             minlength=len(self.corpora))
        return {f"data_share/{k}": n / global_batch_size for k, n in enumerate(counts)}

    def unigram_entropy_nats_per_byte(self) -> dict:
        """The single-corpus baselines (``Corpus.unigram_entropy_nats_per_byte``) for the mixed token
        distributions: train unigrams ``p = sum_k w_k p_k``, and likewise the validation tokens."""
        train_p = sum(w * c.unigram_counts() / c.num_tokens("train") for w, c in zip(self.weights, self.corpora))
        n_train = sum(c.num_tokens("train") for c in self.corpora)
        nz = train_p[train_p > 0]
        entropy_per_token = float(-(nz * np.log(nz)).sum())
        log_q = np.log((train_p * n_train + 1.0) / (n_train + self.vocab_size))
        val_p = sum(w * _counts(c.tokens("val"), self.vocab_size) / c.num_tokens("val")
                    for w, c in zip(self.weights, self.corpora))
        return {"train_entropy": entropy_per_token / self.bytes_per_token("train"),
                "val_cross_entropy": float(-(val_p * log_q).sum()) / self.bytes_per_token("val")}

    def describe(self) -> str:
        return "; ".join(f"data_share/{k} = {source} (weight {w:.3g}, {c.num_tokens('train'):,} train tokens)"
                         for k, (source, w, c) in enumerate(zip(self.sources, self.weights, self.corpora)))

    def __repr__(self) -> str:
        return f"Mixture({self.describe()})"


def _counts(tokens, vocab_size: int) -> np.ndarray:
    """Token counts of a split, one shard's memmap or several read in place."""
    if isinstance(tokens, ShardedStream):
        return tokens.bincount(vocab_size)
    return np.bincount(tokens, minlength=vocab_size)


def load_mixture(data_config, sources: list[tuple[float, str]], log: Callable[[str], None] = print) -> Mixture:
    """Prepare (or find in the cache) each ``(weight, source)``'s corpus with ``data_config``'s other
    settings, and open them as one :class:`Mixture`."""
    corpora = []
    for _, source in sources:
        d = ml_collections.ConfigDict(data_config.to_dict())
        d.source = source
        corpora.append(load_corpus(prepare_corpus_for(d, log=log), verify=d.verify_checksums))
    assert all(math.isfinite(w) and w > 0 for w, _ in sources)  # the config's validator checked them
    return Mixture(corpora, [w for w, _ in sources], [s for _, s in sources])
