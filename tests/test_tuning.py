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
