"""Schedules as programs (asyncpp_jax.pipeline.schedules.programs): the validator rejects each broken rule, every
generator's program validates, and what is derived from a program matches the textbook figures.

Pure Python: no JAX program is built or compiled.
"""

from __future__ import annotations

import dataclasses

import pytest

from asyncpp_jax.pipeline.schedules import programs as pr

A = pr.Action
UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _with(program: pr.Program, device: int, actions) -> pr.Program:
    lists = list(program.actions)
    lists[device] = tuple(actions)
    return dataclasses.replace(program, actions=tuple(lists))


def _rejects(program: pr.Program, rule: str, *words: str) -> str:
    with pytest.raises(pr.ProgramError, match=f"rule '{rule}'") as e:
        pr.validate(program)
    for w in words:
        assert w in str(e.value), str(e.value)
    return str(e.value)


# ---- the validator rejects each broken rule ----------------------------------------------------


def test_rejects_a_missing_device_and_an_unknown_kind():
    p = pr.one_f_one_b(4, 4)
    with pytest.raises(pr.ProgramError, match="rule 'shape': 3 action lists for 4 devices"):
        pr.validate(dataclasses.replace(p, actions=p.actions[:3]))
    _rejects(_with(p, 2, [A("X", 0), *p.actions[2][1:]]), "shape", "device 2", "unknown kind 'X'")


def test_rejects_a_backward_before_its_forward():
    p = pr.one_f_one_b(4, 4)
    last = list(p.actions[3])
    last[0], last[1] = last[1], last[0]  # B0 before F0 on the last stage
    _rejects(_with(p, 3, last), "order", "device 3", "action B0", "runs before its F")


def test_rejects_a_weight_gradient_before_its_input_gradient():
    p = pr.zb_h1(4, 4)
    acts = list(p.actions[0])  # stage 0 defers no W: ... F3 I0 W0 ...
    i = acts.index(A("I", 0))
    acts[i], acts[i + 1] = acts[i + 1], acts[i]
    assert acts[i] == A("W", 0)
    _rejects(_with(p, 0, acts), "order", "device 0", "action W0", "runs before its I")


def test_rejects_a_microbatch_run_twice_or_never():
    p = pr.one_f_one_b(4, 4)
    _rejects(_with(p, 1, [x for x in p.actions[1] if x != A("F", 2)]), "once", "stage 1", "microbatch 2")
    _rejects(_with(p, 1, [*p.actions[1], A("B", 2)]), "once", "runs B of microbatch 2 twice")
    mixed = [x for x in pr.zb_h1(4, 4).actions[0] if x != A("W", 1)]  # I without W
    _rejects(_with(pr.zb_h1(4, 4), 0, mixed), "once", "stage 0", "microbatch 1")


def test_rejects_a_deadlock():
    """Stage 1 starts with microbatch 1 and stage 0 with a full F/B of microbatch 0: each waits for the other."""
    p = pr.Program("crossed", 2, 2, ((A("F", 0), A("B", 0), A("F", 1), A("B", 1)),
                                      (A("F", 1), A("B", 1), A("F", 0), A("B", 0))))
    _rejects(p, "dataflow", "deadlock", "device 0 at B of microbatch 0 on stage 0", "waits for B/I of 0 on stage 1",
             "device 1 at F of microbatch 1 on stage 1 (step 0) waits for F of 1 on stage 0")


def test_rejects_a_channel_received_out_of_order():
    """No deadlock, but stage 1 takes microbatch 1's activation first while stage 0 sent microbatch 0's
    first: lowered to send/recv pairs, the channel does not match."""
    p = pr.Program("swapped", 2, 2, ((A("F", 0), A("F", 1), A("B", 0), A("B", 1)),
                                      (A("F", 1), A("B", 1), A("F", 0), A("B", 0))))
    pr.simulate(p)  # the dataflow itself is fine
    _rejects(p, "channels", "activation channel 0->1", "message 0 is stage 0's microbatch 0")


def test_rejects_weights_that_break_the_delay_rule():
    # a flushed schedule running a microbatch of the previous batch
    p = pr.one_f_one_b(2, 2)
    _rejects(_with(p, 0, [A("F", -1, 0, -1), *p.actions[0][1:]]), "version", "keeps only this step's batch")
    # 2bw: one version for a microbatch's F and its B
    p = pr.two_bw(4, 4)
    acts = [dataclasses.replace(x, version=0) if x == A("B", -3, 0, -1) else x for x in p.actions[0]]
    _rejects(_with(p, 0, acts), "version", "device 0", "action B-3", "reads w[t-1]", "this one reads w[t+0]")
    # 2bw: a batch two steps old would need a third weight version
    _rejects(pr.two_bw(4, 2), "version", "batch t-2", "2 weight versions")


# ---- every generator's program validates ----------------------------------------------------------


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3, 4])
def test_every_generator_validates(P, mult):
    M = P * mult
    for name in ("sync", "1f1b", "zb-h1", "2bw", "pipedream"):
        pr.validate(pr.generate(name, P, M))
    for v in (1, 2, 3):
        pr.validate(pr.interleaved(P, M, v))
    for M_odd in (1, 3, 5):  # the flushed schedules (and pipedream) need no multiple of P
        for name in ("sync", "1f1b", "zb-h1", "pipedream"):
            pr.validate(pr.generate(name, P, M_odd))


def test_2bw_below_its_validity_breaks_the_delay_rule():
    """Below ``P - 1`` microbatches a backward would reach two batches back: three weight versions."""
    _rejects(pr.two_bw(4, 2), "version", "batch t-2")


def test_pipedream_stage_delays():
    """Stage s reads batch t-(P-1-s) in its backwards (its own delay), and nothing older."""
    P, M = 4, 3
    p = pr.validate(pr.pipedream(P, M))
    assert p.delays == (3, 2, 1, 0) and p.delay == 3 and p.flushless
    for s, acts in enumerate(p.actions):
        assert {a.version for a in acts if a.kind == "B"} == {-(P - 1 - s)}
        assert {a.version for a in acts if a.kind == "F"} == {0}
    # a backward one batch older than its stage's delay breaks the version rule
    acts = list(p.actions[1])
    acts[0] = pr.Action("B", acts[0].microbatch - M, 0, acts[0].version - 1)
    _rejects(pr.Program("pipedream", P, M, (p.actions[0], tuple(acts)) + p.actions[2:], delay=3,
                        stage_delays=p.stage_delays), "version", "at most 2 step(s) old")


def test_offsets_hold_only_the_offsets_a_step_adds_to():
    """Under pipedream a tied table's lookup gradient (stage 0, batch t-(P-1)) joins update t and
    its head gradient (stage P-1, batch t) update t+P-1: a step holds two accumulators for the
    table, not P, while the partials carried across steps span every offset between."""
    P = 4
    o = pr.Offsets.of(pr.pipedream(P, 8), tied=True)
    assert o.slots("embed") == (0, P - 1) and o.count("embed") == P and o.carried == P - 1
    assert o.slots("layers") == o.slots("final_norm") == o.slots("stats") == (0,)
    untied = pr.Offsets.of(pr.pipedream(P, 8), tied=False)
    assert untied.slots("embed") == untied.slots("lm_head") == (0,) and untied.carried == 0
    two_bw = pr.Offsets.of(pr.two_bw(P, 8), tied=True)
    assert all(two_bw.slots(g) == (0, 1) for g in ("layers", "embed", "final_norm", "stats"))
    assert pr.Offsets.of(pr.sync(P, 8), tied=True).slots("embed") == (0,)


# ---- derived figures ------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [2, 4, 8])
def test_stash_depths(P):
    M = 2 * P
    assert pr.stash_depth(pr.one_f_one_b(P, M)) == [P - s for s in range(P)]  # 1F1B: stage s holds P - s
    assert pr.stash_depth(pr.two_bw(P, P - 1 if P > 1 else 1)) == [P - s for s in range(P)]  # 2bw below 2(P-1)
    assert max(pr.stash_depth(pr.zb_h1(P, M))) == P  # ZB-H1: 1F1B's peak
    # the eager sync order and 2bw from 2(P-1) microbatches (their crossing, bubble-free order) hold 2(P-1-s)+1
    eager = [2 * (P - 1 - s) + 1 for s in range(P)]
    assert pr.stash_depth(pr.sync(P, M)) == eager
    assert pr.stash_depth(pr.two_bw(P, max(M, 2 * (P - 1)))) == eager


@pytest.mark.parametrize("P", [2, 4, 8])
def test_smallest_microbatches(P):
    assert pr.min_microbatches("1f1b", P) == 1
    assert pr.min_microbatches("zb-h1", P) == 1
    assert pr.min_microbatches("interleaved", P, 2) == P  # Megatron's groups of P
    assert pr.min_microbatches("2bw", P) == max(P - 1, 1)  # below the 2BW paper's M >= P
    assert pr.min_microbatches("pipedream", P) == 1


@pytest.mark.parametrize("P,M", [(2, 2), (4, 4), (4, 8), (8, 16)])
def test_critical_paths_match_the_textbook(P, M):
    F, B = UNIT["F"], UNIT["B"]
    assert pr.step_time(pr.one_f_one_b(P, M), UNIT) == (M + P - 1) * (F + B)
    assert pr.step_time(pr.two_bw(P, M), UNIT) == M * (F + B)  # steady state: no flush, no bubble
    assert pr.bubble_fraction(pr.two_bw(P, M), UNIT) == 0.0
    for v in (2, 4):  # Megatron: bubble (P - 1)/(v M) of the ideal step
        p = pr.interleaved(P, M, v)
        assert pr.step_time(p, UNIT) / (M * (F + B)) - 1 == pytest.approx((P - 1) / (v * M))
    # ZB-H1: (P - 1)(F + I - W) (Qi et al. 2024), a third of 1F1B's when F = I = W
    assert pr.step_time(pr.zb_h1(P, M), UNIT) == M * (F + B) + (P - 1) * (F + UNIT["I"] - UNIT["W"])
    eq = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    bubble = {n: pr.step_time(pr.generate(n, P, M), eq) - M * 3 for n in ("1f1b", "zb-h1")}
    assert bubble["zb-h1"] == pytest.approx(bubble["1f1b"] / 3)


def test_stash_is_read_off_the_order():
    """GPipe's order (every forward, then every backward) validates with 1F1B's critical path but holds
    all M microbatches on every stage: the stash is a property of the program, not of P."""
    P, M = 4, 8
    gpipe = pr.Program("gpipe", P, M, tuple(tuple([A("F", m) for m in range(M)] + [A("B", m) for m in range(M)])
                                            for _ in range(P)))
    pr.validate(gpipe)
    assert pr.stash_depth(gpipe) == [M] * P
    assert pr.step_time(gpipe, UNIT) == pr.step_time(pr.one_f_one_b(P, M), UNIT)


def test_buffers_and_update_collective():
    p = pr.one_f_one_b(4, 8)
    buf = pr.buffers(p, UNIT)
    assert set(buf) == {("activation", s, s + 1) for s in range(3)} | {("gradient", s + 1, s) for s in range(3)}
    assert all(n >= 1 for n in buf.values())
    # a costly update is paid once per step, after the flush (sync) or between windows (2bw)
    assert pr.step_time(p, UNIT, update=5.0) == pr.step_time(p, UNIT) + 5.0
    assert pr.step_time(pr.two_bw(4, 8), UNIT, update=5.0) == pr.step_time(pr.two_bw(4, 8), UNIT) + 5.0


def test_lockstep_slot_lasts_as_long_as_its_costliest_action():
    # 1f1b, P = M = 2 (d0: F0 F1 B0 B1; d1: F0 B0 F1 B1), one action per slot, a message lands for
    # the next slot: slots F0 | F1,F0 | -,B0 | B0,F1 | -,B1 | B1 cost 1+1+2+2+2+2 with B = 2F, while
    # the event-driven run overlaps d1's F1 with d0's B0 (9); with equal costs the two agree.
    p = pr.validate(pr.one_f_one_b(2, 2))
    costs = {"F": 1.0, "B": 2.0}
    assert pr.lockstep(p, costs) == [10.0] and pr.step_time(p, costs) == 9.0
    unit = {"F": 1.0, "B": 1.0}
    assert pr.lockstep_time(p, unit) == pr.step_time(p, unit) == 6.0


def test_lockstep_2bw_from_2p_minus_2_microbatches_is_balanced():
    # From 2(P-1) microbatches 2bw's forwards cross the step boundary too: every device runs a
    # forward and a backward at every tick, so the steady window is the ideal, a device's work
    # (M (F + B)); below it (only backwards cross) the window pays for its ramp.
    costs = {"F": 1.0, "B": 2.0}
    crossing = pr.validate(pr.two_bw(4, 8))
    assert pr.lockstep_time(crossing, costs) == pr.work(crossing, costs) / 4 == 24.0
    ramp = pr.validate(pr.two_bw(4, 5))
    assert pr.lockstep_time(ramp, costs) > pr.work(ramp, costs) / 4
