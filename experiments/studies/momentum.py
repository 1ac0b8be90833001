"""The delay gap as a function of momentum: AdamW's b1 and Muon's mu."""

import collections
import pathlib
import re

from experiments import stats
from experiments.report_format import claim, md_table, plot_xy, se_kind
from experiments.studies.common import optimizer, preset
from experiments.studies import tuned
from experiments.study import Study

MOMENTA = (0.8, 0.9, 0.95, 0.98)


def base_study(name: str) -> Study:
    """The untuned variants (at ``cpu_regime`` tuned per arm, so per momentum value, by
    :mod:`experiments.studies.tuned`)."""
    config, base, seeds, note = preset(name)
    variants = {}
    for opt, key in (("adamw", "optimizer.adamw.b1"), ("muon", "optimizer.muon.mu")):
        for beta in MOMENTA:
            for mode in ("sync", "2bw"):
                variants[f"{opt}/beta={beta}/{mode}"] = {**optimizer(opt, name), key: beta, "staleness.mode": mode}
    return Study("momentum", config, variants, seeds=seeds, base=base, note=note)


def study(name: str) -> Study:
    return tuned.finish(base_study(name), name)


def analyse(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    """The report's section: the gap per momentum and the claim that higher momentum shrinks it."""
    lines: list[str] = []
    series, found = collections.defaultdict(list), collections.defaultdict(list)
    for v in arms:
        m = re.match(r"(\w+)/beta=([\d.]+)/2bw$", v)
        if m:
            g = stats.gap(arms, v, v[: -len("2bw")] + "sync")
            if g:
                series[m.group(1)].append((float(m.group(2)), g.value, g.se))
                found[m.group(1)].append((float(m.group(2)), g, m.group(2)))
    series = {k: sorted(v) for k, v in series.items()}
    lines += md_table(["optimizer", "momentum", "delay gap", "standard error"],
                    [(k, x, str(g), se_kind(g)) for k, pts in sorted(found.items())
                     for x, g, _ in sorted(pts, key=lambda p: p[0])]) + [""]
    lines.append(f"![gap vs momentum]({plot_xy(series, out / 'momentum_gap.png', 'b1 / mu', 'delay gap', 'gap vs momentum')})")
    lines.append("")
    for opt, pts in sorted(found.items()):
        if len(pts) < 2:
            continue
        pts = sorted(pts, key=lambda p: p[0])
        (lo, g_lo, s_lo), (hi, g_hi, s_hi) = pts[0], pts[-1]
        shrink = stats.contrast(arms, {f"{opt}/beta={s_lo}/2bw": 1.0, f"{opt}/beta={s_lo}/sync": -1.0,
                                       f"{opt}/beta={s_hi}/2bw": -1.0, f"{opt}/beta={s_hi}/sync": 1.0})
        claim(claims, f"Higher momentum shrinks the delay gap ({opt})", stats.verdict(shrink),
               "s = gap at the lowest momentum - gap at the highest: reproduced if s > t SE, "
               "not reproduced if s < -t SE",
               f"gap {g_lo} at {lo:g} -> {g_hi} at {hi:g}; s = {shrink} ({se_kind(shrink)})",
               "higher momentum consistently shrinks the gap (reported, no figure)")
    return lines
