"""Scoring text with a run's model: lm-evaluation-harness's three request types on the model's own
forward, with no ``lm_eval`` import (:mod:`asyncpp_jax.evaluate` and :mod:`asyncpp_jax.lm_eval_adapter`
serve it to the harness; that module's docstring states what each request computes)."""

from __future__ import annotations

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
