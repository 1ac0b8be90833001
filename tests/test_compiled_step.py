"""The engine's compiled train step, read as XLA:CPU's HLO: nothing vocabulary-sized is copied inside the loop.

XLA copies a buffer that a conditional's branch passes through, or that two branches both write
(docs/pipeline.md, "Work ratio"; docs/design.md, section 6.1); inside the loop over ticks or slots
such a copy of the head's ``[D, V]`` accumulator (or the table) would run at every slot.  The test
compiles the step at a vocabulary size no other dimension has and walks every computation the
loop runs (its body, and the branches of its conditionals, nested): no vocabulary-sized ``copy`` or
``transpose``, and no fusion that only moves data, may produce a vocabulary-sized array there.
Fusions that compute (the head's matmuls, the softmax, the accumulator's add) are the step's work.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncpp_jax.pipeline.spmd import engine

from test_pipeline import SCHED, T, engine_options, engine_shapes, init_pipeline, make_opt, model_cfg

V = 97  # no other dimension of the model is 97
MOVES = {"parameter", "copy", "bitcast", "transpose", "reshape", "tuple", "get-tuple-element", "copy-start",
         "copy-done"}
_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\((.*)")


def _computations(text: str) -> dict:
    """HLO module text -> ``{computation name: its instruction lines}``."""
    comps, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name, comps[head.group(1)] = head.group(1), []
        elif line.startswith("}"):
            name = None
        elif name:
            comps[name].append(line)
    return comps


def _loop_computations(comps: dict) -> set:
    """Every computation a ``while`` body runs: the bodies, and their conditionals' branches, nested."""
    edges = r"(?:body|condition|true_computation|false_computation)=%?([\w.\-]+)"
    todo = [b for lines in comps.values() for line in lines if " while(" in line
            for b in re.findall(r"body=%?([\w.\-]+)", line)]
    seen = set()
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            todo += re.findall(edges, line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                todo += [x.strip().lstrip("%") for x in group.split(",")]
    return seen


def vocab_moves_in_loops(text: str, v: int = V) -> list:
    """The loop's instructions that only move an array with a dimension of ``v`` (the vocabulary,
    or under ``vocab_parallel`` a device's block of it)."""
    comps = _computations(text)
    out = []
    for c in _loop_computations(comps):
        for line in comps[c]:
            m = _INSTR.match(line)
            if not m or not re.search(rf"[\[,]{v}[\],]", m.group(2)):
                continue
            op = m.group(3)
            if op == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", line).group(1)
                inner = {i.group(3) for i in map(_INSTR.match, comps[called]) if i}
                if inner <= MOVES:
                    out.append(f"{c}: {m.group(1)} (a fusion of {sorted(inner)})")
            elif op in MOVES - {"parameter", "get-tuple-element", "tuple", "bitcast"}:
                out.append(f"{c}: {m.group(1)} ({op})")
    return out


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("schedule, tie", [pytest.param("sync", False, marks=pytest.mark.slow),
                                           pytest.param("2bw", True, marks=pytest.mark.slow), ("2bw", False),
                                           ("1f1b", True), pytest.param("interleaved", True, marks=pytest.mark.slow),
                                           pytest.param("zb-h1", True, marks=pytest.mark.slow)])
def test_nothing_vocabulary_sized_is_copied_inside_the_loop(schedule, tie):
    cfg = model_cfg()
    cfg.update(vocab_size=V, tie_embeddings=tie)
    mesh, tx, M = engine.make_pipeline_mesh(1, 4), make_opt("adamw"), 8
    v = 2 if schedule == "interleaved" else 1
    if v > 1:
        cfg.n_layers = 8
    interleave = (4, v) if v > 1 else None
    step = engine.make_pipeline_train_step(cfg, tx, SCHED, mesh, engine_shapes(cfg, interleave),
                                           engine_options(schedule, 4, M, virtual_stages=v))
    state = init_pipeline(cfg, tx, mesh, M, 16, schedule, interleave=interleave)
    tokens = np.random.default_rng(0).integers(0, V, (M, 2, T + 1))
    batch = jax.device_put(jnp.asarray(tokens, jnp.int32), engine.global_batch_sharding(mesh))
    text = step.lower(state, batch).compile().as_text()
    assert _loop_computations(_computations(text)), "no loop found: the walk would check nothing"
    assert re.search(rf"f32\[16,(1,|2,)?{V}\]", text), "no vocabulary-sized array found"
    assert vocab_moves_in_loops(text) == []
    # Nor outside it: 2bw's version shift is made by reference (engine.ShiftByReference), so the
    # step copies no weights, where one jitted step over the donated state copied the table three times.
    assert table_copies_outside_loops(text) == []
    if schedule == "2bw":
        new, _ = step(state, batch)
        assert all(a is b for a, b in zip(jax.tree.leaves(new.runner_state.weight_versions[0]), jax.tree.leaves(state.params)))


def table_copies_outside_loops(text: str, v: int = V, d: int = 16) -> list:
    """The entry computation's ``copy`` instructions (outside every loop) of a whole ``[d, v]`` or
    ``[v, d]`` table: a weight version (a gradient's partial sum is ``1/P`` of one)."""
    entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M).group(1)
    return [m.group(1) for m in map(_INSTR.match, _computations(text)[entry])
            if m and m.group(3) == "copy" and re.match(rf"f32\[({d},{v}|{v},{d})\]", m.group(2))]


def test_the_walk_finds_a_copy_in_a_branch():
    """The reader itself: a vocabulary-sized copy in a loop's conditional branch is found."""
    text = "\n".join([
        "%branch (p: f32[16,97]) -> f32[16,97] {",
        "  %p = f32[16,97]{1,0} parameter(0)",
        "  ROOT %copy.1 = f32[16,97]{0,1} copy(%p)",
        "}",
        "%body (s: f32[16,97]) -> f32[16,97] {",
        "  %s = f32[16,97]{1,0} parameter(0)",
        "  ROOT %c = f32[16,97]{1,0} conditional(%pred, %s, %s), branch_computations={%branch, %branch}",
        "}",
        "ENTRY %main (a: f32[16,97]) -> f32[16,97] {",
        "  ROOT %w = f32[16,97]{1,0} while(%a), condition=%cond, body=%body",
        "}",
    ])
    assert vocab_moves_in_loops(text) == ["branch: copy.1 (copy)"]


def carried(text: str) -> tuple[list, list]:
    """``(handed, copies)``: each ``(computation, instruction, shape)`` a loop computation reads
    off its parameter (the buffers the loop carries), and each ``copy`` it makes of one of those
    (a carried buffer copied at every iteration)."""
    comps = _computations(text)
    handed, copies = [], []
    for c in _loop_computations(comps):
        lines = comps[c]
        params = {m.group(1) for m in (re.match(r"\s*%([\w.\-]+) = .* parameter\(", line) for line in lines) if m}
        names = set()
        for m in map(_INSTR.match, lines):
            src = m and m.group(3) == "get-tuple-element" and re.match(r"%([\w.\-]+)\)", m.group(4))
            if src and src.group(1) in params:
                handed.append((c, m.group(1), m.group(2)))
                names.add(m.group(1))
        for m in map(_INSTR.match, lines):
            src = m and m.group(3) == "copy" and re.match(r"%([\w.\-]+)\)", m.group(4))
            if src and src.group(1) in names:
                copies.append((c, m.group(1), m.group(2)))
    return handed, copies


def test_the_carried_walk_finds_a_copy_of_what_the_loop_carries():
    """The reader itself: a loop body's copy of an element of its parameter is found; a copy of a
    value computed in the body is not."""
    text = "\n".join([
        "%body (p: (s32[], f32[5,16])) -> (s32[], f32[5,16]) {",
        "  %p = (s32[], f32[5,16]{1,0}) parameter(0)",
        "  %i = s32[] get-tuple-element(%p), index=0",
        "  %ring = f32[5,16]{1,0} get-tuple-element(%p), index=1",
        "  %copy.1 = f32[5,16]{1,0} copy(%ring)",
        "  %neg = f32[5,16]{1,0} negate(%copy.1)",
        "  %copy.2 = f32[5,16]{1,0} copy(%neg)",
        "  ROOT %t = (s32[], f32[5,16]{1,0}) tuple(%i, %copy.2)",
        "}",
        "ENTRY %main (a: (s32[], f32[5,16])) -> (s32[], f32[5,16]) {",
        "  ROOT %w = (s32[], f32[5,16]{1,0}) while(%a), condition=%cond, body=%body",
        "}",
    ])
    handed, copies = carried(text)
    assert [h[1] for h in handed] == ["i", "ring"]
    assert copies == [("body", "copy.1", "f32[5,16]{1,0}")]


def _elements(shape: str) -> int:
    dims = re.match(r"\w+\[([\d,]*)\]", shape).group(1)
    return int(np.prod([int(d) for d in dims.split(",") if d]))


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_the_slot_loop_copies_no_stash(schedule):
    """Kept residuals, tables split over ``stage``: the slot's forward writes the stash in place
    after its backward has read it, so nothing the loop carries that is larger than one
    activation is copied per slot.  (With the last stage's loss sums added outside its block's
    backward cond, the two were unordered and XLA copied every stash array twice a slot: 117
    copies here, +30-50% of the step at the benchmark's shapes.)"""
    cfg = model_cfg()
    cfg.update(vocab_size=96, n_layers=8)
    mesh, tx, M = engine.make_pipeline_mesh(1, 4), make_opt("adamw"), 8
    step = engine.make_pipeline_train_step(cfg, tx, SCHED, mesh, engine_shapes(cfg),
                                           engine_options(schedule, 4, M, recompute=False, vocab_parallel=True))
    state = init_pipeline(cfg, tx, mesh, M, 16, schedule, recompute=False, vocab_parallel=True)
    tokens = np.random.default_rng(0).integers(0, 96, (M, 2, T + 1))
    batch = jax.device_put(jnp.asarray(tokens, jnp.int32), engine.global_batch_sharding(mesh))
    handed, copies = carried(step.lower(state, batch).compile().as_text())
    activation = 2 * T * cfg.d_model  # one microbatch's [b, T, D] on a device
    assert any(_elements(h[2]) > activation for h in handed), "the walk sees no stash in the loop: it checks nothing"
    assert [c for c in copies if _elements(c[2]) > activation] == []
