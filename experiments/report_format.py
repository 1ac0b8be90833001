"""Formatting shared by the study report's sections: estimates, tables, claims and x-y plots."""

from __future__ import annotations

import pathlib

import numpy as np

from experiments import stats


def est(e: stats.Estimate | None, pct: bool = False) -> str:
    if e is None:
        return "-"
    return e.pct() if pct else str(e)


OPT_NAMES = {"adamw": "AdamW", "muon": "Muon", "soap": "SOAP", "adan": "Adan", "lion": "Lion", "mars": "MARS-AdamW"}

SHARE_NOTE = ("EF's share s: G_EF = (1 - s) G with G = 2bw - sync and G_EF = 2bw+EF - sync, given as the point "
              "1 - G_EF / G and its 90% interval [lo, hi] from the linear test of G_EF - (1 - s) G (Fieller; "
              "each end a one-sided 5% t test at n - 1 degrees of freedom); none where G itself is not "
              "resolved from 0 by that test, or from one seed.")


def share_text(r: stats.Ratio | None) -> str:
    if r is None:
        return "-"
    if r.n < 2:
        return "- (one seed)"
    return r.text(pct=True)


def claim(claims: dict, name: str, verdict: str, test: str, measured: str, paper: str) -> None:
    """One row of the claims table: ``paper`` is the paper's own figure for it (experiments.paper)."""
    assert verdict in stats.VERDICTS, verdict
    claims[name] = (verdict, test, measured, paper)


def se_kind(e: stats.Estimate | None) -> str:
    if e is None:
        return "-"
    return f"paired, {e.n} seed{'s' * (e.n != 1)}" if e.paired else f"independent, >= {e.n} runs per arm"


def plt_module():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_xy(series: dict[str, list[tuple[float, float, float]]], out: pathlib.Path, xlabel: str, ylabel: str,
            title: str, bars: bool = False, logx: bool = False, zero: bool = True) -> str:
    plt = plt_module()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, pts) in enumerate(sorted(series.items())):
        xs, ys, es = zip(*pts)
        if bars:
            pos = np.arange(len(xs)) + 0.4 * i
            ax.bar(pos, ys, 0.4, yerr=es, label=name)
            ax.set_xticks(np.arange(len(xs)) + 0.2, [str(x) for x in xs], rotation=30, fontsize=8)
        else:
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=name)
    if zero:
        ax.axhline(0, color="gray", lw=0.5)
    if logx:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out.name


def figure(alt: str, series: dict, out: pathlib.Path, *labels, **kw) -> list[str]:
    """The report's lines embedding :func:`plot_xy` of ``series`` (``labels``: x label, y label,
    title), under the alt text ``alt``; none when there is no series to plot."""
    if not series:
        return []
    return [f"![{alt}]({plot_xy(series, out, *labels, **kw)})", ""]


def md_table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
