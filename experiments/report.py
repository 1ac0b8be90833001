"""Markdown report with tables and plots from one or more studies' ``results.jsonl``.

    python -m experiments.report runs/studies/optimizers/results.jsonl [...] [--out report_dir]
    python -m experiments.report --check experiments/results/cpu     # regenerate, compare tables

The report directory always receives the rows it was made from, as ``results.jsonl`` beside
``report.md`` (the input lines, verbatim, in order), and ``report.md`` names that file's SHA-256. So a
committed report regenerates from the repository alone; ``--check DIR`` does that into a temporary
directory and compares ``report.md`` exactly (plots are not compared: their bytes depend on
matplotlib's version).

Per study: a table of final validation loss (nats/byte), mean ± std over seeds, per variant; the
study's derived quantity (delay gap ``2bw - sync`` per optimizer, per momentum, per depth, per
setting; every mitigation ranked by the fraction of the gap it recovers, ± its standard error);
and plots (loss curves sync vs async, gap vs momentum, gap vs depth, recovered fraction).  Then a
verdict on each of the paper's claims that the given studies can test, stated as measured: a claim
that does not hold here is reported as not reproduced.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import hashlib
import json
import pathlib
import re
import sys
import tempfile

import numpy as np

# Thresholds that turn the paper's words into a test, stated in the report.
FAR_LARGER = 2.0  # "AdamW's gap is far larger than Muon's": at least this ratio
LARGE_PART = 0.5  # "EF recovers a large part of the gap": at least this fraction


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


def fmt(values: np.ndarray) -> str:
    if len(values) > 1:
        return f"{values.mean():.4f} ± {values.std(ddof=1):.4f}"
    return f"{values.mean():.4f}"


def gap(stats, async_key, sync_key) -> tuple[float, float] | None:
    """Mean gap and its standard error (independent seeds)."""
    if async_key not in stats or sync_key not in stats:
        return None
    a, s = stats[async_key], stats[sync_key]
    se = np.sqrt((a.var(ddof=1) / len(a) if len(a) > 1 else 0.0) + (s.var(ddof=1) / len(s) if len(s) > 1 else 0.0))
    return float(a.mean() - s.mean()), float(se)


def _var_of_mean(x: np.ndarray) -> float:
    return float(x.var(ddof=1) / len(x)) if len(x) > 1 else 0.0


def recovered(stats, opt: str, arm: str) -> tuple[float, float] | None:
    """Fraction of the delay gap ``arm`` recovers, ``f = 1 - (arm - sync) / (none - sync)``, and its SE.

    The standard error is the delta method on the three means (independent seeds, the same
    assumption as :func:`gap`), counting that both gaps share the synchronous mean:
    ``Var f = [Var(G_a) + r^2 Var(G_n) - 2 r Var(sync)] / G_n^2`` with ``r = G_a / G_n``.
    """
    keys = [f"{opt}/{arm}", f"{opt}/none", f"{opt}/sync"]
    if any(k not in stats for k in keys):
        return None
    a, n, s = (stats[k] for k in keys)
    g_a, g_n = a.mean() - s.mean(), n.mean() - s.mean()
    if g_n == 0:
        return None
    r = g_a / g_n
    va, vn, vs = _var_of_mean(a), _var_of_mean(n), _var_of_mean(s)
    var = ((va + vs) + r * r * (vn + vs) - 2 * r * vs) / g_n**2
    return float(1 - r), float(np.sqrt(max(var, 0.0)))


def minus_ef(stats, opt: str, arm: str) -> tuple[float, float] | None:
    """``f_arm - f_ef = (ef - arm) / (none - sync)`` and its delta-method SE (independent seeds)."""
    keys = [f"{opt}/{arm}", f"{opt}/ef", f"{opt}/none", f"{opt}/sync"]
    if any(k not in stats for k in keys):
        return None
    a, e, n, s = (stats[k] for k in keys)
    g_n = n.mean() - s.mean()
    if g_n == 0:
        return None
    diff = (e.mean() - a.mean()) / g_n
    var = (_var_of_mean(a) + _var_of_mean(e)) / g_n**2 + (diff / g_n) ** 2 * (_var_of_mean(n) + _var_of_mean(s))
    return float(diff), float(np.sqrt(var))


def analyse_mitigations(stats, out: pathlib.Path, claims: dict) -> list[str]:
    """Every mitigation ranked by the fraction of the gap it recovers, per optimizer, ± SE."""
    series, table, lines = collections.defaultdict(list), [], []
    for opt in sorted({v.split("/")[0] for v in stats}):
        arms = sorted({v.split("/", 1)[1] for v in stats if v.startswith(f"{opt}/")} - {"sync", "none"})
        fracs = [(arm, f) for arm in arms if (f := recovered(stats, opt, arm))]
        if fracs:  # bars in one (alphabetical) arm order for every optimizer; the table is ranked
            series[opt] = [(arm, f[0], f[1]) for arm, f in fracs]
        for rank, (arm, f) in enumerate(sorted(fracs, key=lambda x: -x[1][0]), start=1):
            vs = minus_ef(stats, opt, arm) if arm != "ef" else None
            table.append((opt, rank, arm, _gap_str(gap(stats, f"{opt}/{arm}", f"{opt}/sync")),
                          f"{f[0]:.0%} ± {f[1]:.0%}", "-" if vs is None else f"{vs[0]:+.0%} ± {vs[1]:.0%}"))
    lines += _table(["optimizer", "rank", "mitigation", "gap vs sync", "fraction of the gap recovered",
                     "minus EF's fraction"], table) + [""]
    if series:
        lines.append(f"![recovered]({plot_xy(series, out / 'mitigations_recovered.png', 'mitigation', 'fraction recovered', 'gap recovered', bars=True)})")
        lines.append("")
        ef = {opt: dict((a, f) for a, f, _ in pts).get("ef") for opt, pts in series.items()}
        ef = {k: v for k, v in ef.items() if v is not None}
        if ef:
            claims["Error feedback recovers a large part of the gap"] = (
                all(v >= LARGE_PART for v in ef.values()),
                ", ".join(f"{k} {v:.0%}" for k, v in ef.items()) + f" (test: >= {LARGE_PART:.0%})")
    return lines


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(rows, out: pathlib.Path, title: str) -> str:
    """Validation curves (mean over seeds) of every variant of one study."""
    plt = _plt()
    curves = collections.defaultdict(list)
    for r in rows:
        if r["val_curve"]:
            curves[r["variant"]].append(np.asarray(r["val_curve"], float))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # One colour per setting (the variant without its last part), dashed for the synchronous arm.
    settings = sorted({v.rsplit("/", 1)[0] for v in curves})
    colours = {k: plt.get_cmap("tab20" if len(settings) > 10 else "tab10")(i) for i, k in enumerate(settings)}
    for variant, cs in sorted(curves.items()):
        n = min(len(c) for c in cs)
        mean = np.mean([c[:n, 1] for c in cs], axis=0)
        style = "--" if variant.rsplit("/", 1)[-1] == "sync" else "-"
        ax.plot(cs[0][:n, 0], mean, style, color=colours[variant.rsplit("/", 1)[0]], label=variant)
    ax.set(xlabel="update", ylabel="validation loss (nats/byte)", title=title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out.name


def plot_xy(series: dict[str, list[tuple[float, float, float]]], out: pathlib.Path, xlabel: str, ylabel: str,
            title: str, bars: bool = False) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, pts) in enumerate(sorted(series.items())):
        xs, ys, es = zip(*pts)
        if bars:
            pos = np.arange(len(xs)) + 0.4 * i
            ax.bar(pos, ys, 0.4, yerr=es, label=name)
            ax.set_xticks(np.arange(len(xs)) + 0.2, [str(x) for x in xs], rotation=30, fontsize=8)
        else:
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=name)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out.name


def _table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _gap_str(g):
    return "-" if g is None else f"{g[0]:+.4f} ± {g[1]:.4f}"


def analyse(name: str, rows: list[dict], out: pathlib.Path, claims: dict) -> list[str]:
    stats = by_variant(rows)
    lines = [f"## Study `{name}`", "", f"{len(rows)} runs, seeds {sorted({r['seed'] for r in rows})}.", ""]
    lines += _table(["variant", "final val loss (nats/byte)", "runs"],
                    [(v, fmt(x), len(x)) for v, x in sorted(stats.items())]) + [""]
    lines.append(f"![curves]({plot_curves(rows, out / f'{name}_curves.png', name)})")
    lines.append("")

    if name in ("optimizers", "sensitivity"):
        prefixes = sorted({v.rsplit("/", 1)[0] for v in stats})
        gaps = {p: gap(stats, f"{p}/2bw", f"{p}/sync") for p in prefixes}
        lines += _table(["setting", "delay gap 2bw - sync"], [(p, _gap_str(g)) for p, g in gaps.items()]) + [""]
        if name == "optimizers" and gaps.get("adamw") and gaps.get("muon"):
            a, m = gaps["adamw"][0], gaps["muon"][0]
            claims["AdamW's delay gap is far larger than Muon's"] = (
                a > FAR_LARGER * max(m, 1e-9) and a > 0,
                f"AdamW {a:+.4f} vs Muon {m:+.4f} (test: AdamW > {FAR_LARGER}x Muon)")
    elif name == "momentum":
        series = collections.defaultdict(list)
        for v in stats:
            m = re.match(r"(\w+)/beta=([\d.]+)/2bw$", v)
            if m:
                g = gap(stats, v, v[: -len("2bw")] + "sync")
                if g:
                    series[m.group(1)].append((float(m.group(2)), *g))
        series = {k: sorted(v) for k, v in series.items()}
        lines += _table(["optimizer", "momentum", "delay gap"],
                        [(k, x, f"{y:+.4f} ± {e:.4f}") for k, pts in series.items() for x, y, e in pts]) + [""]
        lines.append(f"![gap vs momentum]({plot_xy(series, out / 'momentum_gap.png', 'b1 / mu', 'delay gap', 'gap vs momentum')})")
        lines.append("")
        verdicts = {k: pts[-1][1] < pts[0][1] for k, pts in series.items() if len(pts) > 1}
        if verdicts:
            claims["Higher momentum shrinks the delay gap"] = (
                all(verdicts.values()),
                "; ".join(f"{k}: gap {series[k][0][1]:+.4f} at {series[k][0][0]} -> {series[k][-1][1]:+.4f} at "
                          f"{series[k][-1][0]}" for k in verdicts))
    elif name == "mitigations":
        lines += analyse_mitigations(stats, out, claims)
    elif name == "schemes":
        pts = []
        for v in stats:
            m = re.search(r"/pipedream/P=(\d+)$", v)
            if m:
                g = gap(stats, v, v.split("/")[0] + "/sync")
                if g:
                    pts.append((int(m.group(1)), *g))
        pts.sort()
        two = gap(stats, "adamw/2bw", "adamw/sync")
        series = {"pipedream": pts}
        if two and pts:
            series["2bw"] = [(p, *two) for p, _, _ in pts]
        lines += _table(["scheme", "P", "delay gap"], [("pipedream", p, f"{y:+.4f} ± {e:.4f}") for p, y, e in pts]
                        + ([("2bw", "any", _gap_str(two))] if two else [])) + [""]
        if pts:
            lines.append(f"![gap vs depth]({plot_xy(series, out / 'schemes_gap.png', 'pipeline depth P', 'delay gap', 'gap vs depth')})")
            lines.append("")
        if two and len(pts) > 1:
            grows = all(b[1] > a[1] for a, b in zip(pts, pts[1:]))
            claims["PipeDream degrades with depth while 2BW does not"] = (
                grows and pts[-1][1] > two[0],
                f"PipeDream gap {' -> '.join(f'{y:+.4f}' for _, y, _ in pts)} for P = "
                f"{', '.join(str(p) for p, _, _ in pts)}; 2BW {two[0]:+.4f} (one delay at any depth)")
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
    claims: dict[str, tuple[bool, str]] = {}
    body = []
    for name in sorted(studies):
        body += analyse(name, studies[name], out, claims)
    digest = hashlib.sha256(data.encode()).hexdigest()[:16]
    lines = ["# Async PP study report", "", f"Made from `{RESULTS}` beside this file ({len(rows)} runs, sha256 "
             f"`{digest}`); regenerate with `python -m experiments.report --check <this directory>`.", "",
             "Final validation loss in nats/byte; mean ± sample std over seeds; "
             "a delay gap is async minus sync (± its standard error).", "", "## The paper's claims at this scale", ""]
    if claims:
        lines += _table(["claim", "reproduced here?", "measured"],
                        [(c, "yes" if ok else "**no**", why) for c, (ok, why) in claims.items()])
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
