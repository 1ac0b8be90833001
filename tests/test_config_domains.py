"""Every numeric or enumerated setting has a domain, checked before JAX starts.

The table holds settings that a run would accept and then waste (a negative eps, a zero init, a
negative loss weight, ...) or crash on deep inside JAX.  Each must raise one ConfigError whose
message names the field; the coverage test makes sure no numeric field of the base config is
left without a bad value in the table.
"""

import math

import pytest

from asyncpp_jax import configs
from helpers import run_cli

NAN, INF = math.nan, math.inf

# (field, bad value, extra settings the case needs, text the message must contain besides the field)
BAD = [
    ("runner", "magic", {}, "is unknown"),
    ("hardware", "h100", {}, "is unknown"),
    ("seed", -1, {}, "[0, 4294967296)"),
    ("name", "", {}, "non-empty"),
    ("name", "..", {}, "not '.' or '..'"),  # runs/.. is the current directory itself
    # model
    ("model.vocab_size", 0, {}, ">= 1"),
    ("model.d_model", -8, {}, ">= 1"),
    ("model.n_layers", 0, {}, ">= 1"),
    ("model.n_heads", 0, {}, ">= 1"),
    ("model.n_heads", 3, {}, "does not divide"),
    ("model.n_kv_heads", -1, {}, ">= 1"),
    ("model.n_kv_heads", 3, {}, "does not divide"),
    ("model.d_ff", 0, {}, ">= 1"),
    ("model.head_dim", -2, {}, ">= 1"),
    ("model.head_dim", 3, {}, "even for RoPE"),
    ("model.rope_theta", 0.0, {}, "> 0"),
    ("model.rope_theta", NAN, {}, "finite"),
    ("model.norm_eps", -1.0, {}, "> 0"),
    ("model.norm_eps", 0.0, {}, "> 0"),
    ("model.init_std", 0.0, {}, "exactly 0"),
    ("model.init_std", NAN, {}, "finite"),
    ("model.init_std", INF, {}, "finite"),
    ("model.z_loss", -1.0, {}, ">= 0"),
    ("model.z_loss", INF, {}, "finite"),
    ("model.compute_dtype", "int8", {}, "unsupported"),
    ("model.param_dtype", "bfloat16", {}, "fp32 master"),
    ("model.attention", "flash", {}, "is unknown"),
    ("model.attention", "splash", {"data.seq_len": 200}, "multiple of 128"),
    # mixture of experts (moe_tiny base)
    ("model.moe.num_experts", 1, {}, ">= 2"),
    ("model.moe.num_experts", -4, {}, ">= 2"),
    ("model.moe.top_k", 0, {}, "[1, 8]"),
    ("model.moe.top_k", 9, {}, "[1, 8]"),
    ("model.moe.expert_d_ff", 0, {}, ">= 1"),
    ("model.moe.shared_experts", -1, {}, ">= 0"),
    ("model.moe.gating", "relu", {}, "is unknown"),
    ("model.moe.lb_loss_coef", -10.0, {}, "rewards imbalance"),
    ("model.moe.router_z_loss_coef", -1.0, {}, ">= 0"),
    ("model.moe.capacity_factor", 1e-9, {}, "less than one slot"),
    ("model.moe.capacity_factor", NAN, {}, "finite"),
    ("model.moe.capacity_factor", 1e12, {}, "more slots than"),  # its capacity would overflow int32
    ("model.moe.every", 3, {}, "dividing"),
    # data
    ("data.seq_len", 1, {}, ">= 2"),
    ("data.val_fraction", 0.0, {}, "(0, 1)"),
    ("data.val_fraction", 1.0, {}, "(0, 1)"),
    ("data.split_seed", -1, {}, ">= 0"),
    ("data.hf_max_docs", -5, {}, ">= 0"),
    ("data.source", "", {}, "is empty"),
    ("data.tokenizer", "", {}, "is empty"),
    ("data.source", "hf:", {}, "names no dataset"),
    ("data.mixture", "1:hf::x;1:stdlib", {}, "names no dataset"),
    ("data.eos_token", "</s>", {}, "the byte tokenizer's end-of-document id is always 256"),
    ("data.hf_split", "", {}, "split"),
    ("data.hf_text_field", "", {}, "text column"),
    # training loop
    ("train.accept_changed", "corpus,optimizer", {}, "tokenizer, corpus, seq_len, model"),
    ("train.steps", 0, {}, "positive integer"),
    ("train.global_batch_size", 0, {}, "positive integer"),
    ("train.microbatches", -2, {}, "positive integer"),
    ("train.microbatches", 3, {}, "not divisible"),
    ("train.eval_every", 0, {}, "positive integer"),
    ("train.eval_batches", -1, {}, "positive integer"),
    ("train.test_batches", -1, {}, ">= 0"),
    ("train.log_every", 0, {}, "positive integer"),
    ("train.checkpoint_every", 0, {}, "positive integer"),
    ("train.keep_checkpoints", 0, {}, "positive integer"),
    ("train.peak_tflops_per_device", -1.0, {}, ">= 0"),
    ("train.device_memory_gb", -1.0, {}, ">= 0"),
    ("train.device_memory_gb", float("nan"), {}, "finite"),
    ("train.profile_start", -1, {}, "non-negative integer"),
    ("train.profile_steps", 2, {"train.steps": 5, "train.profile_start": 4}, "runs past config.train.steps=5"),
    # optimizer
    ("optimizer.name", "sgdx", {}, "is unknown"),
    ("optimizer.schedule", "step", {}, "is unknown"),
    ("optimizer.lr", -1.0, {}, "positive finite"),
    ("optimizer.lr", 0.0, {}, "positive finite"),
    ("optimizer.lr", NAN, {}, "positive finite"),
    ("optimizer.weight_decay", -0.1, {}, ">= 0"),
    ("optimizer.grad_clip", -1.0, {}, ">= 0"),
    ("optimizer.min_lr_ratio", 1.5, {}, "[0, 1]"),
    ("optimizer.wsd_decay_fraction", 0.0, {}, "(0, 1]"),
    ("optimizer.warmup_steps", -1, {}, ">= 0"),
    ("optimizer.warmup_steps", 10_000, {}, "below config.train.steps"),
    ("optimizer.adamw_pattern", "(", {}, "regular expression"),
    ("optimizer.adamw.b1", 1.0, {}, "[0, 1)"),
    ("optimizer.adamw.b2", -0.1, {}, "[0, 1)"),
    ("optimizer.adamw.eps", -1.0, {}, "> 0"),
    ("optimizer.adamw.eps", 0.0, {}, "> 0"),
    ("optimizer.muon.mu", 1.5, {}, "[0, 1)"),
    ("optimizer.muon.ns_steps", 0, {}, "positive integer"),
    ("optimizer.muon.ns_steps", 100_000, {}, "at most 50"),  # unrolled at trace time: never compiles
    ("optimizer.muon.scaling", "other", {}, "is unknown"),
    ("optimizer.soap.b1", NAN, {}, "[0, 1)"),
    ("optimizer.soap.b2", 1.0, {}, "[0, 1)"),
    ("optimizer.soap.shampoo_beta", 5.0, {}, "-1"),
    ("optimizer.soap.eps", -1e-8, {}, "> 0"),
    ("optimizer.soap.precondition_frequency", 0, {}, "positive integer"),
    ("optimizer.soap.max_precond_dim", 0, {}, ">= 1"),
    ("optimizer.adan.b1", -0.5, {}, "[0, 1)"),
    ("optimizer.adan.b2", 1.0, {}, "[0, 1)"),
    ("optimizer.adan.b3", 1.0, {}, "[0, 1)"),
    ("optimizer.adan.eps", 0.0, {}, "> 0"),
    ("optimizer.adan.weight_decay_mode", "l2", {}, "is unknown"),
    ("optimizer.lion.b1", -0.5, {}, "[0, 1)"),
    ("optimizer.lion.b2", 1.0, {}, "[0, 1)"),
    ("optimizer.mars.b1", 1.0, {}, "[0, 1)"),
    ("optimizer.mars.b2", 7.0, {}, "[0, 1)"),
    ("optimizer.mars.gamma", -0.1, {}, ">= 0"),
    ("optimizer.mars.eps", -1.0, {}, "> 0"),
    ("optimizer.side.eps", -1.0, {}, "> 0"),
    ("optimizer.side.lr_ratio", 0.0, {}, "> 0"),
    ("optimizer.side.weight_decay", -0.5, {}, "or -1"),
    ("optimizer.side.b1", 2.0, {}, "[0, 1)"),
    ("optimizer.side.b2", 1.0, {}, "[0, 1)"),
    # staleness
    ("staleness.mode", "async", {}, "is unknown"),
    ("staleness.mitigation", "magic", {}, "is unknown"),
    ("staleness.mitigation", "ef", {}, "needs a delay"),
    ("staleness.pipedream_gradient", "exact", {}, "is unknown"),
    ("staleness.pipedream_stages", 1, {"staleness.mode": "pipedream"}, ">= 2"),
    ("staleness.pipedream_stages", 3, {"staleness.mode": "pipedream"}, "not divisible"),
    # the layer stack of an MoE model with moe.every=2 is n_layers / 2 = 2 groups: 4 stages cannot split it
    ("staleness.pipedream_stages", 4, {"staleness.mode": "pipedream", "model.moe.num_experts": 4,
                                       "model.moe.expert_d_ff": 64, "model.moe.every": 2}, "moe.every=2"),
    ("staleness.taylor_lam", -5.0, {"staleness.mode": "2bw", "staleness.mitigation": "taylor"}, ">= 0"),
    ("staleness.taylor_lam0", -1.0, {}, ">= 0"),
    ("staleness.taylor_ema_decay", 1.0, {}, "[0, 1)"),
    ("staleness.ef_strength", -1.0, {}, ">= 0"),
    ("staleness.sync_start_steps", -1, {}, ">= 0"),
    ("staleness.sync_cooldown_steps", -3, {}, ">= 0"),
    ("staleness.sync_start_steps", 400, {"staleness.sync_cooldown_steps": 200}, "exceeds config.train.steps"),
    ("staleness.nesterov_b1", 1.0, {}, "[0, 1)"),
    ("staleness.nesterov_momentum_decay", -0.004, {}, ">= 0"),
    ("staleness.weight_prediction_smoothing", -0.5, {}, "[0, 1)"),
    ("staleness.lr_rescheduling_steps", -1, {}, ">= 0"),
    ("staleness.nesterov", True, {}, "there is none"),
    ("staleness.weight_prediction", True, {"pipeline.stages": 2, "pipeline.schedule": "sync"}, "there is none"),
    # pipeline
    ("pipeline.stages", 0, {}, "positive integer"),
    ("pipeline.stages", 3, {}, "not divisible"),
    ("pipeline.schedule", "gpipe", {}, "is unknown"),
    ("pipeline.stages", 4, {"pipeline.schedule": "2bw", "train.microbatches": 2}, "too few"),
    ("pipeline.virtual_stages", 1, {"pipeline.stages": 2, "pipeline.schedule": "interleaved"}, ">= 2"),
    ("pipeline.virtual_stages", 3, {"pipeline.stages": 2, "pipeline.schedule": "interleaved"}, "equal chunks"),
    ("pipeline.stage_layers", (3, 1), {"pipeline.stages": 2, "pipeline.schedule": "zb-h1"}, "even split"),
    ("model.moe.num_experts", 8, {"pipeline.stages": 2, "pipeline.schedule": "zb-h1", "model.moe.every": 2},
     "use config.pipeline.schedule=1f1b"),
    ("pipeline.stage_layers", (3, 1), {}, "runs the simulate runner"),
    ("pipeline.stage_layers", (3, 1), {"pipeline.stages": 2, "runner": "simulate"}, "runs the simulate runner"),
    # the engine's settings on a config without the engine would be ignored (2bw: trained with no delay)
    ("pipeline.schedule", "2bw", {}, "the simulated one-step delay is config.staleness.mode=2bw"),
    ("pipeline.schedule", "1f1b", {"pipeline.stages": 2, "runner": "simulate"}, "runs the simulate runner"),
    ("pipeline.vocab_parallel", True, {}, "leave it False"),
    ("pipeline.placement", "mdmp", {}, "leave it 'spmd'"),
    ("pipeline.stage_layers", (4,), {"pipeline.stages": 2}, "one per stage"),
    ("pipeline.stage_layers", (5, -1), {"pipeline.stages": 2}, "negative"),
    ("pipeline.stage_layers", (3, 2), {"pipeline.stages": 2}, "must sum to config.model.n_layers=4"),
    ("pipeline.stage_layers", (3, 1.0), {"pipeline.stages": 2}, "tuple of integers"),
    ("pipeline.stage_layers", (3, 1), {"pipeline.stages": 2, "model.moe.num_experts": 8, "model.moe.every": 2},
     "multiple of 2"),
    ("pipeline.vocab_parallel", True, {"pipeline.stages": 2, "model.vocab_size": 257}, "does not divide"),
    ("pipeline.placement", "mixed", {"pipeline.stages": 2}, "is unknown"),
    ("pipeline.schedule", "zb-h1", {"pipeline.stages": 2, "pipeline.placement": "mpmd"}, "placement='spmd'"),
    ("pipeline.recompute", False, {"pipeline.stages": 2, "pipeline.placement": "mpmd"}, "set recompute=True"),
    ("pipeline.stage_layers", (3, 1), {"pipeline.stages": 2, "pipeline.placement": "mpmd"}, "splits the layers evenly"),
    ("pipeline.vocab_parallel", True, {"pipeline.stages": 2, "pipeline.placement": "mpmd", "model.vocab_size": 258},
     "does not apply"),
    ("train.microbatches", 2, {"pipeline.stages": 4, "pipeline.schedule": "2bw", "pipeline.placement": "mpmd"},
     "it runs from config.train.microbatches=3"),
    ("pipeline.schedule", "interleaved", {"pipeline.stages": 2, "pipeline.placement": "mpmd"}, "placement='spmd'"),
    # mesh
    ("mesh.data", 0, {}, "-1"),
    ("mesh.data", -2, {}, "-1"),
    ("mesh.data", 100_000, {"train.global_batch_size": 100_000}, "65536"),
    ("mesh.expert_parallel", True, {}, "needs an MoE model"),
]


def _config_for(field):
    name = "moe_tiny" if field.startswith("model.moe.") else "tiny"
    return configs.load_file(f"configs/{name}.py")


def _set(c, field, value):
    section, _, key = field.rpartition(".")
    node = c
    for part in filter(None, section.split(".")):
        node = node[part]
    node[key] = value


@pytest.mark.parametrize("field, value, extra, needle", BAD, ids=[f"{f}={v!r}" for f, v, _, _ in BAD])
def test_bad_setting_is_refused_naming_the_field(field, value, extra, needle):
    c = _config_for(field)
    for k, v in extra.items():
        _set(c, k, v)
    _set(c, field, value)
    with pytest.raises(configs.ConfigError) as e:
        configs.validate(c)
    message = str(e.value)
    assert f"config.{field}" in message, message
    assert needle in message, message


def _numeric_fields(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _numeric_fields(v, f"{prefix}{k}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield prefix + k


def test_rules_on_the_replica_count_apply_once_the_devices_resolve_mesh_data():
    """Under mesh.data=-1 the replica count is known only on the devices: check_against_devices
    applies the same rules the validator applies to a set count, before anything is built."""
    c = configs.load_file("configs/moe_tiny.py")
    c.model.moe.num_experts = 3
    c.pipeline.update(stages=2, schedule="1f1b")
    c.mesh.update(data=-1, expert_parallel=True)
    c.train.microbatches = 2
    configs.validate(c)
    assert configs.check_against_devices(c, 2) == 1  # one replica holds all 3 experts
    with pytest.raises(configs.ConfigError, match=r"num_experts=3 is not divisible by config.mesh.data=2 "
                                                  r"\(config.mesh.data=-1: 2 replicas on these devices\)"):
        configs.check_against_devices(c, 4)
    c.mesh.data = 2
    with pytest.raises(configs.ConfigError, match="num_experts=3 is not divisible by config.mesh.data=2"):
        configs.validate(c)


def test_the_engines_pipedream_splits_by_its_own_stages():
    """On the engine the schedule's stages replace staleness.pipedream_stages (configs.effective_staleness),
    so a pipedream_stages that would not split the layers is not held against the run."""
    c = configs.load_file("configs/tiny.py")
    c.pipeline.update(stages=2, schedule="pipedream")
    c.staleness.update(mode="pipedream", pipedream_stages=3)
    c.train.microbatches = 2
    configs.validate(c)
    assert configs.effective_staleness(c).pipedream_stages == 2


def test_the_table_covers_every_numeric_field():
    """A new numeric setting without a bad value in the table (and so without a checked domain)
    fails here."""
    assert len(BAD) >= 60
    covered = {f for f, *_ in BAD}
    missing = sorted(set(_numeric_fields(configs.base_config().to_dict())) - covered)
    assert not missing, f"numeric settings with no bad value in BAD: {missing}"


def test_sections_are_checked_separately():
    """One check per config section, each a small function (a bad model setting is found by the
    model check alone)."""
    c = configs.resolve(configs.load_file("configs/tiny.py"))
    c.model.init_std = 0.0
    c.optimizer.adamw.eps = -1.0
    by_check = {check.__name__: check(c) for check in configs.SECTION_CHECKS}
    assert [n for n, errs in by_check.items() if errs] == ["_check_model", "_check_optimizer"]


def test_cli_refuses_the_reported_settings_without_a_traceback(tmp_path):
    """The settings the issue found accepted, all at once through the CLI: exit 2, every field
    named, nothing started (no workdir)."""
    bad = ["optimizer.adamw.eps=-1", "optimizer.side.eps=-1", "model.init_std=0", "staleness.taylor_lam=-5",
           "optimizer.soap.shampoo_beta=5", "model.head_dim=-2", "model.norm_eps=-1", "model.z_loss=inf",
           "model.moe.lb_loss_coef=-10", "model.moe.capacity_factor=1e-9"]
    args = ["--config=configs/moe_tiny.py", f"--workdir={tmp_path}/run", *(f"--config.{b}" for b in bad)]
    out = run_cli(args, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    for b in bad:
        assert f"config.{b.split('=')[0]}=" in out.stderr, b
    assert not (tmp_path / "run").exists()


def test_cli_messages_for_missing_config_and_workdir_file(tmp_path):
    missing = run_cli(["--config=configs/nope.py"], timeout=120)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert "--config=configs/nope.py could not be loaded (no such file)" in missing.stderr
    afile = tmp_path / "afile"
    afile.write_text("x")
    clash = run_cli([f"--workdir={afile}"], timeout=120)
    assert clash.returncode == 2 and "Traceback" not in clash.stderr, clash.stderr
    assert f"{afile} is an existing file, not a directory" in clash.stderr
    assert afile.read_text() == "x"


def test_cpu_host_refuses_more_fake_devices_than_it_can_make():
    c = configs.load_file("configs/tiny.py")
    c.train.global_batch_size = 2048
    c.mesh.data = 2048
    configs.validate(c)  # a real cluster can have 2048 devices
    with pytest.raises(configs.ConfigError, match="config.mesh.data=2048 .* fake CPU device"):
        configs.check_cpu_host(c)


def test_stage_layers_accepts_uneven_splits_and_the_cli_form():
    c = configs.load_file("configs/tiny.py")
    c.pipeline.update(stages=2, stage_layers=(3, 1))
    configs.validate(c)
    c.pipeline.stage_layers = (4, 0)  # the last stage: head and loss only
    configs.validate(c)
    c.model.n_layers = 5  # not divisible by the stages: fine with an explicit split
    c.pipeline.stage_layers = (4, 1)
    configs.validate(c)
    from ml_collections import config_flags  # the CLI's parser: --config.pipeline.stage_layers=3,1
    assert config_flags.tuple_parser.TupleParser().parse("3,1") == (3, 1)
