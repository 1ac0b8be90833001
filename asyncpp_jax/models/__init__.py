"""Flax models with stacked (scanned) layer parameters."""

from asyncpp_jax.models.dense import (  # noqa: F401
    Decoder,
    abstract_params,
    apply_layers,
    count_params,
    cross_entropy,
    embed,
    forward,
    init_params,
    logits_from_hidden,
    loss_fn,
    slice_layers,
)
