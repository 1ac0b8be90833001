"""Sync vs 2BW for the six optimizers: the delay gap per optimizer."""

from experiments import analysis
from experiments.studies.common import optimizer, preset
from experiments.studies import tuned
from experiments.study import Study

NAMES = ("adamw", "muon", "soap", "adan", "lion", "mars")


# At cpu_regime also 2BW + error feedback for the optimizers of the paper's Table 2.
EF_NAMES = ("adamw", "muon", "soap")


def base_study(name: str) -> Study:
    """The untuned variants (at ``cpu_regime`` tuned per arm by :mod:`experiments.studies.tuned`)."""
    config, base, seeds, note = preset(name, paper_model="360m")  # the paper's headline size
    variants = {f"{opt}/{mode}": {**optimizer(opt, name), "staleness.mode": mode} for opt in NAMES for mode in ("sync", "2bw")}
    if name in tuned.TUNED_PRESETS:
        variants.update({f"{opt}/ef": {**optimizer(opt, name), "staleness.mode": "2bw", "staleness.mitigation": "ef"}
                         for opt in EF_NAMES})
    return Study("optimizers", config, variants, seeds=seeds, base=base, note=note)


def study(name: str) -> Study:
    return tuned.finish(base_study(name), name)


def analyse(name: str, rows: list[dict], arms, out, claims: dict) -> list[str]:
    """The report's section: each setting's delay gap, EF's shares, the AdamW/Muon claim and the gap over training."""
    return analysis.delay_gaps(name, rows, arms, out, claims)
