"""The lm-evaluation-harness adapter (asyncpp_jax.evaluate.Scorer, asyncpp_jax.lm_eval_adapter).

The reference is the model's own forward (``dense.forward``) on each example alone, unpadded, with
the log-softmax taken in float64: the scorer's batched, padded log-likelihoods must equal it.  The
lm-eval tests run a tiny local task (task YAML files over local JSON lines) through
``lm_eval.simple_evaluate`` and compare every logged per-example response with that reference;
they are skipped where ``lm_eval`` is not importable (it is an optional extra).
"""

import importlib.util
import json

import jax
import numpy as np
import pytest

from asyncpp_jax import configs
from asyncpp_jax.data.tokenizers import ByteTokenizer
from asyncpp_jax.evaluate import Scorer, rolling_windows
from asyncpp_jax.models import decode, dense

MAX_LENGTH = 32


def model_cfg():
    m = configs.base_config().model
    m.update(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, tie_embeddings=False)
    return m


@pytest.fixture(scope="module")
def scorer():
    m = model_cfg()
    from test_generate import random_params

    params = random_params(m, std=0.2)  # sharper than at init
    return Scorer(m, params, ByteTokenizer(), max_length=MAX_LENGTH, batch_size=4)


_FORWARD = {}


def reference(s: Scorer, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """``(sum log p(cont | ctx), all argmax)`` from one forward of the last ``max_length + 1``
    tokens alone (zero-padded on the right to one fixed length, which the causal mask keeps out),
    log-softmax in float64."""
    full = (ctx + cont)[-(s.max_length + 1):]
    if id(s) not in _FORWARD:
        _FORWARD[id(s)] = jax.jit(lambda p, x: dense.forward(s.cfg, p, x))
    x = np.zeros((1, s.max_length + 8), np.int32)
    x[0, :len(full) - 1] = full[:-1]
    logits = np.asarray(_FORWARD[id(s)](s.params, x))[0, :len(full) - 1].astype(np.float64)
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    tgt = np.asarray(full[1:])
    n = min(len(cont), len(tgt))
    rows = np.arange(len(tgt))[-n:]
    return float(logp[rows, tgt[rows]].sum()), bool(np.all(logits[rows].argmax(-1) == tgt[rows]))


REQUESTS = [("The capital of France is", " Paris"), ("2 + 2 =", " 4"), ("", "an empty context"),
            ("a trailing space ", "moves"), ("x" * 50 + " long context past max_length", " cut"),
            ("def f(x):\n    return", " x * 2\n")]


def test_loglikelihood_equals_the_models_forward(scorer):
    got = scorer.loglikelihood(REQUESTS)
    tok = ByteTokenizer()
    for (ctx, cont), (ll, greedy) in zip(REQUESTS, got):
        if not ctx:
            ids = [tok.eos_id], list(tok.encode(cont))  # an empty context is the end-of-document token
        else:
            n = len(ctx) - len(ctx.rstrip())  # trailing spaces go to the continuation, as lm-eval's HF model
            ids = list(tok.encode(ctx[:len(ctx) - n])), list(tok.encode(ctx[len(ctx) - n:] + cont))
        want_ll, want_greedy = reference(scorer, [int(i) for i in ids[0]], [int(i) for i in ids[1]])
        assert ll == pytest.approx(want_ll, rel=1e-5, abs=1e-4), (ctx, cont)
        assert greedy == want_greedy
    assert len({round(ll, 3) for ll, _ in got}) == len(REQUESTS)  # distinct examples, distinct answers


def test_greedy_flag_is_true_for_the_models_own_continuation(scorer):
    ctx = "import os\n"
    ids = [int(t) for t in scorer.tokenizer.encode(ctx)]
    new = scorer.generator.generate([ids], decode.Sampling(max_new_tokens=6))[0]
    ll, greedy = scorer.score([(ids, new)])[0]
    assert greedy and ll == pytest.approx(reference(scorer, ids, new)[0], rel=1e-5, abs=1e-4)
    flipped = new[:-1] + [(new[-1] + 1) % 256]
    assert not scorer.score([(ids, flipped)])[0][1]


def test_rolling_windows_predict_each_token_once_with_full_context():
    tokens = list(range(100, 175))  # 75 tokens, windows of 32
    windows = rolling_windows(tokens, prefix=7, max_length=32)
    assert [len(c) for _, c in windows] == [32, 32, 11]
    assert sum((c for _, c in windows), []) == tokens
    assert windows[0][0] == [7]
    for ctx, cont in windows[1:]:
        full = ctx + cont
        assert len(full) == 33 and full == tokens[tokens.index(full[0]):tokens.index(full[0]) + 33]


def test_rolling_loglikelihood_is_the_sum_over_its_windows(scorer):
    text = "".join(chr(97 + (i * 7) % 26) for i in range(70))
    ids = [int(t) for t in scorer.tokenizer.encode(text)]
    want = sum(reference(scorer, c, x)[0] for c, x in rolling_windows(ids, scorer.eos_id, MAX_LENGTH))
    short = "short text"
    short_ids = [int(t) for t in scorer.tokenizer.encode(short)]
    got = scorer.loglikelihood_rolling([text, short])
    assert got[0] == pytest.approx(want, rel=1e-5)
    assert got[1] == pytest.approx(reference(scorer, [scorer.eos_id], short_ids)[0], rel=1e-5)


def test_generate_until_cuts_at_the_stop_string(scorer):
    ctx = "import os\n"
    ids = [int(t) for t in scorer.tokenizer.encode(ctx)]
    full = scorer.tokenizer.decode(scorer.generator.generate([ids], decode.Sampling(max_new_tokens=6))[0])
    stop = full[2:4]
    got = scorer.generate_until([(ctx, {"until": [stop], "max_gen_toks": 6}), (ctx, {"max_gen_toks": 6})])
    assert got == [full[:full.index(stop)], full]


# ------------------------------------------------------------------------------ through lm-eval

TASKS = {
    "tiny_choice": dict(output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice="{{choices}}",
                        doc_to_target="{{label}}", metric_list=[{"metric": "acc"}]),
    "tiny_rolling": dict(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                         metric_list=[{"metric": "word_perplexity"}]),
    "tiny_generate": dict(output_type="generate_until", doc_to_text="{{question}}", doc_to_target="{{answer}}",
                          generation_kwargs={"until": ["\n"], "max_gen_toks": 5, "do_sample": False},
                          metric_list=[{"metric": "exact_match"}]),
}
DOCS = [{"question": "Q: 1 + 1 =", "choices": [" 2", " 3", " eleven"], "label": 0, "text": "one two three " * 4,
         "answer": " 2"},
        {"question": "Q: the sky is", "choices": [" blue", " green"], "label": 0, "text": "the sky is blue today",
         "answer": " blue"},
        {"question": "Q: import", "choices": [" os", " sys", " json"], "label": 2, "text": "import os\n" * 9,
         "answer": " os"}]


def write_tasks(root):
    """Task YAML files (JSON is YAML) over a local JSON lines file: no network, no Hub."""
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, spec in TASKS.items():
        (root / f"{name}.yaml").write_text(json.dumps({
            "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", **spec}))
    return root


def test_lm_eval_responses_equal_the_models_forward(scorer, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval>=0.4,<0.5'); "
                        "the adapter's arithmetic is tested above without it")
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from asyncpp_jax import lm_eval_adapter

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = lm_eval_adapter.evaluate(scorer, list(TASKS), include_path=str(write_tasks(tmp_path)), log_samples=True)
    samples = results["samples"]
    choice = samples["tiny_choice"]
    assert sum(len(s["arguments"]) for s in choice) == sum(len(d["choices"]) for d in DOCS)
    for s in choice:
        for args, resp in zip(s["arguments"], s["resps"]):
            ctx, cont = args
            want = reference(scorer, *scorer.encode_pair(ctx, cont))
            assert resp[0][0] == pytest.approx(want[0], rel=1e-5, abs=1e-4) and resp[0][1] == want[1]
    for s in samples["tiny_rolling"]:
        (text,) = s["arguments"][0]
        ids = scorer.encode(text)
        ours = rolling_windows(ids, scorer.eos_id, MAX_LENGTH)
        theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, scorer.eos_id, MAX_LENGTH, 1)]
        assert [(list(a), list(b)) for a, b in theirs] == ours
        assert s["resps"][0][0] == pytest.approx(sum(reference(scorer, c, x)[0] for c, x in ours), rel=1e-5)
    for s, d in zip(samples["tiny_generate"], DOCS):
        assert s["resps"][0][0] == scorer.generate_until([(d["question"], {"until": ["\n"], "max_gen_toks": 5})])[0]
    assert set(results["results"]) == set(TASKS)


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is not None, reason="lm-eval is installed here")
def test_evaluate_command_without_lm_eval_says_how_to_install_it(tmp_path, capsys):
    from asyncpp_jax import evaluate

    assert evaluate.main([f"--workdir={tmp_path}", "--tasks=arc_easy"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'lm-eval>=0.4,<0.5'" in err, err
