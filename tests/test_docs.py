"""The docs stay true to the code: rendered tables, named modules and paths, and every documented command.

- Every measured table in README.md and docs/*.md matches the records it is rendered from
  (``python -m experiments.render_docs --check``), and every record says where its figures came from.
- Every module docstring names only modules and paths that exist (dotted names under asyncpp_jax
  and experiments such as ``asyncpp_jax.train.step``, paths such as ``asyncpp_jax/train/step.py``
  or ``train/step.py`` inside the package; a ``.jsonl`` or ``.json`` path may be an output not yet
  written); so do the README and the docs pages, their links included.
- Every command in README.md and docs/*.md parses: ``python -m asyncpp_jax.main`` flags through the
  same absl/ml_collections flags as the CLI, then ``configs.validate``; every argparse script through
  its own parser (stopped right after parsing); each script's ``--help`` runs. The CLI's ``--dry_run``
  of the tiny config runs in tests/test_shipped_configs_fit.py (test_each_config_fits_its_stated_hardware),
  so it is not run twice here. The README's optax loop runs.
- The README stays a front door: short, the CI command byte for byte, the notebooks on its first
  screen, no dated diary.
- Every figure ``x ± y`` typed in the prose of README.md, docs/studies.md and experiments/README.md
  (outside the rendered blocks) is one a committed study report prints, rounded once.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import inspect
import io
import json
import pathlib
import re
import shlex
import subprocess
import sys

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from asyncpp_jax import configs
from experiments import records, render_docs

ROOT = configs.REPO_ROOT
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES]
SOURCE_DIRS = ("asyncpp_jax", "experiments", "tests", "configs", "notebooks")
TOP = ("asyncpp_jax", "experiments", "tests", "configs", "docs", "notebooks")
STUDY_DOCS = [README, ROOT / "docs" / "studies.md", ROOT / "docs" / "delay.md", ROOT / "experiments" / "README.md"]
DIARY = re.compile(r"this (shared )?machine|that day|was slower|20[0-9][0-9]-[01][0-9]-[0-3][0-9]")


# ---- rendered tables and their records ----------------------------------------------------------


def test_rendered_tables_match_their_records():
    assert render_docs.check() == "", "run python -m experiments.render_docs"


def test_a_table_on_typed_records_says_so_in_the_table():
    """--check passes on figures typed by hand as well as on measured ones, so a table resting on
    typed records must say so in its own lines, not only in the footnote under it."""
    unmarked = []
    for doc in DOCS:
        for m in render_docs.BLOCK.finditer(render_docs.render(doc.read_text(), doc)):
            body = m.group("body")
            table = [line for line in body.splitlines() if line.startswith("|")]
            if table and "typed by hand from" in body and not any(render_docs.TYPED_MARK in line for line in table):
                unmarked.append(f"{doc.name}: {m.group('name')}")
    assert not unmarked, unmarked
    fit = render_docs.fit_table(ROOT / "docs" / "fitting.md")
    typed_rows = [line for line in fit.splitlines() if line.startswith("| ") and render_docs.TYPED_MARK in line]
    assert typed_rows and all("(typed by hand)" in row.split(" | ")[0] for row in typed_rows)


def test_rendering_restores_a_changed_figure():
    text = README.read_text()
    m = re.search(r"delay gap AdamW (\+\d\.\d{3})", text)
    assert m, "the README's glance table names AdamW's delay gap"
    changed = text.replace(m.group(0), "delay gap AdamW +9.999")
    assert render_docs.render(changed, README) == text
    with pytest.raises(KeyError, match="no renderer named 'nope'"):
        render_docs.render("<!-- render:nope -->\n<!-- end:nope -->", README)


def test_a_new_measured_record_replaces_the_typed_figures(tmp_path, monkeypatch):
    import shutil

    shutil.copytree(records.BENCH_DIR, tmp_path / "bench")
    monkeypatch.setattr(records, "BENCH_DIR", tmp_path / "bench")
    old = records.load("bench_pipeline", "bench_pipeline_compile")[-1]
    records.append(tmp_path / "bench" / "bench_pipeline.jsonl", records.make(
        "bench_pipeline_compile", {**old["figures"], "twice_depth": 1.234}, command="python -m experiments.bench_pipeline compile"))
    job = records.load("main_job")[-1]
    records.append(tmp_path / "bench" / "main_job.jsonl", records.make(
        "main_job", {"wall_s": 1000.0, "s_per_update": 2.0, "final_val_nats_per_byte": 1.25, "updates": 500},
        command=job["command"]))
    page = (ROOT / "docs" / "pipeline.md").read_text()
    rendered = render_docs.render(page, ROOT / "docs" / "pipeline.md")
    assert "| twice the depth | 1.23× |" in rendered and "1 measured and written by the script as it ran" in rendered
    assert f"| twice the depth | {old['figures']['twice_depth']:.2f}× |" in page  # the record it replaces
    rendered = render_docs.render(README.read_text(), README)
    assert "to 16 min 40 s end to end" in rendered and "loss of 1.250 to" in rendered


def test_every_record_says_where_its_figures_came_from():
    files = sorted(records.BENCH_DIR.glob("*.jsonl"))
    assert files
    for path in files:
        rows = records.load(path.stem)
        assert rows, path
        for row in rows:
            assert row["source"] == "measured" or row["source"].startswith("typed by hand from "), (path, row)
            assert row["command"] and row["hardware"] and isinstance(row["figures"], dict), (path, row)
            if row["source"] == "measured":
                assert row["commit"] and row["date"], (path, row)


def test_a_record_written_by_a_script_has_every_field(tmp_path):
    rec = records.make("demo", {"ratio": 1.0}, command="python -m experiments.demo")
    records.append(tmp_path / "x.jsonl", rec)
    (row,) = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert set(records.KEYS) <= set(row) and row["source"] == "measured" and row["figures"] == {"ratio": 1.0}
    assert records.command_line([str(ROOT / "experiments" / "bench_pipeline.py"), "work", "--rows", "8"]) == \
        "python -m experiments.bench_pipeline work --rows 8"
    with pytest.raises(ValueError, match="a record needs figures"):
        records.append(tmp_path / "y.jsonl", {k: "" for k in records.KEYS if k != "figures"})


def test_record_run_reads_a_runs_figures(tmp_path):
    from experiments import record_run

    (tmp_path / "status.json").write_text(json.dumps({
        "status": "finished", "step": 500, "val_loss": 1.29, "val_loss_per_byte": 1.288,
        "unigram": {"train_entropy": 3.248, "val_cross_entropy": 3.312}}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "step_time": t, "tokens_per_sec": 4096 / t})
                                                      for s, t in ((1, 9.0), (2, 1.0), (3, 1.0))) + "\n")
    f = record_run.figures_from_workdir(tmp_path)
    assert f == {"status": "finished", "updates": 500, "final_val_nats_per_byte": 1.288, "final_val_nats_per_token": 1.29,
                 "unigram_entropy_train_nats_per_byte": 3.248, "unigram_xent_val_nats_per_byte": 3.312,
                 "s_per_update": 1.0, "tokens_per_s": 4096.0}
    assert record_run.workdir_of(["-m", "asyncpp_jax.main", "--workdir=runs/x"]) == pathlib.Path("runs/x")
    assert record_run.workdir_of(["-m", "asyncpp_jax.main", "--config=configs/moe_tiny.py"]) == \
        pathlib.Path("runs/moe_tiny")
    stdout = "\n".join(["I0 log line", *records.load("dry_run", "dry_run")[0]["figures"]["stdout"], "done"])
    d = record_run.figures_from_dry_run(stdout)
    assert d["stdout"][0].startswith("dry run of moe10b") and d["stdout"][-1].startswith("  target") and \
        d["compile_s"] == 11.0
    with pytest.raises(ValueError, match="no dry-run report"):
        record_run.figures_from_dry_run("Traceback ...")
    assert record_run.figures_from_pytest("....\n569 passed, 2 skipped, 46 deselected in 710.12s (0:11:50)\n") == {
        "tests_default": 571, "passed": 569, "failed": 0, "skipped": 2, "errors": 0, "tests_all": 617, "tests_slow": 46,
        "pytest_s": 710.12}
    assert record_run.figures_from_pytest("no tests ran in 0.01s") == {}


# ---- modules and paths named in docstrings and docs ---------------------------------------------


@functools.cache
def _top_level_names(path: pathlib.Path) -> frozenset:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _dotted_problem(name: str) -> str | None:
    """None if ``a.b.c`` is a module of the repository, or a module followed by a name it defines."""
    parts, here = name.split("."), ROOT
    for i, part in enumerate(parts):
        if (here / part).is_dir() and (here / part / "__init__.py").exists():
            here = here / part
            continue
        if (here / f"{part}.py").exists():
            module = here / f"{part}.py"
            rest = parts[i + 1:]
            if rest and rest[0] not in _top_level_names(module):
                return f"{'.'.join(parts[:i + 1])} defines no {rest[0]}"
            return None
        if i == 0:
            return f"no module {part}"
        init = here / "__init__.py"
        return None if part in _top_level_names(init) else f"{'.'.join(parts[:i])} has no {part}"
    return None


def _path_problem(path: str, base: pathlib.Path) -> str | None:
    path = path.rstrip(".,:;)").split("::")[0]
    if any(c in path for c in "*?<>{}") or path.startswith("runs/") or path.endswith((".jsonl", ".json")):
        return None  # a pattern, a run's output, or a record a script may write
    for root in (base, ROOT, ROOT / "asyncpp_jax", ROOT / "experiments"):
        if (root / path).exists():
            return None
    return f"no file {path}"


DOTTED = re.compile(r"(?<![\w./-])((?:asyncpp_jax|experiments)(?:\.[A-Za-z_]\w*)+)")
PATHS = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w|(?:models|data|optim|pipeline|train|studies)/\w+\.py)(?![\w/<])"
                   % "|".join(TOP))


def _mentions(text: str, base: pathlib.Path) -> list[str]:
    problems = []
    for m in DOTTED.finditer(text):
        name = m.group(1)
        if re.search(r"\.(py|md|jsonl|json|ipynb|txt|png)$", name):
            continue
        p = _dotted_problem(name)
        if p:
            problems.append(f"{name}: {p}")
    for m in PATHS.finditer(text):
        p = _path_problem(m.group(1), base)
        if p:
            problems.append(p)
    return problems


DOCSTRING = re.compile(r"\A(?:\s*#[^\n]*\n|\s)*[rR]?(\"\"\"|\'\'\')(.*?)\1", re.S)


def _source_files() -> list[pathlib.Path]:
    """The repository's tracked Python files (every one on disk outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", *[f"{d}/*.py" for d in SOURCE_DIRS]], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
        return [ROOT / p for p in out if (ROOT / p).exists()]
    except (OSError, subprocess.CalledProcessError):
        return [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]


def _module_docstrings():
    for path in _source_files():
        m = DOCSTRING.match(path.read_text())  # the module docstring, without parsing the whole file
        if m:
            yield path, m.group(2)


def test_module_docstrings_name_only_existing_modules():
    bad = [f"{path.relative_to(ROOT)}: {p}" for path, doc in _module_docstrings() for p in _mentions(doc, path.parent)]
    assert not bad, "\n".join(bad)


def test_the_name_check_catches_a_stale_name():
    assert _mentions("see asyncpp_jax.train.step and asyncpp_jax/train/step.py", ROOT) == []
    assert _mentions("asyncpp_jax.optim.delay, asyncpp_jax.train_state.TrainState", ROOT) == []
    assert _mentions("asyncpp_jax.pipeline.tick_tables", ROOT) == [
        "asyncpp_jax.pipeline.tick_tables: asyncpp_jax.pipeline has no tick_tables"]
    assert _mentions("asyncpp_jax.train.step.make_pipeline_step", ROOT) == [
        "asyncpp_jax.train.step.make_pipeline_step: asyncpp_jax.train.step defines no make_pipeline_step"]
    assert _mentions("pipeline/tick_tables.py", ROOT) == ["no file pipeline/tick_tables.py"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_name_only_existing_modules_and_files(doc):
    text = doc.read_text()
    bad = _mentions(text, doc.parent)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"https?:|#|mailto:", target) and not (doc.parent / target.split("#")[0]).exists():
            bad.append(f"broken link {target}")
    assert not bad, "\n".join(bad)


def test_design_maps_every_module():
    """docs/design.md's module map ("Where each module lives") names every module of the package."""
    text = (ROOT / "docs" / "design.md").read_text().split("Where each module lives", 1)[1]
    modules = [p.relative_to(ROOT / "asyncpp_jax").as_posix() for p in _source_files()
               if p.is_relative_to(ROOT / "asyncpp_jax") and p.name != "__init__.py"]
    assert modules
    missing = [m for m in modules if not re.search(rf"^  {re.escape(m)} ", text, re.M)]
    assert not missing, f"add to docs/design.md's module map: {missing}"


# ---- the pages' shape ---------------------------------------------------------------------------


def test_readme_is_a_front_door():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250
    ci_command = re.search(r"^(python -m pytest .*?)\s+#", (ROOT / ".ci" / "run").read_text(), re.M).group(1)
    assert ci_command == 'python -m pytest -q -m "not slow" -n 2 --dist loadfile tests'
    assert ci_command in text.split("```bash", 1)[1].split("```")[0], "the README's test command is CI's"
    first_screen = "\n".join(lines[:30])
    assert "notebooks/quickstart.ipynb" in first_screen and "notebooks/optax_delay.ipynb" in first_screen
    assert "**Status**" in "\n".join(lines[:40])
    assert "## Does it reproduce the paper?" in lines
    for page in PAGES:
        assert f"(docs/{page.name})" in text, f"the README's map of docs/ lacks {page.name}"


@pytest.mark.parametrize("doc", DOCS + STUDY_DOCS[2:], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_dated_diary(doc):
    assert not [line for line in doc.read_text().splitlines() if DIARY.search(line)]


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "design.md"], ids=lambda p: p.name)
def test_each_page_says_what_it_is_for_and_links_back(page):
    text = page.read_text()
    intro = text.split("\n\n")[1]
    assert intro.startswith("With this page you can"), intro
    assert "(../README.md)" in text.split("```")[0]
    assert "```bash" in text


# ---- every documented command parses -----------------------------------------------------------


def _shell_commands(text: str) -> list[str]:
    """Lines of ```bash blocks (continuations joined, comments dropped) and inline `python ...` spans."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            line = pending + " " + line if pending else line
            if line.count('"') % 2:  # a quoted argument continues on the next line
                pending = line
                continue
            pending = ""
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    out += [" ".join(m.split()) for m in re.findall(r"`(python (?:-m )?[^`]+)`", text)]
    return out


def _python_invocations(command) -> list[list[str]]:
    """Each ``python ...`` in a shell line as argv, through ``&&``, ``;``, env assignments, srun and
    taskset prefixes, and quoted remote commands (gcloud ... --command="...")."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        tokens = command.split()
    found, segment = [], []
    for token in [*tokens, ";"]:
        if token not in ("&&", ";", "||", "|"):
            segment.append(token)
            continue
        while segment and (re.match(r"^\w+=", segment[0]) or segment[0] in ("srun", "taskset", "-c")
                           or segment[0].isdigit()):
            segment = segment[1:]
        if segment and segment[0] == "python":
            found.append([a for a in segment[1:] if a != "..."])
        else:
            for t in segment:
                if "python " in t:
                    found += _python_invocations(t)
        segment = []
    return found


class _Parsed(Exception):
    pass


def _main_flag_names() -> set:
    tree = ast.parse((ROOT / "asyncpp_jax" / "main.py").read_text())
    return {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr.startswith("DEFINE_") and n.args and isinstance(n.args[0], ast.Constant)}


def _parse_main_flags(argv: list[str]) -> ml_collections.ConfigDict:
    """The CLI's flags (the same definitions as asyncpp_jax/main.py, checked by name) and the config they
    load, validated as the CLI validates it before JAX starts."""
    assert _main_flag_names() == {"config", "dry_run", "print_config", "workdir"}, \
        "asyncpp_jax/main.py's flags changed: update this"
    renamed = configs.renamed_flag_errors(argv)
    assert not renamed, renamed
    argv = configs.argv_with_config_path(argv)  # --config=NAME: a preset, as the CLI resolves it
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", str(configs.DEFAULT_CONFIG), "", flag_values=fv, lock_config=True,
                                    sys_argv=["main", *argv])  # the --config.a.b overrides are read from it
    flags.DEFINE_bool("dry_run", False, "", flag_values=fv)
    flags.DEFINE_bool("print_config", False, "", flag_values=fv)
    flags.DEFINE_string("workdir", None, "", flag_values=fv)
    rest = fv(["main", *argv])
    assert rest == ["main"], f"unexpected arguments {rest[1:]}"
    config = ml_collections.ConfigDict(fv.config.to_dict())
    configs.validate(config)
    return config


def _parse_script(module: str, argv: list[str]) -> argparse.Namespace | None:
    """Parse argv with the script's own argparse parser, stopping right after parse_args (nothing runs).
    Returns None after ``--help`` (which must exit 0)."""
    mod = importlib.import_module(module)
    err = io.StringIO()
    saved_argv, original = sys.argv, argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    if hasattr(mod, "_args"):  # the parser is its own function (bench_pipeline parses before importing JAX)
        entry = mod._args
    else:
        argparse.ArgumentParser.parse_args = parse_only
        entry = (lambda: mod.main(argv)) if inspect.signature(mod.main).parameters else mod.main
    sys.argv = [module, *argv]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            result = entry()
    except _Parsed as parsed:
        return parsed.args[0]
    except SystemExit as e:
        assert e.code == 0 and "--help" in argv, f"{module} {shlex.join(argv)}: exit {e.code}: {err.getvalue()}"
        return None
    finally:
        sys.argv, argparse.ArgumentParser.parse_args = saved_argv, original
    return result


def _check_invocation(argv: list[str]):
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
    else:
        script = pathlib.Path(argv[0])
        assert (ROOT / script).exists(), f"no script {script}"
        module, args = script.with_suffix("").as_posix().replace("/", "."), argv[1:]
    if module == "pytest":
        for a in args:
            if a.startswith("tests"):
                assert (ROOT / a.split("::")[0]).exists(), a
        return module
    assert _dotted_problem(module) is None, f"no module {module}"
    if module == "asyncpp_jax.main":
        if "--help" not in args:
            _parse_main_flags(args)
    elif module == "asyncpp_jax.launch":
        _parse_script(module, args)
        if "--" in args:
            _parse_main_flags(args[args.index("--") + 1:])
    elif module == "experiments.record_run":
        _parse_script(module, args)
        inner = args[args.index("--") + 1:]
        if inner[:1] == ["bash"]:
            assert (ROOT / inner[1]).exists(), f"no script {inner[1]}"
        else:
            assert inner[:1] == ["python"], f"record_run runs a python or bash command: {inner}"
            _check_invocation(inner[1:])
    else:
        _parse_script(module, args)
    return module


def _documented_invocations():
    out = []
    for doc in DOCS:
        for command in _shell_commands(doc.read_text()):
            for argv in _python_invocations(command):
                out.append((doc.name, command, argv))
    return out


def test_every_documented_command_parses(monkeypatch):
    monkeypatch.chdir(ROOT)
    invocations = _documented_invocations()
    assert len(invocations) > 40
    failures, modules = [], set()
    for doc, command, argv in invocations:
        try:
            modules.add(_check_invocation(argv))
        except Exception as e:  # noqa: BLE001 - report every failing command at once
            failures.append(f"{doc}: {command}\n    {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)
    # Each documented script's --help runs (asyncpp_jax.main's below, in its own process).
    for module in sorted(modules - {"pytest", "asyncpp_jax.main"}):
        assert _parse_script(module, ["--help"]) is None, module


def test_the_command_check_catches_a_bad_command(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises((flags.Error, KeyError, AttributeError), match="nam"):
        _check_invocation(["-m", "asyncpp_jax.main", "--config.optimizer.nam=muon"])
    with pytest.raises(flags.Error):
        _check_invocation(["-m", "asyncpp_jax.main", "--dryrun"])
    with pytest.raises(configs.ConfigError):
        _check_invocation(["-m", "asyncpp_jax.main", "--config.optimizer.name=sgd"])
    with pytest.raises(AssertionError, match="exit 2"):
        _check_invocation(["-m", "experiments.sweep", "optimizers", "--presett=cpu"])
    with pytest.raises(AssertionError, match="no module"):
        _check_invocation(["-m", "experiments.bench_everything"])
    assert _python_invocations('gcloud ssh x --command="cd a && python -m asyncpp_jax.main --dry_run"') == [
        ["-m", "asyncpp_jax.main", "--dry_run"]]


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "asyncpp_jax.main", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    # absl exits 1 after printing the usage for --help
    assert out.returncode in (0, 1) and "dry_run" in out.stdout and "--workdir" in out.stdout, out.stderr


def test_readme_python_runs_and_names_real_functions():
    from asyncpp_jax import optim

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README shows the optax transforms in a loop"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # the training loop, as printed
    assert float(scope["loss"]) < 1.0, float(scope["loss"])
    for doc in DOCS:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            for name in re.findall(r"\boptim\.(\w+)", block):
                assert hasattr(optim, name), f"{doc.name}: optim.{name} does not exist"
            ast.parse(block)


# ---- figures typed in the prose ---------------------------------------------------------------

STUDY_REPORTS = sorted((ROOT / "experiments" / "results").glob("*/report.md"))
FIGURE = re.compile(r"(?<![\w.])([+-]?\d+(?:\.\d+)?)(%?) ± (\d+(?:\.\d+)?)(%?)( points)?")


def _figures(text: str) -> list[tuple[str, str, bool]]:
    """``(value, standard error, in percent)`` of every ``x ± y`` (``x ± y points`` is in percent)."""
    return [(m[1], m[3], bool(m[2] or m[5])) for m in FIGURE.finditer(text)]


def _rounded(printed: str, digits: int):
    """``printed`` rounded to ``digits`` decimals as its unrounded value would be; None where that is
    ambiguous (the dropped digits are exactly one half: the value could lie either side)."""
    from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

    d, q = Decimal(printed), Decimal(1).scaleb(-digits)
    if -d.as_tuple().exponent < digits:
        return None  # the report printed fewer digits than the prose claims
    if -d.as_tuple().exponent > digits and abs(d - d.quantize(q, rounding=ROUND_DOWN)) == q / 2:
        return None
    return d.quantize(q, rounding=ROUND_HALF_UP)


def _decimals(x: str) -> int:
    return len(x.split(".")[1]) if "." in x else 0


def _printed_by(figure, reported) -> bool:
    from decimal import Decimal

    value, se, pct = figure
    return any(pct == r_pct and _rounded(r_value, _decimals(value)) == Decimal(value)
               and _rounded(r_se, _decimals(se)) == Decimal(se) for r_value, r_se, r_pct in reported)


def test_the_figure_check_rounds_once():
    reported = _figures("| +0.5455 ± 0.0377 | 53% ± 7% | 2.1558 ± 0.0155 |")
    assert _printed_by(("0.5455", "0.0377", False), reported)
    assert _printed_by(("+0.55", "0.04", False), reported) and _printed_by(("53", "7", True), reported)
    # 0.5455 and 0.0155 may come from 0.54549 or 0.01549: one more digit is not the report's rounding
    assert not _printed_by(("+0.546", "0.038", False), reported)
    assert not _printed_by(("2.156", "0.016", False), reported)
    assert not _printed_by(("53", "7", False), reported) and not _printed_by(("0.54552", "0.0377", False), reported)
    assert _figures("by 35 ± 6 points") == [("35", "6", True)]


@pytest.mark.parametrize("doc", STUDY_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_figures_typed_in_the_prose_are_the_reports(doc):
    reported = [f for report in STUDY_REPORTS for f in _figures(report.read_text())]
    prose = render_docs.BLOCK.sub("", doc.read_text())
    stray = [f"{v}{'%' if p else ''} ± {s}{'%' if p else ''}" for v, s, p in _figures(prose)
             if not _printed_by((v, s, p), reported)]
    # a signed figure standing alone (a gap, a change) is a result too: some report prints it
    printed = {m[1] for report in STUDY_REPORTS for m in NUMBER.finditer(report.read_text())}
    stray += [v for v in _signed(FIGURE.sub("", prose)) if not _signed_printed(v, printed)]
    assert not stray, (f"{doc.name}: figures no committed study report prints (rounded once): {stray}; copy them "
                       "from the report, or render the table")


NUMBER = re.compile(r"(?<![\w.])([+-]?\d+\.\d+)")
SIGNED = re.compile(r"(?<![\w.])([+-]\d+\.\d+)(?![\d%])")


def _signed(text: str) -> list[str]:
    return SIGNED.findall(text)


def _signed_printed(value: str, printed) -> bool:
    """Some report number of the same sign, rounded once to ``value``'s decimals, is ``value``."""
    from decimal import Decimal

    neg = value.startswith("-")
    return any(p.startswith("-") == neg and _rounded(p.lstrip("+-"), _decimals(value)) == Decimal(value.lstrip("+-"))
               for p in printed)


def test_a_signed_figure_is_checked_against_the_reports_rounded_once():
    printed = {"+0.7125", "-0.0307", "0.154"}
    assert _signed("gaps +0.71 and -0.031, lr 0.1, 5.2e-4, +3% ") == ["+0.71", "-0.031"]
    assert _signed_printed("+0.71", printed) and _signed_printed("-0.031", printed)
    assert not _signed_printed("+0.713", printed) and not _signed_printed("-0.71", printed)
    assert _signed_printed("+0.15", printed) and not _signed_printed("+0.154", {"+0.1535"})


def test_the_seeds_note_names_each_optimizer_measured_at_other_seeds():
    assert render_docs._measured_seeds({"adamw": {0, 1, 2}, "muon": {0, 1, 2}}) == "seeds [0, 1, 2]"
    said = render_docs._measured_seeds({"lion": {0, 1, 2, 3, 4}, "adamw": {0, 1, 2}, "soap": {0, 1, 2, 3, 4},
                                        "mars": {0, 1}})
    assert said == ("seeds [0, 1, 2] (SOAP, Lion at [0, 1, 2, 3, 4], where a gap was under 3 standard errors; "
                    "MARS-AdamW at [0, 1], so far)")
    assert render_docs._runs_committed(59, 45).startswith("59 of the cell's measured runs committed (45 at three")
    assert render_docs._runs_committed(36, 45) == "36 of the cell's 45 measured runs committed."
