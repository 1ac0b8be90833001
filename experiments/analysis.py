"""Analysis shared by the studies' own report sections (each study module's ``analyse``): the
thresholds that turn the paper's words into tests, the delay gap over training, EF's share and its
claim, and the delay-gap table of the optimizer studies.  Imports no study, so every study can use it."""

from __future__ import annotations

import collections
import math
import pathlib

import numpy as np

from experiments import paper, picks, stats
from experiments.report_format import SHARE_NOTE, claim, est, md_table, plt_module, se_kind, share_text

# Thresholds that turn the paper's words into a test, stated in the report.
FAR_LARGER = 2.0  # "AdamW's gap is far larger than Muon's": at least this ratio
LARGE_PART = 0.5  # "EF recovers a large part of the gap": at least this fraction
# "The gap does not grow with training": its growth from the midpoint to the last evaluation is
# shown to stay under this fraction of the midpoint gap.
GROWTH_MARGIN = 0.1


def diverged(rows) -> collections.Counter:
    """Runs per variant without a final loss (status ``diverged``)."""
    return collections.Counter(r["variant"] for r in rows if r.get("final_val") is None)


def both(verdicts: list[str]) -> str:
    """All parts shown: reproduced; any part contradicted: not reproduced; else inconclusive."""
    if all(v == stats.REPRODUCED for v in verdicts):
        return stats.REPRODUCED
    if any(v == stats.NOT_REPRODUCED for v in verdicts):
        return stats.NOT_REPRODUCED
    return stats.INCONCLUSIVE


def curve_of(row) -> dict[int, float]:
    return {int(s): float(v) for s, v in row.get("val_curve") or [] if v is not None and math.isfinite(v)}


def tokens_per_update(row) -> int | None:
    """``global_batch_size x seq_len`` from the row's saved config; None if it was not saved."""
    c = row.get("config") or {}
    b, t = (c.get("train") or {}).get("global_batch_size"), (c.get("data") or {}).get("seq_len")
    return int(b) * int(t) if isinstance(b, int) and isinstance(t, int) else None


def gap_curve(rows, delayed: str, sync: str):
    """The gap ``delayed - sync`` at every evaluation both arms' runs share, and its change from the
    midpoint evaluation (the first at or after half the last) to the last one.

    Returns ``(points, change, mid_step, last_step, tokens_per_update)`` with ``points`` a list of
    ``(step, Estimate)``, or None with fewer than two shared evaluations.  The change is the contrast
    of the per-run changes ``v(last) - v(mid)``, so it is paired over seeds when the seeds pair.
    """
    runs = [r for r in rows if r["variant"] in (delayed, sync) and r.get("final_val") is not None]
    if not {r["variant"] for r in runs} == {delayed, sync}:
        return None
    curves = [(r, curve_of(r)) for r in runs]
    steps = sorted(set.intersection(*(set(c) for _, c in curves)))
    if len(steps) < 2:
        return None
    points = []
    for step in steps:
        arms = stats.arms_of([r for r, _ in curves], value=lambda r, s=step: curve_of(r)[s])
        points.append((step, stats.gap(arms, delayed, sync)))
    last = steps[-1]
    mid = next(s for s in steps if s >= last / 2)
    if mid == last:
        mid = steps[-2]
    change_arms = stats.arms_of([r for r, _ in curves], value=lambda r: curve_of(r)[last] - curve_of(r)[mid])
    tokens = {tokens_per_update(r) for r in runs}
    return points, stats.gap(change_arms, delayed, sync), mid, last, (tokens.pop() if len(tokens) == 1 else None)


def trend(change: stats.Estimate) -> str:
    """grows / shrinks / stays, by the change of the gap against t standard errors (:func:`stats.t_critical`)."""
    return stats.direction(change, "grows", "shrinks", "stays (within noise)", "unknown (one seed: no standard error)")


def analyse_gap_over_time(name: str, rows, pairs, out: pathlib.Path, claims: dict, headline: dict,
                          prefer: bool) -> list[str]:
    """Plot and table of the gap over training tokens for ``pairs`` = ``[(label, delayed, sync)]``;
    ``headline`` maps an optimizer to its plain-delay label, whose curve tests "the gap does not grow"."""
    series, table, lines = {}, [], []
    unit = "tokens"
    for label, delayed, sync in pairs:
        got = gap_curve(rows, delayed, sync)
        if got is None:
            continue
        points, change, mid, last, per_update = got
        if per_update is None:
            unit = "update"
        series[label] = (points, per_update)
        g_mid = dict(points)[mid]
        g_last = dict(points)[last]
        table.append((label, f"{mid} / {last}", str(g_mid), str(g_last), str(change), trend(change)))
        opt = next((o for o, lab in headline.items() if lab == label), None)
        if opt is not None and change.n >= 2:
            margin, t = GROWTH_MARGIN * max(g_mid.value, 0.0), stats.t_critical(change.n)
            if change.value - t * change.se > 0:
                verdict = stats.NOT_REPRODUCED
            elif change.value + t * change.se < margin:
                verdict = stats.REPRODUCED
            else:
                verdict = stats.INCONCLUSIVE
            key = f"The delay gap does not grow with training ({opt})"
            if prefer or key not in claims:
                claim(claims, key, verdict,
                       f"change c of the gap from the midpoint to the last evaluation: reproduced if c + t SE < "
                       f"{GROWTH_MARGIN:.0%} of the midpoint gap, not reproduced if c - t SE > 0",
                       f"`{name}`, {label}: gap {g_mid} at update {mid} -> {g_last} at update {last}; "
                       f"c = {change}", "the gap stays flat over training (reported, no figure)")
    if not series:
        return lines
    lines += ["### The delay gap over training", "",
              "Gap (async minus sync) at each evaluation, ± 1 SE over seeds (paired when the seeds pair). "
              "Test of the trend: the change c of the gap from the midpoint evaluation (the first at or after "
              "half the run) to the last: grows if c > t SE, shrinks if c < -t SE, else stays (within noise); t is "
              "the one-sided 5% point of Student's t at n - 1 degrees of freedom (2.92 at n = 3).", ""]
    lines += md_table(["arms", "evaluations (mid / last)", "gap at mid", "gap at last", "change c", "trend"], table)
    lines += ["", f"![gap over training]({plot_bands(series, out / f'{name}_gap_over_time.png', unit)})", ""]
    return lines


def plot_bands(series: dict, out: pathlib.Path, unit: str) -> str:
    """Gap vs training tokens (or updates, if a run did not save its batch shape), mean ± 1 SE band."""
    plt = plt_module()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, (points, per_update) in sorted(series.items()):
        scale = per_update if unit == "tokens" else 1
        xs = np.array([s * scale for s, _ in points], float)
        ys = np.array([e.value for _, e in points])
        es = np.array([e.se for _, e in points])
        line, = ax.plot(xs, ys, "-" if label.endswith(("2bw", "none")) else "--", marker=".", label=label)
        ax.fill_between(xs, ys - es, ys + es, color=line.get_color(), alpha=0.2)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set(xlabel="training tokens" if unit == "tokens" else "update", ylabel="delay gap (nats/byte)",
           title="delay gap over training (± 1 SE)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out.name


def lr_names(rows) -> dict:
    """Variant names of ``OPT/lr=VALUE/ARM`` rows by (optimizer, lr, arm); the lr is the one each run trained with."""
    names = {}
    for r in rows:
        parsed = picks.parse(r["variant"])
        if parsed:
            names[(parsed[0], picks.lr_of_row(r), parsed[2])] = r["variant"]
    return names


def ef_shares(arms, prefixes, claims) -> list[str]:
    """EF's share of each optimizer's gap where the study ran ``OPT/ef`` (the optimizers study at
    cpu_regime), with the paper's Table 2 beside it and its claim."""
    body = []
    for p in prefixes:
        f = stats.share(arms, f"{p}/ef", f"{p}/2bw", f"{p}/sync")
        if f is None:
            continue
        g_ef = stats.gap(arms, f"{p}/ef", f"{p}/sync")
        body.append((p, est(g_ef), share_text(f), paper.ef_share(p), se_kind(g_ef)))
        ef_claim(claims, arms, p, f"{p}/ef", f"{p}/2bw", f"{p}/sync", "`optimizers`")
    if not body:
        return []
    return [SHARE_NOTE, ""] + \
        md_table(["optimizer", "EF gap 2bw+EF - sync", "EF's share [90% interval]", "the paper", "standard errors"],
                 body) + [""]


def ef_claim(claims: dict, arms, opt: str, ef: str, none: str, sync: str, where: str) -> None:
    """"EF recovers a large part of the gap": the linear test of c = G_EF - (1 - LARGE_PART) G, and no
    verdict but inconclusive where the gap G itself is not resolved."""
    f = stats.share(arms, ef, none, sync)
    c = stats.share_at_least(arms, ef, none, sync, LARGE_PART)
    if f is None or c is None:
        return
    verdict = stats.verdict(stats.Estimate(-c.value, c.se, c.paired, c.n)) if f.resolved else stats.INCONCLUSIVE
    claim(claims, f"Error feedback recovers a large part of the gap ({opt})", verdict,
          f"c = G_EF - {1 - LARGE_PART:g} G (EF's share s >= {LARGE_PART:.0%} iff c < 0): reproduced if c + t SE < 0, "
          "not reproduced if c - t SE > 0; inconclusive where the gap G is not resolved",
          f"{where}: c = {c} ({se_kind(c)}); s = {share_text(f)}", f"{paper.ef_share(opt)} (Table 2)")


def far_larger_claim(claims: dict, arms, where: str) -> None:
    """"AdamW's delay gap is far larger than Muon's": the linear test of d = G_AdamW - FAR_LARGER G_Muon
    over arms named ``adamw/sync``, ``adamw/2bw``, ``muon/sync``, ``muon/2bw``, with the ratio's
    Fieller interval beside it; nothing where an arm is missing."""
    g_a, g_m = stats.gap(arms, "adamw/2bw", "adamw/sync"), stats.gap(arms, "muon/2bw", "muon/sync")
    if g_a is None or g_m is None:
        return
    d = stats.contrast(arms, {"adamw/2bw": 1.0, "adamw/sync": -1.0, "muon/2bw": -FAR_LARGER, "muon/sync": FAR_LARGER})
    verdict = stats.verdict(d)
    if verdict == stats.REPRODUCED and g_a.value <= 0:
        verdict = stats.INCONCLUSIVE  # "far larger" than a gap that helps says nothing of the delay's harm
    q = stats.fieller(arms, {"adamw/2bw": 1.0, "adamw/sync": -1.0}, {"muon/2bw": 1.0, "muon/sync": -1.0})
    claim(claims, "AdamW's delay gap is far larger than Muon's", verdict,
          f"d = G_AdamW - {FAR_LARGER:g} G_Muon: reproduced if d > t SE, not reproduced if d < -t SE",
          f"{where}: G_AdamW {g_a}, G_Muon {g_m}; d = {d} ({se_kind(d)}); G_AdamW / G_Muon = "
          f"{q.text() if q else '-'} (90% Fieller interval)",
          f"G_AdamW {paper.gap('adamw')}, G_Muon {paper.gap('muon')}: {paper.gap_ratio():.0f}x (Table 1)")


def delay_gaps(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    lines: list[str] = []
    prefixes = sorted({v.rsplit("/", 1)[0] for v in arms})
    gaps = {p: stats.gap(arms, f"{p}/2bw", f"{p}/sync") for p in prefixes}
    lines += md_table(["setting", "delay gap 2bw - sync", "standard error"],
                    [(p, est(g), se_kind(g)) for p, g in gaps.items()]) + [""]
    if name == "optimizers":
        lines += ef_shares(arms, prefixes, claims)
        far_larger_claim(claims, arms, "`optimizers`")
        pairs = [(f"{opt} 2bw", f"{opt}/2bw", f"{opt}/sync") for opt in ("adamw", "muon")]
        lines += analyse_gap_over_time(name, rows, pairs, out, claims,
                                       {"adamw": "adamw 2bw", "muon": "muon 2bw"}, prefer=True)
    return lines
