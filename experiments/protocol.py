"""The referee protocol: tune on seeds that are never measured, measure on others, report a test split.

Each arm (an optimizer with one staleness setting, in one cell of a study) is tuned on a
learning-rate grid of its own and measured at its pick:

1. **Tune.** Three points of a geometric lattice (``centre x sqrt(3)^k``, two significant figures)
   around a starting guess, each run at :data:`TUNE_SEEDS`; the pick is the point of lowest mean
   final validation loss over those seeds (a point at which any seed diverged is never picked).
   A pick on the grid's edge has not bracketed the optimum, so the grid grows by one point past
   that edge and the pick is taken again, up to :data:`MAX_EXTEND` points (:func:`tune_state`).
   Every step is a function of the rows already written, so an interrupted screen resumes where
   it stopped and a rerun reproduces the same grids and picks.
2. **Measure.** The pick at :data:`MEASURE_SEEDS`, disjoint from the tuning seeds, so the seed
   luck that chose the pick is not in the number reported.  Where the headline gap
   (``2bw - sync``) is under :data:`RESOLVE_T` standard errors at three seeds, the optimizer's
   arms are measured at :data:`MORE_SEEDS` too (:func:`needs_more_seeds`).
3. **Test split.** Every run also reports, once at its end, the loss on a test set that neither
   tuning nor the curves see (``config.train.test_batches``: :data:`TEST_SEQUENCES` windows from the
   end of the validation split, disjoint from the ``eval_batches`` windows at its start that the
   pick is made by).  Rows carry it as ``test_val`` (nats/byte).

Verdicts on these rows use the t distribution at ``n - 1`` degrees of freedom (:mod:`experiments.stats`).
"""

from __future__ import annotations

import math

TUNE_SEEDS = (100, 101)
MEASURE_SEEDS = (0, 1, 2)
MORE_SEEDS = (3, 4)
RESOLVE_T = 3.0  # a headline gap under this many standard errors at three seeds gets MORE_SEEDS
MAX_EXTEND = 3  # points a grid may grow past its first three
TEST_SEQUENCES = 512  # test windows of every measured run (twice the 256 validation windows)
STEP = math.sqrt(3)  # the lattice's ratio, as the lr study's grids


def lattice(centre: float, k: int) -> float:
    """The ``k``-th point of the lattice around ``centre``, rounded to two significant figures."""
    return float(f"{centre * STEP ** k:.2g}")


def tune_state(centre: float, k0: int, means: dict[float, float | None]) -> tuple[list[float], float | None]:
    """``(grid, pick)`` of one arm from its tuning results so far.

    ``means`` maps each learning rate whose runs are all done to its mean final validation loss over
    the tuning seeds (None: a seed diverged).  The grid starts at lattice points ``k0 - 1 .. k0 + 1``
    and grows by one point past whichever edge holds the best mean, until the best is inside or
    :data:`MAX_EXTEND` points were added; ``pick`` is None while a point of the grid is not done.
    Ties go to the lower learning rate.
    """
    ks = [k0 - 1, k0, k0 + 1]
    while True:
        grid = [lattice(centre, k) for k in ks]
        if any(lr not in means for lr in grid):
            return grid, None
        finite = {k: means[lattice(centre, k)] for k in ks if means[lattice(centre, k)] is not None}
        best = min(finite, key=lambda k: (finite[k], k)) if finite else ks[0]
        grown = len(ks) - 3
        if grown < MAX_EXTEND and best == ks[0]:
            ks.insert(0, ks[0] - 1)
        elif grown < MAX_EXTEND and best == ks[-1] and finite:
            ks.append(ks[-1] + 1)
        else:
            return grid, (lattice(centre, best) if finite else None)


def on_edge(grid: list[float], pick: float | None) -> bool:
    """True if ``pick`` is an end of its grid (after all growth): a bound, not a bracketed optimum."""
    return pick is not None and pick in (min(grid), max(grid))


def needs_more_seeds(gap) -> bool:
    """True if the headline gap (an :class:`experiments.stats.Estimate`) is under :data:`RESOLVE_T`
    standard errors: the arms get :data:`MORE_SEEDS`."""
    return gap is None or abs(gap.value) < RESOLVE_T * gap.se
