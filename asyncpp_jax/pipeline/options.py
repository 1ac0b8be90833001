"""What the pipeline engine is told about a run, as one frozen object.

:class:`EngineOptions` is built once, where the runner is built (``asyncpp_jax.train.runner.build``
reads the config into it), and handed whole to everything that runs a pipeline: the train step
and its state (:mod:`~asyncpp_jax.pipeline.spmd.engine`), the eval step, the ``mpmd`` placement
(:mod:`~asyncpp_jax.pipeline.mpmd.engine`) and the dry run.  The schedule's name is read here
only: past this object a schedule is its program (:attr:`EngineOptions.program`), and what the
engine does is read off the program (flushed or not, its delays, chunks, a split backward).
The config's validator has checked every rule before this is built; the program's own rules are
checked by :func:`~asyncpp_jax.pipeline.schedules.programs.validate` when it is generated.
"""

from __future__ import annotations

import dataclasses
import functools

from asyncpp_jax.optim.prediction import WeightPrediction
from asyncpp_jax.optim.staleness import DelaySchedule
from asyncpp_jax.pipeline.schedules import programs, slot_plan

# The flushed program a flushless run steps with at a synchronous start or cooldown.
TRANSITION_SCHEDULE = "1f1b"


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The engine's settings for one run (``config.pipeline.*`` and what the config implies).

    ``schedule``: a registered generator (``programs.GENERATORS``); ``virtual_stages``: model
    chunks per device (``interleaved``; 1 otherwise); ``stage_rows``: an uneven split as rows of
    the padded layer stack per stage (``layout.stage_split``), None for an even one;
    ``delay_schedule``: which updates a flushless program runs delayed (``optim.delay_schedule``:
    a synchronous start and cooldown run :data:`TRANSITION_SCHEDULE` instead); ``weight_prediction``:
    SpecTrain / PipeMare's predicted weights for a flushless program's actions (or None)."""

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int = 1
    recompute: bool = True
    vocab_parallel: bool = False  # the vocabulary-sized tables split over ``stage``
    expert_parallel: bool = False  # routed experts sharded over ``data``
    placement: str = "spmd"  # "spmd": one program over the mesh; "mpmd": one program per stage
    stage_rows: tuple | None = None
    delay_schedule: DelaySchedule | None = None
    weight_prediction: WeightPrediction | None = None

    @functools.cached_property
    def program(self) -> programs.Program:
        """The schedule's validated program (raises ``programs.ProgramError`` on a broken rule)."""
        v = self.virtual_stages if self.virtual_stages > 1 else None
        return programs.validate(programs.generate(self.schedule, self.stages, self.microbatches, v))

    @functools.cached_property
    def plan(self) -> slot_plan.SlotPlan:
        """The program compiled into lock-step slots and buffer entries (what the ``spmd`` step scans)."""
        return slot_plan.compile_program(self.program, self.recompute)

    @property
    def flushless(self) -> bool:
        return self.program.flushless

    @property
    def delay(self) -> int:
        """The program's delay ``D``: how many weight versions besides the current one it reads."""
        return self.program.delay

    @property
    def chunks(self) -> int:
        return self.program.chunks

    def in_force(self) -> DelaySchedule:
        """The delay schedule of a flushless program (delayed at every update when none was given)."""
        return self.delay_schedule or DelaySchedule(self.delay)

    def transition(self) -> EngineOptions:
        """These options with the flushed program a flushless run steps with where its delay is
        not in force (a synchronous start or cooldown)."""
        return dataclasses.replace(self, schedule=TRANSITION_SCHEDULE, virtual_stages=1, delay_schedule=None,
                                   weight_prediction=None)
