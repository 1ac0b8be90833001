"""Markdown report with tables and plots from one or more studies' ``results.jsonl``.

    python -m experiments.report runs/studies/optimizers/results.jsonl [...] [--out report_dir]
    python -m experiments.report --check experiments/results/cpu     # regenerate, compare tables

The report directory always receives the rows it was made from, as ``results.jsonl`` beside
``report.md`` (the input lines, verbatim, in order), and ``report.md`` names that file's SHA-256. So a
committed report regenerates from the repository alone; ``--check DIR`` does that into a temporary
directory and compares ``report.md`` exactly (plots are not compared: their bytes depend on
matplotlib's version).

Per study: a table of final validation loss (nats/byte), mean ± sample std over seeds, per variant
(diverged runs counted apart); the study's derived quantities (delay gap ``2bw - sync`` per
optimizer, per momentum, per depth, per setting, per learning rate; every mitigation ranked by the
fraction of the gap it recovers) each ± its standard error, paired over seeds where the arms share
seeds (:mod:`experiments.stats`: a seed fixes both the initial weights and the data order); the
delay gap over training tokens for the headline arms, with the trend test; the ``lr`` study's
table of synchronous loss per learning rate with each optimizer's pick (:mod:`experiments.tuning`);
and plots.  Then a verdict on each of the paper's claims that the given studies can test: exactly
one of "reproduced", "not reproduced", "inconclusive at this scale", with the test (a one-sided t
test at level 5% with n - 1 degrees of freedom, :func:`experiments.stats.verdict`) and the numbers.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import hashlib
import json
import math
import pathlib
import re
import sys
import tempfile

import numpy as np

from experiments import paper, report_factors, report_ladder, stats, tuning
from experiments.report_format import claim, est, md_table, plot_xy, plt_module, se_kind
from experiments.studies import tuned

# Thresholds that turn the paper's words into a test, stated in the report.
FAR_LARGER = 2.0  # "AdamW's gap is far larger than Muon's": at least this ratio
LARGE_PART = 0.5  # "EF recovers a large part of the gap": at least this fraction
# "The gap does not grow with training": its growth from the midpoint to the last evaluation is
# shown to stay under this fraction of the midpoint gap.
GROWTH_MARGIN = 0.1


RESULTS = "results.jsonl"
# The first line of a committed report whose results.jsonl was not kept (it cannot be regenerated).
NOT_REGENERABLE = "> **Not regenerable:**"
_NEEDED = ("study", "variant", "seed", "final_val", "val_curve")


class ReportInputError(ValueError):
    """An input that is not a study's results.jsonl; the message names the file and the fix."""


def read_lines(paths) -> list[str]:
    """The non-empty lines of every input, checked to be study results (``experiments.sweep`` rows)."""
    lines = []
    for path in map(pathlib.Path, paths):
        if not path.is_file():
            raise ReportInputError(f"{path}: no such file. Give the results.jsonl that `python -m "
                                   "experiments.sweep STUDY` writes (runs/studies/STUDY/results.jsonl).")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReportInputError(f"{path}:{n}: not JSON ({e.msg})") from None
            missing = [k for k in _NEEDED if not isinstance(row, dict) or k not in row]
            if missing:
                raise ReportInputError(
                    f"{path}:{n}: not a study result (missing {', '.join(missing)}). Give the results.jsonl "
                    "that `python -m experiments.sweep STUDY` writes, not a run's metrics.jsonl.")
            lines.append(line)
    if not lines:
        raise ReportInputError(f"no study results in {', '.join(map(str, paths))}")
    return lines


def load(paths) -> dict[str, list[dict]]:
    studies = collections.defaultdict(list)
    for line in read_lines(paths):
        row = json.loads(line)
        studies[row["study"]].append(row)
    return dict(studies)


def by_variant(rows) -> dict[str, np.ndarray]:
    out = collections.defaultdict(list)
    for r in rows:
        if r.get("final_val") is not None:
            out[r["variant"]].append(r["final_val"])
    return {k: np.asarray(v, float) for k, v in out.items()}


def diverged(rows) -> collections.Counter:
    """Runs per variant without a final loss (status ``diverged``)."""
    return collections.Counter(r["variant"] for r in rows if r.get("final_val") is None)


def fmt(values: np.ndarray) -> str:
    if len(values) > 1:
        return f"{values.mean():.4f} ± {values.std(ddof=1):.4f}"
    return f"{values.mean():.4f}"


def _both(verdicts: list[str]) -> str:
    """All parts shown: reproduced; any part contradicted: not reproduced; else inconclusive."""
    if all(v == stats.REPRODUCED for v in verdicts):
        return stats.REPRODUCED
    if any(v == stats.NOT_REPRODUCED for v in verdicts):
        return stats.NOT_REPRODUCED
    return stats.INCONCLUSIVE


# ---------------------------------------------------------------------------------------------
# The delay gap over training


def _curve(row) -> dict[int, float]:
    return {int(s): float(v) for s, v in row.get("val_curve") or [] if v is not None and math.isfinite(v)}


def _tokens_per_update(row) -> int | None:
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
    curves = [(r, _curve(r)) for r in runs]
    steps = sorted(set.intersection(*(set(c) for _, c in curves)))
    if len(steps) < 2:
        return None
    points = []
    for step in steps:
        arms = stats.arms_of([r for r, _ in curves], value=lambda r, s=step: _curve(r)[s])
        points.append((step, stats.gap(arms, delayed, sync)))
    last = steps[-1]
    mid = next(s for s in steps if s >= last / 2)
    if mid == last:
        mid = steps[-2]
    change_arms = stats.arms_of([r for r, _ in curves], value=lambda r: _curve(r)[last] - _curve(r)[mid])
    tokens = {_tokens_per_update(r) for r in runs}
    return points, stats.gap(change_arms, delayed, sync), mid, last, (tokens.pop() if len(tokens) == 1 else None)


def trend(change: stats.Estimate) -> str:
    """grows / shrinks / stays, by the change of the gap against t standard errors (:func:`stats.t_critical`)."""
    if change.n < 2:
        return "unknown (one seed: no standard error)"
    t = stats.t_critical(change.n)
    if change.value > t * change.se:
        return "grows"
    if change.value < -t * change.se:
        return "shrinks"
    return "stays (within noise)"


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


# ---------------------------------------------------------------------------------------------
# The learning-rate study


def _lr_names(rows) -> dict:
    """Variant names of ``OPT/lr=VALUE/ARM`` rows by (optimizer, lr, arm); the lr is the one each run trained with."""
    names = {}
    for r in rows:
        parsed = tuning.parse(r["variant"])
        if parsed:
            names[(parsed[0], tuning.lr_of_row(r), parsed[2])] = r["variant"]
    return names


def analyse_lr(rows, out: pathlib.Path, claims: dict) -> list[str]:
    """The ``lr`` study: sync final val per optimizer x lr (the pick marked) and val vs lr."""
    lines = []
    sync = tuning.sync_means(rows)
    picks = tuning.pick_lrs(rows)
    arms = stats.arms_of(rows)
    names = _lr_names(rows)
    div = diverged(rows)

    def cell(opt, lr):
        v = names.get((opt, lr, "sync"))
        if v is None:
            return "", None
        if div.get(v):
            return f"diverged ({div[v]} of {div[v] + len(arms.get(v, []))})", None
        x = np.array([y for _, y in arms[v]])
        e = stats.Estimate(float(x.mean()), math.sqrt(stats.var_of_mean(x)), False, len(x))
        text = f"{e.value:.4f} ± {e.se:.4f}"
        return (f"**{text}** (pick)" if picks.get(opt) == lr else text), e

    table, series = [], {}
    for opt in sorted(sync):
        row = [opt]
        for lr in sorted(lr for (o, lr, arm) in names if o == opt and arm == "sync"):
            text, e = cell(opt, lr)
            row.append(f"{lr:g}: {text}")
            if e is not None:
                series.setdefault(opt, []).append((lr, e.value, e.se))
        table.append(row)
    width = max((len(r) for r in table), default=1) - 1
    table = [r + [""] * (width + 1 - len(r)) for r in table]
    lines += ["### Synchronous final validation loss per learning rate", "",
              "Each cell is `lr: mean ± SE over seeds`, learning rates ascending; the pick (lowest mean; a "
              "learning rate at which any seed diverged is never picked) is what `common.TUNED_LR[preset]` must "
              "hold for this preset (`tests/test_tuning.py` checks it against the committed rows).", ""]
    lines += md_table(["optimizer"] + [f"lr {k + 1}" for k in range(width)], table) + [""]
    lines.append("Picks: " + ", ".join(f"{k} {v:g}" for k, v in sorted(picks.items())) + ".")
    lines.append("")
    if series:
        lines.append(f"![val vs lr]({plot_xy(series, out / 'lr_val.png', 'peak learning rate', 'final val loss (nats/byte)', 'sync loss vs learning rate', logx=True, zero=False)})")
        lines.append("")
    return lines


def analyse_lr_gap(rows, out: pathlib.Path) -> list[str]:
    """The ``lr_gap`` study: AdamW's and Muon's delay gap and EF's recovered fraction at every learning rate."""
    lines = []
    arms = stats.arms_of(rows)
    names = _lr_names(rows)
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
    if gap_series:
        lines.append(f"![gap vs lr]({plot_xy(gap_series, out / 'lr_gap.png', 'peak learning rate', 'delay gap 2bw - sync', 'delay gap vs learning rate', logx=True)})")
        lines.append("")
    if frac_series:
        lines.append(f"![EF recovery vs lr]({plot_xy(frac_series, out / 'lr_ef_recovered.png', 'peak learning rate', 'fraction of the gap EF recovers', 'EF recovery vs learning rate', logx=True)})")
        lines.append("")
    return lines


# ---------------------------------------------------------------------------------------------
# Mitigations


def analyse_mitigations(rows, out: pathlib.Path, claims: dict) -> list[str]:
    """Every mitigation ranked by the fraction of the gap it recovers, per optimizer, ± SE."""
    arms = stats.arms_of(rows)
    series, table, lines = collections.defaultdict(list), [], []
    for opt in sorted({v.split("/")[0] for v in arms}):
        # an arm re-run at sync's pick (``@sync_lr``) is in the table of gaps both ways, not ranked here
        names = sorted({v.split("/", 1)[1] for v in arms if v.startswith(f"{opt}/")
                        and not v.endswith(report_ladder.AT_SYNC)} - {"sync", "none"})
        sync, none = f"{opt}/sync", f"{opt}/none"
        fracs = [(arm, f) for arm in names if (f := stats.recovered(arms, f"{opt}/{arm}", none, sync))]
        if fracs:  # bars in one (alphabetical) arm order for every optimizer; the table is ranked
            series[opt] = [(arm, f.value, f.se) for arm, f in fracs]
        for rank, (arm, f) in enumerate(sorted(fracs, key=lambda x: -x[1].value), start=1):
            # f_arm - f_ef = (ef - arm) / (none - sync)
            vs = stats.ratio(arms, {f"{opt}/ef": 1.0, f"{opt}/{arm}": -1.0}, {none: 1.0, sync: -1.0}) \
                if arm != "ef" else None
            table.append((opt, rank, arm, est(stats.gap(arms, f"{opt}/{arm}", sync)), f.pct(),
                          "-" if vs is None else f"{vs.value:+.0%} ± {vs.se:.0%}", se_kind(f)))
        ef_claim(claims, arms, opt, f"{opt}/ef", none, sync, "`mitigations`")
    lines += md_table(["optimizer", "rank", "mitigation", "gap vs sync", "fraction of the gap recovered",
                     "minus EF's fraction", "standard errors"], table) + [""]
    if series:
        lines.append(f"![recovered]({plot_xy(series, out / 'mitigations_recovered.png', 'mitigation', 'fraction recovered', 'gap recovered', bars=True)})")
        lines.append("")
    pairs = [(f"{opt} {arm}", f"{opt}/{arm}", f"{opt}/sync") for opt in ("adamw", "muon") for arm in ("none", "ef")]
    lines += analyse_gap_over_time("mitigations", rows, pairs, out, claims,
                                   {"adamw": "adamw none", "muon": "muon none"}, prefer=False)
    return lines


BOOKKEEPING = ("train.eval_every", "train.checkpoint_every")  # scaled with a run's length, not causes


def analyse_ef_causes(rows, out: pathlib.Path) -> list[str]:
    """Per suspected cause (one setting changed from the preset): AdamW's delay gap, EF's gap and the
    fraction EF recovers, and that fraction minus the preset's own (``base``), each ± SE."""
    from experiments.studies import ef_causes  # the settings each cause changes, for the table

    arms = stats.arms_of(rows)
    fb = stats.recovered(arms, "adamw/base/ef", "adamw/base/2bw", "adamw/base/sync")
    cases = [(c, f"adamw/{c}/ef", f"adamw/{c}/2bw", f"adamw/{c}/sync",
              ", ".join(f"{k.rsplit('.', 1)[1]}={v}" for k, v in o.items() if k not in BOOKKEEPING) or "the preset")
             for c, o in ef_causes.CAUSES.items()]
    cases += [(f"strength={s:g}", f"adamw/strength={s:g}/ef", "adamw/base/2bw", "adamw/base/sync", f"ef_strength={s:g}")
              for s in ef_causes.STRENGTHS]
    table, series = [], []
    for cause, ef, none, sync, setting in cases:
        f = stats.recovered(arms, ef, none, sync)
        if f is None:
            continue
        series.append((cause, f.value, f.se))
        sync_val = stats.contrast(arms, {sync: 1.0})
        if cause == "base" or fb is None:
            diff, effect = None, "-"
        else:
            # f_cause - f_base = N_base/D_base - N_cause/D_cause, N = ef - sync, D = 2bw - sync
            diff = stats.ratio_difference(
                arms, ({"adamw/base/ef": 1.0, "adamw/base/sync": -1.0}, {"adamw/base/2bw": 1.0, "adamw/base/sync": -1.0}),
                ({ef: 1.0, sync: -1.0}, {none: 1.0, sync: -1.0}))
            t = stats.t_critical(diff.n)
            effect = ("no standard error (one seed)" if diff.n < 2 else "raises it" if diff.value - t * diff.se > 0
                      else "lowers it" if diff.value + t * diff.se < 0 else "no effect within t SE")
        table.append((cause, setting, f"{sync_val.value:.3f}", est(stats.gap(arms, none, sync)),
                      est(stats.gap(arms, ef, sync)), f.pct(),
                      "-" if diff is None else f"{diff.value:+.0%} ± {diff.se:.0%}", effect, se_kind(f)))
    if not table:
        return []
    lines = ["### What error feedback's share of AdamW's gap depends on", "",
             "Each cause changes one setting of the preset (AdamW at its tuned lr) and runs sync, 2bw and "
             "2bw + EF; `strength` changes only the EF arm. EF recovers = 1 - (EF - sync) / (2bw - sync) "
             "(delta method); minus base's = that fraction minus the preset's own, its SE from the "
             "linearised difference (paired over seeds). Raises / lowers it: the difference beyond t SE (one-sided "
             "t test at n - 1 degrees of freedom).", ""]
    lines += md_table(["cause", "setting", "sync val", "delay gap", "EF gap", "EF recovers", "minus base's",
                     "effect", "standard errors"], table) + [""]
    lines.append(f"![EF recovery per cause]({plot_xy({'adamw': series}, out / 'ef_causes_recovered.png', 'cause', 'fraction of the gap EF recovers', 'EF recovery per cause', bars=True)})")
    lines.append("")
    return lines


def plot_curves(rows, out: pathlib.Path, title: str) -> str:
    """Validation curves (mean over seeds) of every variant of one study."""
    plt = plt_module()
    curves = collections.defaultdict(list)
    for r in rows:
        if r["val_curve"] and r.get("final_val") is not None:
            curves[r["variant"]].append(np.asarray(r["val_curve"], float))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # One colour per setting (the variant without its last part), dashed for the synchronous arm.
    settings = sorted({v.rsplit("/", 1)[0] for v in curves})
    cmap = plt.get_cmap("tab20" if len(settings) > 10 else "tab10")
    colours = {k: cmap(i % cmap.N) for i, k in enumerate(settings)}
    for variant, cs in sorted(curves.items()):
        n = min(len(c) for c in cs)
        mean = np.mean([c[:n, 1] for c in cs], axis=0)
        style = "--" if variant.rsplit("/", 1)[-1] == "sync" else "-"
        ax.plot(cs[0][:n, 0], mean, style, color=colours[variant.rsplit("/", 1)[0]], label=variant)
    ax.set(xlabel="update", ylabel="validation loss (nats/byte)", title=title)
    ax.legend(fontsize=6 if len(curves) > 20 else 7, ncol=2 if len(curves) <= 30 else 3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out.name


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


def analyse_ladder(name: str, rows: list[dict], out: pathlib.Path, claims: dict, picks: dict) -> list[str]:
    """``ladder_tune``: each arm's grid and the ladder at the picks on the tuning seed; ``ladder``: the
    picks at three seeds (``picks`` from the ``ladder_tune`` rows given to the same report)."""
    div = diverged(rows)
    lines = [f"## Study `{name}`", "", f"{len(rows)} runs, seeds {sorted({r['seed'] for r in rows})}"
             + (f"; {sum(div.values())} diverged" if div else "") + ".", ""]
    if name == "ladder_tune":
        lines += report_ladder.grid_table(rows)
    elif not picks:
        return lines + ["The `ladder_tune` rows that picked these learning rates are not in this report; give them "
                        "too, since each gap is taken at the arms' picks.", ""]
    return lines + report_ladder.analyse(rows, picks, out, claims)


def _ef_shares(arms, prefixes, claims) -> list[str]:
    """EF's share of each optimizer's gap where the study ran ``OPT/ef`` (the optimizers study at
    cpu_regime), with the paper's Table 2 beside it and its claim."""
    body = []
    for p in prefixes:
        f = stats.share(arms, f"{p}/ef", f"{p}/2bw", f"{p}/sync")
        if f is None:
            continue
        g_ef = stats.gap(arms, f"{p}/ef", f"{p}/sync")
        body.append((p, est(g_ef), report_ladder.share_text(f), paper.ef_share(p), se_kind(g_ef)))
        ef_claim(claims, arms, p, f"{p}/ef", f"{p}/2bw", f"{p}/sync", "`optimizers`")
    if not body:
        return []
    return [report_ladder.SHARE_NOTE, ""] + \
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
          f"{where}: c = {c} ({se_kind(c)}); s = {report_ladder.share_text(f)}", f"{paper.ef_share(opt)} (Table 2)")


def _analyse_optimizers_sensitivity(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    lines: list[str] = []
    prefixes = sorted({v.rsplit("/", 1)[0] for v in arms})
    gaps = {p: stats.gap(arms, f"{p}/2bw", f"{p}/sync") for p in prefixes}
    lines += md_table(["setting", "delay gap 2bw - sync", "standard error"],
                    [(p, est(g), se_kind(g)) for p, g in gaps.items()]) + [""]
    if name == "optimizers":
        lines += _ef_shares(arms, prefixes, claims)
    if name == "optimizers" and gaps.get("adamw") and gaps.get("muon"):
        d = stats.contrast(arms, {"adamw/2bw": 1.0, "adamw/sync": -1.0,
                                  "muon/2bw": -FAR_LARGER, "muon/sync": FAR_LARGER})
        verdict = stats.verdict(d)
        if verdict == stats.REPRODUCED and gaps["adamw"].value <= 0:
            verdict = stats.INCONCLUSIVE  # "far larger" than a gap that helps says nothing of the delay's harm
        q = stats.fieller(arms, {"adamw/2bw": 1.0, "adamw/sync": -1.0}, {"muon/2bw": 1.0, "muon/sync": -1.0})
        claim(claims, "AdamW's delay gap is far larger than Muon's", verdict,
               f"d = G_AdamW - {FAR_LARGER:g} G_Muon: reproduced if d > t SE, not reproduced if d < -t SE",
               f"G_AdamW {gaps['adamw']}, G_Muon {gaps['muon']}; d = {d} ({se_kind(d)}); G_AdamW / G_Muon = "
               f"{q.text() if q else '-'} (90% Fieller interval)",
               f"G_AdamW {paper.gap('adamw')}, G_Muon {paper.gap('muon')}: {paper.gap_ratio():.0f}x (Table 1)")
    if name == "optimizers":
        pairs = [(f"{opt} 2bw", f"{opt}/2bw", f"{opt}/sync") for opt in ("adamw", "muon")]
        lines += analyse_gap_over_time(name, rows, pairs, out, claims,
                                       {"adamw": "adamw 2bw", "muon": "muon 2bw"}, prefer=True)
    return lines


def _analyse_momentum(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
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


def _analyse_lion(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    lines: list[str] = []
    pick = tuning.pick_lion(rows)
    if pick:
        lines += [f"Pick (lowest mean final loss, no seed diverged): "
                  f"{', '.join(f'{k} = {v}' for k, v in pick.items())}.", ""]
    return lines


def _analyse_schemes(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
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
               _both([stats.verdict(deeper), stats.verdict(vs_2bw)]),
               f"d1 = PipeDream(P={p_hi}) - PipeDream(P={p_lo}) and d2 = PipeDream(P={p_hi}) - 2BW: "
               "reproduced if both > t SE, not reproduced if either < -t SE (2BW has one delay at any depth)",
               f"PipeDream gap {' -> '.join(str(g) for _, g, _ in pts)} for P = "
               f"{', '.join(str(p) for p, _, _ in pts)}; 2BW {two}; d1 = {deeper}, d2 = {vs_2bw}",
               "PipeDream's gap grows with P, 2BW's does not (reported, no figure)")
    return lines


# Each study's own analysis, after its variant table and curves: study name -> function(name, rows,
# arms, out, claims) -> report lines (the factor screen's and the ladder's are called from report()).
ANALYSES = {
    "optimizers": _analyse_optimizers_sensitivity,
    "sensitivity": _analyse_optimizers_sensitivity,
    "momentum": _analyse_momentum,
    "mitigations": lambda name, rows, arms, out, claims: analyse_mitigations(rows, out, claims),
    "lr": lambda name, rows, arms, out, claims: analyse_lr(rows, out, claims),
    "lr_gap": lambda name, rows, arms, out, claims: analyse_lr_gap(rows, out),
    "ef_causes": lambda name, rows, arms, out, claims: analyse_ef_causes(rows, out),
    "lion": _analyse_lion,
    "schemes": _analyse_schemes,
}


def analyse(name: str, rows: list[dict], out: pathlib.Path, claims: dict) -> list[str]:
    table = by_variant(rows)
    arms = stats.arms_of(rows)
    div = diverged(rows)
    lines = [f"## Study `{name}`", "", f"{len(rows)} runs, seeds {sorted({r['seed'] for r in rows})}.", ""]
    lines += md_table(["variant", "final val loss (nats/byte)", "runs"],
                    [(v, fmt(table[v]) if v in table else "-",
                      f"{len(table.get(v, []))}" + (f" (+{div[v]} diverged)" if div.get(v) else ""))
                     for v in sorted(set(table) | set(div))]) + [""]
    lines.append(f"![curves]({plot_curves(rows, out / f'{name}_curves.png', name)})")
    lines.append("")

    lines += report_ladder.at_sync_table(rows, lambda v: tuned.sync_of(arms, v))
    analysis = ANALYSES.get(name)
    if analysis is not None:
        lines += analysis(name, rows, arms, out, claims)
    return lines


def report(paths, out: pathlib.Path) -> pathlib.Path:
    """Write ``out/report.md``, its plots, and ``out/results.jsonl`` (the rows it was made from)."""
    out = pathlib.Path(out)
    rows = read_lines(paths)  # before writing: an input may be out/results.jsonl itself
    out.mkdir(parents=True, exist_ok=True)
    data = "\n".join(rows) + "\n"
    (out / RESULTS).write_text(data)
    studies = collections.defaultdict(list)
    for line in rows:
        row = json.loads(line)
        studies[row["study"]].append(row)
    claims: dict[str, tuple[str, str, str]] = {}
    body = []
    ladder_picks = tuning.pick_arm_lrs(studies.get("ladder_tune", []), "ladder_tune")
    for name in sorted(studies):
        if name in ("ladder_tune", "ladder"):
            body += analyse_ladder(name, studies[name], out, claims, ladder_picks)
        elif name in (report_factors.TUNE, report_factors.MEASURE):
            if name == report_factors.MEASURE or report_factors.MEASURE not in studies:
                body += report_factors.analyse(studies.get(report_factors.TUNE, []), studies.get(name, [])
                                               if name == report_factors.MEASURE else [], claims)
        elif name.endswith("_tune"):
            body += [f"## Study `{name}`", "", f"{len(studies[name])} runs, seeds "
                     f"{sorted({r['seed'] for r in studies[name]})}.", ""] + report_ladder.grid_table(studies[name], name)
        else:
            body += analyse(name, studies[name], out, claims)
    digest = hashlib.sha256(data.encode()).hexdigest()[:16]
    lines = ["# Async PP study report", "", f"Made from `{RESULTS}` beside this file ({len(rows)} runs, sha256 "
             f"`{digest}`); regenerate with `python -m experiments.report --check <this directory>`.", "",
             "Final validation loss in nats/byte. The variant tables give the mean ± sample std over seeds. "
             "Every derived quantity (a delay gap is async minus sync; a fraction recovered; a difference of "
             "gaps) is given ± its standard error (SE). Runs with the same seed start from the same weights and "
             "read the same batches (the seed fixes both the initialization and the data order, whatever the "
             "optimizer or delay), so where all arms of a comparison share their seeds the SE is that of the "
             "per-seed differences (paired: the seed's own luck cancels); otherwise the arms count as "
             "independent (SE^2 = sum of each mean's SE^2). Ratios take the delta method. Each table says which "
             "was used.", "", "## The paper's claims at this scale", "",
             "Each claim gets exactly one verdict by a one-sided t test at level 5% with n - 1 degrees of freedom "
             "(n seeds; t = 2.92 at n = 3, 2.13 at n = 5): reproduced (the test's estimate is more than t SE on the "
             "claim's side of its threshold), not reproduced (more than t SE on the other side), or "
             "inconclusive at this scale (within t SE, or fewer than two seeds). In the tests below, t stands "
             "for that point.", ""]
    if claims:
        lines += md_table(["claim", "verdict", "test", "measured", "the paper"],
                       [(c, v, test, why, theirs) for c, (v, test, why, theirs) in claims.items()])
    else:
        lines.append("None of the given studies tests a claim.")
    lines += [""] + body
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def check(report_dir) -> str:
    """Regenerate ``report_dir/report.md`` from the ``results.jsonl`` beside it; '' if identical, else a diff."""
    report_dir = pathlib.Path(report_dir)
    committed = report_dir / "report.md"
    if not committed.is_file():
        raise ReportInputError(f"{committed}: no such file")
    text = committed.read_text()
    if text.startswith(NOT_REGENERABLE) or f"\n{NOT_REGENERABLE}" in text:
        raise ReportInputError(f"{committed} says it is not regenerable: its {RESULTS} was not kept")
    if not (report_dir / RESULTS).is_file():
        raise ReportInputError(f"{report_dir / RESULTS}: no such file; a committed report must sit beside the "
                               f"{RESULTS} it was made from (python -m experiments.report ... --out {report_dir})")
    with tempfile.TemporaryDirectory() as tmp:
        fresh = report([report_dir / RESULTS], pathlib.Path(tmp)).read_text()
    return "".join(difflib.unified_diff(text.splitlines(True), fresh.splitlines(True), str(committed), "regenerated"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="*", help="results.jsonl files written by `python -m experiments.sweep`")
    ap.add_argument("--out", default=None, help="directory for report.md, its plots and a copy of the input rows "
                    "(default: next to the first file)")
    ap.add_argument("--check", metavar="DIR", default=None, help="regenerate DIR/report.md from DIR/results.jsonl "
                    "and compare")
    a = ap.parse_args(argv)
    try:
        if a.check:
            diff = check(a.check)
            if diff:
                sys.exit(f"{a.check}/report.md differs from its regeneration:\n{diff}")
            print(f"{a.check}/report.md regenerates exactly from {RESULTS}")
            return
        if not a.results:
            ap.error("give one or more results.jsonl files, or --check DIR")
        out = pathlib.Path(a.out) if a.out else pathlib.Path(a.results[0]).parent / "report"
        print(report(a.results, out))
    except ReportInputError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
