"""The ``pipeline`` runner: one ``jax.shard_map`` over ``('data', 'stage')``, a ``lax.scan`` over ticks.

The engine is split by concern:

* :mod:`~asyncpp_jax.pipeline.layout`: the mesh, where each leaf lives, the engine's parameter
  layout and the padded layer stack of an uneven split;
* :mod:`~asyncpp_jax.pipeline.state`: what a ``2bw`` run carries between steps, and the state's
  shardings;
* :mod:`~asyncpp_jax.pipeline.executor`: one step's loop (the tick tables' by default) and the
  reduction of its gradients; :mod:`~asyncpp_jax.pipeline.program_executor`: the loop of a program
  compiled into slots;
* :mod:`~asyncpp_jax.pipeline.eval_step`: the forward-only eval step;
* this module: the train step (which tick table runs when, and the update), and the names the
  rest of the package imports.

Stage ``s`` holds layers ``[s L/P, (s+1) L/P)`` (the stacked layer leaves are sharded on their
leading axis over ``stage``); the embedding, final norm and head are replicated, but only stage 0
runs the embedding and only stage ``P-1`` the final norm, head and loss
(:mod:`asyncpp_jax.pipeline.stage` says what each slot computes).  With
``config.pipeline.vocab_parallel`` the vocabulary-sized tables are split over ``stage`` instead
and every device joins the lookup and the loss (:mod:`~asyncpp_jax.pipeline.vocab_loop`).  The params are held in the
engine's layout (:func:`to_engine_layout`): a tied embedding table as the head's ``[D, V]`` matrix,
so nothing vocabulary-sized is ever transposed.

``sync`` flushes each step: the gradient of batch ``t`` at ``w[t]`` is applied at update ``t``,
as in the ``simulate`` runner; a step is ``M + 2P - 2`` ticks of one forward and one backward each,
and stage 0 stashes up to ``2P - 1`` microbatches.  ``1f1b`` computes the same update from the
textbook 1F1B program (:mod:`~asyncpp_jax.pipeline.programs`), compiled into lock-step slots of one
action each (:mod:`~asyncpp_jax.pipeline.slot_plan`, :mod:`~asyncpp_jax.pipeline.program_executor`):
stage 0 stashes at most ``P``.  ``interleaved`` runs Megatron's interleaved 1F1B the same way, each
device holding ``v`` chunks of layers (virtual stage ``c P + d``; the layer stack is held in that
order, :func:`~asyncpp_jax.pipeline.layout.interleave_index`), the last device's chunk ``c``
feeding device 0's chunk ``c + 1``.
``2bw`` never flushes (:class:`~asyncpp_jax.pipeline.tick_tables.OneStepDelay`, beside the
tick tables, is where its delay lives): the stash ring, the
activations and cotangents in transit, the in-flight batch's partial gradient and loss sums, the
previous weight version and the previous batch's tokens live in :class:`PipelineState` (so they
are checkpointed), and update ``t`` applies the gradient of batch ``t-1`` taken at ``w[t-1]``:
``optim.delay``'s conventions exactly (fill at the first delayed update, in-flight batch dropped
at a cooldown switch).  The logged loss of update ``t`` is that batch's loss at those weights.
The optimizer chain has no ``delay`` transform; mitigations (error feedback) follow the same
schedule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from asyncpp_jax.models.moe import with_expert_parallel
from asyncpp_jax.optim.prediction import WeightPrediction
from asyncpp_jax.optim.staleness import DelaySchedule
from asyncpp_jax.pipeline import programs, slot_plan, tick_tables
# The engine's public surface, from the modules that hold it (one concern each).
from asyncpp_jax.pipeline.eval_step import make_pipeline_eval_step  # noqa: F401
from asyncpp_jax.pipeline.executor import TickLoop, make_grads_fn
from asyncpp_jax.pipeline.layout import (check_layout, engine_layout, make_pipeline_mesh, pad_layers,  # noqa: F401
                                         padding_of, param_specs, stage_split, to_engine_layout, to_model_layout,
                                         unpad_layers, update_specs)
from asyncpp_jax.pipeline.state import (PipelineState, global_batch_sharding, init_pipeline_state,  # noqa: F401
                                        place_state, state_shardings)
from asyncpp_jax.pipeline.program_executor import SlotLoop
from asyncpp_jax.pipeline.vocab_loop import VocabSlotLoop, VocabTickLoop
from asyncpp_jax.train_state import TrainState, apply_update

PROGRAM_SCHEDULES = ("1f1b", "interleaved", "zb-h1")  # flushed schedules the program executor runs


def sync_loop(pipeline_schedule: str, n_stages: int, microbatches: int, recompute: bool = True,
              virtual_stages: int = 1, vocab_parallel: bool = False):
    """The loop of a flushed step: a schedule's program in lock-step slots (``1f1b``,
    ``interleaved`` with ``virtual_stages`` chunks: :mod:`asyncpp_jax.pipeline.program_executor`),
    or the ``sync`` tick table (also ``2bw``'s synchronous start and cooldown); with
    ``vocab_parallel``, the same loop with the tables split over ``stage``
    (:mod:`asyncpp_jax.pipeline.vocab_loop`)."""
    if pipeline_schedule == "interleaved" and virtual_stages < 2:
        raise ValueError(f"the interleaved schedule needs virtual_stages >= 2, got {virtual_stages}.")
    if pipeline_schedule in PROGRAM_SCHEDULES:
        v = virtual_stages if pipeline_schedule == "interleaved" else None
        program = programs.generate(pipeline_schedule, n_stages, microbatches, v)
        return (VocabSlotLoop if vocab_parallel else SlotLoop)(slot_plan.compile_program(program, recompute))
    return (VocabTickLoop if vocab_parallel else TickLoop)(tick_tables.sync_table(n_stages, microbatches), recompute)


def make_pipeline_train_step(model_cfg, optimizer, schedule: optax.Schedule, mesh, params_abstract,
                             microbatches: int, pipeline_schedule: str, delay_schedule: DelaySchedule | None = None,
                             expert_parallel: bool = False, recompute: bool = True,
                             weight_prediction: WeightPrediction | None = None, stage_rows: tuple | None = None,
                             virtual_stages: int = 1, vocab_parallel: bool = False):
    """Jitted ``train_step(state, batch) -> (state, metrics)`` with ``state.runner_state`` a
    :class:`PipelineState` (``2bw``) or ``None`` (``sync``).  Under ``2bw`` the
    ``delay_schedule`` (``optim.delay_schedule``) says which updates are synchronous (start,
    cooldown): those run the flushed ``sync`` table and drop what is in flight, as ``delay`` does.

    With ``weight_prediction`` (SpecTrain / PipeMare, :mod:`asyncpp_jax.optim.prediction`) batch
    ``t``'s microbatches run their forward and backward slots at ``ŵ_t = w_t + δ_t`` instead of
    ``w_t`` (the version carried as ``prev_params`` is then ``ŵ_t``), so update ``t+1`` applies
    ``∇L(ŵ_t; batch t)``, exactly the simulate runner's ``delay(1)`` with the same prediction.

    ``stage_rows`` (:func:`stage_split`): an uneven split, with ``params_abstract`` and the state
    in the padded layout of :func:`pad_layers`.  ``virtual_stages``: chunks per device of the
    ``interleaved`` schedule, with the params' layer stack in that order
    (``to_engine_layout(..., interleave=(P, virtual_stages))``).  ``vocab_parallel``: each
    vocabulary-sized table split along its vocabulary over ``stage``
    (:mod:`asyncpp_jax.pipeline.vocab_parallel`), under every schedule."""
    if weight_prediction is not None and pipeline_schedule != "2bw":
        raise ValueError("weight prediction corrects the 2bw delay: config.pipeline.schedule must be '2bw', "
                         f"not {pipeline_schedule!r} (or set config.staleness.weight_prediction=False).")
    n_stages = mesh.shape["stage"]
    if n_stages < 2:
        raise ValueError(f"the pipeline engine needs config.pipeline.stages >= 2, got {n_stages}.")
    check_layout(model_cfg, params_abstract, n_stages, stage_rows)
    if (pipeline_schedule == "interleaved") != (virtual_stages > 1):
        raise ValueError(f"virtual_stages={virtual_stages} with schedule {pipeline_schedule!r}: the interleaved "
                         "schedule needs virtual_stages >= 2 (and the params in its layout), every other one 1.")
    if expert_parallel:  # experts sharded over ``data``: the MoE layers exchange tokens with all_to_all
        model_cfg = with_expert_parallel(model_cfg, "data", mesh.shape["data"])
    is_2bw = pipeline_schedule == "2bw"
    if vocab_parallel and model_cfg.vocab_size % n_stages:
        raise ValueError(f"config.pipeline.vocab_parallel=True splits the vocabulary over config.pipeline.stages="
                         f"{n_stages}, which does not divide config.model.vocab_size={model_cfg.vocab_size}: pad the "
                         f"vocabulary to a multiple of {n_stages} or set vocab_parallel=False.")
    kw = dict(carries_state=is_2bw, params_abstract=params_abstract, expert_parallel=expert_parallel,
              recompute=recompute, stage_rows=stage_rows)
    loop = sync_loop(pipeline_schedule, n_stages, microbatches, recompute, virtual_stages, vocab_parallel)
    sync_fn = make_grads_fn(model_cfg, mesh, loop, False, **kw)
    async_fn = None
    if is_2bw:
        tick_loop = VocabTickLoop if vocab_parallel else TickLoop
        async_fn = make_grads_fn(model_cfg, mesh, tick_loop(tick_tables.async_table(n_stages, microbatches), recompute),
                                  True, **kw)
        delay_schedule = delay_schedule or DelaySchedule(1)

    update_shardings = jax.tree.map(functools.partial(NamedSharding, mesh),
                                    update_specs(params_abstract, n_stages, expert_parallel, vocab_parallel))

    def train_step(state: TrainState, batch):
        ps = state.runner_state
        if async_fn is None:
            grads, stats, ps = sync_fn(state.params, state.params, batch, ps, jnp.bool_(False), state.step)
        else:
            velocity = ps.prediction
            point = state.params if velocity is None else weight_prediction.predicted_point(state.params, velocity)
            args = (point, ps.prev_params, batch, ps._replace(prediction=None))
            prev_live = delay_schedule.in_force(state.step - 1)
            if delay_schedule.always_in_force:  # no synchronous phase: compile the delayed program only
                grads, stats, ps = async_fn(*args, prev_live, state.step)
            else:
                grads, stats, ps = jax.lax.cond(delay_schedule.in_force(state.step),
                                                lambda: async_fn(*args, prev_live, state.step),
                                                lambda: sync_fn(*args, prev_live, state.step))
        old_params = state.params
        # The update runs where its gradient lives: each replicated leaf's weights are sliced to
        # their split layout (local, no transfer), so the optimizer's elementwise work on them runs
        # once over the mesh; only the new weights are gathered, by the constraint below.
        state = state.replace(params=jax.lax.with_sharding_constraint(state.params, update_shardings))
        state, metrics = apply_update(state, grads, stats, ps, optimizer, schedule, delay_schedule)
        if weight_prediction is not None:
            state = state.replace(runner_state=ps._replace(
                prediction=weight_prediction.push(old_params, state.params, velocity)))
        # Keep the layout fixed across steps: weights where the stages read them, the optimizer
        # state of the replicated leaves split over ``stage`` (:func:`update_specs`).
        return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh, params_abstract,
                                                                       expert_parallel, vocab_parallel)), metrics

    if is_2bw and weight_prediction is None:  # the version carried is the weights read: w[t] by reference
        return ShiftByReference(train_step)
    return jax.jit(train_step, donate_argnums=0)


class ShiftByReference:
    """``2bw``'s train step with its weight-version shift made outside the compiled program.

    Update ``t`` reads ``w[t]`` and keeps it as the previous version: ``prev[t+1] = w[t]``.  In
    one jitted step with the whole state donated, ``w[t+1]`` is written over ``w[t]``'s buffers,
    so ``w[t]`` must be copied into ``prev``'s, and XLA:CPU also copies both versions into the
    tick loop: three copies of the weights a step in the compiled step (section 8 of
    docs/design.md: a copy is a cost the size of the buffer), two of them alive during the loop.
    Here the compiled step takes ``w[t]`` undonated beside the rest of the state (donated, with
    ``prev = w[t-1]``), writes ``w[t+1]`` into ``w[t-1]``'s buffers, and ``w[t]``'s arrays become
    ``prev_params`` as they are.  The same ``jit`` API: call, ``trace``, ``lower``."""

    def __init__(self, train_step):
        def step(rest: TrainState, params, batch):
            state, metrics = train_step(rest.replace(params=params), batch)
            ps = state.runner_state._replace(prev_params=None)  # ``params`` itself, handed back by reference
            return state.replace(params=None, runner_state=ps), state.params, metrics

        self._jit = jax.jit(step, donate_argnums=0)

    @staticmethod
    def _args(state: TrainState, batch) -> tuple:
        return state.replace(params=None), state.params, batch

    def __call__(self, state: TrainState, batch):
        out, params, metrics = self._jit(*self._args(state, batch))
        return out.replace(params=params, runner_state=out.runner_state._replace(prev_params=state.params)), metrics

    def trace(self, state: TrainState, batch):
        return self._jit.trace(*self._args(state, batch))

    def lower(self, state: TrainState, batch):
        return self._jit.lower(*self._args(state, batch))
