"""Where a corpus's documents come from, and which split each one goes to.

Sources (``config.data.source``): ``'stdlib'`` (this interpreter's standard library: real, varied
text on every machine, no download), local files / directories / glob patterns,
``'hf:<dataset>[:<config_name>]'`` (a Hugging Face dataset, streamed), or
``'hf:<loader>:<files>'``, local files read by a ``datasets`` loader (``hf:parquet:data/*.parquet``,
``hf:json:docs.jsonl``, ``hf:arrow:...``; :data:`LOCAL_HF_LOADERS`).  Each yields
``(split, name, text)`` documents for :mod:`asyncpp_jax.data.prepare` to tokenize.

Train/val are split by document (a file, or a dataset row), never inside one, so no text is shared
between the two; the choice hashes the document's name (files) or text (dataset rows) with the
split seed, so it does not depend on order or on which other documents exist.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from asyncpp_jax.data.corpus import CorpusError

# Directories that hold installed third-party packages, not the standard library itself.
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_GLOB_CHARS = re.compile(r"[*?[]")


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


def parse_hf_source(source: str) -> tuple[str, str | None]:
    spec = source[len("hf:"):]
    dataset, _, config_name = spec.partition(":")
    if not dataset:
        raise CorpusError(
            f"config.data.source={source!r}: expected 'hf:<dataset>[:<config_name>]', e.g. "
            "'hf:HuggingFaceFW/fineweb-edu:sample-10BT'.")
    return dataset, (config_name or None)

# ----------------------------------------------------------------------------------------------
# Train/val split


def unit_hash(split_seed: int, key: str | bytes) -> float:
    """A stable number in [0, 1) for `key`: same on every run, machine and Python version."""
    if isinstance(key, str):
        key = key.encode("utf-8", errors="surrogatepass")
    digest = hashlib.sha256(f"{split_seed}:".encode() + key).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def check_val_fraction(val_fraction: float) -> None:
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
    check_val_fraction(val_fraction)
    if len(names) < 2:
        raise CorpusError(
            f"The corpus has {len(names)} document(s); at least 2 are needed to get a non-empty "
            "train and validation split. Point config.data.source at more files."
        )
    scores = [unit_hash(split_seed, n) for n in names]
    is_val = [s < val_fraction for s in scores]
    if not any(is_val):
        is_val[int(np.argmin(scores))] = True
    if all(is_val):
        is_val[int(np.argmax(scores))] = False
    return is_val

# ----------------------------------------------------------------------------------------------
# Documents


def local_documents(listing: FileListing, is_val: Sequence[bool]):
    for name, path, val in zip(listing.names, listing.paths, is_val):
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        yield ("val" if val else "train"), name, text


LOCAL_HF_LOADERS = ("parquet", "json", "arrow", "csv", "text")


def _import_datasets(source: str):
    try:
        import datasets  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise CorpusError(
            f"config.data.source={source!r} needs the Hugging Face `datasets` package: "
            "pip install '.[hf]' from the asyncpp_jax checkout (or pip install datasets)") from e
    return datasets


def local_hf_files(dataset: str, config_name: str | None) -> FileListing | None:
    """The files of ``hf:<loader>:<files>`` (a ``datasets`` local loader, :data:`LOCAL_HF_LOADERS`),
    or None for a Hub dataset (``hf:<org>/<name>[:<config>]``)."""
    if dataset not in LOCAL_HF_LOADERS:
        return None
    if not config_name:
        raise CorpusError(f"config.data.source='hf:{dataset}': name the files, e.g. 'hf:{dataset}:data/*.{dataset}' "
                          f"(comma-separated files or glob patterns).")
    return list_local_files(config_name)


def count_rows(loader: str, listing: FileListing) -> int | None:
    """Rows in the files when their metadata says so without reading them (parquet), else None."""
    if loader != "parquet":
        return None
    try:
        import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

        return int(sum(pq.ParquetFile(p).metadata.num_rows for p in listing.paths))
    except Exception:  # pylint: disable=broad-except  # only the progress bar's total
        return None


def hf_local_documents(loader: str, listing: FileListing, text_field: str, max_docs: int, val_fraction: float,
                       split_seed: int):
    """Rows of local files through ``datasets``' own loader for their format (streamed: no copy in
    the Hugging Face cache), in file order, split as :func:`hf_documents` splits a Hub dataset's."""
    source = f"hf:{loader}:{listing.base}"
    datasets = _import_datasets(source)
    stream = datasets.load_dataset(loader, data_files=list(listing.paths), split="train", streaming=True)
    yield from _split_rows(stream, "train", source, text_field, max_docs, val_fraction, split_seed)


def hf_documents(dataset: str, config_name: str | None, hf_split: str, text_field: str,
                  max_docs: int, val_fraction: float, split_seed: int):
    """Streams `(split, name, text)` rows from a Hugging Face dataset without downloading it whole
    (:func:`_split_rows` says which split each row goes to)."""
    datasets = _import_datasets(f"hf:{dataset}")
    stream = datasets.load_dataset(dataset, config_name, split=hf_split, streaming=True)
    yield from _split_rows(stream, hf_split, f"hf:{dataset}", text_field, max_docs, val_fraction, split_seed,
                           hf_split_named=True)


def _split_rows(stream, hf_split: str, source: str, text_field: str, max_docs: int, val_fraction: float,
                split_seed: int, hf_split_named: bool = False):
    """`(split, name, text)` for each row of ``stream``.

    A row goes to validation iff the hash of its TEXT falls below `val_fraction`, so exact duplicate
    rows always land in the same split (no train/val leakage through duplicates) and the choice does
    not depend on the order the server streams rows in. To guarantee both splits are non-empty
    without a second pass, the first train row and the first val row are held back until the end:
    each is released into its own split, unless the other split would otherwise be empty.
    """
    held = {"train": None, "val": None}
    emitted = {"train": 0, "val": 0}
    for index, row in enumerate(stream):
        if max_docs > 0 and index >= max_docs:
            break
        if text_field not in row:
            raise CorpusError(
                f"config.data.hf_text_field={text_field!r} is not a column of {source}; its "
                f"columns are {sorted(row)}. Set config.data.hf_text_field to the one holding the "
                "text."
            )
        text = row[text_field] or ""
        split = "val" if unit_hash(split_seed, text) < val_fraction else "train"
        doc = (split, f"{hf_split}[{index}]", text)
        if held[split] is None:
            held[split] = doc
            continue
        emitted[split] += 1
        yield doc
    total = sum(emitted.values()) + sum(d is not None for d in held.values())
    if total < 2:
        where = f"split {hf_split!r}, " if hf_split_named else ""
        raise CorpusError(
            f"config.data.source='{source}' gave {total} document(s) ({where}"
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
