"""Meshes and (later) the shard_map pipeline engine."""

from asyncpp_jax.pipeline.mesh import make_mesh  # noqa: F401
