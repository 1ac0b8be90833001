"""Resume checks that run before anything in the workdir changes.

A workdir with checkpoints is resumed only if

* the run's identity is unchanged: each checkpoint's manifest records what its state was trained
  on (:func:`run_record`): the tokenizer (``'bytes'`` or its file's SHA-256), the corpus (a
  fingerprint of the prepared shards and their sources), ``data.seq_len`` and the model's shape.
  A change to any is refused in one line naming the setting, both values and
  ``config.train.accept_changed``, which accepts it on purpose (continued training on new data:
  the data iterator then starts afresh on the new data).  Data-parallel size, batch size,
  optimizer settings and the step count are not part of it;
* the state this config builds has exactly the layout (leaf paths, shapes, dtypes) recorded in
  the manifests: a changed model, optimizer, staleness scheme or pipeline layout would otherwise
  surface as an orbax shape error halfway through a restore, or worse, restore into a different
  meaning.

Each manifest also holds the whole config its state was trained under: that, not the workdir's
``config.json`` (the settings of the run's latest start), is what the export reads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib

import ml_collections

from asyncpp_jax import configs
from asyncpp_jax.train.checkpoint import saved_layout, saved_run, state_layout, step_dirs

log = logging.getLogger("asyncpp_jax")

_SHOWN = 8  # differing leaves listed in the message


class ResumeRefused(configs.ConfigError):
    """The workdir holds a run whose saved state does not fit this config."""


def _layout_differences(saved: dict, now: dict) -> list[str]:
    out = []
    for path in sorted(set(saved) | set(now)):
        a, b = saved.get(path), now.get(path)
        if a != b:
            fmt = lambda x: "absent" if x is None else f"{tuple(x[0])} {x[1]}"  # noqa: E731
            out.append(f"{path}: saved {fmt(a)}, now {fmt(b)}")
    return out


def saved_config(workdir: pathlib.Path) -> dict | None:
    """The config the newest checkpoint was trained under (its manifest's), else ``config.json``'s
    (checkpoints from before manifests recorded it)."""
    found = saved_run(workdir / "checkpoints")
    if found is not None and isinstance(found[1].get("config"), dict):
        return found[1]["config"]
    try:
        return json.loads((workdir / "config.json").read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------
# The run's identity: what a checkpoint was trained on.

def model_shape(c) -> dict:
    """The ``config.model`` fields that fix the parameters' shapes and what each row means."""
    m = c.model
    shape = {f: m[f] for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                               "tie_embeddings")}
    shape["head_dim"] = m.head_dim or m.d_model // m.n_heads
    if m.get("moe") and m.moe.num_experts:
        shape.update({f"moe.{f}": m.moe[f] for f in ("num_experts", "expert_d_ff", "shared_experts", "every")})
    return shape


def run_record(config, corpus) -> dict:
    """What a checkpoint of this run carries in its manifest: the ``config`` it was trained under and
    its ``identity`` (compared on resume), with ``about`` (shown in messages, not compared)."""
    tok = corpus.meta["tokenizer"]
    fingerprint = str(tok.get("fingerprint", ""))
    identity = {"tokenizer": "bytes" if fingerprint.startswith("byte") else "sha256:" + fingerprint.removeprefix("hf-"),
                "corpus": corpus.fingerprint, "seq_len": int(config.data.seq_len), "model": model_shape(config)}
    about = {"tokenizer_file": None if identity["tokenizer"] == "bytes" else tok.get("spec"),
             "source": corpus.meta.get("source"), "train_tokens": corpus.num_tokens("train")}
    return {"config": json.loads(configs.to_json(config)), "identity": identity, "about": about}


_SETTING = {"tokenizer": "config.data.tokenizer", "corpus": "the corpus of config.data.source",
            "seq_len": "config.data.seq_len", "model": "config.model"}
_PURPOSE = {"tokenizer": "retrain on the new tokenizer (every embedding row then stands for another token)",
            "corpus": "continue training on the new data", "seq_len": "continue at the new sequence length",
            "model": "restore into the changed model"}


def _show(item: str, identity: dict, about: dict) -> str:
    value = identity.get(item)
    if item == "tokenizer" and value != "bytes" and about.get("tokenizer_file"):
        return f"{value} ({about['tokenizer_file']})"
    if item == "corpus":
        tokens = about.get("train_tokens")
        return f"{value} ({about.get('source')!r}, {tokens:,} train tokens)" if isinstance(tokens, int) else str(value)
    return str(value)


def _identity_change(item: str, saved: dict, now: dict) -> str:
    """``setting: the checkpoint's value, this config's value`` for one changed identity item."""
    if item == "model":
        a, b = saved["identity"].get("model") or {}, now["identity"]["model"]
        fields = [f for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)]
        return "; ".join(f"config.model.{f}: the checkpoint was trained with {a.get(f)!r}, this config has "
                         f"{b.get(f)!r}" for f in fields)
    return (f"{_SETTING[item]}: the checkpoint was trained on {_show(item, saved['identity'], saved.get('about', {}))}, "
            f"this config gives {_show(item, now['identity'], now['about'])}")


@dataclasses.dataclass
class ResumePlan:
    """What a resume allowed: ``changed`` settings (for a warning), ``accepted`` identity changes,
    and whether the data iterator starts afresh (``new_data``: the saved position is another data's)."""
    changed: list[str] = dataclasses.field(default_factory=list)
    accepted: list[str] = dataclasses.field(default_factory=list)

    @property
    def new_data(self) -> bool:
        return bool({"tokenizer", "corpus", "seq_len"} & set(self.accepted))


def _check_identity(workdir: pathlib.Path, config, record: dict) -> list[str]:
    """The identity items that changed and are accepted; raise :class:`ResumeRefused` on one that is not."""
    found = saved_run(workdir / "checkpoints")
    if found is None or not isinstance(found[1].get("identity"), dict):
        return []  # checkpoints from before manifests recorded it: the layout check alone decides
    step, saved = found
    accepted = set(configs.accepted_changes(config))
    if "tokenizer" in accepted:
        accepted.add("corpus")  # another tokenizer makes another corpus of the same sources
    changed = [i for i in configs.RUN_IDENTITY if saved["identity"].get(i) != record["identity"][i]]
    for item in changed:
        if item not in accepted:
            raise ResumeRefused(
                f"refusing to resume the run in {workdir} (checkpoint of step {step}): "
                f"{_identity_change(item, saved, record)}. To {_PURPOSE[item]} on purpose, pass "
                f"--config.train.accept_changed={item}; else restore the setting, or pass a new --workdir. "
                "Nothing in the workdir was changed.")
    for item in changed:
        log.warning("resuming with a changed %s, accepted by config.train.accept_changed: %s", item,
                    _identity_change(item, saved, record))
    return changed


def _check_split(workdir: pathlib.Path, old: dict | None, config) -> None:
    """Two uneven splits can pad to the same shapes ((3, 1) and (1, 3)), and an interleaved layer
    stack has the shapes of a contiguous one, so the layout check alone would restore one stage's
    (or chunk's) layers into another's rows: compare the arrangements themselves."""
    if old is None:
        return
    try:
        old = ml_collections.ConfigDict(old)
        saved = (configs.uneven_split(old), configs.interleave_of(old))
    except Exception:  # noqa: BLE001 - an old or hand-edited config.json: the layout check decides
        return
    now = (configs.uneven_split(config), configs.interleave_of(config))
    if saved[0] != now[0]:
        show = lambda s: "split as an even split" if s is None else f"split as stage_layers={s}"  # noqa: E731
        _refuse(workdir, show(saved[0]), show(now[0]), "config.pipeline.stage_layers",
                "the padded layouts do not map onto each other",
                f"config.pipeline.stage_layers={','.join(map(str, saved[0])) if saved[0] else '()'}")
    if saved[1] != now[1]:
        show = lambda s: "in model order" if s is None else f"interleaved, {s[1]} chunks per stage"  # noqa: E731
        _refuse(workdir, show(saved[1]), show(now[1]), "config.pipeline.schedule and virtual_stages",
                "the rows would be restored into other layers",
                f"config.pipeline.schedule={old.pipeline.schedule}"
                + (f" and virtual_stages={saved[1][1]}" if saved[1] else ""),
                " export the weights (python -m asyncpp_jax.export) to start from them in a new --workdir,")


def _refuse(workdir, saved: str, now: str, settings: str, why: str, fix: str, other: str = "") -> None:
    raise ResumeRefused(
        f"refusing to resume the run in {workdir}: its checkpoints hold the layer stack {saved}, this config "
        f"asks for it {now} ({settings}); {why}.\n"
        f"Fix: rerun with {fix} (as its checkpoints were trained) to resume,{other} or pass a new --workdir to "
        "start a new run. "
        "Nothing in the workdir was changed.")


def check_resume(workdir: pathlib.Path, config, abstract_state, record: dict | None = None) -> ResumePlan:
    """Raise :class:`ResumeRefused` if the workdir's checkpoints were trained on another identity than
    ``record``'s (:func:`run_record`; unless accepted) or do not fit ``abstract_state``.

    Returns the :class:`ResumePlan` (empty for a fresh start).
    """
    ckpt_dir = workdir / "checkpoints"
    if not step_dirs(ckpt_dir):
        return ResumePlan()
    old = saved_config(workdir)
    changed = configs.diff(old, json.loads(configs.to_json(config))) if old is not None else []
    _check_split(workdir, old, config)
    saved = saved_layout(ckpt_dir)
    # A state of another layout can never be restored (no flag accepts it); one of the same layout
    # can, so the identity decides.
    differences = [] if saved is None else _layout_differences(saved, state_layout(abstract_state))
    if not differences:
        return ResumePlan(changed, _check_identity(workdir, config, record) if record is not None else [])
    settings = ("\n    ".join(changed) if changed else
                "(none: the settings equal the checkpoints', so the code's state layout itself changed)")
    leaves = "\n    ".join(differences[:_SHOWN]) + (
        f"\n    ... {len(differences) - _SHOWN} more" if len(differences) > _SHOWN else "")
    raise ResumeRefused(
        f"refusing to resume the run in {workdir}: its checkpoints hold a state of a different layout.\n"
        f"  settings that differ from those of its checkpoints:\n    {settings}\n"
        f"  state leaves that differ ({len(differences)}):\n    {leaves}\n"
        "Fix: rerun with the saved settings (those its checkpoints were trained under) to resume, or pass a new "
        "--workdir to start a new run with these. Nothing in the workdir was changed."
    )
