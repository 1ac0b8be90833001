"""Lion's settings beside its learning rate: ``b1`` (the interpolation weight inside the sign,
``c_t = b1 m_{t-1} + (1 - b1) g_t``) x the learning-rate schedule after warmup, synchronous, at
Lion's tuned learning rate for the preset.

Why Lion gets this step and the others do not: at the ``cpu`` preset's first ``lr`` sweep (paper
defaults b1 0.9, b2 0.99, cosine to 10% of the peak) Lion alone ended less than 1 nat/byte below
the corpus's unigram entropy, and one-seed probes found that its weight decay, b2 and the batch
were not why (``experiments/README.md``, "Lion at the ``cpu`` preset"): its loss was still falling
steeply at the end, and lowering the final learning rate (cosine to 0) made it worse, so Lion is
starved of step size late in a 200-update run while a higher peak is unstable.  The grid: ``b1``
in ``B1`` x schedule in ``SCHEDULES`` (cosine to 10%, the preset's; warmup-stable-decay, holding
the peak and decaying to 10% over the last 20%; constant).  Variants: ``b1=VALUE/SCHEDULE``.  The
best mean final validation loss (:func:`pick`) is
``common.TUNED_SETTINGS[preset]["lion"]``, and the ``lr`` study then sweeps Lion's learning rate
again with it (one round of coordinate descent).
"""

import collections
import math
import pathlib
import re

from experiments.studies.common import lr_of, preset, WD
from experiments.study import Study

B1 = (0.9, 0.7, 0.5)
SCHEDULES = {
    "cosine": {"optimizer.schedule": "cosine", "optimizer.min_lr_ratio": 0.1},
    "wsd": {"optimizer.schedule": "wsd", "optimizer.min_lr_ratio": 0.1, "optimizer.wsd_decay_fraction": 0.2},
    "constant": {"optimizer.schedule": "constant"},
}
# Two seeds, as the lr study this tunes beside.
CPU_SEEDS = (0, 1)


def variant_settings(b1: float, schedule: str) -> dict:
    """The overrides of variant ``b1=B1/SCHEDULE`` beyond optimizer, lr and weight decay."""
    return {"optimizer.lion.b1": b1, **SCHEDULES[schedule]}


def study(name: str) -> Study:
    config, base, seeds, note = preset(name)
    seeds = CPU_SEEDS if name == "cpu" else seeds
    # The lr Lion was tuned to before this step (TUNED_LR), not a re-picked one: this study is one
    # coordinate of the descent.
    fixed = {"optimizer.name": "lion", "optimizer.lr": lr_of("lion", name), "optimizer.weight_decay": WD["lion"],
             "staleness.mode": "sync"}
    variants = {f"b1={b1:g}/{s}": {**fixed, **variant_settings(b1, s)} for b1 in B1 for s in SCHEDULES}
    return Study("lion", config, variants, seeds=seeds, base=base, note=note)


LION_VARIANT = re.compile(r"^b1=(?P<b1>[\d.]+)/(?P<schedule>\w+)$")


def pick(rows) -> dict | None:
    """The overrides (:func:`variant_settings`) of the ``lion`` study's
    variant with the lowest mean final validation loss over seeds; None without such rows."""
    runs = collections.defaultdict(list)
    for r in rows:
        m = LION_VARIANT.match(r["variant"]) if r.get("study") == "lion" else None
        if m:
            runs[(float(m["b1"]), m["schedule"])].append(r.get("final_val"))
    finite = {k: sum(v) / len(v) for k, v in runs.items() if all(x is not None and math.isfinite(x) for x in v)}
    if not finite:
        return None
    b1, schedule = min(finite, key=lambda k: (finite[k], k))
    return variant_settings(b1, schedule)


def analyse(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    """The report's section: the lion study's pick."""
    lines: list[str] = []
    chosen = pick(rows)
    if chosen:
        lines += [f"Pick (lowest mean final loss, no seed diverged): "
                  f"{', '.join(f'{k} = {v}' for k, v in chosen.items())}.", ""]
    return lines
