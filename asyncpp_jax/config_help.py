"""What each config field means, for ``python -m asyncpp_jax.main --config=FILE --print_config``.

A field's meaning is the comment written beside it where its default is set in
``asyncpp_jax/configs.py`` (on its line, or the comment lines right above it), so the
documentation lives next to the default and cannot drift from it.  :data:`MEANINGS` gives the
meaning of the fields that have no comment of their own (those set several to a line, or under a
comment about their section) and a shorter line where the comment runs long.  Every field has
exactly one line (tests/test_config_help.py).  Plain Python: no JAX import.
"""

from __future__ import annotations

import ast
import functools
import io
import os
import pathlib
import sys
import tokenize

import ml_collections

from asyncpp_jax import configs

MAX_MEANING = 160  # characters: a meaning is one line of a terminal, not a paragraph

MEANINGS = {
    "train.test_batches": "eval batches of a test split, scored once at the end (windows no validation batch holds); 0 = none",
    "train.accept_changed": "what a resume may change on purpose (corpus, tokenizer, seq_len, model), comma separated",
    "name": "the run's name: outputs go to runs/<name> unless --workdir says otherwise",
    "hardware": "the accelerator the config is meant for (a key of configs.HARDWARE_GB): the dry run's memory budget",
    "seed": "seed of the parameter initialization and of the data order",
    "model.vocab_size": "rows of the embedding and the head; at least the tokenizer's vocabulary",
    "model.d_model": "the residual stream's width",
    "model.n_layers": "decoder blocks",
    "model.n_heads": "attention (query) heads",
    "model.n_kv_heads": "key/value heads (grouped-query attention: n_heads a multiple of it)",
    "model.head_dim": "per-head dimension; 0 = d_model // n_heads",
    "model.remat": "True: recompute each block's activations in the backward (see also train.auto_remat)",
    "model.moe.num_experts": "routed experts per MoE layer; 0 = a dense model",
    "model.moe.top_k": "experts each token is routed to",
    "model.d_ff": "the SwiGLU MLP's hidden size",
    "model.rope_theta": "RoPE base frequency",
    "model.tie_embeddings": "True: the head is the embedding table transposed",
    "model.norm_eps": "RMSNorm's epsilon",
    "model.init_std": "standard deviation of the normal initialization of the weights",
    "model.z_loss": "weight of the logits' z-loss (log of the softmax normalizer, squared); 0 = off",
    "model.compute_dtype": "float32 | bfloat16: the dtype of activations and matmuls",
    "model.param_dtype": "float32: the master weights' dtype (the only one supported)",
    "model.init_from": "'' = random init; 'hf:DIR' = start from a local Hugging Face Llama checkpoint",
    "data.seq_len": "tokens per training sequence",
    "data.val_fraction": "share of the documents held out for validation",
    "data.split_seed": "seed of the train/validation split of the documents",
    "data.hf_split": "hf: sources: the dataset split to read",
    "data.hf_text_field": "hf: and parquet/JSON sources: the column holding the text",
    "data.hf_max_docs": "hf: sources: read at most this many documents; 0 = all",
    "train.steps": "optimizer updates in the run",
    "train.microbatches": "gradient-accumulation steps per update; -1 = the smallest count that fits (docs/training.md)",
    "train.eval_every": "updates between validation losses",
    "train.eval_batches": "validation batches per evaluation",
    "train.log_every": "updates between metric rows (metrics.jsonl, loggers, the console's plain line)",
    "train.checkpoint_every": "updates between checkpoints",
    "train.keep_checkpoints": "checkpoints kept on disk (older ones are deleted)",
    "train.async_checkpoint": "True: checkpoints are written in the background while training goes on",
    "train.progress_bar": "True: a progress bar on a terminal (a plain line every log_every updates elsewhere)",
    "train.profile_start": "trace updates profile_start+1 .. profile_start+profile_steps into WORKDIR/profile",
    "train.profile_steps": "updates traced by the profiler; 0 = no profile",
    "optimizer.schedule": "learning-rate schedule after warmup: constant | cosine | linear | wsd",
    "optimizer.warmup_steps": "updates of linear warmup from 0 to the peak learning rate",
    "optimizer.adamw.b1": "AdamW's first-moment decay",
    "optimizer.adamw.b2": "AdamW's second-moment decay",
    "optimizer.adamw.eps": "AdamW's epsilon in the denominator",
    "optimizer.adamw.nesterov": "True: NAdamW (Nesterov momentum)",
    "optimizer.muon.mu": "Muon's momentum",
    "optimizer.muon.nesterov": "True: Nesterov momentum",
    "optimizer.muon.ns_steps": "Newton-Schulz iterations per update (5 is the reference)",
    "optimizer.muon.scaling": "moonlight (0.2*sqrt(max(fan_in, fan_out)), RMS-matched to AdamW) | keller",
    "optimizer.soap.b1": "SOAP's first-moment decay",
    "optimizer.soap.b2": "SOAP's second-moment decay",
    "optimizer.soap.shampoo_beta": "decay of Shampoo's preconditioner statistics; -1 = soap.b2",
    "optimizer.soap.eps": "SOAP's epsilon in the denominator",
    "optimizer.soap.precondition_frequency": "updates between refreshes of the eigenbasis",
    "optimizer.soap.max_precond_dim": "dimensions larger than this are not preconditioned",
    "optimizer.adan.b1": "Adan's first-moment decay (the paper's 1 - beta1)",
    "optimizer.adan.b2": "Adan's gradient-difference decay",
    "optimizer.adan.b3": "Adan's second-moment decay",
    "optimizer.adan.eps": "Adan's epsilon in the denominator",
    "optimizer.adan.weight_decay_mode": "proximal (the paper's) | decoupled weight decay",
    "optimizer.lion.b1": "Lion's interpolation factor for the update's sign",
    "optimizer.lion.b2": "Lion's momentum decay",
    "optimizer.mars.b1": "MARS's first-moment decay",
    "optimizer.mars.b2": "MARS's second-moment decay",
    "optimizer.mars.gamma": "MARS's variance-reduction weight of the gradient difference",
    "optimizer.mars.eps": "MARS's epsilon in the denominator",
    "optimizer.adamw_pattern": "regex of parameter paths that go to the AdamW side branch under muon, soap and mars",
    "optimizer.side.lr_ratio": "side branch's learning rate / the main learning rate",
    "optimizer.side.b1": "side branch's AdamW first-moment decay",
    "optimizer.side.b2": "side branch's AdamW second-moment decay",
    "optimizer.side.eps": "side branch's AdamW epsilon",
    "optimizer.side.weight_decay": "side branch's weight decay; -1 = optimizer.weight_decay",
    "staleness.pipedream_stages": "pipedream: the simulated pipeline depth P (stage s's delay is P-1-s)",
    "staleness.pipedream_gradient": "pipedream: mixed (PipeDream's exact mixed point) | per_leaf (delay each "
                                    "stage's slice of the gradient)",
    "staleness.ef_strength": "error feedback's weight of the correction u - u_prev (1 = the paper's)",
    "staleness.taylor_lam": "Taylor compensation's constant lambda (taylor_adaptive=False)",
    "staleness.taylor_lam0": "Taylor compensation's lambda0 (taylor_adaptive=True)",
    "staleness.taylor_ema_decay": "decay of the EMA of g^2 in the adaptive lambda",
    "staleness.nesterov": "True: Nesterov look-ahead against the delay (Ajanthan et al. 2025; adamw, muon)",
    "staleness.nesterov_b1": "the look-ahead's momentum (NAdamW's b1, or Muon's mu)",
    "staleness.nesterov_momentum_decay": "NAdamW's momentum decay",
    "staleness.weight_prediction": "True: take the gradient at w_t + d * delta_t (SpecTrain / PipeMare prediction)",
    "pipeline.schedule": "sync | 1f1b | interleaved | zb-h1 (flushed) | 2bw (no flush, one-step delay) | "
                         "pipedream (no flush, stage s delayed P - 1 - s steps); "
                         "docs/pipeline.md",
    "pipeline.virtual_stages": "interleaved: chunks of layers per device",
    "pipeline.recompute": "True: a stage's backward recomputes its forward from the stashed input",
    "pipeline.stage_layers": "layers per stage, e.g. (26, 6); () = an even split",
    "pipeline.vocab_parallel": "True: the embedding and head split along the vocabulary over the stages",
    "pipeline.placement": "spmd (one program for every stage) | mpmd (one program per stage)",
    "mesh.expert_parallel": "True: MoE experts sharded over the data axis, tokens moved with all_to_all",
}


@functools.lru_cache(maxsize=1)
def comments() -> dict[str, str]:
    """Each field's comment in ``configs.py``: the comment on its line when the field is the only one
    set there, else the comment lines right above it when it opens its line, joined into one line."""
    path = pathlib.Path(configs.__file__)
    source = path.read_text()
    trailing, alone = {}, {}  # line -> comment after code; line -> comment on a line of its own
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (alone if not tok.line[:tok.start[1]].strip() else trailing)[tok.start[0]] = text
    lines = _field_lines(source)
    per_line: dict[int, list[int]] = {}
    for line, col in lines.values():
        per_line.setdefault(line, []).append(col)
    out = {}
    for field, (line, col) in lines.items():
        if len(per_line[line]) == 1 and line in trailing:
            out[field] = trailing[line]
            continue
        if col != min(per_line[line]):
            continue
        block, above = [], line - 1
        while above in alone:
            block.insert(0, alone[above])
            above -= 1
        if block:
            out[field] = " ".join(block)
    return out


def source_order() -> list[str]:
    """Every field's dotted name in the order ``configs.py`` sets them."""
    return list(_field_lines(pathlib.Path(configs.__file__).read_text()))


@functools.lru_cache(maxsize=1)
def _field_lines(source: str) -> dict[str, tuple[int, int]]:
    """Each field's ``(line, column)`` where ``base_config()`` and the section defaults set it, in order."""
    tree = ast.parse(source)
    lines: dict[str, tuple[int, int]] = {}
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}

    def walk_dict(call: ast.Call, prefix: str) -> None:
        for kw in call.keywords:
            if isinstance(kw.value, ast.Call) and getattr(kw.value.func, "id", "") == "dict":
                walk_dict(kw.value, f"{prefix}{kw.arg}.")
            else:
                lines[prefix + kw.arg] = (kw.lineno, kw.col_offset)

    for stmt in functions["base_config"].body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Attribute):
            name, value = stmt.targets[0].attr, stmt.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") in functions:
                inner = next(n for n in ast.walk(functions[value.func.id])
                             if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "dict")
                walk_dict(inner, f"{name}.")
            else:
                lines[name] = (stmt.lineno, stmt.col_offset)
    return lines


def meaning(field: str) -> str:
    """The one-line meaning of the dotted ``field`` ('' if it has none)."""
    return MEANINGS.get(field) or comments().get(field, "")


def leaves(c: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, object]]:
    """``(dotted name, value)`` of every field of ``c``, in the config's own order."""
    out = []
    for key, value in c.items():
        if isinstance(value, ml_collections.ConfigDict):
            out += leaves(value, f"{prefix}{key}.")
        else:
            out.append((prefix + key, value))
    return out


def describe(c: ml_collections.ConfigDict, source: str) -> str:
    """Every field of ``c`` as ``name = value  # meaning``, in the order ``configs.py`` sets them, under a
    header naming where the config came from and how to change a field."""
    order = {name: i for i, name in enumerate(source_order())}
    fields = sorted(leaves(c), key=lambda kv: order.get(kv[0], len(order)))
    rows = [(f"{name} = {value!r}", meaning(name)) for name, value in fields]
    width = min(max(len(left) for left, _ in rows), 48)
    body = [f"{left:<{width}}  # {text}" if text else left for left, text in rows]
    head = (f"# config {c.get('name', '')!r} from {source}; change a field with --config.FIELD=VALUE "
            "(e.g. --config.train.steps=100). Automatic fields (-1) are decided when the run starts.")
    return "\n".join([head, *body])


def print_config(c: ml_collections.ConfigDict, source: str) -> None:
    """Print :func:`describe`; a reader that stops early (``| head``) is no error."""
    try:
        print(describe(c, source), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
