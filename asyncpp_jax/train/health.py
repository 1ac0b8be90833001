"""Which checkpoints a run may call good, and when a model has died mid-run.

A finite checkpoint is not yet a good one: a learning rate far too high can leave finite weights
so saturated that every later gradient is exactly 0 (the engine's 2bw at lr=1e4 reaches weights of
6e9 before its first NaN).  Resumed at a sane learning rate, such a checkpoint cannot train.  So a
checkpoint at step ``s`` is *good* only once the updates that show its weights were *live*:

- an update is live when its loss and gradient norm are finite, the gradient norm is above 0 (where
  a gradient was applied) and the cross-entropy is not pinned at log(vocab) (uniform predictions);
- the checkpoint holds w_s, which first shows in the logged loss of update s + 1 + lag (lag = 1 for
  the pipeline engine's 2bw, which logs the loss of the batch an update applies, computed one version
  earlier; 0 otherwise), and, under a delay d, gradients in flight computed at w_{s-d} ... w_{s-1};
- so it is good when every update in [s - d + 1, s + 1 + lag] (those after the run's start) was live.

Checkpoints older than the run's start were trained past by an earlier run and count as good.  A
run that stops on a divergence sets the others aside (trainer), so a rerun resumes from a good one.
"""

from __future__ import annotations

import math

from asyncpp_jax import configs
from asyncpp_jax.pipeline.options import EngineOptions
from asyncpp_jax.pipeline.schedules.programs import Offsets

DEAD_UPDATES = 3  # consecutive dead updates after which a run stops: the model has died


def window(c, options: EngineOptions | None = None) -> tuple[int, int]:
    """``(d, lag)``: the largest gradient delay under ``c``, and the lag of the logged loss: under
    the pipeline engine (``options``, the runner's) its program's, the logged loss of update ``t``
    being the batch whose last-stage gradient it applies (``2bw``: ``t - 1``; ``pipedream``: ``t``)."""
    st = configs.effective_staleness(c)
    delay = {"2bw": 1, "pipedream": st.pipedream_stages - 1}.get(st.mode, 0)
    lag = 0 if options is None else Offsets.of(options.program, c.model.tie_embeddings).delay("stats")
    return delay, lag


class Health:
    """Follows a run's updates: which are live, which checkpoints are good, whether the model died."""

    def __init__(self, c, start: int, options: EngineOptions | None = None):
        self.delay, self.lag = window(c, options)
        self.start = start
        self.uniform = math.log(c.model.vocab_size)
        self.observed = start  # the last update seen
        self.dead: dict[int, str] = {}  # update -> why it was not live
        self._streak = 0  # consecutive dead updates that applied a gradient

    def why_dead(self, metrics: dict) -> str | None:
        """Why an update is not live, or None.  ``metrics`` without a loss: a fill update, which applies
        no gradient, so only finiteness is asked of it."""
        g = float(metrics["grad_norm"])
        if "loss" not in metrics:
            return None if math.isfinite(g) else f"grad norm {g}"
        ce = float(metrics.get("ce", metrics["loss"]))
        if not (math.isfinite(ce) and math.isfinite(g)):
            return f"loss {ce}, grad norm {g}"
        if g == 0.0:
            return "grad norm exactly 0"
        if abs(ce - self.uniform) <= 1e-6 * self.uniform:
            return f"loss pinned at log(vocab_size) = {self.uniform:.6f}"
        return None

    def observe(self, step: int, metrics: dict) -> str | None:
        """Record update ``step``; returns why it was dead, or None."""
        why = self.why_dead(metrics)
        self.observed = step
        if why is None:
            if "loss" in metrics:  # a fill update neither counts nor breaks the streak
                self._streak = 0
        else:
            self.dead[step] = why
            self._streak += "loss" in metrics
        return why

    def died(self) -> bool:
        """The last :data:`DEAD_UPDATES` updates that applied a gradient were all dead."""
        return self._streak >= DEAD_UPDATES

    def is_good(self, step: int) -> bool:
        if step < self.start:
            return True
        first, last = max(step - self.delay + 1, self.start + 1), step + 1 + self.lag
        return last <= self.observed and not any(u in self.dead for u in range(first, last + 1))

    def newest_good(self, steps) -> int | None:
        good = [s for s in steps if self.is_good(s)]
        return max(good) if good else None

    def first_dead(self) -> tuple[int, str] | None:
        """The first update that was not live, and why."""
        return min(self.dead.items()) if self.dead else None
