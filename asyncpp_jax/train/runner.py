"""Build the runner a config asks for: mesh, optimizer chain, ``train_step``, and the state layout.

Shared by the trainer and the dry run, so the dry run compiles exactly the program a real run
executes.  ``simulate`` is one jitted data-parallel program (the delay, if any, in the optimizer
chain or, for exact PipeDream, in the runner's weight history); ``pipeline`` is the
``shard_map`` engine over ``('data', 'stage')``, or with ``pipeline.placement='mpmd'`` one
program per stage (:mod:`asyncpp_jax.pipeline.mpmd.engine`); the runners share one contract.
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
from asyncpp_jax.pipeline.options import EngineOptions
from asyncpp_jax.pipeline.spmd import engine
from asyncpp_jax.pipeline.mpmd import engine as mpmd
from asyncpp_jax.pipeline.mesh import make_mesh
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
    options: EngineOptions | None = None  # what the pipeline engine is told (None: the simulate runner)
    model_shapes: Any = None  # abstract params of the model itself (its own layout): what to count or export

    def __post_init__(self):
        if self.model_shapes is None:
            self.model_shapes = self.shapes

    @property
    def interleave(self) -> tuple | None:
        """``(stages, virtual_stages)`` of an interleaved layer stack (``configs.interleave_of``), or None."""
        return configs.interleave_of(self.config) if self.pipelined else None

    @property
    def stage_rows(self) -> tuple | None:
        """``config.pipeline.stage_layers`` as rows of the layer stack per stage
        (``engine.stage_split``); None: an even split (or no pipeline), no padding."""
        return self.options.stage_rows if self.pipelined else None

    @property
    def mpmd(self) -> bool:
        """Whether the engine runs one program per stage (``config.pipeline.placement='mpmd'``)."""
        return self.pipelined and self.options.placement == "mpmd"

    def schedule_plan(self):
        """What the engine's step runs, printable (``render()``, ``useful_fraction()``): the
        program in lock-step slots (under ``mpmd``, the program itself)."""
        if not self.pipelined:
            return None
        return self.options.program if self.mpmd else self.options.plan

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
                    c.model, state.params, self.mesh, c.train.global_batch_size, c.data.seq_len, self.options))
            return state

        return init

    def state_shardings(self, abstract_state):
        if self.pipelined:
            return engine.state_shardings(abstract_state, self.mesh, self.shapes, self.options)
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
            return mpmd.MpmdEvalStep(c.model, self.mesh, rows, self.options)
        if self.pipelined:
            return engine.make_pipeline_eval_step(c.model, self.mesh, self.shapes, rows, self.options)
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
    options = engine_options(c, stage_rows) if pipelined else None
    if is_mpmd:
        versions = None
        train_step = mpmd.MpmdTrainStep(c.model, optimizer, schedule, mesh, shapes, options,
                                        c.train.global_batch_size, c.data.seq_len, c.optimizer.grad_clip)
    elif pipelined:
        train_step = engine.make_pipeline_train_step(c.model, optimizer, schedule, mesh, shapes, options)
        versions = options.weight_prediction  # the engine keeps δ in its in-flight state, not in a versions tree
    else:
        versions = weight_versions(staleness, c.train.steps, shapes)
        prediction = weight_prediction(staleness, c.train.steps)
        train_step = step_lib.make_train_step(c.model, optimizer, schedule, mesh,
                                              delay_schedule(staleness, c.train.steps), versions, prediction)
        versions = versions if prediction is None else prediction
    return Runner(c, mesh, data_size, pipelined, shapes, optimizer, schedule, train_step, versions, options,
                  model_shapes)


def engine_options(c, stage_rows: tuple | None) -> EngineOptions:
    """What the pipeline engine is told about a run of config ``c`` (validated), in one object:
    the only place its schedule's name is read off the config."""
    staleness = configs.effective_staleness(c)
    interleave = configs.interleave_of(c)
    return EngineOptions(
        schedule=c.pipeline.schedule, stages=c.pipeline.stages, microbatches=c.train.microbatches,
        virtual_stages=interleave[1] if interleave else 1, recompute=bool(c.pipeline.recompute),
        vocab_parallel=bool(c.pipeline.get("vocab_parallel", False)), expert_parallel=bool(c.mesh.expert_parallel),
        placement=c.pipeline.get("placement", "spmd"), stage_rows=stage_rows,
        delay_schedule=delay_schedule(staleness, c.train.steps),
        weight_prediction=weight_prediction(staleness, c.train.steps))
