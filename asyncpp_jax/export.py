"""Export a run's latest verified checkpoint as a Hugging Face model directory.

    python -m asyncpp_jax.export --workdir=runs/dense135m --out=exported/dense135m [--step=N] [--dtype=bfloat16]

writes ``config.json`` (``LlamaForCausalLM``; an MoE run's ``MixtralForCausalLM`` or
``Qwen2MoeForCausalLM``, :mod:`asyncpp_jax.models.hf_moe`), the weights as safetensors
(``model.safetensors``, or shards with an index past :data:`asyncpp_jax.models.hf_llama.SHARD_BYTES`)
and the tokenizer: the run's ``tokenizer.json``, or the byte tokenizer written as one, with a
``tokenizer_config.json`` and ``special_tokens_map.json`` beside it, so that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
load it (docs/interop.md).  ``--config.model.init_from=hf:DIR`` reads a dense export back bit for
bit (``--dtype=float32``, the default).

The checkpoint is the newest step whose files match their sealed manifest (the check a resume
makes, :func:`asyncpp_jax.train.checkpoint.verify`); only its parameters are read (orbax partial
restore, as NumPy on the host: no accelerator, no optimizer state).  The config that checkpoint
was trained under (its manifest's; the workdir's ``config.json`` for older checkpoints) gives the
tokenizer, ``seq_len`` and which runner wrote it: the pipeline engine's layout (padded layer
stack, a tied table held as ``[D, V]``) is turned back into the model's with
:func:`asyncpp_jax.pipeline.spmd.engine.to_model_layout`.  ``--out`` must be a new or empty directory,
or ``--replace`` removes the files an export owns there first.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from asyncpp_jax import configs
from asyncpp_jax.data.tokenizers import get_tokenizer
from asyncpp_jax.models import hf_llama, hf_moe
from asyncpp_jax.models.hf_llama import HFCheckpointError
from asyncpp_jax.pipeline.spmd import engine
from asyncpp_jax.train import checkpoint

EXPORT_INFO = "asyncpp_export.json"


class ExportError(ValueError):
    """The run cannot be exported; the message says why."""


class OutError(ExportError):
    """``--out`` cannot take an export (a file, or a non-empty directory without ``--replace``): exit 2."""


def run_config(workdir: pathlib.Path, step_dir: pathlib.Path | None = None) -> ml_collections.ConfigDict:
    """The config the checkpoint in ``step_dir`` was trained under (its manifest records it), else the
    workdir's ``config.json`` (checkpoints from before manifests recorded it)."""
    run = (checkpoint.read_manifest(step_dir) or {}).get("run") if step_dir is not None else None
    if isinstance(run, dict) and isinstance(run.get("config"), dict):
        c = ml_collections.ConfigDict(run["config"])
    else:
        path = workdir / "config.json"
        if not path.is_file():
            raise ExportError(f"{workdir} has no config.json: not a run directory (python -m asyncpp_jax.main "
                              "--workdir=... writes one when a run starts).")
        try:
            c = ml_collections.ConfigDict(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise ExportError(f"{path} cannot be read as a run's config ({e}).") from e
    return c


def latest_verified_step(workdir: pathlib.Path, step: int | None = None) -> tuple[int, pathlib.Path]:
    """``(step, its directory)``: the newest checkpoint that passes its checksums (or ``step``, if it does)."""
    found = checkpoint.step_dirs(workdir / "checkpoints")
    if not found:
        raise ExportError(f"{workdir / 'checkpoints'} holds no checkpoint.")
    if step is not None and step not in found:
        raise ExportError(f"{workdir / 'checkpoints'} has no step {step}; it has {sorted(found)}.")
    problems = []
    for s in [step] if step is not None else sorted(found, reverse=True):
        why = checkpoint.verify(found[s])
        if why is None:
            return s, found[s]
        problems.append(f"step {s}: {why}")
    raise ExportError(f"no intact checkpoint to export in {workdir / 'checkpoints'}:\n  " + "\n  ".join(problems))


def read_params(step_dir: pathlib.Path) -> dict:
    """The ``params`` of a saved train state, as NumPy arrays in the layout they were saved in."""
    path = step_dir / "state"
    # The item's handler, not a Checkpointer: the step's own metadata file sits one level up
    # (the trainer's CheckpointManager wrote it), and a Checkpointer warns that it is missing here.
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(path)
        item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree["params"])}
        restore_args = {"params": jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree["params"])}
        out = handler.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                                partial_restore=True))
    finally:
        handler.close()
    return out["params"]


def model_layout(c, params: dict) -> dict:
    """Saved params (either runner's layout) -> the model's own (``dense.init_params``')."""
    if not configs.uses_pipeline(c):
        return params
    stage_rows = engine.stage_split(c.model, c.pipeline.stages, c.pipeline.get("stage_layers", ()))
    return engine.to_model_layout(c.model, params, stage_rows, configs.interleave_of(c))


def _write_tokenizer(c, out: pathlib.Path, step_dir: pathlib.Path) -> tuple[int | None, str | None]:
    """Write the tokenizer ``step_dir`` was trained on as ``tokenizer.json`` (a copy of the run's file,
    or the byte tokenizer written as one) with ``tokenizer_config.json`` and
    ``special_tokens_map.json``; returns ``(eos id, the source tokenizer.json or 'byte')``."""
    eos_token = c.data.get("eos_token") or None
    try:
        tok = get_tokenizer(c.data.tokenizer, eos_token)
    except ValueError as e:
        raise ExportError(f"the run's tokenizer {c.data.tokenizer!r} cannot be loaded ({e}); the export needs it "
                          "for the tokenizer files and the eos id.") from e
    check_tokenizer(c, step_dir, tok)
    if tok.vocab_size > c.model.vocab_size:
        raise ExportError(f"the tokenizer at {c.data.tokenizer!r} now has {tok.vocab_size} tokens, more than the "
                          f"model's config.model.vocab_size={c.model.vocab_size}: not the tokenizer the run used.")
    path = getattr(tok, "path", None)
    if path is None:
        tok.write_tokenizer_json(str(out / "tokenizer.json"))
    else:
        shutil.copyfile(path, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token, "bos_token": None,
        "unk_token": None, "pad_token": None, "add_bos_token": False, "add_eos_token": False,
        # Without it transformers 4.x returns token_type_ids too, which generate() refuses.
        "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False, "model_max_length": int(c.data.seq_len)}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": tok.eos_token}, indent=2))
    return tok.eos_id, path or "byte"


# What an export writes (and so owns in its --out directory): removed first by --replace.
OWNED = ("config.json", hf_llama.WEIGHTS_FILE, hf_llama.INDEX_FILE, "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "generation_config.json", EXPORT_INFO)


def _owned(path: pathlib.Path) -> bool:
    return path.name in OWNED or (path.name.startswith("model-") and path.name.endswith(".safetensors"))


def prepare_out(out: pathlib.Path, replace: bool = False, log=print) -> None:
    """Check that ``out`` can take an export, before anything is read: a directory to create, or an
    empty one; a non-empty one only with ``replace``, which removes the files an export owns there
    (so no stale tokenizer or shard index is left beside the new weights) and leaves the others."""
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            where = "is" if p == out else f"is below {p}, which is"
            raise OutError(f"--out={out} {where} an existing file, not a directory; pass a new directory.")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not replace:
        raise OutError(f"--out={out} is not empty ({len(list(out.iterdir()))} entries); pass a new directory, "
                          "or --replace to remove the files an export owns there first.")
    for p in out.iterdir():
        if _owned(p) and not p.is_dir():
            p.unlink()
    others = sorted(p.name for p in out.iterdir())
    if others:
        log(f"--replace: left {len(others)} entries an export does not write in {out}: {', '.join(others[:5])}")


def check_tokenizer(c, step_dir: pathlib.Path, tok) -> None:
    """The tokenizer at ``c.data.tokenizer`` must be the one the checkpoint was trained on (its
    manifest records its hash): a file replaced since would give the export another vocabulary."""
    run = (checkpoint.read_manifest(step_dir) or {}).get("run") or {}
    trained = (run.get("identity") or {}).get("tokenizer")
    fingerprint = str(getattr(tok, "fingerprint", ""))
    now = "bytes" if fingerprint.startswith("byte") else "sha256:" + fingerprint.removeprefix("hf-")
    if trained is not None and trained != now:
        raise ExportError(f"{step_dir} was trained on the tokenizer {trained}, but config.data.tokenizer="
                          f"{c.data.tokenizer!r} is now {now}: the file changed since; put the original back.")


def export(workdir, out, step: int | None = None, dtype: str = "float32", log=print, replace: bool = False) -> dict:
    """Write the run in ``workdir`` to ``out`` as a Hugging Face model directory (Llama; Mixtral or
    Qwen2-MoE for an MoE run); returns what was written.
    Everything comes from the checkpoint's own config (its manifest's): ``max_position_embeddings``
    is the ``seq_len`` that step was trained at, the tokenizer files and ``eos_token_id`` those of its
    tokenizer."""
    workdir, out = pathlib.Path(workdir), pathlib.Path(out)
    prepare_out(out, replace, log)
    if (workdir / "config.json").is_file() and hf_moe.uses_moe(run_config(workdir).model):
        hf_moe.architecture(run_config(workdir).model)  # Mixtral or Qwen2-MoE, or refused naming the settings
    s, step_dir = latest_verified_step(workdir, step)
    c = run_config(workdir, step_dir)
    writer = hf_llama.write_checkpoint
    if hf_moe.uses_moe(c.model):
        hf_moe.architecture(c.model)  # the checkpoint's own settings, before any parameter is read
        writer = hf_moe.write_checkpoint
    params = model_layout(c, read_params(step_dir))
    out.mkdir(parents=True, exist_ok=True)
    eos_id, tokenizer = _write_tokenizer(c, out, step_dir)
    writer(str(out), c.model, params, max_position_embeddings=int(c.data.seq_len), eos_token_id=eos_id, dtype=dtype)
    info = {"workdir": str(workdir.resolve()), "step": s, "run": c.get("name"), "dtype": dtype,
            "runner": "pipeline" if configs.uses_pipeline(c) else "simulate", "tokenizer": tokenizer,
            "params": int(sum(int(x.size) for x in _leaves(params)))}
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=2))
    log(f"exported step {s} of {workdir} ({info['params']:,} parameters, {dtype}) to {out}")
    return info


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncpp_jax.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="the run's directory (config.json, checkpoints/)")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--step", type=int, default=None, help="default: the newest verified checkpoint")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="float32 (default) reads back bit-identically; bfloat16 halves the file")
    parser.add_argument("--replace", action="store_true",
                        help="export into a non-empty --out: remove the files an export owns there first")
    args = parser.parse_args(argv)
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")  # host arrays only: never claim a training job's accelerator
    try:
        export(args.workdir, args.out, args.step, args.dtype, log=lambda m: print(m, file=sys.stderr),
               replace=args.replace)
    except (ExportError, HFCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, OutError) else 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
