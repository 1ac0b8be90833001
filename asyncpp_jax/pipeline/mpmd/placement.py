"""Where each tensor lives under ``config.pipeline.placement='mpmd'``: one device group per use.

One SPMD program gives every device the same shapes, so a table the first stage reads is held
(whole, or 1/P of it with ``vocab_parallel``) by every stage.  Under ``mpmd`` each stage runs its
own programs (:mod:`asyncpp_jax.pipeline.mpmd.engine`) and the state is split into four groups, each
on the devices that use it:

* ``layers``: the stacked layer leaves, over the whole ``('data', 'stage')`` mesh, sharded over
  ``stage`` as under ``spmd`` (stage ``s``'s rows on stage ``s``'s devices);
* ``first``: the embedding of an untied model, on stage 0's devices only;
* ``last``: the final norm (and an untied model's head), on stage ``P-1``'s devices only;
* ``ends``: a tied table, on stage 0's and stage ``P-1``'s devices (its gradient is summed
  between those two stages only, as Megatron-LM does with a tied embedding).

Every leaf of the train state (weights, the previous version, optimizer state, in-flight
gradient) sits with its group, so no middle stage holds anything vocabulary-sized.  A stage's
part of a group's array is a zero-copy view (:meth:`Placement.view`): the device buffers of that
stage, re-wrapped as an array on the stage's own mesh.
"""

from __future__ import annotations

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from asyncpp_jax.models.moe import is_expert_weight

GROUPS = ("layers", "first", "last", "ends")
DEVICE = P("data", "stage")  # per-device arrays: leading [data, stage] axes


def group_of(key: str, tied: bool) -> str:
    """The group of a top-level parameter key of the engine's layout."""
    if key == "layers":
        return "layers"
    if key == "embed":
        return "ends" if tied else "first"
    return "last"  # final_norm, lm_head


def split_groups(tree: dict, tied: bool) -> dict:
    """``{group: {key: subtree}}`` of a params-shaped dict (groups with no key are left out)."""
    out: dict = {}
    for key, sub in tree.items():
        out.setdefault(group_of(key, tied), {})[key] = sub
    return out


def join_groups(groups: dict) -> dict:
    return {k: v for g in GROUPS if g in groups for k, v in groups[g].items()}


def _spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


class Placement:
    """The device groups of a ``('data', 'stage')`` mesh and the views between them."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.n_stages = mesh.shape["stage"]
        devices = mesh.devices  # [data, stage]
        self.stage_meshes = [Mesh(devices[:, s:s + 1], mesh.axis_names) for s in range(self.n_stages)]
        self.ends_mesh = Mesh(devices[:, [0, self.n_stages - 1]], mesh.axis_names)

    def group_mesh(self, group: str) -> Mesh:
        return {"layers": self.mesh, "first": self.stage_meshes[0], "last": self.stage_meshes[-1],
                "ends": self.ends_mesh}[group]

    def group_stages(self, group: str) -> list[int]:
        last = self.n_stages - 1
        return {"layers": list(range(self.n_stages)), "first": [0], "last": [last], "ends": [0, last]}[group]

    def param_shardings(self, params, tied: bool, expert_parallel: bool = False):
        """The NamedSharding of each parameter: layer leaves over ``stage`` (routed experts also
        over ``data`` with ``expert_parallel``), the rest replicated on their group's devices."""
        def one(path, _):
            group = group_of(path[0].key, tied)
            if group != "layers":
                return NamedSharding(self.group_mesh(group), P())
            return NamedSharding(self.mesh, P("stage", "data") if expert_parallel and is_expert_weight(path)
                                 else P("stage"))
        return jax.tree_util.tree_map_with_path(one, params)

    def stage_sharding(self, s: int, spec=P()) -> NamedSharding:
        return NamedSharding(self.stage_meshes[s], spec)

    def view(self, x: jax.Array, s: int) -> jax.Array:
        """Stage ``s``'s part of ``x`` as an array on stage ``s``'s mesh, sharing its buffers: a
        dimension ``x`` splits over ``stage`` shrinks to that stage's block (the spec keeps its
        other axes)."""
        sharding = x.sharding
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        n = sharding.mesh.shape["stage"]
        shape = tuple(d // n if "stage" in _spec_axes(e) else d for d, e in zip(x.shape, spec))
        local_spec = P(*[tuple(a for a in _spec_axes(e) if a != "stage") or None for e in spec])
        devices = set(self.stage_meshes[s].devices.flat)
        shards = [sh.data for sh in x.addressable_shards if sh.device in devices]
        return jax.make_array_from_single_device_arrays(shape, self.stage_sharding(s, local_spec), shards)

    def assemble(self, parts: list, mesh: Mesh, spec) -> jax.Array:
        """One array on ``mesh`` from per-stage arrays whose ``stage`` axis has size 1 (``DEVICE``
        layout, or a leading stage block): the inverse of :meth:`view`, sharing the buffers."""
        stages = mesh.shape["stage"]
        first = parts[0]
        entries = tuple(spec) + (None,) * (first.ndim - len(spec))
        shape = tuple(d * stages if "stage" in _spec_axes(e) else d for d, e in zip(first.shape, entries))
        shards = [sh.data for part in parts for sh in part.addressable_shards]
        return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, spec), shards)

    def put(self, x, s: int):
        """``x`` (an array on some stage's mesh) sent to stage ``s``'s devices, same spec."""
        return jax.device_put(x, NamedSharding(self.stage_meshes[s], x.sharding.spec))


def bytes_on_devices(tree) -> dict:
    """Bytes each device holds of the arrays (or sharded ``ShapeDtypeStruct``s) in ``tree``:
    ``{device id: bytes}``, from each leaf's sharding and shard shape."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        sharding = leaf.sharding
        per = int(np.prod(sharding.shard_shape(leaf.shape))) * np.dtype(leaf.dtype).itemsize
        for d in sharding.device_set:
            out[d.id] = out.get(d.id, 0) + per
    return out
