"""PipeDream's per-stage delay vs 2BW as the pipeline deepens (P in {2, 4, 8})."""

import pathlib
import re

from experiments import analysis, stats
from experiments.report_format import claim, md_table, plot_xy, se_kind
from experiments.studies.common import optimizer, preset
from experiments.studies import tuned
from experiments.study import Study

DEPTHS = (2, 4, 8)


def base_study(name: str) -> Study:
    """The untuned variants (at ``cpu_regime`` tuned per arm by :mod:`experiments.studies.tuned`)."""
    config, base, seeds, note = preset(name)
    # Divisible by every depth: 8 layers for the CPU presets; for the paper preset SmolLM2-135M's 30
    # layers become 32 (138.5M parameters instead of 134.5M).
    base["model.n_layers"] = 8 if name in ("cpu", "cpu_regime") else 32
    variants = {"adamw/sync": {**optimizer("adamw", name), "staleness.mode": "sync"}}
    variants["adamw/2bw"] = {**optimizer("adamw", name), "staleness.mode": "2bw"}
    for p in DEPTHS:
        variants[f"adamw/pipedream/P={p}"] = {**optimizer("adamw", name), "staleness.mode": "pipedream", "staleness.pipedream_stages": p}
    return Study("schemes", config, variants, seeds=seeds, base=base, note=note)


def study(name: str) -> Study:
    return tuned.finish(base_study(name), name)


def analyse(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    """The report's section: PipeDream's gap per depth against 2BW's, and its claim."""
    lines: list[str] = []
    pts = []
    for v in arms:
        m = re.search(r"/pipedream/P=(\d+)$", v)
        if m:
            g = stats.gap(arms, v, v.split("/")[0] + "/sync")
            if g:
                pts.append((int(m.group(1)), g, v))
    pts.sort(key=lambda p: p[0])
    two = stats.gap(arms, "adamw/2bw", "adamw/sync")
    series = {"pipedream": [(p, g.value, g.se) for p, g, _ in pts]}
    if two and pts:
        series["2bw"] = [(p, two.value, two.se) for p, _, _ in pts]
    lines += md_table(["scheme", "P", "delay gap", "standard error"],
                    [("pipedream", p, str(g), se_kind(g)) for p, g, _ in pts]
                    + ([("2bw", "any", str(two), se_kind(two))] if two else [])) + [""]
    if pts:
        lines.append(f"![gap vs depth]({plot_xy(series, out / 'schemes_gap.png', 'pipeline depth P', 'delay gap', 'gap vs depth')})")
        lines.append("")
    if two and len(pts) > 1:
        (p_lo, _, v_lo), (p_hi, _, v_hi) = pts[0], pts[-1]
        deeper = stats.contrast(arms, {v_hi: 1.0, v_lo: -1.0})
        vs_2bw = stats.contrast(arms, {v_hi: 1.0, "adamw/2bw": -1.0})
        claim(claims, "PipeDream degrades with depth while 2BW does not",
               analysis.both([stats.verdict(deeper), stats.verdict(vs_2bw)]),
               f"d1 = PipeDream(P={p_hi}) - PipeDream(P={p_lo}) and d2 = PipeDream(P={p_hi}) - 2BW: "
               "reproduced if both > t SE, not reproduced if either < -t SE (2BW has one delay at any depth)",
               f"PipeDream gap {' -> '.join(str(g) for _, g, _ in pts)} for P = "
               f"{', '.join(str(p) for p, _, _ in pts)}; 2BW {two}; d1 = {deeper}, d2 = {vs_2bw}",
               "PipeDream's gap grows with P, 2BW's does not (reported, no figure)")
    return lines
