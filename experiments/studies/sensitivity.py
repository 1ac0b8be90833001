"""Sensitivity of the delay gap to batch size, learning rate and weight decay (AdamW and Muon)."""

from experiments.studies.common import optimizer, preset
from experiments.sweep import Study


def study(name: str) -> Study:
    config, base, seeds, note = preset(name)
    batch = base.get("train.global_batch_size", 256)
    variants = {}
    for opt in ("adamw", "muon"):
        lr = optimizer(opt, name)["optimizer.lr"]
        settings = {
            "default": {},
            "batch/2": {"train.global_batch_size": batch // 2},
            "batch*2": {"train.global_batch_size": batch * 2},
            "lr/3": {"optimizer.lr": lr / 3},
            "lr*3": {"optimizer.lr": lr * 3},
            "wd=0": {"optimizer.weight_decay": 0.0},
            "wd=0.3": {"optimizer.weight_decay": 0.3},
        }
        for label, o in settings.items():
            for mode in ("sync", "2bw"):
                variants[f"{opt}/{label}/{mode}"] = {**optimizer(opt, name), **o, "staleness.mode": mode}
    return Study("sensitivity", config, variants, seeds=seeds, base=base, note=note)
