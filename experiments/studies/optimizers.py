"""Sync vs 2BW for the six optimizers: the delay gap per optimizer."""

from experiments.studies.common import optimizer, preset
from experiments.sweep import Study

NAMES = ("adamw", "muon", "soap", "adan", "lion", "mars")


def study(name: str) -> Study:
    config, base, seeds, note = preset(name, paper_model="360m")  # the paper's headline size
    variants = {f"{opt}/{mode}": {**optimizer(opt, name), "staleness.mode": mode} for opt in NAMES for mode in ("sync", "2bw")}
    return Study("optimizers", config, variants, seeds=seeds, base=base, note=note)
