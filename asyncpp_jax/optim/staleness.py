"""Staleness transforms: simulated gradient delay and its mitigations, as optax transforms.

    optax.chain(delay(1), taylor_compensation(...), optax.adamw(3e-4), error_feedback())

- :func:`delay` turns a synchronous optimizer into the one-step-stale PipeDream-2BW update
  ``w[t+1] = w[t] - U_t(g(w[t-1]))`` (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training", arXiv:2006.09503), or into PipeDream's per-stage delay (Narayanan et al. 2019, SOSP,
  "PipeDream: Generalized Pipeline Parallelism for DNN Training") with ``leaf_delays`` from
  :func:`pipedream_leaf_delays`.  Its docstring is THE statement of the conventions at the
  synchronous-start and cooldown transitions; the pipeline engine follows it.
- :func:`error_feedback` applies ``u + strength * (u - u_prev)`` to the inner optimizer's updates.
- :func:`taylor_compensation` is DC-ASGD (Zheng et al. 2017, "Asynchronous Stochastic Gradient
  Descent with Delay Compensation", ICML, arXiv:1609.08326).

All three take the same schedule keywords (``steps``, ``sync_start_steps``, ``sync_cooldown_steps``,
``total_steps``, or one ``schedule=DelaySchedule(...)``) and the same optional ``leaf_delays``, and
each counts updates itself, so a chain built with the same keywords agrees on when the delay is in
force and on which steps are fill steps.  Their per-leaf histories (past gradients, past params,
the previous update) and :class:`WeightVersions`' past weights are all kept by :class:`LeafRings`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asyncpp_jax.optim.routing import path_names

@dataclasses.dataclass(frozen=True)
class DelaySchedule:
    """When the delay is in force: updates ``K <= t < T - C`` (``t`` counts updates from 0).

    ``steps`` is the delay ``D`` while in force; ``sync_start_steps`` ``K`` synchronous updates come
    first and ``sync_cooldown_steps`` ``C`` synchronous updates last (``C > 0`` needs
    ``total_steps`` ``T``).  Every method takes a (possibly traced) update count and is jit-safe.
    """

    steps: int = 1
    sync_start_steps: int = 0
    sync_cooldown_steps: int = 0
    total_steps: int | None = None

    def __post_init__(self):
        for name in ("steps", "sync_start_steps", "sync_cooldown_steps", "total_steps"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                ok = not isinstance(value, bool) and operator.index(value) >= 0
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"DelaySchedule.{name}={value!r} must be a non-negative integer.")
            object.__setattr__(self, name, operator.index(value))
        if self.total_steps is not None:
            if self.total_steps < self.sync_cooldown_steps:
                raise ValueError(
                    f"DelaySchedule.sync_cooldown_steps={self.sync_cooldown_steps} exceeds "
                    f"total_steps={self.total_steps}.")
        if self.sync_cooldown_steps > 0 and self.total_steps is None:
            raise ValueError(
                f"DelaySchedule.sync_cooldown_steps={self.sync_cooldown_steps} needs total_steps (the "
                "number of updates T): the synchronous cooldown covers updates T-C..T-1.")

    @property
    def cooldown_start(self) -> int | None:
        """``T - C``, the first synchronous cooldown update, or None without a cooldown."""
        if self.sync_cooldown_steps == 0:
            return None
        return self.total_steps - self.sync_cooldown_steps

    @property
    def always_in_force(self) -> bool:
        """True when every update ``t >= 0`` runs delayed (no synchronous start or cooldown): a
        runner then needs no synchronous program at all."""
        return self.steps > 0 and self.sync_start_steps == 0 and self.cooldown_start is None

    def in_force(self, count) -> jax.Array:
        """``steps > 0 and K <= count < T - C`` (elementwise for an array of counts)."""
        count = jnp.asarray(count, jnp.int32)
        if self.steps == 0:
            return jnp.zeros(count.shape, jnp.bool_)
        on = count >= self.sync_start_steps
        if self.cooldown_start is not None:
            on = on & (count < self.cooldown_start)
        return on

    def delay_at(self, count) -> jax.Array:
        """The delay update ``count`` runs under: ``steps`` while in force, else 0 (for metrics)."""
        return jnp.where(self.in_force(count), jnp.int32(self.steps), jnp.int32(0))

    def filling(self, count) -> jax.Array:
        """Whether update ``count`` is a fill step at delay ``steps`` (it applies a zero gradient)."""
        return self.in_force(count) & ~self.in_force(jnp.asarray(count, jnp.int32) - self.steps)

    def skipped_at(self, count) -> jax.Array:
        """How many buffered gradients update ``count`` drops: the in-flight ones at ``T - C``.

        That is ``steps`` at ``count == T - C`` (fewer if the delay came in force less than ``steps``
        updates before), else 0.  With per-leaf delays it counts at the largest delay; a leaf of
        delay ``d`` drops ``d``.
        """
        count = jnp.asarray(count, jnp.int32)
        if self.steps == 0 or self.cooldown_start is None:
            return jnp.zeros(count.shape, jnp.int32)
        end = self.cooldown_start
        n = min(max(end - max(self.sync_start_steps, end - self.steps), 0), self.steps)
        return jnp.where(count == end, jnp.int32(n), jnp.int32(0))


def _resolve(steps, sync_start_steps, sync_cooldown_steps, total_steps, schedule, leaf_delays):
    if schedule is None:
        schedule = DelaySchedule(steps, sync_start_steps, sync_cooldown_steps, total_steps)
    elif (steps, sync_start_steps, sync_cooldown_steps, total_steps) != (1, 0, 0, None):
        raise ValueError("Pass either schedule=DelaySchedule(...) or the schedule keywords, not both.")
    if leaf_delays is not None:
        biggest = max((int(np.max(np.asarray(d))) for d in jax.tree.leaves(leaf_delays)), default=0)
        schedule = dataclasses.replace(schedule, steps=biggest)
    return schedule


# ------------------------------------------------------------------------------- per-leaf rings


class LeafDelay(NamedTuple):
    """One leaf's delay after normalisation (see :class:`LeafRings`)."""

    depth: int  # m, the ring length: the largest delay of the leaf's slices; 0 = no ring
    delay: Any  # d: an int, or an int32 vector over the leading axis whose entries are not all equal


def _leaf_delay(d, leaf) -> LeafDelay:
    d = np.asarray(d)
    if not np.issubdtype(d.dtype, np.integer) or d.ndim > 1 or (d.size and d.min() < 0):
        raise ValueError(f"A leaf delay must be a non-negative int or an int vector, got {d!r}.")
    if d.ndim == 1:
        if np.ndim(leaf) < 1 or d.shape[0] != np.shape(leaf)[0]:
            raise ValueError(
                f"A leaf delay vector of length {d.shape[0]} must run over the leading axis of its "
                f"leaf, whose shape is {np.shape(leaf)}.")
        if np.all(d == d[0]):
            d = d[0]
    if d.ndim == 0:
        return LeafDelay(int(d), int(d))
    return LeafDelay(int(d.max()), d.astype(np.int32))


def _per_slice(x, d, ndim):
    """Broadcast a per-slice quantity (shape [L], from a delay vector) against a leaf of rank ndim."""
    return x if np.ndim(d) == 0 else jnp.reshape(x, (-1,) + (1,) * (ndim - 1))


class LeafRings:
    """Ring buffers of past values, one per leaf of a params-shaped tree, each as deep as its delay.

    The one piece of bookkeeping behind :func:`delay` (past gradients), :func:`taylor_compensation`
    (past params), :func:`error_feedback` (the previous update) and :class:`WeightVersions` (past
    weights).  Every leaf has a delay ``d``: the schedule's ``steps``, or its entry of
    ``leaf_delays`` (an int, or an int vector over the leaf's leading axis, one delay per stacked
    layer).  A leaf whose largest delay is ``m > 0`` gets a ring ``[m, *leaf.shape]``; the value
    pushed at update ``s`` sits in slot ``s mod m``, so at update ``t`` :meth:`read` returns, slice
    by slice, the value pushed ``d`` updates ago (the oldest one kept when ``d = m``).  A leaf with
    ``m = 0`` keeps a scalar placeholder, because orbax refuses zero-size arrays, and :meth:`map`
    passes it through untouched.

    Rings and counters live in the caller's optax state; this class holds only the (static)
    schedule and delays, so it is safe to build at trace time.
    """

    def __init__(self, schedule: DelaySchedule, leaf_delays=None):
        self.schedule = schedule
        self.leaf_delays = leaf_delays

    def delays(self, tree) -> tuple[list, Any, list[LeafDelay]]:
        """``(leaves, treedef, [LeafDelay per leaf])`` of a params-shaped tree, or of a group of its
        top-level entries (a dict with some of the params' keys: the ``mpmd`` placement updates each
        parameter group on its own devices)."""
        leaves, treedef = jax.tree.flatten(tree)
        if self.leaf_delays is None:
            steps = self.schedule.steps
            return leaves, treedef, [LeafDelay(steps, steps)] * len(leaves)
        leaf_delays = self.leaf_delays
        if isinstance(tree, dict) and isinstance(leaf_delays, dict) and set(tree) < set(leaf_delays):
            leaf_delays = {k: leaf_delays[k] for k in tree}
        try:
            delays = treedef.flatten_up_to(leaf_delays)
        except (ValueError, TypeError) as e:
            raise ValueError(f"leaf_delays must have the tree structure of the params: {e}") from e
        return leaves, treedef, [_leaf_delay(d, x) for d, x in zip(delays, leaves)]

    def init(self, tree):
        """Zero rings ``[m, *leaf.shape]`` in each leaf's dtype (scalar placeholders where ``m = 0``)."""
        leaves, treedef, lds = self.delays(tree)
        return treedef.unflatten([_placeholder(x, ld.depth) for x, ld in zip(leaves, lds)])

    def init_slot(self, tree):
        """One zero copy of each delayed leaf (scalar placeholders where ``m = 0``): a ring of depth 1
        without the ring axis, for values kept one update (error feedback's ``u_{t-1}``, an EMA)."""
        leaves, treedef, lds = self.delays(tree)
        return treedef.unflatten([jnp.zeros_like(x) if ld.depth else _placeholder(x, 0)
                                  for x, ld in zip(leaves, lds)])

    @staticmethod
    def read(ring, count, ld: LeafDelay):
        """The value pushed ``d`` updates before update ``count`` (slot ``(count - d) mod m``), per slice."""
        m, d = ld
        if np.ndim(d) == 0:
            return jax.lax.dynamic_index_in_dim(ring, (count - d) % m, keepdims=False)
        return ring[(count - jnp.asarray(d)) % m, jnp.arange(d.shape[0])]

    @staticmethod
    def push(ring, count, x, ld: LeafDelay):
        """The ring with ``x`` (cast to the ring's dtype) in slot ``count mod m``."""
        return jax.lax.dynamic_update_index_in_dim(ring, x.astype(ring.dtype), count % ld.depth, 0)

    def gates(self, count, ld: LeafDelay, ndim: int, lag: int = 0):
        """``(delayed, ready)`` per slice at update ``count``, each broadcastable to the leaf.

        ``delayed``: the delay is in force at ``count`` and the slice's ``d > 0``.  ``ready``: the
        delay was already in force at ``count - lag - d``, so with ``lag = 0`` the value pushed
        ``d`` updates ago is a delayed one; ``delayed & ~ready`` is a fill step (see :func:`delay`).
        """
        d = ld.delay
        dv = jnp.asarray(d)
        delayed = self.schedule.in_force(count) & _per_slice(dv > 0, d, ndim)
        ready = _per_slice(self.schedule.in_force(count - lag - dv if lag else count - dv), d, ndim)
        return delayed, ready

    def map(self, fn, tree, *others, keep=(0,)):
        """Apply ``fn(leaf_delay, x, *other_leaves)`` to each leaf of ``tree`` that has a ring.

        ``others`` are trees with ``tree``'s structure down to its leaves (rings, slots, params), or
        None for "no tree here" (``fn`` gets None).  ``fn`` returns ``len(keep)`` values; a leaf with
        ``m = 0`` instead passes through its inputs at positions ``keep`` (0 is ``x``).  Returns one
        tree per output, as a tuple.
        """
        leaves, treedef, lds = self.delays(tree)
        flat = [[None] * len(leaves) if o is None else treedef.flatten_up_to(o) for o in others]
        rows = []
        for ld, *xs in zip(lds, leaves, *flat):
            rows.append(tuple(fn(ld, *xs)) if ld.depth else tuple(xs[i] for i in keep))
        columns = list(zip(*rows)) if rows else [()] * len(keep)
        return tuple(treedef.unflatten(list(c)) for c in columns)


def _placeholder(leaf, m: int):
    # Orbax refuses zero-size arrays, so a leaf that never needs a ring keeps a scalar placeholder.
    return jnp.zeros((m,) + tuple(leaf.shape) if m else (), leaf.dtype)


def _count_only_init(params):
    del params
    return jnp.zeros([], jnp.int32)


# ----------------------------------------------------------------------------------------- delay


def _counting_identity(make_state) -> optax.GradientTransformation:
    """The identity, keeping only an update counter (state ``make_state(count)``, a NamedTuple)."""

    def init_fn(params):
        return make_state(_count_only_init(params))

    def update_fn(updates, state, params=None):
        del params
        return updates, state._replace(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


class DelayState(NamedTuple):
    count: jax.Array  # int32: updates so far
    gradient_ring: Any  # per leaf [m, *shape]: the last m gradients (scalar where m = 0); () if none


def delay(
    steps: int = 1,
    *,
    sync_start_steps: int = 0,
    sync_cooldown_steps: int = 0,
    total_steps: int | None = None,
    leaf_delays=None,
    schedule: DelaySchedule | None = None,
) -> optax.GradientTransformation:
    """Hand the optimizer the gradient from ``d`` updates ago: simulated pipeline staleness.

    Conventions (the pipeline engine follows these; this is their only statement).  ``t`` is the
    0-indexed update count (this transform's own counter), ``g_t`` the gradient handed in at update
    ``t`` (computed at ``w_t`` on batch ``t``), ``d`` the delay of a leaf or layer slice while the
    delay is in force, i.e. while ``K <= t < T - C`` (:class:`DelaySchedule`).

    - Steady state: update ``t`` outputs ``g_{t-d}``.  With ``d = 1`` this is PipeDream-2BW,
      ``w[t+1] = w[t] - U_t(g(w[t-1]))``.  ``delay(0)`` is the identity and keeps only a counter,
      so ``chain(delay(0), opt)`` equals ``opt`` bit for bit.
    - Fill: update ``t`` is a fill step when the delay is in force at ``t`` but was not at ``t - d``
      (the first ``d`` delayed updates: at the very start, or right after the ``K`` synchronous
      updates).  A fill step outputs ZEROS (the inner optimizer sees a zero gradient, like the real
      pipeline's fill bubble) and buffers ``g_t``.  At the sync->async switch no gradient is applied
      twice: ``g_{K-1}`` is applied fresh at ``K - 1``, updates ``K..K+d-1`` apply zeros, ``g_K`` is
      applied at ``K + d``.
    - Delay off (before ``K``, from ``T - C`` on, or ``steps = 0``): update ``t`` outputs ``g_t``.
      The gradients in flight at the cooldown switch, ``g_{T-C-d} .. g_{T-C-1}``, are DROPPED, never
      applied: ``d`` batches are skipped at the cooldown switch.
      ``DelaySchedule.skipped_at(t)`` gives that count (``d`` at ``t = T - C``, else 0) for the log.
      Without a cooldown, the last ``d`` gradients of a run are likewise never applied.
    - Every gradient is applied at most once.

    Per-leaf / per-layer delays: ``leaf_delays`` is a tree with the structure of the params whose
    leaves are each an int, or an int vector over the leaf's LEADING axis (stacked layers
    ``[L, ...]``: slice ``l`` has its own delay; see :func:`pipedream_leaf_delays`).  The rules
    above then hold per slice with that slice's ``d``; a ``d = 0`` slice passes its fresh gradient.
    When ``leaf_delays`` is given, ``steps`` is ignored: the schedule's delay becomes the largest
    leaf delay (what ``delay_at`` reports), while ``K``, ``C`` and ``T`` apply to every leaf.

    State: the counter and, per leaf of largest delay ``m > 0``, a ring ``[m, *leaf.shape]`` of the
    last ``m`` gradients (``g_s`` in slot ``s mod m``; a scalar placeholder where ``m = 0``), so
    ``delay(1)`` holds exactly one gradient tree.
    """
    sched = _resolve(steps, sync_start_steps, sync_cooldown_steps, total_steps, schedule, leaf_delays)

    if sched.steps == 0:
        return _counting_identity(lambda count: DelayState(count, ()))

    rings = LeafRings(sched, leaf_delays)

    def init_fn(params):
        return DelayState(jnp.zeros([], jnp.int32), rings.init(params))

    def update_fn(updates, state, params=None):
        del params
        count = state.count

        def leaf(ld, g, ring):
            stale = rings.read(ring, count, ld).astype(g.dtype)
            # g_{t-d} is waiting in the ring only if the delay was already in force when it came in;
            # otherwise it was applied fresh (or never existed) and this is a fill step.
            delayed, ready = rings.gates(count, ld, g.ndim)
            out = jnp.where(delayed, jnp.where(ready, stale, jnp.zeros_like(g)), g)
            return out, rings.push(ring, count, g, ld)

        out, ring = rings.map(leaf, updates, state.gradient_ring, keep=(0, 1))
        return out, DelayState(optax.safe_increment(count), ring)

    return optax.GradientTransformation(init_fn, update_fn)


def pipedream_leaf_delays(params, n_stages: int):
    """PipeDream's per-stage delays for a :mod:`asyncpp_jax.models.dense` params tree.

    The ``L`` stacked layers split into ``P = n_stages`` contiguous stages, layers
    ``[s L/P, (s+1) L/P)`` on stage ``s``, and stage ``s`` (0-indexed) sees delay ``P - 1 - s``
    (Narayanan et al. 2019).  ``embed`` lives on stage 0 (delay ``P - 1``); ``final_norm`` and
    ``lm_head`` on stage ``P - 1`` (delay 0).  With tied embeddings the one embedding matrix serves
    stage 0 (input lookup) and stage ``P - 1`` (output projection); it is given stage 0's delay
    ``P - 1``, i.e. its whole gradient, both contributions, is applied ``P - 1`` updates late.

    Returns a tree like ``params``: an int per leaf, and for each ``layers/...`` leaf an int32
    vector ``[L]`` over its leading layer axis, ready for ``delay(leaf_delays=...)``.  Works on
    abstract params (``jax.eval_shape``).
    """
    n_stages = operator.index(n_stages)
    if n_stages < 1:
        raise ValueError(f"config.staleness.pipedream_stages={n_stages} must be a positive integer.")
    layer_lengths = {
        x.shape[0] for path, x in jax.tree_util.tree_leaves_with_path(params)
        if path_names(path)[0] == "layers"
    }
    if len(layer_lengths) > 1:
        raise ValueError(f"layers/... leaves disagree on the layer count: {sorted(layer_lengths)}.")
    n_layers = layer_lengths.pop() if layer_lengths else 0
    if n_layers % n_stages:
        raise ValueError(
            f"config.staleness.pipedream_stages={n_stages} does not divide config.model.n_layers={n_layers}: "
            "each pipeline stage holds a contiguous block of L/P layers.")
    per_stage = n_layers // n_stages if n_layers else 1
    layer_delays = (n_stages - 1 - np.arange(n_layers) // per_stage).astype(np.int32)
    delay_of_top = {"embed": n_stages - 1, "final_norm": 0, "lm_head": 0}

    def leaf_delay(path, x):
        top = path_names(path)[0]
        if top == "layers":
            return layer_delays.copy()
        if top not in delay_of_top:
            raise ValueError(
                f"pipedream_leaf_delays does not know which stage holds {'/'.join(path_names(path))!r}; "
                f"expected top-level keys {sorted(delay_of_top) + ['layers']}.")
        return delay_of_top[top]

    return jax.tree_util.tree_map_with_path(leaf_delay, params)


class WeightVersionsState(NamedTuple):
    count: jax.Array  # int32: updates so far
    weight_ring: Any  # per leaf [m, *shape]: the weights before each of the last m updates (scalar where m = 0)


class WeightVersions:
    """PipeDream's exact mixed-version gradient point, for the ``simulate`` runner.

    Real PipeDream (Narayanan et al. 2019) takes update ``t``'s gradient at the mixed point

        w_mix[t] = (w_0[t - d_0], ..., w_{P-1}[t - d_{P-1}]),   d_s = P - 1 - s,

    each stage's own stashed weights, and applies it at once: ``w[t+1] = w[t] - U_t(∇L(w_mix[t]))``.
    ``delay(leaf_delays=pipedream_leaf_delays(...))`` only approximates this: it hands stage ``s``
    its slice of ``∇L(w[t - d_s])``, a gradient taken at one consistent (all-stale) point.  This
    class gives the runner what it needs for the faithful version: :meth:`mixed_point` builds
    ``w_mix[t]`` from a ring of past weights, :meth:`mask_fill` zeroes the slices in their fill
    steps, and :meth:`push` records ``w[t]``.  The conventions are :func:`delay`'s, per slice: the
    delay of slice ``s`` is ``d_s`` while the schedule has it in force; update ``t`` is a fill step
    for that slice (zero gradient) when the delay is in force at ``t`` but not at ``t - d_s``; with
    the delay off the slice uses ``w[t]``.  With every ``d_s = 1`` this is 2BW with the batches
    relabelled: update ``t`` takes batch ``t``'s gradient at ``w[t-1]``, where ``delay(1)`` applies
    batch ``t-1``'s gradient at ``w[t-1]``.

    State: the counter and, per leaf of largest delay ``m > 0``, a ring ``[m, *leaf.shape]`` of the
    weights before each of the last ``m`` updates: ``P - 1`` copies of the stage-0 and layer
    weights (the layer stack keeps one ring for all its slices), none for the last stage's head.
    """

    def __init__(self, leaf_delays, schedule: DelaySchedule):
        self.leaf_delays = leaf_delays
        self.schedule = _resolve(1, 0, 0, None, schedule, leaf_delays)
        self.rings = LeafRings(self.schedule, leaf_delays)

    def init(self, params) -> WeightVersionsState:
        return WeightVersionsState(jnp.zeros([], jnp.int32), self.rings.init(params))

    def mixed_point(self, params, state: WeightVersionsState):
        """``w_mix[t]``: ``w[t - d_s]`` on slices whose delay is in force and past its fill, else ``w[t]``."""
        rings, count = self.rings, state.count

        def leaf(ld, w, ring):
            delayed, ready = rings.gates(count, ld, w.ndim)
            return (jnp.where(delayed & ready, rings.read(ring, count, ld).astype(w.dtype), w),)

        return rings.map(leaf, params, state.weight_ring)[0]

    def mask_fill(self, grads, state: WeightVersionsState):
        """Zero the gradient on slices in a fill step (their stage has no finished backward yet)."""
        rings, count = self.rings, state.count

        def leaf(ld, g):
            delayed, ready = rings.gates(count, ld, g.ndim)
            return (jnp.where(delayed & ~ready, jnp.zeros_like(g), g),)

        return rings.map(leaf, grads)[0]

    def push(self, params, state: WeightVersionsState) -> WeightVersionsState:
        """Record ``w[t]`` (the weights before update ``t``) and advance the counter."""
        rings, count = self.rings, state.count
        ring = rings.map(lambda ld, w, r: (rings.push(r, count, w, ld),), params, state.weight_ring, keep=(1,))[0]
        return WeightVersionsState(optax.safe_increment(count), ring)


# ---------------------------------------------------------------------------------- error feedback


class ErrorFeedbackState(NamedTuple):
    count: jax.Array  # int32: updates so far
    previous_update: Any  # per leaf: u_{t-1} before correction (scalar where delay 0); () if none


def error_feedback(
    strength: float = 1.0,
    *,
    steps: int = 1,
    sync_start_steps: int = 0,
    sync_cooldown_steps: int = 0,
    total_steps: int | None = None,
    leaf_delays=None,
    schedule: DelaySchedule | None = None,
) -> optax.GradientTransformation:
    """Update-level error feedback: ``out_t = u_t + strength * (u_t - u_{t-1})``.

    Placed after the inner optimizer (``chain(delay(1), opt, error_feedback())``), ``u_t`` is the
    optimizer's update for the stale gradient, so with strength 1 and delay 1 the parameters follow
    ``x[t+1] = x[t] - 2 u[t-1](g[t-1]) + u[t-2](g[t-2])`` (here ``u[s]`` is the step the optimizer
    takes for gradient ``g[s]``, to be subtracted; in optax's sign convention ``out_t = 2 u_t -
    u_{t-1}`` is added): the update that arrives one step late is extrapolated one step forward.

    The correction is active at update ``t`` only when both ``u_t`` and ``u_{t-1}`` are updates of
    delayed, non-fill gradients: the delay is in force at ``t`` and at ``t - 1 - d`` (hence at every
    update between).  Otherwise (synchronous phases, fill steps, the first delayed update after
    fill, slices of delay 0) ``out_t = u_t``.  The schedule keywords and ``leaf_delays`` must match
    the chain's :func:`delay`; per-leaf delays give a per-slice activation.

    State: the counter and ONE update tree (``u_{t-1}``, the uncorrected update; a scalar placeholder
    for leaves of delay 0).  ``strength = 0`` or no delay: the identity, with only a counter.
    """
    sched = _resolve(steps, sync_start_steps, sync_cooldown_steps, total_steps, schedule, leaf_delays)

    if strength == 0 or sched.steps == 0:
        return _counting_identity(lambda count: ErrorFeedbackState(count, ()))

    rings = LeafRings(sched, leaf_delays)

    def init_fn(params):
        return ErrorFeedbackState(jnp.zeros([], jnp.int32), rings.init_slot(params))

    def update_fn(updates, state, params=None):
        del params
        count = state.count

        def leaf(ld, u, prev):
            # Active when u_{t-1} too came from a delayed, non-fill gradient: in force at t - 1 - d.
            delayed, ready = rings.gates(count, ld, u.ndim, lag=1)
            prev = prev.astype(u.dtype)
            return jnp.where(delayed & ready, u + strength * (u - prev), u), u

        out, prev = rings.map(leaf, updates, state.previous_update, keep=(0, 1))
        return out, ErrorFeedbackState(optax.safe_increment(count), prev)

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------- delay compensation


class TaylorState(NamedTuple):
    count: jax.Array  # int32: updates so far
    param_ring: Any  # per leaf [m, *shape]: params of the last m updates (scalar where m = 0)
    grad_sq_ema: Any  # adaptive only: EMA of g^2 per leaf (scalar where m = 0); () otherwise


def taylor_compensation(
    lam: float = 0.0,
    *,
    adaptive: bool = False,
    lam0: float = 2.0,
    ema_decay: float = 0.99,
    eps: float = 1e-8,
    steps: int = 1,
    sync_start_steps: int = 0,
    sync_cooldown_steps: int = 0,
    total_steps: int | None = None,
    leaf_delays=None,
    schedule: DelaySchedule | None = None,
) -> optax.GradientTransformation:
    """DC-ASGD delay compensation (Zheng et al. 2017, arXiv:1609.08326).

    A first-order Taylor step of the gradient from the stale weights to the current ones, with the
    Hessian replaced by the diagonal outer-product approximation ``lam * g * g``::

        g_c = g + lam * g * g * (w_t - w_{t-d})

    Place it right after :func:`delay` with the same schedule keywords: ``g`` is the stale gradient
    ``g_{t-d}`` (computed at ``w_{t-d}``) and ``params`` must be the CURRENT params ``w_t`` (optax
    passes them: ``tx.update(grads, state, params)``).  Adaptive form (DC-ASGD-a):
    ``lam = lam0 / sqrt(v_t + eps)`` elementwise with ``v_t = ema_decay * v_{t-1} + (1 - ema_decay)
    * g^2`` (``v_{-1} = 0``, no bias correction, ``v_t`` includes the current ``g``), updated on every
    update except fill steps (whose ``g`` is the zero placeholder).  ``lam0 = 2`` is only an order-one
    starting point: tune it.

    No correction where the delay is not in force, on fill steps, or for slices of delay 0.

    State: the counter; per leaf of largest delay ``m > 0`` a ring ``[m, *leaf.shape]`` of the params
    seen at the last ``m`` updates (``w_s`` in slot ``s mod m``), i.e. at most ``D`` param trees
    for delay ``D``; and for the adaptive form one EMA tree (scalar placeholders where ``m = 0``).
    ``lam = 0`` without ``adaptive``, or no delay: the identity with only a counter.
    """
    sched = _resolve(steps, sync_start_steps, sync_cooldown_steps, total_steps, schedule, leaf_delays)

    if (lam == 0 and not adaptive) or sched.steps == 0:
        return _counting_identity(lambda count: TaylorState(count, (), ()))

    rings = LeafRings(sched, leaf_delays)

    def init_fn(params):
        return TaylorState(jnp.zeros([], jnp.int32), rings.init(params),
                           rings.init_slot(params) if adaptive else ())

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("taylor_compensation needs the current params: call update(g, state, params).")
        count = state.count

        def leaf(ld, g, ring, ema, w):
            w_stale = rings.read(ring, count, ld)
            delayed, ready = rings.gates(count, ld, g.ndim)
            if adaptive:
                filling = delayed & ~ready
                ema = jnp.where(filling, ema, ema_decay * ema + (1.0 - ema_decay) * g * g)
                coeff = lam0 / jnp.sqrt(ema + eps)
            else:
                coeff = lam
            corrected = g + coeff * g * g * (w - w_stale).astype(g.dtype)
            return jnp.where(delayed & ready, corrected, g), rings.push(ring, count, w, ld), ema

        emas = state.grad_sq_ema if adaptive else None
        out, ring, ema = rings.map(leaf, updates, state.param_ring, emas, params, keep=(0, 1, 2))
        return out, TaylorState(optax.safe_increment(count), ring, ema if adaptive else ())

    return optax.GradientTransformation(init_fn, update_fn)
