"""Tuned learning rates from the ``lr`` study's rows.

    python -m experiments.tuning experiments/results/cpu/results.jsonl   # prints a TUNED_LR entry

:func:`pick_lrs`: per optimizer, the learning rate whose synchronous runs (``OPT/lr=VALUE/sync``)
reach the lowest mean final validation loss over seeds.  A learning rate at which any seed
diverged (or has no final loss) is never picked: a setting that fails on some seeds is not a
safe default.  ``experiments.studies.common.TUNED_LR[preset]`` holds these picks for the preset the
rows came from (``tests/test_tuning.py`` compares the two).

:func:`pick_lion`: from the ``lion`` study's rows (``b1=VALUE/SCHEDULE``), Lion's settings beside
its learning rate with the lowest mean final validation loss, by the same rule; they are
``common.TUNED_SETTINGS[preset]["lion"]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from experiments import sweep
from experiments.picks import (ARM_VARIANT, arm_means, complete_picks, lr_of_row, on_grid_edge, parse,  # noqa: F401
                               parse_arm, pick_arm_lrs, pick_lrs, sync_means)
from experiments.studies import lion as lion_study


pick_lion = lion_study.pick  # the lion study's settings of lowest mean final loss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.jsonl holding the lr study's rows")
    a = ap.parse_args(argv)
    rows = [json.loads(line) for p in a.results for line in pathlib.Path(p).read_text().splitlines() if line.strip()]
    picks = pick_lrs(rows)
    if not picks:
        raise SystemExit(f"error: no lr-study rows in {', '.join(a.results)}; run `python -m experiments.sweep lr`")
    print("{" + ", ".join(f'"{k}": {v!r}' for k, v in sorted(picks.items())) + "}")
    for study in sorted({r.get("study") for r in rows if str(r.get("study", "")).endswith("_tune")}):
        try:
            variants = sweep.load_study(study, "cpu_regime").variants
        except ValueError:
            continue  # not a sweep study (the factor screen picks as it runs: experiments.screen)
        arm_picks = complete_picks(rows, study, variants)
        partial = sorted(set(pick_arm_lrs(rows, study)) - set(arm_picks))
        if partial:
            print(f"{study}: grids not yet complete, no pick: {', '.join(partial)}")
        if arm_picks:
            if study != "ladder_tune":  # common.TUNED_ARMS[preset][STUDY] is {variant: lr}
                arm_picks = {f"{p}/{arm}": v for p, arms in arm_picks.items() for arm, v in arms.items()}
            print(f"{study}: {json.dumps(arm_picks)}")  # common.TUNED_LADDER, common.TUNED_ARMS
            edges = on_grid_edge(rows, study)
            if edges:
                print(f"{study}: picked on the grid's edge (extend the grid): {', '.join(edges)}")
    lion_pick = pick_lion(rows)
    if lion_pick is not None:
        print(f"lion: {json.dumps(lion_pick)}")  # common.TUNED_SETTINGS[preset]["lion"]


if __name__ == "__main__":
    main()
