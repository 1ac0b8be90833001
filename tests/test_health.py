"""train/health.py: when an update is live, and which checkpoints a run may call good."""

import math

import pytest

from asyncpp_jax import configs
from asyncpp_jax.pipeline.options import EngineOptions
from asyncpp_jax.train import health

LIVE = {"loss": 4.0, "ce": 4.0, "grad_norm": 1.5}


def config(mode="sync", engine_2bw=False, pipedream_stages=4):
    c = configs.base_config()
    c.model.vocab_size = 257
    c.staleness.update(mode=mode, pipedream_stages=pipedream_stages)
    if engine_2bw:
        c.pipeline.update(stages=2, schedule="2bw")
    return c


def engine(schedule):
    """The runner's options of a 2-stage engine run (what the trainer hands Health)."""
    return EngineOptions(schedule=schedule, stages=2, microbatches=2)


@pytest.mark.parametrize("mode, engine_schedule, want", [
    ("sync", None, (0, 0)), ("2bw", None, (1, 0)), ("pipedream", None, (3, 0)),
    # the engine's loss of update t is the batch whose last-stage gradient it applies
    ("sync", "2bw", (1, 1)), ("sync", "1f1b", (0, 0))])
def test_window_is_the_delay_and_the_log_lag(mode, engine_schedule, want):
    c = config(mode, engine_schedule == "2bw")
    assert health.window(c, engine(engine_schedule) if engine_schedule else None) == want


def test_engine_pipedream_logs_this_update_s_loss():
    c = config()
    c.pipeline.update(stages=2, schedule="pipedream")
    assert health.window(c, engine("pipedream"))[1] == 0


def test_an_update_is_live_unless_non_finite_zero_gradient_or_uniform():
    h = health.Health(config(), start=0)
    assert h.why_dead(LIVE) is None
    assert h.why_dead({"grad_norm": 0.0}) is None  # the engine's fill update applies no gradient
    assert "grad norm exactly 0" in h.why_dead(dict(LIVE, grad_norm=0.0))
    assert "nan" in h.why_dead(dict(LIVE, loss=math.nan, ce=math.nan))
    assert "pinned" in h.why_dead(dict(LIVE, loss=math.log(257), ce=math.log(257)))
    assert h.why_dead(dict(LIVE, loss=math.log(257) + 1e-3, ce=math.log(257) + 1e-3)) is None


def run(h, steps, dead=()):
    for s in range(h.start + 1, steps + 1):
        h.observe(s, dict(LIVE, grad_norm=0.0) if s in dead else LIVE)


def test_sync_checkpoint_is_good_once_the_next_update_is_live():
    h = health.Health(config(), start=0)
    run(h, 4, dead={3})
    # w_s shows in update s+1's loss: 1 (update 2 live) is good, 2 (update 3 dead) and 4 (unseen) are not
    assert [h.is_good(s) for s in (1, 2, 3, 4)] == [True, False, True, False]
    assert h.newest_good([1, 2, 4]) == 1 and h.first_dead() == (3, "grad norm exactly 0")


def test_engine_2bw_needs_the_updates_of_its_in_flight_gradient_and_the_log_lag():
    h = health.Health(config(engine_2bw=True), start=0, options=engine("2bw"))
    run(h, 5, dead={4, 5})
    # [s - d + 1, s + 1 + lag] = [s, s + 2]: checkpoint 1 needs updates 1..3, checkpoint 2 needs 2..4
    assert h.newest_good([1, 2, 3]) == 1


def test_older_than_the_start_counts_as_good_and_the_start_is_proven_again():
    h = health.Health(config(), start=10)
    assert h.is_good(5) and not h.is_good(10)
    run(h, 11)
    assert h.is_good(10)


def test_died_after_consecutive_dead_updates_that_applied_a_gradient():
    h = health.Health(config(), start=0)
    run(h, 2)
    h.observe(3, dict(LIVE, grad_norm=0.0))
    h.observe(4, {"grad_norm": 0.0})  # a fill update neither counts nor breaks the streak
    h.observe(5, dict(LIVE, grad_norm=0.0))
    assert not h.died()
    h.observe(6, dict(LIVE, grad_norm=0.0))
    assert h.died()
    h.observe(7, LIVE)
    assert not h.died()
