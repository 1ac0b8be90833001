"""Every train and eval step lowers for the hardware it targets, on this CPU machine.

``jax.export`` lowers a jitted function for other platforms without their devices
(``platforms=('cuda', 'tpu')``), so an op without a GPU or TPU lowering (a CPU-only custom call, a
collective the partitioner cannot place) fails here, in CI, instead of on a lent accelerator.  The
abstract state and batch carry the real shardings, so the pipeline engine's ``shard_map`` over the
fake-device mesh lowers as a real mesh would.  Lowering only: nothing is compiled or run.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from asyncpp_jax import configs
from asyncpp_jax.train import runner as runner_lib
from asyncpp_jax.train import step as step_lib

TARGETS = ("cuda", "tpu")


def _config(optimizer="adamw", mode="2bw", stages=1, schedule="sync", moe=False, dtype="float32", mitigation="none",
            vocab_parallel=False, placement="spmd"):
    c = configs.load_file("configs/tiny.py")
    c.model.update(d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=64, compute_dtype=dtype)
    if moe:
        c.model.moe.update(num_experts=4, top_k=2, expert_d_ff=32)
    c.data.seq_len = 16
    c.train.update(global_batch_size=8, microbatches=4 if stages > 1 else 1)
    c.optimizer.name = optimizer
    if stages > 1:
        c.pipeline.update(stages=stages, schedule=schedule, vocab_parallel=vocab_parallel, placement=placement)
        if vocab_parallel:
            c.model.vocab_size = 258  # the byte vocabulary, padded to a multiple of the stages
        c.mesh.data = 2
    else:
        c.staleness.update(mode=mode, mitigation=mitigation)
    return configs.resolve(c)


CASES = {
    **{f"simulate-{opt}-2bw": dict(optimizer=opt) for opt in ("adamw", "muon", "soap", "adan", "lion", "mars")},
    "simulate-adamw-ef-bf16": dict(mitigation="ef", dtype="bfloat16"),
    "simulate-muon-pipedream": dict(optimizer="muon", mode="pipedream"),
    "engine-sync": dict(stages=2, schedule="sync"),
    "engine-2bw": dict(stages=2, schedule="2bw"),
    "engine-1f1b": dict(stages=2, schedule="1f1b"),
    "engine-interleaved": dict(stages=2, schedule="interleaved"),
    "engine-zb-h1": dict(stages=2, schedule="zb-h1"),
    "engine-2bw-moe-bf16": dict(stages=2, schedule="2bw", moe=True, dtype="bfloat16"),
    "engine-2bw-vocab-parallel-bf16": dict(stages=2, schedule="2bw", dtype="bfloat16", vocab_parallel=True),
    "engine-zb-h1-vocab-parallel": dict(stages=2, schedule="zb-h1", vocab_parallel=True),
}


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("case", sorted(CASES))
def test_train_and_eval_steps_lower_for_gpu_and_tpu(case):
    c = _config(**CASES[case])
    if c.staleness.mode == "pipedream":
        c.staleness.pipedream_stages = 2
    r = runner_lib.build(c, jax.devices())
    state = r.abstract_state(jax.random.key(0))
    rows = c.train.global_batch_size // c.train.microbatches
    batch = jax.ShapeDtypeStruct((c.train.microbatches, rows, c.data.seq_len + 1), np.int32,
                                 sharding=r.batch_sharding())
    train = jax.export.export(r.train_step, platforms=TARGETS)(state, batch)
    assert train.platforms == TARGETS and train.nr_devices == r.mesh.devices.size
    eval_rows = rows * r.eval_group()
    eval_batch = jax.ShapeDtypeStruct((eval_rows, c.data.seq_len + 1), np.int32,
                                      sharding=step_lib.eval_sharding(r.mesh))
    ev = jax.export.export(r.eval_step(), platforms=TARGETS)(state.params, eval_batch)
    assert ev.platforms == TARGETS
    # The CPU's own custom calls (LAPACK, say) have no GPU/TPU lowering: none may appear.
    for exported in (train, ev):
        text = exported.mlir_module()
        assert "lapack" not in text.lower() and "ducc" not in text.lower(), case


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("case", [dict(), dict(moe=True, dtype="bfloat16", expert_parallel=True)],
                         ids=["dense", "moe-expert-parallel-bf16"])
def test_mpmd_programs_lower_for_gpu_and_tpu(case):
    """Under config.pipeline.placement='mpmd' a step is many programs, each on its own stage's
    devices: every stage's actions, every group's reduction and update, and the eval's forwards."""
    from asyncpp_jax.pipeline.mpmd import memory as mpmd_memory

    ep = case.pop("expert_parallel", False)
    c = _config(stages=2, schedule="2bw", placement="mpmd", **case)
    c.mesh.expert_parallel = ep
    r = runner_lib.build(c, jax.devices())
    state = r.abstract_state(jax.random.key(0))
    step = r.train_step
    lowered = [p for s in range(step.n_stages) for p in mpmd_memory.stage_programs(step, s)]
    lowered += [p for progs in mpmd_memory.update_programs(step, state).values() for p in progs]
    lowered += mpmd_memory.eval_programs(r.eval_step(), step)
    assert len(lowered) >= 3 + 2 * 2 + 2  # 2 stages' actions, 2 groups or more, 2 stages' eval
    for name, fn, args in lowered:
        exported = jax.export.export(fn, platforms=TARGETS)(*args)
        assert exported.platforms == TARGETS, name
        text = exported.mlir_module()
        assert "lapack" not in text.lower() and "ducc" not in text.lower(), name


# ---------------------------------------------------------------------------------------------
# The attention kernel (config.model.attention) in the lowered step


def _attention_config(attention: str, seq_len: int = 128, **kw):
    c = _config(**kw)
    c.model.attention = attention
    c.data.seq_len = seq_len
    configs.validate(c)
    return c


def _tpu_modules(c) -> dict:
    """The MLIR text of ``c``'s train step and eval step exported for ``tpu`` (abstract shapes)."""
    r = runner_lib.build(c, jax.devices())
    state = r.abstract_state(jax.random.key(0))
    rows = c.train.global_batch_size // c.train.microbatches
    batch = jax.ShapeDtypeStruct((c.train.microbatches, rows, c.data.seq_len + 1), np.int32,
                                 sharding=r.batch_sharding())
    out = {"train": jax.export.export(r.train_step, platforms=("tpu",))(state, batch).mlir_module()}
    if not r.mpmd:
        eval_batch = jax.ShapeDtypeStruct((rows * r.eval_group(), c.data.seq_len + 1), np.int32,
                                          sharding=step_lib.eval_sharding(r.mesh))
        out["eval"] = jax.export.export(r.eval_step(), platforms=("tpu",))(state.params, eval_batch).mlir_module()
    return out


SPLASH_RUNNERS = {
    "simulate": dict(),
    "engine-sync": dict(stages=2, schedule="sync"),
    "engine-2bw": dict(stages=2, schedule="2bw"),
}


# Two of the six in the default suite (each exports a train and an eval step); the rest under -m slow.
SPLASH_DEFAULT = {("simulate", "auto"), ("engine-2bw", "splash")}


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("case, attention", [
    pytest.param(case, attention, id=f"{case}-{attention}",
                 marks=() if (case, attention) in SPLASH_DEFAULT else (pytest.mark.slow,))
    for case in sorted(SPLASH_RUNNERS) for attention in ("splash", "auto")])
def test_splash_kernel_is_in_the_step_exported_for_tpu(case, attention):
    """``splash`` and ``auto`` put Pallas's splash kernel (a ``tpu_custom_call``) into the train
    and eval steps of every runner lowered for ``tpu``; the einsum path puts none there."""
    for what, text in _tpu_modules(_attention_config(attention, **SPLASH_RUNNERS[case])).items():
        assert "tpu_custom_call" in text, (case, attention, what)


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("attention, seq_len", [("xla", 128), pytest.param("auto", 16, marks=pytest.mark.slow)],
                         ids=["xla", "auto-off-block"])
def test_no_tpu_kernel_without_splash(attention, seq_len):
    """The einsum path, and ``auto`` at a length splash's blocks do not divide (it then runs
    ``dot_product``, XLA's attention on a TPU), lower without the kernel."""
    for what, text in _tpu_modules(_attention_config(attention, seq_len)).items():
        assert "tpu_custom_call" not in text, (attention, what)


@pytest.mark.needs_devices(4)
def test_splash_kernel_in_every_mpmd_stage_program():
    """Under the mpmd placement each stage's programs that run its layers hold the kernel."""
    from asyncpp_jax.pipeline.mpmd import memory as mpmd_memory

    c = _attention_config("splash", stages=2, schedule="2bw", placement="mpmd")
    r = runner_lib.build(c, jax.devices())
    step = r.train_step
    for s in range(step.n_stages):
        texts = [jax.export.export(fn, platforms=("tpu",))(*args).mlir_module()
                 for _, fn, args in mpmd_memory.stage_programs(step, s)]
        assert any("tpu_custom_call" in t for t in texts), s


def _without_locations(text: str) -> str:
    return "\n".join(re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", line) for line in text.splitlines()
                     if not line.startswith("#loc"))


def test_tpu_splash_kernel_is_the_causal_one_on_q_k_v():
    """The tpu module of ``attend(..., 'splash')`` is, op for op, that of Pallas's splash kernel
    built here from the library's ``CausalMask`` on ``(q / sqrt(d), k, v)``: a mask dropped or K
    and V swapped change the module (checked by mutation)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    from asyncpp_jax.models import layers

    b, t, n, kv, d = 2, 128, 4, 2, 16
    q = jax.ShapeDtypeStruct((b, t, n, d), np.float32)
    k = jax.ShapeDtypeStruct((b, t, kv, d), np.float32)

    def reference(q, k, v, interpret=False):
        kernel = sa.make_splash_mha(sa.MultiHeadMask([sa.CausalMask((t, t))] * n),
                                    block_sizes=sa.BlockSizes(*(128,) * 8), head_shards=1, q_seq_shards=1,
                                    interpret=interpret)
        heads_first = lambda x: x.swapaxes(1, 2)  # noqa: E731
        q = q * np.float32(1 / np.sqrt(d))
        return heads_first(jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v)))

    def reference_on_any_platform(q, k, v):  # as attend lays it out: the TPU's kernel, else interpreted
        return jax.lax.platform_dependent(q, k, v, tpu=reference, default=lambda *a: reference(*a, interpret=True))

    def export(fn):
        fn.__name__ = "attention"
        return _without_locations(jax.export.export(jax.jit(fn), platforms=("tpu",))(q, k, k).mlir_module())

    def ours(q, k, v):
        return layers.attend(q, k, v, None, "splash")

    ours = export(ours)
    assert "tpu_custom_call" in ours and ours == export(reference_on_any_platform)
