"""Resume checks that run before anything in the workdir changes.

A workdir with checkpoints is resumed only if the state this config builds has exactly the layout
(leaf paths, shapes, dtypes) recorded in the checkpoints' manifests: a changed model, optimizer,
staleness scheme or pipeline layout would otherwise surface as an orbax shape error halfway
through a restore, or worse, restore into a different meaning.  ``config.json`` is the record of
the settings the run started with; it is written only when a run starts fresh.
"""

from __future__ import annotations

import json
import pathlib

import ml_collections

from asyncpp_jax import configs
from asyncpp_jax.train.checkpoint import saved_layout, state_layout, step_dirs

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
    try:
        return json.loads((workdir / "config.json").read_text())
    except (OSError, ValueError):
        return None


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
        f"Fix: rerun with {fix} (as in config.json) to resume,{other} or pass a new --workdir to start a new run. "
        "Nothing in the workdir was changed.")


def check_resume(workdir: pathlib.Path, config, abstract_state) -> list[str]:
    """Raise :class:`ResumeRefused` if the workdir's checkpoints do not fit ``abstract_state``.

    Returns the settings that differ from the saved ``config.json`` (for a warning) when the
    resume is allowed; an empty list for a fresh start.
    """
    ckpt_dir = workdir / "checkpoints"
    if not step_dirs(ckpt_dir):
        return []
    old = saved_config(workdir)
    changed = configs.diff(old, json.loads(configs.to_json(config))) if old is not None else []
    _check_split(workdir, old, config)
    saved = saved_layout(ckpt_dir)
    if saved is None:  # no sealed checkpoint: the integrity check will report it
        return changed
    differences = _layout_differences(saved, state_layout(abstract_state))
    if not differences:
        return changed
    settings = ("\n    ".join(changed) if changed else
                "(none: the settings equal config.json, so the code's state layout itself changed)")
    leaves = "\n    ".join(differences[:_SHOWN]) + (
        f"\n    ... {len(differences) - _SHOWN} more" if len(differences) > _SHOWN else "")
    raise ResumeRefused(
        f"refusing to resume the run in {workdir}: its checkpoints hold a state of a different layout.\n"
        f"  settings that differ from {workdir / 'config.json'}:\n    {settings}\n"
        f"  state leaves that differ ({len(differences)}):\n    {leaves}\n"
        "Fix: rerun with the saved settings (those in config.json) to resume, or pass a new --workdir to "
        "start a new run with these. Nothing in the workdir was changed."
    )
