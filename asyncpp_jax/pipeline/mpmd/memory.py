"""Memory per stage of the ``mpmd`` placement, from shapes and compiled programs: tooling of the dry
run (``asyncpp_jax.train.dry_run``), which alone imports it; a training step never does.

Each stage runs its own programs, so its peak is its own:

    peak(s) = state(s) + accumulators(s) + stash(s) + in transit + max temporaries(s)

* ``state(s)``: the bytes of the train state (params, optimizer state, the in-flight state) on one
  of stage ``s``'s devices, from their shardings: exact;
* ``accumulators(s)``: one batch's float32 gradient accumulators and loss sums (under a flushless
  program the partial gradients of later updates are part of the state);
* ``stash(s)``: the program's peak microbatches held by stage ``s`` (``programs.stash_depth``)
  times one activation (``[b, T, D]`` in ``compute_dtype``): the stage input a backward recomputes
  from; stage 0 re-embeds from the tokens and holds none; plus one activation and one cotangent
  in transit;
* temporaries: XLA's memory analysis of each of the stage's compiled programs (forward,
  backward or the fused last vjp, the reduction and update of each group it holds); a device runs
  them one at a time, so the largest counts.

XLA:CPU compiles them here; an accelerator's compiler lays temporaries out differently, so that
term is an estimate, the others are exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax.pipeline.mpmd import engine as mpmd
from asyncpp_jax.pipeline.schedules import programs
from asyncpp_jax.pipeline.mpmd.placement import DEVICE, bytes_on_devices, split_groups
from asyncpp_jax.pipeline.mpmd.stages import TOKENS


def _nbytes(tree) -> int:
    """Bytes on one device of a tree of sharded ``ShapeDtypeStruct``s that all live on it."""
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def _temp(fn, *args) -> int:
    mem = fn.lower(*args).compile().memory_analysis()
    return 0 if mem is None else int(mem.temp_size_in_bytes)


def stage_params_abstract(step, params_abstract: dict, s: int) -> dict:
    """:meth:`MpmdTrainStep.stage_params` on shapes: what stage ``s`` reads, on its own mesh."""
    mesh, n = step.placement.stage_meshes[s], step.n_stages

    def one(path, x):
        shape = (x.shape[0] // n,) + tuple(x.shape[1:]) if path[0].key == "layers" else x.shape
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(mesh, step.stages[s].param_spec(path)))

    keys = mpmd.stage_keys(n, step.tied, s)
    return jax.tree_util.tree_map_with_path(one, {k: params_abstract[k] for k in keys})


def stage_programs(step, s: int) -> list[tuple]:
    """``(name, jitted function, abstract arguments)`` of each compiled action of stage ``s``."""
    w = stage_params_abstract(step, step.params_abstract, s)
    act = step.stages[s].activation(step.rows, step.seq_len, step.data)
    acc, sums = step.zeros_abstract[s]
    batch = jax.ShapeDtypeStruct((step.M, step.global_batch // step.M, step.seq_len + 1), jnp.int32,
                                 sharding=NamedSharding(step.placement.stage_meshes[s], TOKENS))
    m = jax.ShapeDtypeStruct((), jnp.int32)
    if s == step.n_stages - 1:
        return [("last", step.last.jitted(w), (w, act, batch, m, acc, sums))]
    if s == 0:
        return [("forward", step.fwd[0].jitted(w), (w, batch, m, sums)),
                ("backward", step.bwd[0].jitted(w), (w, batch, m, act, acc))]
    return [("forward", step.fwd[s].jitted(w), (w, act, sums)), ("backward", step.bwd[s].jitted(w), (w, act, act, acc))]


def update_programs(step, state) -> dict:
    """Per group, ``(name, jitted function, abstract arguments)`` of its reduction and its update."""
    upd, pl = step.update, step.placement
    params = split_groups(state.params, step.tied)
    out = {}
    for g in upd.groups:
        mesh = pl.group_mesh(g)
        grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), params[g])
        sqs = [jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P())) for _ in upd.groups]
        out[g] = [("reduce", upd.reduce_fns[g], (_reduce_input(step, g, params[g]),)),
                  ("update", upd.apply_fns[g], (params[g], state.opt_state[g], grads, sqs))]
    return out


def _update_temps(step, state) -> dict:
    """Per group, the larger of its reduction's and its update's temporaries, with the reduced
    gradient (a parameter-shaped float32 tree) held between them."""
    out = {}
    for g, progs in update_programs(step, state).items():
        grads = progs[1][2][2]
        out[g] = max(_temp(fn, *args) for _, fn, args in progs) + max(bytes_on_devices(grads).values())
    return out


def _reduce_input(step, group: str, params_g):
    """The abstract accumulators a group's reduction takes (``GroupedUpdate.reduce``'s inputs)."""
    pl, data, n = step.placement, step.data, step.n_stages

    def dev(mesh, shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, DEVICE))

    if group == "layers":  # each stage's accumulators side by side (a routed expert's: this device's)
        return jax.tree.map(lambda z: dev(pl.mesh, (data, n) + z.shape[2:]), step.zeros_abstract[0][0]["layers"])
    if group == "ends":
        table = params_g["embed"]["embedding"]
        return dev(pl.ends_mesh, (data, 2) + table.shape)
    if group == "first":
        return dev(pl.stage_meshes[0], (data, 1) + params_g["embed"]["embedding"].shape)
    head = step.zeros_abstract[-1][0]["head"]
    return {"final_norm": head["final_norm"]} if step.tied else head


def stage_state_bytes(step, state) -> list[int]:
    """The train state's bytes on one device of each stage."""
    held = bytes_on_devices(state)
    return [held.get(step.placement.stage_meshes[s].devices.flat[0].id, 0) for s in range(step.n_stages)]


def train_memory(step, state) -> list[dict]:
    """Per stage, the terms of its peak (bytes on one of its devices) and the peak itself."""
    held = stage_state_bytes(step, state)
    group_temps = _update_temps(step, state)
    program = step.delayed if step.flushless else step.flushed
    depth = programs.stash_depth(program)
    out = []
    for s in range(step.n_stages):
        act = _nbytes(step.stages[s].activation(step.rows, step.seq_len, step.data))
        acc = _nbytes(step.zeros_abstract[s])
        stash = (0 if s == 0 else int(np.ceil(depth[s]))) * act
        transit = 2 * act
        groups = [g for g in step.update.groups if s in step.placement.group_stages(g)]
        actions = max(_temp(fn, *args) for _, fn, args in stage_programs(step, s))
        temps = max([actions] + [group_temps[g] for g in groups])
        terms = {"stage": s, "state": held[s], "accumulators": acc, "stash": stash,
                 "transit": transit, "temporaries": temps}
        terms["peak"] = sum(v for k, v in terms.items() if k != "stage")
        out.append(terms)
    return out


def eval_programs(eval_step, step) -> list[tuple]:
    """``(name, jitted function, abstract arguments)`` of each stage's forward-only program."""
    out = []
    rows = eval_step.rows * step.data * step.M
    m = jax.ShapeDtypeStruct((), jnp.int32)
    for s in range(step.n_stages):
        w = stage_params_abstract(step, step.params_abstract, s)
        batch = jax.ShapeDtypeStruct((rows, step.seq_len + 1), jnp.int32,
                                     sharding=NamedSharding(step.placement.stage_meshes[s], P("data")))
        act = step.stages[s].activation(step.rows, step.seq_len, step.data)
        args = (w, batch, m) if s == 0 else (w, act, batch, m) if s == step.n_stages - 1 else (w, act)
        out.append((f"eval stage {s}", eval_step.fns[s].jitted(w), args))
    return out


def eval_memory(eval_step, step) -> list[int]:
    """Per stage, the temporaries of its forward-only program."""
    return [_temp(fn, *args) for _, fn, args in eval_programs(eval_step, step)]
