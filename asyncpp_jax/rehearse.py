"""Rehearse the ``paper`` preset's data path on a CPU before spending GPU hours on it.

    python -m asyncpp_jax.rehearse --workdir=/tmp/rehearsal

The ``paper`` preset (``experiments/studies/common.py``) trains ``configs/dense135m.py`` on
FineWeb-Edu (``hf:HuggingFaceFW/fineweb-edu:sample-10BT``) through the prepare step with the
SmolLM2 tokenizer (a ``tokenizer.json``).  Offline, this command runs the same path end to end:

1. writes the Python standard library as parquet files laid out like FineWeb-Edu's (a ``text``
   column beside ``id``, ``url`` and ``score``; ``WORKDIR/fineweb_like/*.parquet``);
2. trains a byte-level BPE of SmolLM2's kind and size (vocabulary 49,152; ``WORKDIR/tokenizer.json``);
3. runs ``python -m asyncpp_jax.main --config=configs/dense135m.py`` with the preset's data settings,
   the source being those parquet files through ``datasets``' parquet loader
   (``hf:parquet:...``, the same streaming path as the Hub dataset's) and the tokenizer that file,
   at a CPU size: the dense135m shape (d 576, 9 heads, 3 KV heads, MLP 1536, tied, RoPE 1e5, bf16
   compute, remat) with ``--layers`` layers, ``--steps`` updates of ``--batch`` x ``--seq_len`` tokens.

The trainer prepares the corpus (parallel tokenization, cached), trains, evaluates and prints the
validation loss in nats per byte; the command it ran is printed first.  Swap the two data settings
for the Hub dataset and the real tokenizer and drop the size overrides to get the preset's run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from asyncpp_jax.configs import REPO_ROOT
from asyncpp_jax.data.sources import list_stdlib_files
from asyncpp_jax.data.tokenizers import train_bpe

CONFIG = "configs/dense135m.py"  # the paper preset's 135M model (experiments.studies.common.PAPER_MODELS)


def write_parquet(directory: str, max_files: int = 0, shards: int = 4) -> list[str]:
    """The stdlib's ``.py`` files as ``shards`` parquet files of FineWeb-Edu's columns; returns their paths."""
    import pyarrow as pa  # pylint: disable=import-outside-toplevel  # the [hf] extra
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

    listing = list_stdlib_files()
    names, paths = listing.names, listing.paths
    if max_files:
        names, paths = names[:max_files], paths[:max_files]
    os.makedirs(directory, exist_ok=True)
    out = []
    for k in range(shards):
        rows = range(k, len(paths), shards)
        texts = [open(paths[i], "rb").read().decode("utf-8", errors="replace") for i in rows]
        table = pa.table({"text": texts, "id": [names[i] for i in rows],
                          "url": [f"file://stdlib/{names[i]}" for i in rows], "score": [3.0] * len(texts)})
        path = os.path.join(directory, f"000_{k:05d}.parquet")
        pq.write_table(table, path)
        out.append(path)
    return out


def rehearsal_overrides(workdir: str, vocab: int, layers: int, steps: int, batch: int, seq_len: int) -> dict:
    """The ``paper`` preset's settings with its data moved offline and its size cut to a CPU's."""
    return {
        # the preset's data path, offline: the same loader path (datasets, streamed) and a tokenizer.json
        "data.source": f"hf:parquet:{os.path.join(workdir, 'fineweb_like')}/*.parquet",
        "data.tokenizer": os.path.join(workdir, "tokenizer.json"),
        "data.cache_dir": os.path.join(workdir, "corpora"),
        # CPU size
        "model.vocab_size": vocab, "model.n_layers": layers, "data.seq_len": seq_len,
        "train.global_batch_size": batch, "train.microbatches": 1, "train.steps": steps,
        "optimizer.warmup_steps": max(steps // 10, 1), "train.eval_every": steps, "train.eval_batches": 2,
        "train.checkpoint_every": steps, "hardware": "cpu",
    }


def command(workdir: str, overrides: dict) -> list[str]:
    return [sys.executable, "-m", "asyncpp_jax.main", f"--config={CONFIG}", f"--workdir={os.path.join(workdir, 'run')}",
            *[f"--config.{k}={v}" for k, v in overrides.items()]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncpp_jax.rehearse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--vocab", type=int, default=49152, help="the BPE's vocabulary (SmolLM2's: 49,152)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--max_files", type=int, default=0, help="stdlib files to use (0: all)")
    args = parser.parse_args(argv)
    workdir = os.path.abspath(args.workdir)
    data = os.path.join(workdir, "fineweb_like")
    if not os.path.isdir(data):
        print(f"rehearse: writing the stdlib as parquet into {data}", file=sys.stderr)
        write_parquet(data, args.max_files)
    tok = os.path.join(workdir, "tokenizer.json")
    if not os.path.isfile(tok):
        print(f"rehearse: training a byte-level BPE of vocabulary {args.vocab} into {tok}", file=sys.stderr)
        import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

        texts = (t for p in sorted(os.listdir(data)) for t in pq.read_table(os.path.join(data, p))["text"].to_pylist())
        train_bpe(texts, args.vocab, tok)
    cmd = command(workdir, rehearsal_overrides(workdir, args.vocab, args.layers, args.steps, args.batch, args.seq_len))
    print("rehearse: " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the trainer sets its own fake-device count
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
