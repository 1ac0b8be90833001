"""Optimizers as optax transforms, and the factory that builds them from a config."""

from asyncpp_jax.optim.factory import build_optimizer, decay_mask  # noqa: F401
from asyncpp_jax.optim.schedules import make_schedule  # noqa: F401
