"""The engine running a schedule as a program: the compiled slot plan, and parity with the simulate runner.

The plan is checked symbolically (every buffer entry an action reads holds the message it needs,
written by the exchange of an earlier slot and not overwritten since); the executor against the
simulate runner, as the tick loop is in test_pipeline.py.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from asyncpp_jax.pipeline.spmd import engine
from asyncpp_jax.pipeline.schedules import programs
from asyncpp_jax.pipeline.schedules import slot_plan
from experiments.census import Census, census

from test_pipeline import (BF16_U, assert_params_close, batches, engine_options, engine_shapes, init_pipeline, make_opt, model_cfg,
                           run_pipeline, run_simulate, SCHED)

CASES = [(2, 2), (2, 5), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)]


def _replay(plan: slot_plan.SlotPlan, recompute: bool) -> None:
    """Run the plan's rows on symbols: each buffer entry holds the ``(stage, microbatch)`` of what was
    written there.  Asserts every read finds its own message, every arrival an empty entry, and each
    action of the program runs once; in a slot the backward reads before the forward writes."""
    p = plan.program
    P, last = p.devices, p.stages - 1
    col = {name: plan.column(name) for name in slot_plan.COLUMNS}
    held = {name: [dict() for _ in range(P)] for name in slot_plan.BUFFERS if name != "save" or plan.split}
    trash = {name: plan.depth[name] - 1 for name in held}
    saves = lambda u: u < last and (u > 0 or not recompute)  # noqa: E731
    done = []
    for k in range(plan.slots):
        sends = []
        for d in range(P):
            m, u = col["b"][k, d], col["b_chunk"][k, d] * P + d
            if m != slot_plan.IDLE:
                if u == last:
                    assert held["fwd"][d].pop(col["b_fwd"][k, d]) == (u - 1, m)
                else:
                    if saves(u):
                        assert held["stash"][d].pop(col["b_stash"][k, d]) == (u, m)
                    assert held["bwd"][d].pop(col["b_bwd"][k, d]) == (u + 1, m)
                if u > 0:
                    sends.append(("bwd", p.device_of(u - 1), (u, m)))
                if plan.split:  # an I: what its W needs goes into a free save entry
                    at = col["b_save"][k, d]
                    assert at != trash["save"] and at not in held["save"][d]
                    held["save"][d][at] = (u, m)
                done.append(("I" if plan.split else "B", u, int(m)))
            m, u = col["w"][k, d], col["w_chunk"][k, d] * P + d
            if m != slot_plan.IDLE:
                assert held["save"][d].pop(col["w_save"][k, d]) == (u, m)
                done.append(("W", u, int(m)))
            m, u = col["f"][k, d], col["f_chunk"][k, d] * P + d
            if m != slot_plan.IDLE:
                assert u != last, "the last stage's F takes no slot"
                if u > 0:
                    assert held["fwd"][d].pop(col["f_fwd"][k, d]) == (u - 1, m)
                if saves(u):
                    at = col["f_stash"][k, d]
                    assert at != trash["stash"] and at not in held["stash"][d]
                    held["stash"][d][at] = (u, m)
                sends.append(("fwd", p.device_of(u + 1), (u, m)))
                done.append(("F", u, int(m)))
        for d in range(P):  # the exchange: an arrival lands in its named entry, all else in the write-only one
            for name in ("fwd", "bwd"):
                got = [msg for buf, dst, msg in sends if buf == name and dst == d]
                entry = col[f"{name}_store"][k, d]
                if got:
                    assert entry != trash[name] and entry not in held[name][d], "an arrival overwrote a live entry"
                    held[name][d][entry] = got[0]
                else:
                    assert entry == trash[name]
        for name in held:
            assert all(len(h) <= plan.held(name) for h in held[name])
    assert all(not h for name in held for h in held[name]), "a buffer entry left unread at the step's end"
    want = [("F", u, m) for u in range(last) for m in range(p.microbatches)]
    want += [(kind, u, m) for kind in (("I", "W") if plan.split else ("B",))
             for u in range(p.stages) for m in range(p.microbatches)]
    assert sorted(done) == sorted(want)


@pytest.mark.parametrize("P, M", CASES)
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("paired", [False, True])
def test_1f1b_plan_delivers_every_message_and_stashes_at_most_P(P, M, recompute, paired):
    program = programs.generate("1f1b", P, M)
    plan = slot_plan.compile_program(program, recompute, paired)
    _replay(plan, recompute)
    # 1F1B's memory: stage 0 holds at most P microbatches (P - 1 on stage 1 when stage 0 re-embeds),
    # against 2P - 1 (2P - 3) in the tick tables' ring.
    deepest = programs.stash_depth(program)[1 if recompute else 0] if not (recompute and P == 2) else 0
    assert plan.held("stash") == deepest == (min(P - 1, M) if recompute and P > 2 else 0 if recompute else min(P, M))
    assert plan.held("fwd") <= 2 and plan.held("bwd") <= 2
    assert 0 < plan.useful_fraction() < 1 and "F0" in plan.render()


@pytest.mark.parametrize("P, M", CASES)
@pytest.mark.parametrize("recompute", [True, False])
def test_zb_h1_plan_delivers_every_message_and_keeps_each_w_input_until_its_w(P, M, recompute):
    """zb-h1's I takes the B's place and fills a save entry that its W, later, empties; the stash
    entry is freed at the I, so the stash is 1F1B's; no device keeps more than P W inputs (device s
    defers s of its W's)."""
    program = programs.generate("zb-h1", P, M)
    plan = slot_plan.compile_program(program, recompute)
    assert plan.split and not slot_plan.compile_program(programs.generate("1f1b", P, M), recompute).split
    _replay(plan, recompute)
    f1b = slot_plan.compile_program(programs.generate("1f1b", P, M), recompute, plan.paired)
    assert plan.held("stash") <= max(f1b.held("stash"), min(P, M))
    assert 1 <= plan.held("save") <= min(P, M)
    assert "W0" in plan.render() and "I0" in plan.render() and "save" in plan.render()


def test_the_faster_placement_is_kept():
    """Unpaired slots let forward-only slots be short; paired ones hide a forward beside a backward.
    At B = 2F pairing wins for 1F1B at P = 4 and loses at P = 8 (docs/pipeline.md)."""
    for P, M, paired in ((4, 8, True), (4, 16, True), (8, 16, False), (8, 32, False)):
        program = programs.generate("1f1b", P, M)
        times = {x: slot_plan.compile_program(program, paired=x).step_time() for x in (False, True)}
        assert times[paired] < times[not paired]
        assert slot_plan.compile_program(program).paired == paired


@pytest.mark.parametrize("P", [4, 8])
def test_lockstep_paths(P):
    """docs/pipeline.md's claims: a compiled plan's step time is its placement's path; 1F1B in
    lock-step slots is up to 28% longer than the tick table's (M + 2P - 2)(F + B) at M = 4P (its
    stash of P cannot cover a round trip of 2(P - 1) + 1 slots); interleaved (v = 2) in paired slots
    reaches its event-driven path and beats the tick table in every cell."""
    for M in (P, 2 * P, 4 * P):
        f1b, il = programs.generate("1f1b", P, M), programs.generate("interleaved", P, M)
        plan = slot_plan.compile_program(f1b)
        assert plan.step_time() == slot_plan.path(f1b, plan.paired)
        ticks = 3 * (M + 2 * P - 2)
        assert slot_plan.path(il, True) == programs.step_time(il) < ticks
        assert slot_plan.path(il, False) > programs.step_time(il)
    assert plan.step_time() / ticks == pytest.approx({4: 78 / 66, 8: 177 / 138}[P])


def test_eval_is_the_forward_only_program():
    """The pipeline's eval step runs programs.forward_only: stage s runs microbatch m at slot m + s
    (the last stage's F too, ending in the loss), one activation in transit per device."""
    P, M = 4, 5
    plan = slot_plan.compile_program(programs.forward_only(P, M))
    f = plan.column("f")
    want = np.array([[k - d if 0 <= k - d < M else slot_plan.IDLE for d in range(P)] for k in range(M + P - 1)])
    np.testing.assert_array_equal(f, want)
    assert (plan.column("b") == slot_plan.IDLE).all() and plan.held("fwd") == 1 and plan.held("stash") == 0
    # forward-only means forward only: a backward in it breaks rule 'once'
    acts = programs.forward_only(P, M).actions
    bad = programs.Program("forward", P, M, (acts[0] + (programs.Action("B", 0),),) + acts[1:], training=False)
    with pytest.raises(programs.ProgramError, match="rule 'once'.*runs one F and nothing else"):
        programs.validate(bad)


def test_program_executor_refuses_what_it_cannot_run_yet():
    assert slot_plan.compile_program(programs.generate("2bw", 4, 8)).cyclic  # flushless: entries kept across steps
    # A flushless program with a split backward: not yet (F and B on one chunk per device).
    zb = programs.generate("zb-h1", 2, 2)
    flushless = dataclasses.replace(zb, name="zb-h1 never flushing", delay=1)
    programs.validate(flushless)
    with pytest.raises(programs.ProgramError, match="flushless program runs F and B"):
        slot_plan.compile_program(flushless)
    # A valid program whose device 0 runs microbatch 0's backward whole and the rest split: the
    # executor runs one kind of backward per program.
    zb = programs.generate("zb-h1", 2, 2)
    first = [dataclasses.replace(a, kind="B") if (a.kind, a.microbatch) == ("I", 0) else a
             for a in zb.actions[0] if (a.kind, a.microbatch) != ("W", 0)]
    mixed = dataclasses.replace(zb, name="mixed", actions=(tuple(first),) + zb.actions[1:])
    programs.validate(mixed)
    with pytest.raises(programs.ProgramError, match="either B or I and W"):
        slot_plan.compile_program(mixed)


def test_slot_costs_at_unit_costs():
    """Lock-step time is the sum of each slot's costliest row; at P = 2, M = 2 unpaired:
    F0 | F1 B0* | B0 B1* | B1, with * the last stage's fused B (F + B = 3)."""
    plan = slot_plan.compile_program(programs.generate("1f1b", 2, 2), paired=False)
    assert [line.split() for line in plan.render().splitlines()[2:]] == [
        ["0", "F0", "."], ["1", "F1", "B0"], ["2", "B0", "B1"], ["3", "B1", "."]]
    assert plan.step_time() == 1 + 3 + 3 + 2
    assert plan.useful_fraction() == pytest.approx((2 * 1 + 2 * 2 + 2 * 3) / (2 * 9))
    # Paired at M = 4: d0 runs F0 | F1 | B0/F2 | B1/F3 | B2 | B3 beside d1's fused backwards (3 each).
    paired = slot_plan.compile_program(programs.generate("1f1b", 2, 4), paired=True)
    assert [line.split()[1] for line in paired.render().splitlines()[2:]] == ["F0", "F1", "B0/F2", "B1/F3", "B2", "B3"]
    assert paired.step_time() == 1 + 3 + 3 + 3 + 3 + 2


# ------------------------------------------------------------------------------------------ parity


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("P, M, recompute",
                         [(2, 2, True), (4, 4, True), pytest.param(4, 8, False, marks=pytest.mark.slow)])
def test_1f1b_program_equals_simulate(P, M, recompute):
    cfg, data = model_cfg(), batches(2, M, 2 * M)
    want, _ = run_simulate(cfg, make_opt("adamw"), data)
    got, metrics = run_pipeline(cfg, make_opt("adamw"), data, P, "1f1b", recompute=recompute)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert np.isfinite(metrics[-1]["loss"]) and metrics[-1]["loss_microbatches"] == M


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("P, M, recompute", [(2, 4, True), pytest.param(4, 4, False, marks=pytest.mark.slow),
                                              pytest.param(4, 8, True, marks=pytest.mark.slow)])
def test_zb_h1_program_equals_simulate(P, M, recompute):
    """zb-h1's I and W (the backward split at every dense leaf, asyncpp_jax/models/taps.py) compute
    the synchronous update of the simulate runner."""
    cfg, data = model_cfg(), batches(2, M, 2 * M)
    want, _ = run_simulate(cfg, make_opt("adamw"), data)
    got, metrics = run_pipeline(cfg, make_opt("adamw"), data, P, "zb-h1", recompute=recompute)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params)
    assert np.isfinite(metrics[-1]["loss"]) and metrics[-1]["loss_microbatches"] == M


@pytest.mark.slow
@pytest.mark.needs_devices(4)
def test_zb_h1_bf16_equals_simulate():
    """As test_pipeline's bf16 transport test: the bound of a few bf16 roundings per gradient entry."""
    cfg, data = model_cfg(), batches(3, 4, 8, seed=10)
    cfg.compute_dtype = "bfloat16"
    lr = 0.5
    tx = optax.sgd(lr)
    want, want_m = run_simulate(cfg, tx, data)
    got, _ = run_pipeline(cfg, tx, data, 4, "zb-h1")
    tol = lr * len(data) * 8 * BF16_U * max(float(m["grad_norm"]) for m in want_m)
    assert_params_close(engine.to_model_layout(cfg, got.params), want.params, rtol=0, atol=tol)


@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("schedule, per_slot", [("1f1b", 5), ("zb-h1", 6)])
def test_conditionals_per_slot(schedule, per_slot):
    """1f1b: three conds per slot (F, B, the last stage's fused B), with the nested ones of the tick
    loop's slots: stage 0's embedding in F, its re-embedding in B (recompute): 5 per slot.  zb-h1:
    four (F, I, the last stage's I, W) with the same nested two: 6."""
    cfg, data = model_cfg(), batches(1, 4, 8)
    mesh = engine.make_pipeline_mesh(1, 2)
    tx = make_opt("adamw")
    step = engine.make_pipeline_train_step(cfg, tx, SCHED, mesh, engine_shapes(cfg), engine_options(schedule, 2, 4))
    state = init_pipeline(cfg, tx, mesh, 4, 8, schedule)
    batch = jax.device_put(data[0], engine.global_batch_sharding(mesh))
    plan = slot_plan.compile_program(programs.generate(schedule, 2, 4))
    assert census(jax.make_jaxpr(step)(state, batch)) == Census(per_slot * plan.slots, 0)
