"""What a study is: named variants (each a dict of ``--config`` overrides) x a cartesian grid of
overrides x seeds, and the runs it expands to.

A module of its own, imported by the study definitions (``experiments/studies``) and by the sweep
that runs them, so that neither imports the other.
"""

from __future__ import annotations

import dataclasses
import itertools


@dataclasses.dataclass(frozen=True)
class Study:
    name: str
    config: str  # config file, relative to the repository root
    variants: dict  # variant name -> {dotted config key: value}
    grid: dict = dataclasses.field(default_factory=dict)  # dotted key -> list of values (cartesian)
    seeds: tuple = (0,)
    base: dict = dataclasses.field(default_factory=dict)  # overrides for every run
    note: str = ""  # expected compute, what the preset is for


@dataclasses.dataclass(frozen=True)
class Run:
    study: str
    variant: str
    point: tuple  # ((key, value), ...) of the grid
    seed: int
    overrides: dict

    @property
    def run_id(self) -> str:
        parts = [self.variant] + [f"{k.split('.')[-1]}={v}" for k, v in self.point] + [f"seed={self.seed}"]
        return "__".join(p.replace("/", "-") for p in parts)


def expand(study: Study) -> list[Run]:
    """Variants x grid points x seeds, in that nesting order; later overrides win (base < variant < grid)."""
    keys = list(study.grid)
    points = [tuple(zip(keys, values)) for values in itertools.product(*(study.grid[k] for k in keys))] or [()]
    runs = []
    for variant, overrides in study.variants.items():
        for point in points:
            for seed in study.seeds:
                merged = {**study.base, **overrides, **dict(point), "seed": seed}
                runs.append(Run(study.name, variant, point, seed, merged))
    ids = [r.run_id for r in runs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"study {study.name!r} expands to duplicate run ids; give variants distinct names")
    return runs
