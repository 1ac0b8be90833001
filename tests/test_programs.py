"""Schedules as programs (asyncpp_jax.pipeline.programs): the validator rejects each broken rule, every
generator's program validates, and what is derived from a program matches the textbook figures.

Pure Python: no JAX program is built or compiled.
"""

from __future__ import annotations

import dataclasses

import pytest

from asyncpp_jax.pipeline import programs as pr
from asyncpp_jax.pipeline import tick_tables

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
    for name in ("1f1b", "zb-h1", "2bw", "sync-ticks"):
        pr.validate(pr.generate(name, P, M))
    for v in (1, 2, 3):
        pr.validate(pr.interleaved(P, M, v))
    if M >= tick_tables.min_microbatches_2bw(P):
        pr.validate(pr.generate("2bw-ticks", P, M))
    for M_odd in (1, 3, 5):  # the flushed schedules need no multiple of P
        pr.validate(pr.one_f_one_b(P, M_odd))
        pr.validate(pr.zb_h1(P, M_odd))


def test_the_engines_tick_tables_validate_as_programs():
    for P in (2, 4):
        for M in (2 * (P - 1), 8):
            pr.validate(pr.from_tick_table(tick_tables.sync_table(P, M)))
            pr.validate(pr.from_tick_table(tick_tables.async_table(P, M)))
    # below min_microbatches_2bw the 2bw window is a program too, and the rule it breaks is the delay's
    _rejects(pr.from_tick_table(tick_tables.async_table(4, 5, check=False)), "version", "batch t-2")


# ---- derived figures ------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [2, 4, 8])
def test_stash_depths(P):
    M = 2 * P
    assert pr.stash_depth(pr.one_f_one_b(P, M)) == [P - s for s in range(P)]  # 1F1B: stage s holds P - s
    assert pr.stash_depth(pr.two_bw(P, M)) == [P - s for s in range(P)]  # 2bw: 1F1B's memory
    assert max(pr.stash_depth(pr.zb_h1(P, M))) == P  # ZB-H1: 1F1B's peak
    # the engine's lock-step ticks: 2(P-1-s)+1, the tick_tables.stash_slots ring on stage 0
    ticks = pr.stash_depth(pr.from_tick_table(tick_tables.async_table(P, max(M, 2 * (P - 1)))))
    assert ticks == [2 * (P - 1 - s) + 1 for s in range(P)] and ticks[0] == tick_tables.stash_slots(P)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_smallest_microbatches(P):
    assert pr.min_microbatches("1f1b", P) == 1
    assert pr.min_microbatches("zb-h1", P) == 1
    assert pr.min_microbatches("interleaved", P, 2) == P  # Megatron's groups of P
    assert pr.min_microbatches("2bw", P) == max(P - 1, 1)  # below the 2BW paper's M >= P
    assert pr.min_microbatches("2bw-ticks", P) == tick_tables.min_microbatches_2bw(P)  # the formula, derived


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


def test_lockstep_pairs_of_the_tick_tables_are_balanced():
    # The engine's 2bw ticks put every device's F in one slot and its B in the next: the steady
    # window is the ideal, a device's work (M (F + B)), where textbook 2bw pays for mixed slots.
    costs = {"F": 1.0, "B": 2.0}
    ticks = pr.validate(pr.generate("2bw-ticks", 4, 8))
    assert pr.lockstep_time(ticks, costs) == pr.work(ticks, costs) / 4 == 24.0
    assert pr.lockstep_time(pr.validate(pr.two_bw(4, 8)), costs) > 24.0
