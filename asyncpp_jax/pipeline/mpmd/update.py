"""The update of the ``mpmd`` placement: each parameter group updated on its own devices.

One jitted program cannot take arrays that live on different device sets, so the update is one
program per group (:mod:`asyncpp_jax.pipeline.mpmd.placement`): the layers over the whole mesh,
the embedding on stage 0, the head on stage ``P-1``, a tied table on both.  Each group's
optimizer state is its own, ``opt_state[group] = optimizer.init(params[group])``; every optimizer
here is elementwise or per matrix, so this is the same update as one chain over the whole tree.

The one coupling between groups is the global-norm clip (``config.optimizer.grad_clip``): each
group's squared norm, a scalar, is sent to every other group and the clip applied with the
total, as ``optax.clip_by_global_norm`` does (``g`` when ``|g| < c``, else ``g / |g| * c``).
A tied table's gradient is the sum of its lookup's (stage 0) and its head's (stage ``P-1``): the
two accumulators meet on the two end stages only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models import dense
from asyncpp_jax.models.moe import is_expert_weight
from asyncpp_jax.pipeline.mpmd.placement import DEVICE, Placement, split_groups


def opt_shardings(placement: Placement, group: str, opt_abstract, n_rows: int, expert_shapes=frozenset()):
    """Where each leaf of a group's optimizer state lives: a stacked-layer moment over ``stage``
    like its parameter (a routed expert's, of one of ``expert_shapes``, also over ``data``),
    everything else replicated on the group's devices."""
    mesh = placement.group_mesh(group)

    def one(x):
        if group == "layers" and tuple(x.shape) in expert_shapes:
            return NamedSharding(mesh, P("stage", "data"))
        stacked = group == "layers" and x.ndim >= 1 and x.shape[0] == n_rows
        return NamedSharding(mesh, P("stage") if stacked else P())

    return jax.tree.map(one, opt_abstract)


class GroupedUpdate:
    """``reduce`` the finished batch's accumulators into each group's gradient, then ``apply``
    the optimizer group by group with the global norm."""

    def __init__(self, model_cfg, optimizer: optax.GradientTransformation, schedule, placement: Placement,
                 params_abstract, grad_clip: float = 0.0, expert_parallel: bool = False):
        self.cfg, self.optimizer, self.schedule, self.placement = model_cfg, optimizer, schedule, placement
        self.expert_parallel = expert_parallel
        self.tied = bool(model_cfg.tie_embeddings)
        self.grad_clip = float(grad_clip or 0.0)
        self.abstract = split_groups(params_abstract, self.tied)
        self.groups = list(self.abstract)
        self.n_rows = {x.shape[0] for x in jax.tree.leaves(params_abstract["layers"])}.pop()
        shard = placement.param_shardings(params_abstract, self.tied, expert_parallel)
        self.param_shardings = split_groups(shard, self.tied)
        experts = frozenset(tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(params_abstract)
                            if expert_parallel and is_expert_weight(path))
        self.opt_shardings = {g: opt_shardings(placement, g, jax.eval_shape(optimizer.init, self.abstract[g]),
                                               self.n_rows, experts) for g in self.groups}
        scalar = {g: NamedSharding(placement.group_mesh(g), P()) for g in self.groups}
        reduce = {"layers": self._reduce_layers, "first": self._reduce_first, "last": self._reduce_last,
                  "ends": self._reduce_ends}  # each group's reduction over its devices
        self.reduce_fns = {g: jax.jit(reduce[g], out_shardings=(self.param_shardings[g], scalar[g]))
                           for g in self.groups}
        outs = {g: (self.param_shardings[g], self.opt_shardings[g], scalar[g]) for g in self.groups}
        self.apply_fns = {g: jax.jit(self._apply_fn, donate_argnums=(0, 1), out_shardings=outs[g])
                          for g in self.groups}
        self.retiring_fns = {g: jax.jit(self._apply_retiring_fn, donate_argnums=(1, 4), out_shardings=outs[g])
                             for g in self.groups}

    # --------------------------------------------------------------------------- init
    def init(self, params: dict) -> dict:
        """``{group: optimizer state}`` on each group's devices."""
        groups = split_groups(params, self.tied)
        return {g: jax.jit(self.optimizer.init, out_shardings=self.opt_shardings[g])(groups[g]) for g in self.groups}

    def abstract_opt_state(self) -> dict:
        return {g: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                jax.eval_shape(self.optimizer.init, self.abstract[g]), self.opt_shardings[g])
                for g in self.groups}

    # ------------------------------------------------------------------------- reduce
    @staticmethod
    def _sq(tree):
        return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))

    def _reduce_layers(self, acc):
        """``[data, P, L/P, ...]`` per leaf -> the mean over replicas, ``[L, ...]`` over ``stage``.
        A routed expert's (``[data, P, L/P, E/data, ...]`` under expert parallelism) holds each
        device's own experts, which already saw every replica's tokens (all_to_all's transpose sums
        them): laid side by side and divided by ``data`` for the mean, not reduced."""
        def one(path, a):
            if self.expert_parallel and is_expert_weight(path):
                a = jnp.moveaxis(a, 0, 2) / a.shape[0]  # [P, L/P, data, E/data, ...]: device d's block of E
                return a.reshape((a.shape[0] * a.shape[1], a.shape[2] * a.shape[3]) + a.shape[4:])
            return jnp.mean(a, 0).reshape((-1,) + a.shape[3:])

        g = {"layers": jax.tree_util.tree_map_with_path(one, acc)}
        return g, self._sq(g)

    def _reduce_first(self, table):
        g = {"embed": {"embedding": jnp.mean(table, 0)[0]}}
        return g, self._sq(g)

    def _reduce_last(self, head):
        head = jax.tree.map(lambda a: jnp.mean(a, 0)[0], head)
        g = {"final_norm": head["final_norm"]} if self.tied else dense.grads_from_head(self.cfg, head)
        return g, self._sq(g)

    def _reduce_ends(self, table):
        """The tied table's ``[data, 2, D, V]`` (lookup on stage 0, head on stage ``P-1``)."""
        g = {"embed": {"embedding": jnp.mean(jnp.sum(table, 1), 0)}}
        return g, self._sq(g)

    def reduce(self, accs: list) -> tuple[dict, dict]:
        """Per-stage accumulators of one batch -> ``({group: gradient}, {group: squared norm})``."""
        pl, last = self.placement, len(accs) - 1
        inputs = {"layers": jax.tree.map(lambda *parts: pl.assemble(list(parts), pl.mesh, DEVICE),
                                         *[a["layers"] for a in accs])}
        head = accs[last]["head"]
        if self.tied:
            inputs["ends"] = pl.assemble([accs[0]["table"], head["w"]], pl.ends_mesh, DEVICE)
            inputs["last"] = {"final_norm": head["final_norm"]}
        else:
            inputs["first"] = accs[0]["table"]
            inputs["last"] = head
        grads, sqs = {}, {}
        for g in self.groups:
            grads[g], sqs[g] = self.reduce_fns[g](inputs[g])
        return grads, sqs

    # -------------------------------------------------------------------------- apply
    def _apply_fn(self, params, opt_state, grads, sqs):
        norm = jnp.sqrt(sum(sqs))
        if self.grad_clip:
            c = self.grad_clip
            grads = jax.tree.map(lambda g: jnp.where(norm < c, g, (g / norm * c).astype(g.dtype)), grads)
        with jax.named_scope("optimizer_update"):  # a part of the step in train/profile.py
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, norm

    def _apply_retiring_fn(self, params, opt_state, grads, sqs, retired):
        del retired  # donated: the new weights are written into the retired version's buffers
        return self._apply_fn(params, opt_state, grads, sqs)

    def apply(self, params: dict, opt_state: dict, grads: dict, sqs: dict, retired: dict | None = None):
        """``(new params, new opt_state, global norm on the last stage)``.  ``retired`` (2bw: the
        version no batch reads any more) is donated, so the new weights take its buffers and
        ``params`` stays alive as the next previous version."""
        groups = split_groups(params, self.tied)
        retired = split_groups(retired, self.tied) if retired is not None else None
        order = list(self.groups)
        new_params, new_opt, norms = {}, {}, {}
        for g in order:
            mesh = self.placement.group_mesh(g)
            here = [jax.device_put(sqs[h], NamedSharding(mesh, P())) for h in order]
            if retired is None:
                new_params[g], new_opt[g], norms[g] = self.apply_fns[g](groups[g], opt_state[g], grads[g], here)
            else:
                new_params[g], new_opt[g], norms[g] = self.retiring_fns[g](groups[g], opt_state[g], grads[g],
                                                                           here, retired[g])
        return {k: v for g in order for k, v in new_params[g].items()}, new_opt, norms["last"]

    # ------------------------------------------------------------------------ metrics
    def metrics(self, sums: list, norm, step: int, delay_schedule=None) -> dict:
        """The engine's metrics from each stage's loss sums (``[data, 1]`` scalars), moved to the
        last stage: sums over stages, means over replicas, divided by the applied microbatches."""
        last = self.placement.n_stages - 1
        moved = [jax.tree.map(lambda x: self.placement.put(x, last), s) for s in sums]
        return _metrics(moved, norm, np.int32(step), self.schedule, delay_schedule)


def _metrics_fn(sums, norm, step, schedule, delay_schedule):
    totals = {k: jnp.mean(sum(s[k] for s in sums)) for k in sums[0]}
    count = totals.pop("count")  # 0 at a fill update: no batch's gradient is applied, so no loss
    out = {k: v / count for k, v in totals.items()}
    out.update(loss_microbatches=count, grad_norm=norm, lr=schedule(step))
    if delay_schedule is not None:
        out.update(delay=delay_schedule.delay_at(step), skipped_batches=delay_schedule.skipped_at(step))
    return out


_metrics = jax.jit(_metrics_fn, static_argnums=(3, 4))
