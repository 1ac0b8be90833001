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
and plots.  Each study's own section is its module's ``analyse`` (:func:`study_section`); the
updates ladder's (:mod:`experiments.report_ladder`) and the factor screen's
(:mod:`experiments.report_factors`) read two studies' rows each (:data:`PAIRED`).  Then a verdict on each of the paper's claims that the given studies can test: exactly
one of "reproduced", "not reproduced", "inconclusive at this scale", with the test (a one-sided t
test at level 5% with n - 1 degrees of freedom, :func:`experiments.stats.verdict`) and the numbers.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import hashlib
import importlib
import json
import pathlib
import sys
import tempfile

import numpy as np

from experiments import report_factors, report_ladder, stats
from experiments.analysis import diverged, gap_curve, trend  # noqa: F401  (report.gap_curve, report.trend)
from experiments.report_format import md_table, plt_module
from experiments.studies import tuned


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


def analyse(name: str, rows: list[dict], out: pathlib.Path, claims: dict, own=lambda *_: []) -> list[str]:
    """The common tables of one study (final loss per variant, curves, the gaps at sync's learning
    rate), then its own section ``own(name, rows, arms, out, claims)``."""
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
    return lines + own(name, rows, arms, out, claims)


# Studies whose section reads other studies' rows too (a tuning study and its measurement):
# the module that owns the pair's analysis, by the measured study's name (``X`` and ``X_tune``).
PAIRED = {"ladder": report_ladder, "factors": report_factors}
# Studies under the referee protocol (tuning seeds never measured, a test split): their claims win.
PROTOCOL_STUDIES = ("factors",)


def study_section(name: str):
    """The study's own section, ``section(name, studies, out, claims) -> lines``: the ``section`` of
    the module that owns a tuning/measurement pair (:data:`PAIRED`), else the study module's
    ``analyse`` under the common tables, else (a ``STUDY_tune`` step) its grid table."""
    paired = PAIRED.get(name.removesuffix("_tune"))
    if paired is not None:
        return paired.section
    if name.endswith("_tune"):
        return lambda name, studies, out, claims: (
            [f"## Study `{name}`", "", f"{len(studies[name])} runs, seeds "
             f"{sorted({r['seed'] for r in studies[name]})}.", ""] + report_ladder.grid_table(studies[name], name))
    try:
        module = importlib.import_module(f"experiments.studies.{name}")
    except ModuleNotFoundError:
        module = None
    own = getattr(module, "analyse", lambda *_: [])
    return lambda name, studies, out, claims: analyse(name, studies[name], out, claims, own)


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
    # The protocol's studies run last, so that where they test a claim their verdict replaces the
    # earlier studies' (whose arms were tuned on a seed they were then measured on); the body keeps
    # the studies' alphabetical order.
    sections = {}
    for name in sorted(studies, key=lambda n: (n.removesuffix("_tune") in PROTOCOL_STUDIES, n)):
        sections[name] = study_section(name)(name, studies, out, claims)
    body = [line for name in sorted(studies) for line in sections[name]]
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
             "for that point." + (" The measured column names the rows each verdict rests on: where the factor "
                                  "screen (`factors`, each arm tuned on seeds it is never measured on) tests a "
                                  "claim, its rows decide it; the other claims rest on the earlier studies, whose "
                                  "arms were tuned on one of their measured seeds."
                                  if any(n in studies for n in PROTOCOL_STUDIES) else ""), ""]
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
