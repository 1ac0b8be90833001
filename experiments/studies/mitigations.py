"""What each mitigation recovers of the delay gap, for AdamW and Muon.

Beyond the paper's four: ``nesterov`` (Ajanthan et al. 2025's look-ahead: NAdamW with b1 0.99 for
AdamW, Nesterov momentum 0.99 plus a NAdamW side branch for Muon) and ``weight_prediction``
(SpecTrain / PipeMare: the gradient taken at ``w_t + (w_t - w_{t-1})``).  PipeMare's learning-rate
rescheduling has no arm: at 2BW's one-step delay its factor ``1^-p`` is 1, and config validation
rejects it there.
"""

from experiments.studies.common import optimizer, preset
from experiments.studies import tuned
from experiments.study import Study


def base_study(name: str) -> Study:
    """The untuned variants (at ``cpu_regime`` tuned per arm by :mod:`experiments.studies.tuned`)."""
    config, base, seeds, note = preset(name, paper_model="360m")  # the paper's headline size
    steps = base.get("train.steps", 20000)
    k = max(steps // 10, 1)
    arms = {
        "sync": {"staleness.mode": "sync"},
        "none": {"staleness.mode": "2bw"},
        "ef": {"staleness.mode": "2bw", "staleness.mitigation": "ef"},
        "taylor": {"staleness.mode": "2bw", "staleness.mitigation": "taylor"},
        "sync_start": {"staleness.mode": "2bw", "staleness.sync_start_steps": k},
        "sync_cooldown": {"staleness.mode": "2bw", "staleness.sync_cooldown_steps": k},
        "ef+sync_start": {"staleness.mode": "2bw", "staleness.mitigation": "ef", "staleness.sync_start_steps": k},
        "nesterov": {"staleness.mode": "2bw", "staleness.nesterov": True},
        "weight_prediction": {"staleness.mode": "2bw", "staleness.weight_prediction": True},
    }
    variants = {f"{opt}/{arm}": {**optimizer(opt, name), **o} for opt in ("adamw", "muon") for arm, o in arms.items()}
    return Study("mitigations", config, variants, seeds=seeds, base=base, note=note)


def study(name: str) -> Study:
    return tuned.finish(base_study(name), name)
