"""The updates ladder's tuning: every arm of every rung swept over the same learning-rate grid.

The ``ladder`` study (:mod:`experiments.studies.ladder`) asks whether the delay gap shrinks toward
the paper's figures as the number of updates grows.  Its rungs train the ``cpu_regime`` model on the
same 819,200 tokens in 200, 800 and 3,200 updates (batches of 32, 8 and 2 sequences of 128), each in
the paper's schedule shape (``common.regime_rung``).  This study is the paper's tuning protocol on
each rung: sync, 2BW and 2BW + error feedback of AdamW, Muon and SOAP, each over the same 5-point
grid (``lr.grid`` at that rung's batch, 9x wide), one seed.  Each arm's best learning rate
(:func:`experiments.tuning.pick_arm_lrs`) is what ``common.TUNED_LADDER`` holds and what ``ladder``
measures at three seeds.

A fourth rung keeps the preset's batch and trains on twice the tokens (6,400 updates,
:data:`EXTRA_RUNGS`): against the 3,200-update rung it adds updates without shrinking the batch.

Variants: ``u=UPDATES/OPT/lr=VALUE/ARM``.  153 runs of about 2 min on one core each (SOAP's about 5)
and 36 of about 6 min (SOAP's about 10): about 10 CPU-hours, 5 hours with ``--jobs 2`` on 2 cores; the 3,200-update rung's sync
arms are the ``lr`` study's runs at ``cpu_regime`` (the sweep copies them: run ``lr`` first under
the same ``--out``).
"""

import math

from experiments.studies import lr
from experiments.studies.common import lr_centre, optimizer, preset, regime_rung
from experiments.study import Study

# updates -> batch (sequences of 128 tokens): the same 819,200 tokens at every rung.
RUNGS = {200: 32, 800: 8, 3200: 2}
# The preset's batch on twice the tokens (1,638,400): more updates without a smaller batch, which
# separates the number of updates from the batch size.  Twice a run's cost, so its grid is the
# batch-2 grid's middle three points (still one grid for every arm).
EXTRA_RUNGS = {6400: 2}
OPTIMIZERS = ("adamw", "muon", "soap")
ARMS = ("sync", "2bw", "ef")


def rung_name(updates: int) -> str:
    return f"u={updates}"


def check_preset(name: str, study: str) -> None:
    if name != "cpu_regime":
        raise ValueError(f"the {study} study is defined at the cpu_regime preset only (its rungs are that "
                         f"preset's model at other batch sizes); run it with --preset=cpu_regime")


# A grid whose best run is its lowest point has not bracketed the optimum.  Where the first pass put
# any arm's pick on the low edge, that rung's grid goes on downward at the grid's own ratio (sqrt 3),
# for every arm alike, a point per pass, until the picks are inside.  First pass (one seed): at 200
# updates AdamW's EF arm and Muon's 2BW and EF arms, at 800 AdamW's 2BW arm and all three Muon arms
# (the linear batch rule puts Muon's grid too high at batch 8), and SOAP's 2BW and EF arms at 200.
# Second: AdamW's 2BW and EF arms at 200 updates, best again at the new lowest point.  The extra
# rung (6,400 updates, twice the tokens) runs the grid's middle three points; its first pass put
# picks on their low edge for all three optimizers, so it goes down through the grid's own lowest.
EXTEND_DOWN = {(200, "adamw"): 2, (200, "muon"): 1, (200, "soap"): 1, (800, "adamw"): 1, (800, "muon"): 1,
               (6400, "adamw"): 1, (6400, "muon"): 1, (6400, "soap"): 1}


def rung_grid(opt: str, updates: int, batch: int) -> list[float]:
    grid, n = lr.grid(opt, "cpu_regime", batch), EXTEND_DOWN.get((updates, opt), 0)
    if updates in EXTRA_RUNGS:  # the middle three points; extended, the grid's lowest first
        grid, n = grid[max(1 - n, 0):-1], max(n - 1, 0)
    below = [float(f"{lr_centre(opt, batch) * lr.FACTORS[0] / math.sqrt(3) ** k:.2g}") for k in range(n, 0, -1)]
    return below + grid


def variants(rungs: dict = RUNGS, optimizers=OPTIMIZERS, arms=ARMS, extra: dict = EXTRA_RUNGS) -> dict:
    # Optimizer-major, so that an interrupted study has whole ladders for the first optimizers; the
    # costlier extra rungs last.
    out = {}
    order = [(opt, u, b) for opt in optimizers for u, b in rungs.items()] + \
        [(opt, u, b) for opt in optimizers for u, b in extra.items()]
    for opt, updates, batch in order:
        for lr_value in rung_grid(opt, updates, batch):
            for arm in arms:
                out[f"{rung_name(updates)}/{opt}/lr={lr_value:g}/{arm}"] = {
                    **regime_rung(batch, updates), **optimizer(opt, "cpu_regime"), "optimizer.lr": lr_value,
                    **lr.ARMS[arm]}
    return out


def study(name: str) -> Study:
    check_preset(name, "ladder_tune")
    config, base, _, note = preset(name)
    return Study("ladder_tune", config, variants(), seeds=lr.TUNE_SEEDS, base=base,
                 note="ladder tuning: 153 runs of ~2 min and 27 of ~4 min on one core (SOAP's 2.5x; ~9 CPU-hours)")
