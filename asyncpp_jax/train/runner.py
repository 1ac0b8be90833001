"""Build the runner a config asks for: mesh, optimizer chain, ``train_step``, and the state layout.

Shared by the trainer and the dry run, so the dry run compiles exactly the program a real run
executes.  ``simulate`` is one jitted data-parallel program (the delay, if any, in the optimizer
chain or, for exact PipeDream, in the runner's weight history); ``pipeline`` is the
``shard_map`` engine over ``('data', 'stage')``, or with ``pipeline.placement='mpmd'`` one
program per stage (:mod:`asyncpp_jax.pipeline.mpmd`); the runners share one contract.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import optax

from asyncpp_jax import configs
from asyncpp_jax import train_state as state_lib
from asyncpp_jax.models import abstract_params, hf_llama
from asyncpp_jax.optim import build_optimizer, delay_schedule, weight_prediction, weight_versions
from asyncpp_jax.pipeline import engine, make_mesh, mpmd, slot_plan
from asyncpp_jax.train import step as step_lib


@dataclasses.dataclass
class Runner:
    config: Any
    mesh: jax.sharding.Mesh
    data_size: int
    pipelined: bool
    shapes: Any  # abstract params as the state holds them (the engine's layout, engine.to_engine_layout)
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    train_step: Callable
    weight_versions: Any  # what runner_state holds: optim.WeightVersions (exact PipeDream) or WeightPrediction
    # config.pipeline.stage_layers as rows of the layer stack per stage (engine.stage_split); None:
    # an even split (or no pipeline), no padding
    stage_rows: tuple | None = None
    model_shapes: Any = None  # abstract params of the model itself (its own layout): what to count or export

    def __post_init__(self):
        if self.model_shapes is None:
            self.model_shapes = self.shapes

    @property
    def interleave(self) -> tuple | None:
        """``(stages, virtual_stages)`` of an interleaved layer stack (``configs.interleave_of``), or None."""
        return configs.interleave_of(self.config) if self.pipelined else None

    @property
    def vocab_parallel(self) -> bool:
        """Whether the engine splits the vocabulary-sized tables over its stages."""
        return self.pipelined and bool(self.config.pipeline.get("vocab_parallel", False))

    @property
    def mpmd(self) -> bool:
        """Whether the engine runs one program per stage (``config.pipeline.placement='mpmd'``)."""
        return self.pipelined and configs.is_mpmd(self.config)

    @property
    def chunks(self) -> int:
        """Layer chunks per device: ``virtual_stages`` under ``interleaved``, else 1."""
        return (self.interleave or (0, 1))[1]

    def schedule_plan(self) -> slot_plan.SlotPlan | None:
        """What the engine's step runs, printable (``render()``, ``useful_fraction()``): the
        schedule's program in lock-step slots (under ``mpmd``, its program)."""
        c = self.config
        if not self.pipelined:
            return None
        if self.mpmd:
            return self.train_step.delayed if c.pipeline.schedule == "2bw" else self.train_step.flushed
        return slot_plan.compile_schedule(c.pipeline.schedule, c.pipeline.stages, c.train.microbatches,
                                          c.pipeline.recompute, self.chunks)

    def init_fn(self) -> Callable:
        """``init(key) -> state`` for a fresh run (the trainer jits it with the state's shardings).
        With ``config.model.init_from = 'hf:DIR'`` the weights are read from that Hugging Face
        checkpoint (checked against ``config.model`` now, read when the jitted init runs)."""
        return self._init(self._pretrained())

    def _pretrained(self) -> Callable | None:
        """The reader of ``config.model.init_from = 'hf:DIR'``'s weights (checked now), or None."""
        source = self.config.model.get("init_from", "")
        return hf_llama.params_initializer(self.config.model, source[len("hf:"):]) if source else None

    def init_state(self, key):
        """A fresh train state on the mesh (the trainer's start): the jitted :meth:`init_fn` with
        the state's shardings, or under ``mpmd`` each group initialised on its own devices."""
        if self.mpmd:
            pretrained = self._pretrained()
            return mpmd.init_state(self.config.model, self.train_step, key,
                                   pretrained() if pretrained is not None else None)
        shardings = jax.tree.map(lambda x: x.sharding, self.abstract_state(key))
        return jax.jit(self.init_fn(), out_shardings=shardings)(key)

    def _init(self, pretrained: Callable | None) -> Callable:
        c = self.config

        def init(key):
            # The weights are initialised as the simulate runner's (same key, same values), or read
            # from a checkpoint, then put in the engine's layout; the optimizer is initialised on that layout.
            state = state_lib.init_state(c.model, self.optimizer, key,
                                         None if self.pipelined else self.weight_versions,
                                         layout=engine.engine_layout(c.model, self.stage_rows, self.interleave)
                                         if self.pipelined
                                         else None, params=pretrained() if pretrained is not None else None)
            if self.pipelined:
                state = state.replace(runner_state=engine.init_pipeline_state(
                    c.model, state.params, self.mesh, c.train.microbatches, c.train.global_batch_size,
                    c.data.seq_len, c.pipeline.schedule, c.pipeline.recompute, c.mesh.expert_parallel,
                    self.weight_versions, stage_rows=self.stage_rows))
            return state

        return init

    def state_shardings(self, abstract_state):
        if self.pipelined:
            return engine.state_shardings(abstract_state, self.mesh, self.shapes, self.config.mesh.expert_parallel,
                                          self.vocab_parallel)
        return jax.tree.map(lambda _: state_lib.replicated(self.mesh), abstract_state)

    def abstract_state(self, key):
        """The train state as sharded ``ShapeDtypeStruct``s: nothing is allocated."""
        if self.mpmd:
            return mpmd.abstract_state(self.train_step, self.shapes)
        abstract = jax.eval_shape(self._init(None), key)  # an imported checkpoint has these shapes too
        shardings = self.state_shardings(abstract)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)

    def eval_step(self) -> Callable:
        """Jitted ``eval_step(params, batch[B, T+1]) -> (loss sum, token count)``: under the
        pipeline engine forward-only through the stages, so the model is never gathered."""
        c = self.config
        rows = c.train.global_batch_size // c.train.microbatches // self.data_size
        if self.mpmd:
            return mpmd.MpmdEvalStep(c.model, self.mesh, rows, c.mesh.expert_parallel)
        if self.pipelined:
            return engine.make_pipeline_eval_step(c.model, self.mesh, self.shapes, rows, c.mesh.expert_parallel,
                                                  stage_rows=self.stage_rows, chunks=self.chunks,
                                                  vocab_parallel=self.vocab_parallel)
        return step_lib.make_eval_step(c.model, self.mesh)

    def eval_group(self) -> int:
        """How many eval batches (of one training microbatch each) one eval call takes: the
        pipeline streams ``M`` microbatches through its stages at once, as in training."""
        return self.config.train.microbatches if self.pipelined else 1

    def batch_sharding(self):
        return jax.sharding.NamedSharding(self.mesh, state_lib.BATCH_SPEC)


def build(c, devices) -> Runner:
    """``c`` resolved and validated; ``devices`` the devices to lay the mesh over."""
    devices = list(devices)
    data_size = configs.check_against_devices(c, len(devices))
    pipelined = configs.uses_pipeline(c)
    mesh = (engine.make_pipeline_mesh(data_size, c.pipeline.stages, devices) if pipelined
            else make_mesh(data_size, devices))
    model_shapes = abstract_params(c.model)
    stage_rows = engine.stage_split(c.model, c.pipeline.stages, c.pipeline.stage_layers) if pipelined else None
    # The optimizer is built on the shapes the state holds (Muon's routing reads them).
    interleave = configs.interleave_of(c)
    shapes = (jax.eval_shape(engine.engine_layout(c.model, stage_rows, interleave), model_shapes) if pipelined
              else model_shapes)
    staleness = configs.effective_staleness(c)
    is_mpmd = configs.is_mpmd(c)
    if is_mpmd and jax.process_count() > 1:
        raise configs.ConfigError(
            f"config.pipeline.placement='mpmd' runs in one process (its host dispatches every stage's programs), "
            f"and this job has {jax.process_count()}: set config.pipeline.placement='spmd' for a job of several "
            "processes.")
    # Under mpmd each parameter group runs the chain on its own devices; the clip's global norm
    # is taken over all of them by the step itself.
    optimizer, schedule = build_optimizer(c.optimizer, c.train.steps, staleness, shapes,
                                          delay_in_chain=not pipelined, clip=not is_mpmd)
    if is_mpmd:
        versions = None
        train_step = mpmd.MpmdTrainStep(c.model, optimizer, schedule, mesh, shapes, c.train.microbatches,
                                        c.pipeline.schedule, c.train.global_batch_size, c.data.seq_len,
                                        delay_schedule(staleness, c.train.steps), c.optimizer.grad_clip,
                                        c.mesh.expert_parallel)
    elif pipelined:
        versions = None
        prediction = weight_prediction(staleness, c.train.steps)
        train_step = engine.make_pipeline_train_step(
            c.model, optimizer, schedule, mesh, shapes, c.train.microbatches, c.pipeline.schedule,
            delay_schedule(staleness, c.train.steps), expert_parallel=c.mesh.expert_parallel,
            recompute=c.pipeline.recompute, weight_prediction=prediction, stage_rows=stage_rows,
            virtual_stages=(interleave or (0, 1))[1], vocab_parallel=bool(c.pipeline.get("vocab_parallel", False)))
        versions = prediction  # the engine keeps δ in its in-flight state, not in a versions tree
    else:
        versions = weight_versions(staleness, c.train.steps, shapes)
        prediction = weight_prediction(staleness, c.train.steps)
        train_step = step_lib.make_train_step(c.model, optimizer, schedule, mesh,
                                              delay_schedule(staleness, c.train.steps), versions, prediction)
        versions = versions if prediction is None else prediction
    return Runner(c, mesh, data_size, pipelined, shapes, optimizer, schedule, train_step, versions, stage_rows,
                  model_shapes)
