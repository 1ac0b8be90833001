"""PipeDream's per-stage delay vs 2BW as the pipeline deepens (P in {2, 4, 8})."""

from experiments.studies.common import optimizer, preset
from experiments.studies import tuned
from experiments.study import Study

DEPTHS = (2, 4, 8)


def base_study(name: str) -> Study:
    """The untuned variants (at ``cpu_regime`` tuned per arm by :mod:`experiments.studies.tuned`)."""
    config, base, seeds, note = preset(name)
    # Divisible by every depth: 8 layers for the CPU presets; for the paper preset SmolLM2-135M's 30
    # layers become 32 (138.5M parameters instead of 134.5M).
    base["model.n_layers"] = 8 if name in ("cpu", "cpu_regime") else 32
    variants = {"adamw/sync": {**optimizer("adamw", name), "staleness.mode": "sync"}}
    variants["adamw/2bw"] = {**optimizer("adamw", name), "staleness.mode": "2bw"}
    for p in DEPTHS:
        variants[f"adamw/pipedream/P={p}"] = {**optimizer("adamw", name), "staleness.mode": "pipedream", "staleness.pipedream_stages": p}
    return Study("schemes", config, variants, seeds=seeds, base=base, note=note)


def study(name: str) -> Study:
    return tuned.finish(base_study(name), name)
