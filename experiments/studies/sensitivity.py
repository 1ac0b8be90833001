"""Sensitivity of the delay gap to batch size, learning rate and weight decay (AdamW and Muon).

The learning-rate arms sit a factor of about 3 either side of the preset's learning rate: two steps
of the ``lr`` study's sqrt(3) grid where the grid reaches (so those runs are the lr study's own,
reused by the sweep for the seeds it has), else 3x rounded to two significant figures.
"""

from experiments import analysis, stats
from experiments.report_format import est, md_table, se_kind
from experiments.studies import lr as lr_study
from experiments.studies.common import optimizer, preset
from experiments.study import Study


def lr_steps(opt: str, lr: float) -> tuple[float, float]:
    """(about lr / 3, about lr * 3): the ``lr`` study's grid two steps away, where it has the point."""
    grid = lr_study.grid(opt)
    i = grid.index(lr) if lr in grid else None
    down = grid[i - 2] if i is not None and i >= 2 else float(f"{lr / 3:.2g}")
    up = grid[i + 2] if i is not None and i + 2 < len(grid) else float(f"{lr * 3:.2g}")
    return down, up


def study(name: str) -> Study:
    config, base, seeds, note = preset(name)
    batch = base.get("train.global_batch_size", 256)
    variants = {}
    for opt in ("adamw", "muon"):
        down, up = lr_steps(opt, optimizer(opt, name)["optimizer.lr"])
        settings = {
            "default": {},
            "batch/2": {"train.global_batch_size": batch // 2},
            "batch*2": {"train.global_batch_size": batch * 2},
            "lr/3": {"optimizer.lr": down},
            "lr*3": {"optimizer.lr": up},
            "wd=0": {"optimizer.weight_decay": 0.0},
            "wd=0.3": {"optimizer.weight_decay": 0.3},
        }
        for label, o in settings.items():
            for mode in ("sync", "2bw"):
                variants[f"{opt}/{label}/{mode}"] = {**optimizer(opt, name), **o, "staleness.mode": mode}
    return Study("sensitivity", config, variants, seeds=seeds, base=base, note=note)


def against_default(arms) -> list[str]:
    """Each setting's delay gap minus the default's, ``(2bw_s - sync_s) - (2bw_d - sync_d)``, paired
    over seeds, judged by the one-sided t test at n - 1 degrees of freedom."""
    body = []
    # variants are OPT/SETTING/ARM, and a setting may hold a slash itself (batch/2)
    for opt, setting in sorted({(v.split("/", 1)[0], v.split("/", 1)[1].rsplit("/", 1)[0]) for v in arms}):
        if setting == "default" or f"{opt}/default/sync" not in arms:
            continue
        d = stats.contrast(arms, {f"{opt}/{setting}/2bw": 1.0, f"{opt}/{setting}/sync": -1.0,
                                  f"{opt}/default/2bw": -1.0, f"{opt}/default/sync": 1.0})
        if d is not None:
            body.append((opt, setting, est(d), stats.direction(d, "larger", "smaller"), se_kind(d)))
    if not body:
        return []
    return ["Each setting's gap minus the default's (paired over seeds; larger or smaller where beyond t SE, "
            "the one-sided t test at n - 1 degrees of freedom):", ""] + md_table(
        ["optimizer", "setting", "gap minus the default's", "against the default", "standard errors"], body) + [""]


def analyse(name: str, rows: list[dict], arms, out, claims: dict) -> list[str]:
    """The report's section: each setting's delay gap, and its difference from the default's."""
    return analysis.delay_gaps(name, rows, arms, out, claims) + against_default(arms)
