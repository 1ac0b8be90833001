"""What each mitigation recovers of the delay gap, for AdamW and Muon."""

from experiments.studies.common import optimizer, preset
from experiments.sweep import Study


def study(name: str) -> Study:
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
    }
    variants = {f"{opt}/{arm}": {**optimizer(opt), **o} for opt in ("adamw", "muon") for arm, o in arms.items()}
    return Study("mitigations", config, variants, seeds=seeds, base=base, note=note)
