"""The delay gap as a function of momentum: AdamW's b1 and Muon's mu."""

from experiments.studies.common import optimizer, preset
from experiments.studies import tuned
from experiments.study import Study

MOMENTA = (0.8, 0.9, 0.95, 0.98)


def base_study(name: str) -> Study:
    """The untuned variants (at ``cpu_regime`` tuned per arm, so per momentum value, by
    :mod:`experiments.studies.tuned`)."""
    config, base, seeds, note = preset(name)
    variants = {}
    for opt, key in (("adamw", "optimizer.adamw.b1"), ("muon", "optimizer.muon.mu")):
        for beta in MOMENTA:
            for mode in ("sync", "2bw"):
                variants[f"{opt}/beta={beta}/{mode}"] = {**optimizer(opt, name), key: beta, "staleness.mode": mode}
    return Study("momentum", config, variants, seeds=seeds, base=base, note=note)


def study(name: str) -> Study:
    return tuned.finish(base_study(name), name)
