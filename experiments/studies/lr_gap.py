"""AdamW's and Muon's delay gap and error feedback's recovered fraction at every learning rate of
the ``lr`` study's grid: sync, 2BW and 2BW + EF (variants ``OPT/lr=VALUE/ARM``).  The sync arms
are the ``lr`` study's runs, copied by the sweep when that study has been run under the same
``--out``; run ``lr`` first.
"""

import pathlib

from experiments import analysis, stats
from experiments.report_format import est, figure, md_table, se_kind
from experiments.studies import lr
from experiments.studies.common import preset
from experiments.study import Study


def study(name: str) -> Study:
    config, base, seeds, note = preset(name)
    return Study("lr_gap", config, lr.variants_of(name, lr.DELAYED, tuple(lr.ARMS)), seeds=lr.seeds_of(name, seeds),
                 base=base, note=note)


def analyse_lr_gap(rows, out: pathlib.Path) -> list[str]:
    """The ``lr_gap`` study: AdamW's and Muon's delay gap and EF's recovered fraction at every learning rate."""
    lines = []
    arms = stats.arms_of(rows)
    names = analysis.lr_names(rows)
    lrs = sorted({lr for (_, lr, _) in names})
    gap_series, frac_series, table = {}, {}, []
    for opt in ("adamw", "muon"):
        for lr in lrs:
            v = {arm: names.get((opt, lr, arm)) for arm in ("sync", "2bw", "ef")}
            if v["sync"] is None or v["2bw"] is None:
                continue
            g = stats.gap(arms, v["2bw"], v["sync"])
            g_ef = stats.gap(arms, v["ef"], v["sync"]) if v["ef"] else None
            f = stats.recovered(arms, v["ef"], v["2bw"], v["sync"]) if v["ef"] else None
            table.append((opt, f"{lr:g}", est(g), est(g_ef), est(f, pct=True), se_kind(g)))
            if g:
                gap_series.setdefault(opt, []).append((lr, g.value, g.se))
            if f:
                frac_series.setdefault(opt, []).append((lr, f.value, f.se))
    if table:
        lines += ["### Delay gap and EF recovery per learning rate", "",
                  "Gap = 2bw - sync, EF gap = 2bw+EF - sync, recovered = 1 - EF gap / gap (delta method).", ""]
        lines += md_table(["optimizer", "lr", "delay gap", "EF gap", "EF recovers", "standard errors"], table) + [""]
    lines += figure("gap vs lr", gap_series, out / "lr_gap.png",
                    "peak learning rate", "delay gap 2bw - sync", "delay gap vs learning rate", logx=True)
    lines += figure("EF recovery vs lr", frac_series, out / "lr_ef_recovered.png",
                    "peak learning rate", "fraction of the gap EF recovers", "EF recovery vs learning rate", logx=True)
    return lines


def analyse(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    """The report's section of this study."""
    return analyse_lr_gap(rows, out)
