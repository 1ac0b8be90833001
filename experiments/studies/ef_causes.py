"""Why does error feedback recover little of AdamW's delay gap at the CPU preset?  One run per cause.

Error feedback (update level) applies ``u_t + s (u_t - u_{t-1})`` where ``u_t`` is the inner
optimizer's update for the stale gradient: a first-order extrapolation of the update sequence one
step ahead, which can only help as far as consecutive updates differ smoothly.  The paper reports it
recovering 85-90% of AdamW's gap at 360M parameters and 0.5M-token batches; at the ``cpu`` preset
(0.76M parameters, 2048-token batches, 200 updates) the ``lr`` and ``mitigations`` studies measure
15-40%.  Each cause below changes one setting of the preset's AdamW (at its tuned learning rate)
and runs the three arms ``sync``, ``2bw``, ``ef`` (2bw + EF), so the report can compare the fraction
recovered with the preset's own (``base``):

* ``warmup``: a 3x longer warmup (60 updates): the first updates, where the gap opens, are smaller;
* ``length``: 3x the updates (600, the schedule stretched with it): is it an early-training effect?
* ``size``: d_model 256 (2.9M parameters, same depth): does the model's size matter?
* ``batch``: 4x the tokens per update (64 x 128): gradient noise, which the extrapolation amplifies;
* ``b1``: AdamW's b1 0.98 instead of 0.9: smoother updates, so a better extrapolation;
* ``strength``: the correction itself, ``s`` = 0.5 and 2 instead of 1 (only the ``ef`` arm differs).

The learning rate, the other suspect, is the ``lr`` study's axis (its table of EF recovery per
learning rate).  Two seeds per run: 4.0k CPU-seconds a seed, about 70 minutes at ``--jobs 2``.
"""

import pathlib

from experiments import stats
from experiments.report_format import est, md_table, plot_xy, se_kind
from experiments.studies.common import CPU, optimizer, preset
from experiments.study import Study

ARMS = {"sync": {"staleness.mode": "sync"}, "2bw": {"staleness.mode": "2bw"},
        "ef": {"staleness.mode": "2bw", "staleness.mitigation": "ef"}}
CAUSES = {
    "base": {},
    "warmup": {"optimizer.warmup_steps": 3 * CPU["optimizer.warmup_steps"]},
    "length": {"train.steps": 3 * CPU["train.steps"], "train.eval_every": 3 * CPU["train.eval_every"],
               "train.checkpoint_every": CPU["train.checkpoint_every"]},  # a stopped run resumes from update 200 or 400
    "size": {"model.d_model": 256, "model.d_ff": 688},
    "batch": {"train.global_batch_size": 4 * CPU["train.global_batch_size"]},
    "b1": {"optimizer.adamw.b1": 0.98},
}
# About 3x a base run's compute each (3x the updates, ~3.5x the FLOPs per token, 4x the tokens).
COSTLY = ("length", "size", "batch")
STRENGTHS = (0.5, 2.0)
SEEDS = (0, 1)


def study(name: str) -> Study:
    if name != "cpu":
        raise ValueError(f"the ef_causes study varies the cpu preset's settings; run it with --preset=cpu, not {name!r}")
    config, base, _, note = preset(name)
    adamw = optimizer("adamw", name)
    arms = lambda causes: {f"adamw/{c}/{arm}": {**adamw, **CAUSES[c], **a}  # noqa: E731
                           for c in causes for arm, a in ARMS.items()}
    # Runs go in this order (cheapest first), so a study stopped early has the most causes measured.
    variants = arms([c for c in CAUSES if c not in COSTLY])
    variants |= {f"adamw/strength={s:g}/ef": {**adamw, **ARMS["ef"], "staleness.ef_strength": s} for s in STRENGTHS}
    variants |= arms(COSTLY)
    return Study("ef_causes", config, variants, seeds=SEEDS, base=base,
                 note=note + "; AdamW at its tuned lr, one setting changed per cause, 2 seeds")


BOOKKEEPING = ("train.eval_every", "train.checkpoint_every")  # scaled with a run's length, not causes


def analyse_ef_causes(rows, out: pathlib.Path) -> list[str]:
    """Per suspected cause (one setting changed from the preset): AdamW's delay gap, EF's gap and the
    fraction EF recovers, and that fraction minus the preset's own (``base``), each ± SE."""
    arms = stats.arms_of(rows)
    fb = stats.recovered(arms, "adamw/base/ef", "adamw/base/2bw", "adamw/base/sync")
    cases = [(c, f"adamw/{c}/ef", f"adamw/{c}/2bw", f"adamw/{c}/sync",
              ", ".join(f"{k.rsplit('.', 1)[1]}={v}" for k, v in o.items() if k not in BOOKKEEPING) or "the preset")
             for c, o in CAUSES.items()]
    cases += [(f"strength={s:g}", f"adamw/strength={s:g}/ef", "adamw/base/2bw", "adamw/base/sync", f"ef_strength={s:g}")
              for s in STRENGTHS]
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
            effect = stats.direction(diff, "raises it", "lowers it", "no effect within t SE", "no standard error (one seed)")
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


def analyse(name: str, rows: list[dict], arms, out: pathlib.Path, claims: dict) -> list[str]:
    """The report's section of this study."""
    return analyse_ef_causes(rows, out)
