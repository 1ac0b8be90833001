"""The package's imports flow one way: config -> (models, data, optim) -> train state -> runners ->
trainer -> entry point, with no cycles and no function-level imports that hide one.

Read from the source with ``ast`` (nothing is imported), so the test is fast and sees imports inside
functions too.  Each layer lists its components (a package or a module); a module may import its
own component and any component of a lower layer, never one beside it or above it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = "asyncpp_jax"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE

# Lowest first.  A module belongs to the component with the longest matching prefix.
LAYERS = (
    ("process set-up", ("asyncpp_jax.host_setup", "asyncpp_jax.distributed", "asyncpp_jax.limits")),
    # schedules as programs: plain Python, which the config's validator calls (the one check of a
    # schedule's rules)
    ("schedules", ("asyncpp_jax.pipeline.schedules",)),
    ("config", ("asyncpp_jax.configs",)),
    ("parts", ("asyncpp_jax.models", "asyncpp_jax.data", "asyncpp_jax.optim")),
    ("train state", ("asyncpp_jax.train_state",)),
    ("runners", ("asyncpp_jax.pipeline", "asyncpp_jax.train.step")),
    ("runner choice", ("asyncpp_jax.train.runner",)),
    ("trainer", ("asyncpp_jax.train",)),
    # what reads a run back: its checkpoint as a Hugging Face model (checkpoints and both runners'
    # layouts), and the config's printout
    ("run readers", ("asyncpp_jax.export", "asyncpp_jax.config_help")),
    # a run's checkpoint as a model with its tokenizer, and what generates or scores with it
    ("trained model", ("asyncpp_jax.trained",)),
    ("model tools", ("asyncpp_jax.generate", "asyncpp_jax.lm_eval_adapter")),
    # the trainer's entry point, the local launcher that starts it in N processes (it reads
    # host_setup's CPU-list convention to give each process its own cores), the paper preset's
    # offline rehearsal (it runs the entry point), and the evaluation command (its lm-eval adapter
    # imported only when lm-eval is asked for)
    ("entry point", ("asyncpp_jax.main", "asyncpp_jax.launch", "asyncpp_jax.rehearse", "asyncpp_jax.evaluate")),
)

# Function-level imports of the package's own modules, each with why it is not dodging a cycle.
LAZY_ALLOWED = {
    # JAX must start after host_setup and the config checks, and distributed.initialize() before
    # anything touches a device; a bad flag then fails before JAX is even imported.
    "asyncpp_jax.main",
    # lm-eval is an optional extra: its adapter is imported when the command needs it
    "asyncpp_jax.evaluate",
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, bool]]:
    """``(imported package module, at function level?)`` for every import of the package in ``path``."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node, nested: bool):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, nested) for a in child.names if a.name.split(".")[0] == PACKAGE)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] == PACKAGE:
                    for a in child.names:
                        sub = f"{base}.{a.name}"
                        found.append((sub if sub in known else base, nested))
            visit(child, inner)

    visit(tree, False)
    return sorted({(m, lazy) for m, lazy in found if m != name})


def import_graph() -> dict[str, list[tuple[str, bool]]]:
    mods = package_modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def component(module: str) -> tuple[int, str] | None:
    """``(layer index, component)`` of ``module``: its longest matching prefix in :data:`LAYERS`."""
    best = None
    for level, (_, comps) in enumerate(LAYERS):
        for comp in comps:
            if (module == comp or module.startswith(comp + ".")) and (best is None or len(comp) > len(best[1])):
                best = (level, comp)
    return best


def layer_violations(graph) -> list[str]:
    out = []
    for src, targets in graph.items():
        here = component(src)
        if here is None:
            if src != PACKAGE:
                out.append(f"{src} is in no layer; add it to LAYERS in tests/test_layers.py")
            continue
        for dst, _ in targets:
            there = component(dst)
            if there is None or there[1] == here[1] or there[0] < here[0]:
                continue
            where = "beside" if there[0] == here[0] else "above"
            out.append(f"{src} ({LAYERS[here[0]][0]}) imports {dst}, {where} it ({LAYERS[there[0]][0]})")
    return out


def cycles(graph) -> list[list[str]]:
    """Every import cycle, found by depth-first search (each reported once, from where it is entered)."""
    found, state = [], {}

    def dfs(node, stack):
        state[node] = "open"
        stack.append(node)
        for dst, _ in graph.get(node, ()):
            if state.get(dst) == "open":
                found.append(stack[stack.index(dst):] + [dst])
            elif dst not in state:
                dfs(dst, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            dfs(node, [])
    return found


def test_every_module_sits_in_a_layer_and_imports_only_downward():
    assert layer_violations(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_function_level_imports_of_the_package():
    lazy = [f"{src} imports {dst} inside a function" for src, targets in import_graph().items()
            for dst, nested in targets if nested and src not in LAZY_ALLOWED]
    assert lazy == []


@pytest.mark.parametrize("src, dst, needle", [
    ("asyncpp_jax.pipeline.spmd.engine", "asyncpp_jax.train.step", "beside it"),  # runner imports runner
    ("asyncpp_jax.models.dense", "asyncpp_jax.train_state", "above it"),
    ("asyncpp_jax.configs", "asyncpp_jax.optim.factory", "above it"),
    ("asyncpp_jax.optim.factory", "asyncpp_jax.models.dense", "beside it"),
])
def test_the_checks_catch_an_upward_import(src, dst, needle):
    graph = import_graph()
    graph[src] = graph[src] + [(dst, False)]
    assert any(needle in v and src in v for v in layer_violations(graph))


def test_the_checks_catch_a_cycle():
    graph = import_graph()
    graph["asyncpp_jax.models.layers"] = graph["asyncpp_jax.models.layers"] + [("asyncpp_jax.models.dense", False)]
    assert any("asyncpp_jax.models.dense" in c and "asyncpp_jax.models.layers" in c for c in cycles(graph))


def test_the_graph_sees_the_real_imports():
    graph = import_graph()
    assert ("asyncpp_jax.train_state", False) in graph["asyncpp_jax.pipeline.spmd.engine"]
    assert ("asyncpp_jax.train_state", False) in graph["asyncpp_jax.train.step"]
    assert ("asyncpp_jax.train.trainer", True) in graph["asyncpp_jax.main"]
