"""Data layer: tokenizers, document sources, cached on-disk tokenized corpora, grain input pipelines.

Modules: ``tokenizers``; ``sources`` (stdlib, local files, Hugging Face; the train/val split);
``corpus`` (the on-disk format: writer, reader, checks); ``prepare`` (tokenize a source into the
cache; also the command line); ``stream`` and ``pipeline`` (grain input pipelines); ``mixture``
(weighted sources in one run).

Depends only on numpy, tokenizers and grain (never on `asyncpp_jax.train` or
`asyncpp_jax.pipeline`). Names are re-exported lazily (PEP 562) so that importing this package, or
running `python -m asyncpp_jax.data.prepare`, loads neither grain nor, through grain's orbax
integration, jax, until a pipeline is actually asked for.
"""

import importlib

_EXPORTS = {
    "ByteTokenizer": "tokenizers",
    "HFTokenizer": "tokenizers",
    "get_tokenizer": "tokenizers",
    "Corpus": "corpus",
    "CorpusError": "corpus",
    "CorpusWriteError": "corpus",
    "FileListing": "sources",
    "assign_splits": "sources",
    "default_cache_dir": "corpus",
    "list_local_files": "sources",
    "list_stdlib_files": "sources",
    "load_corpus": "corpus",
    "prepare_corpus": "prepare",
    "prepare_corpus_for": "prepare",
    "Mixture": "mixture",
    "load_mixture": "mixture",
    "PackedWindows": "pipeline",
    "ShardedStream": "stream",
    "make_eval_batches": "pipeline",
    "make_train_dataset": "pipeline",
    "make_train_iterator": "pipeline",
    "batch_rows": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
