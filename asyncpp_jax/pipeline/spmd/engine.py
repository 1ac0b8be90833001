"""The ``pipeline`` runner: one ``jax.shard_map`` over ``('data', 'stage')``, a ``lax.scan`` over the
lock-step slots of the schedule's program.

The engine is split by concern:

* :mod:`~asyncpp_jax.pipeline.schedules.programs`: every schedule as a program (per-device action lists),
  its generator, validator and simulator, and the delays: which weight version an action reads
  and which update its gradient joins (the one place the engine's delay lives);
* :mod:`~asyncpp_jax.pipeline.schedules.slot_plan`: a program compiled into lock-step slots and buffer
  entries (a flushless program's entries kept across steps);
* :mod:`~asyncpp_jax.pipeline.spmd.loop` and :mod:`~asyncpp_jax.pipeline.spmd.executor`: the
  one loop that runs any compiled program, and the reduction of its gradients;
* :mod:`~asyncpp_jax.pipeline.layout`: the mesh, where each leaf lives, the engine's parameter
  layout and the padded layer stack of an uneven split;
* :mod:`~asyncpp_jax.pipeline.spmd.state`: what a flushless program carries between steps, and the
  state's shardings;
* :mod:`~asyncpp_jax.pipeline.spmd.eval_step`: the forward-only eval step (a forward-only program);
* this module: the train step (which program runs when, and the update), and the names the
  rest of the package imports.

Stage ``s`` holds layers ``[s L/P, (s+1) L/P)`` (the stacked layer leaves are sharded on their
leading axis over ``stage``); the embedding, final norm and head are replicated, but only stage 0
runs the embedding and only stage ``P-1`` the final norm, head and loss
(:mod:`asyncpp_jax.pipeline.stage` says what each slot computes).  With
``config.pipeline.vocab_parallel`` the vocabulary-sized tables are split over ``stage`` instead
and every device joins the lookup and the loss (:mod:`~asyncpp_jax.pipeline.spmd.tables`).  The
params are held in the engine's layout (:func:`to_engine_layout`): a tied embedding table as the
head's ``[D, V]`` matrix, so nothing vocabulary-sized is ever transposed.

A flushed program (``sync``, ``1f1b``, ``interleaved``, ``zb-h1``) computes the gradient of batch
``t`` at ``w[t]``, applied at update ``t``, as in the ``simulate`` runner.  A flushless one never
drains: ``2bw`` applies at update ``t`` the gradient of batch ``t-1`` taken at ``w[t-1]``
(``optim.delay(1)``), ``pipedream`` stage ``s``'s gradient of batch ``t-(P-1-s)`` taken at that
batch's weights (``optim.delay`` with PipeDream's per-leaf delays).  Its weight versions, the
stash, the activations and cotangents in transit, the partial gradients and loss sums of later
updates and the tokens of the batches in flight live in :class:`PipelineState`, so they are
checkpointed.  ``optim.delay``'s conventions hold exactly: nothing is applied from a batch that
had not started (the fill), and what is in flight is dropped at a cooldown switch, where a
flushed ``1f1b`` step runs instead.  The logged loss of update ``t`` is the loss of the batch
whose last-stage gradient it applies.  The optimizer chain has no ``delay`` transform;
mitigations (error feedback) follow the same schedule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from asyncpp_jax.models.moe import with_expert_parallel
from asyncpp_jax.pipeline.options import EngineOptions
# The engine's public surface, from the modules that hold it (one concern each).
from asyncpp_jax.pipeline.spmd.eval_step import make_pipeline_eval_step  # noqa: F401
from asyncpp_jax.pipeline.spmd.executor import make_grads_fn
from asyncpp_jax.pipeline.layout import (check_layout, engine_layout, make_pipeline_mesh, pad_layers,  # noqa: F401
                                         padding_of, param_specs, stage_split, to_engine_layout, to_model_layout,
                                         unpad_layers, update_specs)
from asyncpp_jax.pipeline.spmd.state import (PipelineState, global_batch_sharding, init_pipeline_state,  # noqa: F401
                                        place_state, state_shardings)
from asyncpp_jax.pipeline.spmd.loop import SlotLoop
from asyncpp_jax.pipeline.spmd.tables import tables_of
from asyncpp_jax.train_state import TrainState, apply_update

def compile_loop(options: EngineOptions) -> SlotLoop:
    """The loop of the options' program: compiled into lock-step slots (``options.plan``), with the
    tables laid out as ``options.vocab_parallel`` says (:mod:`asyncpp_jax.pipeline.spmd.tables`).
    Raises ``programs.ProgramError`` for a program that breaks a rule."""
    return SlotLoop(options.plan, tables_of(options.vocab_parallel))


def make_pipeline_train_step(model_cfg, optimizer, schedule: optax.Schedule, mesh, params_abstract,
                             options: EngineOptions):
    """Jitted ``train_step(state, batch) -> (state, metrics)`` with ``state.runner_state`` a
    :class:`PipelineState` (a flushless program) or ``None`` (a flushed one).  ``schedule``: the
    learning rate's; ``options`` (:class:`~asyncpp_jax.pipeline.options.EngineOptions`): the
    program and everything else the engine is told.  Under a flushless program
    ``options.delay_schedule`` says which updates are synchronous (start, cooldown): those run the
    flushed ``1f1b`` program and drop what is in flight, as ``delay`` does.

    With ``options.weight_prediction`` (SpecTrain / PipeMare,
    :mod:`asyncpp_jax.optim.prediction`; ``2bw``) batch ``t``'s microbatches run their forward
    and backward slots at ``ŵ_t = w_t + δ_t`` instead of ``w_t`` (the version carried is then
    ``ŵ_t``), so update ``t+1`` applies ``∇L(ŵ_t; batch t)``, exactly the simulate runner's
    ``delay(1)`` with the same prediction.

    ``params_abstract`` is in the engine's layout: padded (:func:`pad_layers`) for an uneven split
    (``options.stage_rows``), and with the layer stack in virtual-stage order under
    ``interleaved`` (``to_engine_layout(..., interleave=(P, virtual_stages))``).  The settings are
    checked by the config's validator (``configs.validate``) and the program's
    (``programs.validate``)."""
    n_stages = mesh.shape["stage"]
    expert_parallel, vocab_parallel = options.expert_parallel, options.vocab_parallel
    weight_prediction = options.weight_prediction
    check_layout(model_cfg, params_abstract, n_stages, options.stage_rows)
    if expert_parallel:  # experts sharded over ``data``: the MoE layers exchange tokens with all_to_all
        model_cfg = with_expert_parallel(model_cfg, "data", mesh.shape["data"])
    loop = compile_loop(options)
    flushless, D = options.flushless, options.delay
    if flushless:
        delayed_fn = make_grads_fn(model_cfg, mesh, loop, params_abstract, options, carries_state=True)
        flushed_fn = make_grads_fn(model_cfg, mesh, compile_loop(options.transition()), params_abstract, options,
                                   carries_state=True)
        delay_schedule = options.in_force()
    else:
        flushed_fn = make_grads_fn(model_cfg, mesh, loop, params_abstract, options, carries_state=False)
        delay_schedule = options.delay_schedule

    update_shardings = jax.tree.map(functools.partial(NamedSharding, mesh),
                                    update_specs(params_abstract, n_stages, expert_parallel, vocab_parallel))

    def train_step(state: TrainState, batch):
        ps = state.runner_state
        if not flushless:
            grads, stats, ps = flushed_fn((state.params,), batch, None, jnp.ones((1,), bool), state.step)
        else:
            velocity = ps.prediction
            point = state.params if velocity is None else weight_prediction.predicted_point(state.params, velocity)
            versions = (point,) + tuple(ps.weight_versions)
            live = jnp.stack([jnp.bool_(True)] + [delay_schedule.in_force(state.step - k) for k in range(1, D + 1)])
            inner = ps._replace(weight_versions=(), prediction=None)
            delayed = lambda: delayed_fn(versions, batch, inner, live, state.step)  # noqa: E731
            if delay_schedule.always_in_force:  # no synchronous phase: compile the delayed program only
                grads, stats, ps = delayed()
            else:
                grads, stats, ps = jax.lax.cond(delay_schedule.in_force(state.step), delayed,
                                                lambda: flushed_fn(versions[:1], batch, inner, live[:1], state.step))
            ps = ps._replace(weight_versions=versions[:D], prediction=velocity,
                             batches=jnp.concatenate([batch[None], inner.batches[:-1]]))
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
        return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh, params_abstract, options)), metrics

    if flushless and weight_prediction is None:  # the version carried is the weights read: w[t] by reference
        return ShiftByReference(train_step)
    return jax.jit(train_step, donate_argnums=0)


class ShiftByReference:
    """A flushless program's train step with its weight-version shift made outside the compiled program.

    Update ``t`` reads ``w[t]`` and keeps it as the newest previous version: the versions
    ``(w[t-1], ..., w[t-D])`` become ``(w[t], ..., w[t-D+1])``.  In one jitted step with the whole
    state donated, ``w[t+1]`` is written over ``w[t]``'s buffers, so ``w[t]`` must be copied into
    the versions', and XLA:CPU also copies the versions into the loop: copies of the weights a step
    in the compiled step (section 8 of docs/design.md: a copy is a cost the size of the buffer).
    Here the compiled step takes ``w[t]`` and the versions still needed undonated beside the rest
    of the state (donated, with the oldest version ``w[t-D]``), writes ``w[t+1]`` into ``w[t-D]``'s
    buffers, and the kept arrays become the new versions as they are.  The same ``jit`` API:
    call, ``trace``, ``lower``."""

    def __init__(self, train_step):
        def step(rest: TrainState, params, kept: tuple, batch):
            ps = rest.runner_state
            state = rest.replace(params=params, runner_state=ps._replace(weight_versions=kept + ps.weight_versions))
            state, metrics = train_step(state, batch)
            ps = state.runner_state._replace(weight_versions=())  # ``params`` and ``kept``, handed back by reference
            return state.replace(params=None, runner_state=ps), state.params, metrics

        self._jit = jax.jit(step, donate_argnums=0)

    @staticmethod
    def _args(state: TrainState, batch) -> tuple:
        ps = state.runner_state
        rest = state.replace(params=None, runner_state=ps._replace(weight_versions=ps.weight_versions[-1:]))
        return rest, state.params, tuple(ps.weight_versions[:-1]), batch

    def __call__(self, state: TrainState, batch):
        kept = tuple(state.runner_state.weight_versions[:-1])
        out, params, metrics = self._jit(*self._args(state, batch))
        versions = (state.params,) + kept
        return out.replace(params=params, runner_state=out.runner_state._replace(weight_versions=versions)), metrics

    def trace(self, state: TrainState, batch):
        return self._jit.trace(*self._args(state, batch))

    def lower(self, state: TrainState, batch):
        return self._jit.lower(*self._args(state, batch))
