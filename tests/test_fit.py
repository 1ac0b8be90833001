"""train/fit.py: microbatches=-1 and auto_remat decided against a memory budget; the smallest change
that makes a config fit.  The search logic runs against a model of the peak (no compile); one test
compiles a small model for real, and the trainer refuses an explicit setting that does not fit."""

import jax
import pytest

from asyncpp_jax import configs
from asyncpp_jax.train import dry_run, fit
from asyncpp_jax.train.trainer import Trainer, fitted_config
from configs.tiny import get_config as tiny

GB = fit.GB


def _cfg(**train):
    c = tiny()
    c.train.update(global_batch_size=64, **train)
    return c


class FakeMeasure:
    """Peak = state + activations / microbatches (x 0.25 with remat) / data: the shape of the real
    curve, so the search's choices and compile counts can be checked without compiling."""

    def __init__(self, state_gb=2.0, act_gb=64.0, shard_state=False):
        self.state, self.act, self.shard, self.calls = state_gb * GB, act_gb * GB, shard_state, []

    def __call__(self, c):
        self.calls.append((c.train.microbatches, c.model.remat, c.mesh.data, c.pipeline.stages))
        data = max(c.mesh.data, 1)
        rows = c.train.global_batch_size / data / c.train.microbatches  # per device and microbatch
        act = self.act * rows / c.train.global_batch_size / c.pipeline.stages
        state = self.state / data if self.shard else self.state
        return fit.Measurement(int(state + act * (0.25 if c.model.remat else 1.0)), 0)


def test_no_budget_compiles_nothing_and_keeps_the_old_meaning():
    measure = FakeMeasure()
    d = fit.decide(_cfg(), measure, None)
    assert d.config.train.microbatches == 1 and measure.calls == [] and d.fits


def test_auto_microbatches_is_the_smallest_divisor_that_fits_by_bisection():
    measure = FakeMeasure()  # 2 + 64/M GB: fits 10 GB from M = 8
    d = fit.decide(_cfg(), measure, int(10 * GB))
    assert d.fits and d.config.train.microbatches == 8 and not d.config.model.remat
    assert "config.train.microbatches=-1 -> 8" in d.describe()
    # 7 divisors of 64: the smallest, then bisection; never more than 1 + ceil(log2(7)) + 1.
    assert len(measure.calls) <= 5 and measure.calls[0][0] == 1


def test_auto_microbatches_compiles_once_when_the_smallest_fits():
    measure = FakeMeasure()
    d = fit.decide(_cfg(), measure, int(100 * GB))
    assert d.config.train.microbatches == 1 and len(measure.calls) == 1


def test_auto_remat_turns_on_only_when_no_count_fits_without_it():
    measure = FakeMeasure(act_gb=640)  # without remat 2 + 640/64 = 12 GB at best
    d = fit.decide(_cfg(auto_remat=True), measure, int(10 * GB))
    assert d.fits and d.config.model.remat is True and d.config.train.microbatches == 32  # 2 + 160/32 = 7
    d = fit.decide(_cfg(auto_remat=True), FakeMeasure(), int(10 * GB))
    assert d.config.model.remat is False and d.config.train.microbatches == 8
    assert not fit.decide(_cfg(), FakeMeasure(act_gb=640), int(10 * GB)).fits  # remat not allowed


def test_pipeline_2bw_respects_its_minimum_microbatches():
    c = _cfg()
    c.pipeline.update(stages=4, schedule="2bw")
    assert fit.microbatch_candidates(c) == [8, 16, 32, 64]  # >= 2(P-1) = 6, dividing 64
    c.mesh.data = 2
    assert fit.microbatch_candidates(c) == [8, 16, 32]


def test_auto_microbatches_on_a_flushed_pipeline_starts_at_the_same_floor_with_or_without_a_budget():
    c = _cfg()
    c.pipeline.update(stages=4, schedule="1f1b")
    assert configs.auto_microbatches(c) == [8, 16, 32, 64]  # bubble (P-1)/(M+P-1) <= 1/3: M >= 6
    assert configs.resolve(c).train.microbatches == 8
    measure = FakeMeasure(act_gb=0.1)  # every count fits: the budget search still starts at the floor
    assert fit.decide(c, measure, int(10 * GB)).config.train.microbatches == 8 and measure.calls[0][0] == 8
    assert fit.microbatch_candidates(c)[0] == 1  # an explicit count below the floor still runs
    c.train.global_batch_size = 4  # no divisor reaches 6: the largest the schedule runs
    assert configs.auto_microbatches(c) == [4] and configs.resolve(c).train.microbatches == 4
    configs.validate(configs.resolve(c))


def test_an_explicit_setting_that_does_not_fit_suggests_the_smallest_change():
    measure = FakeMeasure()
    d = fit.decide(_cfg(microbatches=2), measure, int(10 * GB))
    assert not d.fits
    assert fit.suggest(d) == ["config.train.microbatches=8"]
    err = str(fit.not_fitting_error(d, fit.suggest(d), "test"))
    assert "config.train.microbatches=2" in err and "--config.train.microbatches=8" in err
    # More microbatches cannot do it (the batch has 64 rows): remat, then data parallelism.
    d = fit.decide(_cfg(microbatches=64), FakeMeasure(act_gb=640), int(10 * GB))
    assert fit.suggest(d) == ["config.model.remat=True"]  # 2 + 2.5 GB
    c = _cfg(microbatches=64)
    c.model.remat = True
    measure = FakeMeasure(act_gb=640, shard_state=True)  # 2/data + 160/M/data: data 2 -> 1 + 2.5
    d = fit.decide(c, measure, int(4 * GB))
    assert fit.suggest(d, max_devices=4) == ["config.mesh.data=2", "config.train.microbatches=32"]
    assert fit.suggest(d, max_devices=1) == []  # no device for it


def test_budget_sources():
    c = _cfg()
    assert fit.budget_bytes(c, jax.devices()) is None  # a CPU run: no budget unless set
    assert fit.budget_bytes(c, dry_run=True) == int(configs.HARDWARE_GB["cpu"] * GB)
    c.hardware = "h100-80gb"
    assert fit.budget_bytes(c, dry_run=True) == int(80 * GB)
    c.train.device_memory_gb = 12.5
    assert fit.budget_bytes(c, jax.devices()) == int(12.5 * GB)


def test_config_fields_are_validated():
    c = _cfg()
    c.hardware = "h100"
    c.train.device_memory_gb = -1.0
    with pytest.raises(configs.ConfigError) as e:
        configs.validate(c)
    assert "config.hardware='h100' is unknown" in str(e.value)
    assert "config.train.device_memory_gb=-1.0 must be" in str(e.value)


def _small():
    c = tiny()
    c.model.update(d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, n_layers=2)
    c.data.seq_len = 32
    c.train.global_batch_size = 16
    return c


@pytest.mark.slow  # about 8 compiles of a small model: ~60 s of CPU
def test_real_compiles_pick_microbatches_and_the_trainer_refuses_a_setting_that_does_not_fit(tmp_path):
    """Budget set between the compiled peaks at 1 and 16 microbatches: -1 picks a count that fits,
    and the trainer stops an explicit microbatches=1 before training, naming the count that fits."""
    devices = jax.devices()[:1]
    c = _small()
    search = fit.Search(lambda x: dry_run.measure(x, devices, None), 0)  # one cache for every compile
    peak = {m: search(fit.with_fields(configs.resolve(c), train__microbatches=m)).peak for m in (1, 16)}
    assert peak[16] < peak[1]
    search.budget = budget = int((peak[1] + peak[16]) / 2)
    c.train.device_memory_gb = budget / GB
    d = fit.decide(c, search.measure, budget, search)
    assert d.fits and 1 < d.config.train.microbatches <= 16 and d.measurement.peak <= budget
    assert search.compiles <= 5
    c.train.microbatches = 1
    with pytest.raises(configs.ConfigError) as e:
        Trainer(c, tmp_path / "run", devices=devices)
    assert "config.train.microbatches=1" in str(e.value) and "--config.train.microbatches=" in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing started


def test_the_default_cpu_run_compiles_nothing_extra(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("compiled a candidate without a memory budget")

    monkeypatch.setattr(dry_run, "measure", refuse)
    assert fitted_config(tiny(), jax.devices()).train.microbatches == 1
