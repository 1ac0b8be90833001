"""``config.train.profile_steps``: a trace of a window of updates, attributed to the step's parts."""

import gzip
import json

import pytest

from asyncpp_jax import configs
from asyncpp_jax.train import profile
from asyncpp_jax.train.trainer import Trainer
from helpers import small_train_config


def test_profile_settings_are_checked():
    c = configs.base_config()
    c.train.update(steps=10, profile_steps=-1)
    assert any("config.train.profile_steps=-1" in e for e in configs.validate_errors(c))
    c.train.update(profile_start=8, profile_steps=3)
    assert any("runs past config.train.steps=10" in e for e in configs.validate_errors(c))
    c.train.update(profile_start=7, profile_steps=3)
    assert not any("profile" in e for e in configs.validate_errors(c))


def test_part_of_reads_scopes_through_autodiff_wrappers():
    assert profile.part_of("jit(train_step)/shard_map/while/body/pp_tick/cond/pp_fwd/dot_general") == "pp_fwd"
    assert profile.part_of("jit(train_step)/transpose(jvp(pp_last))/dot_general") == "pp_last"
    assert profile.part_of("jit(train_step)/optimizer_update/mul") == "optimizer_update"
    assert profile.part_of("jit(train_step)/pp_tickle/add") == "other"  # whole names only
    assert profile.part_of("") == "other"


def test_self_times_subtract_nested_thunks():
    ev = lambda name, ts, dur, tid=1: {"name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}  # noqa: E731
    events = [ev("while", 0, 100), ev("cond", 10, 50), ev("dot", 12, 30), ev("add", 70, 10),
              ev("other_thread", 0, 40, tid=2)]
    got = {e["name"]: t for e, t in profile.self_times(events)}
    assert got == {"while": 40, "cond": 20, "dot": 30, "add": 10, "other_thread": 40}


def _thunk(ts, dur, run=None, slot=False, dev="0"):
    args = {"hlo_op": "slot" if slot else "other", "device_ordinal": dev} | ({"run_id": run} if run else {})
    return {"ts": ts, "dur": dur, "args": args}


def _is_slot(e):
    return e["args"]["hlo_op"] == "slot"


def test_phases_split_each_update_at_its_first_and_last_slot():
    # Update 1 spans two devices; then a run with no slot (an eval step), which is not an update;
    # then update 2, whose last thunk ends after its last slot.
    thunks = [_thunk(0, 10_000, "1"), _thunk(20_000, 10_000, "1", True), _thunk(50_000, 20_000, "1", True, "1"),
              _thunk(90_000, 10_000, "1", dev="1"),
              _thunk(120_000, 5_000, "2"),
              _thunk(200_000, 5_000, "3"), _thunk(210_000, 30_000, "3", True), _thunk(245_000, 5_000, "3")]
    got = profile.phases(thunks, _is_slot)
    assert got == [profile.Phase(100.0, 20.0, 50.0, 30.0), profile.Phase(50.0, 10.0, 30.0, 10.0)]


def test_phases_keep_overlapping_runs_apart_by_run_id():
    # Asynchronous dispatch: device 1 starts update 2 before device 0 has finished update 1.  By
    # time alone they would be one window; the runtime's run_id on each thunk keeps them apart.
    thunks = [_thunk(0, 5_000, "7"), _thunk(10_000, 60_000, "7", True), _thunk(90_000, 10_000, "7"),
              _thunk(20_000, 40_000, "7", True, "1"),
              _thunk(95_000, 50_000, "8", True, "1"), _thunk(120_000, 40_000, "8", True), _thunk(160_000, 35_000, "8")]
    got = profile.phases(thunks, _is_slot)
    assert got == [profile.Phase(100.0, 10.0, 60.0, 30.0), profile.Phase(100.0, 0.0, 65.0, 35.0)]


def test_phases_of_a_trace_without_run_ids_group_by_overlap():
    thunks = [_thunk(0, 50_000), _thunk(10_000, 20_000, slot=True), _thunk(40_000, 30_000, dev="1"),
              _thunk(100_000, 10_000, slot=True)]
    got = profile.phases(thunks, _is_slot)
    assert got == [profile.Phase(70.0, 10.0, 20.0, 40.0), profile.Phase(10.0, 0.0, 10.0, 0.0)]


_HLO = """HloModule jit_train_step, entry_computation_layout={()}

%fused_computation.3 (param_0: f32[4,8,16], param_1: f32[4,16,8]) -> f32[4,8,8] {
  %param_0 = f32[4,8,16]{2,1,0} parameter(0)
  %param_1 = f32[4,16,8]{2,1,0} parameter(1)
  ROOT %dot.1 = f32[4,8,8]{2,1,0} dot(%param_0, %param_1), lhs_batch_dims={0}, metadata={stack_frame_id=3}
}

ENTRY %main (p.0: f32[4,8,16], p.1: f32[4,16,8], p.2: f32[8,8]) -> (f32[4,8,8], f32[8,8]) {
  %p.0 = f32[4,8,16]{2,1,0} parameter(0)
  %p.1 = f32[4,16,8]{2,1,0} parameter(1)
  %p.2 = f32[8,8]{1,0} parameter(2)
  %q = f32[4,8,16]{2,1,0} copy(%p.0), metadata={op_name="jit(train_step)/pp_last/attn/q/copy"}
  %k = f32[4,16,8]{2,1,0} copy(%p.1), metadata={op_name="jit(train_step)/pp_last/attn/k/copy"}
  %ynn_fusion.3 = f32[4,8,8]{2,1,0} fusion(%q, %k), kind=kCustom, calls=%fused_computation.3, backend_config={"x":[]}
  %dot.2 = f32[8,8]{1,0} dot(%p.2, %p.2), lhs_contracting_dims={1}, metadata={op_name="jit(train_step)/loss/dot_general"}
  ROOT %tuple = (f32[4,8,8]{2,1,0}, f32[8,8]{1,0}) tuple(%ynn_fusion.3, %dot.2)
}
"""


def test_hlo_reader_gives_an_unnamed_fusion_its_operands_scope_and_finds_unscoped_matmuls(tmp_path):
    (tmp_path / "train_step.txt").write_text(_HLO)
    hlo = profile._parse_hlo(tmp_path)
    # the YNNPACK fusion has no op_name: it ran where both its operands were computed
    assert hlo.names[("jit_train_step", "ynn_fusion.3")] == "jit(train_step)/pp_last/attn"
    assert profile.part_of(hlo.names[("jit_train_step", "ynn_fusion.3")]) == "pp_last"
    assert sorted(hlo.matmuls) == ["jit(train_step)/loss/dot_general", "jit(train_step)/pp_last/attn"]
    assert hlo.unscoped_matmuls() == ["jit(train_step)/loss/dot_general"]


@pytest.mark.parametrize("pipeline", [False, True], ids=["simulate", "engine_2bw"])
def test_a_profiled_run_attributes_its_step(cache_dir, tmp_path, pipeline):
    cfg = small_train_config(cache_dir, "prof", 1, steps=4, microbatches=2, eval_every=4, eval_batches=1,
                             checkpoint_every=4, profile_start=1, profile_steps=2)
    if pipeline:
        cfg.pipeline.update(stages=2, schedule="2bw")
    t = Trainer(cfg, tmp_path)
    assert t.run().status == "finished"
    t.close()
    d = tmp_path / "profile" / "process_0"
    assert json.loads((d / "window.json").read_text()) == {"first_update": 2, "updates": 2}
    (trace,) = d.rglob("*.trace.json.gz")
    assert json.load(gzip.open(trace))  # a Perfetto trace that other tools can open
    s = profile.summarize(tmp_path)
    assert s.updates == 2 and s.ms["optimizer_update"] > 0
    expected = {"pp_fwd", "pp_bwd", "pp_last", "pp_send"} if pipeline else {"sim_grad"}
    assert expected <= set(s.ms)
    # every matmul of the step (the attention's, fused by YNNPACK without an op_name, included)
    # runs under a named part: nothing large escapes the scopes
    assert s.unscoped_matmuls == []
    assert s.devices == (2 if pipeline else 1)
    assert "| total |" in profile.render(s)
    # one phase split per traced update, its parts summing to its wall clock
    assert len(s.phases) == 2 and all(p.slots > 0 and p.before >= 0 and p.after >= 0 for p in s.phases)
    assert all(abs(p.before + p.slots + p.after - p.wall) < 1e-6 for p in s.phases)
    assert "| update | wall |" in profile.render(s)


def test_summary_of_an_unprofiled_run_is_a_clear_error(tmp_path, capsys):
    assert profile.main([str(tmp_path)]) == 2
    assert "--config.train.profile_steps=N" in capsys.readouterr().err
