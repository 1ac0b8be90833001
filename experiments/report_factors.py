"""The factor screen's section of the study report, and the answer to "What makes the gap large?".

From the ``factors`` rows (:mod:`experiments.studies.factors`, run by :mod:`experiments.screen`):
each arm sits at its pick from the ``factors_tune`` seeds, so every estimate here is on seeds that
chose nothing.  Per cell and optimizer: the delay gap ``G = 2bw - sync`` on the validation windows
and on the test split, and EF's share (:func:`experiments.stats.share`: the linear test of
``G_EF - (1 - s) G``, none where ``G`` is unresolved); per cell the ratio ``G_AdamW / G_Muon`` with
its Fieller interval (the linear test of ``G_AdamW - r G_Muon``).  Along each axis, the change per
doubling of the factor: of each gap (a least-squares slope, a linear contrast of the cells' arms)
and of the ratio (its end cells' difference over the doublings between them, delta-method
standard errors, the cells' runs independent), each judged by a one-sided t test at ``n - 1``
degrees of freedom.  The paper's claims these rows test (:func:`protocol_claims`) are decided on
them, in place of the earlier studies' rows, whose arms were tuned on a seed they were measured on.
"""

from __future__ import annotations

import collections
import math

from experiments import analysis, paper, protocol, stats
from experiments.report_format import OPT_NAMES, SHARE_NOTE, claim, md_table, se_kind
from experiments.studies import factors

TUNE, MEASURE = "factors_tune", "factors"
# Axes: name -> [(cell, factor value)], the factor's value in the unit it doubles in.
AXES = {
    "width (d_model)": [("width=128", 128), ("width=256", 256), ("width=512", 512)],
    "sequences per update": [("width=128", 2), ("seqs=8", 8), ("seqs=32", 32)],
    "updates on the same tokens": [("updates=200", 200), ("updates=800", 800), ("width=128", 3200)],
}
PAIRS = {  # one-step comparisons, not doublings: (label, base cell, changed cell)
    "vocabulary: BPE 4,096 against bytes": ("width=128", "vocab=bpe4096"),
    "warmup: 20 updates against 320 (3,200 updates)": ("width=128", "warmup=20"),
}
RATIO_LABEL = "G_AdamW / G_Muon"


def arms_by_cell(rows) -> dict[tuple[str, str, str], str]:
    """``(cell, optimizer, arm) -> variant`` of the measured rows (one learning rate per arm: its pick)."""
    out = {}
    for r in rows:
        cell, opt, _, arm = r["variant"].split("/")
        out[(cell, opt, arm)] = r["variant"]
    return out


def cell_estimates(rows, cell: str, value=lambda r: r.get("final_val")) -> dict | None:
    """Per optimizer the gap, EF's gap and share; the ratio of the gaps; None if the cell has no rows."""
    names = arms_by_cell(rows)
    arms = stats.arms_of([r for r in rows if r["variant"].startswith(cell + "/")], value)
    if not arms:
        return None
    out: dict = {"opts": {}, "seeds": sorted({s for runs in arms.values() for s, _ in runs})}
    for opt in factors.optimizers_of(cell):
        n = {arm: names.get((cell, opt, arm)) for arm in factors.ARMS}
        if not (n["sync"] in arms and n["2bw"] in arms):
            continue
        out["opts"][opt] = {
            "sync": stats.contrast(arms, {n["sync"]: 1.0}),
            "gap": stats.gap(arms, n["2bw"], n["sync"]),
            "ef_gap": stats.gap(arms, n["ef"], n["sync"]) if n["ef"] in arms else None,
            "share": stats.share(arms, n["ef"], n["2bw"], n["sync"]) if n["ef"] in arms else None,
            "names": n,
        }
    a, m = out["opts"].get("adamw"), out["opts"].get("muon")
    if a and m:
        num = {a["names"]["2bw"]: 1.0, a["names"]["sync"]: -1.0}
        den = {m["names"]["2bw"]: 1.0, m["names"]["sync"]: -1.0}
        out["ratio"] = stats.fieller(arms, num, den)
        out["ratio_se"] = stats.ratio(arms, num, den)
    return out


def _share(r) -> str:
    if r is None:
        return "-"
    return "- (one seed)" if r.n < 2 else r.text(pct=True)


def _est(e, digits=3) -> str:
    if e is None:
        return "-"
    while e.n > 1 and 0 < e.se < 0.5 * 10 ** -digits and digits < 6:  # a standard error never prints as 0
        digits += 1
    return f"{e.value:+.{digits}f}" + (f" ± {e.se:.{digits}f}" if e.n > 1 else "")


def ratio_text(est, one_seed: str = "- (one seed)") -> str:
    """A cell's ``G_AdamW / G_Muon`` from :func:`cell_estimates` as text: its Fieller interval, or why none."""
    r = (est or {}).get("ratio")
    return "-" if r is None else r.text() if r.n > 1 else one_seed


def cell_table(rows, cells) -> list[str]:
    body = []
    for cell in cells:
        val, test = cell_estimates(rows, cell), cell_estimates(rows, cell, lambda r: r.get("test_val"))
        if val is None:
            continue
        for opt, e in val["opts"].items():
            if opt not in factors.OPTIMIZERS:  # width=128's other optimizers: optimizers_table
                continue
            t = (test or {"opts": {}})["opts"].get(opt, {})
            body.append((cell, opt, f"{e['sync'].value:.3f}", _est(e["gap"]), _est(t.get("gap")), _est(e["ef_gap"]),
                         _share(e["share"]), _share(t.get("share")), se_kind(e["gap"])))
        if "ratio" in val:
            body.append((cell, RATIO_LABEL, "", ratio_text(val), ratio_text(test, one_seed="-"), "", "", "",
                         se_kind(val["ratio_se"])))
    if not body:
        return []
    return md_table(["cell", "optimizer", "sync val", "gap (val)", "gap (test split)", "EF gap (val)",
                     "EF share (val)", "EF share (test)", "standard errors"], body) + [""]


def optimizers_table(rows) -> list[str]:
    """The ``optimizers`` study under the protocol: every optimizer of :data:`factors.OPTIMIZERS_CELL` (the
    ``cpu_regime`` run), its gap on validation and the test split and EF's share, beside the paper's
    Tables 1 and 2; an optimizer whose arms are not all measured at three seeds shows what it has."""
    val = cell_estimates(rows, factors.OPTIMIZERS_CELL)
    test = cell_estimates(rows, factors.OPTIMIZERS_CELL, lambda r: r.get("test_val"))
    if val is None:
        return []
    body = []
    for opt in factors.optimizers_of(factors.OPTIMIZERS_CELL):
        e, t = val["opts"].get(opt), (test or {"opts": {}})["opts"].get(opt, {})
        if e is None:
            body.append((OPT_NAMES[opt], "-", "not measured yet", "-", "-", paper.gap(opt), "-", paper.ef_share(opt)))
            continue
        body.append((OPT_NAMES[opt], f"{e['sync'].value:.3f}", _est(e["gap"]), _est(t.get("gap")), _est(e["ef_gap"]),
                     paper.gap(opt), _share(e["share"]) if e["names"]["ef"] else _ef_missing(opt),
                     paper.ef_share(opt)))
    return md_table(["optimizer", "sync val", "gap (val)", "gap (test split)", "EF gap (val)", "the paper's gap",
                     "EF share (val)", "the paper's EF share"], body) + [""]


def _ef_missing(opt: str) -> str:
    """What stands in the EF share's place of an optimizer with no measured EF arm: the screen either
    has not measured it yet, or gives this optimizer none (EF only for the paper's Table 2 optimizers)."""
    return "not measured yet" if (opt, "ef") in factors.arms(factors.OPTIMIZERS_CELL) else "- (no EF arm)"


def answer_table(rows, cells) -> list[str]:
    """One row per cell: both gaps, their ratio on validation and on the test split, EF's shares (the
    front page's compact form of :func:`cell_table`)."""
    body = []
    for cell in cells:
        val, test = cell_estimates(rows, cell), cell_estimates(rows, cell, lambda r: r.get("test_val"))
        if val is None:
            continue
        a, m = val["opts"].get("adamw", {}), val["opts"].get("muon", {})
        seeds = sorted({e["gap"].n for o, e in val["opts"].items() if o in factors.OPTIMIZERS})
        body.append((cell, _est(a.get("gap")), _est(m.get("gap")), ratio_text(val), ratio_text(test),
                     _share(a.get("share")), _share(m.get("share")), "/".join(map(str, seeds))))
    if not body:
        return []
    return md_table(["cell", "AdamW gap", "Muon gap", f"{RATIO_LABEL} (val)", f"{RATIO_LABEL} (test split)",
                     "EF share, AdamW", "EF share, Muon", "seeds"], body) + [""]


def _measured(rows, axis, opt: str) -> list[tuple[str, float]]:
    """The axis's ``(cell, log2 factor)`` whose sync and 2bw arms of ``opt`` are measured."""
    names = arms_by_cell(rows)
    return [(cell, math.log2(x)) for cell, x in axis if (cell, opt, "sync") in names and (cell, opt, "2bw") in names]


def _gap_contrast(rows, cells, weights, opt: str, value) -> stats.Estimate:
    """``sum_i w_i G_i`` over ``cells``' gaps of ``opt`` (a contrast of their arms, paired by seed)."""
    names = arms_by_cell(rows)
    coefs: dict = collections.defaultdict(float)
    for cell, w in zip(cells, weights):
        coefs[names[(cell, opt, "2bw")]] += w
        coefs[names[(cell, opt, "sync")]] -= w
    return stats.contrast(stats.arms_of(rows, value), dict(coefs))


def gap_slope(rows, axis, opt: str, value=lambda r: r.get("final_val")) -> stats.Estimate | None:
    """Least-squares slope of ``opt``'s gap against log2 of the axis's factor over its measured cells."""
    pts = _measured(rows, axis, opt)
    if len(pts) < 2:
        return None
    return _gap_contrast(rows, [c for c, _ in pts], stats.slope_weights([x for _, x in pts]), opt, value)


def gap_intervals(rows, axis, opt: str, value=lambda r: r.get("final_val")) -> list[tuple[str, str, stats.Estimate]]:
    """``opt``'s gap change per doubling between each pair of neighbouring measured cells of the axis."""
    pts = _measured(rows, axis, opt)
    return [(c0, c1, _gap_contrast(rows, [c0, c1], [-1 / (x1 - x0), 1 / (x1 - x0)], opt, value))
            for (c0, x0), (c1, x1) in zip(pts, pts[1:])]


def gap_bend(rows, axis, opt: str, value=lambda r: r.get("final_val")) -> stats.Estimate | None:
    """The straight line's lack of fit over three or more measured cells (:func:`experiments.stats.bend_weights`:
    at three equally spaced cells, the second interval's change per doubling minus the first's)."""
    pts = _measured(rows, axis, opt)
    w = stats.bend_weights([x for _, x in pts])
    return None if w is None else _gap_contrast(rows, [c for c, _ in pts], w, opt, value)


def gap_change(rows, base: str, changed: str, opt: str, value=lambda r: r.get("final_val")) -> stats.Estimate | None:
    """``opt``'s gap in cell ``changed`` minus its gap in cell ``base``: a linear contrast of the four
    arms, paired by seed as :func:`gap_slope` is."""
    names = arms_by_cell(rows)
    keys = [(c, opt, a) for c in (base, changed) for a in ("sync", "2bw")]
    if not all(k in names for k in keys):
        return None
    coefs = {names[(changed, opt, "2bw")]: 1.0, names[(changed, opt, "sync")]: -1.0,
             names[(base, opt, "2bw")]: -1.0, names[(base, opt, "sync")]: 1.0}
    return stats.contrast(stats.arms_of(rows, value), coefs)


def ratio_change(rows, axis) -> tuple[stats.Estimate, str, str] | None:
    """The ratio's change per doubling between the axis's first and last measured cells whose ratio
    is resolved: ``(q_last - q_first) / doublings``, SE from the two delta-method SEs."""
    got = []
    for cell, x in axis:
        e = cell_estimates(rows, cell)
        if e and e.get("ratio") and e["ratio"].resolved and e["ratio_se"] is not None:
            got.append((cell, x, e["ratio_se"]))
    if len(got) < 2:
        return None
    (c0, x0, q0), (c1, x1, q1) = got[0], got[-1]
    d = math.log2(x1 / x0)
    n = min(q0.n, q1.n)
    return stats.Estimate((q1.value - q0.value) / d, math.hypot(q0.se, q1.se) / d, False, n), c0, c1


def _direction(e: stats.Estimate | None, up: str, down: str) -> str:
    return "not measured" if e is None else stats.direction(e, up, down, "no change beyond t SE", "not measured")


def axis_table(rows) -> tuple[list[str], list[str]]:
    """The per-doubling table and the conclusion's sentences."""
    body, said = [], []
    for label, axis in AXES.items():
        slopes = {opt: gap_slope(rows, axis, opt) for opt in ("adamw", "muon")}
        rc = ratio_change(rows, axis)
        if not any(slopes.values()) and rc is None:
            continue
        cells = [c for c, _ in axis if cell_estimates(rows, c)]
        body.append((label, ", ".join(cells), _est(slopes["adamw"]), _est(slopes["muon"]),
                     "-" if rc is None else f"{rc[0].value:+.2f} ± {rc[0].se:.2f} ({rc[1]} -> {rc[2]})",
                     _direction(rc[0] if rc else None, "toward the paper's", "away from the paper's")))
        for opt in factors.OPTIMIZERS:
            steps, bend = gap_intervals(rows, axis, opt), gap_bend(rows, axis, opt)
            if bend is not None:
                said.append(f"{label}: {OPT_NAMES[opt]}'s gap changes per doubling by "
                            + ", then ".join(f"{_est(e)} ({c0} -> {c1})" for c0, c1, e in steps)
                            + f"; lack of fit {_est(bend)} ("
                            + stats.direction(bend, "the line bends", "the line bends", "a straight line within t SE",
                                              "one seed") + ").")
        if rc is not None:
            verdict = _direction(rc[0], "moves it toward", "moves it away from")
            said.append(f"{label}: the ratio changes by {rc[0].value:+.2f} ± {rc[0].se:.2f} per doubling "
                        f"({rc[1]} -> {rc[2]}); this axis " + (f"{verdict} the paper's {paper.gap_ratio():.0f}"
                                                              if verdict.startswith("moves") else
                                                              "does not move it beyond t SE") + ".")
    lines = []
    if body:
        lines += md_table(["axis", "cells measured", "AdamW's gap per doubling", "Muon's gap per doubling",
                           f"{RATIO_LABEL} per doubling", "the ratio moves"], body) + [""]
    for label, (base, changed) in PAIRS.items():
        a, b = cell_estimates(rows, base), cell_estimates(rows, changed)
        if a and b and a.get("ratio_se") and b.get("ratio_se"):
            d = stats.Estimate(b["ratio_se"].value - a["ratio_se"].value, math.hypot(a["ratio_se"].se, b["ratio_se"].se),
                               False, min(a["ratio_se"].n, b["ratio_se"].n))
            moves = "; ".join(f"{OPT_NAMES[o]}'s gap by {_est(g)} ({_direction(g, 'grows', 'shrinks')})"
                              for o in factors.OPTIMIZERS if (g := gap_change(rows, base, changed, o)) is not None)
            said.append(f"{label}: the ratio changes by {d.value:+.2f} ± {d.se:.2f} "
                        f"({_direction(d, 'toward the paper', 'away from the paper')}); {moves}.")
    return lines, said


def conclusion(rows) -> list[str]:
    """Plain sentences from the numbers: which factor moves the ratio toward the paper's, or none."""
    _, said = axis_table(rows)
    if not said:
        return ["No axis has two cells with a resolved ratio yet, so the screen does not yet say which "
                "factor moves AdamW's gap relative to Muon's."]
    moving = [s for s in said if "moves it toward" in s]
    head = ("At these sizes, " + ("these factors move the ratio toward the paper's: " + " ".join(moving)
                                  if moving else "no factor measured so far moves the ratio toward the paper's "
                                  f"{paper.gap_ratio():.0f} beyond t standard errors."))
    return [head, ""] + [f"- {s}" for s in said]


def headline(rows) -> str:
    """The first line of :func:`conclusion`: which factor moves the ratio, or none."""
    return conclusion(rows)[0]


def _arm_seeds(rows) -> dict:
    """``{(cell, optimizer, arm): the seeds measured}``."""
    seeds = collections.defaultdict(set)
    for r in rows:
        seeds[tuple(r["variant"].split("/")[i] for i in (0, 1, 3))].add(r["seed"])
    return seeds


def _measured_fully(seeds: dict, cell: str, opts) -> bool:
    """Whether every arm of ``opts`` in ``cell`` has the protocol's measurement seeds (``seeds`` from
    :func:`_arm_seeds`)."""
    full = len(protocol.MEASURE_SEEDS)
    return all(len(seeds.get((cell, o, a), ())) >= full for o, a in factors.arms(cell) if o in opts)


def cell_states(tune_rows, rows) -> dict[str, str]:
    """Each cell's state in the screen, from the rows: "measured" (every AdamW and Muon arm at the
    protocol's measurement seeds), "measuring", "tuning", "queued" (nothing run yet) or "cut"
    (:data:`factors.CUT`, nothing run)."""
    seeds = _arm_seeds(rows)
    started = {r["variant"].split("/")[0] for r in rows}
    tuned = {r["variant"].split("/")[0] for r in tune_rows}

    def state(c: str) -> str:
        if c in started:
            return "measured" if _measured_fully(seeds, c, factors.OPTIMIZERS) else "measuring"
        return "tuning" if c in tuned else "cut" if c in factors.CUT else "queued"

    return {c: state(c) for c in factors.ORDER}


def progress(tune_rows, rows) -> str:
    """Which cells are measured, being measured, tuning, not started and cut (:func:`cell_states`;
    the cut cells' costs are the pilot's table in docs/studies.md)."""
    states, seeds, full = cell_states(tune_rows, rows), _arm_seeds(rows), len(protocol.MEASURE_SEEDS)
    home = factors.OPTIMIZERS_CELL
    more = [(o, _measured_fully(seeds, home, (o,)))
            for o in factors.optimizers_of(home) if o not in factors.OPTIMIZERS]

    def named(state: str) -> str:
        return ", ".join(c for c, s in states.items() if s == state) or "none"

    return (f"{len(tune_rows)} tuning runs (seeds {sorted({r['seed'] for r in tune_rows})}) and {len(rows)} "
            f"measured runs (seeds {sorted({r['seed'] for r in rows})}) committed. Cells measured (every arm at "
            f"{full} seeds or more): {named('measured')}; measuring: {named('measuring')}; "
            f"tuning: {named('tuning')}; not started (the "
            f"queue runs in this order, width first): {named('queued')}; cut to fit the screen's "
            f"budget of about {factors.SCREEN_HOURS} hours on 2 cores: {named('cut')}. {home}'s "
            f"other optimizers (run after every cell's contrast), measured: "
            f"{', '.join(o for o, ok in more if ok) or 'none'}; not yet: {', '.join(o for o, ok in more if not ok) or 'none'}.")


def protocol_rows(rows, cell: str = factors.OPTIMIZERS_CELL) -> list[dict]:
    """``cell``'s measured rows of every optimizer whose arms all have the protocol's measurement
    seeds, each renamed ``OPTIMIZER/ARM`` (the ``optimizers`` study's variants; the screen measures
    one pick per arm), so that analyses written for that study read the protocol's rows unchanged."""
    seeds = _arm_seeds(rows)
    done = {o for o in factors.optimizers_of(cell) if _measured_fully(seeds, cell, (o,))}
    out = []
    for r in rows:
        c, opt, _, arm = r["variant"].split("/")
        if c == cell and opt in done:
            out.append({**r, "variant": f"{opt}/{arm}"})
    return out


UPDATES_AXIS = "updates on the same tokens"


def protocol_claims(rows, out, claims: dict) -> list[str]:
    """The paper's claims that the protocol's rows test, recorded under the same names as the earlier
    studies' (each arm tuned on a seed it was then measured on), so that these rows decide them: EF's
    share, AdamW's gap against Muon's and the gap over training from :data:`factors.OPTIMIZERS_CELL`,
    and "more, smaller updates shrink the gap" from the updates axis once all its cells are measured.
    Returns the gap-over-training section of those rows."""
    cell = factors.OPTIMIZERS_CELL
    where = f"`{MEASURE}` {cell} (protocol)"
    renamed = protocol_rows(rows, cell)
    arms = stats.arms_of(renamed)
    opts = [o for o in factors.optimizers_of(cell) if f"{o}/sync" in arms]
    for opt in opts:
        if f"{opt}/ef" in arms:
            analysis.ef_claim(claims, arms, opt, f"{opt}/ef", f"{opt}/2bw", f"{opt}/sync", where)
    analysis.far_larger_claim(claims, arms, where)
    labels = {o: f"{cell} {o} 2bw" for o in opts}
    lines = analysis.analyse_gap_over_time(MEASURE, renamed, [(labels[o], f"{o}/2bw", f"{o}/sync") for o in opts],
                                           out, claims, {o: labels[o] for o in factors.OPTIMIZERS if o in labels},
                                           prefer=True)
    axis = AXES[UPDATES_AXIS]
    for opt in factors.OPTIMIZERS:
        pts = _measured(rows, axis, opt)
        s = gap_slope(rows, axis, opt)
        if len(pts) < len(axis) or s is None or s.n < 2:
            continue
        steps, factor = gap_intervals(rows, axis, opt), dict(axis)
        claim(claims, f"More, smaller updates on the same tokens shrink the delay gap ({opt})",
              stats.verdict(stats.Estimate(-s.value, s.se, s.paired, s.n)),
              "least-squares slope b of the gap against log2(updates) over the rungs, each arm at its own pick: "
              "reproduced if b + t SE < 0, not reproduced if b - t SE > 0",
              f"`{MEASURE}` (protocol), rungs {', '.join(f'{x:,}' for _, x in axis)} updates: b = {_est(s, 4)} per "
              f"doubling ({se_kind(s)}); per interval "
              + ", ".join(f"{factor[c0]:,}->{factor[c1]:,}: {_est(e, 4)}" for c0, c1, e in steps),
              "a smaller batch shrinks the gap (reported, no figure)")
    return lines


def grid_table(tune_rows) -> list[str]:
    """Each arm's grid so far: mean final val over the cell's tuning seeds per learning rate (done
    points only), the pick in bold once the grid has bracketed it (:func:`experiments.protocol.tune_state`)."""

    body = []
    for cell in factors.ORDER:
        for opt, arm in factors.arms(cell):
            means = factors.tune_means(tune_rows, cell, opt, arm, factors.CELLS[cell][1])
            if not means:
                continue
            grid, pick = factors.tuning_state(cell, opt, arm, tune_rows)
            cells = [(f"**{lr:g}: {m:.3f}**" if lr == pick else f"{lr:g}: {m:.3f}") if m is not None
                     else f"{lr:g}: diverged" for lr, m in sorted(means.items())]
            state = ("pending: " + ", ".join(f"{lr:g}" for lr in grid if lr not in means) if pick is None
                     else "on the grid's edge (a bound)" if protocol.on_edge(grid, pick) else "bracketed")
            body.append((cell, opt, arm, ", ".join(cells), state))
    if not body:
        return []
    return ["### Each arm's learning-rate grid", "",
            "Mean final validation loss (nats/byte) over the cell's tuning seeds at each learning rate run at "
            "every one of them; the pick in bold once the grid brackets it (a grid grows past an edge that "
            "holds the best point).", ""] + md_table(["cell", "optimizer", "arm", "lr: final val", "pick"], body) + [""]


def analyse(tune_rows, rows, out, claims) -> list[str]:

    lines = ["## The factor screen: what makes the gap large?", "", progress(tune_rows, rows), ""]
    if tune_rows:
        lines += grid_table(tune_rows)
    lines += ["### The gap per cell", "",
              "Each arm at its own pick from the tuning seeds, measured on other seeds. Gap = 2bw - sync in "
              "nats/byte on the 256 validation windows and on the test split (512 other windows, never used to "
              "pick); " + SHARE_NOTE + f" {RATIO_LABEL}: the point and its 90% Fieller interval "
              "(none where Muon's gap is unresolved).", ""]
    lines += cell_table(rows, factors.ORDER)
    lines += [f"### Every optimizer under the protocol ({factors.OPTIMIZERS_CELL})", "",
              f"The `{factors.OPTIMIZERS_CELL}` cell is the `cpu_regime` run of the `optimizers` study; it also holds "
              + ", ".join(OPT_NAMES[o] for o in factors.MORE_OPTIMIZERS) + " (EF only for the optimizers of the "
              "paper's Table 2). Gaps in nats/byte, the paper's in nats/token of its tokenizer: compare signs, "
              "ratios and shares, not sizes.", ""] + optimizers_table(rows)
    table, _ = axis_table(rows)
    lines += ["### Along each axis", ""] + table + conclusion(rows) + [""]
    return lines + protocol_claims(rows, out, claims)


def section(name: str, studies: dict[str, list[dict]], out, claims: dict) -> list[str]:
    """The report's one section for both studies: under ``factors`` when its rows are given (the
    tuning rows beside them), else under ``factors_tune`` alone."""
    if name == TUNE and MEASURE in studies:
        return []
    return analyse(studies.get(TUNE, []), studies.get(MEASURE, []), out, claims)
