"""Generate text from a run's checkpoint.

    python -m asyncpp_jax.generate --workdir=runs/tiny --prompt='def main(' [--max_new_tokens=64]
        [--temperature=0] [--top_p=1.0] [--num_samples=1] [--seed=0] [--step=N]

Reads the newest verified checkpoint (:mod:`asyncpp_jax.trained`), encodes the prompt with the
run's tokenizer (no BOS: the runs never used one; documents were separated by the end-of-document
token), and decodes with a key/value cache (:mod:`asyncpp_jax.models.decode`): greedy at
``--temperature=0`` (the default), else sampling at that temperature within the ``--top_p``
nucleus.  Generation stops at the end-of-document token or after ``--max_new_tokens``.  Each
sample is printed as the prompt followed by its continuation.
"""

from __future__ import annotations

import argparse
import sys

from asyncpp_jax import trained
from asyncpp_jax.export import ExportError
from asyncpp_jax.models.decode import Generator, Sampling


def generate_text(model: trained.TrainedModel, prompt: str, sampling: Sampling, num_samples: int = 1) -> list[str]:
    """``num_samples`` continuations of ``prompt`` (text after the prompt, end-of-document token dropped)."""
    ids = [int(i) for i in model.tokenizer.encode(prompt)]
    if not ids:  # an empty prompt starts a new document, as after the separator in training
        ids = [model.tokenizer.eos_id]
    out = Generator(model.model_cfg, model.params).generate([ids] * num_samples, sampling,
                                                           stop_ids=(model.tokenizer.eos_id,))
    return [model.tokenizer.decode(row) for row in out]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncpp_jax.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="the run's directory (config.json, checkpoints/)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass, in (0, 1]; 1: the whole vocabulary")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None, help="default: the newest verified checkpoint")
    args = parser.parse_args(argv)
    for name, ok, want in (("max_new_tokens", args.max_new_tokens >= 1, ">= 1"),
                           ("temperature", args.temperature >= 0, ">= 0"),
                           ("top_p", 0 < args.top_p <= 1, "in (0, 1]"),
                           ("num_samples", args.num_samples >= 1, ">= 1")):
        if not ok:
            print(f"error: --{name}={getattr(args, name)} must be {want}", file=sys.stderr)
            return 2
    try:
        model = trained.load(args.workdir, args.step)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    for i, text in enumerate(generate_text(model, args.prompt, sampling, args.num_samples)):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} (step {model.step})")
        print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
