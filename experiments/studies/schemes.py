"""PipeDream's per-stage delay vs 2BW as the pipeline deepens (P in {2, 4, 8})."""

from experiments.studies.common import optimizer, preset
from experiments.sweep import Study

DEPTHS = (2, 4, 8)


def study(name: str) -> Study:
    config, base, seeds, note = preset(name)
    if name == "cpu":
        base["model.n_layers"] = 8  # divisible by every depth
    variants = {"adamw/sync": {**optimizer("adamw"), "staleness.mode": "sync"}}
    variants["adamw/2bw"] = {**optimizer("adamw"), "staleness.mode": "2bw"}
    for p in DEPTHS:
        variants[f"adamw/pipedream/P={p}"] = {**optimizer("adamw"), "staleness.mode": "pipedream", "staleness.stages": p}
    return Study("schemes", config, variants, seeds=seeds, base=base, note=note)
