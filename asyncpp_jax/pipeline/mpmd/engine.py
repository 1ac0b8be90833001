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

Schedules: ``sync`` and ``1f1b`` (the same flushed update), and the flushless ``2bw`` and
``pipedream``.  A flushless program never drains: under ``2bw`` update ``t`` applies batch
``t-1``'s gradient taken at ``w[t-1]`` (the simulate runner's ``delay(1)``), under ``pipedream``
stage ``s``'s gradient of batch ``t-(P-1-s)`` taken at that batch's weights (``delay`` with
PipeDream's per-leaf delays).  The delay lives in one place, the program: an action on batch
``t+b`` reads ``w[t+b]``, and stage ``s``'s gradient of it joins update ``t+b+d_s``
(:func:`part_delays`).  What the batches in flight still need crosses steps in
:class:`MpmdState` (and so into checkpoints): their weight versions and tokens, their stashed
activations and the cotangents in transit, and the partial gradients and loss sums of later
updates.  A synchronous start and cooldown (``optim.DelaySchedule``) run the ``1f1b`` program
and drop what is in flight, as the ``spmd`` engine does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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
    """What crosses ``train_step`` calls under a flushless program (``2bw``, ``pipedream``); every
    leaf on the stage that uses it."""

    weight_versions: tuple  # w[t-1], ..., w[t-D]: the versions the batches in flight read, placed like the params
    inflight: dict  # "stash/s/b/m", "fwd/s/b/m", "ct/s/b/m": batch t+b's activations and cotangents on stage s
    acc: dict  # "a<k>/s<s>": stage s's partial gradients of update t+k (the parts that reach it), per replica
    sums: dict  # "a<k>/s<s>": stage s's loss sums of update t+k
    batches: jax.Array  # [D, M, B, T+1]: the tokens of batches t-1, ..., t-D


def in_force(ds: DelaySchedule | None, t: int) -> bool:
    """``DelaySchedule.in_force`` on the host (no device round trip)."""
    if ds is None or ds.steps == 0 or t < ds.sync_start_steps:
        return False
    return ds.cooldown_start is None or t < ds.cooldown_start


def order(program: programs.Program) -> list[tuple]:
    """The program's actions of one window as ``(stage, kind, batch, microbatch)`` in an order the
    host can dispatch (each after everything it reads): by start time in the program's own
    simulation, in the steady state (after ``delay`` earlier windows) of a flushless program.
    ``batch`` is step-relative: ``-k`` for batch ``t-k``."""
    steps = program.delay + 1
    run = programs.simulate(program, steps=steps)
    M = program.microbatches
    ops = [(run.start[(d, i)], d, i, op) for d, ops in enumerate(run.lists) for i, op in enumerate(ops)
           if op.step == steps - 1]
    ops.sort(key=lambda t: t[:3])
    return [(op.stage, op.kind, op.action.microbatch // M, op.action.microbatch % M) for *_, op in ops]


def _moves(store: set, window: list[tuple], n_stages: int) -> set:
    """The keys ``(kind, stage, batch, microbatch)`` in transit or stashed after ``window`` runs
    on ``store``: the same moves as :meth:`MpmdTrainStep._run` makes, on keys only."""
    live = set(store)
    for s, kind, b, m in window:
        if kind == "F":
            if s > 0:
                live.discard(("fwd", s, b, m))
                live.add(("stash", s, b, m))
            if s < n_stages - 1:
                live.add(("fwd", s + 1, b, m))
        else:
            if s > 0:
                live.discard(("stash", s, b, m))
                live.add(("ct", s - 1, b, m))
            if s < n_stages - 1:
                live.discard(("ct", s, b, m))
    return live


def carried_keys(window: list[tuple], n_stages: int, delay: int) -> list[tuple]:
    """``(kind, stage, batch, microbatch)`` of what a steady window leaves in flight, ``batch``
    relative to the step that ends (the next step finds it as ``batch - 1``)."""
    live: set = set()
    for _ in range(delay + 1):  # from an empty pipeline to the steady state
        live = _moves({(k, s, b - 1, m) for k, s, b, m in live}, window, n_stages)
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


def _key(kind: str, s: int, b: int, m: int) -> str:
    return f"{kind}/{s}/{b}/{m}"


def part_delays(program: programs.Program, tied: bool, s: int) -> dict:
    """Each accumulator part of stage ``s`` -> its delay: a gradient of batch ``t+b`` joins update
    ``t + b + delay`` (each part's group's, :meth:`~asyncpp_jax.pipeline.schedules.programs.Offsets.delay`:
    a tied table's head gradient takes the first stage's, as its lookup's does)."""
    offsets = programs.Offsets.of(program, tied)
    out = {"layers": offsets.delay("layers", s)}
    if s == 0:
        out["table"] = offsets.delay("embed")
    if s == program.devices - 1:
        out.update({f"head/{k}": offsets.delay(g) for k, g in offsets.head_groups().items()})
    return out


def _get(tree: dict, part: str):
    for k in part.split("/"):
        tree = tree[k]
    return tree


def _join(parts: dict) -> dict:
    """``{"layers": x, "head/w": y, ...}`` -> the nested accumulator tree."""
    out: dict = {}
    for part, v in parts.items():
        *outer, leaf = part.split("/")
        node = out
        for k in outer:
            node = node.setdefault(k, {})
        node[leaf] = v
    return out


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
        self.n_stages, self.data = P_, mesh.shape["data"]
        self.rows, self.seq_len, self.global_batch = global_batch // microbatches // self.data, seq_len, global_batch
        self.flushless = options.flushless
        self.D = options.delay
        self.delay_schedule = options.in_force() if self.flushless else None
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
        self.flushed = options.transition().program if self.flushless else options.program
        self.windows = {"flushed": order(self.flushed)}
        # Per program ("flushed", "delayed"), read off it once: each stage's parts' delays and the
        # loss statistics' delay (:meth:`_run`), and the latest update each part's gradient and the
        # loss sums join, relative to the step that made them: what crosses steps is the partial
        # gradients of updates t+1 .. t+reach.
        self.delays = {"flushed": self._delays_of(self.flushed)}
        self.reach = {"flushed": [{p: 0 for p in d} for d in self.delays["flushed"][0]]}
        self.stats_reach = {"flushed": 0}
        batches = NamedSharding(mesh, P(None, None, "data"))  # [D, M, B, T+1]: the batches in flight
        self._shift = jax.jit(lambda b, held: jnp.concatenate([b[None], held[:-1]]), out_shardings=batches)
        self._batch_at = jax.jit(lambda held, k: held[k], static_argnums=1,
                                 out_shardings=NamedSharding(mesh, BATCH_SPEC))
        if self.flushless:
            self.delayed = options.program
            self.windows["delayed"] = order(self.delayed)
            self.carried = carried_keys(self.windows["delayed"], P_, self.D)
            parts, d_stats = self.delays["delayed"] = self._delays_of(self.delayed)
            window = self.windows["delayed"]
            self.reach["delayed"] = [
                {p: max([b + d for st, kind, b, _ in window if st == s and kind == "B"], default=0)
                 for p, d in parts[s].items()} for s in range(P_)]
            self.stats_reach["delayed"] = max(b + d_stats for *_, b, _ in window)
        self._last_step: tuple | None = None  # (the step array this returned, its value): no read back

    def _delays_of(self, program: programs.Program) -> tuple[list[dict], int]:
        """Each stage's :func:`part_delays` and the loss statistics' delay under ``program``."""
        return ([part_delays(program, self.tied, s) for s in range(self.n_stages)],
                programs.Offsets.of(program, self.tied).delay("stats"))

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
        delayed = self.flushless and in_force(self.delay_schedule, t)
        # Whether batch t-k ran this program (else its actions are skipped: the fill, as optim.delay).
        live = [True] + [delayed and in_force(self.delay_schedule, t - k) for k in range(1, self.D + 1)]
        key = "delayed" if delayed else "flushed"
        window = [a for a in self.windows[key] if live[-a[2]]]
        rs = state.runner_state
        versions, batches, store = self._inputs(state, batch, live)
        acc, sums = self._accumulators(rs if delayed else None, key)
        self._run(window, key, versions, batches, store, acc, sums)
        grads, sqs = self.update.reduce([_join(acc[0][s]) for s in range(self.n_stages)])
        retired = rs.weight_versions[-1] if self.flushless else None  # no batch reads it any more
        params, opt_state, norm = self.update.apply(state.params, state.opt_state, grads, sqs, retired)
        metrics = self.update.metrics([sums[0][s] for s in range(self.n_stages)], norm, t, self.delay_schedule)
        new_rs = None
        if self.flushless:
            versions_next = (state.params,) + tuple(rs.weight_versions[:-1])
            batches_next = self._shift(batch, rs.batches)
            new_rs = self._runner_state(versions_next, store if delayed else {}, acc if delayed else None,
                                        sums if delayed else None, batches_next)
        step = jax.device_put(np.int32(t + 1), NamedSharding(self.placement.mesh, P()))
        self._last_step = (step, t + 1)
        return TrainState(step=step, params=params, opt_state=opt_state, runner_state=new_rs), metrics

    def _inputs(self, state: TrainState, batch, live: list) -> tuple:
        """Per live batch ``b`` in the window (0: this step's, ``-k``: batch ``t-k``), each stage's
        weight version and tokens; and what the previous window left in flight."""
        P_, pl, rs = self.n_stages, self.placement, state.runner_state
        versions = {0: [self.stage_params(state.params, s) for s in range(P_)]}
        batches = {0: [pl.view(batch, s) for s in range(P_)]}
        store = {}
        for k in range(1, self.D + 1):
            if live[k]:
                versions[-k] = [self.stage_params(rs.weight_versions[k - 1], s) for s in range(P_)]
                held = self._batch_at(rs.batches, k - 1)
                batches[-k] = [pl.view(held, s) for s in range(P_)]
        if self.D and live[1]:
            store = {(kind, s, b - 1, m): rs.inflight[_key(kind, s, b, m)] for kind, s, b, m in self.carried}
        return versions, batches, store

    def _accumulators(self, rs: MpmdState | None, key: str) -> tuple[dict, dict]:
        """``acc[a][s][part]`` and ``sums[a][s]``: stage ``s``'s partial gradient and loss sums of
        update ``t+a`` under program ``key``, from what the previous step carried for them (``rs``;
        None: zeros)."""
        acc, sums = {}, {}
        for s in range(self.n_stages):
            fresh: dict = {}  # offset -> (zero accumulators, zero sums) of this stage, made once

            def zero(a, s=s, fresh=fresh):
                if a not in fresh:
                    fresh[a] = self.zeros[s]()
                return fresh[a]

            for part, reach in self.reach[key][s].items():
                for a in range(reach + 1):
                    carried = rs.acc.get(f"a{a + 1}/s{s}", {}) if rs is not None else {}
                    acc.setdefault(a, {}).setdefault(s, {})[part] = (
                        carried[part] if part in carried else _get(zero(a)[0], part))
            for a in range(self.stats_reach[key] + 1):
                name = f"a{a + 1}/s{s}"
                sums.setdefault(a, {})[s] = rs.sums[name] if rs is not None and name in rs.sums else zero(a)[1]
        return acc, sums

    def _run(self, window, key, versions, batches, store, acc, sums) -> None:
        """Dispatch one window of program ``key``; ``store`` holds what is in transit or stashed,
        keyed ``(kind, stage, batch, microbatch)``.  A gradient of batch ``b`` on stage ``s`` joins
        update ``t + b + d`` (``d`` its part's delay, :func:`part_delays`)."""
        last, pl = self.n_stages - 1, self.placement
        delays, d_stats = self.delays[key]
        for s, kind, b, m in window:
            w, tokens, mi = versions[b][s], batches[b][s], np.int32(m)
            a_s = b + d_stats  # the update whose loss this batch's statistics join
            if kind == "F":
                if s == 0:
                    h, sums[a_s][s] = self.fwd[s](w, tokens, mi, sums[a_s][s])
                else:
                    x = store.pop(("fwd", s, b, m))
                    store[("stash", s, b, m)] = x
                    if s == last:
                        continue  # the last stage's forward runs fused with its backward
                    h, sums[a_s][s] = self.fwd[s](w, x, sums[a_s][s])
                store[("fwd", s + 1, b, m)] = pl.put(h, s + 1)
                continue
            into = {part: b + d for part, d in delays[s].items()}  # each part's update offset
            g = _join({part: acc[a][s][part] for part, a in into.items()})
            if s == last:
                g_x, g, sums[a_s][s] = self.last(w, store.pop(("stash", s, b, m)), tokens, mi, g, sums[a_s][s])
                store[("ct", s - 1, b, m)] = pl.put(g_x, s - 1)
            elif s > 0:
                g_x, g = self.bwd[s](w, store.pop(("stash", s, b, m)), store.pop(("ct", s, b, m)), g)
                store[("ct", s - 1, b, m)] = pl.put(g_x, s - 1)
            else:
                g = self.bwd[s](w, tokens, mi, store.pop(("ct", s, b, m)), g)
            for part, a in into.items():
                acc[a][s][part] = _get(g, part)

    # ------------------------------------------------------------------------------ state
    def _runner_state(self, versions: tuple, store: dict, acc: dict | None, sums: dict | None,
                      batches) -> MpmdState:
        """What the next step needs: the weight versions and tokens of the batches in flight, what
        they left in transit or stashed (zeros where nothing is: a fill, or a synchronous step),
        and the partial gradients and loss sums of later updates."""
        inflight = {_key(kind, s, b, m): store[(kind, s, b, m)] if (kind, s, b, m) in store
                    else self.zero_activation[s]() for kind, s, b, m in self.carried}
        out_acc, out_sums = {}, {}
        stats_reach = self.stats_reach["delayed"]
        for s in range(self.n_stages):
            reach = self.reach["delayed"][s]
            for a in range(1, max(max(reach.values()), stats_reach) + 1):
                zero_acc, zero_sums = self.zeros[s]() if acc is None else (None, None)  # one batch's, once
                parts = [p for p, r in reach.items() if r >= a]
                if parts:
                    out_acc[f"a{a}/s{s}"] = {p: acc[a][s][p] if acc is not None else _get(zero_acc, p) for p in parts}
                if a <= stats_reach:
                    out_sums[f"a{a}/s{s}"] = sums[a][s] if sums is not None else zero_sums
        return MpmdState(tuple(versions), inflight, out_acc, out_sums, batches)

    def init_runner_state(self, params) -> MpmdState | None:
        """The in-flight state of a fresh run (``None`` under a flushed program)."""
        if not self.flushless:
            return None
        versions = tuple(jax.tree.map(jnp.copy, params) for _ in range(self.D))
        batches = jax.device_put(np.zeros((self.D, self.M, self.global_batch // self.M, self.seq_len + 1), np.int32),
                                 NamedSharding(self.placement.mesh, P(None, None, "data")))
        return self._runner_state(versions, {}, None, None, batches)

    def abstract_runner_state(self, params_abstract) -> MpmdState | None:
        if not self.flushless:
            return None
        inflight = {_key(kind, s, b, m): self.stages[s].activation(self.rows, self.seq_len, self.data)
                    for kind, s, b, m in self.carried}
        acc, sums = {}, {}
        for s in range(self.n_stages):
            zero_acc, zero_sums = self.zeros_abstract[s]
            reach = self.reach["delayed"][s]
            for a in range(1, max(reach.values()) + 1):
                acc[f"a{a}/s{s}"] = {p: _get(zero_acc, p) for p, r in reach.items() if r >= a}
            for a in range(1, self.stats_reach["delayed"] + 1):
                sums[f"a{a}/s{s}"] = zero_sums
        batches = jax.ShapeDtypeStruct((self.D, self.M, self.global_batch // self.M, self.seq_len + 1), jnp.int32,
                                       sharding=NamedSharding(self.placement.mesh, P(None, None, "data")))
        return MpmdState(tuple(params_abstract for _ in range(self.D)), inflight, acc, sums, batches)


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
