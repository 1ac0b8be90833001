"""Evaluate a run's checkpoint with lm-evaluation-harness.

    python -m asyncpp_jax.evaluate --workdir=runs/dense135m --tasks=hellaswag,arc_easy [--limit=100]
        [--num_fewshot=0] [--include_path=DIR] [--batch_size=8] [--max_length=N] [--step=N] [--output=FILE]

needs ``lm-eval`` (``pip install 'lm-eval>=0.4,<0.5'``, or the package's ``[eval]`` extra).  The
run's newest verified checkpoint (:mod:`asyncpp_jax.trained`) answers the harness's three request
types through :class:`~asyncpp_jax.models.scoring.Scorer`, which needs no ``lm_eval`` itself:

* ``loglikelihood(context, continuation)``: ``sum_i log p(c_i | context, c_<i)`` over the
  continuation's tokens and whether each was the argmax (lm-eval's ``(logprob, is_greedy)``).
  Tokenized as lm-eval's Hugging Face model does: trailing spaces of the context move to the
  continuation, the pair is encoded whole and split at the context's length, and an empty
  context is the end-of-document token (the runs put it before every document; they used no BOS).
* ``loglikelihood_rolling(text)``: the text's total log-likelihood after the end-of-document token,
  in disjoint windows of ``max_length`` predicted tokens, each with a full window of context
  (lm-eval's ``get_rolling_token_windows`` with ``context_len = 1``).
* ``generate_until(context, gen_kwargs)``: greedy (or sampled at ``temperature``) continuation with
  the key/value cache of :mod:`asyncpp_jax.models.decode`, cut at the first ``until`` string.

``max_length`` defaults to the run's ``data.seq_len`` (the context the model was trained on); longer
inputs keep their last ``max_length`` tokens.  Scoring runs the model's own forward
(:func:`asyncpp_jax.models.dense.forward`) on one device, in batches of ``batch_size`` padded to a
power-of-two length, so each shape compiles once.  The results (lm-eval's JSON, without per-sample
logs) go to ``--output`` (default ``WORKDIR/lm_eval/step_<step>.json``) and the table to stdout.

The export route needs no adapter: ``python -m asyncpp_jax.export`` then ``lm_eval --model hf
--model_args pretrained=DIR`` (docs/interop.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from asyncpp_jax import trained
from asyncpp_jax.export import ExportError
from asyncpp_jax.models.scoring import Scorer, rolling_windows  # noqa: F401 - the API this module serves


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncpp_jax.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="the run's directory (config.json, checkpoints/)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include_path", default=None, help="a directory of extra task YAML files")
    parser.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1)")
    parser.add_argument("--num_fewshot", type=int, default=None)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=None, help="default: the run's data.seq_len")
    parser.add_argument("--step", type=int, default=None, help="default: the newest verified checkpoint")
    parser.add_argument("--output", default=None, help="default: WORKDIR/lm_eval/step_<step>.json")
    args = parser.parse_args(argv)
    for name in ("batch_size", "max_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"error: --{name}={value} must be >= 1", file=sys.stderr)
            return 2
    try:
        from asyncpp_jax import lm_eval_adapter  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        print(f"error: python -m asyncpp_jax.evaluate needs lm-eval ({e}); install it with "
              "pip install 'lm-eval>=0.4,<0.5' (or this package's [eval] extra).", file=sys.stderr)
        return 1

    try:
        model = trained.load(args.workdir, args.step)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    scorer = Scorer(model.model_cfg, model.params, model.tokenizer,
                    args.max_length or int(model.config.data.seq_len), args.batch_size)
    try:
        results = lm_eval_adapter.evaluate(scorer, args.tasks.split(","), include_path=args.include_path,
                                           limit=args.limit, num_fewshot=args.num_fewshot)
    except lm_eval_adapter.UnknownTasks as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.output) if args.output else pathlib.Path(args.workdir) / "lm_eval" / f"step_{model.step}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results["asyncpp_jax"] = {"workdir": str(pathlib.Path(args.workdir).resolve()), "step": model.step,
                              "max_length": scorer.max_length}
    out.write_text(json.dumps(results, indent=2, default=str))
    print(lm_eval_adapter.table(results))
    print(f"results of step {model.step}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
