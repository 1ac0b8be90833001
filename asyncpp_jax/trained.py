"""A run's trained model for inference: its config, the newest verified checkpoint's parameters in
the model's layout, and its tokenizer (what ``python -m asyncpp_jax.generate`` and ``python -m
asyncpp_jax.evaluate`` start from).

The checkpoint is chosen and read as the export reads it (:mod:`asyncpp_jax.export`): the newest
step whose files pass their sealed checksums, parameters only, on the host, the pipeline engine's
layout turned back into the model's.
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple

import jax
import ml_collections

from asyncpp_jax import export
from asyncpp_jax.data.tokenizers import Tokenizer, get_tokenizer
from asyncpp_jax.models import decode


class TrainedModel(NamedTuple):
    config: ml_collections.ConfigDict  # the run's config.json
    model_cfg: ml_collections.ConfigDict  # config.model for inference (decode.inference_config)
    params: dict  # the model's layout, on the default device
    tokenizer: Tokenizer
    step: int


def load(workdir, step: int | None = None) -> TrainedModel:
    """The run in ``workdir`` at its newest verified checkpoint (or ``step``); raises
    :class:`asyncpp_jax.export.ExportError` with the reason when there is none."""
    workdir = pathlib.Path(workdir)
    c = export.run_config(workdir)
    s, step_dir = export.latest_verified_step(workdir, step)
    params = jax.device_put(export.model_layout(c, export.read_params(step_dir)))
    try:
        tok = get_tokenizer(c.data.tokenizer, c.data.get("eos_token") or None)
    except ValueError as e:
        raise export.ExportError(f"the run's tokenizer {c.data.tokenizer!r} cannot be loaded ({e}).") from e
    return TrainedModel(c, decode.inference_config(c.model), params, tok, s)
