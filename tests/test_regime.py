"""The cpu_regime preset (the paper's schedule shape at many small updates), the updates ladder's
studies, per-arm tuning and the ladder's report section, on fabricated rows (no training)."""

from __future__ import annotations

import collections
import json
import re
import math

import pytest

from experiments import paper, report as report_lib, report_ladder, stats, sweep, tuning
from experiments.studies import common, ladder, ladder_tune, lr as lr_study


def test_cpu_regime_is_in_the_papers_regime():
    config, base, seeds, _ = common.preset("cpu_regime")
    assert config == "configs/tiny.py" and seeds == (0, 1, 2)
    steps, batch, seq = base["train.steps"], base["train.global_batch_size"], base["data.seq_len"]
    assert steps >= 2000  # thousands of updates
    assert base["optimizer.warmup_steps"] == steps // 10  # warmup over 10% of the updates
    assert base["optimizer.schedule"] == "cosine" and base["optimizer.min_lr_ratio"] == 0.1
    assert base["optimizer.weight_decay"] == 0.1 and base["optimizer.grad_clip"] == 1.0
    # the cpu preset's model; tokens per parameter as the comments state them
    assert {k: v for k, v in base.items() if k.startswith("model.")} == common.REGIME_MODEL
    assert steps * batch * seq == 819_200
    assert round(819_200 / 759_040, 2) == 1.08


def test_ladder_rungs_share_the_model_tokens_and_eval_set():
    for updates, batch in ladder_tune.RUNGS.items():
        rung = common.regime_rung(batch, updates)
        assert updates * batch * rung["data.seq_len"] == 819_200
        assert rung["train.eval_batches"] * batch == common.REGIME_SEQUENCES_EVAL  # the same held-out sequences
        assert rung["optimizer.warmup_steps"] * 10 == updates
    assert common.regime_rung(2, 3200) == common.CPU_REGIME  # the last rung is the preset itself


def test_lr_grid_at_cpu_regime_is_centred_by_the_batch_scaling_rules():
    for opt in lr_study.NAMES:
        for batch in (2, 8, 32):
            g = lr_study.grid(opt, "cpu_regime", batch)
            assert len(g) == 5 + len(lr_study.EXTEND_REGIME.get(opt, ())) and g == sorted(g)
            scale = batch / 16 if opt in ("muon", "lion") else math.sqrt(batch / 16)  # fixed-size updates: linear
            assert g[2] == pytest.approx(common.TUNED_LR["cpu"][opt] * scale, rel=0.05)  # two significant figures
    assert lr_study.grid("adamw") == [0.001, 0.0017, 0.003, 0.0052, 0.009]  # cpu unchanged
    assert lr_study.grid("lion", "cpu_regime")[-2:] == [0.00034, 0.00058]  # one point past the first top pick
    assert len(sweep.expand(lr_study.study("cpu_regime"))) == 31  # tuned on one seed


def test_ladder_tune_sweeps_every_arm_over_the_same_grid():
    study = ladder_tune.study("cpu_regime")
    runs = sweep.expand(study)
    extended = sum(ladder_tune.EXTEND_DOWN.values())  # points added below grids whose picks sat on the edge
    assert len(runs) == 3 * (3 * 3 * 5 + extended) + 3 * 3 * 3  # the extra rung's grid is the middle three points
    by_prefix: dict = {}
    for run in runs:
        prefix, lr, arm = tuning.parse_arm(run.variant)
        assert run.overrides["optimizer.lr"] == lr
        by_prefix.setdefault(prefix, {}).setdefault(arm, set()).add(lr)
    for prefix, arms in by_prefix.items():
        assert set(arms) == {"sync", "2bw", "ef"} and len({frozenset(v) for v in arms.values()}) == 1, prefix
    # an extended grid goes on below at its own ratio (sqrt 3, to two significant figures)
    for (updates, opt), k in ladder_tune.EXTEND_DOWN.items():
        grid = sorted(by_prefix[f"u={updates}/{opt}"]["sync"])
        if updates in ladder_tune.EXTRA_RUNGS:  # its middle three points, extended through the grid's lowest
            assert k == 1 and grid == sorted(lr_study.grid(opt, "cpu_regime", ladder_tune.EXTRA_RUNGS[updates])[:-1])
            continue
        assert len(grid) == 5 + k
        assert all(hi / lo == pytest.approx(3 ** 0.5, rel=0.05) for lo, hi in zip(grid[:k], grid[1:k + 1]))
    # the 3,200-update rung's sync arms are the lr study's runs at cpu_regime: the sweep copies them
    sigs = {sweep.run_signature(study, r) for r in runs}
    lr_runs = lr_study.study("cpu_regime")
    shared = [r for r in sweep.expand(lr_runs) if sweep.run_signature(lr_runs, r) in sigs]
    assert len(shared) == 3 * 5
    with pytest.raises(ValueError, match="cpu_regime"):
        ladder_tune.study("cpu")


def test_ladder_measures_each_arm_at_its_pick_and_at_syncs():
    rungs = {**ladder_tune.RUNGS, **ladder_tune.EXTRA_RUNGS}
    picks = {f"u={u}/{o}": {} for u in rungs for o in ladder_tune.OPTIMIZERS}
    grid_lrs = {(u, o): lr_study.grid(o, "cpu_regime", b) for u, b in rungs.items() for o in ladder_tune.OPTIMIZERS}
    for key in picks:
        u, o = report_ladder._rung_key(key)
        g = grid_lrs[(u, o)]
        picks[key] = {"sync": g[2], "2bw": g[1], "ef": g[2]}
    v = ladder.variants(picks)
    # per rung and optimizer: sync at its pick; 2bw at its own and sync's; ef's own pick is sync's
    assert len(v) == 12 * 4
    assert "u=200/adamw/lr=0.0024/2bw" in v and "u=200/adamw/lr=0.0042/2bw" in v
    tune = ladder_tune.variants()
    assert all(v[name] == tune[name] for name in v)  # the same configs: seed 0 is the tuning run
    with pytest.raises(ValueError, match="TUNED_LADDER"):
        ladder.variants({})


def _row(study, variant, seed, final):
    return {"study": study, "run_id": f"{variant}-{seed}", "variant": variant, "point": {}, "seed": seed,
            "overrides": {"seed": seed}, "status": "finished" if final is not None else "diverged",
            "final_val": final, "best_val": final, "val_curve": [[10, final]] if final else [], "train_curve": [],
            "seconds": 1.0, "config": {}}


GAP = {200: {"adamw": 0.40, "muon": 0.20}, 800: {"adamw": 0.20, "muon": 0.08}, 3200: {"adamw": 0.10, "muon": 0.02},
       6400: {"adamw": 0.07, "muon": 0.02}}  # 6400: the extra rung (twice the tokens at batch 2)


def ladder_rows(seed_noise=(0.0, 0.004, -0.003)):
    """Tuning rows (seed 0): sync best at 0.002, 2bw best at 0.001 (where its gap is GAP), EF
    recovering 60% there; and the ladder's rows at those picks for three seeds."""
    tune, meas = [], []
    for updates, by_opt in GAP.items():
        for opt, g in by_opt.items():
            for lr in (0.001, 0.002, 0.004):
                sync = 2.0 + abs(math.log2(lr / 0.002)) * 0.05
                delayed = sync + g * (1.0 if lr == 0.001 else 1.5 + (lr == 0.004))
                ef = sync + 0.4 * (delayed - sync)
                for arm, val in (("sync", sync), ("2bw", delayed), ("ef", ef)):
                    name = f"u={updates}/{opt}/lr={lr:g}/{arm}"
                    tune.append(_row("ladder_tune", name, 0, val))
                    if (arm, lr) in (("sync", 0.002), ("2bw", 0.001), ("2bw", 0.002), ("ef", 0.001), ("ef", 0.002)):
                        for seed, noise in enumerate(seed_noise):
                            meas.append(_row("ladder", name, seed, val + noise * (arm != "sync")))
    return tune, meas


def test_complete_picks_ignore_a_grid_still_running():
    tune, _ = ladder_rows()
    variants = [r["variant"] for r in tune]
    assert tuning.complete_picks(tune, "ladder_tune", variants) == tuning.pick_arm_lrs(tune, "ladder_tune")
    partial = [r for r in tune if r["variant"] != "u=200/adamw/lr=0.004/ef"]
    assert "u=200/adamw" not in tuning.complete_picks(partial, "ladder_tune", variants)
    assert "u=200/muon" in tuning.complete_picks(partial, "ladder_tune", variants)


def test_pick_arm_lrs_tunes_every_arm_and_never_a_diverged_lr():
    tune, _ = ladder_rows()
    picks = tuning.pick_arm_lrs(tune, "ladder_tune")
    assert picks["u=200/adamw"] == {"sync": 0.002, "2bw": 0.001, "ef": 0.001}
    tune.append(_row("ladder_tune", "u=200/adamw/lr=0.0005/2bw", 0, None))  # diverged: never picked
    tune.append(_row("ladder_tune", "u=200/adamw/lr=0.0005/sync", 0, 0.5))
    assert tuning.pick_arm_lrs(tune, "ladder_tune")["u=200/adamw"]["2bw"] == 0.001
    assert "u=200/adamw/sync" in tuning.on_grid_edge(tune, "ladder_tune")  # 0.0005 is the grid's low end


def test_ladder_report_gives_gaps_both_ways_the_trend_and_the_paper(tmp_path):
    tune, meas = ladder_rows()
    picks = tuning.pick_arm_lrs(tune, "ladder_tune")
    found = report_ladder.gaps(meas, picks)
    best, at_sync = found[(200, "adamw")]["gap_best"], found[(200, "adamw")]["gap_at_sync"]
    assert best.value == pytest.approx(0.40 + 0.05 + (0.0 + 0.004 - 0.003) / 3, abs=1e-9)  # 2bw@0.001 - sync@0.002
    assert at_sync.value == pytest.approx(0.40 * 1.5 + (0.001) / 3, abs=1e-9)
    assert best.paired and best.n == 3
    share = found[(3200, "muon")]["ef_share_at_sync"]
    assert share.value == pytest.approx(0.6, abs=0.05)
    s = report_ladder.slope(meas, found, "adamw")
    assert s.value < 0 and s.n == 3
    # the slope is the least-squares fit of the best-vs-best gap against log2(updates)
    same_tokens = [u for u in GAP if u in ladder_tune.RUNGS]  # the slope is over the same-token rungs
    xs = [math.log2(u) for u in same_tokens]
    ys = [found[(u, "adamw")]["gap_best"].value for u in same_tokens]
    x_bar, y_bar = sum(xs) / 3, sum(ys) / 3
    fit = sum((x - x_bar) * (y - y_bar) for x, y in zip(xs, ys)) / sum((x - x_bar) ** 2 for x in xs)
    assert s.value == pytest.approx(fit, abs=1e-9)

    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in tune + meas) + "\n")
    text = report_lib.report([path], tmp_path / "rep").read_text()
    assert "| claim | verdict | test | measured | the paper |" in text
    assert "More, smaller updates on the same tokens shrink the delay gap (adamw) | reproduced" in text
    assert "gap, best vs best" in text and "gap at sync's lr" in text
    assert f"| {paper.gap('adamw')} |" in text and "90%" in text  # the paper's figures beside ours
    assert "**0.002: 2.000**" in text  # the sync pick in bold in the grid table
    assert (tmp_path / "rep" / "ladder_gap.png").is_file()
    assert "| adamw | 3200 -> 6400 | 2 | +0.1503 ± 0.0020 | +0.1053 ± 0.0020 | -0.0450 ± 0.0000 |" in text
    assert re.search(r"\| adamw \| 200, 800, 3200 \| -0\.0750 ± 0\.0000 \| [^|]+ \| paired, 3 seeds \| shrinks \|", text)
    assert "| adamw | 200 -> 800 |" in text and "| adamw | 800 -> 3200 |" in text  # the change per interval


def test_ladder_report_without_its_tuning_rows_says_what_is_missing(tmp_path):
    _, meas = ladder_rows()
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in meas) + "\n")
    assert "The `ladder_tune` rows that picked these learning rates are not in this report" in \
        report_lib.report([path], tmp_path / "rep").read_text()


def test_tuned_ladder_table_equals_the_picks_of_its_committed_rows():
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "results" / "cpu_regime" / "results.jsonl"
    if not path.is_file():
        pytest.skip("experiments/results/cpu_regime/results.jsonl is not committed yet")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not tuning.pick_arm_lrs(rows, "ladder_tune"):
        assert common.TUNED_LADDER == {}, "TUNED_LADDER is set but no ladder_tune rows are committed"
        pytest.skip("no ladder_tune rows committed yet")
    complete = tuning.complete_picks(rows, "ladder_tune", ladder_tune.variants())  # a whole grid per arm
    assert common.TUNED_LADDER == complete, f"set common.TUNED_LADDER to {complete}"


def test_stats_contrast_slope_matches_a_paired_regression():
    # one arm pair per rung, two seeds: the contrast's SE is that of the per-seed slopes
    arms = {f"d{u}": [(0, 1.0 / u + 0.01), (1, 1.0 / u - 0.01)] for u in (1, 2, 4)}
    arms.update({f"s{u}": [(0, 0.0), (1, 0.0)] for u in (1, 2, 4)})
    xs = [0.0, 1.0, 2.0]
    c = {f"d{u}": (x - 1.0) / 2.0 for u, x in zip((1, 2, 4), xs)}
    c.update({f"s{u}": -(x - 1.0) / 2.0 for u, x in zip((1, 2, 4), xs)})
    est = stats.contrast(arms, c)
    assert est.paired and est.value == pytest.approx((0.25 - 1.0) / 2.0)


# ---------------------------------------------------------------------------------------------
# The headline studies at cpu_regime: tuned per arm (experiments/studies/tuned.py)


def test_headline_studies_tune_every_arm_on_one_grid_then_measure_the_picks(monkeypatch):
    from experiments.studies import optimizers, tuned

    base = optimizers.base_study("cpu_regime")
    assert {"adamw/ef", "muon/ef", "soap/ef"} <= set(base.variants) and "lion/ef" not in base.variants
    tune = sweep.load_study("optimizers_tune", "cpu_regime")
    assert tune.name == "optimizers_tune" and tune.seeds == lr_study.TUNE_SEEDS
    assert len(tune.variants) == sum(len(lr_study.grid(o["optimizer.name"], "cpu_regime")) for o in base.variants.values())
    assert tune.variants["adamw/lr=0.0011/2bw"] == {**base.variants["adamw/2bw"], "optimizer.lr": 0.0011}
    with pytest.raises(ValueError, match="cpu_regime"):
        sweep.load_study("optimizers_tune", "cpu")
    monkeypatch.delitem(common.TUNED_ARMS["cpu_regime"], "schemes", raising=False)
    with pytest.raises(ValueError, match="schemes_tune"):
        sweep.load_study("schemes", "cpu_regime")  # no picks: the error names the step to run
    assert len(sweep.load_study("optimizers", "cpu_regime").variants) == 22  # its picks are in TUNED_ARMS

    picks = {v: lr_study.grid(o["optimizer.name"], "cpu_regime")[2] for v, o in base.variants.items()}
    picks["adamw/2bw"] = 0.00061  # a delayed arm whose own pick (on its grid) differs from its sync arm's
    measured = tuned.measured_study(base, picks)
    assert measured.seeds == (0, 1, 2)
    assert measured.variants["adamw/2bw"]["optimizer.lr"] == 0.00061
    assert measured.variants["adamw/2bw@sync_lr"]["optimizer.lr"] == 0.0011
    assert "muon/2bw@sync_lr" not in measured.variants  # same pick: one run serves both ways
    assert len(measured.variants) == len(base.variants) + 1
    # the measured runs at seed 0 are the tuning runs (the sweep copies them by config)
    tune_sigs = {sweep.run_signature(tune, r) for r in sweep.expand(tune)}
    seed0 = [r for r in sweep.expand(measured) if r.seed == 0]
    assert all(sweep.run_signature(measured, r) in tune_sigs for r in seed0)


def test_momentum_mitigations_and_schemes_tune_on_three_grid_points_around_the_sync_pick(monkeypatch):
    from experiments.studies import tuned

    picks = common.TUNED_ARMS["cpu_regime"]["optimizers"]
    for name in tuned.LOCAL_GRID:
        tune = sweep.load_study(f"{name}_tune", "cpu_regime")
        by_arm = {}
        for variant, overrides in tune.variants.items():
            prefix, arm = tuned.split(variant)
            by_arm.setdefault((prefix.rpartition("/lr=")[0], arm), []).append(overrides["optimizer.lr"])
        for (prefix, arm), lrs in by_arm.items():
            opt = prefix.split("/")[0]
            full = lr_study.grid(opt, "cpu_regime")
            k = full.index(picks[f"{opt}/sync"])
            # the same three points for every arm of the optimizer, and points of its full grid, so a
            # run the optimizers' tuning made is the same run (reused, not rerun); a setting whose
            # grid an edge pick extended has the extra points beyond them, on the same lattice
            ext = tuned.LOCAL_EXTEND.get(name, {}).get(prefix, ())
            assert set(full[k - 1:k + 2]) <= set(lrs) and len(lrs) == 3 + len(ext), (name, prefix, arm)
            for extra in set(lrs) - set(full[k - 1:k + 2]):
                assert not full[k - 1] < extra < full[k + 1] and (extra in full or not full[0] <= extra <= full[-1])
    assert lr_study.local_grid("adamw", 0.0011) == [0.00061, 0.0011, 0.0018]
    # a setting extended past an edge pick: every arm of it gets the new point, no other setting does
    monkeypatch.setattr(tuned, "LOCAL_EXTEND", {"momentum": {"adamw/beta=0.98": (2,)}})
    lrs = collections.Counter(v.rpartition("/lr=")[0] + "|" + str(o["optimizer.lr"])
                              for v, o in sweep.load_study("momentum_tune", "cpu_regime").variants.items())
    assert lrs["adamw/beta=0.98|0.0032"] == 2 and "adamw/beta=0.95|0.0032" not in lrs
    assert lr_study.local_grid("lion", 0.00034, steps=(0, 1, 2)) == [0.00034, 0.00058, 0.001]
    with pytest.raises(ValueError, match="not a point of adamw's learning-rate grid"):
        lr_study.local_grid("adamw", 0.001)


def test_sync_of_names_the_arm_each_gap_is_taken_against():
    from experiments.studies import momentum, schemes, tuned

    s = schemes.base_study("cpu_regime")
    assert tuned.sync_of(s.variants, "adamw/pipedream/P=4") == "adamw/sync"
    assert tuned.sync_of(s.variants, "adamw/sync") is None
    m = momentum.base_study("cpu_regime")
    assert tuned.sync_of(m.variants, "muon/beta=0.8/2bw") == "muon/beta=0.8/sync"
    assert tuning.parse_arm("adamw/pipedream/lr=0.001/P=4") == ("adamw/pipedream", 0.001, "P=4")


def test_report_gives_the_gap_at_syncs_lr_and_efs_share_beside_the_paper(tmp_path):
    rows = []
    for seed, noise in enumerate((0.0, 0.01, -0.01)):
        for variant, val in (("adamw/sync", 2.0), ("adamw/2bw", 2.3), ("adamw/2bw@sync_lr", 2.4), ("adamw/ef", 2.06),
                             ("muon/sync", 1.8), ("muon/2bw", 1.9), ("muon/ef", 1.84)):
            rows.append(_row("optimizers", variant, seed, val + noise * (not variant.endswith("/sync"))))
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text = report_lib.report([path], tmp_path / "rep").read_text()
    assert "| adamw/2bw | +0.3000 ± 0.0058 | +0.4000 ± 0.0058 | paired, 3 seeds |" in text
    assert "| Error feedback recovers a large part of the gap (adamw) | reproduced |" in text
    assert "| adamw | +0.0600 ± 0.0058 | 80% [76%, 85%] | 90% | paired, 3 seeds |" in text


def test_tuned_arms_tables_equal_the_picks_of_their_committed_rows():
    import pathlib

    from experiments.studies import tuned

    for preset, tables in common.TUNED_ARMS.items():
        path = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "results" / preset / "results.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        for study in sweep.TUNABLE:
            variants = sweep.load_study(f"{study}_tune", preset).variants
            picks = tuned.picks_by_variant(tuning.complete_picks(rows, f"{study}_tune", variants))
            if study in tables or picks:
                assert tables.get(study) == picks, f"set common.TUNED_ARMS[{preset!r}][{study!r}] to {picks}"


def test_readme_paper_section_renders_the_ladder_beside_the_paper(tmp_path, monkeypatch):
    from experiments import render_docs

    tune, meas = ladder_rows()
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in tune) + "\n")
    monkeypatch.setattr(render_docs, "REGIME_RESULTS", path)
    monkeypatch.setattr(render_docs, "_link", lambda target, doc: target.name)  # the rows live outside the repo here
    readme = render_docs.REPO_ROOT / "README.md"
    one_seed = render_docs.paper_regime(readme)
    assert "| 200 x 32 | +0.450 | +0.250 | - |" in one_seed
    assert "| the paper, 360M, ~10^4 updates | +0.278 | +0.012 | +0.027 | 90% | 58%-71% | 67% |" in one_seed
    assert "One seed (the tuning runs)" in one_seed
    path.write_text("\n".join(json.dumps(r) for r in tune + meas) + "\n")
    three = render_docs.paper_regime(readme)
    assert "| 3,200 x 2 | +0.150 ± 0.002 | +0.030 ± 0.002 | - |" in three and "Three seeds, paired" in three
    part = [r for r in meas if r["seed"] == 0 or not r["variant"].startswith("u=200/")]  # one rung at seed 0 only
    path.write_text("\n".join(json.dumps(r) for r in tune + part) + "\n")
    partial = render_docs.paper_regime(readme)
    assert "| 200 x 32 | +0.450 | +0.250 | - |" in partial and "| 3,200 x 2 | +0.150 ± 0.002 |" in partial
    assert "Three seeds where a cell shows ±" in partial


def test_a_study_carried_over_by_its_committed_rows_goes_on_where_it_stopped(tmp_path):
    from helpers import fake_sweep_run, no_prepare

    from asyncpp_jax import configs

    study = sweep.Study("s", "configs/tiny.py", {"a": {}, "b": {"optimizer.lr": 0.002}}, seeds=(0, 1))

    def runner(cmd, workdir, env):  # writes what the CLI leaves, with the run's real resolved config
        inner(cmd, workdir, env)
        run = next(r for r in sweep.expand(study) if r.run_id == workdir.name)
        (workdir / "config.json").write_text(configs.to_json(sweep.run_config(study, run)))
        return 0

    inner = fake_sweep_run(lambda name: 1.0 if name.startswith("a") else 2.0)
    first = sweep.execute(study, tmp_path / "one", runner=runner, log=lambda *_: None, prepare=no_prepare)
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    committed = [r for r in rows if r["run_id"] != "b__seed=1"]  # one run never finished there
    # Another machine: nothing under --out but the committed rows; a row whose settings went stale
    # since is not restored (it runs again).
    committed[0] = {**committed[0], "config": {**committed[0]["config"], "optimizer": {
        **committed[0]["config"]["optimizer"], "lr": 0.5}}}
    restored = sweep.restore(study, committed, tmp_path / "two" / "s", log=lambda *_: None)
    assert restored == ["a__seed=1", "b__seed=0"]
    inner.calls.clear()
    again = sweep.execute(study, tmp_path / "two", runner=runner, log=lambda *_: None, prepare=no_prepare)
    assert inner.calls == ["a__seed=0", "b__seed=1"]
    new_rows = {r["run_id"]: r for r in map(json.loads, again.read_text().splitlines())}
    assert new_rows["b__seed=0"] == committed[2] and new_rows["a__seed=1"] == committed[1]  # verbatim


def test_restoring_a_study_also_restores_the_studies_it_reuses(tmp_path):
    """A study whose runs repeat another's (``ladder``'s seed 0 is ``ladder_tune``'s run), carried
    over by committed rows: the other study's rows are laid out too, so its run is reused."""
    from helpers import fake_sweep_run, no_prepare

    from asyncpp_jax import configs

    src = sweep.Study("src", "configs/tiny.py", {"a": {}}, seeds=(0,))
    dst = sweep.Study("dst", "configs/tiny.py", {"a": {}, "b": {"optimizer.lr": 0.002}}, seeds=(0,))

    def runner_for(study):
        def runner(cmd, workdir, env):
            inner(cmd, workdir, env)
            run = next(r for r in sweep.expand(study) if r.run_id == workdir.name)
            (workdir / "config.json").write_text(configs.to_json(sweep.run_config(study, run)))
            return 0
        return runner

    inner = fake_sweep_run(lambda name: 1.0)
    rows = sweep.execute(src, tmp_path / "one", runner=runner_for(src), log=lambda *_: None, prepare=no_prepare)
    rows = [json.loads(line) for line in rows.read_text().splitlines()]
    inner.calls.clear()
    sweep.restore_with_sources(dst, rows, tmp_path / "two", {"src": src}.get, log=lambda *_: None)
    again = sweep.execute(dst, tmp_path / "two", runner=runner_for(dst), log=lambda *_: None, prepare=no_prepare)
    assert inner.calls == ["b__seed=0"]
    assert {r["run_id"]: r["reused_from"] for r in map(json.loads, again.read_text().splitlines())} == {
        "a__seed=0": "src/a__seed=0", "b__seed=0": None}


def test_sweep_only_runs_the_matching_part_of_a_study(capsys):
    sweep.main(["lr", "--preset=cpu_regime", "--only", "^muon/", "--list"])
    runs = [line for line in capsys.readouterr().out.splitlines() if "--workdir=" in line]
    assert len(runs) == 5 and all("/muon-lr=" in line for line in runs)
    with pytest.raises(SystemExit):
        sweep.main(["lr", "--preset=cpu_regime", "--only", "^nothing", "--list"])


def test_runs_saved_before_init_from_existed_are_still_reused():
    from asyncpp_jax import configs

    study = lr_study.study("cpu_regime")
    run = sweep.expand(study)[0]
    saved = json.loads(configs.to_json(sweep.run_config(study, run)))
    assert saved["model"]["init_from"] == ""
    older = json.loads(json.dumps(saved))
    del older["model"]["init_from"]  # what a run saved before the setting existed holds
    assert sweep.signature(older) == sweep.signature(saved) == sweep.run_signature(study, run)
    saved["model"]["init_from"] = "hf:/some/dir"  # a run that did start from weights is another run
    assert sweep.signature(saved) != sweep.signature(older)
