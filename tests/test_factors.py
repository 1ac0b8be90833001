"""The referee protocol and the factor screen's scheduler, on synthetic rows (nothing is trained)."""

import numpy as np
import pytest

from experiments import protocol, screen, stats
from experiments.studies import factors


def test_tune_state_grows_past_an_edge_until_the_best_is_inside():
    c = 0.001
    pts = {k: protocol.lattice(c, k) for k in range(-6, 6)}
    grid, pick = protocol.tune_state(c, 0, {})
    assert grid == [pts[-1], pts[0], pts[1]] and pick is None
    # best at the low edge: one more point below, nothing picked until it is done
    means = {pts[-1]: 2.0, pts[0]: 2.1, pts[1]: 2.2}
    grid, pick = protocol.tune_state(c, 0, means)
    assert grid == [pts[-2], pts[-1], pts[0], pts[1]] and pick is None
    grid, pick = protocol.tune_state(c, 0, {**means, pts[-2]: 2.05})
    assert pick == pts[-1] and not protocol.on_edge(grid, pick)
    # a diverged point is never picked; the top one diverging keeps the grid from growing upward
    grid, pick = protocol.tune_state(c, 0, {pts[-1]: 2.2, pts[0]: 2.0, pts[1]: None})
    assert pick == pts[0] and len(grid) == 3
    # growth stops at MAX_EXTEND points: the pick is then a bound
    falling = {pts[k]: 3.0 + k for k in range(-6, 2)}
    grid, pick = protocol.tune_state(c, 0, falling)
    assert len(grid) == 3 + protocol.MAX_EXTEND and pick == min(grid) and protocol.on_edge(grid, pick)


def test_tuning_and_measurement_seeds_are_disjoint_and_every_run_has_a_test_split():
    for cell, (base, tune_seeds, k0) in factors.CELLS.items():
        assert not set(tune_seeds) & set(protocol.MEASURE_SEEDS + protocol.MORE_SEEDS), cell
        assert base["train.test_batches"] * base["train.global_batch_size"] == protocol.TEST_SEQUENCES
        # every cell measures the contrast's six arms; a key of k0 outside the known arms would be lost
        assert set(factors.arms(cell)) == set(k0) >= {(o, a) for o in factors.OPTIMIZERS for a in factors.ARMS}
        assert factors.optimizers_of(cell)[:2] == list(factors.OPTIMIZERS)
    # the rest of the optimizers study at width=128 only, EF for the optimizers of the paper's Table 2
    assert [c for c in factors.CELLS if len(factors.optimizers_of(c)) > 2] == ["width=128"]
    assert {a for o, a in factors.arms("width=128") if o == "soap"} == set(factors.ARMS)
    assert all({a for o, a in factors.arms("width=128") if o == opt} == {"sync", "2bw"} for opt in ("adan", "lion", "mars"))
    assert factors.width(512) == {"model.d_model": 512, "model.n_heads": 16, "model.n_kv_heads": 8,
                                  "model.d_ff": 1376}


def _row(study, cell, opt, arm, lr, seed, val):
    return {"study": study, "variant": factors.variant(cell, opt, arm, lr), "seed": seed,
            "overrides": {"optimizer.lr": lr}, "final_val": val, "run_id": ""}


def _tuned_rows(cell, loss):
    """Tuning rows of every arm of ``cell`` with final loss ``loss(opt, arm, lr)``, run on the grids
    the plan asks for, step by step, until every arm has its pick."""
    rows = []
    while True:
        tune_runs, _, picks = screen.plan(cell, rows, [])
        done = {(r["variant"], r["seed"]) for r in rows}
        new = [(s, r) for s, r in tune_runs if (r.variant, r.seed) not in done]
        if not new:
            return rows, picks
        for _, run in new:
            _, opt, lr_part, arm = run.variant.split("/")
            lr = float(lr_part[3:])
            rows.append(_row("factors_tune", cell, opt, arm, lr, run.seed, loss(opt, arm, lr)))


def test_plan_tunes_then_measures_then_adds_seeds_where_the_gap_is_unresolved():
    cell = "width=128"
    best = {"sync": 0.0011, "2bw": 0.00061, "ef": 0.0011}

    def loss(opt, arm, lr):  # a bowl in log lr around each arm's best, equal for both optimizers' lattices
        return 2.0 + (np.log(lr / best[arm])) ** 2

    rows, picks = _tuned_rows(cell, loss)
    assert {r["seed"] for r in rows} == set(factors.CELLS[cell][1])
    for opt in factors.OPTIMIZERS:
        for arm in factors.ARMS:
            grid, pick = picks[(opt, arm)]
            assert pick == min(grid, key=lambda v: abs(np.log(v / best[arm])))
            assert not protocol.on_edge(grid, pick)
    _, measure_runs, _ = screen.plan(cell, rows, [])
    assert {r.seed for _, r in measure_runs} == set(protocol.MEASURE_SEEDS)
    assert len(measure_runs) == len(factors.arms(cell)) * len(protocol.MEASURE_SEEDS)
    # every gap resolved (large, steady) but Muon's (noise): only Muon gets seeds 3 and 4
    noise = {0: 0.01, 1: -0.01, 2: 0.0}
    measured = []
    for _, run in measure_runs:
        _, opt, lr_part, arm = run.variant.split("/")
        gap = (0.002 if opt == "muon" else 0.1) * (arm == "2bw")
        jitter = noise[run.seed] * (opt == "muon" and arm == "2bw")
        measured.append(_row("factors", cell, opt, arm, float(lr_part[3:]), run.seed, 2.0 + gap + jitter + run.seed))
    _, more, _ = screen.plan(cell, rows, measured)
    extra = [r for _, r in more if r.seed in protocol.MORE_SEEDS]
    assert extra and {r.variant.split("/")[1] for r in extra} == {"muon"}
    assert len(extra) == len(factors.ARMS) * len(protocol.MORE_SEEDS)


def test_t_verdict_uses_n_minus_one_degrees_of_freedom():
    est = stats.Estimate(0.05, 0.02, True, 3)  # t = 2.5 < 2.92 at 2 degrees of freedom
    assert stats.verdict(est) == stats.INCONCLUSIVE
    assert stats.verdict(stats.Estimate(0.05, 0.02, True, 5)) == stats.REPRODUCED  # 2.5 > 2.13 at 4
    assert stats.t_critical(3) == pytest.approx(2.919986, abs=1e-5)


def test_screen_runs_the_queue_to_the_end_and_writes_every_row(tmp_path, monkeypatch):
    """The scheduler end to end with a fake runner: tuning (with a grid that grows), measurement,
    extra seeds; rows written as runs finish, and a second start runs nothing again, here or on
    another machine from the merged rows."""
    import json

    from asyncpp_jax import configs
    from experiments import sweep

    monkeypatch.setattr(factors, "OPTIMIZERS", ("adamw",))
    monkeypatch.setattr(factors, "MORE_OPTIMIZERS", ())
    monkeypatch.setattr(factors, "ARMS", ("sync", "2bw"))
    ran = []

    def runner(study, run, out, env):
        _, _, lr_part, arm = run.variant.split("/")
        lr = float(lr_part[3:])
        # sync best at the grid's low edge at first (so its grid grows), 2bw inside; 2bw's gap resolved
        val = 2.0 + abs(np.log(lr / 0.00061)) + (0.3 if arm == "2bw" else 0.0) + 0.001 * (run.seed % 7)
        workdir = out / study.name / run.run_id
        workdir.mkdir(parents=True)
        (workdir / "metrics.jsonl").write_text(json.dumps({"step": 10, "val_loss_per_byte": val}) + "\n")
        (workdir / "config.json").write_text(configs.to_json(sweep.run_config(study, run)))
        (workdir / "status.tmp").write_text(json.dumps({"status": "finished", "val_loss_per_byte": val,
                                                        "test_loss_per_byte": val + 0.01}))
        (workdir / "status.tmp").replace(workdir / "status.json")  # atomically, as the trainer writes it
        ran.append(f"{study.name}/{run.run_id}")
        return 0

    kw = dict(runner=runner, envs=[{}, {}], prepare=lambda study, log: None, log=lambda *_: None)
    screen.execute(tmp_path, ["width=128"], 2, **kw)
    tune = [json.loads(x) for x in (tmp_path / "factors_tune" / "results.jsonl").read_text().splitlines()]
    measured = [json.loads(x) for x in (tmp_path / "factors" / "results.jsonl").read_text().splitlines()]
    assert len(ran) == len(set(ran)) == len(tune) + len(measured)
    sync_lrs = sorted({r["overrides"]["optimizer.lr"] for r in tune if r["variant"].endswith("/sync")})
    assert len(sync_lrs) == 4 and sync_lrs[1] == 0.00061  # grew one point below 0.00061, its first low edge
    assert {r["seed"] for r in tune} == {100, 101} and {r["seed"] for r in measured} == {0, 1, 2}
    assert all(r["test_val"] == pytest.approx(r["final_val"] + 0.01) for r in measured)
    assert {r["variant"] for r in measured} == {"width=128/adamw/lr=0.00061/sync", "width=128/adamw/lr=0.00061/2bw"}
    ran.clear()
    screen.execute(tmp_path, ["width=128"], 2, **kw)
    assert ran == []
    # carried to another machine by committed rows: merged beside another study's, restored, nothing reruns
    results = tmp_path / "committed.jsonl"
    results.write_text(json.dumps({"study": "lr", "variant": "adamw/lr=0.001/sync", "seed": 0}) + "\n")
    screen.merge(tmp_path, ["width=128"], results)
    merged = [json.loads(x) for x in results.read_text().splitlines()]
    assert merged[0]["study"] == "lr" and len(merged) == 1 + len(tune) + len(measured)
    elsewhere = tmp_path / "elsewhere"
    screen.restore(elsewhere, ["width=128"], merged)
    screen.execute(elsewhere, ["width=128"], 2, **kw)
    assert ran == []
    again = [json.loads(x) for x in (elsewhere / "factors" / "results.jsonl").read_text().splitlines()]
    assert again == measured


def test_fieller_interval_ends_are_where_the_linear_test_turns():
    """Each end r of the interval makes the contrast A - r B exactly t standard errors from 0, the
    share is 1 - that ratio, and an unresolved denominator gives no ratio."""
    rng = np.random.default_rng(1)
    arms = {v: [(s, base + 0.01 * s + rng.normal(0, 0.01)) for s in range(3)]
            for v, base in (("sync", 1.0), ("2bw", 1.2), ("ef", 1.06))}
    num, den = {"ef": 1.0, "sync": -1.0}, {"2bw": 1.0, "sync": -1.0}
    r = stats.fieller(arms, num, den)
    assert r.resolved and r.lo < r.value < r.hi
    t = stats.t_critical(3)
    for end in (r.lo, r.hi):
        c = stats.contrast(arms, {"ef": 1.0, "2bw": -end, "sync": -1.0 + end})
        assert abs(c.value) == pytest.approx(t * c.se, rel=1e-6)
    s = stats.share(arms, "ef", "2bw", "sync")
    assert (s.value, s.lo, s.hi) == pytest.approx((1 - r.value, 1 - r.hi, 1 - r.lo))
    flat = {**arms, "2bw": [(s, v + 0.001 * (-1) ** s) for s, v in arms["sync"]]}  # a gap lost in noise
    assert not stats.share(flat, "ef", "2bw", "sync").resolved


def test_the_screens_section_gives_gaps_ratio_shares_and_the_width_trend(tmp_path):
    """Synthetic measured rows of two widths: AdamW's gap doubles per doubling of width, Muon's stays,
    so the ratio moves toward the paper's and the conclusion names width."""
    import json
    from experiments import render_docs, report as report_lib, report_factors

    gaps = {("width=128", "adamw"): 0.06, ("width=128", "muon"): 0.02,
            ("width=512", "adamw"): 0.24, ("width=512", "muon"): 0.02}
    rows = []
    for (cell, opt), g in gaps.items():
        for seed, noise in enumerate((0.0, 0.002, -0.002)):
            for arm, extra in (("sync", 0.0), ("2bw", g + noise), ("ef", 0.2 * g + noise / 2)):
                val = 1.5 + extra + 0.01 * seed
                rows.append({"study": "factors", "run_id": f"{cell}-{opt}-{arm}-{seed}",
                             "variant": factors.variant(cell, opt, arm, 0.001), "seed": seed, "point": {},
                             "overrides": {"optimizer.lr": 0.001}, "final_val": val, "test_val": val + 0.05,
                             "val_curve": [[3200, val]], "train_curve": [], "config": {}, "status": "finished"})
    e = report_factors.cell_estimates(rows, "width=512")
    assert e["opts"]["adamw"]["gap"].value == pytest.approx(0.24) and e["ratio"].value == pytest.approx(12.0)
    assert e["opts"]["adamw"]["share"].value == pytest.approx(0.8)
    slope = report_factors.gap_slope(rows, report_factors.AXES["width (d_model)"], "adamw")
    assert slope.value == pytest.approx((0.24 - 0.06) / 2)  # per doubling, over two doublings
    change = report_factors.gap_change(rows, "width=128", "width=512", "adamw")
    assert change.value == pytest.approx(0.18) and change.n == 3
    assert report_factors.gap_change(rows, "width=128", "width=512", "muon").value == pytest.approx(0.0, abs=1e-12)
    assert report_factors.gap_change(rows, "width=128", "seqs=8", "adamw") is None
    change, first, last = report_factors.ratio_change(rows, report_factors.AXES["width (d_model)"])
    assert change.value == pytest.approx((12.0 - 3.0) / 2) and (first, last) == ("width=128", "width=512")
    said = " ".join(report_factors.conclusion(rows))
    assert "these factors move the ratio toward the paper's" in said and "width (d_model)" in said
    assert report_factors.headline(rows).startswith("At these sizes, these factors move the ratio")
    compact = "\n".join(report_factors.answer_table(rows, factors.ORDER))
    assert "| width=512 | +0.240 ± 0.001 | +0.020 ± 0.001 | 12.00 [" in compact and "| 80% [" in compact
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report_lib.report([path], tmp_path / "rep").read_text()
    assert "## The factor screen: what makes the gap large?" in text and "| width=512 | G_AdamW / G_Muon |" in text
    assert render_docs.RENDERERS["factors_answer"] and render_docs.RENDERERS["gpu_plan"]


def test_progress_calls_a_cell_measured_only_when_every_arm_has_its_seeds():
    from experiments import report_factors

    rows = [_row("factors", "width=128", o, a, 0.001, seed, 1.5) for o in factors.OPTIMIZERS for a in factors.ARMS
            for seed in protocol.MEASURE_SEEDS]
    rows += [_row("factors", "width=256", "adamw", "sync", 0.001, seed, 1.5) for seed in protocol.MEASURE_SEEDS]
    tune = [_row("factors_tune", "updates=800", "adamw", "sync", 0.001, 100, 1.5)]
    said = report_factors.progress(tune, rows)
    assert "more): width=128; measuring: width=256; tuning: updates=800; not started" in said
    assert "width=256" not in said.split("measuring")[0]
    rows = rows[1:]  # width=128's first arm short of a seed
    assert "more): none; measuring: width=128, width=256;" in report_factors.progress(tune, rows)
    states = report_factors.cell_states(tune, rows)
    assert (states["width=128"], states["width=256"], states["updates=800"]) == ("measuring", "measuring", "tuning")
    assert states["seqs=8"] == "queued" and all(states[c] == "cut" for c in factors.CUT)
    # a cut cell named with --cells and run is no longer "cut": its rows say what it is
    assert report_factors.cell_states(tune + [_row("factors_tune", "width=512", "adamw", "sync", 0.001, 100, 1.5)],
                                      rows)["width=512"] == "tuning"


def test_parameters_follow_the_cells_width():
    """The counts the docs quote (0.76M -> 3.0M -> 11.7M); the BPE cell's larger (tied) table adds
    (4,096 - 257) x 128 to width 128's."""
    assert [factors.parameters(c) for c in ("width=128", "width=256", "width=512")] == [759040, 2968064, 11736064]
    assert factors.parameters("seqs=8") == 759040
    assert factors.parameters("vocab=bpe4096") - 759040 == (4096 - 257) * 128


def test_no_import_circle_in_experiments():
    """Every import between the modules of experiments/ (lazy ones inside functions too) forms no
    cycle: a study module never imports the sweep that loads it, nor the report that reads it."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    modules = {".".join(p.relative_to(root).with_suffix("").parts): p
               for p in sorted((root / "experiments").rglob("*.py")) if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("experiments"):
                deps |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = sorted(d for d in deps if d in modules and d != name)
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in graph[node]:
            assert state.get(dep) != "open", f"import circle: {' -> '.join(stack + [node, dep])}"
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [])
    assert "experiments.sweep" in graph["experiments.screen"] and graph["experiments.study"] == []


def test_the_headline_arms_run_first_and_are_measured_before_efs_arm_is_tuned():
    cell = "width=128"
    first = screen.ordered(*screen.plan(cell, [], [])[:2])
    arms = [r.variant.rsplit("/", 1)[-1] for _, r in first]
    assert arms.index("ef") == len([a for a in arms if a != "ef"])  # every sync and 2bw run before any EF run
    rows, _ = _tuned_rows(cell, lambda opt, arm, lr: 2.0 + np.log(lr / 0.001) ** 2)
    headline = [r for r in rows if not r["variant"].endswith("/ef")]
    order = screen.ordered(*screen.plan(cell, headline, [])[:2])
    kinds = [(s.name, r.variant.rsplit("/", 1)[-1]) for s, r in order]
    measured = [i for i, k in enumerate(kinds) if k[0] == "factors"]
    ef_tuning = [i for i, k in enumerate(kinds) if k == ("factors_tune", "ef")]
    assert measured and ef_tuning and max(measured) < min(ef_tuning)


def test_every_cells_contrast_runs_before_the_other_optimizers(tmp_path):
    """width=128's SOAP, Adan, Lion and MARS wait until no cell has an AdamW or Muon run to do."""
    s = screen.Screen(tmp_path, ["width=128", "updates=800"])
    s.refresh()
    opts = [(r.variant.split("/")[0], r.variant.split("/")[1]) for _, r in s.next_runs()]
    first_more = next(i for i, (_, o) in enumerate(opts) if o not in factors.OPTIMIZERS)
    assert {c for c, o in opts[:first_more]} == {"width=128", "updates=800"}
    assert all(o in factors.MORE_OPTIMIZERS for _, o in opts[first_more:])
    assert {o for _, o in opts[first_more:]} == set(factors.MORE_OPTIMIZERS)


def test_the_optimizers_table_shows_every_optimizer_of_the_cell_beside_the_paper():
    from experiments import report_factors

    rows = []
    for opt, arms in (("adamw", factors.ARMS), ("muon", factors.ARMS), ("soap", factors.ARMS), ("lion", ("sync", "2bw"))):
        for seed in protocol.MEASURE_SEEDS:
            for arm in arms:
                extra = {"sync": 0.0, "2bw": 0.05, "ef": 0.01}[arm] + 0.001 * seed * (arm == "2bw")
                rows.append({**_row("factors", "width=128", opt, arm, 0.001, seed, 1.5 + extra + 0.01 * seed),
                             "test_val": 1.6 + extra + 0.01 * seed})
    table = "\n".join(report_factors.optimizers_table(rows))
    assert "| SOAP | 1.510 | +0.051 ± 0.001 | +0.051 ± 0.001 | +0.010 ± 0.000 | +0.027 | 80% [" in table
    assert "| Lion | 1.510 | +0.051 ± 0.001 |" in table and "- (no EF arm)" in table
    assert "| Adan | - | not measured yet | - | - | +0.010 | - | - |" in table
    # SOAP's EF arm is queued but not measured: the share waits for it, it is not absent
    no_soap_ef = [r for r in rows if not r["variant"].startswith("width=128/soap/") or not r["variant"].endswith("/ef")]
    assert "| SOAP | 1.510 | +0.051 ± 0.001 | +0.051 ± 0.001 | - | +0.027 | not measured yet | 67% |" in "\n".join(
        report_factors.optimizers_table(no_soap_ef))
    # the contrast's tables keep to AdamW and Muon
    assert "soap" not in "\n".join(report_factors.cell_table(rows, ["width=128"]))
    said = report_factors.progress([], rows)
    assert "width=128's other optimizers (run after every cell's contrast), measured: soap, lion; not yet: adan, mars." in said


def test_pilot_prices_every_cell_and_the_cut_cells_leave_the_queue(tmp_path):
    """Each cell's pilots are its sync runs of each optimizer at the pilot's length (the cell's other
    settings kept) and leave one record each naming the cell; a cut cell is priced but never queued."""
    import json

    from experiments import records

    assert not set(factors.CUT) & set(factors.QUEUE) and set(factors.ORDER) == set(factors.CELLS)
    commands = {}

    def runner(cmd, workdir, env):
        flags = dict(a[len("--config."):].split("=", 1) for a in cmd if a.startswith("--config."))
        commands[workdir.name.split("__")[0]] = flags
        steps = int(flags["train.steps"])
        (workdir / "status.json").write_text(json.dumps({"status": "finished", "step": steps, "val_loss": 2.0,
                                                         "val_loss_per_byte": 2.0}))
        (workdir / "config.json").write_text(json.dumps({"optimizer": {"name": flags["optimizer.name"]}}))
        (workdir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_time": 0.5, "tokens_per_sec": 1.0})
                                                       + "\n" for s in range(10, steps + 1, 10)))
        return 0

    out = tmp_path / "pilot.jsonl"
    cells = ["width=128", "updates=200", "seqs=32"]
    screen.run_pilots(cells, 2, tmp_path, out, log=lambda *_: None, runner=runner, envs=[{}, {}],
                      prepare=lambda study, log: None)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["cell"], r["figures"]["optimizer"]) for r in recs) == sorted(
        (c, o) for c in cells for o in factors.OPTIMIZERS)
    for cell in cells:
        base = factors.CELLS[cell][0]
        for opt in factors.OPTIMIZERS:
            flags = commands[f"{cell}-{opt}"]
            updates = min(screen.PILOT_UPDATES, base["train.steps"])
            assert int(flags["train.steps"]) == updates and int(flags["train.eval_every"]) == updates // 10
            assert int(flags["train.global_batch_size"]) == base["train.global_batch_size"]
            assert int(flags["model.d_model"]) == base["model.d_model"] and flags["staleness.mode"] == "sync"
            assert flags["optimizer.name"] == opt and float(flags["optimizer.lr"]) == factors.centre(cell, opt)
    assert all(set(records.KEYS) <= set(r) and r["figures"]["s_per_update"] == 0.5 for r in recs)


def test_a_cut_cell_runs_only_when_named(tmp_path, capsys):
    screen.main(["--out", str(tmp_path), "--list"])
    default = capsys.readouterr().out.split()
    assert default and not any(line.split("/")[1].startswith(tuple(factors.CUT)) for line in default)
    screen.main(["--out", str(tmp_path), "--list", "--cells", "width=512"])
    named = capsys.readouterr().out.split()
    assert named and all(line.split("/")[1].startswith("width=512-") for line in named)


def test_update_size_takes_exact_spectral_norms_and_the_2bw_arm_at_its_pick():
    from experiments import update_size

    # a stack of two matrices: diag(3, -5) and the rank-1 u v^T, |u| = 5, |v| = sqrt(2)
    stack = np.array([[[3.0, 0.0], [0.0, -5.0]], [[3.0, 3.0], [4.0, 4.0]]])
    assert update_size.spectral_norms(stack) == pytest.approx([5.0, 5.0 * np.sqrt(2.0)], rel=1e-12)
    # stable rank: 1 for a rank-one matrix, n for an orthogonal n x n one
    assert update_size.stable_rank(stack[1:]) == pytest.approx([1.0]) and update_size.stable_rank(np.eye(3)[None]) == pytest.approx([3.0])
    after = stack + np.array([[[0.5, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    assert update_size.relative_step(stack, after) == pytest.approx([0.1, 0.0], abs=1e-12)
    # medians over the sampled updates, of each kernel and of the mean over kernels (2, 4, 6)
    s = update_size.summary({"attn/q": [1.0, 3.0, 2.0], "mlp/up": [3.0, 5.0, 10.0]})
    assert s == {"median_relative_step": 4.0, "per_kernel": {"attn/q": 2.0, "mlp/up": 5.0}}
    assert update_size.summary({"attn/q": [1.0, 3.0], "mlp/up": [3.0, 5.0]}, [0, 160])["series"] == [[0, 2.0], [160, 4.0]]
    assert update_size.summary({"attn/q": [1.0]}, [0], {"attn/q": [7.0]})["median_stable_rank"] == 7.0
    r = update_size.ratios({"width=128/adamw": {"lr": 0.001, "median_relative_step": 4.0},
                            "width=128/muon": {"lr": 0.002, "median_relative_step": 2.0},
                            "width=256/adamw": {"lr": 0.0003, "median_relative_step": 2.0},
                            "width=256/adamw/lr=0.001": {"lr": 0.001, "median_relative_step": 6.0},
                            "width=256/muon": {"lr": 0.002, "median_relative_step": 3.0}})
    assert r == {"width=128: adamw / muon": 2.0, "width=256: adamw / muon": pytest.approx(2 / 3),
                 "adamw: width=256 / width=128": 0.5, "adamw: width=256 / width=128 at lr 0.001": 1.5,
                 "muon: width=256 / width=128": 1.5}
    # the 2bw arm's config at the pick its tuning rows give, at the measurement seed
    cell, seeds = "width=256", factors.CELLS["width=256"][1]
    grid, _ = factors.tuning_state(cell, "adamw", "2bw", [])
    rows = [_row("factors_tune", cell, "adamw", "2bw", lr, s, 2.0 + abs(k - 1)) for k, lr in enumerate(grid) for s in seeds]
    pick = update_size.pick_of(cell, "adamw", rows)
    config = update_size.arm_config(cell, "adamw", pick, 1)
    assert pick == grid[1] and config.optimizer.lr == pick and config.seed == 1
    assert config.staleness.mode == "2bw" and config.model.d_model == 256


def test_pilot_refuses_optimizers_no_named_cell_measures(tmp_path, capsys):
    for bad in ("sgd", "soap"):  # unknown; known but measured at width=128 only
        with pytest.raises(SystemExit) as e:
            screen.main(["--out", str(tmp_path), "--pilot", "--cells", "width=256", "--pilot_optimizers", bad])
        assert e.value.code == 2 and "--pilot_optimizers" in capsys.readouterr().err


def test_an_axis_of_three_cells_gives_each_interval_and_the_lines_lack_of_fit():
    from experiments import report_factors

    gaps = {"updates=200": 0.5, "updates=800": 0.2, "width=128": 0.1}  # a bent line: -0.15, then -0.05 per doubling
    rows = []
    for i, (cell, g) in enumerate(gaps.items()):
        for seed, noise in enumerate((0.0, 0.0002, -0.0002)):
            for arm, extra in (("sync", 0.0), ("2bw", g + noise * (i + 1) ** 2)):
                rows.append(_row("factors", cell, "adamw", arm, 0.001, seed, 1.5 + extra + 0.01 * seed))
    axis = report_factors.AXES["updates on the same tokens"]
    steps = report_factors.gap_intervals(rows, axis, "adamw")
    assert [(a, b) for a, b, _ in steps] == [("updates=200", "updates=800"), ("updates=800", "width=128")]
    assert [e.value for _, _, e in steps] == pytest.approx([-0.15, -0.05])
    assert report_factors.gap_bend(rows, axis, "adamw").value == pytest.approx(0.1)  # -0.05 - (-0.15)
    assert report_factors.gap_slope(rows, axis, "adamw").value == pytest.approx((0.1 - 0.5) / 4)
    assert report_factors.gap_bend(rows, report_factors.AXES["width (d_model)"], "adamw") is None
    said = " ".join(report_factors.axis_table(rows)[1])
    # the first interval's SE (0.00015) gets a fourth decimal: a standard error never prints as 0
    assert "AdamW's gap changes per doubling by -0.1500 ± 0.0002 (updates=200 -> updates=800)" in said
    # per seed the bend's noise is 0.5 n - 4 n + 4.5 n = n, so its SE is 0.0002 / sqrt(3)
    assert "then -0.0500 ± 0.0003 (updates=800 -> width=128); lack of fit +0.1000 ± 0.0001 (the line bends)" in said
    assert stats.slope_weights([0.0, 1.0, 2.0]) == pytest.approx([-0.5, 0.0, 0.5])
    assert stats.bend_weights([0.0, 2.0, 4.0]) == pytest.approx([0.5, -1.0, 0.5])


def test_the_protocols_rows_decide_the_claims_they_test_and_head_the_readmes_table(tmp_path, monkeypatch):
    """AdamW and Muon measured under the protocol, SOAP one seed short: the claims on AdamW and Muon
    and the README's rows for them come from the protocol's rows; SOAP's stay the earlier study's, marked."""
    import json
    from experiments import render_docs, report as report_lib, report_factors

    def row(study, variant, seed, val, test=None):
        return {"study": study, "variant": variant, "seed": seed, "run_id": f"{study}-{variant}-{seed}", "point": {},
                "overrides": {}, "final_val": val, "test_val": test, "val_curve": [[1600, val], [3200, val]],
                "train_curve": [], "config": {}, "status": "finished"}

    early = {"adamw": 0.09, "muon": 0.01, "soap": 0.02}  # the earlier study: a ratio of 9
    proto = {"adamw": 0.06, "muon": 0.02, "soap": 0.03}  # the protocol: a ratio of 3
    rows = []
    for seed in protocol.MEASURE_SEEDS:
        for opt in early:
            for arm, share in (("sync", None), ("2bw", 0.0), ("ef", 0.5)):
                g = lambda gap: 0.0 if share is None else gap * (1 - share) + 0.001 * seed  # noqa: E731
                rows.append(row("optimizers", f"{opt}/{arm}", seed, 1.5 + g(early[opt]) + 0.01 * seed))
                if opt != "soap" or seed != protocol.MEASURE_SEEDS[-1]:
                    rows.append(row("factors", factors.variant("width=128", opt, arm, 0.001), seed,
                                    1.4 + g(proto[opt]) + 0.01 * seed, 1.45 + g(proto[opt]) + 0.01 * seed))
    measured = [r for r in rows if r["study"] == "factors"]
    assert {r["variant"] for r in report_factors.protocol_rows(measured)} == \
        {f"{o}/{a}" for o in ("adamw", "muon") for a in factors.ARMS}

    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report_lib.report([path], tmp_path / "rep").read_text()
    claims = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ") and " | " in line}
    assert "`factors` width=128 (protocol): G_AdamW +0.0610 ± 0.0006" in claims["AdamW's delay gap is far larger than Muon's"]
    assert "`factors` width=128 (protocol): c =" in claims["Error feedback recovers a large part of the gap (muon)"]
    assert "`optimizers`: c =" in claims["Error feedback recovers a large part of the gap (soap)"]
    assert "its rows decide it" in text
    # the body keeps the studies' alphabetical order whatever order the claims were decided in
    assert text.index("## The factor screen") < text.index("## Study `optimizers`")

    monkeypatch.setattr(render_docs, "_regime_rows", lambda: rows)
    table = render_docs.paper_optimizers(render_docs.REPO_ROOT / "README.md")
    assert "| AdamW | 1.410 | +0.061 ± 0.001 | +0.061 ± 0.001 | +0.278 | 49% [" in table
    assert f"| SOAP {render_docs.EARLIER} | 1.510 | +0.021 ± 0.001 | - | +0.027 |" in table
    assert "2.90 [" in table and "(test split)" in table and "Not yet measured under the protocol" in table
    summary = render_docs.paper_summary(render_docs.REPO_ROOT / "README.md")
    assert summary.startswith("Under the protocol, AdamW's gap is 2.90 [") and "The earlier protocol's rows" in summary
