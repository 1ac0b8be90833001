"""Learning-rate sweep: each optimizer's synchronous final loss over a geometric grid of peak
learning rates around its untuned default (``common.LR``); the best per optimizer is its tuned
learning rate.  The ``lr_gap`` study (:mod:`experiments.studies.lr_gap`) runs AdamW and Muon on the
same grid under 2BW's one-step delay and 2BW + error feedback, so the delay gap and EF's recovered
fraction are measured at every learning rate rather than at one that suits the synchronous arm; it
is a study of its own so that each fits the preset's hour, and its synchronous arms are this
study's runs (the sweep copies them).

Grid: ``centre x {1/3, 1/sqrt 3, 1, sqrt 3, 3}`` (9x wide, two significant figures).  At ``cpu``
the centre is ``LR[opt]``, so Lion's grid sits 10x below the others as its default does, extended
upward (:data:`EXTEND`) for an optimizer whose best learning rate was the grid's top point.  At
``cpu_regime`` (and each rung of the ``ladder`` study) the centre is the optimizer's ``cpu`` pick
scaled by the batch ratio (Muon, Lion) or its square root (the others;
:func:`experiments.studies.common.lr_centre`).  Variant names: ``OPT/lr=VALUE/ARM`` with ARM
``sync`` here, ``sync``, ``2bw`` or ``ef`` in ``lr_gap``.  The best synchronous learning rate per optimizer
(:func:`experiments.tuning.pick_lrs`) is what ``common.TUNED_LR`` holds for the preset.  Every
other setting is the optimizer's at the preset (``common.optimizer``), including those a study of
their own tuned (``common.TUNED_SETTINGS``: Lion's b1 and schedule at ``cpu``, tuned by the ``lion``
study at Lion's first pick here, after which Lion's grid here was run again with them).
"""

import math
import pathlib

import numpy as np

from experiments import analysis, picks, stats
from experiments.report_format import figure, md_table

from experiments.studies.common import LR, lr_centre, optimizer, preset
from experiments.study import Study

NAMES = ("adamw", "muon", "soap", "adan", "lion", "mars")
FACTORS = (1 / 3, 1 / math.sqrt(3), 1.0, math.sqrt(3), 3.0)
DELAYED = ("adamw", "muon")  # the optimizers whose delay gap and EF recovery are swept too
ARMS = {
    "sync": {"staleness.mode": "sync"},
    "2bw": {"staleness.mode": "2bw"},
    "ef": {"staleness.mode": "2bw", "staleness.mitigation": "ef"},
}


# A sweep whose best learning rate sits on the grid's edge has not found the optimum: where the
# first grid's best synchronous run was its top point, the grid goes on upward (same ratio) until
# the best is inside.  cpu preset: Muon and SOAP were best at 0.009 and Lion at 0.0009, all still
# falling (Muon 1.92 nats/byte against 2.06 at 0.0052, SOAP 1.96 against 2.02, Lion 2.37 against 2.46).
EXTEND = {opt: (3 * math.sqrt(3), 9.0) for opt in ("muon", "soap", "lion")}
# cpu_regime: Lion's best synchronous run was its grid's top point (0.00034) in both the lr study
# and the optimizers' tuning, so its grid goes one point further up.
EXTEND_REGIME = {"lion": (3 * math.sqrt(3),)}


def local_grid(opt: str, around: float, preset_name: str = "cpu_regime", batch: int | None = None,
               steps: tuple[int, ...] = (-1, 0, 1)) -> list[float]:
    """The points ``around x sqrt(3)^k`` (``k`` in ``steps``) of ``opt``'s grid lattice at ``preset_name``
    (``centre x sqrt(3)^k``, rounded as :func:`grid` rounds): the same values :func:`grid` gives, so a
    run on both is one run.  ``around`` must be a lattice point (a pick from a grid)."""
    centre = lr_centre(opt, batch) if preset_name == "cpu_regime" else LR[opt]
    lattice = {float(f"{centre * math.sqrt(3) ** k:.2g}"): k for k in range(-8, 9)}
    if around not in lattice:
        raise ValueError(f"{around:g} is not a point of {opt}'s learning-rate grid at {preset_name} "
                         f"(its points near it: {sorted(lattice)}); give a pick from that grid")
    k0 = lattice[around]
    return sorted(float(f"{centre * math.sqrt(3) ** (k0 + k):.2g}") for k in steps)


def grid(opt: str, preset_name: str = "cpu", batch: int | None = None) -> list[float]:
    """``opt``'s learning rates at ``preset_name`` (a ``cpu_regime`` rung: at ``batch``), ascending,
    rounded to two significant figures."""
    if preset_name == "cpu_regime":
        return [float(f"{lr_centre(opt, batch) * f:.2g}") for f in FACTORS + EXTEND_REGIME.get(opt, ())]
    return [float(f"{LR[opt] * f:.2g}") for f in FACTORS + EXTEND.get(opt, ())]


# Two seeds at the cpu preset, here and in lr_gap: 36 and 36 variants, and three seeds would take
# each past the hour the studies' presets are sized to; the picks' margins are checked against two.
CPU_SEEDS = (0, 1)


def variants_of(name: str, optimizers, arms, batch: int | None = None) -> dict:
    """``OPT/lr=VALUE/ARM`` -> overrides, for each optimizer's grid and each arm."""
    variants = {}
    for opt in optimizers:
        for lr in grid(opt, name, batch):
            for arm in arms:
                # The grid is around the untuned LR; the optimizer's other tuned settings at this
                # preset (common.TUNED_SETTINGS: Lion's b1 and schedule at cpu) apply.
                variants[f"{opt}/lr={lr:g}/{arm}"] = {**optimizer(opt, name), "optimizer.lr": lr, **ARMS[arm]}
    return variants


# cpu_regime follows the paper's protocol: tune on one seed, then measure the picks at three.
TUNE_SEEDS = (0,)


def seeds_of(name: str, seeds: tuple) -> tuple:
    return {"cpu": CPU_SEEDS, "cpu_regime": TUNE_SEEDS}.get(name, seeds)


def study(name: str) -> Study:
    config, base, seeds, note = preset(name)
    return Study("lr", config, variants_of(name, NAMES, ("sync",)), seeds=seeds_of(name, seeds), base=base, note=note)


def analyse_lr(rows, out: pathlib.Path, claims: dict) -> list[str]:
    """The ``lr`` study: sync final val per optimizer x lr (the pick marked) and val vs lr."""
    lines = []
    sync = picks.sync_means(rows)
    chosen = picks.pick_lrs(rows)
    arms = stats.arms_of(rows)
    names = analysis.lr_names(rows)
    div = analysis.diverged(rows)

    def cell(opt, lr):
        v = names.get((opt, lr, "sync"))
        if v is None:
            return "", None
        if div.get(v):
            return f"diverged ({div[v]} of {div[v] + len(arms.get(v, []))})", None
        x = np.array([y for _, y in arms[v]])
        e = stats.Estimate(float(x.mean()), math.sqrt(stats.var_of_mean(x)), False, len(x))
        text = f"{e.value:.4f} ± {e.se:.4f}"
        return (f"**{text}** (pick)" if chosen.get(opt) == lr else text), e

    table, series = [], {}
    for opt in sorted(sync):
        row = [opt]
        for lr in sorted(lr for (o, lr, arm) in names if o == opt and arm == "sync"):
            text, e = cell(opt, lr)
            row.append(f"{lr:g}: {text}")
            if e is not None:
                series.setdefault(opt, []).append((lr, e.value, e.se))
        table.append(row)
    width = max((len(r) for r in table), default=1) - 1
    table = [r + [""] * (width + 1 - len(r)) for r in table]
    lines += ["### Synchronous final validation loss per learning rate", "",
              "Each cell is `lr: mean ± SE over seeds`, learning rates ascending; the pick (lowest mean; a "
              "learning rate at which any seed diverged is never picked) is what `common.TUNED_LR[preset]` must "
              "hold for this preset (`tests/test_tuning.py` checks it against the committed rows).", ""]
    lines += md_table(["optimizer"] + [f"lr {k + 1}" for k in range(width)], table) + [""]
    lines.append("Picks: " + ", ".join(f"{k} {v:g}" for k, v in sorted(chosen.items())) + ".")
    lines.append("")
    lines += figure("val vs lr", series, out / "lr_val.png",
                    "peak learning rate", "final val loss (nats/byte)", "sync loss vs learning rate", logx=True, zero=False)
    return lines


def analyse(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    """The report's section of this study."""
    return analyse_lr(rows, out, claims)
