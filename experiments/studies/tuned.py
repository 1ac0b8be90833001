"""The paper's tuning protocol for the headline studies at ``cpu_regime``: every arm tuned on the
same learning-rate grid, then measured at three seeds.

A headline study (``optimizers``, ``momentum``, ``mitigations``, ``schemes``) defines its variants
untuned (``base_study``).  At ``cpu_regime`` it runs in two steps:

1. ``STUDY_tune`` (:func:`tune_study`): each variant ``PREFIX/ARM`` over its optimizer's grid
   (``lr.grid`` at the preset's batch; for ``momentum``, ``mitigations`` and ``schemes`` its three
   points around the optimizer's synchronous pick, :func:`tune_grid`), one seed (``lr.TUNE_SEEDS``), as ``PREFIX/lr=VALUE/ARM``;
   the sweep copies the runs another study already made with the same config (the ``lr`` study's
   sync arms, the ladder's 3,200-update rung).
2. ``STUDY`` (:func:`measured_study`): each variant at its own pick, under its own name, so the
   report's gaps are best arm against best arm; each delayed variant also at its synchronous arm's
   pick, as ``PREFIX/ARM@sync_lr``, for the gap at the sync-tuned learning rate.  Three seeds; seed
   0 is the tuning run (copied).

The picks (:func:`experiments.tuning.pick_arm_lrs` over the ``STUDY_tune`` rows) live in
``common.TUNED_ARMS[preset][STUDY]`` as ``{variant: lr}``; ``tests/test_regime.py`` holds each
table to its committed rows.  Other presets run the untuned study as before.
"""

from __future__ import annotations

import dataclasses

from experiments.studies import common, lr
from experiments.study import Study

TUNED_PRESETS = ("cpu_regime",)
AT_SYNC = "@sync_lr"


def split(variant: str) -> tuple[str, str]:
    """``('adamw', '2bw')`` of ``adamw/2bw``; ``('adamw/beta=0.9', 'sync')`` of ``adamw/beta=0.9/sync``."""
    prefix, _, arm = variant.rpartition("/")
    return prefix, arm


def sync_of(variants, variant: str) -> str | None:
    """The synchronous arm of ``variants`` (names) a variant's delay gap is taken against:
    ``PREFIX/sync`` if there is one, else the optimizer's own ``OPT/sync`` (``adamw/pipedream/P=4``
    -> ``adamw/sync``)."""
    prefix, arm = split(variant)
    if arm == "sync":
        return None
    return next((c for c in (f"{prefix}/sync", f"{variant.split('/')[0]}/sync") if c in variants), None)


# These studies tune on three points of the optimizer's grid, around its synchronous pick in the
# optimizers' tuning (TUNED_ARMS[preset]["optimizers"]): there every delayed arm's pick sat within one
# point of it, and five points for each of 16-18 arms would take a study several hours on 2 cores.
# Where an arm's pick lands on this grid's edge, every arm of that setting gets the next points, so
# that they still share one grid (LOCAL_EXTEND: {study: {setting: (k, ...)}}, k in grid steps).
LOCAL_GRID = ("momentum", "mitigations", "schemes")
LOCAL_EXTEND: dict[str, dict[str, tuple[int, ...]]] = {
    # momentum_tune's first pass: these settings' picks were on an edge (AdamW's lower momenta at the
    # lowest point, Muon's at the highest; the 0.9 / 0.95 points are the optimizers' tuning runs);
    # the second put Muon 0.8's and 0.98's there again
    "momentum": {"adamw/beta=0.8": (-2,), "adamw/beta=0.9": (-2,), "adamw/beta=0.95": (2,),
                 "muon/beta=0.8": (2, 3), "muon/beta=0.9": (2,), "muon/beta=0.95": (2,), "muon/beta=0.98": (2,)},
    # mitigations_tune's first pass: AdamW's 2bw, EF, Taylor, cooldown and Nesterov arms picked the
    # lowest point, Muon's 2bw and EF the highest
    "mitigations": {"adamw": (-2,), "muon": (2,)},
    # schemes_tune, set before its first pass: every delayed AdamW arm of mitigations_tune picked
    # one point below the 3-point grid, and PipeDream's deeper delays want no larger a step; the
    # first pass put PipeDream's P = 8 pick on that lower edge, so its setting goes one point further
    "schemes": {"adamw": (-2,), "adamw/pipedream": (-2, -3)},
}


def tune_grid(study_name: str, variant: str, opt: str, preset_name: str, batch: int | None) -> list[float]:
    """The learning rates ``variant`` of ``study_name`` is tuned over: the optimizer's grid, or for a
    :data:`LOCAL_GRID` study its three points around the optimizer's synchronous pick."""
    if study_name not in LOCAL_GRID:
        return lr.grid(opt, preset_name, batch)
    around = common.TUNED_ARMS[preset_name]["optimizers"][f"{opt}/sync"]
    steps = (-1, 0, 1) + LOCAL_EXTEND.get(study_name, {}).get(split(variant)[0], ())
    return lr.local_grid(opt, around, preset_name, batch, steps)


def tune_study(study: Study, preset_name: str) -> Study:
    """``study``'s variants over their learning-rate grids (:func:`tune_grid`) at ``preset_name``, one seed."""
    batch = study.base.get("train.global_batch_size")
    variants = {}
    for variant, overrides in study.variants.items():
        prefix, arm = split(variant)
        for value in tune_grid(study.name, variant, overrides["optimizer.name"], preset_name, batch):
            variants[f"{prefix}/lr={value:g}/{arm}"] = {**overrides, "optimizer.lr": value}
    return dataclasses.replace(study, name=f"{study.name}_tune", variants=variants, seeds=lr.TUNE_SEEDS,
                               note=f"{study.name}'s tuning: {len(variants)} runs, one seed")


def picks_by_variant(arm_picks: dict) -> dict[str, float]:
    """``{'adamw': {'sync': a, '2bw': b}}`` (tuning.pick_arm_lrs) -> ``{'adamw/sync': a, 'adamw/2bw': b}``."""
    return {f"{prefix}/{arm}": value for prefix, arms in arm_picks.items() for arm, value in arms.items()}


def measured_study(study: Study, picks: dict[str, float]) -> Study:
    """Each variant at its pick; each delayed one also at its sync arm's pick (``@sync_lr``)."""
    missing = [v for v in study.variants if v not in picks]
    if missing:
        raise ValueError(f"common.TUNED_ARMS has no pick for {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''} of study {study.name!r}; run "
                         f"`python -m experiments.sweep {study.name}_tune --preset=cpu_regime` and set the table "
                         "from `python -m experiments.tuning RESULTS`")
    variants = {}
    for variant, overrides in study.variants.items():
        variants[variant] = {**overrides, "optimizer.lr": picks[variant]}
        sync = sync_of(study.variants, variant)
        if sync is not None and picks[sync] != picks[variant]:
            variants[variant + AT_SYNC] = {**overrides, "optimizer.lr": picks[sync]}
    return dataclasses.replace(study, variants=variants, seeds=common.CPU_REGIME_SEEDS)


def finish(study: Study, preset_name: str) -> Study:
    """``study`` as the preset runs it: measured at its tuned picks where the preset tunes per arm."""
    if preset_name not in TUNED_PRESETS:
        return study
    return measured_study(study, common.TUNED_ARMS.get(preset_name, {}).get(study.name, {}))
