"""``--dry_run``: prove a config fits its mesh without allocating the model.

Builds the same runner as training (:mod:`asyncpp_jax.train.runner`) on the config's mesh of
(fake, on CPU) devices, makes the train state and a batch as sharded ``ShapeDtypeStruct``s, and
lowers and compiles the real ``train_step``.  Reports per device: parameter, optimizer-state and
runner-state bytes (from the shardings), XLA's memory analysis of the compiled step, the
schedule's bubble fraction, and whether the step fits named accelerators.  The automatic fields
(``train.microbatches=-1``, ``train.auto_remat``) are decided against ``config.hardware``'s memory
(or ``train.device_memory_gb``) as a run on that hardware would (:mod:`asyncpp_jax.train.fit`);
a config that does not fit gets the smallest change that does, each candidate compiled here.

XLA:CPU compiles the program here; a GPU/TPU compiler fuses and lays out differently, so the
temporary-buffer figure is an estimate of the accelerator's, while the argument (state) bytes are
exact.  Where ``config.hardware`` runs a fused attention kernel (splash on a TPU, cuDNN's flash
attention on an Ampere or newer GPU; ``config.model.attention='auto'``), the program compiled here
runs splash attention through Pallas's interpreter in its place (:func:`attention_stand_in`): it is
blockwise as the fused kernels are, so the estimate holds no [T, T] score buffer.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from asyncpp_jax import configs
from asyncpp_jax.models import count_params, layers
from asyncpp_jax.models.flops import active_matmul_params, flops_per_token
from asyncpp_jax.models.moe import with_expert_parallel
from asyncpp_jax.pipeline.mpmd import memory as mpmd_memory
from asyncpp_jax.pipeline.spmd import state as pipeline_state
from asyncpp_jax.pipeline.mpmd.placement import bytes_on_devices
from asyncpp_jax.train import fit
from asyncpp_jax.train import runner as runner_lib
from asyncpp_jax.train import step as step_lib

ACCELERATORS_GB = {"H100 80GB": 80, "H200 141GB": 141, "TPU v5p 95GB": 95}


def _bytes_per_device(tree) -> int:
    """Bytes the fullest device holds of a tree of sharded ShapeDtypeStructs (under the mpmd
    placement the stages hold different trees)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return 0
    if all(x.sharding is not None for x in leaves):
        return max(bytes_on_devices(leaves).values())
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)


def _global_bytes(tree) -> int:
    """Bytes of a tree written once (a checkpoint holds each array once, however it is sharded)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _peak(mem) -> int:
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
               + mem.temp_size_in_bytes)


def _eval_memory(runner, state) -> dict:
    """Compile the eval step on the same mesh: its temporaries come on top of the resident state."""
    c = runner.config
    if runner.mpmd:  # each stage's forward program on top of what that stage holds
        temps = mpmd_memory.eval_memory(runner.eval_step(), runner.train_step)
        held = mpmd_memory.stage_state_bytes(runner.train_step, state)
        return {"eval_temp_bytes": max(temps), "eval_peak_bytes_per_device": max(map(sum, zip(held, temps)))}
    rows = c.train.global_batch_size // c.train.microbatches * runner.eval_group()
    batch = jax.ShapeDtypeStruct((rows, c.data.seq_len + 1), jnp.int32, sharding=step_lib.eval_sharding(runner.mesh))
    mem = runner.eval_step().lower(state.params, batch).compile().memory_analysis()
    if mem is None:
        return {}
    return {"eval_temp_bytes": int(mem.temp_size_in_bytes),
            "eval_peak_bytes_per_device": _bytes_per_device(state) + int(mem.temp_size_in_bytes)}


def _stash_bytes(runner) -> dict:
    """Per device, the stash under each ``pipeline.recompute`` setting (shapes only): the depth the
    schedule's slot plan derives (``interleaved``: an entry holds one chunk's input, or its
    residuals, ``1/v`` of a stage's; ``zb-h1``: with its ``save`` ring, what each ``I`` keeps for
    its ``W``; a flushless program's entries are kept across steps, in the state)."""
    c = runner.config
    if not runner.pipelined or runner.mpmd:  # mpmd: each stage's stash is in its own line
        return {}
    out = {}
    b = c.train.global_batch_size // c.train.microbatches // runner.data_size
    model = with_expert_parallel(c.model, "data", runner.data_size) if c.mesh.expert_parallel else c.model
    options = runner.options
    v, split = options.chunks, options.plan.split

    def entry_bytes(recompute, ring="stash"):
        entry = pipeline_state.ring_shapes(model, runner.mesh, runner.shapes, b, c.data.seq_len, recompute,
                                           options.expert_parallel, options.stage_rows, split, ring)
        return sum(int(np.prod(e.shape)) * jnp.dtype(e.dtype).itemsize for e in entry)

    for recompute in (True, False):
        per_entry = entry_bytes(recompute)
        plan = dataclasses.replace(options, recompute=recompute).plan
        total = plan.depth["stash"] * per_entry // (1 if recompute else v)
        if split:  # what each I keeps for its W: every leaf call's input and output cotangent
            total += plan.depth["save"] * entry_bytes(recompute, "save")
        out["recompute" if recompute else "keep_residuals"] = total
    return out


def _vocab_bytes(runner, state) -> dict:
    """Per device, what the vocabulary-sized tensors (embedding, head: a dimension of ``vocab_size``)
    cost under the pipeline engine: bytes in the state (params, optimizer state, runner state: the
    2bw weight version and partial gradient), and an estimate of the step's own (the float32
    gradient accumulators, one per batch in flight and table, and each weight version's
    ``compute_dtype`` cast).  Whole on every stage (though only stage 0 reads the embedding and
    only stage ``P-1`` the head), or ``1/P`` of each on every stage with
    ``config.pipeline.vocab_parallel``."""
    c = runner.config
    if not runner.pipelined:
        return {}
    vocab = c.model.vocab_size
    is_vocab = lambda x: vocab in x.shape  # noqa: E731
    held = {name: _bytes_per_device([x for x in jax.tree.leaves(tree) if is_vocab(x)])
            for name, tree in (("params", state.params), ("optimizer", state.opt_state),
                               ("runner_state", state.runner_state))}
    tables = [x for x in jax.tree.leaves(state.params) if is_vocab(x)]
    elements = sum(int(np.prod(x.shape)) for x in tables)
    if runner.mpmd and not c.model.tie_embeddings:  # each end stage holds one of the two tables
        elements //= 2
    versions = 1 + runner.options.delay  # the weight versions a step reads (2bw: 2; pipedream: P)
    compute = jnp.dtype(c.model.compute_dtype).itemsize
    casts = versions * elements * compute if compute != tables[0].dtype.itemsize else 0
    step = versions * elements * 4 + casts
    vocab_parallel = runner.options.vocab_parallel
    if vocab_parallel:  # every per-device figure is of one block of the vocabulary
        step //= c.pipeline.stages
    out = {**held, "step_estimate": step, "total": sum(held.values()) + step, "vocab_size": vocab,
           "stages": c.pipeline.stages, "vocab_parallel": vocab_parallel}
    if runner.mpmd:  # what each stage holds (with the step's share where it holds a table)
        per = bytes_on_devices([x for x in jax.tree.leaves(state) if is_vocab(x)])
        held_s = [per.get(runner.mesh.devices[0, s].id, 0) for s in range(c.pipeline.stages)]
        out["per_stage"] = [b + (step if b else 0) for b in held_s]
    return out


def _layer_padding(runner) -> dict:
    """What an uneven ``config.pipeline.stage_layers`` costs: the layer stack held as ``P * Lmax``
    rows for ``L`` layers, ``(P Lmax - L) / L`` more (params; the optimizer moments, the ``2bw``
    weight version and partial gradient alike).  Per device it is no more than the largest stage."""
    if runner.stage_rows is None:
        return {}
    layer_bytes = lambda t: sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize  # noqa: E731
                                for x in jax.tree.leaves(t["layers"]))
    real, padded = layer_bytes(runner.model_shapes), layer_bytes(runner.shapes)
    return {"stage_rows": list(runner.stage_rows), "fraction": (padded - real) / real,
            "param_bytes_total": padded - real}


def attention_stand_in(c) -> str:
    """The attention kernel compiled here for ``c``'s memory: interpreted splash where
    ``config.hardware`` runs a fused kernel, so that no [T, T] buffer is counted that the
    accelerator never holds (:func:`asyncpp_jax.models.layers.memory_stand_in`)."""
    platform, cuda_flash = configs.HARDWARE_PLATFORM[c.hardware]
    m = c.model
    return layers.memory_stand_in(m.attention, platform, c.data.seq_len, m.compute_dtype, layers.head_dim(m),
                                  cuda_flash)


def measure(c, devices, budget: int | None) -> fit.Measurement:
    """Lower and compile ``c``'s train step on ``devices`` from abstract shapes; the eval step too
    unless the train step alone is already over ``budget``."""
    runner = runner_lib.build(c, devices)
    state = runner.abstract_state(jax.random.key(c.seed))
    if runner.mpmd:
        return _measure_stages(runner, state)
    M, B = c.train.microbatches, c.train.global_batch_size
    batch = jax.ShapeDtypeStruct((M, B // M, c.data.seq_len + 1), jnp.int32, sharding=runner.batch_sharding())
    t0 = time.perf_counter()
    lowered = runner.train_step.lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    if mem is not None:
        train_peak = _peak(mem)
    else:
        train_peak = sum(_bytes_per_device(x) for x in (state.params, state.opt_state, state.runner_state))
    detail = {"runner": runner, "state": state, "mem": mem, "lower_seconds": t1 - t0, "compile_seconds": t2 - t1}
    m = fit.Measurement(int(train_peak), None, detail)
    if budget is None or train_peak <= budget:
        _add_eval(m)
    return m


def _measure_stages(runner, state) -> fit.Measurement:
    """The mpmd placement: each stage's peak from its own compiled programs
    (:mod:`asyncpp_jax.pipeline.mpmd.memory`); the step's peak is the fullest stage's."""
    t0 = time.perf_counter()
    stages = mpmd_memory.train_memory(runner.train_step, state)
    t1 = time.perf_counter()
    detail = {"runner": runner, "state": state, "mem": None, "lower_seconds": 0.0, "compile_seconds": t1 - t0,
              "stages": stages}
    m = fit.Measurement(max(st["peak"] for st in stages), None, detail)
    _add_eval(m)
    return m


def _add_eval(m: fit.Measurement) -> None:
    m.detail["eval"] = _eval_memory(m.detail["runner"], m.detail["state"])
    m.eval_peak = m.detail["eval"].get("eval_peak_bytes_per_device", 0)


def dry_run(c, devices=None, spare_devices=None) -> dict:
    """Report on ``c`` (its automatic fields decided against ``config.hardware``'s memory, or
    ``train.device_memory_gb``) compiled on ``devices``; when it does not fit, the smallest change
    that does, compiled on up to ``spare_devices`` (default: ``devices``)."""
    devices = list(devices if devices is not None else jax.devices())
    pool = list(spare_devices) if spare_devices is not None else devices
    budget = fit.budget_bytes(c, dry_run=True)

    def measure_candidate(cfg):
        n = len(devices) if cfg.mesh.data == -1 else configs.devices_needed(cfg)
        stand_in = fit.with_fields(cfg, model__attention=attention_stand_in(cfg))
        return measure(stand_in, pool[:n] if n > len(devices) else devices, budget)

    decision = fit.decide(c, measure_candidate, budget)
    suggestion = [] if decision.fits else fit.suggest(decision, max_devices=len(pool))
    c, m = decision.config, decision.measurement
    if m.eval_peak is None:
        _add_eval(m)
    runner, state, mem = m.detail["runner"], m.detail["state"], m.detail["mem"]
    table = runner.schedule_plan()
    report = {
        "config": c.name,
        "mesh": dict(runner.mesh.shape),
        "devices": int(runner.mesh.devices.size),
        "params_total": count_params(runner.model_shapes),
        "layer_padding": _layer_padding(runner),
        "params_active_matmul": active_matmul_params(c.model),
        "model_flops_per_token": flops_per_token(c.model, c.data.seq_len),
        "param_bytes_per_device": _bytes_per_device(state.params),
        "optimizer_bytes_per_device": _bytes_per_device(state.opt_state),
        "runner_state_bytes_per_device": _bytes_per_device(state.runner_state),
        "param_bytes_total": _global_bytes(state.params),
        "checkpoint_bytes": _global_bytes(state),
        "stash_bytes_per_device": _stash_bytes(runner),
        "stage_bytes": m.detail.get("stages", []),
        "vocab_bytes_per_device": _vocab_bytes(runner, state),
        "bubble_fraction": 0.0 if table is None else 1.0 - table.useful_fraction(),
        "lower_seconds": m.detail["lower_seconds"],
        "compile_seconds": m.detail["compile_seconds"],
        "hardware": c.hardware,
        "attention": c.model.attention,
        "attention_memory_stand_in": attention_stand_in(c),
        "budget_bytes_per_device": decision.budget,
        "microbatches": c.train.microbatches,
        "remat": bool(c.model.remat),
        "decision": decision.describe(),
        "compiles": decision.search.compiles if decision.search else 0,
        "fits_budget": decision.fits,
        "suggestion": suggestion,
    }
    if mem is not None:
        report.update(
            xla_argument_bytes=int(mem.argument_size_in_bytes),
            xla_output_bytes=int(mem.output_size_in_bytes),
            xla_alias_bytes=int(mem.alias_size_in_bytes),
            xla_temp_bytes=int(mem.temp_size_in_bytes),
        )
    report["train_peak_bytes_per_device"] = int(m.train_peak)
    report.update(m.detail["eval"])
    peak = m.peak
    report["peak_bytes_per_device"] = int(peak)
    report["fits"] = {name: peak <= gb * 1e9 for name, gb in ACCELERATORS_GB.items()}
    return report


def _vocab_placement(v: dict, gb) -> str:
    """Which stages hold the tables, which read them, and what that costs each one."""
    if v.get("per_stage"):
        per, last = v["per_stage"], v["stages"] - 1
        middle = f"; stages 1-{last - 1} hold {gb(max(per[1:last]))}" if last > 1 else ""
        return (f"    only where they are used (config.pipeline.placement='mpmd'): stage 0 holds {gb(per[0])} (the "
                f"embedding), stage {last} {gb(per[last])} (the head){middle}")
    if v.get("vocab_parallel"):
        return (f"    split over the vocabulary (config.pipeline.vocab_parallel=True): every stage holds 1/{v['stages']} "
                f"of each table, {gb(v['total'])}, and computes 1/{v['stages']} of the lookup and the head")
    middle = (f"stages 1-{v['stages'] - 2} hold {gb(v['total'])} each that they never read"
              if v["stages"] > 2 else "every stage reads one of them")
    return (f"    on every stage: stage 0 reads the embedding, stage {v['stages'] - 1} the head; {middle} "
            f"(config.pipeline.vocab_parallel=True splits them: 1/{v['stages']} on each stage)")


def format_report(r: dict) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    lines = [
        f"dry run of {r['config']}: mesh {r['mesh']} ({r['devices']} devices)",
        f"  parameters: {r['params_total']:,} total, {r['params_active_matmul']:,} in a token's matmuls; "
        f"{r['model_flops_per_token']:.3g} model FLOPs/token",
        f"  per device: params {gb(r['param_bytes_per_device'])}, optimizer state "
        f"{gb(r['optimizer_bytes_per_device'])}, runner state (weight versions, stash, buffers) "
        f"{gb(r['runner_state_bytes_per_device'])}",
    ]
    if "xla_temp_bytes" in r:
        lines.append(f"  XLA memory analysis (per device): arguments {gb(r['xla_argument_bytes'])}, outputs "
                     f"{gb(r['xla_output_bytes'])}, aliased {gb(r['xla_alias_bytes'])}, temporaries "
                     f"{gb(r['xla_temp_bytes'])}")
    params = r["param_bytes_per_device"]
    lines.append(f"  in-flight state per device {gb(r['runner_state_bytes_per_device'])} = "
                 f"{r['runner_state_bytes_per_device'] / params:.2f}x the params on a device; checkpoint "
                 f"{gb(r['checkpoint_bytes'])} = {r['checkpoint_bytes'] / r['param_bytes_total']:.2f}x the params")
    if r.get("layer_padding"):
        pad = r["layer_padding"]
        lines.append(f"  uneven split: config.pipeline.stage_layers pads the layer stack ({pad['stage_rows']} rows "
                     f"per stage) by {pad['fraction']:.0%}: {gb(pad['param_bytes_total'])} more params over the mesh,")
        lines.append("    as much again per optimizer moment (and 2bw weight version); per device no more than the "
                     "largest stage; padded layers compute nothing")
    if r.get("vocab_bytes_per_device"):
        v = r["vocab_bytes_per_device"]
        lines.append(f"  vocabulary-sized tensors (a dimension of {v['vocab_size']:,}) per device: params "
                     f"{gb(v['params'])}, optimizer state {gb(v['optimizer'])}, runner state {gb(v['runner_state'])}, "
                     f"about {gb(v['step_estimate'])} more in the step (float32 accumulators, compute-dtype casts)")
        lines.append(_vocab_placement(v, gb))
    for st in r.get("stage_bytes", []):
        lines.append(f"  stage {st['stage']}: peak {gb(st['peak'])} = state {gb(st['state'])} + accumulators "
                     f"{gb(st['accumulators'])} + stash {gb(st['stash'])} + in transit {gb(st['transit'])} + "
                     f"temporaries {gb(st['temporaries'])} (its largest compiled program)")
    if r["stash_bytes_per_device"]:
        st = r["stash_bytes_per_device"]
        lines.append(f"  stash per device: {gb(st['recompute'])} with config.pipeline.recompute=True, "
                     f"{gb(st['keep_residuals'])} with False")
    if "eval_peak_bytes_per_device" in r:
        lines.append(f"  train step peak {gb(r['train_peak_bytes_per_device'])}; eval step peak (state resident "
                     f"+ eval temporaries) {gb(r['eval_peak_bytes_per_device'])}")
    lines.append(f"  peak estimate per device: {gb(r['peak_bytes_per_device'])}; schedule bubble "
                 f"{r['bubble_fraction']:.0%}; lowered in {r['lower_seconds']:.0f} s, compiled in "
                 f"{r['compile_seconds']:.0f} s")
    lines.append("  fits: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["fits"].items()))
    lines.append(f"  target config.hardware={r['hardware']!r}, budget {gb(r['budget_bytes_per_device'])} per device: "
                 f"{r['decision']}")
    if "attention" in r:
        lines.append(f"  attention: config.model.attention={r['attention']!r}, its memory compiled here as "
                     f"{r['attention_memory_stand_in']!r}" + (" (blockwise, no [T, T] scores)"
                                                             if r["attention_memory_stand_in"] == "splash" else ""))
    if not r["fits_budget"]:
        if r["suggestion"]:
            lines.append("  DOES NOT FIT; smallest change that fits (each compiled to check): "
                         + " ".join(f"--{s}" for s in r["suggestion"]))
        else:
            lines.append("  DOES NOT FIT, and neither do more microbatches, remat, or 2x/4x data or pipeline "
                         "parallelism; lower config.train.global_batch_size or config.data.seq_len")
    return "\n".join(lines)
