"""What each mitigation recovers of the delay gap, for AdamW and Muon.

Beyond the paper's four: ``nesterov`` (Ajanthan et al. 2025's look-ahead: NAdamW with b1 0.99 for
AdamW, Nesterov momentum 0.99 plus a NAdamW side branch for Muon) and ``weight_prediction``
(SpecTrain / PipeMare: the gradient taken at ``w_t + (w_t - w_{t-1})``).  PipeMare's learning-rate
rescheduling has no arm: at 2BW's one-step delay its factor ``1^-p`` is 1, and config validation
rejects it there.
"""

import collections
import pathlib

from experiments import analysis, stats
from experiments.report_format import est, figure, md_table, se_kind
from experiments.studies.common import optimizer, preset
from experiments.studies import tuned
from experiments.study import Study


def base_study(name: str) -> Study:
    """The untuned variants (at ``cpu_regime`` tuned per arm by :mod:`experiments.studies.tuned`)."""
    config, base, seeds, note = preset(name, paper_model="360m")  # the paper's headline size
    steps = base.get("train.steps", 20000)
    k = max(steps // 10, 1)
    arms = {
        "sync": {"staleness.mode": "sync"},
        "none": {"staleness.mode": "2bw"},
        "ef": {"staleness.mode": "2bw", "staleness.mitigation": "ef"},
        "taylor": {"staleness.mode": "2bw", "staleness.mitigation": "taylor"},
        "sync_start": {"staleness.mode": "2bw", "staleness.sync_start_steps": k},
        "sync_cooldown": {"staleness.mode": "2bw", "staleness.sync_cooldown_steps": k},
        "ef+sync_start": {"staleness.mode": "2bw", "staleness.mitigation": "ef", "staleness.sync_start_steps": k},
        "nesterov": {"staleness.mode": "2bw", "staleness.nesterov": True},
        "weight_prediction": {"staleness.mode": "2bw", "staleness.weight_prediction": True},
    }
    variants = {f"{opt}/{arm}": {**optimizer(opt, name), **o} for opt in ("adamw", "muon") for arm, o in arms.items()}
    return Study("mitigations", config, variants, seeds=seeds, base=base, note=note)


def study(name: str) -> Study:
    return tuned.finish(base_study(name), name)


def analyse_mitigations(rows, out: pathlib.Path, claims: dict) -> list[str]:
    """Every mitigation ranked by the fraction of the gap it recovers, per optimizer, ± SE."""
    arms = stats.arms_of(rows)
    series, table, lines = collections.defaultdict(list), [], []
    for opt in sorted({v.split("/")[0] for v in arms}):
        # an arm re-run at sync's pick (``@sync_lr``) is in the table of gaps both ways, not ranked here
        names = sorted({v.split("/", 1)[1] for v in arms if v.startswith(f"{opt}/")
                        and not v.endswith(tuned.AT_SYNC)} - {"sync", "none"})
        sync, none = f"{opt}/sync", f"{opt}/none"
        fracs = [(arm, f) for arm in names if (f := stats.recovered(arms, f"{opt}/{arm}", none, sync))]
        if fracs:  # bars in one (alphabetical) arm order for every optimizer; the table is ranked
            series[opt] = [(arm, f.value, f.se) for arm, f in fracs]
        for rank, (arm, f) in enumerate(sorted(fracs, key=lambda x: -x[1].value), start=1):
            # f_arm - f_ef = (ef - arm) / (none - sync)
            vs = stats.ratio(arms, {f"{opt}/ef": 1.0, f"{opt}/{arm}": -1.0}, {none: 1.0, sync: -1.0}) \
                if arm != "ef" else None
            table.append((opt, rank, arm, est(stats.gap(arms, f"{opt}/{arm}", sync)), f.pct(),
                          "-" if vs is None else f"{vs.value:+.0%} ± {vs.se:.0%}",
                          "-" if vs is None else stats.direction(vs, "more than EF", "less than EF"), se_kind(f)))
        analysis.ef_claim(claims, arms, opt, f"{opt}/ef", none, sync, "`mitigations`")
    lines += ["Against EF: the mitigation's fraction minus EF's, judged by the one-sided t test at n - 1 degrees "
              "of freedom (more or less than EF where beyond t SE).", ""]
    lines += md_table(["optimizer", "rank", "mitigation", "gap vs sync", "fraction of the gap recovered",
                    "minus EF's fraction", "against EF", "standard errors"], table) + [""]
    lines += figure("recovered", series, out / "mitigations_recovered.png",
                    "mitigation", "fraction recovered", "gap recovered", bars=True)
    pairs = [(f"{opt} {arm}", f"{opt}/{arm}", f"{opt}/sync") for opt in ("adamw", "muon") for arm in ("none", "ef")]
    lines += analysis.analyse_gap_over_time("mitigations", rows, pairs, out, claims,
                                   {"adamw": "adamw none", "muon": "muon none"}, prefer=False)
    return lines


def analyse(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    """The report's section of this study."""
    return analyse_mitigations(rows, out, claims)
