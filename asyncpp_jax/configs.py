"""Shared config defaults and validation.

Every file in ``configs/`` starts from :func:`base_config` and changes what it needs.  Validation
is plain Python (no JAX import), runs before anything is compiled, and reports every problem at
once in one :class:`ConfigError` whose lines each name the offending field and the fix.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import ml_collections

OPTIMIZERS = ("adamw", "muon", "soap", "adan", "lion", "mars")
MUON_SCALINGS = ("moonlight", "keller")
ADAN_DECAY_MODES = ("proximal", "decoupled")
SCHEDULES = ("constant", "cosine", "linear", "wsd")
DTYPES = ("float32", "bfloat16")
RUNNERS = ("auto", "simulate", "pipeline")
PIPELINE_SCHEDULES = ("sync", "2bw")
PIPEDREAM_GRADIENTS = ("mixed", "per_leaf")
STALENESS_MODES = ("sync", "2bw", "pipedream")
MITIGATIONS = ("none", "ef", "taylor")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.py"


class ConfigError(ValueError):
    """An impossible or unsupported setting; the message names each field and how to fix it."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "base"
    c.seed = 0
    c.runner = "auto"  # auto: the pipeline engine when config.pipeline.stages > 1, else simulate

    c.model = ml_collections.ConfigDict(
        dict(
            vocab_size=257,
            d_model=256,
            n_layers=4,
            n_heads=4,
            n_kv_heads=4,
            head_dim=0,  # 0: d_model // n_heads
            d_ff=768,
            rope_theta=10000.0,
            tie_embeddings=True,
            norm_eps=1e-5,
            init_std=0.02,
            z_loss=0.0,
            compute_dtype="float32",
            param_dtype="float32",
            remat=False,
            # Mixture of experts (models/moe.py); num_experts = 0 is a dense model.
            moe=dict(
                num_experts=0,
                top_k=2,
                expert_d_ff=0,  # each expert's SwiGLU hidden size
                gating="softmax",  # softmax | sigmoid router scores
                normalize_gates=True,  # renormalise the top-k gates to sum to 1
                capacity_factor=1.25,  # <= 0: dropless (every expert on every token)
                shared_experts=0,  # always-on experts, fused into one SwiGLU of shared_experts * expert_d_ff
                every=1,  # MoE on every k-th layer (the others dense)
                lb_loss_coef=0.01,  # Switch load-balancing loss weight
                router_z_loss_coef=0.001,  # ST-MoE router z-loss weight
            ),
        )
    )
    c.data = ml_collections.ConfigDict(
        dict(
            source="stdlib",  # 'stdlib' | glob / path(s), comma separated | 'hf:<dataset>[:<config>]'
            tokenizer="byte",  # 'byte' | path to a Hugging Face tokenizer.json
            eos_token="",  # HF tokenizers only; '' = detect
            cache_dir="",  # '' = $ASYNCPP_JAX_CACHE or ~/.cache/asyncpp_jax/corpora
            seq_len=256,
            val_fraction=0.05,
            split_seed=0,
            hf_split="train",
            hf_text_field="text",
            hf_max_docs=0,
            verify_checksums=True,  # sha256 of every shard at start; sizes are always checked
        )
    )
    c.train = ml_collections.ConfigDict(
        dict(
            steps=1000,
            global_batch_size=32,  # sequences per optimizer update, over all devices and microbatches
            # gradient accumulation steps per update; -1 = auto: 1, or under the pipeline engine the
            # smallest divisor of the per-replica batch that is >= 2*(stages-1) (2bw's minimum)
            microbatches=-1,
            eval_every=100,
            eval_batches=8,
            log_every=10,
            checkpoint_every=200,
            keep_checkpoints=3,
            async_checkpoint=True,
            progress_bar=True,
            # peak dense TFLOP/s of one accelerator (e.g. 989 H100 bf16, 459 TPU v5p); 0 = MFU not reported
            peak_tflops_per_device=0.0,
        )
    )
    c.optimizer = ml_collections.ConfigDict(
        dict(
            name="adamw",  # adamw | muon | soap | adan | lion | mars
            lr=3e-3,  # peak learning rate of the main branch
            weight_decay=0.1,  # decoupled; matrices only (never norm scales or biases)
            schedule="cosine",
            warmup_steps=100,
            min_lr_ratio=0.1,  # final lr / peak lr for cosine, linear and wsd
            wsd_decay_fraction=0.2,  # wsd: fraction of the steps spent in the final decay
            grad_clip=1.0,  # global-norm clip; 0 disables
            # Each optimizer's own hyperparameters; defaults follow its reference.
            adamw=dict(b1=0.9, b2=0.95, eps=1e-8, nesterov=False),
            muon=dict(mu=0.95, nesterov=True, ns_steps=5, scaling="moonlight"),
            soap=dict(b1=0.95, b2=0.95, shampoo_beta=-1.0, eps=1e-8, precondition_frequency=10,
                      max_precond_dim=10000),
            adan=dict(b1=0.98, b2=0.92, b3=0.99, eps=1e-8, weight_decay_mode="proximal"),
            lion=dict(b1=0.9, b2=0.99),
            mars=dict(b1=0.95, b2=0.99, gamma=0.025, eps=1e-8),
            # Muon, SOAP and MARS act on hidden matrices; the rest (embeddings, head, norms,
            # biases: leaves < 2-D or whose path matches adamw_pattern) go to an AdamW side branch.
            adamw_pattern=r"embed|lm_head|head|norm|scale|bias|router",
            # side lr = lr_ratio * lr; weight_decay -1 = the main branch's weight_decay.
            side=dict(lr_ratio=1.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=-1.0),
        )
    )
    c.staleness = ml_collections.ConfigDict(
        dict(
            mode="sync",  # sync | 2bw (one-step delay) | pipedream (per-stage delay P-1-s)
            stages=4,  # pipedream: pipeline depth P
            # pipedream: 'mixed' takes the gradient at PipeDream's mixed point (w_s[t-(P-1-s)] per
            # stage; exact, keeps P-1 weight copies); 'per_leaf' delays stage s's slice of a
            # consistent-point gradient by P-1-s (the optax delay(leaf_delays=...) approximation).
            pipedream_gradient="mixed",
            sync_start_steps=0,  # first K updates without delay
            sync_cooldown_steps=0,  # last C updates without delay
            mitigation="none",  # none | ef (error feedback) | taylor (DC-ASGD)
            ef_strength=1.0,
            taylor_adaptive=True,  # lam = taylor_lam0 / sqrt(EMA(g^2) + eps); else constant taylor_lam
            taylor_lam=0.1,
            taylor_lam0=0.1,
            taylor_ema_decay=0.99,
            # Delay corrections beyond the paper (each combines with the mitigation above):
            # Ajanthan et al. 2025's Nesterov look-ahead: NAdamW (b1 nesterov_b1) in place of AdamW, and
            # for Muon Nesterov momentum mu = nesterov_b1 with a NAdamW side branch (optim/lookahead.py)
            nesterov=False,
            nesterov_b1=0.99,
            nesterov_momentum_decay=0.004,
            # SpecTrain / PipeMare weight prediction: gradient at w_t + d * delta_t (simulate runner only)
            weight_prediction=False,
            weight_prediction_smoothing=0.0,  # EMA factor of delta over the updates; 0 = the last update
            # PipeMare learning-rate rescheduling over the first K updates: lr * d^-(1 - min(t/K, 1)); 0 = off
            lr_rescheduling_steps=0,
        )
    )
    c.pipeline = ml_collections.ConfigDict(
        dict(
            stages=1,  # > 1: the pipeline engine, layers split into this many contiguous stages
            schedule="sync",  # sync (1F1B, flush every step) | 2bw (no flush, one-step delay)
            # True: a stage's backward recomputes its forward from the stashed stage input (one
            # activation per in-flight microbatch); False: the forward keeps its autodiff residuals
            # for the backward (no recompute, every intermediate of the block per microbatch)
            recompute=True,
        )
    )
    c.mesh = ml_collections.ConfigDict(
        dict(
            data=1,  # data-parallel devices; -1 = all devices
            # MoE under the pipeline engine: shard the experts over the data axis (GShard) and move
            # tokens to them with all_to_all; needs num_experts divisible by data
            expert_parallel=False,
        )
    )
    return c


def resolve(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy with the automatic fields filled in (``train.microbatches = -1``); validate after."""
    c = ml_collections.ConfigDict(c.to_dict())
    if c.train.microbatches == -1:
        want = 1
        if uses_pipeline(c) and isinstance(c.pipeline.stages, int) and c.pipeline.stages > 1:
            want = 2 * (c.pipeline.stages - 1)
        per_replica = c.train.global_batch_size // max(c.mesh.data, 1) if isinstance(c.mesh.data, int) else 1
        divisors = [m for m in range(want, max(per_replica, 0) + 1) if per_replica % m == 0]
        c.train.microbatches = divisors[0] if divisors else want
    return c


def uses_pipeline(c: ml_collections.ConfigDict) -> bool:
    return c.runner == "pipeline" or (c.runner == "auto" and c.pipeline.stages > 1)


def effective_staleness(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config.staleness`` as the optimizer chain should see it: under the engine's ``2bw``
    schedule the one-step delay is physical, so the mode is ``2bw`` whatever the field says."""
    st = ml_collections.ConfigDict(c.staleness.to_dict())
    if uses_pipeline(c) and c.pipeline.schedule == "2bw":
        st.mode = "2bw"
    return st


def devices_needed(c: ml_collections.ConfigDict) -> int:
    stages = c.pipeline.stages if uses_pipeline(c) else 1
    return max(c.mesh.data, 1) * stages


def validate(c: ml_collections.ConfigDict) -> None:
    """Raise one ConfigError listing every impossible setting in ``c``."""
    c = resolve(c)
    errs: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errs.append(msg)

    m, d, t, o = c.model, c.data, c.train, c.optimizer
    need(c.runner in RUNNERS, f"config.runner={c.runner!r} is unknown; choose one of {RUNNERS}.")

    # Model shape.
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
        need(isinstance(m[f], int) and m[f] > 0, f"config.model.{f}={m[f]!r} must be a positive integer.")
    moe = m.moe
    if moe.num_experts:
        need(isinstance(moe.num_experts, int) and moe.num_experts >= 2,
             f"config.model.moe.num_experts={moe.num_experts!r} must be 0 (dense) or an integer >= 2.")
        need(isinstance(moe.top_k, int) and 1 <= moe.top_k <= moe.num_experts,
             f"config.model.moe.top_k={moe.top_k!r} must lie in [1, num_experts={moe.num_experts}].")
        need(isinstance(moe.expert_d_ff, int) and moe.expert_d_ff > 0,
             f"config.model.moe.expert_d_ff={moe.expert_d_ff!r} must be a positive integer.")
        need(moe.gating in ("softmax", "sigmoid"),
             f"config.model.moe.gating={moe.gating!r} is unknown; choose softmax or sigmoid.")
        need(isinstance(moe.every, int) and moe.every >= 1 and isinstance(m.n_layers, int)
             and m.n_layers % moe.every == 0,
             f"config.model.moe.every={moe.every!r} must be a positive integer dividing "
             f"config.model.n_layers={m.n_layers}.")
    if not errs:
        if not m.head_dim:
            need(
                m.d_model % m.n_heads == 0,
                f"config.model.n_heads={m.n_heads} does not divide config.model.d_model={m.d_model}; "
                "pick n_heads dividing d_model, or set config.model.head_dim explicitly.",
            )
        need(
            m.n_heads % m.n_kv_heads == 0,
            f"config.model.n_kv_heads={m.n_kv_heads} does not divide config.model.n_heads={m.n_heads} "
            "(grouped-query attention shares each K/V head among n_heads/n_kv_heads query heads).",
        )
        hd = m.head_dim or (m.d_model // m.n_heads)
        need(hd % 2 == 0, f"head dimension {hd} must be even for RoPE; change config.model.head_dim or n_heads.")
    for f in ("compute_dtype", "param_dtype"):
        need(m[f] in DTYPES, f"config.model.{f}={m[f]!r} is unsupported; choose one of {DTYPES}.")
    need(m.param_dtype == "float32", "config.model.param_dtype must be 'float32' (the dtype policy keeps fp32 master weights).")
    need(m.z_loss >= 0, f"config.model.z_loss={m.z_loss} must be >= 0.")
    need(m.rope_theta > 0, f"config.model.rope_theta={m.rope_theta} must be > 0.")

    # Data.
    need(isinstance(d.seq_len, int) and d.seq_len >= 2, f"config.data.seq_len={d.seq_len!r} must be an integer >= 2.")
    need(0 < d.val_fraction < 1, f"config.data.val_fraction={d.val_fraction} must be in (0, 1).")
    need(bool(d.source), "config.data.source is empty; use 'stdlib', a glob of text files, or 'hf:<dataset>'.")

    # Training loop.
    for f in ("steps", "global_batch_size", "microbatches", "eval_every", "eval_batches", "log_every",
              "checkpoint_every", "keep_checkpoints"):
        need(isinstance(t[f], int) and t[f] > 0, f"config.train.{f}={t[f]!r} must be a positive integer.")

    # Optimizer.
    need(o.name in OPTIMIZERS, f"config.optimizer.name={o.name!r} is unknown; choose one of {OPTIMIZERS}.")
    need(o.schedule in SCHEDULES, f"config.optimizer.schedule={o.schedule!r} is unknown; choose one of {SCHEDULES}.")
    need(o.lr > 0 and math.isfinite(o.lr), f"config.optimizer.lr={o.lr} must be a positive finite number.")
    for sub, keys in (("adamw", ("b1", "b2")), ("soap", ("b1", "b2")), ("adan", ("b1", "b2", "b3")),
                      ("lion", ("b1", "b2")), ("mars", ("b1", "b2")), ("side", ("b1", "b2")),
                      ("muon", ("mu",))):
        for k in keys:
            v = o[sub][k]
            need(0 <= v < 1, f"config.optimizer.{sub}.{k}={v} must lie in [0, 1).")
    need(o.muon.scaling in MUON_SCALINGS,
         f"config.optimizer.muon.scaling={o.muon.scaling!r} is unknown; choose one of {MUON_SCALINGS}.")
    need(isinstance(o.muon.ns_steps, int) and o.muon.ns_steps > 0,
         f"config.optimizer.muon.ns_steps={o.muon.ns_steps!r} must be a positive integer.")
    need(o.adan.weight_decay_mode in ADAN_DECAY_MODES,
         f"config.optimizer.adan.weight_decay_mode={o.adan.weight_decay_mode!r} is unknown; "
         f"choose one of {ADAN_DECAY_MODES}.")
    need(isinstance(o.soap.precondition_frequency, int) and o.soap.precondition_frequency > 0,
         f"config.optimizer.soap.precondition_frequency={o.soap.precondition_frequency!r} must be a positive integer.")
    need(o.side.lr_ratio > 0, f"config.optimizer.side.lr_ratio={o.side.lr_ratio} must be > 0.")
    need(o.side.weight_decay >= 0 or o.side.weight_decay == -1,
         f"config.optimizer.side.weight_decay={o.side.weight_decay} must be >= 0, or -1 for config.optimizer.weight_decay.")
    try:
        re.compile(o.adamw_pattern)
    except re.error as e:
        errs.append(f"config.optimizer.adamw_pattern={o.adamw_pattern!r} is not a valid regular expression ({e}).")
    need(o.weight_decay >= 0, f"config.optimizer.weight_decay={o.weight_decay} must be >= 0.")
    need(o.grad_clip >= 0, f"config.optimizer.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping).")
    need(0 <= o.min_lr_ratio <= 1, f"config.optimizer.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1].")
    need(0 < o.wsd_decay_fraction <= 1, f"config.optimizer.wsd_decay_fraction={o.wsd_decay_fraction} must lie in (0, 1].")
    if isinstance(t.steps, int):
        need(
            0 <= o.warmup_steps < t.steps,
            f"config.optimizer.warmup_steps={o.warmup_steps} must be >= 0 and below config.train.steps={t.steps}.",
        )

    # Staleness.
    st = c.staleness
    need(st.mode in STALENESS_MODES, f"config.staleness.mode={st.mode!r} is unknown; choose one of {STALENESS_MODES}.")
    need(st.mitigation in MITIGATIONS,
         f"config.staleness.mitigation={st.mitigation!r} is unknown; choose one of {MITIGATIONS}.")
    pipe = c.pipeline
    need(isinstance(pipe.stages, int) and pipe.stages >= 1,
         f"config.pipeline.stages={pipe.stages!r} must be a positive integer.")
    need(pipe.schedule in PIPELINE_SCHEDULES,
         f"config.pipeline.schedule={pipe.schedule!r} is unknown; choose one of {PIPELINE_SCHEDULES}.")
    need(isinstance(pipe.recompute, bool),
         f"config.pipeline.recompute={pipe.recompute!r} must be True (recompute each stage's forward in its "
         "backward) or False (keep the forward's residuals).")
    engine_2bw = False
    if isinstance(pipe.stages, int) and pipe.stages >= 1 and pipe.schedule in PIPELINE_SCHEDULES:
        if c.runner == "pipeline":
            need(pipe.stages > 1, "config.runner='pipeline' needs config.pipeline.stages > 1.")
        if uses_pipeline(c) and pipe.stages > 1:
            engine_2bw = pipe.schedule == "2bw"
            grouped = (m.moe.num_experts and isinstance(m.moe.every, int) and m.moe.every > 1
                       and isinstance(m.n_layers, int))
            units = m.n_layers // m.moe.every if grouped else m.n_layers
            if isinstance(units, int):
                need(units % pipe.stages == 0,
                     f"config.model.n_layers={m.n_layers} is not divisible by config.pipeline.stages={pipe.stages}"
                     + (f" x config.model.moe.every={m.moe.every}" if units != m.n_layers else "")
                     + "; each stage holds an equal, contiguous block of layers.")
            need(st.mode in ("sync", pipe.schedule),
                 f"config.staleness.mode={st.mode!r} cannot run on the pipeline engine with "
                 f"config.pipeline.schedule={pipe.schedule!r}: the engine's delay is physical. Use "
                 "config.pipeline.schedule=2bw for a one-step delay, or config.pipeline.stages=1 to simulate it.")
            if engine_2bw and isinstance(t.microbatches, int):
                need(t.microbatches >= 2 * (pipe.stages - 1),
                     f"config.train.microbatches={t.microbatches} is too few for config.pipeline.schedule=2bw "
                     f"with config.pipeline.stages={pipe.stages}: a one-step delay needs microbatches >= "
                     f"2*(stages-1) = {2 * (pipe.stages - 1)}.")
    if st.mode == "sync" and not engine_2bw:
        need(st.mitigation == "none",
             f"config.staleness.mitigation={st.mitigation!r} needs a delay; set config.staleness.mode=2bw or "
             "pipedream, or config.pipeline.schedule=2bw.")
    if st.mode == "pipedream":
        need(isinstance(st.stages, int) and st.stages >= 2,
             f"config.staleness.stages={st.stages!r} must be an integer >= 2 for pipedream.")
        if isinstance(st.stages, int) and st.stages >= 2 and isinstance(m.n_layers, int):
            need(m.n_layers % st.stages == 0,
                 f"config.model.n_layers={m.n_layers} is not divisible by config.staleness.stages={st.stages}; "
                 "each stage holds an equal, contiguous slice of layers.")
    need(st.pipedream_gradient in PIPEDREAM_GRADIENTS,
         f"config.staleness.pipedream_gradient={st.pipedream_gradient!r} is unknown; choose one of "
         f"{PIPEDREAM_GRADIENTS}.")
    errs += staleness_correction_errors(c, engine_2bw)
    for f in ("sync_start_steps", "sync_cooldown_steps"):
        need(isinstance(st[f], int) and st[f] >= 0, f"config.staleness.{f}={st[f]!r} must be an integer >= 0.")
    if isinstance(t.steps, int) and isinstance(st.sync_start_steps, int) and isinstance(st.sync_cooldown_steps, int):
        need(st.sync_start_steps + st.sync_cooldown_steps <= t.steps,
             f"config.staleness.sync_start_steps + sync_cooldown_steps = "
             f"{st.sync_start_steps + st.sync_cooldown_steps} exceeds config.train.steps={t.steps}.")
    need(st.ef_strength >= 0, f"config.staleness.ef_strength={st.ef_strength} must be >= 0.")
    need(0 <= st.taylor_ema_decay < 1, f"config.staleness.taylor_ema_decay={st.taylor_ema_decay} must lie in [0, 1).")

    if c.mesh.expert_parallel:
        need(m.moe.num_experts > 0, "config.mesh.expert_parallel=True needs an MoE model (config.model.moe.num_experts > 0).")
        need(uses_pipeline(c), "config.mesh.expert_parallel=True runs inside the pipeline engine; set "
             "config.pipeline.stages > 1.")
        need(m.moe.capacity_factor > 0, "config.mesh.expert_parallel=True needs config.model.moe.capacity_factor > 0.")
        if isinstance(c.mesh.data, int) and c.mesh.data > 0 and m.moe.num_experts:
            need(m.moe.num_experts % c.mesh.data == 0,
                 f"config.model.moe.num_experts={m.moe.num_experts} is not divisible by config.mesh.data={c.mesh.data} "
                 "(expert parallelism gives each data shard num_experts / data experts).")

    # Parallelism: the batch splits into microbatches, each split over the data axis.
    need(isinstance(c.mesh.data, int) and (c.mesh.data > 0 or c.mesh.data == -1),
         f"config.mesh.data={c.mesh.data!r} must be a positive integer, or -1 for all devices.")
    if not errs and c.mesh.data > 0:
        div = t.microbatches * c.mesh.data
        need(
            t.global_batch_size % div == 0,
            f"config.train.global_batch_size={t.global_batch_size} is not divisible by "
            f"config.train.microbatches × config.mesh.data = {t.microbatches} × {c.mesh.data} = {div}; "
            "change the batch size or the split.",
        )

    if errs:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))


NESTEROV_OPTIMIZERS = ("adamw", "muon")


def staleness_correction_errors(c: ml_collections.ConfigDict, engine_2bw: bool) -> list[str]:
    """Problems with ``config.staleness``'s Nesterov look-ahead, weight prediction and PipeMare lr."""
    st, errs = c.staleness, []
    mode = "2bw" if engine_2bw else st.mode
    max_delay = {"2bw": 1, "pipedream": st.stages - 1 if isinstance(st.stages, int) else 0}.get(mode, 0)
    used = [f for f in ("nesterov", "weight_prediction") if st[f]] + (
        ["lr_rescheduling_steps"] if st.lr_rescheduling_steps else [])
    for f in used:
        if mode == "sync":
            errs.append(f"config.staleness.{f} corrects a gradient delay, but there is none; set "
                        "config.staleness.mode=2bw or pipedream, or config.pipeline.schedule=2bw.")
    if st.nesterov:
        if c.optimizer.name not in NESTEROV_OPTIMIZERS:
            errs.append(f"config.staleness.nesterov=True is defined for config.optimizer.name in "
                        f"{NESTEROV_OPTIMIZERS}, not {c.optimizer.name!r}; pick one of those or set nesterov=False.")
        if not 0 <= st.nesterov_b1 < 1:
            errs.append(f"config.staleness.nesterov_b1={st.nesterov_b1} must lie in [0, 1) (the paper uses 0.99).")
        if not st.nesterov_momentum_decay >= 0:
            errs.append(f"config.staleness.nesterov_momentum_decay={st.nesterov_momentum_decay} must be >= 0.")
    if st.weight_prediction:
        if uses_pipeline(c):
            errs.append("config.staleness.weight_prediction=True is not supported by the pipeline engine yet "
                        "(its forward/backward slots use the stashed weights); run it with "
                        "config.runner=simulate (config.pipeline.stages=1) and config.staleness.mode=2bw.")
        elif mode == "pipedream":
            errs.append("config.staleness.weight_prediction=True needs config.staleness.mode=2bw: with "
                        "PipeDream's per-stage delays each stage would need its own extrapolation distance.")
        if not 0 <= st.weight_prediction_smoothing < 1:
            errs.append(f"config.staleness.weight_prediction_smoothing={st.weight_prediction_smoothing} "
                        "must lie in [0, 1).")
    k = st.lr_rescheduling_steps
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
        errs.append(f"config.staleness.lr_rescheduling_steps={k!r} must be an integer >= 0 (0 disables it).")
    elif k and mode in ("2bw", "pipedream") and max_delay <= 1:
        errs.append(f"config.staleness.lr_rescheduling_steps={k} does nothing at a one-step delay: PipeMare "
                    "scales the lr by delay^-(1 - t/K), which is 1 at delay 1. Use it with "
                    "config.staleness.mode=pipedream and stages >= 3, or set it to 0.")
    return errs


def check_against_devices(c: ml_collections.ConfigDict, num_devices: int) -> int:
    """Resolve ``mesh.data = -1`` and check the mesh fits the devices; returns the data size."""
    c = resolve(c)
    stages = c.pipeline.stages if uses_pipeline(c) else 1
    data = num_devices // stages if c.mesh.data == -1 else c.mesh.data
    if data * stages > num_devices or data < 1:
        raise ConfigError(
            f"config.mesh.data={c.mesh.data} x config.pipeline.stages={stages} asks for {max(data, 1) * stages} "
            f"devices but {num_devices} are present; lower them, or on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={max(data, 1) * stages} before JAX starts."
        )
    div = c.train.microbatches * data
    if c.train.global_batch_size % div:
        raise ConfigError(
            f"config.train.global_batch_size={c.train.global_batch_size} is not divisible by "
            f"config.train.microbatches × data devices = {c.train.microbatches} × {data}."
        )
    return data


def check_against_tokenizer(c: ml_collections.ConfigDict, vocab_size: int) -> None:
    if c.model.vocab_size < vocab_size:
        raise ConfigError(
            f"config.model.vocab_size={c.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({vocab_size}, config.data.tokenizer={c.data.tokenizer!r}); set config.model.vocab_size >= {vocab_size}."
        )


def to_json(c: ml_collections.ConfigDict) -> str:
    return json.dumps(c.to_dict(), indent=2, sort_keys=True)


def diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two config dicts."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out
