"""The ``mpmd`` placement of the pipeline runner: each stage runs its own programs, so each holds
only what it uses (``config.pipeline.placement='mpmd'``).

Under ``spmd`` (the default) one ``shard_map`` program runs every stage, so every stage holds the
same shapes: the embedding and the head (whole, or 1/P of each with ``vocab_parallel``), their
previous version, accumulators and optimizer state sit on the middle stages too, which never
read them.  Here the state is split into groups that live on the devices that use them
(:mod:`~asyncpp_jax.pipeline.mpmd.placement`): the embedding on stage 0, the final norm and head
on stage ``P-1``, a tied table on those two only, the layers on their own stages.  The host
runs a schedule's program (:mod:`~asyncpp_jax.pipeline.schedules.programs`), dispatching each action to
its stage's compiled program (:mod:`~asyncpp_jax.pipeline.mpmd.stages`) and each activation and
cotangent to the next stage's devices with ``jax.device_put``.  Dispatch is asynchronous: the
host only enqueues, each device runs its actions in the program's order as their inputs arrive,
and nothing is read back during a step.  The same programs as the ``spmd`` engine, validated the
same way; the update runs group by group (:mod:`~asyncpp_jax.pipeline.mpmd.update`).

Schedules: ``1f1b`` (and ``sync``, the same flushed update) and ``2bw``.  Under ``2bw`` update ``t``
applies batch ``t-1``'s gradient taken at ``w[t-1]`` (the simulate runner's ``delay(1)``); the
program never flushes, so the previous batch's unfinished backwards, their stashed activations,
the cotangents in transit and the partial accumulators cross steps in :class:`MpmdState` (and
so into checkpoints).  The delay lives in one place, the program's microbatch versions
(:func:`asyncpp_jax.pipeline.schedules.programs.two_bw`): an action on a previous-batch microbatch reads
``prev_params``.  A synchronous start and cooldown (``optim.DelaySchedule``) run the ``1f1b``
program and drop what is in flight, as the ``spmd`` engine does.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax import configs
from asyncpp_jax.models import dense
from asyncpp_jax.optim.staleness import DelaySchedule
from asyncpp_jax.pipeline.options import EngineOptions
from asyncpp_jax.pipeline.schedules import programs
from asyncpp_jax.pipeline.layout import to_engine_layout
from asyncpp_jax.pipeline.mpmd.placement import Placement
from asyncpp_jax.pipeline.mpmd.stages import StagePrograms
from asyncpp_jax.pipeline.mpmd.update import GroupedUpdate
from asyncpp_jax.train_state import BATCH_SPEC, TrainState

SCHEDULES = configs.MPMD_SCHEDULES  # the config's check reads the same list


class MpmdState(NamedTuple):
    """What crosses ``train_step`` calls under ``2bw``; every leaf on the stage that uses it."""

    prev_params: Any  # w[t-1], placed like the params
    inflight: dict  # "stash/s/m", "ct/s/m": the in-flight batch's activations and cotangents on stage s
    acc: dict  # "s<k>": stage k's accumulators of the in-flight batch (its replica's own)
    sums: dict  # "s<k>": stage k's loss sums of the in-flight batch
    prev_batch: jax.Array  # [M, B, T+1]: the in-flight batch's tokens


def in_force(ds: DelaySchedule | None, t: int) -> bool:
    """``DelaySchedule.in_force`` on the host (no device round trip)."""
    if ds is None or ds.steps == 0 or t < ds.sync_start_steps:
        return False
    return ds.cooldown_start is None or t < ds.cooldown_start


def order(program: programs.Program, steady: bool) -> list[tuple]:
    """The program's actions of one window as ``(stage, kind, batch, microbatch)`` in an order the
    host can dispatch (each after everything it reads): by start time in the program's own
    simulation.  ``steady``: a delayed program's window after a live one (its previous-batch
    actions included); else the first window (or a flushed step)."""
    steps = 2 if steady and program.delay else 1
    run = programs.simulate(program, steps=steps)
    M = program.microbatches
    ops = [(run.start[(d, i)], d, i, op) for d, ops in enumerate(run.lists) for i, op in enumerate(ops)
           if op.step == steps - 1]
    ops.sort(key=lambda t: t[:3])
    return [(op.stage, op.kind, op.action.microbatch // M, op.action.microbatch % M) for *_, op in ops]


def carried_keys(window: list[tuple], n_stages: int) -> list[tuple]:
    """``(kind, stage, microbatch)`` of what a window leaves in flight of its own batch: the same
    moves as :meth:`MpmdTrainStep._run` makes, on keys only."""
    live: set = set()
    for s, kind, b, m in window:
        if b != 0:
            continue
        if kind == "F":
            if s > 0:
                live.discard(("fwd", s, m))
                live.add(("stash", s, m))
            if s < n_stages - 1:
                live.add(("fwd", s + 1, m))
        else:
            if s > 0:
                live.discard(("stash", s, m))
                live.add(("ct", s - 1, m))
            if s < n_stages - 1:
                live.discard(("ct", s, m))
    return sorted(live)


def stage_keys(n_stages: int, tied: bool, s: int) -> list[str]:
    """The parameter keys stage ``s`` reads: its layers, the embedding on stage 0, the final norm
    and head on the last (a tied table on both)."""
    return ["layers"] + (["embed"] if s == 0 else []) + (
        ["final_norm", "embed" if tied else "lm_head"] if s == n_stages - 1 else [])


def stage_params(placement: Placement, tied: bool, params: dict, s: int) -> dict:
    """What stage ``s`` reads of a weight version, as arrays on its own devices (zero-copy)."""
    return {k: jax.tree.map(lambda x: placement.view(x, s), params[k])
            for k in stage_keys(placement.n_stages, tied, s)}


def _key(kind: str, s: int, m: int) -> str:
    return f"{kind}/{s}/{m}"


class MpmdTrainStep:
    """``train_step(state, batch) -> (state, metrics)`` of the ``mpmd`` placement (the runners'
    contract), with ``state.opt_state`` a dict of each group's optimizer state."""

    def __init__(self, model_cfg, optimizer, schedule, mesh, params_abstract, options: EngineOptions,
                 global_batch: int, seq_len: int, grad_clip: float = 0.0):
        # The config's validator admits the schedules in SCHEDULES only.
        microbatches, expert_parallel = options.microbatches, options.expert_parallel
        self.cfg, self.M = model_cfg, microbatches
        self.placement = pl = Placement(mesh)
        P_ = pl.n_stages
        if P_ < 2:
            raise ValueError(f"the pipeline engine needs config.pipeline.stages >= 2, got {P_}.")
        self.n_stages, self.data = P_, mesh.shape["data"]
        self.rows, self.seq_len, self.global_batch = global_batch // microbatches // self.data, seq_len, global_batch
        self.is_2bw = options.flushless  # a one-step delay: SCHEDULES' one flushless program
        self.delay_schedule = options.in_force() if self.is_2bw else None
        self.tied, self.expert_parallel = bool(model_cfg.tie_embeddings), expert_parallel
        self.params_abstract = params_abstract
        self.stages = [StagePrograms(model_cfg, pl, s, microbatches, expert_parallel) for s in range(P_)]
        self.fwd = [st.forward() if s < P_ - 1 else None for s, st in enumerate(self.stages)]
        self.bwd = [st.backward() if s < P_ - 1 else None for s, st in enumerate(self.stages)]
        self.last = self.stages[-1].last()
        self.zeros, self.zeros_abstract = zip(*[st.zeros(params_abstract, self.data) for st in self.stages])
        acts = [st.activation(self.rows, seq_len, self.data) for st in self.stages]
        # One compiled program per stage, reused at every synchronous step.
        self.zero_activation = [jax.jit(functools.partial(jnp.zeros, a.shape, a.dtype), out_shardings=a.sharding)
                                for a in acts]
        self.update = GroupedUpdate(model_cfg, optimizer, schedule, pl, params_abstract, grad_clip, expert_parallel)
        self.flushed = options.transition().program if self.is_2bw else options.program
        self.windows = {"flushed": order(self.flushed, False)}
        if self.is_2bw:
            self.delayed = options.program
            self.windows.update(fill=order(self.delayed, False), steady=order(self.delayed, True))
            self.carried = carried_keys(self.windows["fill"], P_)
        self._last_step: tuple | None = None  # (the step array this returned, its value): no read back

    # ------------------------------------------------------------------------------ views
    def stage_params(self, params: dict, s: int) -> dict:
        return stage_params(self.placement, self.tied, params, s)

    def _host_step(self, state: TrainState) -> int:
        if self._last_step is not None and state.step is self._last_step[0]:
            return self._last_step[1]
        return int(jax.device_get(state.step))  # a fresh or restored state: once

    # ------------------------------------------------------------------------------ step
    def __call__(self, state: TrainState, batch: jax.Array):
        t = self._host_step(state)
        delayed = self.is_2bw and in_force(self.delay_schedule, t)
        prev_live = delayed and in_force(self.delay_schedule, t - 1)
        window = self.windows["flushed" if not delayed else "steady" if prev_live else "fill"]
        versions, batches, acc, sums, store = self._inputs(state, batch, prev_live)
        self._run(window, versions, batches, store, acc, sums)
        applied = -1 if delayed else 0
        if applied not in acc:  # the first delayed update: no batch finished (the fill)
            acc[-1], sums[-1] = zip(*[self.zeros[s]() for s in range(self.n_stages)])
        grads, sqs = self.update.reduce(list(acc[applied]))
        rs = state.runner_state
        params, opt_state, norm = self.update.apply(state.params, state.opt_state, grads, sqs,
                                                    rs.prev_params if self.is_2bw else None)
        metrics = self.update.metrics(list(sums[applied]), norm, t, self.delay_schedule)
        new_rs = None
        if self.is_2bw and delayed:
            inflight = {_key(kind, s, m): store.pop((kind, s, 0, m)) for kind, s, m in self.carried}
            new_rs = MpmdState(state.params, inflight, {f"s{s}": a for s, a in enumerate(acc[0])},
                               {f"s{s}": x for s, x in enumerate(sums[0])}, batch)
        elif self.is_2bw:  # a synchronous update: nothing in flight
            new_rs = self._empty_runner_state(state.params, batch)
        step = jax.device_put(np.int32(t + 1), NamedSharding(self.placement.mesh, P()))
        self._last_step = (step, t + 1)
        return TrainState(step=step, params=params, opt_state=opt_state, runner_state=new_rs), metrics

    def _inputs(self, state: TrainState, batch, prev_live: bool) -> tuple:
        """Per batch in the window (0: this step's, -1: the one in flight), each stage's weight
        version, tokens, accumulators and loss sums; and what the previous window left in flight."""
        P_, pl, rs = self.n_stages, self.placement, state.runner_state
        versions = {0: [self.stage_params(state.params, s) for s in range(P_)]}
        batches = {0: [pl.view(batch, s) for s in range(P_)]}
        acc, sums = map(list, zip(*[self.zeros[s]() for s in range(P_)]))
        acc, sums, store = {0: acc}, {0: sums}, {}
        if prev_live:
            versions[-1] = [self.stage_params(rs.prev_params, s) for s in range(P_)]
            batches[-1] = [pl.view(rs.prev_batch, s) for s in range(P_)]
            acc[-1] = [rs.acc[f"s{s}"] for s in range(P_)]
            sums[-1] = [rs.sums[f"s{s}"] for s in range(P_)]
            store = {(kind, s, -1, m): rs.inflight[_key(kind, s, m)] for kind, s, m in self.carried}
        return versions, batches, acc, sums, store

    def _run(self, window, versions, batches, store, acc, sums) -> None:
        """Dispatch one window's actions; ``store`` holds what is in transit or stashed, keyed
        ``(kind, stage, batch, microbatch)``."""
        last, pl = self.n_stages - 1, self.placement
        for s, kind, b, m in window:
            w, tokens, mi = versions[b][s], batches[b][s], np.int32(m)
            if kind == "F":
                if s == 0:
                    h, sums[b][s] = self.fwd[s](w, tokens, mi, sums[b][s])
                else:
                    x = store.pop(("fwd", s, b, m))
                    store[("stash", s, b, m)] = x
                    if s == last:
                        continue  # the last stage's forward runs fused with its backward
                    h, sums[b][s] = self.fwd[s](w, x, sums[b][s])
                store[("fwd", s + 1, b, m)] = pl.put(h, s + 1)
            elif s == last:
                g_x, acc[b][s], sums[b][s] = self.last(w, store.pop(("stash", s, b, m)), tokens, mi, acc[b][s],
                                                       sums[b][s])
                store[("ct", s - 1, b, m)] = pl.put(g_x, s - 1)
            elif s > 0:
                g_x, acc[b][s] = self.bwd[s](w, store.pop(("stash", s, b, m)), store.pop(("ct", s, b, m)), acc[b][s])
                store[("ct", s - 1, b, m)] = pl.put(g_x, s - 1)
            else:
                acc[b][s] = self.bwd[s](w, tokens, mi, store.pop(("ct", s, b, m)), acc[b][s])

    # ------------------------------------------------------------------------------ state
    def _empty_runner_state(self, prev_params, batch) -> MpmdState:
        inflight = {_key(kind, s, m): self.zero_activation[s]() for kind, s, m in self.carried}
        made = [self.zeros[s]() for s in range(self.n_stages)]
        return MpmdState(prev_params, inflight, {f"s{s}": a for s, (a, _) in enumerate(made)},
                         {f"s{s}": x for s, (_, x) in enumerate(made)}, batch)

    def init_runner_state(self, params) -> MpmdState | None:
        """The in-flight state of a fresh run (``None`` unless ``2bw``)."""
        if not self.is_2bw:
            return None
        prev = jax.tree.map(jnp.copy, params)
        batch = jax.device_put(np.zeros((self.M, self.global_batch // self.M, self.seq_len + 1), np.int32),
                               NamedSharding(self.placement.mesh, BATCH_SPEC))
        return self._empty_runner_state(prev, batch)

    def abstract_runner_state(self, params_abstract) -> MpmdState | None:
        if not self.is_2bw:
            return None
        inflight = {_key(kind, s, m): self.stages[s].activation(self.rows, self.seq_len, self.data)
                    for kind, s, m in self.carried}
        batch = jax.ShapeDtypeStruct((self.M, self.global_batch // self.M, self.seq_len + 1), jnp.int32,
                                     sharding=NamedSharding(self.placement.mesh, BATCH_SPEC))
        return MpmdState(params_abstract, inflight, {f"s{s}": z[0] for s, z in enumerate(self.zeros_abstract)},
                         {f"s{s}": z[1] for s, z in enumerate(self.zeros_abstract)}, batch)


class MpmdEvalStep:
    """``eval_step(params, batch[B, T+1]) -> (sum of token losses, token count)``: the forward-only
    program, each stage on its own devices."""

    def __init__(self, model_cfg, mesh, microbatch_rows: int, options: EngineOptions):
        expert_parallel = options.expert_parallel
        self.placement = pl = Placement(mesh)
        self.rows, self.n_stages, self.tied = microbatch_rows, pl.n_stages, bool(model_cfg.tie_embeddings)
        self.stages = [StagePrograms(model_cfg, pl, s, 1, expert_parallel) for s in range(pl.n_stages)]
        self.fns = [st.eval_forward(microbatch_rows) for st in self.stages]
        self._total = jax.jit(lambda t, n: (jnp.sum(t), jnp.sum(n)))

    def __call__(self, params, batch):
        pl, last = self.placement, self.placement.n_stages - 1
        local_rows = batch.shape[0] // pl.mesh.shape["data"]
        n_mb = -(-local_rows // min(self.rows, local_rows))
        views = [stage_params(pl, self.tied, params, s) for s in range(pl.n_stages)]
        tokens = [pl.view(batch, s) for s in range(pl.n_stages)]
        totals, counts = [], []
        for m in range(n_mb):
            mi = np.int32(m)
            h = self.fns[0](views[0], tokens[0], mi)
            for s in range(1, last):
                h = self.fns[s](views[s], pl.put(h, s))
            t, n = self.fns[last](views[last], pl.put(h, last), tokens[last], mi)
            totals.append(t)
            counts.append(n)
        return self._total(jnp.stack(totals), jnp.stack(counts))


def init_state(model_cfg, step: MpmdTrainStep, key, params=None) -> TrainState:
    """A fresh state under ``mpmd``: ``params`` (the model's own layout; default a fresh init from
    ``key``) in the engine's layout, each group on its devices, each group's optimizer state."""
    params = dense.init_params(model_cfg, key) if params is None else params
    params = to_engine_layout(model_cfg, params)
    shardings = step.placement.param_shardings(params, step.tied, step.expert_parallel)
    params = jax.tree.map(lambda x, s: jax.device_put(x, s), params, shardings)
    return TrainState(step=jax.device_put(np.int32(0), NamedSharding(step.placement.mesh, P())), params=params,
                      opt_state=step.update.init(params), runner_state=step.init_runner_state(params))


def abstract_state(step: MpmdTrainStep, params_abstract) -> TrainState:
    shardings = step.placement.param_shardings(params_abstract, step.tied, step.expert_parallel)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params_abstract, shardings)
    return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(step.placement.mesh, P())),
                      params=params, opt_state=step.update.abstract_opt_state(),
                      runner_state=step.abstract_runner_state(params))


__all__ = ["MpmdEvalStep", "MpmdState", "MpmdTrainStep", "abstract_state", "carried_keys", "in_force", "init_state",
           "order", "stage_keys", "stage_params"]
