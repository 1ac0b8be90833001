"""The updates ladder's sections of the study report (``ladder_tune`` and ``ladder`` studies).

Every arm is tuned on the same grid (the paper's protocol), so each delay gap is given both ways:

- best against best: ``G* = L(2bw at its pick) - L(sync at its pick)``;
- at the sync-tuned learning rate: ``G_s = L(2bw at sync's pick) - L(sync at its pick)``;

and error feedback's share the same two ways, ``f = 1 - (L_ef - L_sync) / (L_2bw - L_sync)``.  The
picks come from the ``ladder_tune`` rows (one seed; :func:`experiments.picks.pick_arm_lrs`); the
``ladder`` rows measure them at three seeds.  The trend over the ladder is the least-squares slope
of the gap against ``log2(updates)``, a linear contrast of the arms' means (paired over seeds where
they share them), tested by a one-sided t test at n - 1 degrees of freedom, beside the change per
interval between neighbouring rungs and the line's lack of fit; the paper's figure stands beside each row.
"""

from __future__ import annotations

import collections
import math
import pathlib
import re


from experiments import paper, picks, stats
from experiments.analysis import diverged
from experiments.report_format import SHARE_NOTE, claim, figure, md_table, se_kind, share_text  # noqa: F401
from experiments.report_format import est as _est_with_se
from experiments.studies.ladder_tune import EXTRA_RUNGS, RUNGS

VARIANT = re.compile(r"^u=(?P<updates>\d+)/(?P<opt>\w+)/lr=(?P<lr>[^/]+)/(?P<arm>\w+)$")
ARMS = ("sync", "2bw", "ef")
AT_SYNC = "@sync_lr"  # experiments.studies.tuned.AT_SYNC: a delayed variant run at its sync arm's pick


def _names(rows) -> dict[tuple[int, str, str, float], str]:
    """(updates, optimizer, arm, lr) -> variant name."""
    out = {}
    for r in rows:
        m = VARIANT.match(r["variant"])
        if m:
            out[(int(m["updates"]), m["opt"], m["arm"], float(m["lr"]))] = r["variant"]
    return out


def est(e: stats.Estimate | None, pct: bool = False) -> str:
    """An estimate with its standard error, or alone from one seed (which has none, not a zero one)."""
    if e is not None and e.n < 2:
        return f"{e.value:.0%}" if pct else f"{e.value:+.4f}"
    return _est_with_se(e, pct)


def grid_table(rows, study: str = "ladder_tune") -> list[str]:
    """Final val per learning rate for each setting and arm of a tuning study (``ladder_tune``,
    ``STUDY_tune``), picks in bold."""
    means = picks.arm_means(rows, study)
    chosen = picks.pick_arm_lrs(rows, study)
    body = []
    for (prefix, arm), by_lr in sorted(means.items(), key=lambda kv: (_rung_key(kv[0][0]), ARMS.index(kv[0][1])
                                                                      if kv[0][1] in ARMS else 9)):
        cells = []
        for lr, m in sorted(by_lr.items()):
            text = "diverged" if m is None else f"{m:.3f}"
            cells.append(f"**{lr:g}: {text}**" if chosen.get(prefix, {}).get(arm) == lr else f"{lr:g}: {text}")
        body.append((prefix, arm, ", ".join(cells)))
    edges = picks.on_grid_edge(rows, study)
    lines = ["### Each arm's learning-rate grid", "",
             "Final validation loss (nats/byte, mean over the tuning seeds) at each learning rate; the pick "
             "(lowest, no seed diverged) in bold.", ""]
    lines += md_table(["setting", "arm", "lr: final val"], body) + [""]
    if edges:
        lines += [f"Picked on the grid's edge (the optimum may lie beyond it): {', '.join(edges)}.", ""]
    return lines


def _rung_key(prefix: str) -> tuple:
    m = re.match(r"u=(\d+)/(\w+)$", prefix)
    return (int(m[1]), m[2]) if m else (0, prefix)


def at_sync_table(rows, sync_of) -> list[str]:
    """The gap of each delayed variant run at its sync arm's pick (``VARIANT@sync_lr``) beside the
    gap at its own pick (best against best); ``sync_of(variant)`` names its synchronous arm."""
    arms = stats.arms_of(rows)
    body = []
    for v in sorted(arms):
        if not v.endswith(AT_SYNC):
            continue
        own, sync = v[: -len(AT_SYNC)], sync_of(v[: -len(AT_SYNC)])
        if sync is None:
            continue
        g_own, g_sync = stats.gap(arms, own, sync), stats.gap(arms, v, sync)
        body.append((own, est(g_own), est(g_sync), se_kind(g_sync)))
    if not body:
        return []
    return ["Each delayed arm at its own pick (best vs best) and at its synchronous arm's pick:", ""] + \
        md_table(["variant", "gap, best vs best", "gap at sync's lr", "standard errors"], body) + [""]


def gaps(rows, picks: dict) -> dict[tuple[int, str], dict]:
    """Per (updates, optimizer): the gap and EF's share both ways, each an Estimate or None."""
    arms = stats.arms_of(rows)
    names = _names(rows)
    out = {}
    for prefix, arm_lrs in picks.items():
        updates, opt = _rung_key(prefix)
        if "sync" not in arm_lrs:
            continue
        sync = names.get((updates, opt, "sync", arm_lrs["sync"]))
        own = {arm: names.get((updates, opt, arm, arm_lrs[arm])) for arm in ("2bw", "ef") if arm in arm_lrs}
        at_sync = {arm: names.get((updates, opt, arm, arm_lrs["sync"])) for arm in ("2bw", "ef")}
        if sync is None:
            continue
        res = {"sync": stats.contrast(arms, {sync: 1.0}), "lrs": arm_lrs,
               "terms": {"best": (sync, own.get("2bw"), own.get("ef")),
                         "at_sync": (sync, at_sync.get("2bw"), at_sync.get("ef"))}}
        for way, (s, d, e) in res["terms"].items():
            res[f"gap_{way}"] = stats.gap(arms, d, s) if d else None
            res[f"ef_gap_{way}"] = stats.gap(arms, e, s) if e else None
            res[f"ef_share_{way}"] = stats.share(arms, e, d, s) if d and e else None
        out[(updates, opt)] = res
    return out


def slope(rows, found: dict, opt: str, way: str = "best") -> stats.Estimate | None:
    """Least-squares slope of ``opt``'s gap against ``log2(updates)`` over the rungs: a linear
    contrast ``sum_i c_i G_i`` with ``c_i = (x_i - mean x) / sum (x - mean x)^2``."""
    rungs, terms = _rung_terms(found, opt, way)
    if len(rungs) < 2:
        return None
    return stats.contrast(stats.arms_of(rows), _gap_contrast(stats.slope_weights([math.log2(u) for u in rungs]), terms))


def analyse(rows, picks: dict, out: pathlib.Path, claims: dict) -> list[str]:
    """Tables, plots and claims of the ladder, each arm at its ``picks`` ({'u=U/OPT': {arm: lr}})."""
    found = gaps(rows, picks)
    if not found:
        return ["No rung has its synchronous arm at the picked learning rate yet.", ""]
    seeds = sorted({r["seed"] for r in rows})
    lines = ["### The delay gap along the ladder", "",
             f"Same model, same 819,200 tokens, the number of updates stepped by the batch; seeds {seeds}. "
             "Gap both ways: best arm against best arm (each at its own pick), and the delayed arms at the "
             "synchronous arm's pick. " + SHARE_NOTE + " The paper's figures (360M, ~10^4 updates) beside "
             "ours.", ""]
    body, gap_series, share_series = [], collections.defaultdict(list), collections.defaultdict(list)
    for (updates, opt), r in sorted(found.items()):
        lrs = r["lrs"]
        batch = {**RUNGS, **EXTRA_RUNGS}.get(updates)
        tokens = f"{updates * batch * 128:,}" if batch else "-"
        body.append((updates, tokens, opt, f"{lrs.get('sync', '-')} / {lrs.get('2bw', '-')} / {lrs.get('ef', '-')}",
                     f"{r['sync'].value:.3f}", est(r["gap_best"]), est(r["gap_at_sync"]),
                     paper.gap(opt), share_text(r["ef_share_best"]),
                     share_text(r["ef_share_at_sync"]), paper.ef_share(opt),
                     se_kind(r["gap_best"])))
        if updates not in RUNGS:
            continue  # the plots follow the same-token rungs
        if r["gap_best"] is not None:
            gap_series[opt].append((updates, r["gap_best"].value, r["gap_best"].se))
        sh = r["ef_share_best"]
        if sh is not None and sh.resolved:  # the bar: half the 90% Fieller interval
            share_series[opt].append((updates, sh.value, (sh.hi - sh.lo) / 2))
    lines += md_table(["updates", "tokens", "optimizer", "lr sync / 2bw / ef", "sync val", "gap, best vs best",
                             "gap at sync's lr", "paper's gap", "EF share, best", "EF share at sync's lr",
                             "paper's EF share", "standard errors"], body) + [""]
    lines += _ratio_rows(rows, found)
    lines += _trend(rows, found, claims)
    lines += _more_tokens(rows, found)
    lines += figure("gap vs updates", gap_series, out / "ladder_gap.png",
                    "updates (same tokens)", "delay gap, best vs best", "delay gap along the ladder", logx=True)
    lines += figure("EF share vs updates", share_series, out / "ladder_ef_share.png",
                    "updates (same tokens)", "fraction of the gap EF recovers", "EF share along the ladder", logx=True)
    return lines


def _ratio_rows(rows, found) -> list[str]:
    """AdamW's gap over Muon's per rung (best vs best), the paper's 23x beside it."""
    arms = stats.arms_of(rows)
    body = []
    for updates in sorted({u for u, _ in found}):
        a, m = found.get((updates, "adamw")), found.get((updates, "muon"))
        if not (a and m and a["gap_best"] and m["gap_best"]):
            continue
        (sa, da, _), (sm, dm, _) = a["terms"]["best"], m["terms"]["best"]
        q = stats.ratio(arms, {da: 1.0, sa: -1.0}, {dm: 1.0, sm: -1.0})
        text = "-" if q is None else f"{q.value:.2f}" + (f" ± {q.se:.2f}" if q.n > 1 else "")
        body.append((updates, text, f"{paper.gap_ratio():.0f}"))
    if not body:
        return []
    return ["AdamW's gap over Muon's (best vs best, delta method):", ""] + \
        md_table(["updates", "G_AdamW / G_Muon", "paper"], body) + [""]


def _more_tokens(rows, found) -> list[str]:
    """Each extra rung (the preset's batch, more tokens) against the same-token rung of that batch:
    the change of the gap from more updates alone, the batch held."""
    body = []
    for extra, batch in EXTRA_RUNGS.items():
        base = next((u for u, b in RUNGS.items() if b == batch), None)
        for opt in sorted({o for _, o in found}):
            a, b = found.get((extra, opt)), found.get((base, opt))
            if not (a and b and a["gap_best"] and b["gap_best"]):
                continue
            (s1, d1, _), (s0, d0, _) = a["terms"]["best"], b["terms"]["best"]
            change = stats.contrast(stats.arms_of(rows), {d1: 1.0, s1: -1.0, d0: -1.0, s0: 1.0})
            body.append((opt, f"{base} -> {extra}", batch, est(b["gap_best"]), est(a["gap_best"]), est(change),
                         se_kind(change)))
    if not body:
        return []
    return ["More updates at the same batch (more tokens): the gap's change, best vs best.", ""] + \
        md_table(["optimizer", "updates", "batch", "gap before", "gap after", "change", "standard errors"], body) + [""]


def _rung_terms(found, opt, way="best"):
    rungs = sorted(u for (u, o), r in found.items() if o == opt and u in RUNGS and r[f"gap_{way}"] is not None)
    return rungs, [found[(u, opt)]["terms"][way][:2] for u in rungs]


def _gap_contrast(weights, terms) -> dict:
    coefs: dict = collections.defaultdict(float)
    for w, (s, d) in zip(weights, terms):
        coefs[d] += w
        coefs[s] -= w
    return dict(coefs)


def intervals(rows, found: dict, opt: str, way: str = "best") -> list[tuple[int, int, stats.Estimate]]:
    """The gap's change per doubling of the updates between each pair of neighbouring rungs:
    ``(G_{i+1} - G_i) / log2(u_{i+1} / u_i)``, a contrast of four arms."""
    rungs, terms = _rung_terms(found, opt, way)
    arms = stats.arms_of(rows)
    out = []
    for i in range(len(rungs) - 1):
        step = math.log2(rungs[i + 1] / rungs[i])
        out.append((rungs[i], rungs[i + 1], stats.contrast(arms, _gap_contrast([-1 / step, 1 / step], terms[i:i + 2]))))
    return out


def lack_of_fit(rows, found: dict, opt: str, way: str = "best") -> stats.Estimate | None:
    """The straight line's lack of fit over three or more rungs: the contrast of the gaps along the
    second orthogonal polynomial in ``log2(updates)`` (its residual direction at three rungs), scaled
    so that it is the difference between the two halves' slopes per doubling at equal spacing."""
    rungs, terms = _rung_terms(found, opt, way)
    w = stats.bend_weights([math.log2(u) for u in rungs])
    return None if w is None else stats.contrast(stats.arms_of(rows), _gap_contrast(w, terms))


def _trend(rows, found, claims) -> list[str]:
    body, steps = [], []
    for opt in sorted({o for _, o in found}):
        s = slope(rows, found, opt)
        if s is None:
            continue
        rungs = sorted(u for (u, o) in found if o == opt and u in RUNGS)
        verdict = stats.direction(s, "grows", "shrinks", "no trend within t SE", "unknown (one seed)")
        bend = lack_of_fit(rows, found, opt)
        body.append((opt, ", ".join(map(str, rungs)), est(s), est(bend), se_kind(s), verdict))
        for lo, hi, e in intervals(rows, found, opt):
            steps.append((opt, f"{lo} -> {hi}", est(e), se_kind(e)))
        key = f"More, smaller updates on the same tokens shrink the delay gap ({opt})"
        if key in claims and s.n < 2:
            continue  # the ladder's seeds judge it, not the tuning seed
        claim(claims, key,
                       stats.verdict(stats.Estimate(-s.value, s.se, s.paired, s.n)),
                       "least-squares slope b of the gap (best vs best) against log2(updates) over the ladder's "
                       "rungs: reproduced if b + t SE < 0, not reproduced if b - t SE > 0",
                       f"rungs {', '.join(map(str, rungs))}: b = {est(s)} per doubling ({se_kind(s)}); per "
                       "interval " + ", ".join(f"{lo}->{hi}: {est(e)}" for lo, hi, e in intervals(rows, found, opt)),
                       "a smaller batch shrinks the gap (reported, no figure)")
    if not body:
        return []
    return ["Trend: the gap's change per doubling of the updates, per interval between neighbouring rungs, "
            "and the least-squares slope over every rung with its lack of fit (the second orthogonal "
            "polynomial's contrast, scaled as the second interval's slope minus the first's: a bent curve "
            "shows there, and the slope alone then hides it). At 200 / 800 / 3,200 updates the slope's weights "
            "are (-1/4, 0, +1/4): it uses the end rungs only, so the per-interval changes say more.", ""] + \
        md_table(["optimizer", "interval (updates)", "change per doubling", "standard error"], steps) + [""] + \
        md_table(["optimizer", "rungs (updates)", "slope per doubling", "lack of fit", "standard error", "trend"],
                 body) + [""]


def section(name: str, studies: dict[str, list[dict]], out: pathlib.Path, claims: dict) -> list[str]:
    """The report's section of ``ladder_tune`` (each arm's grid and the ladder at the picks on the
    tuning seed) or ``ladder`` (the picks at three seeds, from the ``ladder_tune`` rows of the same
    report)."""
    rows = studies[name]
    div = diverged(rows)
    lines = [f"## Study `{name}`", "", f"{len(rows)} runs, seeds {sorted({r['seed'] for r in rows})}"
             + (f"; {sum(div.values())} diverged" if div else "") + ".", ""]
    chosen = picks.pick_arm_lrs(studies.get("ladder_tune", []), "ladder_tune")
    if name == "ladder_tune":
        lines += grid_table(rows)
    elif not chosen:
        return lines + ["The `ladder_tune` rows that picked these learning rates are not in this report; give them "
                        "too, since each gap is taken at the arms' picks.", ""]
    return lines + analyse(rows, chosen, out, claims)
