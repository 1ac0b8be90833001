"""Decide that a config fits a device's memory: ``train.microbatches=-1`` and ``train.auto_remat``.

The measure is XLA's memory analysis of the compiled step (``compiled.memory_analysis()``): per
device, ``arguments + outputs - aliased + temporaries`` of the train step, and the resident state
plus the eval step's temporaries; the peak is the larger of the two.  Only abstract shapes are
lowered and compiled (``jit(...).lower(ShapeDtypeStruct...).compile()``), nothing is allocated.
On an accelerator the figure is that of its own compiler; under ``--dry_run`` it is XLA:CPU's on
fake CPU devices, an estimate of the accelerator's (see :mod:`asyncpp_jax.train.dry_run`).

The budget per device (:func:`budget_bytes`): ``train.device_memory_gb`` when set; else, in a run,
the accelerator's own limit (``memory_stats()['bytes_limit']``; none on CPU, where nothing is
searched and ``microbatches=-1`` keeps its plain meaning); in the dry run, the memory of
``config.hardware`` (:data:`asyncpp_jax.configs.HARDWARE_GB`).

The choice (:func:`decide`), only when a budget applies.  The microbatch counts tried are the divisors of the per-replica batch
``global_batch_size / mesh.data`` that are at least the runner's minimum (``2(stages-1)`` for the
engine's 2bw schedule, else 1).  More microbatches never raise the peak (each holds fewer rows),
so the smallest count that fits is found by bisection over the sorted divisors after one compile
at the smallest: about ``1 + log2(#divisors)`` compiles, one when the smallest fits.
``train.auto_remat=True`` keeps ``model.remat`` off when some count fits without it, else turns it
on and searches again (remat costs a second forward; more microbatches cost only smaller matmuls).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import ml_collections

from asyncpp_jax import configs

log = logging.getLogger("asyncpp_jax")

GB = 1e9


@dataclasses.dataclass
class Measurement:
    """One compiled candidate: its peak bytes per device and what the dry run reports of it."""

    train_peak: int
    eval_peak: int | None  # None: not compiled, the train step alone is over the budget
    detail: dict = dataclasses.field(default_factory=dict)  # the dry run's compiled pieces

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.eval_peak or 0)


def accelerator_budget_bytes(devices) -> int | None:
    """The memory XLA lets one accelerator use (``bytes_limit``), or None on CPU / when unknown.
    Read from a device of this process (another process's cannot be asked); every process of a
    job has the same kind of device, so each decides the same."""
    import jax

    d = next((x for x in devices if x.process_index == jax.process_index()), devices[0])
    if d.platform == "cpu":
        return None
    try:
        stats = d.memory_stats()
    except Exception:  # some PJRT plugins do not implement it
        return None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def budget_bytes(c, devices=None, dry_run: bool = False) -> int | None:
    """Bytes per device the config must fit in (see the module docstring), or None for no budget."""
    if c.train.device_memory_gb:
        return int(c.train.device_memory_gb * GB)
    if dry_run:
        return int(configs.HARDWARE_GB[c.hardware] * GB)
    return accelerator_budget_bytes(devices) if devices is not None else None


def with_fields(c, **fields) -> ml_collections.ConfigDict:
    """A copy of ``c`` with dotted ``fields`` (``train__microbatches`` spells train.microbatches)."""
    c = ml_collections.ConfigDict(c.to_dict())
    for key, value in fields.items():
        *path, last = key.split("__")
        node = c
        for p in path:
            node = node[p]
        node[last] = value
    return c


def microbatch_candidates(c) -> list[int]:
    """Microbatch counts the config's batch, mesh and runner allow, smallest first."""
    data = max(c.mesh.data, 1)
    per_replica = c.train.global_batch_size // data
    low, step = configs.microbatch_rule(c)
    return [m for m in range(low, per_replica + 1, step) if per_replica % m == 0]


class Search:
    """Compiles candidates through ``measure(config) -> Measurement``, once each (cached)."""

    def __init__(self, measure: Callable, budget: int):
        self.measure, self.budget = measure, budget
        self.cache: dict[str, Measurement] = {}
        self.compiles = 0

    def __call__(self, c) -> Measurement:
        # The fields that steer the search do not change the program compiled.
        key = configs.to_json(with_fields(c, hardware="", train__device_memory_gb=0.0, train__auto_remat=False))
        if key not in self.cache:
            self.compiles += 1
            self.cache[key] = self.measure(c)
        return self.cache[key]

    def fits(self, c) -> bool:
        return self(c).peak <= self.budget

    def smallest_microbatches(self, c, counts: list[int]) -> int | None:
        """The smallest of ``counts`` (sorted) whose compiled step fits; bisection, as the peak
        does not rise with the count."""
        if not counts:
            return None
        if self.fits(with_fields(c, train__microbatches=counts[0])):
            return counts[0]
        lo, hi = 0, len(counts)  # counts[lo] does not fit; counts[hi], if it existed, would
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(with_fields(c, train__microbatches=counts[mid])):
                hi = mid
            else:
                lo = mid
        return counts[hi] if hi < len(counts) else None


@dataclasses.dataclass
class Decision:
    config: ml_collections.ConfigDict  # resolved: concrete microbatches and remat
    budget: int | None
    measurement: Measurement | None  # of ``config``; None when no budget applied (nothing compiled)
    fits: bool
    chosen: list[str]  # the automatic fields and what they became
    compiles: int
    search: Search | None = None

    def describe(self) -> str:
        c = self.config
        what = ", ".join(self.chosen) if self.chosen else (
            f"config.train.microbatches={c.train.microbatches}, config.model.remat={c.model.remat} (as set)")
        if self.budget is None:
            return f"{what}; no memory budget (CPU without config.train.device_memory_gb): not measured"
        return (f"{what}: peak {self.measurement.peak / GB:.2f} GB per device of a {self.budget / GB:.2f} GB "
                f"budget ({'fits' if self.fits else 'does NOT fit'}; {self.compiles} compile(s))")


def decide(raw, measure: Callable, budget: int | None, search: Search | None = None) -> Decision:
    """Resolve ``raw``'s automatic fields against ``budget`` bytes per device.

    ``train.microbatches=-1``: the smallest allowed count that fits; ``train.auto_remat``: remat off
    if some count fits without it.  Explicit settings are measured as they are.  Without a budget it
    is :func:`asyncpp_jax.configs.resolve` and nothing is compiled.
    """
    resolved = configs.resolve(raw)
    if budget is None:
        chosen = [f"config.train.microbatches=-1 -> {resolved.train.microbatches}"] if (
            raw.train.microbatches == -1) else []
        return Decision(resolved, None, None, True, chosen, 0)
    search = search or Search(measure, budget)
    auto_m = raw.train.microbatches == -1
    auto_r = bool(raw.train.auto_remat) and not raw.model.remat
    remats = [False, True] if auto_r else [bool(resolved.model.remat)]
    counts = configs.auto_microbatches(resolved) if auto_m else [resolved.train.microbatches]
    for remat in remats:
        c = with_fields(resolved, model__remat=remat)
        m = search.smallest_microbatches(c, counts)
        if m is not None:
            c = with_fields(c, train__microbatches=m)
            chosen = ([f"config.train.microbatches=-1 -> {m}"] if auto_m else []) + (
                [f"config.train.auto_remat=True -> config.model.remat={remat}"] if auto_r else [])
            return Decision(c, budget, search(c), True, chosen, search.compiles, search)
    # Nothing fits: report the config as resolved (smallest count, remat as set or off).
    chosen = ([f"config.train.microbatches=-1 -> {resolved.train.microbatches}"] if auto_m else []) + (
        ["config.train.auto_remat=True -> config.model.remat=False"] if auto_r else [])
    return Decision(resolved, budget, search(resolved), False, chosen, search.compiles, search)


def suggest(decision: Decision, max_devices: int | None = None) -> list[str]:
    """The smallest change that makes a config that does not fit fit, each verified by compiling.

    Tried in order of cost, stopping at the first that fits: more microbatches (same remat), remat
    on (with the smallest count that then fits), then twice / four times the data parallelism
    (activations per device shrink; under expert parallelism the experts too), then twice / four
    times the pipeline stages (the pipeline engine only: each stage holds fewer layers).  Returns
    ``config.x=v`` settings, or [] when none of these fits.
    """
    c, search = decision.config, decision.search
    counts = microbatch_candidates(c)
    more = [m for m in counts if m > c.train.microbatches]
    m = search.smallest_microbatches(c, more)
    if m is not None:
        return [f"config.train.microbatches={m}"]
    if not c.model.remat:
        r = with_fields(c, model__remat=True)
        m = search.smallest_microbatches(r, [x for x in counts if x >= c.train.microbatches])
        if m is not None:
            return ["config.model.remat=True"] + (
                [f"config.train.microbatches={m}"] if m != c.train.microbatches else [])
    for factor in (2, 4):
        data = max(c.mesh.data, 1) * factor
        d = with_fields(c, mesh__data=data)
        if max_devices is not None and configs.devices_needed(d) > max_devices:
            break
        # The same microbatch count if the batch still splits, else the largest that does.
        fewer = [x for x in microbatch_candidates(d) if x <= c.train.microbatches]
        if not fewer:
            continue
        d = with_fields(d, train__microbatches=fewer[-1])
        if configs.validate_errors(d):
            continue
        if search.fits(d):
            return [f"config.mesh.data={data}"] + (
                [f"config.train.microbatches={fewer[-1]}"] if fewer[-1] != c.train.microbatches else [])
    if configs.uses_pipeline(c) and c.pipeline.stages > 1:
        for factor in (2, 4):
            stages = c.pipeline.stages * factor
            s = with_fields(c, pipeline__stages=stages)
            if max_devices is not None and configs.devices_needed(s) > max_devices:
                break
            allowed = microbatch_candidates(s)
            if c.train.microbatches not in allowed:
                s = with_fields(s, train__microbatches=next(
                    (x for x in allowed if x >= c.train.microbatches), c.train.microbatches))
            if configs.validate_errors(s):
                continue
            if search.fits(s):
                return [f"config.pipeline.stages={stages}"] + (
                    [f"config.train.microbatches={s.train.microbatches}"]
                    if s.train.microbatches != c.train.microbatches else [])
    return []


def not_fitting_error(decision: Decision, suggestion: list[str], where: str) -> configs.ConfigError:
    c = decision.config
    fix = (" Smallest change that fits (compiled to check): " + " ".join(f"--{s}" for s in suggestion) + "."
           if suggestion else
           " No larger microbatch count, remat, or 2x/4x data or pipeline parallelism fits; lower "
           "config.train.global_batch_size or config.data.seq_len, or use devices with more memory.")
    return configs.ConfigError(
        f"the train step needs {decision.measurement.peak / GB:.2f} GB per device ({where}) but the budget is "
        f"{decision.budget / GB:.2f} GB (config.train.device_memory_gb, or config.hardware="
        f"{c.hardware!r} in a dry run) with config.train.microbatches={c.train.microbatches} and "
        f"config.model.remat={c.model.remat}.{fix}")
