"""Hugging Face Llama checkpoints in and out of the dense model's parameters.

A Hugging Face Llama directory (what ``LlamaForCausalLM.save_pretrained`` writes, and what
SmolLM2's model repositories hold) is ``config.json`` plus the weights in the safetensors format:
one ``model.safetensors``, or shards listed by ``model.safetensors.index.json``.

**The mapping.**  :class:`asyncpp_jax.models.dense.Decoder` computes exactly ``LlamaForCausalLM``
(the half-split RoPE of :func:`asyncpp_jax.models.layers.rope` is HF's ``rotate_half`` convention,
with the same ``inv_freq = theta^(-2i/d)``; query head ``h`` reads K/V head ``h // (n_heads /
n_kv_heads)`` as HF's ``repeat_kv``; RMSNorm scales after normalising in fp32).  HF checkpoints are
already in HF's rotate-half layout (the permutation in HF's ``convert_llama_weights_to_hf.py``
turns Meta's interleaved layout into it), so no q/k permutation is needed here, only transposes:
a ``torch.nn.Linear`` weight is ``[out, in]`` and a Flax ``Dense`` kernel ``[in, out]``::

    model.embed_tokens.weight                      [V, D]       embed/embedding            [V, D]
    model.layers.{i}.input_layernorm.weight        [D]          layers/attn_norm/scale     [L, D]
    model.layers.{i}.self_attn.q_proj.weight       [H hd, D]    layers/attn/q/kernel       [L, D, H hd]  (.T)
    model.layers.{i}.self_attn.k_proj.weight       [K hd, D]    layers/attn/k/kernel       [L, D, K hd]  (.T)
    model.layers.{i}.self_attn.v_proj.weight       [K hd, D]    layers/attn/v/kernel       [L, D, K hd]  (.T)
    model.layers.{i}.self_attn.o_proj.weight       [D, H hd]    layers/attn/o/kernel       [L, H hd, D]  (.T)
    model.layers.{i}.post_attention_layernorm.weight [D]        layers/mlp_norm/scale      [L, D]
    model.layers.{i}.mlp.gate_proj.weight          [F, D]       layers/mlp/gate/kernel     [L, D, F]     (.T)
    model.layers.{i}.mlp.up_proj.weight            [F, D]       layers/mlp/up/kernel       [L, D, F]     (.T)
    model.layers.{i}.mlp.down_proj.weight          [D, F]       layers/mlp/down/kernel     [L, F, D]     (.T)
    model.norm.weight                              [D]          final_norm/scale           [D]
    lm_head.weight                                 [V, D]       lm_head/kernel             [D, V]        (.T; untied only)

With ``tie_word_embeddings`` the head is the embedding table; a checkpoint that still stores
``lm_head.weight`` then has it ignored.

**Memory.**  The ``safetensors`` package reads and writes the files.  Reading opens each file
with ``safe_open`` (memory-mapped) and reads one tensor at a time into its destination, so loading
costs the parameters themselves plus one tensor in flight, never a second copy of the file.
Writing builds one file at a time (``safetensors``' writer takes a file's tensors together), so
a directory is split into shards of at most :data:`SHARD_BYTES` (with an index, as
``save_pretrained`` writes): the parameters plus one shard.  ``bfloat16`` and ``float16``
tensors widen to the model's ``float32`` exactly; other dtypes are refused.

NumPy and ``safetensors`` (and ``ml_dtypes`` for bfloat16, a JAX dependency); only
:func:`params_initializer` touches JAX.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable

import numpy as np

from asyncpp_jax.configs import ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# (our path under ``layers``, HF name after ``model.layers.{i}.``, transposed)
LAYER_TENSORS = (
    (("attn_norm", "scale"), "input_layernorm.weight", False),
    (("attn", "q", "kernel"), "self_attn.q_proj.weight", True),
    (("attn", "k", "kernel"), "self_attn.k_proj.weight", True),
    (("attn", "v", "kernel"), "self_attn.v_proj.weight", True),
    (("attn", "o", "kernel"), "self_attn.o_proj.weight", True),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", False),
    (("mlp", "gate", "kernel"), "mlp.gate_proj.weight", True),
    (("mlp", "up", "kernel"), "mlp.up_proj.weight", True),
    (("mlp", "down", "kernel"), "mlp.down_proj.weight", True),
)
# (our path, HF name, transposed); lm_head only when the embeddings are untied
TOP_TENSORS = (
    (("embed", "embedding"), "model.embed_tokens.weight", False),
    (("final_norm", "scale"), "model.norm.weight", False),
    (("lm_head", "kernel"), "lm_head.weight", True),
)
# Buffers some older checkpoints store beside the weights; recomputed by every implementation.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
ARCHITECTURE = "LlamaForCausalLM"


class HFCheckpointError(ConfigError):
    """A Hugging Face checkpoint that does not fit the model (or is not one); the message says why
    (a :class:`~asyncpp_jax.configs.ConfigError`: the command line reports it in one line)."""


# ---------------------------------------------------------------------------------------------
# safetensors files, through the safetensors package

# What widens exactly into the model's float32 parameters.
_LOSSLESS_INTO_F32 = ("F32", "BF16", "F16")
# Largest file the writer builds in memory: safetensors' writer takes a whole file's tensors at once.
SHARD_BYTES = 1 << 30


class SafetensorsFile:
    """One safetensors file opened with ``safetensors.safe_open`` (memory-mapped): names, shapes and
    dtypes from its header; :meth:`tensor` reads one tensor."""

    def __init__(self, path: str):
        from safetensors import SafetensorError, safe_open  # pylint: disable=import-outside-toplevel

        self.path = path
        try:
            self._file = safe_open(path, framework="numpy")
        except (SafetensorError, OSError) as e:
            raise HFCheckpointError(f"{path} is not a safetensors file ({e})") from e
        self.metadata = self._file.metadata() or {}

    def names(self) -> list[str]:
        return list(self._file.keys())

    def dtype_name(self, name: str) -> str:
        return self._file.get_slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    def tensor(self, name: str) -> np.ndarray:
        return self._file.get_tensor(name)


def write_safetensors(path: str, tensors: list[tuple[str, tuple, np.dtype, Callable[[], np.ndarray]]],
                      metadata: dict | None = None) -> None:
    """Write ``(name, shape, dtype, make)`` tensors to one file with ``safetensors.numpy.save_file``
    (each made by ``make()``; the file's tensors are held together while it is written: see
    :func:`write_directory` for the bound).  ``__metadata__`` ``{'format': 'pt'}`` is what
    ``transformers`` expects of a PyTorch checkpoint."""
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

    made = {}
    for name, shape, dtype, make in tensors:
        x = np.ascontiguousarray(make()).astype(dtype, copy=False)
        if x.shape != tuple(shape):
            raise ValueError(f"tensor {name!r}: made shape {x.shape}, declared {tuple(shape)}")
        made[name] = x
    tmp = path + ".tmp"
    save_file(made, tmp, metadata={"format": "pt", **(metadata or {})})
    os.replace(tmp, path)


def write_directory(directory: str, tensors: list[tuple[str, tuple, np.dtype, Callable[[], np.ndarray]]],
                    config: dict, max_shard_bytes: int = SHARD_BYTES) -> list[str]:
    """``config.json`` and the tensors as ``model.safetensors``, or, past ``max_shard_bytes``, as
    ``model-0000k-of-0000n.safetensors`` shards listed by ``model.safetensors.index.json`` (as
    ``save_pretrained`` shards).  Tensors are made one shard at a time, so writing holds at most
    one shard (or one tensor larger than a shard) beside the caller's parameters.  Returns the
    weight files written."""
    os.makedirs(directory, exist_ok=True)
    shards, size = [[]], 0
    for t in tensors:
        nbytes = math.prod(t[1]) * np.dtype(t[2]).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    names = ([WEIGHTS_FILE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for name, shard in zip(names, shards):
        write_safetensors(os.path.join(directory, name), shard)
    if len(shards) > 1:
        total = sum(math.prod(t[1]) * np.dtype(t[2]).itemsize for t in tensors)
        index = {"metadata": {"total_size": total},
                 "weight_map": {t[0]: name for name, shard in zip(names, shards) for t in shard}}
        with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return names


# ---------------------------------------------------------------------------------------------
# A Hugging Face directory


class HFCheckpoint:
    """A local Hugging Face model directory opened for reading: ``config`` (``config.json``) and
    every tensor of its safetensors file(s) by name, memory-mapped."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(os.path.expanduser(directory))
        cfg_path = os.path.join(self.directory, CONFIG_FILE)
        if not os.path.isfile(cfg_path):
            raise HFCheckpointError(f"{self.directory} has no {CONFIG_FILE}: not a Hugging Face model directory "
                                    "(config.model.init_from='hf:DIR' wants a directory as save_pretrained writes it).")
        with open(cfg_path, encoding="utf-8") as f:
            self.config = json.load(f)
        index = os.path.join(self.directory, INDEX_FILE)
        single = os.path.join(self.directory, WEIGHTS_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = {name: os.path.join(self.directory, fn) for name, fn in weight_map.items()}
        elif os.path.isfile(single):
            files = None
        else:
            have = sorted(os.listdir(self.directory))
            raise HFCheckpointError(
                f"{self.directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE} (it holds {have}); only the "
                "safetensors format is read (convert a pytorch_model.bin with transformers' save_pretrained "
                "(safe_serialization=True)).")
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        for path in sorted(set(files.values())) if files else [single]:
            if not os.path.isfile(path):
                raise HFCheckpointError(f"{INDEX_FILE} in {self.directory} lists {os.path.basename(path)}, which is missing")
            sf = self._files[path] = SafetensorsFile(path)
            for name in sf.names():
                self._where[name] = path
        if files:
            missing = sorted(n for n, p in files.items() if self._where.get(n) != p)
            if missing:
                raise HFCheckpointError(f"{INDEX_FILE} in {self.directory} lists tensors its shards do not hold: {missing[:5]}")

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> str:
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._where[name]].shape(name)

    def dtype_name(self, name: str) -> str:
        return self._files[self._where[name]].dtype_name(name)

    def tensor(self, name: str) -> np.ndarray:
        return self._files[self._where[name]].tensor(name)


# ---------------------------------------------------------------------------------------------
# config.json <-> config.model

# config.model field -> (config.json key, default when the key is absent, as LlamaConfig has it)
_CONFIG_FIELDS = (
    ("vocab_size", "vocab_size", 32000),
    ("d_model", "hidden_size", 4096),
    ("n_layers", "num_hidden_layers", 32),
    ("n_heads", "num_attention_heads", 32),
    ("d_ff", "intermediate_size", 11008),
    ("norm_eps", "rms_norm_eps", 1e-6),
    ("tie_embeddings", "tie_word_embeddings", False),
)


def _rope_theta(hf: dict) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    return float((hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def model_overrides(hf: dict) -> dict:
    """The ``config.model`` fields a Hugging Face Llama ``config.json`` fixes (checked by
    :func:`architecture_errors` first): ``{'vocab_size': ..., 'd_model': ..., ...}``."""
    out = {field: type(default)(default if hf.get(key) is None else hf[key]) for field, key, default in _CONFIG_FIELDS}
    out["n_kv_heads"] = int(hf.get("num_key_value_heads") or out["n_heads"])
    hd = hf.get("head_dim")
    out["head_dim"] = 0 if not hd or int(hd) * out["n_heads"] == out["d_model"] else int(hd)
    out["rope_theta"] = _rope_theta(hf)
    return out


def architecture_errors(hf: dict, where: str) -> list[str]:
    """What in a ``config.json`` this model cannot compute (each a message naming the key)."""
    errs = []
    arch = hf.get("architectures") or [ARCHITECTURE]
    if hf.get("model_type", "llama") != "llama" or ARCHITECTURE not in arch:
        errs.append(f"{where}: model_type={hf.get('model_type')!r}, architectures={arch}; only Llama-family "
                    f"checkpoints (model_type 'llama', {ARCHITECTURE}) map onto the dense model.")
    if hf.get("hidden_act", "silu") != "silu":
        errs.append(f"{where}: hidden_act={hf['hidden_act']!r}; the dense model's MLP is SwiGLU (silu).")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            errs.append(f"{where}: {key}=true; the dense model has no biases.")
    scaling = hf.get("rope_scaling") or {}
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        errs.append(f"{where}: RoPE scaling {scaling or hf.get('rope_parameters')} (rope_type {rope_type!r}); the dense "
                    "model implements plain RoPE (rope_type 'default') only.")
    if hf.get("rope_interleaved"):  # a nanotron key SmolLM2's config.json carries (false there)
        errs.append(f"{where}: rope_interleaved=true; the dense model (and transformers' Llama) rotate halves, "
                    "not interleaved pairs.")
    if int(hf.get("pretraining_tp", 1) or 1) != 1:
        errs.append(f"{where}: pretraining_tp={hf['pretraining_tp']}; only 1 is supported.")
    return errs


def _effective(model_cfg) -> dict:
    m = {k: model_cfg[k] for k, _, _ in _CONFIG_FIELDS}
    m.update(n_kv_heads=model_cfg.n_kv_heads, rope_theta=float(model_cfg.rope_theta),
             head_dim=model_cfg.head_dim or 0)
    if m["head_dim"] and m["head_dim"] * model_cfg.n_heads == model_cfg.d_model:
        m["head_dim"] = 0
    return m


def config_errors(model_cfg, hf: dict, where: str) -> list[str]:
    """Every way ``config.model`` differs from the ``config.json`` at ``where``, each with the flag
    that fixes it (``--config.model.d_model=576``), plus what the model cannot compute at all."""
    errs = architecture_errors(hf, where)
    if model_cfg.get("moe") and model_cfg.moe.num_experts:
        errs.append("config.model.moe.num_experts > 0: a Hugging Face Llama checkpoint is a dense model.")
    want, have = model_overrides(hf), _effective(model_cfg)
    for field, value in want.items():
        ours = have[field]
        same = math.isclose(ours, value, rel_tol=1e-12) if isinstance(value, float) else ours == value
        if not same:
            errs.append(f"config.model.{field}={ours!r} but {where} says {value!r}: set --config.model.{field}={value!r}")
    return errs


def hf_config(model_cfg, max_position_embeddings: int, eos_token_id: int | None = None,
              bos_token_id: int | None = None, torch_dtype: str = "float32") -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` that computes ``config.model``."""
    hd = model_cfg.head_dim or model_cfg.d_model // model_cfg.n_heads
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "vocab_size": int(model_cfg.vocab_size), "hidden_size": int(model_cfg.d_model),
        "intermediate_size": int(model_cfg.d_ff), "num_hidden_layers": int(model_cfg.n_layers),
        "num_attention_heads": int(model_cfg.n_heads), "num_key_value_heads": int(model_cfg.n_kv_heads),
        "head_dim": int(hd), "hidden_act": "silu", "max_position_embeddings": int(max_position_embeddings),
        "rms_norm_eps": float(model_cfg.norm_eps), "rope_theta": float(model_cfg.rope_theta), "rope_scaling": None,
        "tie_word_embeddings": bool(model_cfg.tie_embeddings), "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "pretraining_tp": 1, "initializer_range": float(model_cfg.init_std),
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "torch_dtype": torch_dtype, "use_cache": True,
    }


# ---------------------------------------------------------------------------------------------
# Tensors <-> params


def _param_shapes(model_cfg) -> dict:
    """The model's parameter shapes as a nested dict of tuples (plain Python, no JAX)."""
    d, v, f, l = model_cfg.d_model, model_cfg.vocab_size, model_cfg.d_ff, model_cfg.n_layers
    hd = model_cfg.head_dim or d // model_cfg.n_heads
    q, kv = model_cfg.n_heads * hd, model_cfg.n_kv_heads * hd
    shapes = {
        "embed": {"embedding": (v, d)},
        "final_norm": {"scale": (d,)},
        "layers": {"attn_norm": {"scale": (l, d)}, "mlp_norm": {"scale": (l, d)},
                   "attn": {"q": {"kernel": (l, d, q)}, "k": {"kernel": (l, d, kv)}, "v": {"kernel": (l, d, kv)},
                            "o": {"kernel": (l, q, d)}},
                   "mlp": {"gate": {"kernel": (l, d, f)}, "up": {"kernel": (l, d, f)}, "down": {"kernel": (l, f, d)}}},
    }
    if not model_cfg.tie_embeddings:
        shapes["lm_head"] = {"kernel": (d, v)}
    return shapes


def _plan(model_cfg) -> list[tuple[tuple, tuple, list[tuple[str, bool]]]]:
    """``[(our path, our shape, [(HF name, transposed), ...one per stacked row])]``."""
    shapes, plan = _param_shapes(model_cfg), []
    for path, name, t in TOP_TENSORS:
        if path[0] == "lm_head" and model_cfg.tie_embeddings:
            continue
        plan.append((path, _get(shapes, path), [(name, t)]))
    for path, name, t in LAYER_TENSORS:
        rows = [(f"model.layers.{i}.{name}", t) for i in range(model_cfg.n_layers)]
        plan.append((("layers",) + path, _get(shapes, ("layers",) + path), rows))
    return plan


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


class ParamReader:
    """Reads a checkpoint into ``config.model``'s parameters, one leaf at a time.

    Construction checks everything that can be checked without reading a byte of the weights:
    ``config.json`` against ``config.model`` (:func:`config_errors`), then every tensor's presence,
    shape and dtype; the problems are reported together in one :class:`HFCheckpointError`.
    """

    def __init__(self, model_cfg, directory: str):
        self.ckpt = ckpt = HFCheckpoint(directory)
        self.model_cfg = model_cfg
        where = os.path.join(ckpt.directory, CONFIG_FILE)
        errs = config_errors(model_cfg, ckpt.config, where)
        if errs:
            raise HFCheckpointError(f"the Hugging Face checkpoint in {ckpt.directory} does not fit config.model:\n  "
                                    + "\n  ".join(errs))
        self.plan = _plan(model_cfg)
        used, errs = set(), []
        for path, shape, rows in self.plan:
            row_shape = shape[1:] if path[0] == "layers" else shape
            for name, transposed in rows:
                want = tuple(reversed(row_shape)) if transposed else row_shape
                used.add(name)
                if not ckpt.has(name):
                    errs.append(f"tensor {name!r} is missing (needed for {'/'.join(path)})")
                    continue
                got, dt = ckpt.shape(name), ckpt.dtype_name(name)
                if got != want:
                    errs.append(f"tensor {name!r} has shape {list(got)}, config.model needs {list(want)} "
                                f"(for {'/'.join(path)} {list(shape)})")
                if dt not in _LOSSLESS_INTO_F32:
                    errs.append(f"tensor {name!r} has dtype {dt}; the float32 parameters take F32, BF16 or F16 "
                                "exactly (convert the checkpoint)")
        if model_cfg.tie_embeddings:
            used.add("lm_head.weight")  # tied: a stored copy of the table is not read
        unexpected = [n for n in ckpt.names() if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
        if unexpected:
            errs.append(f"{len(unexpected)} tensor(s) the dense model has no place for, e.g. {unexpected[:4]} "
                        "(biases or another architecture?)")
        if errs:
            raise HFCheckpointError(f"the Hugging Face checkpoint in {ckpt.directory} does not fit config.model:\n  "
                                    + "\n  ".join(errs))

    def leaves(self) -> list[tuple[tuple, tuple]]:
        """``[(path, shape)]`` of every parameter leaf."""
        return [(path, shape) for path, shape, _ in self.plan]

    def read(self, path: tuple) -> np.ndarray:
        """The leaf at ``path`` as float32 (a stacked ``[L, ...]`` array for a layer leaf)."""
        _, shape, rows = next(p for p in self.plan if p[0] == tuple(path))
        out = np.empty(shape, np.float32)
        for i, (name, transposed) in enumerate(rows):
            x = self.ckpt.tensor(name)
            x = x.T if transposed else x
            if path[0] == "layers":
                out[i] = x
            else:
                out[...] = x
        return out

    def read_all(self) -> dict:
        """Every leaf as NumPy float32, in the model's layout: the host memory of the parameters."""
        params: dict = {}
        for path, _ in self.leaves():
            _set(params, path, self.read(path))
        return params


def read_params(model_cfg, directory: str) -> dict:
    """A Hugging Face Llama directory -> ``config.model``'s parameters (NumPy float32, the model's
    layout, as ``dense.init_params`` returns them)."""
    return ParamReader(model_cfg, directory).read_all()


def params_initializer(model_cfg, directory: str) -> Callable[[], dict]:
    """``init() -> params`` for use inside a jitted initialiser: each leaf comes from the
    checkpoint through its own ``jax.pure_callback``, so the jitted program holds no copy of the
    weights as constants and reads each leaf only when it runs (straight into its buffer, which
    ``out_shardings`` then places).  The checks of :class:`ParamReader` run now, at the call."""
    import jax  # pylint: disable=import-outside-toplevel

    reader = ParamReader(model_cfg, directory)

    def init() -> dict:
        params: dict = {}
        for path, shape in reader.leaves():
            leaf = jax.pure_callback(lambda p=path: reader.read(p), jax.ShapeDtypeStruct(shape, np.float32))
            _set(params, path, leaf)
        return params

    return init


def hf_tensors(model_cfg, params: dict, dtype=np.float32) -> list[tuple[str, tuple, np.dtype, Callable]]:
    """``(HF name, shape, dtype, make)`` for every tensor of the Hugging Face checkpoint of
    ``params`` (the model's layout, NumPy or anything ``np.asarray`` takes); ``make()`` builds one
    tensor, so a writer holds one at a time."""
    dtype = np.dtype(dtype)
    out = []
    for path, shape, rows in _plan(model_cfg):
        leaf = _get(params, path)
        if tuple(leaf.shape) != shape:
            raise HFCheckpointError(f"parameter {'/'.join(path)} has shape {list(leaf.shape)}, config.model says {list(shape)}")
        for i, (name, transposed) in enumerate(rows):
            row_shape = shape[1:] if path[0] == "layers" else shape
            hf_shape = tuple(reversed(row_shape)) if transposed else row_shape

            def make(leaf=leaf, i=i, transposed=transposed, layered=path[0] == "layers"):
                x = np.asarray(leaf[i] if layered else leaf)
                return np.ascontiguousarray(x.T if transposed else x, dtype=dtype)  # one copy at most

            out.append((name, hf_shape, dtype, make))
    return out


def write_checkpoint(directory: str, model_cfg, params: dict, max_position_embeddings: int,
                     eos_token_id: int | None = None, bos_token_id: int | None = None,
                     dtype: str = "float32", max_shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write ``params`` as a Hugging Face Llama directory (``config.json``, the safetensors
    weights: :func:`write_directory`); returns the weight files.

    ``dtype='float32'`` (the parameters' own) reads back bit-identically; ``'bfloat16'`` halves the
    files and rounds each weight to nearest-even."""
    np_dtype = np_dtype_of(dtype)
    cfg = hf_config(model_cfg, max_position_embeddings, eos_token_id, bos_token_id, dtype)
    return write_directory(directory, hf_tensors(model_cfg, params, np_dtype), cfg, max_shard_bytes)


def np_dtype_of(dtype: str) -> np.dtype:
    """``'float32'`` or ``'bfloat16'`` as a NumPy dtype (``ml_dtypes``' bfloat16)."""
    import ml_dtypes  # pylint: disable=import-outside-toplevel

    return {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}[dtype]
