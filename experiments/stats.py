"""Estimates over seeds for the study report: linear contrasts of arms, ratios of contrasts, and the
three-way verdict a claim gets from one of them (a one-sided t test at ``n - 1`` degrees of freedom).

Pairing.  A run's seed fixes both its initial parameters (``jax.random.key(config.seed)`` in
``Trainer.restore_or_init``) and its data order (the grain shuffle seeded from ``config.seed`` in
``data.pipeline.make_train_dataset``); neither depends on the optimizer or the staleness settings.
So two arms of one study run with the same seed start from the same weights and see the same batches,
and their difference per seed removes the seed's own luck.  When every arm of a contrast has the same
seeds (each once), the estimate is the mean of the per-seed contrasts and its standard error that of
the per-seed values, ``SE = sd(z_s) / sqrt(n)`` with ``z_s = sum_k c_k x_{k,s}`` (a paired
comparison).  Otherwise the arms are treated as independent: ``SE^2 = sum_k c_k^2 sd_k^2 / n_k``.

A ratio of two contrasts ``q = N / D`` (the fraction of the delay gap a mitigation recovers) takes
the delta method, ``Var q = [Var N + q^2 Var D - 2 q Cov(N, D)] / D^2``, with the variances and the
covariance of the two means estimated from the per-seed values when paired, and from the shared arms
(``Cov = sum_k a_k b_k sd_k^2 / n_k``) when independent.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# variant -> [(seed, value), ...]: one entry per finished run
Arms = dict


@dataclasses.dataclass(frozen=True)
class Estimate:
    value: float
    se: float
    paired: bool
    n: int  # seeds (paired), or the fewest runs of any arm (independent)

    def __str__(self) -> str:
        return f"{self.value:+.4f} ± {self.se:.4f}"

    def pct(self) -> str:
        return f"{self.value:.0%} ± {self.se:.0%}"


def arms_of(rows, value=lambda r: r.get("final_val")) -> Arms:
    """``{variant: [(seed, value)]}`` over the rows whose ``value`` is a finite number."""
    out: dict = {}
    for r in rows:
        v = value(r)
        if v is not None and math.isfinite(v):
            out.setdefault(r["variant"], []).append((r["seed"], float(v)))
    return out


def _paired_seeds(arms: Arms, variants) -> list | None:
    """The common seeds if every variant has the same seeds, each once; else None."""
    sets = []
    for v in variants:
        seeds = [s for s, _ in arms[v]]
        if len(set(seeds)) != len(seeds):
            return None
        sets.append(frozenset(seeds))
    return sorted(sets[0]) if all(s == sets[0] for s in sets) else None


def var_of_mean(x) -> float:
    x = np.asarray(x, float)
    return float(x.var(ddof=1) / len(x)) if len(x) > 1 else 0.0


def _combine(arms: Arms, coefs: dict, seeds: list) -> np.ndarray:
    table = {v: dict(arms[v]) for v in coefs}
    return np.array([sum(c * table[v][s] for v, c in coefs.items()) for s in seeds])


def contrast(arms: Arms, coefs: dict) -> Estimate | None:
    """``sum_k c_k mean(arm_k)`` with its standard error (paired if the seeds pair); None if an arm is missing."""
    if not coefs or any(not arms.get(v) for v in coefs):
        return None
    seeds = _paired_seeds(arms, coefs)
    if seeds is not None:
        z = _combine(arms, coefs, seeds)
        return Estimate(float(z.mean()), math.sqrt(var_of_mean(z)), True, len(seeds))
    vals = {v: np.array([x for _, x in arms[v]]) for v in coefs}
    value = sum(c * vals[v].mean() for v, c in coefs.items())
    var = sum(c * c * var_of_mean(vals[v]) for v, c in coefs.items())
    return Estimate(float(value), math.sqrt(var), False, min(len(x) for x in vals.values()))


def ratio(arms: Arms, num: dict, den: dict) -> Estimate | None:
    """``N / D`` of two contrasts with its delta-method standard error; None if an arm is missing or D = 0."""
    variants = {**num, **den}
    if any(not arms.get(v) for v in variants):
        return None
    seeds = _paired_seeds(arms, variants)
    if seeds is not None:
        x, y = _combine(arms, num, seeds), _combine(arms, den, seeds)
        n_bar, d_bar, n = x.mean(), y.mean(), len(seeds)
        if n > 1:
            vn, vd, cov = x.var(ddof=1) / n, y.var(ddof=1) / n, float(np.cov(x, y, ddof=1)[0, 1]) / n
        else:
            vn = vd = cov = 0.0
    else:
        vals = {v: np.array([x for _, x in arms[v]]) for v in variants}
        vom = {v: var_of_mean(x) for v, x in vals.items()}
        n_bar = sum(c * vals[v].mean() for v, c in num.items())
        d_bar = sum(c * vals[v].mean() for v, c in den.items())
        vn = sum(c * c * vom[v] for v, c in num.items())
        vd = sum(c * c * vom[v] for v, c in den.items())
        cov = sum(c * den[v] * vom[v] for v, c in num.items() if v in den)
        n = min(len(x) for x in vals.values())
    if d_bar == 0:
        return None
    q = n_bar / d_bar
    var = (vn + q * q * vd - 2 * q * cov) / d_bar**2
    return Estimate(float(q), math.sqrt(max(var, 0.0)), seeds is not None, n)


def ratio_difference(arms: Arms, first: tuple[dict, dict], second: tuple[dict, dict]) -> Estimate | None:
    """``N1/D1 - N2/D2`` of four contrasts with its delta-method standard error.

    Linearised in the arm means: ``d(N/D)/d x_v = (a_v - q b_v) / D`` (``a``, ``b`` the numerator's and
    denominator's coefficients), so the difference is the contrast ``sum_v g_v x_v`` with
    ``g_v = (a1_v - q1 b1_v)/D1 - (a2_v - q2 b2_v)/D2``, whose standard error :func:`contrast` gives
    (paired over seeds when all arms share them, which keeps the covariance of the two ratios).
    None if an arm is missing or a denominator is 0."""
    (num1, den1), (num2, den2) = first, second
    variants = {**num1, **den1, **num2, **den2}
    if any(not arms.get(v) for v in variants):
        return None
    mean = {v: float(np.mean([x for _, x in arms[v]])) for v in variants}
    d1, d2 = (sum(c * mean[v] for v, c in den.items()) for den in (den1, den2))
    if d1 == 0 or d2 == 0:
        return None
    q1 = sum(c * mean[v] for v, c in num1.items()) / d1
    q2 = sum(c * mean[v] for v, c in num2.items()) / d2
    g = {v: (num1.get(v, 0.0) - q1 * den1.get(v, 0.0)) / d1 - (num2.get(v, 0.0) - q2 * den2.get(v, 0.0)) / d2
         for v in variants}
    lin = contrast(arms, g)
    return dataclasses.replace(lin, value=float(q1 - q2))


def gap(arms: Arms, delayed: str, sync: str) -> Estimate | None:
    """The delay gap ``delayed - sync``."""
    return contrast(arms, {delayed: 1.0, sync: -1.0})


def recovered(arms: Arms, arm: str, none: str, sync: str) -> Estimate | None:
    """Fraction of the delay gap ``arm`` recovers: ``f = 1 - (arm - sync) / (none - sync)``."""
    q = ratio(arms, {arm: 1.0, sync: -1.0}, {none: 1.0, sync: -1.0})
    return None if q is None else dataclasses.replace(q, value=1.0 - q.value)


REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive at this scale"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE)


ALPHA = 0.05  # one-sided level of every test


def slope_weights(xs) -> list[float]:
    """Least-squares slope of y on ``xs`` as weights on the y's: ``(x - x_bar) / S_xx``."""
    x_bar = sum(xs) / len(xs)
    sxx = sum((x - x_bar) ** 2 for x in xs)
    return [(x - x_bar) / sxx for x in xs]


def bend_weights(xs) -> list[float] | None:
    """Weights on the y's of a straight line's lack of fit over three or more points ``xs``: the
    second orthogonal polynomial in x, scaled at three equally spaced points (spacing h) to
    ``(y1 - 2 y2 + y3) / h``, the second interval's slope minus the first's.  None under three points."""
    if len(xs) < 3:
        return None
    x = np.asarray(xs, dtype=float)
    q, _ = np.linalg.qr(np.vander(x - x.mean(), 3, increasing=True))
    w = q[:, 2]
    h = (x[-1] - x[0]) / (len(x) - 1)
    return list(w / (w[0] * h)) if len(x) == 3 else list(w)


def t_critical(n: int, alpha: float = ALPHA) -> float:
    """The one-sided ``1 - alpha`` point of Student's t at ``n - 1`` degrees of freedom: ``(mean - m0) / SE``
    of ``n`` paired seeds follows it under the null (2.92 at n = 3, 2.13 at n = 5).  For independent
    arms ``n`` is the fewest runs of any arm, a conservative count of the degrees of freedom."""
    from scipy import stats as scipy_stats  # pylint: disable=import-outside-toplevel

    return float(scipy_stats.t.ppf(1.0 - alpha, max(n - 1, 1)))


def direction(est: Estimate, up: str, down: str, within: str = "within t SE",
              one_seed: str = "one seed: no standard error") -> str:
    """Which side of 0 ``est`` lies on by a one-sided t test at level :data:`ALPHA` with ``n - 1``
    degrees of freedom (:func:`t_critical`): ``up`` if ``value - t SE > 0``, ``down`` if
    ``value + t SE < 0``, else ``within``; ``one_seed`` with fewer than two seeds."""
    if est.n < 2:
        return one_seed
    t = t_critical(est.n)
    return up if est.value - t * est.se > 0 else down if est.value + t * est.se < 0 else within


def verdict(est: Estimate, above: float = 0.0, at_least: bool = False) -> str:
    """The claim "the quantity exceeds ``above``" by a one-sided t test at level :data:`ALPHA` with
    ``n - 1`` degrees of freedom (:func:`t_critical`): reproduced if ``value - t SE > above``
    (``>=`` when ``at_least``), not reproduced if ``value + t SE < above``, else inconclusive;
    inconclusive too with fewer than two seeds (no standard error)."""
    if est.n < 2:
        return INCONCLUSIVE
    t = t_critical(est.n)
    lo, hi = est.value - t * est.se, est.value + t * est.se
    if lo > above or (at_least and lo >= above):
        return REPRODUCED
    if hi < above:
        return NOT_REPRODUCED
    return INCONCLUSIVE


@dataclasses.dataclass(frozen=True)
class Ratio:
    """A ratio ``q = A / B`` of two contrasts with its Fieller interval: the values ``r`` for which the
    linear contrast ``A - r B`` is not rejected by a two-sided t test at level ``2 ALPHA`` (so each
    end is a one-sided 5% test).  ``resolved`` is False where ``B`` itself is not resolved from 0 by
    that test: then the interval is unbounded and no ratio is given."""

    value: float | None
    lo: float | None
    hi: float | None
    n: int
    paired: bool
    resolved: bool

    def text(self, pct: bool = False) -> str:
        if not self.resolved:
            return "- (gap unresolved)"
        f = (lambda x: f"{x:.0%}") if pct else (lambda x: f"{x:.2f}")
        return f"{f(self.value)} [{f(self.lo)}, {f(self.hi)}]"


def _variance_of(arms: Arms, coefs: dict) -> float:
    e = contrast(arms, coefs)
    return e.se ** 2


def fieller(arms: Arms, num: dict, den: dict) -> Ratio | None:
    """``A / B`` of the contrasts ``num`` and ``den`` by Fieller's theorem, from the linear test of
    ``A - r B`` (paired over seeds where the arms share them); None if an arm is missing."""
    a, b = contrast(arms, num), contrast(arms, den)
    if a is None or b is None:
        return None
    keys = set(num) | set(den)
    diff = {k: num.get(k, 0.0) - den.get(k, 0.0) for k in keys}
    vaa, vbb = a.se ** 2, b.se ** 2
    vab = (vaa + vbb - _variance_of(arms, diff)) / 2  # Var(A - B) = Vaa - 2 Vab + Vbb
    n, paired = min(a.n, b.n), a.paired and b.paired
    t = t_critical(n)
    qa = b.value ** 2 - t * t * vbb
    if n < 2 or qa <= 0:
        return Ratio(None, None, None, n, paired, False)
    qb = a.value * b.value - t * t * vab
    qc = a.value ** 2 - t * t * vaa
    root = math.sqrt(max(qb * qb - qa * qc, 0.0))
    return Ratio(a.value / b.value, (qb - root) / qa, (qb + root) / qa, n, paired, True)


def share(arms: Arms, arm: str, none: str, sync: str) -> Ratio | None:
    """The share ``s`` of the delay gap ``G = none - sync`` that ``arm`` recovers, ``G_arm = (1 - s) G``,
    from the linear test of ``G_arm - (1 - s) G`` (:func:`fieller`): no share where ``G`` is unresolved
    or not positive."""
    r = fieller(arms, {arm: 1.0, sync: -1.0}, {none: 1.0, sync: -1.0})
    if r is None or not r.resolved:
        return r
    if r.value is not None and contrast(arms, {none: 1.0, sync: -1.0}).value <= 0:
        return Ratio(None, None, None, r.n, r.paired, False)  # a delay that helps has no gap to recover
    return dataclasses.replace(r, value=1.0 - r.value, lo=1.0 - r.hi, hi=1.0 - r.lo)


def share_at_least(arms: Arms, arm: str, none: str, sync: str, s0: float) -> Estimate | None:
    """The contrast ``c = G_arm - (1 - s0) G``: the share exceeds ``s0`` where ``c < 0``."""
    return contrast(arms, {arm: 1.0, none: -(1.0 - s0), sync: -1.0 + (1.0 - s0)})
