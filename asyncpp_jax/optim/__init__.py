"""Optimizers as optax transforms, and the factory that builds them from a config.

    from asyncpp_jax import optim
    tx = optim.muon(3e-3)              # Muon on hidden matrices, AdamW on the rest
    tx = optim.muon(3e-3, side=optim.AdamWBranch(learning_rate=1e-3))   # its AdamW side branch's settings
    tx = optim.soap(3e-3); tx = optim.adan(1e-3); tx = optim.lion(3e-4); tx = optim.mars(3e-3)
    tx = optax.chain(optim.delay(1), optim.muon(3e-3), optim.error_feedback())   # 2BW + EF
    tx = optax.chain(optim.delay(1), optim.nesterov_lookahead(3e-4))              # 2BW + NAG look-ahead
"""

from asyncpp_jax.optim.adamw import AdamWBranch, adamw, decay_mask  # noqa: F401
from asyncpp_jax.optim.adan import adan, scale_by_adan  # noqa: F401
from asyncpp_jax.optim.delay_lr import delay_aware_lr  # noqa: F401
from asyncpp_jax.optim.factory import build_main, build_optimizer, delay_schedule, describe_routing, weight_versions  # noqa: F401
from asyncpp_jax.optim.factory import build_nesterov_main, weight_prediction  # noqa: F401
from asyncpp_jax.optim.lookahead import nesterov_lookahead, scale_by_nesterov_lookahead  # noqa: F401
from asyncpp_jax.optim.lion import lion  # noqa: F401
from asyncpp_jax.optim.mars import mars, scale_by_mars  # noqa: F401
from asyncpp_jax.optim.muon import muon, orthogonalize, scale_by_muon  # noqa: F401
from asyncpp_jax.optim.prediction import WeightPrediction, WeightPredictionState  # noqa: F401
from asyncpp_jax.optim.routing import describe, label_params, partition, print_routing, suspects  # noqa: F401
from asyncpp_jax.optim.lr_schedules import make_schedule  # noqa: F401
from asyncpp_jax.optim.soap import scale_by_soap, soap  # noqa: F401
from asyncpp_jax.optim.staleness import (  # noqa: F401
    DelaySchedule,
    WeightVersions,
    delay,
    error_feedback,
    pipedream_leaf_delays,
    taylor_compensation,
)
