"""The tuned learning-rate tables cannot drift from their evidence: ``common.TUNED_LR[preset]``
equals the picks (:func:`experiments.tuning.pick_lrs`) of the ``lr`` study rows committed in
``experiments/results/<preset>/results.jsonl``."""

from __future__ import annotations

import json
import pathlib

import pytest

from experiments import tuning
from experiments.studies import common

RESULTS_ROOT = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "results"


@pytest.mark.parametrize("preset", sorted(common.TUNED_LR))
def test_tuned_lr_table_equals_the_picks_of_its_committed_lr_study(preset):
    path = RESULTS_ROOT / preset / "results.jsonl"
    if not path.is_file():
        pytest.skip(f"{path.relative_to(RESULTS_ROOT.parent.parent)} is not committed yet: no evidence to check "
                    f"TUNED_LR[{preset!r}] against (run `python -m experiments.sweep lr --preset={preset}` and the report)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    picks = tuning.pick_lrs(rows)
    if not picks:
        pytest.skip(f"{path.relative_to(RESULTS_ROOT.parent.parent)} holds no lr-study rows yet "
                    f"(python -m experiments.sweep lr --preset={preset})")
    assert common.TUNED_LR[preset] == picks, (
        f"TUNED_LR[{preset!r}] differs from the lr study's picks; set it to {picks} "
        f"(python -m experiments.tuning {path.relative_to(RESULTS_ROOT.parent.parent)})")


def test_every_tuned_table_names_every_optimizer():
    for preset, table in common.TUNED_LR.items():
        assert set(table) == set(common.LR), preset
        assert preset in common.PRESETS


@pytest.mark.parametrize("preset", sorted(common.TUNED_SETTINGS))
def test_tuned_lion_settings_equal_the_pick_of_their_committed_lion_study(preset):
    path = RESULTS_ROOT / preset / "results.jsonl"
    if not path.is_file():
        pytest.skip(f"{path.relative_to(RESULTS_ROOT.parent.parent)} is not committed yet")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pick = tuning.pick_lion(rows)
    assert pick is not None, (f"TUNED_SETTINGS[{preset!r}] tunes Lion, but {path.relative_to(RESULTS_ROOT.parent.parent)} "
                              f"holds no lion-study rows (python -m experiments.sweep lion --preset={preset})")
    assert common.TUNED_SETTINGS[preset]["lion"] == pick, (
        f"TUNED_SETTINGS[{preset!r}]['lion'] differs from the lion study's pick; set it to {pick}")


def test_pick_lion_takes_the_lowest_mean_and_never_a_setting_that_diverged():
    def row(variant, seed, val):
        return {"study": "lion", "variant": variant, "seed": seed, "final_val": val}

    rows = [row("b1=0.9/cosine", 0, 2.3), row("b1=0.9/cosine", 1, 2.4),
            row("b1=0.7/wsd", 0, 2.2), row("b1=0.7/wsd", 1, 2.25),
            row("b1=0.5/constant", 0, 2.0), row("b1=0.5/constant", 1, None),  # a seed diverged
            {"study": "lr", "variant": "lion/lr=0.0009/sync", "seed": 0, "final_val": 1.0}]
    assert tuning.pick_lion(rows) == {"optimizer.lion.b1": 0.7, "optimizer.schedule": "wsd",
                                      "optimizer.min_lr_ratio": 0.1, "optimizer.wsd_decay_fraction": 0.2}
    assert tuning.pick_lion(rows[-1:]) is None
