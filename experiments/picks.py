"""Each arm's pick from a tuning study's rows: the learning rate of lowest mean final validation loss
over the tuning seeds, never one at which a seed diverged.  Pure functions of the rows (no study,
no sweep), so the studies' own analyses and :mod:`experiments.tuning` both use them."""

from __future__ import annotations

import collections
import math
import re


def parse(variant: str) -> tuple[str, float, str] | None:
    """``(optimizer, lr, arm)`` of an ``lr`` study variant such as ``adamw/lr=0.003/sync``; else None."""
    parsed = parse_arm(variant)
    return parsed if parsed and re.fullmatch(r"\w+", parsed[0]) and re.fullmatch(r"\w+", parsed[2]) else None


def lr_of_row(row: dict) -> float | None:
    """The learning rate the run trained with: its ``optimizer.lr`` override, else the one in its name."""
    lr = (row.get("overrides") or {}).get("optimizer.lr")
    if lr is not None:
        return float(lr)
    parsed = parse_arm(row["variant"])
    return parsed[1] if parsed else None


ARM_VARIANT = re.compile(r"^(?P<prefix>.+)/lr=(?P<lr>[^/]+)/(?P<arm>[^/]+)$")


def parse_arm(variant: str) -> tuple[str, float, str] | None:
    """``(prefix, lr, arm)`` of a variant ``PREFIX/lr=VALUE/ARM`` (``u=200/adamw/lr=0.0042/2bw`` ->
    ``('u=200/adamw', 0.0042, '2bw')``); else None."""
    m = ARM_VARIANT.match(variant)
    if not m:
        return None
    try:
        return m["prefix"], float(m["lr"]), m["arm"]
    except ValueError:
        return None


def arm_means(rows, study: str) -> dict[tuple[str, str], dict[float, float | None]]:
    """``{(prefix, arm): {lr: mean final val over seeds, or None if a seed diverged}}`` of ``study``'s rows."""
    runs = collections.defaultdict(list)
    for r in rows:
        parsed = parse_arm(r["variant"]) if r.get("study") == study else None
        if parsed:
            runs[(parsed[0], parsed[2], lr_of_row(r))].append(r.get("final_val"))
    out: dict = collections.defaultdict(dict)
    for (prefix, arm, lr), vals in sorted(runs.items()):
        ok = all(v is not None and math.isfinite(v) for v in vals)
        out[(prefix, arm)][lr] = sum(vals) / len(vals) if ok else None
    return dict(out)


def pick_arm_lrs(rows, study: str) -> dict[str, dict[str, float]]:
    """The paper's protocol: every arm tuned on the same grid.  ``{prefix: {arm: lr}}`` with each
    arm's learning rate of lowest mean final val over ``study``'s seeds (never one at which a seed
    diverged); for ``ladder_tune``'s rows, ``{'u=200/adamw': {'sync': ..., '2bw': ..., 'ef': ...}}``."""
    picks: dict = collections.defaultdict(dict)
    for (prefix, arm), by_lr in arm_means(rows, study).items():
        finite = {lr: m for lr, m in by_lr.items() if m is not None}
        if finite:
            picks[prefix][arm] = min(finite, key=lambda lr: (finite[lr], lr))
    return {k: dict(v) for k, v in sorted(picks.items())}


def complete_picks(rows, study: str, variants) -> dict[str, dict[str, float]]:
    """:func:`pick_arm_lrs` restricted to the settings (prefixes) every arm of which has run its whole
    grid, as ``variants`` (the tuning study's variant names) lay it out: a study still running, or
    stopped half way, picks nothing from a partial grid."""
    grids: dict = {}
    for name in variants:
        parsed = parse_arm(name)
        if parsed:
            grids.setdefault(parsed[0], {}).setdefault(parsed[2], set()).add(parsed[1])
    means = arm_means(rows, study)
    picks = pick_arm_lrs(rows, study)
    return {prefix: arms for prefix, arms in picks.items()
            if prefix in grids and all(set(means.get((prefix, arm), {})) >= lrs for arm, lrs in grids[prefix].items())}


def sync_means(rows) -> dict[str, dict[float, float | None]]:
    """``{optimizer: {lr: mean final val over seeds, or None if a seed diverged}}`` (sync arms of the lr study)."""
    return {prefix: by_lr for (prefix, arm), by_lr in arm_means(rows, "lr").items()
            if arm == "sync" and parse(f"{prefix}/lr=0/{arm}")}


def pick_lrs(rows) -> dict[str, float]:
    """Each optimizer's best synchronous learning rate (lowest mean final val over seeds)."""
    return {opt: arms["sync"] for opt, arms in pick_arm_lrs(rows, "lr").items()
            if "sync" in arms and parse(f"{opt}/lr=0/sync")}


def on_grid_edge(rows, study: str) -> list[str]:
    """``prefix/arm`` whose pick is the lowest or highest learning rate it was run at: its grid
    did not bracket the optimum, so the pick is a bound, not a tuned value."""
    edges = []
    for (prefix, arm), by_lr in arm_means(rows, study).items():
        finite = {lr: m for lr, m in by_lr.items() if m is not None}
        if len(by_lr) >= 3 and finite:
            best = min(finite, key=lambda lr: (finite[lr], lr))
            if best in (min(by_lr), max(by_lr)):
                edges.append(f"{prefix}/{arm}")
    return edges
