"""Collectives inside the engine's ``shard_map``: device-varying casts, the ``ppermute`` pairs of
one hop over ``stage``, the reduction of the replicated leaves' gradients over ``stage`` and of
every gradient over ``data``."""

from __future__ import annotations

import jax

from asyncpp_jax.models.moe import is_expert_weight


def vary(tree, axes=("data", "stage")):
    """Cast to device-varying over ``axes``: differentiating w.r.t. a value that is invariant over an
    axis would make shard_map's transpose sum the gradient over that axis."""
    def one(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)


def hop_perms(n_stages: int, ring: bool = False) -> tuple[list, list]:
    """``ppermute`` pairs of one hop over ``stage``: forward (``s -> s+1``) and backward (``s+1 -> s``);
    with ``ring`` the last device also feeds device 0 (an interleaved device's next chunk) and back."""
    fwd = [(i, i + 1) for i in range(n_stages - 1)] + ([(n_stages - 1, 0)] if ring else [])
    return fwd, [(b, a) for a, b in fwd]


def reduce_top(acc, spec, axis: int):
    """A replicated leaf's stacked accumulator summed over ``stage`` (scattered where ``spec`` splits
    it), in one collective for every batch it holds; the accumulator axis stays at ``axis``."""
    spec = tuple(spec)
    if "stage" not in spec:
        return jax.lax.psum(acc, "stage")
    split = spec.index("stage")
    dim = split + (1 if axis <= split else 0)
    if _gloo_job():
        # Over gloo (a CPU job of several processes) XLA's reduce-scatter of a 50 MB slab takes
        # 1.5-2.5x its all-reduce (157 vs 96 ms between two pinned processes here; 100 MB: 335 vs
        # 143): reduce it whole and keep this device's slice.  In one process (and on accelerators)
        # the reduce-scatter is the faster one (67 vs 325 ms in-process, four devices on one core).
        full = jax.lax.psum(acc, "stage")
        n = full.shape[dim] // jax.lax.axis_size("stage")
        return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index("stage") * n, n, axis=dim)
    return jax.lax.psum_scatter(acc, "stage", scatter_dimension=dim, tiled=True)


def _gloo_job() -> bool:
    """Whether the collectives cross processes over gloo (XLA:CPU's multi-process collectives)."""
    return (jax.process_count() > 1 and jax.default_backend() == "cpu"
            and jax.config.jax_cpu_collectives_implementation == "gloo")


def mean_over_data(grads, expert_parallel: bool):
    """Average each gradient over ``data``."""
    data_size = jax.lax.axis_size("data")

    def one(path, g):
        if expert_parallel and is_expert_weight(path):
            # This device's experts already got every data shard's tokens (all_to_all's
            # transpose sums them): divide for the mean, no reduction.
            return g / data_size
        return jax.lax.pmean(g, "data")

    return jax.tree_util.tree_map_with_path(one, grads)
