"""Meshes for the simulate runner; the shard_map pipeline engine is in asyncpp_jax.pipeline.engine."""

from asyncpp_jax.pipeline.mesh import make_mesh  # noqa: F401
