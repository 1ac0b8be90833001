"""Prepare throughput: tokens/s of the prepare step with a byte-level BPE of SmolLM2's size.

Trains (once, cached) a byte-level BPE of vocabulary 49,152 on the Python standard library, the
kind of tokenizer SmolLM2 uses (``asyncpp_jax.data.tokenizers.train_bpe``), or takes a real
``tokenizer.json`` (``--tokenizer``), then prepares the stdlib corpus from scratch with 1 worker
process (the tokenizer's own Rust threads over each batch) and with ``--workers`` processes (one
thread each), side by side, and prints tokens/s of wall time and of CPU time (this process and its
workers: on a shared machine the wall-clock rate is mostly the other jobs' doing), their ratio,
and the time the ``paper`` preset's 10.5B tokens would take on a ``--cores`` host, EXTRAPOLATED
from the tokens per CPU-second measured here on the assumption that it scales linearly with
dedicated cores (each process works on its own documents; the parent, which reads the documents
and writes the shards, is the first thing that would stop that, and its share is printed).

    python -m experiments.bench_prepare [--workers 2] [--cores 32] [--tokenizer PATH] [--record FILE]

``--record FILE`` appends the figures as a record (``experiments/records.py``), from which
``python -m experiments.render_docs`` renders the table in docs/interop.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from asyncpp_jax.data import load_corpus, prepare_corpus
from asyncpp_jax.data import prepare as prepare_lib
from asyncpp_jax.data.sources import list_stdlib_files
from asyncpp_jax.data.tokenizers import get_tokenizer, train_bpe
from experiments import records

PAPER_TOKENS = 20000 * 256 * 2048  # the paper preset: 20k updates of 256 x 2048 tokens (10.5B)


def stdlib_tokenizer(vocab_size: int, cache: str) -> str:
    path = os.path.join(cache, f"stdlib-bpe-{vocab_size}.json")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        files = list_stdlib_files()
        texts = (open(p, encoding="utf-8", errors="replace").read() for p in files.paths)
        t0 = time.perf_counter()
        train_bpe(texts, vocab_size, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"trained a byte-level BPE of vocabulary {vocab_size} on the stdlib in {time.perf_counter() - t0:.0f} s")
    return path


def cpu_seconds() -> tuple[float, float]:
    """(this process's CPU seconds, its reaped children's), user + system."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def prepare_seconds(tokenizer: str, workers: int) -> tuple[float, int, int, float, float, float]:
    """(wall seconds, tokens, bytes, seconds the parent spent writing, the parent's CPU seconds, the
    workers' CPU seconds) of one prepare from scratch."""
    written = [0.0]
    real_add = prepare_lib.SplitWriter.add

    def timed_add(self, *args):
        t0 = time.perf_counter()
        real_add(self, *args)
        written[0] += time.perf_counter() - t0

    prepare_lib.SplitWriter.add = timed_add
    try:
        with tempfile.TemporaryDirectory() as cache:
            me0, kids0 = cpu_seconds()
            t0 = time.perf_counter()
            path = prepare_corpus("stdlib", tokenizer=tokenizer, cache_dir=cache, log=lambda m: None,
                                  workers=workers, progress_bar=False)
            seconds = time.perf_counter() - t0
            me1, kids1 = cpu_seconds()
            c = load_corpus(path, verify=False)
            tokens = c.num_tokens("train") + c.num_tokens("val")
            nbytes = c.num_bytes("train") + c.num_bytes("val")
    finally:
        prepare_lib.SplitWriter.add = real_add
    return seconds, tokens, nbytes, written[0], me1 - me0, kids1 - kids0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=prepare_lib.default_workers("bpe"))
    parser.add_argument("--cores", type=int, default=32, help="the host the extrapolation is for")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json instead of the trained stdlib BPE")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "asyncpp_bench_prepare"))
    parser.add_argument("--record", default=None, metavar="FILE",
                        help="append the figures as a record, e.g. experiments/results/bench/bench_prepare.jsonl")
    args = parser.parse_args()
    tokenizer = args.tokenizer or stdlib_tokenizer(args.vocab, args.cache)
    tok = get_tokenizer(tokenizer)
    print(f"tokenizer {tokenizer}: vocabulary {tok.vocab_size}; host: {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    rows, figures = {}, {"vocab": tok.vocab_size}
    for workers in (1, args.workers):
        if workers in rows:
            continue
        seconds, tokens, nbytes, writing, parent_cpu, workers_cpu = prepare_seconds(tokenizer, workers)
        cpu = parent_cpu + workers_cpu
        rows[workers] = (tokens / seconds, tokens / cpu)
        figures.setdefault("rows", []).append(
            {"workers": workers, "wall_s": round(seconds, 1), "cpu_s": round(cpu, 1), "parent_cpu_s": round(parent_cpu, 1),
             "tokens": tokens, "bytes_per_token": round(nbytes / tokens, 2), "tokens_per_s": round(tokens / seconds),
             "tokens_per_cpu_s": round(tokens / cpu)})
        print(f"workers={workers}: {tokens:,} tokens ({nbytes / tokens:.2f} bytes/token) in {seconds:.1f} s wall, "
              f"{cpu:.1f} CPU-s (parent {parent_cpu:.1f}, workers {workers_cpu:.1f}): {tokens / seconds:,.0f} tokens/s "
              f"wall, {tokens / cpu:,.0f} tokens per CPU-second; the parent's shard writing {writing:.1f} s")
    if args.workers != 1:
        print(f"ratio workers={args.workers} / workers=1: {rows[args.workers][0] / rows[1][0]:.2f} in wall tokens/s, "
              f"{rows[args.workers][1] / rows[1][1]:.2f} in tokens per CPU-second")
    per_core = rows[args.workers][1]
    rate = per_core * args.cores
    hours = PAPER_TOKENS / rate / 3600
    print(f"EXTRAPOLATED (tokens per CPU-second with {args.workers} worker processes, {per_core:,.0f}, x {args.cores} "
          f"dedicated cores, assumed linear): {rate:,.0f} tokens/s, so the paper preset's {PAPER_TOKENS / 1e9:.1f}B "
          f"tokens in {hours:.1f} h on a {args.cores}-core host")
    if args.record:
        figures["extrapolated"] = {"cores": args.cores, "tokens_per_s": round(rate), "paper_tokens": PAPER_TOKENS,
                                   "hours": round(hours, 2)}
        records.append(args.record, records.make("bench_prepare", figures))


if __name__ == "__main__":
    main()
