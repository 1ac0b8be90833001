"""Sweep expansion and resume, and the report on a synthetic results file with known numbers."""

import json

import pytest

from experiments import report as report_lib
from experiments import sweep
from experiments.studies import mitigations, optimizers
from helpers import fake_sweep_run as fake_run
from helpers import no_prepare as NO_PREPARE


def test_expand_variants_grid_seeds_and_precedence():
    study = sweep.Study("s", "configs/tiny.py", {"a": {"x.y": 1, "x.z": 1}, "b": {"x.y": 2}},
                        grid={"x.z": [5, 6]}, seeds=(0, 1), base={"x.y": 0, "x.w": 3})
    runs = sweep.expand(study)
    assert len(runs) == 2 * 2 * 2
    assert len({r.run_id for r in runs}) == 8
    first = runs[0]
    assert first.run_id == "a__z=5__seed=0"
    assert first.overrides == {"x.y": 1, "x.w": 3, "x.z": 5, "seed": 0}  # base < variant < grid
    cmd = sweep.command(study, first, sweep.pathlib.Path("/tmp/w"))
    assert "--config.x.z=5" in cmd and "--config.seed=0" in cmd and "--config=configs/tiny.py" in cmd


@pytest.mark.parametrize("preset", ["cpu", "paper"])
def test_real_studies_expand(preset):
    assert len(sweep.expand(optimizers.study(preset))) == 6 * 2 * 3  # three seeds at every preset
    runs = sweep.expand(mitigations.study(preset))
    assert {r.variant.split("/")[1] for r in runs} >= {"sync", "none", "ef", "taylor", "sync_start", "sync_cooldown"}


@pytest.mark.parametrize("name", ["optimizers", "momentum", "mitigations", "schemes", "sensitivity", "lr", "lr_gap",
                                  "ef_causes", "lion"])
@pytest.mark.parametrize("preset", ["cpu", "gpu", "paper"])
def test_every_run_of_every_study_is_a_valid_config(name, preset):
    from asyncpp_jax import configs

    if name == "ef_causes" and preset != "cpu":
        pytest.skip("ef_causes varies the cpu preset only (tested to refuse the others)")
    study = sweep.load_study(name, preset)
    for run in sweep.expand(study):
        # the config the sweep trains with; raises with the field named if a preset asks for the impossible
        configs.validate(sweep.run_config(study, run))


def test_ef_causes_changes_one_setting_per_cause_and_is_cpu_only():
    from experiments.studies import ef_causes

    study = ef_causes.study("cpu")
    for cause, changed in ef_causes.CAUSES.items():
        for arm in ef_causes.ARMS:
            v, base = study.variants[f"adamw/{cause}/{arm}"], study.variants[f"adamw/base/{arm}"]
            assert {k for k in set(v) | set(base) if v.get(k) != base.get(k)} == set(changed)
    assert study.variants["adamw/strength=2/ef"]["staleness.ef_strength"] == 2.0
    assert len(sweep.expand(study)) == (3 * len(ef_causes.CAUSES) + len(ef_causes.STRENGTHS)) * len(ef_causes.SEEDS)
    with pytest.raises(ValueError, match="--preset=cpu"):
        ef_causes.study("gpu")


def test_execute_collects_and_resumes(tmp_path):
    study = sweep.Study("s", "configs/tiny.py", {"a": {}, "b": {}}, seeds=(0, 1))
    runner = fake_run(lambda name: 1.0 if name.startswith("a") else 2.0)
    results = sweep.execute(study, tmp_path, runner=runner, log=lambda *_: None, prepare=NO_PREPARE)
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert len(rows) == 4 and len(runner.calls) == 4
    assert {r["variant"]: r["final_val"] for r in rows} == {"a": 1.0, "b": 2.0}
    assert rows[0]["best_val"] == 1.0 and rows[0]["val_curve"] == [[5, 1.5], [10, 1.0]]
    # Interrupted study: one run unfinished; only it runs again.
    (tmp_path / "s" / "b__seed=1" / "status.json").write_text(json.dumps({"status": "preempted"}))
    again = fake_run(lambda name: 2.0)
    sweep.execute(study, tmp_path, runner=again, log=lambda *_: None, prepare=NO_PREPARE)
    assert again.calls == ["b__seed=1"]


def _runner_saving_configs(*studies):
    """fake_run, but each workdir's config.json is the run's real resolved config, as the CLI saves it."""
    from asyncpp_jax import configs

    by_id = {(s.name, r.run_id): (s, r) for s in studies for r in sweep.expand(s)}
    inner = fake_run(lambda name: 1.0)

    def run(cmd, workdir, env):
        inner(cmd, workdir, env)
        study, r = by_id[(workdir.parent.name, workdir.name)]
        (workdir / "config.json").write_text(configs.to_json(sweep.run_config(study, r)))
        return 0

    run.calls = inner.calls
    return run


def test_a_run_another_study_has_done_is_reused_not_rerun(tmp_path):
    first = sweep.Study("first", "configs/tiny.py", {"base": {}, "lr": {"optimizer.lr": 0.002}}, seeds=(0,))
    # "same" differs from first's "base" only in a setting that computes nothing (the progress bar).
    second = sweep.Study("second", "configs/tiny.py", {"same": {"train.progress_bar": False},
                                                       "other": {"optimizer.lr": 0.004}}, seeds=(0,))
    runner = _runner_saving_configs(first, second)
    quiet = dict(log=lambda *_: None, prepare=NO_PREPARE)
    sweep.execute(first, tmp_path, runner=runner, **quiet)
    results = sweep.execute(second, tmp_path, runner=runner, **quiet)
    assert runner.calls == ["base__seed=0", "lr__seed=0", "other__seed=0"]
    got = {r["variant"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert got["same"]["reused_from"] == "first/base__seed=0" and got["same"]["final_val"] == 1.0
    assert got["same"]["seconds"] is None and got["other"]["reused_from"] is None
    # A reused run is never a source itself (the row names the run that computed it)...
    third = sweep.Study("third", "configs/tiny.py", {"same": {}}, seeds=(0,))
    row = json.loads(sweep.execute(third, tmp_path, runner=runner, **quiet).read_text())
    assert row["reused_from"] == "first/base__seed=0" and len(runner.calls) == 3
    # ...and --no-reuse runs everything.
    fourth = sweep.Study("fourth", "configs/tiny.py", {"same": {}}, seeds=(0,))
    runner4 = _runner_saving_configs(fourth)
    sweep.execute(fourth, tmp_path, runner=runner4, reuse_done=False, **quiet)
    assert runner4.calls == ["same__seed=0"]


def test_a_done_run_with_settings_its_study_no_longer_asks_for_is_set_aside_and_run_again(tmp_path):
    quiet = dict(log=lambda *_: None, prepare=NO_PREPARE)
    old = sweep.Study("s", "configs/tiny.py", {"lion": {"optimizer.name": "lion", "optimizer.lion.b1": 0.9},
                                              "adamw": {}}, seeds=(0,))
    runner = _runner_saving_configs(old)
    sweep.execute(old, tmp_path, runner=runner, **quiet)
    # The same study, with Lion's b1 tuned since: only Lion's run is stale.
    new = sweep.Study("s", "configs/tiny.py", {"lion": {"optimizer.name": "lion", "optimizer.lion.b1": 0.7},
                                              "adamw": {}}, seeds=(0,))
    runner2, said = _runner_saving_configs(new), []
    sweep.execute(new, tmp_path, runner=runner2, log=said.append, prepare=NO_PREPARE)
    assert runner2.calls == ["lion__seed=0"]
    assert any("optimizer.lion.b1: 0.9 -> 0.7" in line for line in said)
    kept = json.loads((tmp_path / "s" / "lion__seed=0.stale" / "config.json").read_text())
    assert kept["optimizer"]["lion"]["b1"] == 0.9  # moved aside, not deleted
    assert json.loads((tmp_path / "s" / "lion__seed=0" / "config.json").read_text())["optimizer"]["lion"]["b1"] == 0.7
    # A setting the saved config lacks (added to the code after the run) is not a difference.
    assert sweep.stale_settings({"optimizer": {"lr": 0.1}}, {"optimizer": {"lr": 0.1, "new": 1}}) == []
    assert sweep.stale_settings({"train": {"progress_bar": True}}, {"train": {"progress_bar": False}}) == []


def test_reuse_signature_refuses_a_config_saved_without_a_setting_the_code_now_has():
    config = {"optimizer": {"lr": 0.001, "b1": 0.9}, "train": {"progress_bar": True, "steps": 10}}
    older = {"optimizer": {"lr": 0.001}, "train": {"steps": 10}}  # saved before b1 existed
    assert sweep.signature(config) == sweep.signature({**config, "train": {"progress_bar": False, "steps": 10}})
    assert sweep.signature(config) != sweep.signature(older)
    # The one setting known to have been added with the old behaviour as its value: the even split.
    assert sweep.signature({**config, "pipeline": {"stage_layers": []}}) == sweep.signature({**config, "pipeline": {}})
    assert sweep.signature({**config, "pipeline": {"stage_layers": [3, 1]}}) != sweep.signature({**config, "pipeline": {}})


def test_failed_run_stops_the_study_with_its_name(tmp_path):
    study = sweep.Study("s", "configs/tiny.py", {"a": {}})
    with pytest.raises(RuntimeError, match="run a__seed=0 of study s failed with exit code 3"):
        sweep.execute(study, tmp_path, runner=lambda cmd, w, env: 3, log=lambda *_: None, prepare=NO_PREPARE)


def rows(study, finals):
    out = []
    for variant, values in finals.items():
        for seed, v in enumerate(values):
            out.append({"study": study, "run_id": f"{variant}-{seed}", "variant": variant, "point": {}, "seed": seed,
                        "final_val": v, "best_val": v, "val_curve": [[10, v + 0.3], [20, v]],
                        "train_curve": [], "seconds": 1.0, "config": {}})
    return out


def test_report_tables_claims_and_plots(tmp_path):
    data = rows("optimizers", {"adamw/sync": [1.0, 1.2], "adamw/2bw": [2.0, 2.3],
                               "muon/sync": [1.0, 1.0], "muon/2bw": [1.1, 1.1]})
    data += rows("mitigations", {"adamw/sync": [1.0, 1.0], "adamw/none": [2.0, 2.0], "adamw/ef": [1.3, 1.3], "adamw/nesterov": [1.1, 1.3],
                                 "muon/sync": [1.0, 1.0], "muon/none": [1.2, 1.2], "muon/ef": [1.16, 1.16],
                                 "muon/ef@sync_lr": [1.5, 1.5]})  # at sync's pick: a gap both ways, not a mitigation
    data += rows("schemes", {"adamw/sync": [1.0, 1.0], "adamw/2bw": [1.05, 1.05], "adamw/pipedream/P=2": [1.1, 1.1],
                             "adamw/pipedream/P=4": [1.2, 1.2], "adamw/pipedream/P=8": [1.4, 1.4]})
    data += rows("momentum", {"adamw/beta=0.8/sync": [1.0], "adamw/beta=0.8/2bw": [1.5],
                              "adamw/beta=0.95/sync": [1.0], "adamw/beta=0.95/2bw": [1.6]})
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in data) + "\n")
    md = report_lib.report([path], tmp_path / "rep").read_text()
    assert "| adamw/sync | 1.1000 ± 0.1414 | 2 |" in md
    # Seeds 0 and 1 in both arms: the gap's SE is that of the per-seed differences (1.0, 1.1).
    assert "| adamw | +1.0500 ± 0.0500 | paired, 2 seeds |" in md
    # Ranked by the fraction recovered, with delta-method standard errors: nesterov's seeds spread
    # 0.1 around 1.2 and the other arms not at all, so SE(mean) = 0.1 = SE of its fraction and of its
    # lead over EF (gap of none: 1).
    assert "| adamw | 1 | nesterov | +0.2000 ± 0.1000 | 80% ± 10% | +10% ± 10% | within t SE | paired, 2 seeds |" in md
    assert "| adamw | 2 | ef | +0.3000 ± 0.0000 | 70% ± 0% | - | - | paired, 2 seeds |" in md
    assert "| muon | 1 | ef | +0.1600 ± 0.0000 | 20% ± 0% | - | - | paired, 2 seeds |" in md
    assert "| muon | 2 | ef@sync_lr" not in md
    assert "| muon/ef | +0.1600 ± 0.0000 | +0.5000 ± 0.0000 | paired, 2 seeds |" in md
    verdicts = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in md.splitlines()
                if line.startswith("| ") and len(line.split(" | ")) == 5}  # claim, verdict, test, measured, the paper
    assert verdicts["AdamW's delay gap is far larger than Muon's"] == "reproduced"  # d = 1.05 - 0.2 ± 0.05
    assert verdicts["Error feedback recovers a large part of the gap (adamw)"] == "reproduced"  # 70% ± 0
    assert verdicts["Error feedback recovers a large part of the gap (muon)"] == "not reproduced"  # 20% ± 0
    assert verdicts["PipeDream degrades with depth while 2BW does not"] == "reproduced"
    # One seed per momentum: no standard error, so no verdict either way.
    assert verdicts["Higher momentum shrinks the delay gap (adamw)"] == "inconclusive at this scale"
    for png in ("optimizers_curves.png", "mitigations_recovered.png", "schemes_gap.png", "momentum_gap.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 1000


def test_job_envs_give_each_job_its_own_accelerators():
    assert sweep.job_envs("gpu", [str(i) for i in range(8)], 8)[3] == {"CUDA_VISIBLE_DEVICES": "3"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in sweep.job_envs("gpu", ["4", "5", "6", "7"], 2)] == ["4,5", "6,7"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in sweep.job_envs("gpu", list("0123456"), 3)] == ["0,1", "2,3", "4,5"]
    tpu = sweep.job_envs("tpu", ["0", "1", "2", "3"], 4)
    assert [e["TPU_VISIBLE_CHIPS"] for e in tpu] == ["0", "1", "2", "3"]
    assert {e["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in tpu} == {"1,1,1"}
    assert len({e["TPU_MESH_CONTROLLER_PORT"] for e in tpu}) == 4  # each job its own TPU process
    assert sweep.job_envs("tpu", ["0", "1", "2", "3"], 2)[1]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
    assert sweep.job_envs("cpu", [], 1) == [{}]
    assert sweep.job_envs("cpu", [], 2, cpus={0, 1, 2, 3, 4}) == [{"ASYNCPP_CPUS": "0,1"}, {"ASYNCPP_CPUS": "2,3"}]
    with pytest.raises(ValueError, match="--jobs 3 needs at least 3 CPU cores"):
        sweep.job_envs("cpu", [], 3, cpus={0, 1})
    with pytest.raises(ValueError, match="--jobs 8 needs at least 8 accelerators"):
        sweep.job_envs("gpu", ["0", "1"], 8)
    with pytest.raises(ValueError, match="choose --jobs"):
        sweep.job_envs("tpu", list("012345"), 2)  # 3 chips each: no TPU process shape


def test_accelerators_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert sweep.accelerators() == ("gpu", ["2", "5"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert sweep.accelerators() == ("cpu", [])


def test_running_jobs_never_share_accelerators_and_the_corpus_is_prepared_first(tmp_path):
    import threading
    import time

    study = sweep.Study("s", "configs/tiny.py", {"a": {}, "b": {}, "c": {}}, seeds=(0, 1))
    envs = sweep.job_envs("gpu", ["0", "1", "2", "3"], 2)
    events, active, lock = [], set(), threading.Lock()
    finish = fake_run(lambda name: 1.0)

    def runner(cmd, workdir, env):
        with lock:
            assert env["CUDA_VISIBLE_DEVICES"] not in active  # a slot is held by one job at a time
            active.add(env["CUDA_VISIBLE_DEVICES"])
            events.append(("run", env["CUDA_VISIBLE_DEVICES"]))
        time.sleep(0.05)
        with lock:
            active.remove(env["CUDA_VISIBLE_DEVICES"])
        return finish(cmd, workdir, env)

    def prepare(study, log):
        events.append(("prepare", None))

    sweep.execute(study, tmp_path, jobs=2, runner=runner, log=lambda *_: None, prepare=prepare, envs=envs)
    assert events[0] == ("prepare", None) and events.count(("prepare", None)) == 1
    assert {e for kind, e in events if kind == "run"} == {"0,1", "2,3"} and len(events) == 7


def test_prepare_corpora_prepares_each_distinct_corpus_once(tmp_path):
    import sysconfig

    json_dir = sysconfig.get_paths()["stdlib"] + "/json/*.py"
    base = {"data.source": json_dir, "data.cache_dir": str(tmp_path / "corpora"), "data.val_fraction": 0.3}
    study = sweep.Study("s", "configs/tiny.py", {"a": {}, "b": {"data.seq_len": 64},
                                                  "c": {"data.val_fraction": 0.5}}, seeds=(0, 1), base=base)
    logs = []
    paths = sweep.prepare_corpora(study, log=logs.append)
    assert len(paths) == 2 and len(set(paths)) == 2  # a and b share one corpus; c splits differently
    assert sum("tokenizing" in m for m in logs) == 2
    assert sorted(p.name for p in (tmp_path / "corpora").iterdir()) == sorted(p.rsplit("/", 1)[1] for p in paths)


def test_sensitivity_lr_arms_are_the_lr_studys_grid_points_where_it_has_them():
    from experiments.studies import sensitivity

    assert sensitivity.lr_steps("adamw", 0.003) == (0.001, 0.009)  # both on AdamW's grid
    assert sensitivity.lr_steps("muon", 0.016) == (0.0052, 0.048)  # 3x is past Muon's grid: rounded
    assert sensitivity.lr_steps("adamw", 0.002) == (0.00067, 0.006)  # off the grid: 3x either way


def test_an_unknown_study_is_named_with_the_choices():
    assert {"lr", "lr_gap", "lion", "optimizers", "ef_causes"} <= set(sweep.study_names())
    with pytest.raises(ValueError, match="no study 'nosuch'; choose one of ef_causes, ladder, ladder_tune, lion, lr, lr_gap"):
        sweep.load_study("nosuch", "cpu")
