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
