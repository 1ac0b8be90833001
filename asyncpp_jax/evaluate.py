"""Evaluate a run's checkpoint with lm-evaluation-harness.

    python -m asyncpp_jax.evaluate --workdir=runs/dense135m --tasks=hellaswag,arc_easy [--limit=100]
        [--num_fewshot=0] [--include_path=DIR] [--batch_size=8] [--max_length=N] [--step=N] [--output=FILE]

needs ``lm-eval`` (``pip install 'lm-eval>=0.4,<0.5'``, or the package's ``[eval]`` extra).  The
run's newest verified checkpoint (:mod:`asyncpp_jax.trained`) answers the harness's three request
types through :class:`Scorer`, which needs no ``lm_eval`` itself:

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

import jax
import jax.numpy as jnp
import numpy as np

from asyncpp_jax.models import decode, dense


def rolling_windows(tokens: list[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """``(context, continuation)`` pairs that predict each of ``tokens`` once: the first window
    after ``prefix``, then disjoint chunks of up to ``max_length`` tokens, each after the
    ``max_length + 1 - len(chunk)`` tokens before it (so every input is ``max_length`` long)."""
    if not tokens:
        return []
    first = tokens[:max_length]
    out = [([prefix], first)]
    done = len(first)
    while done < len(tokens):
        end = min(len(tokens), done + max_length)
        out.append((tokens[end - max_length - 1:done], tokens[done:end]))
        done = end
    return out


class Scorer:
    """The model's log-likelihoods and greedy continuations for lm-eval's request types."""

    def __init__(self, model_cfg, params: dict, tokenizer, max_length: int, batch_size: int = 8):
        self.cfg = decode.inference_config(model_cfg)
        self.params, self.tokenizer = params, tokenizer
        self.max_length, self.batch_size = int(max_length), int(batch_size)
        cfg = self.cfg

        def token_logprobs(p, inputs, targets):
            logp = jax.nn.log_softmax(dense.forward(cfg, p, inputs), axis=-1)
            picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            return picked, jnp.argmax(logp, axis=-1) == targets

        self._token_logprobs = jax.jit(token_logprobs)
        self._generator: decode.Generator | None = None

    @property
    def generator(self) -> decode.Generator:
        """The cached decoder on the same parameters (built on first use)."""
        if self._generator is None:
            self._generator = decode.Generator(self.cfg, self.params)
        return self._generator

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_id)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of ``(context, continuation)`` as lm-eval's causal models split them."""
        if not context:
            return [self.eos_id], self.encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return ctx, whole[len(ctx):]

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum of the continuation's token log-probs, whether every token was the argmax)`` per
        ``(context ids, continuation ids)`` pair; the context is cut to ``max_length`` inputs."""
        rows = []
        for ctx, cont in pairs:
            if not cont:
                rows.append(None)
                continue
            full = (list(ctx) + list(cont))[-(self.max_length + 1):]
            rows.append((full[:-1], full[1:], min(len(cont), len(full) - 1)))
        out: list[tuple[float, bool] | None] = [(0.0, True) if r is None else None for r in rows]
        order = sorted((i for i, r in enumerate(rows) if r is not None), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size):
            group = order[start:start + self.batch_size]
            length = min(decode.bucket_length(len(rows[group[0]][0])), self.max_length)
            inputs = np.zeros((self.batch_size, length), np.int32)
            targets = np.zeros((self.batch_size, length), np.int32)
            for j, i in enumerate(group):
                x, y, _ = rows[i]
                inputs[j, :len(x)], targets[j, :len(y)] = x, y
            logp, greedy = jax.device_get(self._token_logprobs(self.params, inputs, targets))
            for j, i in enumerate(group):
                x, _, n = rows[i]
                span = slice(len(x) - n, len(x))
                out[i] = (float(np.sum(logp[j, span], dtype=np.float64)), bool(np.all(greedy[j, span])))
        return out

    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(c, x) for c, x in requests])

    def loglikelihood_rolling(self, texts: list[str]) -> list[float]:
        windows = [rolling_windows(self.encode(t), self.eos_id, self.max_length) for t in texts]
        flat = self.score([w for ws in windows for w in ws])
        out, k = [], 0
        for ws in windows:
            out.append(float(sum(ll for ll, _ in flat[k:k + len(ws)])))
            k += len(ws)
        return out

    def generate_until(self, requests: list[tuple[str, dict]]) -> list[str]:
        out = []
        for context, kwargs in requests:
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", 256)))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            sampling = decode.Sampling(max_new, temperature, float(kwargs.get("top_p", 1.0)), int(kwargs.get("seed", 0)))
            ids = (self.encode(context) or [self.eos_id])[-max(1, self.max_length - max_new):]
            text = self.tokenizer.decode(self.generator.generate([ids], sampling, stop_ids=(self.eos_id,))[0])
            cuts = [text.index(s) for s in until if s and s in text]
            out.append(text[:min(cuts)] if cuts else text)
        return out


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
    from asyncpp_jax import trained  # pylint: disable=import-outside-toplevel
    from asyncpp_jax.export import ExportError  # pylint: disable=import-outside-toplevel

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
