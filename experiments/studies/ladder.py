"""The updates ladder, measured: does the delay gap shrink toward the paper's as updates grow?

Same model (``cpu_regime``'s), same 819,200 tokens, 200 / 800 / 3,200 updates (batches of 32 / 8 / 2
sequences), for AdamW, Muon and SOAP.  Each arm at its own learning rate, picked on the
``ladder_tune`` study's grid (``common.TUNED_LADDER``), and the delayed arms also at the synchronous
arm's pick, so the report gives each gap both ways: best arm against best arm, and at the
sync-tuned learning rate.  Three seeds; seed 0 of every variant is the tuning run itself (the sweep
copies it from ``ladder_tune`` when both are under one ``--out``).

Variants are the tuning study's names, ``u=UPDATES/OPT/lr=VALUE/ARM``: at most 5 per rung and
optimizer (sync at its pick; 2BW and 2BW + EF at their own picks and at sync's), fewer where picks
coincide: 51 with the picks in ``common.TUNED_LADDER``, 153 runs, 51 of them copied, so 102 to
run: about 5.4 CPU-hours, 2.7 hours with ``--jobs 2``.
"""

from experiments.studies import ladder_tune, lr
from experiments.studies.common import CPU_REGIME_SEEDS, TUNED_LADDER, preset
from experiments.study import Study


def variants(picks: dict) -> dict:
    """The tuning study's variants at the picked learning rates: sync at its own, each delayed arm at
    its own and at sync's."""
    grid = ladder_tune.variants()
    out = {}
    for updates in {**ladder_tune.RUNGS, **ladder_tune.EXTRA_RUNGS}:
        for opt in ladder_tune.OPTIMIZERS:
            key = f"{ladder_tune.rung_name(updates)}/{opt}"
            if key not in picks:
                raise ValueError(f"common.TUNED_LADDER has no picks for {key}; run the ladder_tune study and set "
                                 "the table from `python -m experiments.tuning RESULTS`")
            arm_lrs = picks[key]
            wanted = [("sync", arm_lrs["sync"])] + [(arm, v) for arm in ("2bw", "ef")
                                                    for v in sorted({arm_lrs[arm], arm_lrs["sync"]})]
            for arm, lr_value in wanted:
                name = f"{key}/lr={lr_value:g}/{arm}"
                out[name] = grid[name]
    return out


def study(name: str) -> Study:
    ladder_tune.check_preset(name, "ladder")
    config, base, _, note = preset(name)
    return Study("ladder", config, variants(TUNED_LADDER), seeds=CPU_REGIME_SEEDS, base=base,
                 note="the ladder at each arm's picks, 3 seeds (seed 0 copied from ladder_tune)")
