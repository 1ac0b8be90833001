"""Shared config defaults and validation.

Every file in ``configs/`` starts from :func:`base_config` and changes what it needs.  Validation
is plain Python (no JAX import), runs before anything is compiled, and reports every problem at
once in one :class:`ConfigError` whose lines each name the offending field and the fix.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import re

import ml_collections

from asyncpp_jax.pipeline.schedules import programs  # plain Python: the schedules and their validator

OPTIMIZERS = ("adamw", "muon", "soap", "adan", "lion", "mars")
MUON_SCALINGS = ("moonlight", "keller")
ADAN_DECAY_MODES = ("proximal", "decoupled")
SCHEDULES = ("constant", "cosine", "linear", "wsd")
DTYPES = ("float32", "bfloat16")
ATTENTION_KERNELS = ("auto", "xla", "dot_product", "splash")  # models/layers.py: attend
SPLASH_SEQ_MULTIPLE = 128  # splash attention's blocks are multiples of 128 tokens
RUNNERS = ("auto", "simulate", "pipeline")
PLACEMENTS = ("spmd", "mpmd")
MPMD_SCHEDULES = ("sync", "1f1b", "2bw", "pipedream")  # what config.pipeline.placement='mpmd' runs (asyncpp_jax.pipeline.mpmd.engine)
PIPEDREAM_GRADIENTS = ("mixed", "per_leaf")
STALENESS_MODES = ("sync", "2bw", "pipedream")
MITIGATIONS = ("none", "ef", "taylor")
LOGGERS = ("jsonl", "tensorboard", "wandb")  # config.train.loggers (train/metrics.py)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# The preset config files: configs/ in a source checkout; an install ships the same files as
# asyncpp_jax/presets/ (setup.py), never as a top-level module named "configs".
_INSTALLED_PRESETS = pathlib.Path(__file__).resolve().parent / "presets"
PRESETS_DIR = _INSTALLED_PRESETS if _INSTALLED_PRESETS.is_dir() else REPO_ROOT / "configs"
DEFAULT_CONFIG = PRESETS_DIR / "tiny.py"
# ``config.hardware``: what a config is for, and the memory per device (GB, 1e9 bytes) the dry run
# holds it to (train/fit.py).  'cpu' is a workstation's share per fake device.  A T4 exposes
# about 15 GB of its 16.
HARDWARE_GB = {"cpu": 8.0, "t4-16gb": 15.0, "tpu-v5e-16gb": 16.0, "a100-40gb": 40.0, "h100-80gb": 80.0,
               "tpu-v5p-95gb": 95.0, "h200-141gb": 141.0}
# ``config.hardware``'s platform (as jax names it) and whether cuDNN's flash attention runs there
# (Ampere or newer; a T4 is Turing): what attention='auto' becomes on it (models/layers.py).
HARDWARE_PLATFORM = {"cpu": ("cpu", False), "t4-16gb": ("cuda", False), "tpu-v5e-16gb": ("tpu", False),
                     "a100-40gb": ("cuda", True), "h100-80gb": ("cuda", True), "tpu-v5p-95gb": ("tpu", False),
                     "h200-141gb": ("cuda", True)}
# Dense matmul peak TFLOP/s of one device, (bf16, fp32), by a piece of jax's ``device_kind``: the
# vendors' datasheet figures without sparsity (H100/H200 SXM; a TPU multiplies fp32 in bf16 passes,
# so its bf16 peak is the yardstick for both).  MFU (experiments/bench_mfu.py) is measured against it.
PEAK_TFLOPS = {"H100": (989.0, 67.0), "H200": (989.0, 67.0), "A100": (312.0, 19.5), "T4": (65.0, 8.1),
               "TPU v5p": (459.0, 459.0), "TPU v5 lite": (197.0, 197.0), "TPU v5e": (197.0, 197.0),
               "TPU v4": (275.0, 275.0), "TPU v6": (918.0, 918.0)}
# Largest mesh accepted at all (more devices than any TPU pod or GPU cluster this code targets), and
# the largest made of fake XLA:CPU devices on a host without an accelerator.
MAX_MESH_DEVICES = 65536
MAX_NS_STEPS = 50  # Newton-Schulz steps are unrolled at trace time: 1e5 of them never finish compiling
MAX_CPU_DEVICES = 1024  # measured on XLA:CPU: 512 start in ~1 s, 4096 in ~9 s, 100000 hang
# What a run was trained on, recorded in each checkpoint and compared on resume (train/resume.py);
# ``config.train.accept_changed`` names those a resume may change on purpose.
RUN_IDENTITY = ("tokenizer", "corpus", "seq_len", "model")


class ConfigError(ValueError):
    """An impossible or unsupported setting; the message names each field and how to fix it."""


# Fields that were renamed: old dotted name -> new one.  Either spelling of the old one, as a
# command-line override or a key a config file still sets, is rejected with the new name.
RENAMED_FIELDS = {
    # It is PipeDream's simulated depth, not config.pipeline.stages (the real engine's stage count).
    "staleness.stages": "staleness.pipedream_stages",
}


def _renamed_message(old: str) -> str:
    return f"config.{old} was renamed to config.{RENAMED_FIELDS[old]}; set that instead."


def renamed_flag_errors(argv) -> list[str]:
    """Messages for command-line overrides (``--config.old.name=V``) of renamed fields: ml_collections
    would otherwise fail on them with a bare ``AttributeError``."""
    return [_renamed_message(old) for arg in argv for old in RENAMED_FIELDS
            if arg == f"--config.{old}" or arg.startswith(f"--config.{old}=")]


def _check_renamed(c) -> list[str]:
    """A renamed field still set by a config file (or ``ConfigDict.update``, which adds unknown keys)."""
    errs = []
    for old in RENAMED_FIELDS:
        section, _, field = old.rpartition(".")
        if section in c and field in c[section]:
            errs.append(_renamed_message(old))
    return errs


def resolve(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy with the automatic fields filled in (``train.microbatches = -1``); validate after."""
    c = ml_collections.ConfigDict(c.to_dict())
    if c.train.microbatches == -1:
        counts = auto_microbatches(c)
        c.train.microbatches = counts[0] if counts else microbatch_rule(c)[0]  # validate names the fix
    return c


def auto_microbatches(c) -> list[int]:
    """The counts ``train.microbatches=-1`` picks from, smallest first (without a memory budget the
    first; with one, the first whose compiled step fits): the divisors of the per-replica batch that
    the schedule runs (:func:`microbatch_rule`), from ``2(P - 1)`` where that rule starts at 1 on a
    pipeline, so that a flushed schedule's bubble ``(P - 1) / (M + P - 1)`` is at most a third; where
    no divisor reaches that, the largest one the schedule runs.  Empty when none divides the batch."""
    low, step = microbatch_rule(c)
    per_replica = c.train.global_batch_size // max(c.mesh.data, 1) if _is_int(c.mesh.data) else 1
    runs = [m for m in range(low, max(per_replica, 0) + 1, step) if per_replica % m == 0]
    floor = 2 * (c.pipeline.stages - 1) if low == 1 and uses_pipeline(c) and _is_int(c.pipeline.stages) else low
    return [m for m in runs if m >= floor] or runs[-1:]


def pipeline_schedules() -> tuple:
    """The schedules the engine runs: every program generator (``programs.register`` adds one)."""
    return tuple(name for name in programs.GENERATORS if name != "forward")


def engine_delay(c) -> str | None:
    """The delay the engine's schedule makes physical: ``'2bw'``, ``'pipedream'``, or None (a
    flushed schedule, or no engine)."""
    p = c.pipeline
    if not (_is_int(p.stages) and p.stages > 1 and uses_pipeline(c)):
        return None
    return p.schedule if p.schedule in ("2bw", "pipedream") else None


def microbatch_rule(c) -> tuple[int, int]:
    """``(smallest, step)``: the microbatch counts ``train.microbatches=-1`` picks from, ``smallest,
    smallest + step, ...`` (``2bw``: from ``2(P - 1)``, where its steps have no ramp; ``interleaved``:
    multiples of ``P``; otherwise any)."""
    pipe = c.pipeline
    if not (uses_pipeline(c) and isinstance(pipe.stages, int) and pipe.stages > 1):
        return 1, 1
    if pipe.schedule == "2bw":
        return 2 * (pipe.stages - 1), 1
    if pipe.schedule == "interleaved":
        return pipe.stages, pipe.stages
    return 1, 1


def uses_pipeline(c: ml_collections.ConfigDict) -> bool:
    return c.runner == "pipeline" or (c.runner == "auto" and c.pipeline.stages > 1)


def effective_staleness(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config.staleness`` as the optimizer chain should see it: under the engine's ``2bw`` or
    ``pipedream`` schedule the delay is physical, so the mode is the schedule's whatever the field
    says (``pipedream``: ``per_leaf`` over the engine's stages, what the engine computes)."""
    st = ml_collections.ConfigDict(c.staleness.to_dict())
    mode = engine_delay(c)
    if mode == "2bw":
        st.mode = "2bw"
    elif mode == "pipedream":  # stage s's gradient P-1-s updates late, taken at one point per batch
        st.update(mode="pipedream", pipedream_stages=c.pipeline.stages, pipedream_gradient="per_leaf")
    return st


def devices_needed(c: ml_collections.ConfigDict) -> int:
    stages = c.pipeline.stages if uses_pipeline(c) else 1
    return max(c.mesh.data, 1) * stages


# ---------------------------------------------------------------------------------------------
# Validation: one check per config section, each next to nothing but the fields it guards.  Every
# check returns a list of messages; each message names the field (``config.section.field=value``),
# the domain it must lie in, and, where it is not obvious, the fix.  Plain Python: no JAX import.

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bounds_text(gt, ge, lt, le) -> str:
    lo = f"({gt}" if gt is not None else (f"[{ge}" if ge is not None else None)
    hi = f"{lt})" if lt is not None else (f"{le}]" if le is not None else None)
    if lo and hi:
        return f" in {lo}, {hi}"
    if lo:
        return f" > {gt}" if gt is not None else f" >= {ge}"
    if hi:
        return f" < {lt}" if lt is not None else f" <= {le}"
    return ""


def _number(errs: list, name: str, v, *, gt=None, ge=None, lt=None, le=None, integer=False,
            allow=(), why: str = "") -> bool:
    """Append a message unless ``config.<name> = v`` is a finite number (an integer if ``integer``)
    within the bounds, or one of the special values in ``allow``; returns whether it passed."""
    if not isinstance(v, bool) and v in allow:
        return True
    ok = _is_int(v) if integer else _is_real(v)
    if ok:
        ok = ((gt is None or v > gt) and (ge is None or v >= ge) and (lt is None or v < lt)
              and (le is None or v <= le))
    if not ok:
        kind = "an integer" if integer else "a finite number"
        special = f" (or {' or '.join(repr(a) for a in allow)})" if allow else ""
        errs.append(f"config.{name}={v!r} must be {kind}{_bounds_text(gt, ge, lt, le)}{special}{why}.")
    return ok


def _choice(errs: list, name: str, v, choices) -> bool:
    if v in choices:
        return True
    errs.append(f"config.{name}={v!r} is unknown; choose one of {tuple(choices)}.")
    return False


def _flag(errs: list, name: str, v) -> None:
    if not isinstance(v, bool):
        errs.append(f"config.{name}={v!r} must be True or False.")


# ---------------------------------------------------------------------------------------------
# config: the top-level fields; each section below has its defaults next to its check


def preset_names() -> list[str]:
    """The names ``--config=NAME`` accepts: the preset files' stems (``tiny``, ``dense135m``, ...)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.py") if not p.stem.startswith("_"))


def find_file(path) -> pathlib.Path:
    """The config file ``--config=path`` names, from any directory.

    In order: an existing file; a preset's name (``tiny``: ``PRESETS_DIR/tiny.py``); a path
    relative to the repository root (``configs/tiny.py`` run from elsewhere); a path into the
    repository's ``configs/`` that an install ships as a preset (``configs/tiny.py`` after
    ``pip install .``).  Raises ``FileNotFoundError`` naming the presets otherwise.
    """
    p = pathlib.Path(path).expanduser()
    candidates = [p]
    if not p.is_absolute():
        if p.suffix == "" and len(p.parts) == 1:
            candidates.append(PRESETS_DIR / f"{p.name}.py")
        candidates.append(REPO_ROOT / p)
        if len(p.parts) == 2 and p.parts[0] == "configs":
            candidates.append(PRESETS_DIR / p.name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"config file {str(path)!r} does not exist; pass a config file's path or a preset's "
                            f"name ({', '.join(preset_names())}; the presets are in configs/).")


def argv_with_config_path(argv: list[str]) -> list[str]:
    """``argv`` with the value of ``--config`` (``--config=V`` or ``--config V``) replaced by the path of the
    file :func:`find_file` finds for it (its ``:args`` kept), so that a preset's name loads from any
    directory; a value naming no file is left as it is."""
    out, take = [], False
    for a in argv:
        if take or a.startswith("--config="):
            head = "" if take else "--config="
            name, sep, args = a[len(head):].partition(":")
            try:
                a = f"{head}{find_file(name)}{sep}{args}"
            except FileNotFoundError:
                pass
        take = a == "--config"
        out.append(a)
    return out


def load_file(path) -> ml_collections.ConfigDict:
    """The ``get_config()`` of a config file, loaded as ``--config=FILE`` loads it (see :func:`find_file`:
    ``load_file("tiny")`` and ``load_file("configs/tiny.py")`` work from any directory).

    The files in ``configs/`` are not an importable package: they are loaded by path, never with
    ``import configs``.
    """
    p = find_file(path)
    spec = importlib.util.spec_from_file_location(f"_asyncpp_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "base"
    c.seed = 0
    c.runner = "auto"  # auto: the pipeline engine when config.pipeline.stages > 1, else simulate
    # The accelerator the config is meant for (a key of HARDWARE_GB): the dry run checks that the
    # step fits its memory, and decides train.microbatches=-1 / train.auto_remat against it.
    c.hardware = "cpu"

    c.model = _model_defaults()
    c.data = _data_defaults()
    c.train = _train_defaults()
    c.optimizer = _optimizer_defaults()
    c.staleness = _staleness_defaults()
    c.pipeline = _pipeline_defaults()
    c.mesh = _mesh_defaults()
    return c


def _check_top(c) -> list[str]:
    errs: list[str] = []
    _choice(errs, "runner", c.runner, RUNNERS)
    _choice(errs, "hardware", c.hardware, tuple(HARDWARE_GB))
    _number(errs, "seed", c.seed, ge=0, lt=2**32, integer=True)
    if not (isinstance(c.name, str) and c.name and "/" not in c.name and c.name not in (".", "..")):
        errs.append(f"config.name={c.name!r} must be a non-empty name without '/', and not '.' or '..' "
                    "(it names runs/<name>).")
    return errs


# ---------------------------------------------------------------------------------------------
# config.model (and config.model.moe)


def _model_defaults() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
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
            remat=False,  # see also train.auto_remat
            # attention kernel (models/layers.py: attend): auto = splash on TPU, cuDNN's fused kernel
            # (dot_product) on a CUDA GPU, the einsum path (xla) elsewhere
            attention="auto",
            # '' = random init; 'hf:DIR' = start from a local Hugging Face Llama checkpoint
            # (config.json + safetensors; models/hf_llama.py), checked against these fields
            init_from="",
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


def _check_model(c) -> list[str]:
    m, errs = c.model, []
    shape_ok = all([_number(errs, f"model.{f}", m[f], ge=1, integer=True)
                    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")])
    shape_ok &= _number(errs, "model.head_dim", m.head_dim, ge=1, integer=True, allow=(0,),
                        why=" (0: d_model // n_heads)")
    if shape_ok:
        if not m.head_dim and m.d_model % m.n_heads:
            errs.append(f"config.model.n_heads={m.n_heads} does not divide config.model.d_model={m.d_model}; "
                        "pick n_heads dividing d_model, or set config.model.head_dim explicitly.")
        if m.n_heads % m.n_kv_heads:
            errs.append(f"config.model.n_kv_heads={m.n_kv_heads} does not divide config.model.n_heads={m.n_heads} "
                        "(grouped-query attention shares each K/V head among n_heads/n_kv_heads query heads).")
        hd = m.head_dim or (m.d_model // m.n_heads)
        if hd % 2:
            errs.append(f"head dimension {hd} must be even for RoPE; change config.model.head_dim or n_heads.")
    for f in ("compute_dtype", "param_dtype"):
        if m[f] not in DTYPES:
            errs.append(f"config.model.{f}={m[f]!r} is unsupported; choose one of {DTYPES}.")
    if m.param_dtype != "float32":
        errs.append("config.model.param_dtype must be 'float32' (the dtype policy keeps fp32 master weights).")
    _number(errs, "model.rope_theta", m.rope_theta, gt=0)
    _number(errs, "model.norm_eps", m.norm_eps, gt=0, why=" (RMSNorm divides by sqrt(mean(x^2) + eps))")
    _number(errs, "model.init_std", m.init_std, gt=0, why=" (0 makes every gradient exactly 0)")
    _number(errs, "model.z_loss", m.z_loss, ge=0)
    _flag(errs, "model.tie_embeddings", m.tie_embeddings)
    _flag(errs, "model.remat", m.remat)
    if _choice(errs, "model.attention", m.attention, ATTENTION_KERNELS) and m.attention == "splash":
        if _is_int(c.data.seq_len) and c.data.seq_len % SPLASH_SEQ_MULTIPLE:
            errs.append(f"config.model.attention='splash' needs config.data.seq_len to be a multiple of "
                        f"{SPLASH_SEQ_MULTIPLE} (its kernel's block), not {c.data.seq_len}; change the length, or "
                        "set config.model.attention='auto' (which picks splash only where it fits).")
    if not (m.init_from == "" or (isinstance(m.init_from, str) and m.init_from.startswith("hf:") and m.init_from[3:])):
        errs.append(f"config.model.init_from={m.init_from!r} must be '' (random init) or 'hf:DIR', DIR a local "
                    "Hugging Face Llama directory (config.json and model.safetensors).")
    return errs


def _check_moe(c) -> list[str]:
    m, moe, errs = c.model, c.model.moe, []
    if not _number(errs, "model.moe.num_experts", moe.num_experts, ge=2, integer=True, allow=(0,),
                   why=" (0: a dense model)") or not moe.num_experts:
        return errs
    _number(errs, "model.moe.top_k", moe.top_k, ge=1, le=moe.num_experts, integer=True,
            why=" (it picks top_k of the num_experts experts)")
    _number(errs, "model.moe.expert_d_ff", moe.expert_d_ff, ge=1, integer=True)
    _number(errs, "model.moe.shared_experts", moe.shared_experts, ge=0, integer=True)
    _choice(errs, "model.moe.gating", moe.gating, ("softmax", "sigmoid"))
    _flag(errs, "model.moe.normalize_gates", moe.normalize_gates)
    _number(errs, "model.moe.lb_loss_coef", moe.lb_loss_coef, ge=0, why=" (a negative weight rewards imbalance)")
    _number(errs, "model.moe.router_z_loss_coef", moe.router_z_loss_coef, ge=0)
    if not (_is_int(moe.every) and moe.every >= 1 and _is_int(m.n_layers) and m.n_layers % moe.every == 0):
        errs.append(f"config.model.moe.every={moe.every!r} must be a positive integer dividing "
                    f"config.model.n_layers={m.n_layers}.")
    if _is_real(moe.capacity_factor) and _is_int(moe.num_experts) and moe.capacity_factor > moe.num_experts:
        errs.append(f"config.model.moe.capacity_factor={moe.capacity_factor} gives each expert more slots than there "
                    f"are token assignments (capacity_factor > num_experts={moe.num_experts}); use at most "
                    f"{moe.num_experts} (1.0-1.25 is usual), or <= 0 for dropless.")
    else:
        _number(errs, "model.moe.capacity_factor", moe.capacity_factor, allow=())
    return errs


def _capacity_errors(c, data: int) -> list[str]:
    """A positive ``moe.capacity_factor`` leaves each expert at least one slot of the tokens one of
    the ``data`` replicas routes per microbatch (the ``N`` of the capacity)."""
    moe, t = c.model.moe, c.train
    numbers = (moe.num_experts, moe.top_k, t.global_batch_size, t.microbatches, c.data.seq_len)
    if not (all(_is_int(v) and v >= 1 for v in numbers) and _is_real(moe.capacity_factor)):
        return []
    if not 0 < moe.capacity_factor <= moe.num_experts:
        return []
    tokens = max(t.global_batch_size // (t.microbatches * data), 1) * c.data.seq_len
    if moe.capacity_factor * moe.top_k * tokens >= moe.num_experts:
        return []
    return [f"config.model.moe.capacity_factor={moe.capacity_factor} leaves each expert less than one slot: "
            f"capacity_factor * top_k * tokens / num_experts = {moe.capacity_factor} * {moe.top_k} * {tokens} / "
            f"{moe.num_experts} < 1 (almost every assignment would be dropped); use >= "
            f"{moe.num_experts / (moe.top_k * tokens):.3g} (1.0-1.25 is usual), or <= 0 for dropless."]


# ---------------------------------------------------------------------------------------------
# config.data


def _data_defaults() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            source="stdlib",  # 'stdlib' | glob / path(s), comma separated | 'hf:<dataset>[:<config>]'
            # weighted sources in place of source: 'WEIGHT:SOURCE;WEIGHT:SOURCE' (e.g. '0.7:stdlib;0.3:/data/*.txt')
            mixture="",
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


def _check_data(c) -> list[str]:
    d, errs = c.data, []
    if not (isinstance(d.source, str) and d.source):
        errs.append("config.data.source is empty; use 'stdlib', a glob of text files, or 'hf:<dataset>'.")
    elif d.source.startswith("hf:"):
        errs += _hf_source_errors(f"config.data.source={d.source!r}", d.source)
    if not (isinstance(d.tokenizer, str) and d.tokenizer):
        errs.append("config.data.tokenizer is empty; use 'byte' or the path to a tokenizer.json.")
    elif d.tokenizer == "byte" and d.eos_token:
        errs.append(f"config.data.eos_token={d.eos_token!r} only applies to a Hugging Face tokenizer; the byte "
                    "tokenizer's end-of-document id is always 256: unset it (--config.data.eos_token='').")
    for field, what in (("hf_split", "split, e.g. 'train'"), ("hf_text_field", "text column, e.g. 'text'")):
        if not (isinstance(d[field], str) and d[field]):
            errs.append(f"config.data.{field}={d[field]!r} must name the Hugging Face dataset's {what}.")
    _number(errs, "data.seq_len", d.seq_len, ge=2, integer=True)
    _number(errs, "data.val_fraction", d.val_fraction, gt=0, lt=1)
    _number(errs, "data.split_seed", d.split_seed, ge=0, integer=True)
    _number(errs, "data.hf_max_docs", d.hf_max_docs, ge=0, integer=True, why=" (0: all documents)")
    _flag(errs, "data.verify_checksums", d.verify_checksums)
    if not isinstance(d.get("mixture", ""), str):
        errs.append(f"config.data.mixture={d.mixture!r} must be a string 'WEIGHT:SOURCE;WEIGHT:SOURCE'.")
    elif d.get("mixture", ""):
        errs += mixture_errors(d.mixture)
    return errs


def mixture_sources(c) -> list[tuple[float, str]]:
    """``config.data.mixture`` as ``[(weight, source), ...]`` (empty: the run reads ``config.data.source``);
    each entry ``WEIGHT:SOURCE``, entries separated by ``;`` (a source may itself hold ``,`` and ``:``)."""
    out = []
    for entry in c.data.get("mixture", "").split(";"):
        if entry.strip():
            weight, _, source = entry.partition(":")
            out.append((float(weight), source.strip()))
    return out


def mixture_errors(spec: str) -> list[str]:
    errs = []
    for entry in (e.strip() for e in spec.split(";") if e.strip()):
        weight, sep, source = entry.partition(":")
        try:
            ok = math.isfinite(float(weight)) and float(weight) > 0
        except ValueError:
            ok = False
        if not (ok and sep and source.strip()):
            errs.append(f"config.data.mixture entry {entry!r} must be WEIGHT:SOURCE with a positive WEIGHT, e.g. "
                        "'0.7:stdlib;0.3:/data/*.txt'.")
        elif source.strip().startswith("hf:"):
            errs += _hf_source_errors(f"config.data.mixture entry {entry!r}", source.strip())
    return errs


def _hf_source_errors(what: str, source: str) -> list[str]:
    """``hf:<dataset>[:<config_name>]`` names a dataset (``what``: the setting, as the message names it)."""
    if source[len("hf:"):].partition(":")[0]:
        return []
    return [f"{what} names no dataset: expected 'hf:<dataset>[:<config_name>]', e.g. "
            "'hf:HuggingFaceFW/fineweb-edu:sample-10BT'."]


# ---------------------------------------------------------------------------------------------
# config.train


def _train_defaults() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            steps=1000,
            global_batch_size=32,  # sequences per optimizer update, over all devices and microbatches
            # gradient accumulation steps per update; -1 = auto: the smallest divisor of the
            # per-replica batch that the schedule runs (on the engine from 2*(stages-1); multiples of
            # stages for interleaved) whose compiled step fits the memory budget below
            # (train/fit.py); with no budget, the smallest (configs.auto_microbatches)
            microbatches=-1,
            # memory budget per device in GB (1e9 bytes); 0 = the accelerator's own limit in a run
            # (none on CPU), config.hardware's memory in a dry run
            device_memory_gb=0.0,
            # True: under a memory budget, turn model.remat on when no microbatch count fits without it
            auto_remat=False,
            eval_every=100,
            eval_batches=8,
            # batches (of the eval batch size) of a test set evaluated once, at the end of a finished
            # run: the val split's last windows, disjoint from the eval_batches first ones that the
            # run reports along the way and that tuning picks by (0: no test set)
            test_batches=0,
            log_every=10,
            checkpoint_every=200,
            keep_checkpoints=3,
            async_checkpoint=True,
            progress_bar=True,
            # comma-separated metric loggers: jsonl (metrics.jsonl), tensorboard, wandb (the [wandb] extra); '' = none
            loggers="jsonl,tensorboard",
            wandb_project="asyncpp_jax",  # the W&B project a wandb logger writes to (the run is named config.name)
            wandb_entity="",  # the W&B user or team; '' = your default entity
            # peak dense TFLOP/s of one accelerator (e.g. 989 H100 bf16, 459 TPU v5p); 0 = MFU not reported
            peak_tflops_per_device=0.0,
            # trace updates profile_start+1 .. profile_start+profile_steps into WORKDIR/profile (0: off);
            # python -m asyncpp_jax.train.profile WORKDIR prints where the device time went
            profile_start=0,
            profile_steps=0,
            # what a resume may change on purpose, comma separated, of RUN_IDENTITY: e.g. 'corpus' to
            # continue training on new data (the data iterator then starts afresh on it); '' = none
            accept_changed="",
        )
    )


def accepted_changes(c) -> tuple[str, ...]:
    """``config.train.accept_changed`` as a tuple of :data:`RUN_IDENTITY` names."""
    value = c.train.get("accept_changed", "")
    return tuple(x.strip() for x in value.split(",") if x.strip()) if isinstance(value, str) else ()


def loggers(c) -> tuple[str, ...]:
    """The metric loggers ``config.train.loggers`` names (``'jsonl,wandb'``: ``('jsonl', 'wandb')``)."""
    return tuple(x.strip() for x in c.train.get("loggers", "").split(",") if x.strip())


def _check_train(c) -> list[str]:
    t, errs = c.train, []
    for f in ("steps", "global_batch_size", "microbatches", "eval_every", "eval_batches", "log_every",
              "checkpoint_every", "keep_checkpoints"):
        if not (_is_int(t[f]) and t[f] > 0):
            errs.append(f"config.train.{f}={t[f]!r} must be a positive integer.")
    _number(errs, "train.test_batches", t.test_batches, ge=0, integer=True, why=" (0: no test set)")
    _number(errs, "train.peak_tflops_per_device", t.peak_tflops_per_device, ge=0, why=" (0: MFU not reported)")
    _flag(errs, "train.async_checkpoint", t.async_checkpoint)
    _flag(errs, "train.progress_bar", t.progress_bar)
    chosen = loggers(c) if isinstance(t.get("loggers", ""), str) else None
    if chosen is None or not set(chosen) <= set(LOGGERS) or len(set(chosen)) != len(chosen):
        errs.append(f"config.train.loggers={t.loggers!r} must name each logger at most once, comma-separated, from "
                    f"{', '.join(LOGGERS)} (--config.train.loggers=jsonl,wandb), or '' for none.")
    for f in ("wandb_project", "wandb_entity"):
        if not isinstance(t.get(f, ""), str):
            errs.append(f"config.train.{f}={t[f]!r} must be a string.")
    _number(errs, "train.device_memory_gb", t.device_memory_gb, ge=0,
            why=" (0: the accelerator's limit in a run, config.hardware's memory in a dry run)")
    _flag(errs, "train.auto_remat", t.auto_remat)
    unknown = [x for x in accepted_changes(c) if x not in RUN_IDENTITY]
    if not isinstance(t.get("accept_changed", ""), str) or unknown:
        errs.append(f"config.train.accept_changed={t.get('accept_changed')!r}: name what a resume may change, comma "
                    f"separated, of {', '.join(RUN_IDENTITY)} (or '' for none).")
    for f in ("profile_start", "profile_steps"):
        if not (_is_int(t[f]) and t[f] >= 0):
            errs.append(f"config.train.{f}={t[f]!r} must be a non-negative integer (profile_steps=0: no profile).")
    if (_is_int(t.profile_start) and _is_int(t.profile_steps) and _is_int(t.steps) and t.profile_steps > 0
            and t.profile_start + t.profile_steps > t.steps):
        errs.append(f"config.train.profile_start={t.profile_start} + config.train.profile_steps={t.profile_steps} runs past "
                    f"config.train.steps={t.steps}: start the profile earlier or trace fewer updates.")
    return errs


# ---------------------------------------------------------------------------------------------
# config.optimizer


def _optimizer_defaults() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
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


def _check_optimizer(c) -> list[str]:
    o, errs = c.optimizer, []
    _choice(errs, "optimizer.name", o.name, OPTIMIZERS)
    _choice(errs, "optimizer.schedule", o.schedule, SCHEDULES)
    if not (_is_real(o.lr) and o.lr > 0):
        errs.append(f"config.optimizer.lr={o.lr} must be a positive finite number.")
    _number(errs, "optimizer.weight_decay", o.weight_decay, ge=0)
    _number(errs, "optimizer.grad_clip", o.grad_clip, ge=0, why=" (0 disables clipping)")
    _number(errs, "optimizer.min_lr_ratio", o.min_lr_ratio, ge=0, le=1)
    _number(errs, "optimizer.wsd_decay_fraction", o.wsd_decay_fraction, gt=0, le=1)
    if _is_int(c.train.steps):
        if not (_is_int(o.warmup_steps) and 0 <= o.warmup_steps < c.train.steps):
            errs.append(f"config.optimizer.warmup_steps={o.warmup_steps} must be >= 0 and below "
                        f"config.train.steps={c.train.steps}.")
    try:
        re.compile(o.adamw_pattern)
    except (re.error, TypeError) as e:
        errs.append(f"config.optimizer.adamw_pattern={o.adamw_pattern!r} is not a valid regular expression ({e}).")
    return errs + _check_optimizer_hparams(o)


# Each optimizer's decay rates (betas, momenta): [0, 1); its eps: > 0.
_OPTIMIZER_BETAS = (("adamw", ("b1", "b2")), ("soap", ("b1", "b2")), ("adan", ("b1", "b2", "b3")),
                    ("lion", ("b1", "b2")), ("mars", ("b1", "b2")), ("side", ("b1", "b2")), ("muon", ("mu",)))
_OPTIMIZER_EPS = ("adamw", "soap", "adan", "mars", "side")


def _check_optimizer_hparams(o) -> list[str]:
    errs: list[str] = []
    for sub, keys in _OPTIMIZER_BETAS:
        for k in keys:
            v = o[sub][k]
            if not (_is_real(v) and 0 <= v < 1):
                errs.append(f"config.optimizer.{sub}.{k}={v} must lie in [0, 1).")
    for sub in _OPTIMIZER_EPS:
        _number(errs, f"optimizer.{sub}.eps", o[sub].eps, gt=0, why=" (it keeps the denominator away from 0)")
    _choice(errs, "optimizer.muon.scaling", o.muon.scaling, MUON_SCALINGS)
    if not (_is_int(o.muon.ns_steps) and 0 < o.muon.ns_steps <= MAX_NS_STEPS):
        errs.append(f"config.optimizer.muon.ns_steps={o.muon.ns_steps!r} must be a positive integer at most "
                    f"{MAX_NS_STEPS} (5 is the reference; each step is unrolled into the compiled program).")
    _choice(errs, "optimizer.adan.weight_decay_mode", o.adan.weight_decay_mode, ADAN_DECAY_MODES)
    _number(errs, "optimizer.soap.shampoo_beta", o.soap.shampoo_beta, ge=0, lt=1, allow=(-1,),
            why=" (-1: use soap.b2)")
    if not (_is_int(o.soap.precondition_frequency) and o.soap.precondition_frequency > 0):
        errs.append(f"config.optimizer.soap.precondition_frequency={o.soap.precondition_frequency!r} "
                    "must be a positive integer.")
    _number(errs, "optimizer.soap.max_precond_dim", o.soap.max_precond_dim, ge=1, integer=True)
    _number(errs, "optimizer.mars.gamma", o.mars.gamma, ge=0)
    if not (_is_real(o.side.lr_ratio) and o.side.lr_ratio > 0):
        errs.append(f"config.optimizer.side.lr_ratio={o.side.lr_ratio} must be > 0.")
    if not (_is_real(o.side.weight_decay) and (o.side.weight_decay >= 0 or o.side.weight_decay == -1)):
        errs.append(f"config.optimizer.side.weight_decay={o.side.weight_decay} must be >= 0, or -1 for "
                    "config.optimizer.weight_decay.")
    for sub in ("adamw", "muon"):
        _flag(errs, f"optimizer.{sub}.nesterov", o[sub].nesterov)
    return errs


# ---------------------------------------------------------------------------------------------
# config.staleness


def _staleness_defaults() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            mode="sync",  # sync | 2bw (one-step delay) | pipedream (per-stage delay P-1-s)
            # pipedream: the simulated pipeline depth P (stage s's delay is P-1-s); not
            # config.pipeline.stages, the real engine's stage count
            pipedream_stages=4,
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
            # SpecTrain / PipeMare weight prediction: gradient at w_t + d * delta_t (simulate runner and 2bw engine)
            weight_prediction=False,
            weight_prediction_smoothing=0.0,  # EMA factor of delta over the updates; 0 = the last update
            # PipeMare learning-rate rescheduling over the first K updates: lr * d^-(1 - min(t/K, 1)); 0 = off
            lr_rescheduling_steps=0,
        )
    )


def _check_staleness(c) -> list[str]:
    st, t, errs = c.staleness, c.train, []
    _choice(errs, "staleness.mode", st.mode, STALENESS_MODES)
    _choice(errs, "staleness.mitigation", st.mitigation, MITIGATIONS)
    _choice(errs, "staleness.pipedream_gradient", st.pipedream_gradient, PIPEDREAM_GRADIENTS)
    if st.mode == "sync" and not engine_delay(c) and st.mitigation != "none":
        errs.append(f"config.staleness.mitigation={st.mitigation!r} needs a delay; set config.staleness.mode=2bw "
                    "or pipedream, or config.pipeline.schedule=2bw or pipedream.")
    if st.mode == "pipedream" and not engine_delay(c):  # the engine's stages replace pipedream_stages
        units = scanned_units(c.model)
        if not (_is_int(st.pipedream_stages) and st.pipedream_stages >= 2):
            errs.append(f"config.staleness.pipedream_stages={st.pipedream_stages!r} must be an integer >= 2 for pipedream.")
        elif _is_int(units) and units % st.pipedream_stages:
            errs.append(_uneven_layers(c.model, units, "staleness.pipedream_stages", st.pipedream_stages)
                        + "; each stage holds an equal, contiguous slice of layers.")
    errs += staleness_correction_errors(c, engine_delay(c))
    counts_ok = True
    for f in ("sync_start_steps", "sync_cooldown_steps"):
        if not (_is_int(st[f]) and st[f] >= 0):
            counts_ok = False
            errs.append(f"config.staleness.{f}={st[f]!r} must be an integer >= 0.")
    if counts_ok and _is_int(t.steps) and st.sync_start_steps + st.sync_cooldown_steps > t.steps:
        errs.append(f"config.staleness.sync_start_steps + sync_cooldown_steps = "
                    f"{st.sync_start_steps + st.sync_cooldown_steps} exceeds config.train.steps={t.steps}.")
    if not (_is_real(st.ef_strength) and st.ef_strength >= 0):
        errs.append(f"config.staleness.ef_strength={st.ef_strength} must be >= 0.")
    _flag(errs, "staleness.taylor_adaptive", st.taylor_adaptive)
    for f in ("taylor_lam", "taylor_lam0"):
        _number(errs, f"staleness.{f}", st[f], ge=0, why=" (a negative lambda pushes the gradient further away)")
    if not (_is_real(st.taylor_ema_decay) and 0 <= st.taylor_ema_decay < 1):
        errs.append(f"config.staleness.taylor_ema_decay={st.taylor_ema_decay} must lie in [0, 1).")
    return errs


NESTEROV_OPTIMIZERS = ("adamw", "muon")


def staleness_correction_errors(c: ml_collections.ConfigDict, engine_mode: str | None) -> list[str]:
    """Problems with ``config.staleness``'s Nesterov look-ahead, weight prediction and PipeMare lr
    (``engine_mode``: :func:`engine_delay`, the engine's physical delay, which takes precedence)."""
    st, errs = c.staleness, []
    mode = engine_mode or st.mode
    stages = c.pipeline.stages if engine_mode == "pipedream" else st.pipedream_stages
    max_delay = {"2bw": 1, "pipedream": stages - 1 if isinstance(stages, int) else 0}.get(mode, 0)
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
    if st.weight_prediction:
        if mode == "pipedream":
            errs.append("config.staleness.weight_prediction=True needs config.staleness.mode=2bw: with "
                        "PipeDream's per-stage delays each stage would need its own extrapolation distance.")
    # Domains, checked whether or not the correction is switched on.
    _number(errs, "staleness.nesterov_b1", st.nesterov_b1, ge=0, lt=1, why=" (the paper uses 0.99)")
    _number(errs, "staleness.nesterov_momentum_decay", st.nesterov_momentum_decay, ge=0)
    _number(errs, "staleness.weight_prediction_smoothing", st.weight_prediction_smoothing, ge=0, lt=1)
    _flag(errs, "staleness.nesterov", st.nesterov)
    _flag(errs, "staleness.weight_prediction", st.weight_prediction)
    k = st.lr_rescheduling_steps
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
        errs.append(f"config.staleness.lr_rescheduling_steps={k!r} must be an integer >= 0 (0 disables it).")
    elif k and mode in ("2bw", "pipedream") and max_delay <= 1:
        errs.append(f"config.staleness.lr_rescheduling_steps={k} does nothing at a one-step delay: PipeMare "
                    "scales the lr by delay^-(1 - t/K), which is 1 at delay 1. Use it with "
                    "config.staleness.mode=pipedream and pipedream_stages >= 3, or set it to 0.")
    return errs


# ---------------------------------------------------------------------------------------------
# config.pipeline


def _pipeline_defaults() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            stages=1,  # > 1: the pipeline engine, layers split into this many contiguous stages
            # sync (flush every step, the eager order: a forward and a backward per slot) | 1f1b
            # (textbook 1F1B with a flush, run as a program: stage 0 stashes at most `stages`
            # microbatches, not 2*stages-1) | interleaved (Megatron's interleaved 1F1B with a flush:
            # each device holds `virtual_stages` chunks of layers, the bubble about that many times
            # smaller) | zb-h1 (zero bubble H1: 1f1b with each backward split into its input-gradient
            # and weight-gradient halves, the latter deferred into the bubble; dense models) | 2bw
            # (no flush, one-step delay)
            schedule="sync",
            # Chunks of layers per device under schedule=interleaved (virtual stage c*stages + d on
            # device d); n_layers must split into stages*virtual_stages equal chunks
            virtual_stages=2,
            # True: a stage's backward recomputes its forward from the stashed stage input (one
            # activation per in-flight microbatch); False: the forward keeps its autodiff residuals
            # for the backward (no recompute, every intermediate of the block per microbatch)
            recompute=True,
            # Layers per stage, e.g. (26, 6) (CLI: --config.pipeline.stage_layers=26,6): one entry
            # per stage, summing to config.model.n_layers; () = an even split.  Lets the last stage,
            # which also runs the final norm, head and loss, hold fewer layers (even none).  The
            # engine pads every stage's stack to the largest (zeros that are never run).
            stage_layers=(),
            # True: each vocabulary-sized table (embedding, head) split along its vocabulary over
            # the stages, with its weight versions, gradient accumulators and optimizer state, so
            # that no device holds a whole table; the lookup and the loss run as collectives that
            # every stage joins each slot.  Every schedule; vocab_size divisible by stages.  The
            # field-sized configs (configs/llama3_8b.py, configs/moe10b.py) set it
            vocab_parallel=False,
            # spmd: one program runs every stage, so every stage holds the same shapes (the
            # embedding and head replicated, or split with vocab_parallel) | mpmd: one program per
            # stage, each stage holding only what it uses: the embedding (its versions, optimizer
            # state, accumulators) on the first stage, the final norm and head on the last, a
            # tied table on those two only.  mpmd runs schedule sync, 1f1b, 2bw or pipedream (2bw from
            # microbatches >= stages - 1), with recompute=True, an even split, no vocab_parallel
            # and no weight prediction, in a job of one process
            placement="spmd",
        )
    )


def uneven_split(c) -> tuple | None:
    """The layers per stage a (valid) config runs with, or ``None`` for the engine's even split
    (``stage_layers`` empty or all equal) and for the simulate runner: what a resume must match."""
    split = tuple(c.pipeline.get("stage_layers", ()) or ())
    if not (uses_pipeline(c) and c.pipeline.stages > 1) or len(set(split)) <= 1:
        return None
    return split


def interleave_of(c) -> tuple | None:
    """``(stages, virtual_stages)`` when a (valid) config runs the interleaved layout of the layer
    stack (``pipeline.schedule='interleaved'`` on the engine), else ``None``: what a resume must match."""
    pipe = c.pipeline
    if not (uses_pipeline(c) and pipe.stages > 1 and pipe.get("schedule") == "interleaved"):
        return None
    return (pipe.stages, pipe.get("virtual_stages", 2))


def _zero_bubble_errors(c) -> list[str]:
    """zb-h1 splits each backward at the dense layers' matmuls (asyncpp_jax/models/taps.py)."""
    errs = []
    if c.model.moe.num_experts:
        errs.append(f"config.pipeline.schedule='zb-h1' splits each backward at the dense layers' weights, and the "
                    f"MoE layers (config.model.moe.num_experts={c.model.moe.num_experts}) hold their experts' "
                    "weights outside them: use config.pipeline.schedule=1f1b or interleaved for an MoE model.")
    if c.pipeline.stage_layers:
        errs.append(f"config.pipeline.stage_layers={tuple(c.pipeline.stage_layers)} cannot be combined with "
                    "config.pipeline.schedule='zb-h1', which runs an even split: set stage_layers=() or use "
                    "schedule=1f1b.")
    return errs


def _vocab_parallel_errors(c) -> list[str]:
    """``pipeline.vocab_parallel`` splits a vocabulary the stages divide."""
    pipe, v = c.pipeline, c.pipeline.get("vocab_parallel", False)
    if not isinstance(v, bool):
        return [f"config.pipeline.vocab_parallel={v!r} must be True or False."]
    if not v:
        return []
    errs = []
    if _is_int(c.model.vocab_size) and c.model.vocab_size % pipe.stages:
        errs.append(f"config.pipeline.vocab_parallel=True splits the vocabulary over config.pipeline.stages="
                    f"{pipe.stages}, which does not divide config.model.vocab_size={c.model.vocab_size}: pad the "
                    f"vocabulary to a multiple of {pipe.stages} or set vocab_parallel=False.")
    return errs


def is_mpmd(c) -> bool:
    """Whether the pipeline engine runs one program per stage (``pipeline.placement='mpmd'``)."""
    return uses_pipeline(c) and c.pipeline.get("placement", "spmd") == "mpmd"


def _placement_errors(c) -> list[str]:
    """What ``pipeline.placement='mpmd'`` runs (asyncpp_jax/pipeline/mpmd/engine.py)."""
    pipe, errs = c.pipeline, []
    if not _choice(errs, "pipeline.placement", pipe.get("placement", "spmd"), PLACEMENTS) or not is_mpmd(c):
        return errs
    why = " under config.pipeline.placement='mpmd'"
    if pipe.schedule not in MPMD_SCHEDULES:
        errs.append(f"config.pipeline.schedule={pipe.schedule!r} does not run{why}, which runs "
                    f"{', '.join(MPMD_SCHEDULES)}: pick one of them, or set placement='spmd'.")
    if pipe.recompute is not True:
        errs.append(f"config.pipeline.recompute=False does not run{why} (its backward recomputes each stage's "
                    "forward from the stashed input): set recompute=True, or placement='spmd'.")
    if pipe.stage_layers:
        errs.append(f"config.pipeline.stage_layers does not run{why}, which splits the layers evenly: set "
                    "stage_layers=(), or placement='spmd'.")
    if pipe.get("vocab_parallel", False) is True:
        errs.append(f"config.pipeline.vocab_parallel=True does not apply{why}: the embedding lives on the first "
                    "stage and the head on the last, whole. Set vocab_parallel=False (or placement='spmd').")
    if c.staleness.get("weight_prediction"):
        errs.append(f"config.staleness.weight_prediction=True does not run{why}: set it False, or placement='spmd'.")
    return errs


def scanned_units(m):
    """The layer stack's length: ``n_layers``, or ``n_layers / moe.every`` for an MoE model whose
    scanned unit groups ``every`` layers (the last one MoE); stages split this stack."""
    grouped = m.moe.num_experts and _is_int(m.moe.every) and m.moe.every > 1 and _is_int(m.n_layers)
    return m.n_layers // m.moe.every if grouped else m.n_layers


def _uneven_layers(m, units, field: str, stages) -> str:
    """``units`` scanned layers (:func:`scanned_units`) do not split over ``config.FIELD = stages``."""
    return (f"config.model.n_layers={m.n_layers} is not divisible by config.{field}={stages}"
            + (f" x config.model.moe.every={m.moe.every}" if units != m.n_layers else ""))


def _interleaved_errors(c, units) -> list[str]:
    pipe, t, errs = c.pipeline, c.train, []
    v = pipe.virtual_stages
    if not (_is_int(v) and v >= 2):
        return [f"config.pipeline.virtual_stages={v!r} must be an integer >= 2 under "
                "config.pipeline.schedule='interleaved' (2 is Megatron's usual choice)."]
    if pipe.stage_layers:
        errs.append("config.pipeline.stage_layers (an uneven split) cannot be combined with "
                    "config.pipeline.schedule='interleaved', which splits the layers evenly into stages x "
                    "virtual_stages chunks: set stage_layers=() or another schedule.")
    if _is_int(units) and units % (pipe.stages * v):
        errs.append(f"config.model.n_layers={c.model.n_layers} does not split into config.pipeline.stages={pipe.stages}"
                    f" x config.pipeline.virtual_stages={v} = {pipe.stages * v} equal chunks"
                    + (" of scanned groups" if units != c.model.n_layers else "")
                    + f"; pick n_layers divisible by {pipe.stages * v} or lower virtual_stages.")
    if _is_int(t.microbatches) and t.microbatches > 0 and t.microbatches % pipe.stages:
        errs.append(f"config.train.microbatches={t.microbatches} must be a multiple of config.pipeline.stages="
                    f"{pipe.stages} under config.pipeline.schedule='interleaved' (microbatches go through the "
                    "chunks in groups of stages).")
    return errs


def _engine_only_errors(c) -> list[str]:
    """Settings only the pipeline engine reads, on a config that runs the simulate runner: refused,
    since the run would ignore them (``schedule='2bw'`` would train without its delay)."""
    pipe, errs = c.pipeline, []
    where = (f"this config runs the simulate runner (config.runner={c.runner!r}, config.pipeline.stages="
             f"{pipe.stages}): set config.pipeline.stages > 1 (config.runner auto or pipeline)")
    split = pipe.stage_layers
    if isinstance(split, (tuple, list)) and split and all(_is_int(n) for n in split):  # else stage_layers_errors
        errs.append(f"config.pipeline.stage_layers={tuple(split)} splits the layers over the pipeline engine's "
                    f"stages, but {where}, or leave stage_layers=().")
    if pipe.schedule != "sync":
        errs.append(f"config.pipeline.schedule={pipe.schedule!r} is the pipeline engine's, but {where}, or leave the "
                    "schedule at 'sync'" + ("; the simulated one-step delay is config.staleness.mode=2bw."
                                            if pipe.schedule in ("2bw", "pipedream") else "."))
    if pipe.get("vocab_parallel", False) is not False:
        errs.append(f"config.pipeline.vocab_parallel={pipe.vocab_parallel!r} splits the tables over the pipeline "
                    f"engine's stages, but {where}, or leave it False.")
    if pipe.get("placement", "spmd") != "spmd":
        errs.append(f"config.pipeline.placement={pipe.placement!r} places the pipeline engine's stages, but {where}, "
                    "or leave it 'spmd'.")
    return errs


def stage_layers_errors(c) -> list[str]:
    """What is wrong with ``config.pipeline.stage_layers`` (empty: nothing)."""
    pipe, m = c.pipeline, c.model
    split = pipe.stage_layers
    if split is None or (isinstance(split, (tuple, list)) and len(split) == 0):
        return []
    name = f"config.pipeline.stage_layers={tuple(split) if isinstance(split, (tuple, list)) else split!r}"
    if not (isinstance(split, (tuple, list)) and all(_is_int(n) for n in split)):
        return [f"{name} must be a tuple of integers, one per stage (--config.pipeline.stage_layers=26,6), "
                "or () for an even split."]
    if not (uses_pipeline(c) and _is_int(pipe.stages) and pipe.stages > 1):
        return []  # on the simulate runner any split is refused, with the engine's other settings
    errs = []
    if len(split) != pipe.stages:
        errs.append(f"{name} has {len(split)} entries; it needs one per stage (config.pipeline.stages="
                    f"{pipe.stages}).")
    if any(n < 0 for n in split):
        errs.append(f"{name} has a negative entry; each stage holds 0 or more layers.")
    if _is_int(m.n_layers) and sum(split) != m.n_layers:
        errs.append(f"{name} sums to {sum(split)}; it must sum to config.model.n_layers={m.n_layers}.")
    grouped = m.moe.num_experts and _is_int(m.moe.every) and m.moe.every > 1
    if grouped and any(n % m.moe.every for n in split):
        errs.append(f"{name}: with config.model.moe.every={m.moe.every} the layers are scanned in groups of "
                    f"{m.moe.every}; give each stage a multiple of {m.moe.every} layers.")
    return errs


def _program_errors(c) -> list[str]:
    """The schedule's program at these settings must pass the program validator
    (``programs.validate``), the one check of what a schedule needs (``2bw``: every backward within
    one batch of its forward, from ``microbatches >= stages - 1``); the engine relies on it."""
    pipe, t = c.pipeline, c.train
    if not (_is_int(t.microbatches) and t.microbatches > 0):
        return []
    v = pipe.virtual_stages if pipe.schedule == "interleaved" else None
    try:
        programs.validate(programs.generate(pipe.schedule, pipe.stages, t.microbatches, v))
    except programs.ProgramError as err:
        least = programs.min_microbatches(pipe.schedule, pipe.stages, v)
        fix = f"; it runs from config.train.microbatches={least}" if least else ""
        return [f"config.train.microbatches={t.microbatches} is too few for config.pipeline.schedule={pipe.schedule} "
                f"with config.pipeline.stages={pipe.stages}: its program breaks a rule ({err}){fix}."]
    return []


def _check_pipeline(c) -> list[str]:
    pipe, m, st, errs = c.pipeline, c.model, c.staleness, []
    if not (_is_int(pipe.stages) and pipe.stages >= 1):
        errs.append(f"config.pipeline.stages={pipe.stages!r} must be a positive integer.")
    if not isinstance(pipe.recompute, bool):
        errs.append(f"config.pipeline.recompute={pipe.recompute!r} must be True (recompute each stage's forward "
                    "in its backward) or False (keep the forward's residuals).")
    if not _choice(errs, "pipeline.schedule", pipe.schedule, pipeline_schedules()) or errs:
        return errs
    if c.runner == "pipeline" and pipe.stages == 1:
        errs.append("config.runner='pipeline' needs config.pipeline.stages > 1.")
    errs += stage_layers_errors(c)
    if not (uses_pipeline(c) and pipe.stages > 1):
        return errs + _engine_only_errors(c)
    units = scanned_units(m)
    if _is_int(units) and units % pipe.stages and not pipe.stage_layers:
        errs.append(_uneven_layers(m, units, "pipeline.stages", pipe.stages)
                    + "; each stage holds an equal, contiguous block of layers unless config.pipeline.stage_layers "
                    "gives each stage's count (e.g. --config.pipeline.stage_layers=3,2).")
    if pipe.schedule == "interleaved":
        errs += _interleaved_errors(c, units)
    if pipe.schedule == "zb-h1":
        errs += _zero_bubble_errors(c)
    errs += _vocab_parallel_errors(c)
    errs += _placement_errors(c)
    if st.mode not in ("sync", pipe.schedule):
        errs.append(f"config.staleness.mode={st.mode!r} cannot run on the pipeline engine with "
                    f"config.pipeline.schedule={pipe.schedule!r}: the engine's delay is physical. Use "
                    "config.pipeline.schedule=2bw for a one-step delay, or config.pipeline.stages=1 to simulate it.")
    if not errs:
        errs += _program_errors(c)
    return errs


# ---------------------------------------------------------------------------------------------
# config.mesh (and the batch split over it)


def _mesh_defaults() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            data=1,  # data-parallel devices; -1 = all devices
            # MoE under the pipeline engine: shard the experts over the data axis (GShard) and move
            # tokens to them with all_to_all; needs num_experts divisible by data
            expert_parallel=False,
        )
    )


def _check_mesh(c) -> list[str]:
    mesh, m, t, errs = c.mesh, c.model, c.train, []
    _flag(errs, "mesh.expert_parallel", mesh.expert_parallel)
    data_ok = _number(errs, "mesh.data", mesh.data, ge=1, le=MAX_MESH_DEVICES, integer=True, allow=(-1,),
                      why=" (-1: all devices)")
    if data_ok and devices_needed(c) > MAX_MESH_DEVICES:
        errs.append(f"config.mesh.data={mesh.data} x config.pipeline.stages={c.pipeline.stages} = "
                    f"{devices_needed(c)} devices is more than any machine this code runs on "
                    f"({MAX_MESH_DEVICES}); lower them.")
    if mesh.expert_parallel is True:
        if not m.moe.num_experts:
            errs.append("config.mesh.expert_parallel=True needs an MoE model (config.model.moe.num_experts > 0).")
        if not uses_pipeline(c):
            errs.append("config.mesh.expert_parallel=True runs inside the pipeline engine; set "
                        "config.pipeline.stages > 1.")
        if _is_real(m.moe.capacity_factor) and m.moe.capacity_factor <= 0:
            errs.append("config.mesh.expert_parallel=True needs config.model.moe.capacity_factor > 0.")
    if data_ok and mesh.data > 0:
        errs += _replica_errors(c, mesh.data)
    elif data_ok:  # -1: check_against_devices applies them once the devices give the count; one replica
        errs += _capacity_errors(c, 1)  # routes the most tokens, so a capacity short even there fails now
    return errs


def _replica_errors(c, data: int) -> list[str]:
    """The rules that depend on the number of data replicas: ``config.mesh.data``, or under ``-1``
    the count the devices give (:func:`check_against_devices`).  The batch splits into
    ``train.microbatches`` microbatches, each split over the replicas; expert parallelism gives each
    replica ``num_experts / data`` experts; a capacity leaves each expert a slot."""
    t, moe, errs = c.train, c.model.moe, []
    auto = f" (config.mesh.data=-1: {data} replicas on these devices)" if c.mesh.data == -1 else ""
    if all(_is_int(t[f]) and t[f] > 0 for f in ("global_batch_size", "microbatches")):
        div = t.microbatches * data
        if t.global_batch_size % div:
            errs.append(f"config.train.global_batch_size={t.global_batch_size} is not divisible by "
                        f"config.train.microbatches × config.mesh.data = {t.microbatches} × {data} = {div}{auto}; "
                        "change the batch size or the split.")
    if c.mesh.expert_parallel is True and _is_int(moe.num_experts) and moe.num_experts % data:
        errs.append(f"config.model.moe.num_experts={moe.num_experts} is not divisible by config.mesh.data={data}"
                    f"{auto} (expert parallelism gives each data shard num_experts / data experts).")
    return errs + _capacity_errors(c, data)


# ---------------------------------------------------------------------------------------------
# All sections


SECTION_CHECKS = (_check_renamed, _check_top, _check_model, _check_moe, _check_data, _check_train,
                  _check_optimizer, _check_staleness, _check_pipeline, _check_mesh)


def validate_errors(c: ml_collections.ConfigDict) -> list[str]:
    """Every impossible setting in ``c``, section by section (empty: valid)."""
    c = resolve(c)
    return [msg for check in SECTION_CHECKS for msg in check(c)]


def validate(c: ml_collections.ConfigDict) -> None:
    """Raise one ConfigError listing every impossible setting in ``c``, section by section."""
    errs = validate_errors(c)
    if errs:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))


def check_cpu_host(c: ml_collections.ConfigDict) -> None:
    """On a CPU-only host the mesh is made of fake XLA:CPU devices, one per mesh slot; past
    :data:`MAX_CPU_DEVICES` the CPU client spends minutes (or hangs) creating them."""
    n = devices_needed(resolve(c))
    if n > MAX_CPU_DEVICES:
        raise ConfigError(
            f"config.mesh.data={c.mesh.data} x config.pipeline.stages={c.pipeline.stages} asks for {n} devices; "
            f"this host has no accelerator, so each would be a fake CPU device, and more than {MAX_CPU_DEVICES} "
            "of them cannot be simulated here. Lower config.mesh.data / config.pipeline.stages, or run on the "
            "accelerators the config is meant for."
        )


def check_against_devices(c: ml_collections.ConfigDict, num_devices: int) -> int:
    """Resolve ``mesh.data = -1`` and check the mesh fits the devices; returns the data size."""
    c = resolve(c)
    stages = c.pipeline.stages if uses_pipeline(c) else 1
    data = num_devices // stages if c.mesh.data == -1 else c.mesh.data
    if data * stages > num_devices or data < 1:
        raise ConfigError(
            f"config.mesh.data={c.mesh.data} x config.pipeline.stages={stages} asks for {max(data, 1) * stages} "
            f"devices but {num_devices} are present; lower them, or on CPU set "
            f"JAX_NUM_CPU_DEVICES={max(data, 1) * stages} before JAX starts (python -m asyncpp_jax.main does)."
        )
    errs = _replica_errors(c, data)
    if errs:
        raise ConfigError("\n".join(errs))
    return data


def check_workdir(workdir) -> None:
    """A workdir must be a directory or not exist yet; a file there (or above it) is a typo.  The
    file system root, the current directory and its parents (``--config.name=..``, ``--workdir=.``)
    are refused: a run writes checkpoints/, metrics.jsonl and status.json into its workdir."""
    path = pathlib.Path(workdir)
    resolved, cwd = path.expanduser().resolve(), pathlib.Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents or resolved == pathlib.Path(resolved.anchor):
        what = ("the file system root" if resolved == pathlib.Path(resolved.anchor) else
                "the current directory" if resolved == cwd else "a parent of the current directory")
        raise ConfigError(f"--workdir={workdir} is {what} ({resolved}); a run writes its checkpoints and records "
                          "into its workdir: pass a new directory such as runs/<name> (--workdir, or config.name).")
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"--workdir={workdir}: {p} is an existing file, not a directory; pass a new "
                              "directory, or the directory of the run to resume.")


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
