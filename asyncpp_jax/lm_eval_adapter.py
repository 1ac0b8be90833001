"""The project's JAX model as an lm-evaluation-harness model (``lm_eval.api.model.LM``).

Imports ``lm_eval`` (an optional dependency: ``pip install 'lm-eval>=0.4,<0.5'``); the arithmetic
lives in :class:`asyncpp_jax.evaluate.Scorer`, which does not.  ``python -m asyncpp_jax.evaluate``
is the command; from Python::

    from asyncpp_jax import lm_eval_adapter, trained
    from asyncpp_jax.evaluate import Scorer
    m = trained.load("runs/tiny")
    results = lm_eval_adapter.evaluate(Scorer(m.model_cfg, m.params, m.tokenizer, m.config.data.seq_len),
                                       ["arc_easy"], limit=100)

``lm_eval.simple_evaluate(model="asyncpp_jax", model_args="workdir=runs/tiny")`` works too once this
module is imported (it registers the model under that name).
"""

from __future__ import annotations

import lm_eval
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager

from asyncpp_jax.evaluate import Scorer


class UnknownTasks(ValueError):
    """Task names lm-eval does not know; the message lists them."""


@register_model("asyncpp_jax")
class AsyncppLM(LM):
    """lm-eval's three request types answered by a :class:`Scorer` (built from ``workdir``, or given)."""

    def __init__(self, workdir: str | None = None, step: int | None = None, batch_size: int | str | None = 8,
                 max_length: int | None = None, scorer: Scorer | None = None, **_unused):
        super().__init__()
        if scorer is None:
            from asyncpp_jax import trained  # pylint: disable=import-outside-toplevel

            if workdir is None:
                raise ValueError("model_args needs workdir=RUN (a run directory)")
            m = trained.load(workdir, None if step is None else int(step))
            size = int(batch_size) if str(batch_size or "").isdigit() else 8
            scorer = Scorer(m.model_cfg, m.params, m.tokenizer, int(max_length or m.config.data.seq_len), size)
        self.scorer = scorer

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood([r.args for r in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        return self.scorer.loglikelihood_rolling([r.args[0] for r in requests])

    def generate_until(self, requests) -> list[str]:
        return self.scorer.generate_until([r.args for r in requests])

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def eot_token_id(self) -> int:
        return self.scorer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return repr(self.scorer.tokenizer)


def evaluate(scorer: Scorer, tasks: list[str], include_path: str | None = None, limit: float | None = None,
             num_fewshot: int | None = None, log_samples: bool = False) -> dict:
    """``lm_eval.simple_evaluate`` of ``tasks`` on the scorer's model; lm-eval's results dict."""
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = f" or in {include_path}" if include_path else " (pass --include_path=DIR for your own task YAML files)"
        raise UnknownTasks(f"--tasks: lm-eval has no task {', '.join(unknown)}{where}; "
                           "lm_eval --tasks list prints the known ones.")
    limit = int(limit) if limit is not None and limit >= 1 else limit
    return lm_eval.simple_evaluate(model=AsyncppLM(scorer=scorer), tasks=tasks, num_fewshot=num_fewshot,
                                   limit=limit, task_manager=manager, log_samples=log_samples,
                                   batch_size=scorer.batch_size)


def table(results: dict) -> str:
    """lm-eval's results table (Markdown)."""
    from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel

    return make_table(results)
