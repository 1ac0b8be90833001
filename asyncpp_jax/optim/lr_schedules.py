"""Learning-rate schedules from config, built from optax's schedule primitives.

All start with a linear warmup from 0 to ``lr`` over ``warmup_steps``, then:
- ``constant``: stay at ``lr``;
- ``cosine``:   cosine decay to ``min_lr_ratio * lr`` at ``steps`` (Loshchilov & Hutter 2017);
- ``linear``:   linear decay to ``min_lr_ratio * lr`` at ``steps``;
- ``wsd``:      warmup-stable-decay (Hu et al. 2024, MiniCPM): hold ``lr`` until the last
                ``wsd_decay_fraction`` of the steps, then decay linearly to ``min_lr_ratio * lr``.
"""

from __future__ import annotations

import optax


def make_schedule(opt_cfg, total_steps: int) -> optax.Schedule:
    lr, warm = opt_cfg.lr, opt_cfg.warmup_steps
    end = lr * opt_cfg.min_lr_ratio
    rest = max(total_steps - warm, 1)
    warmup = optax.linear_schedule(0.0, lr, warm) if warm else optax.constant_schedule(lr)
    name = opt_cfg.schedule
    if name == "constant":
        after = optax.constant_schedule(lr)
    elif name == "cosine":
        after = optax.cosine_decay_schedule(lr, rest, alpha=opt_cfg.min_lr_ratio)
    elif name == "linear":
        after = optax.linear_schedule(lr, end, rest)
    elif name == "wsd":
        decay = max(int(round(rest * opt_cfg.wsd_decay_fraction)), 1)
        after = optax.join_schedules(
            [optax.constant_schedule(lr), optax.linear_schedule(lr, end, decay)], [rest - decay]
        )
    else:
        raise ValueError(f"config.optimizer.schedule={name!r} is unknown")
    return optax.join_schedules([warmup, after], [warm])
