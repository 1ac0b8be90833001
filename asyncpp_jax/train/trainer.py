"""The training loop: data → runner's ``train_step`` → eval, metrics, checkpoints.

Guarantees (each is tested):
- resume is exact: a run interrupted at a checkpoint and restarted ends with bit-identical params;
- SIGTERM (preemption) or SIGINT (Ctrl-C) saves a checkpoint at the current step and returns
  cleanly; a second signal stops at once; with several processes, SIGTERM to any one stops every
  process at the same saved step (``train.preemption``);
- a non-finite loss stops the run with :class:`TrainingDiverged` before anything is saved, so the
  last good checkpoint is what remains; before each save the whole state (parameters, optimizer
  state, the engine's in-flight ``runner_state``) is checked to be finite (one reduced flag on
  device), so no checkpoint holds a NaN that the logged loss did not show (2bw logs update t-1's loss);
- a dead start (gradient norm exactly 0, or the loss pinned at log(vocab), over the first
  updates of a fresh run) stops with :class:`DeadStart` naming the likely settings; a model that
  dies later (the same signs over consecutive updates) stops with :class:`TrainingDiverged`;
- a checkpoint the run calls good was followed by live updates (train/health.py); when a run stops
  on a divergence, the newer, unproven checkpoints are set aside, so a rerun resumes from a good one;
- one run per workdir: ``run.lock`` is held for the whole run (train/workdir_lock.py);
- a stop signal during the first step's compilation stops at once (status written, nothing to save);
- an exception waits for in-flight checkpoint writes, so no saved work is lost;
- checkpoints are verified before a restore (the newest intact one is used) and a checkpoint that
  cannot be written stops the run at once with :class:`CheckpointError` (see checkpoint.py);
- a resume whose state layout differs from the checkpoints', or whose identity does (tokenizer,
  corpus, seq_len, model shape; train/resume.py) unless ``train.accept_changed`` names it, is
  refused before the workdir changes; each checkpoint records the config it was trained under.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from asyncpp_jax import configs
from asyncpp_jax.data import (CorpusError, Mixture, PackedWindows, load_corpus, load_mixture, make_eval_batches,
                              make_train_iterator, prepare_corpus_for)
from asyncpp_jax.models import count_params, dense, hf_llama
from asyncpp_jax.models.flops import flops_per_token
from asyncpp_jax.optim import describe_routing
from asyncpp_jax.train import dry_run, fit, preemption, profile
from asyncpp_jax.train import health as health_lib
from asyncpp_jax.train import runner as runner_lib
from asyncpp_jax.train import step as step_lib
from asyncpp_jax.train import host_memory
from asyncpp_jax.train.batch_layout import batch_layout
from asyncpp_jax.train_state import from_host
from asyncpp_jax.train.checkpoint import CheckpointError, Checkpointer
from asyncpp_jax.train.metrics import ConsoleLine, LoggerUnavailable, MetricWriter, check_available  # noqa: F401 - re-exported
from asyncpp_jax.train.resume import check_resume, run_record
from asyncpp_jax.train.workdir_lock import WorkdirBusy, WorkdirLock, WorkdirUnwritable  # noqa: F401 - WorkdirBusy re-exported

log = logging.getLogger("asyncpp_jax")


EARLY_STEPS = 2  # updates after which a non-finite loss can be the learning rate's doing


DEAD_START_UPDATES = 3  # updates of a fresh run (that apply a gradient) over which a dead start is judged


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; nothing after the last good checkpoint was saved."""


class DeadStart(TrainingDiverged):
    """The model cannot learn from its start (zero gradient, or uniform predictions): a setting's doing."""


class WorkdirError(RuntimeError):
    """The workdir cannot be created or written (the environment's doing, not a setting's)."""


@dataclasses.dataclass
class Result:
    status: str  # 'finished' | 'preempted' (SIGTERM) | 'paused' (until_step)
    step: int
    val_loss: float | None = None  # nats per token
    val_loss_per_byte: float | None = None  # nats per byte
    unigram: dict | None = None  # baselines in nats per byte


@dataclasses.dataclass
class _Progress:
    """Where a run stands; the last validation figures and the step they belong to."""

    start: int
    step: int
    status: str = "finished"
    val: dict = dataclasses.field(default_factory=dict)
    val_step: int | None = None


def _without_fill_loss(metrics: dict) -> dict:
    """The pipeline engine's ``2bw`` logs the loss of the batch whose gradient an update applies;
    at a fill update (the first delayed one) none is applied, so there is no loss to log."""
    if metrics.get("loss_microbatches", 1) > 0:
        return metrics
    dropped = ("loss", "ce", "z_loss", *dense.MOE_METRICS)
    return {k: v for k, v in metrics.items() if k not in dropped}


def fitted_config(config, devices):
    """``config`` resolved, its microbatches / remat decided against the device memory budget
    (train/fit.py): on an accelerator, or with ``train.device_memory_gb`` set, by compiling the
    step; with no budget (CPU) nothing is compiled.  A setting that does not fit is a ConfigError."""
    budget = fit.budget_bytes(config, devices)
    decision = fit.decide(config, lambda c: dry_run.measure(c, devices, budget), budget)
    if not decision.fits:
        raise fit.not_fitting_error(decision, fit.suggest(decision, max_devices=len(devices)),
                                    f"compiled for {devices[0].platform}")
    if decision.budget is not None or config.train.microbatches == -1:
        log.info("memory: %s", decision.describe())
    return decision.config


class Trainer:
    def __init__(self, config, workdir: str | pathlib.Path, devices=None):
        configs.validate(config)
        check_available(configs.loggers(config))  # before any data is prepared or anything compiled
        configs.check_workdir(workdir)
        self.workdir = pathlib.Path(workdir)
        created = not self.workdir.exists()
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WorkdirError(f"cannot create the workdir {self.workdir}: {e.strerror or e}; pass a --workdir on "
                               "a writable file system.") from e
        self._lock = WorkdirLock(self.workdir)
        try:
            self._lock.acquire()
        except WorkdirUnwritable as e:
            raise WorkdirError(str(e)) from e
        try:
            self._setup(config, devices)
        except BaseException:
            self._lock.release()
            if created:  # a run refused before it wrote anything leaves no empty workdir behind
                with contextlib.suppress(OSError):
                    self.workdir.rmdir()
            raise

    def _setup(self, config, devices):
        if config.model.get("init_from"):  # before the corpus, whose preparation can take hours
            hf_llama.ParamReader(config.model, config.model.init_from[len("hf:"):])
        devices = list(devices if devices is not None else jax.devices())
        config = self.config = fitted_config(config, devices)
        c = config

        d = c.data
        try:
            if configs.mixture_sources(c):
                self.corpus = load_mixture(d, configs.mixture_sources(c), log=log.info)
                log.info("data mixture: %s", self.corpus.describe())
            else:
                self.corpus = load_corpus(prepare_corpus_for(d, log=log.info), verify=d.verify_checksums)
        except ValueError as e:  # the tokenizer's errors name their setting and the fix: a setting's mistake
            if isinstance(e, CorpusError) or "config." not in str(e):
                raise
            raise configs.ConfigError(str(e)) from e
        configs.check_against_tokenizer(c, self.corpus.vocab_size)

        self.runner = r = runner_lib.build(c, devices)
        self.mesh, self.data_size, self.pipelined, self.shapes = r.mesh, r.data_size, r.pipelined, r.shapes
        self.optimizer, self.schedule, self.train_step = r.optimizer, r.schedule, r.train_step
        self.routing = describe_routing(c.optimizer, r.shapes)
        # Rows of every global batch this process loads: those of the data replicas its devices hold.
        self.batch_layout = batch_layout(self.mesh, c.train.global_batch_size, c.train.microbatches)
        self.flops_per_token = flops_per_token(c.model, c.data.seq_len)
        if all(d.platform == "cpu" for d in devices):  # before anything is allocated
            host_memory.check_fits(c, r.abstract_state(jax.random.key(c.seed)), len(r.mesh.devices.flat))
        if r.pipelined:
            log.info("pipeline engine, %s schedule:\n%s", c.pipeline.schedule, r.schedule_plan().render())
        self.eval_step = r.eval_step()
        batches = make_eval_batches(
            self.corpus, d.seq_len, c.train.global_batch_size // c.train.microbatches, c.train.eval_batches
        )
        group = r.eval_group()
        self.eval_batches = [np.concatenate(batches[i:i + group]) for i in range(0, len(batches), group)]
        self.test_batches = self._test_batches(c, len(batches), group)
        # Before anything in the workdir changes (orbax's manager cleans up on creation).
        record = run_record(c, self.corpus)
        self.resume_plan = check_resume(self.workdir, c, r.abstract_state(jax.random.key(c.seed)), record)
        self.checkpointer = Checkpointer(self.workdir / "checkpoints", c.train.keep_checkpoints,
                                         c.train.async_checkpoint)
        self.checkpointer.run_record = record
        self._all_finite: dict = {}  # the jitted finiteness flags per device set, built at the first save
        self._early: list[tuple[float, float]] = []  # (loss, grad norm) of the first updates: dead start
        self.health: health_lib.Health | None = None  # set when a run starts
        self._retired: tuple[int | None, str] | None = None  # (newest good step, what was set aside) on a divergence
        self.compile_abandoned = False  # a stop signal came while the first step compiled

    # ------------------------------------------------------------------------------------------
    def _write_config(self, changed: list[str]) -> None:
        """config.json holds the settings of the run's latest start (each checkpoint's manifest holds
        those its state was trained under, which the export reads); replaced atomically, and left
        untouched when it already says the same."""
        path = self.workdir / "config.json"
        if changed:
            log.warning("resuming with settings that differ from those the checkpoint was trained under (%s now "
                        "records these; each checkpoint keeps its own):\n  %s", path, "\n  ".join(changed))
        if jax.process_index() == 0:
            for name, text in (("config.json", configs.to_json(self.config)), ("routing.txt", self.routing + "\n")):
                with contextlib.suppress(OSError):
                    if (self.workdir / name).read_text() == text:
                        continue
                tmp = self.workdir / (name + ".tmp")
                tmp.write_text(text)
                os.replace(tmp, self.workdir / name)

    def _new_iterator(self):
        return make_train_iterator(
            self.corpus, self.config.data.seq_len, self.config.train.global_batch_size, seed=self.config.seed,
            rows=self.batch_layout.rows,
        )

    def restore_or_init(self):
        """The latest checkpoint in the workdir if any, else a fresh state and iterator.

        A restore allocates only the restored state: its target is abstract (``eval_shape``).
        """
        key = jax.random.key(self.config.seed)
        iterator = self._new_iterator()
        step = self._intact_step()
        abstract = self.runner.abstract_state(key)
        if step is None:
            return self.runner.init_state(key), iterator
        fresh_data = self.resume_plan.new_data
        state, iterator = self.checkpointer.restore(step, abstract, iterator, data_position=not fresh_data)
        log.info("resumed from %s at step %d%s", self.checkpointer.directory / str(step), step,
                 "; the data changed on purpose, so its iterator starts afresh on the new data" if fresh_data else "")
        return state, iterator

    def _intact_step(self) -> int | None:
        """The newest checkpoint that passes its checksums; newer broken ones are set aside."""
        step, rejected = self.checkpointer.select_intact()
        if rejected:
            newest = rejected[0][0]
            for s, why in rejected:
                log.warning("checkpoint %s is unusable: %s", self.checkpointer.directory / str(s), why)
            where = self.checkpointer.set_aside([s for s, _ in rejected])
            if step is None:
                log.warning("starting afresh instead of at step %d: no checkpoint had been sealed, so none was "
                            "reported as saved; the unsealed checkpoint(s) were moved to %s", newest, where)
            else:
                log.warning("resuming from step %d instead of step %d: %d step(s) will be redone; the unusable "
                            "checkpoint(s) were moved to %s", step, newest, newest - step, where)
        return step

    def _test_batches(self, c, n_val: int, group: int) -> list:
        """``config.train.test_batches`` batches from the val split's end, checked to share no window
        with the validation batches from its start (both are fixed sets, the same in every run)."""
        if not c.train.test_batches:
            return []
        size = c.train.global_batch_size // c.train.microbatches
        windows = len(PackedWindows(self.corpus.tokens("val"), c.data.seq_len))
        if n_val + c.train.test_batches > windows // size:  # the test set's first batch would be a val one
            raise CorpusError(
                f"The val split of {self.corpus.path} holds {windows} windows of config.data.seq_len="
                f"{c.data.seq_len}: too few for config.train.eval_batches={c.train.eval_batches} and "
                f"config.train.test_batches={c.train.test_batches} batches of {size} without overlap. Lower "
                "config.train.test_batches or raise config.data.val_fraction.")
        batches = make_eval_batches(self.corpus, c.data.seq_len, size, c.train.test_batches, from_end=True)
        return [np.concatenate(batches[i:i + group]) for i in range(0, len(batches), group)]

    def evaluate(self, params, batches=None, name: str = "val") -> dict:
        """Mean loss over ``batches`` (default: the validation batches) as ``{name}_loss`` (nats per
        token) and ``{name}_loss_per_byte`` (over the val split's bytes per token)."""
        total = count = 0.0
        for batch in self.eval_batches if batches is None else batches:  # every process holds the whole batch
            t, n = self.eval_step(params, from_host(step_lib.eval_sharding(self.mesh), batch))
            total, count = total + float(t), count + float(n)
        loss = total / count
        return {f"{name}_loss": loss, f"{name}_loss_per_byte": loss / self.corpus.bytes_per_token("val")}

    def close(self) -> None:
        try:
            self.checkpointer.close()
        finally:
            self._lock.release()

    def _write_status(self, status: str, step: int, **extra) -> None:
        """status.json, replaced atomically; every figure in it belongs to ``step``."""
        if jax.process_index() != 0:
            return
        path = self.workdir / "status.json"
        try:
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps({"status": status, "step": step, **extra}, indent=2))
            os.replace(tmp, path)
        except OSError as e:  # e.g. the disk that refused the checkpoint refuses this too
            log.error("could not write %s (%s); the run's status is %r at step %d", path, e, status, step)

    # ------------------------------------------------------------------------------------------
    def run(self, until_step: int | None = None) -> Result:
        """Train to ``config.train.steps``, or stop early at ``until_step`` with a checkpoint there.

        ``until_step`` leaves the schedule untouched (it is a pause, not a shorter run): a later
        ``run()`` in the same workdir resumes and ends exactly where an uninterrupted run would.
        """
        stop = preemption.Preemption(self.checkpointer.manager)
        with stop:  # from here a stop signal sets a flag, also while the init compiles or a restore reads
            return self._run(stop, until_step)

    def _run(self, stop, until_step: int | None) -> Result:
        c = self.config
        stop_at = c.train.steps if until_step is None else min(until_step, c.train.steps)
        state, iterator = self.restore_or_init()
        self._write_config(self.resume_plan.changed)  # only now: a refused restore changes nothing
        p = _Progress(start=int(state.step), step=int(state.step))
        self.health = health_lib.Health(c, p.start, self.runner.options)
        writer = MetricWriter(self.workdir, configs.loggers(c), resume_step=p.start, config=c)
        if writer.dropped:
            log.info("metrics.jsonl: dropped %d row(s) logged after step %d; those steps are redone",
                     writer.dropped, p.start)
        unigram = self.corpus.unigram_entropy_nats_per_byte()
        if p.start == 0:
            self._log_model(state)
        self._console = ConsoleLine(c.train.steps, c.train.log_every)  # stdout not a terminal: plain lines
        bar = tqdm(total=c.train.steps, initial=p.start, desc=c.name, unit="step", dynamic_ncols=True,
                   disable=not c.train.progress_bar or jax.process_index() != 0 or self._console.enabled)
        try:
            self.checkpointer.check_writable()  # an unwritable directory stops the run now, not at the first save
            state = self._loop(state, iterator, stop_at, p, writer, bar, stop)
            self.checkpointer.wait()  # in-flight async saves land and are sealed
            if p.status == "preempted" and p.step > p.start:  # only now is the checkpoint sealed
                log.warning("stopped: saved a checkpoint at step %d; rerun the same command to resume", p.step)
        except DeadStart:
            self._write_status("dead_start", p.step, last_checkpoint=self._good_checkpoint()[0])
            raise
        except TrainingDiverged:
            self._write_status("diverged", p.step, last_checkpoint=self._good_checkpoint()[0])
            raise
        except CheckpointError as e:
            self._settle_checkpoints()
            self._write_status("checkpoint_failed", p.step, error=str(e), last_checkpoint=self.last_sealed())
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: stop at once, without waiting for in-flight saves
            self._write_status("interrupted", p.step, last_checkpoint=self.last_sealed())
            raise
        except BaseException:
            self._settle_checkpoints()  # in-flight saves land, also on a crash
            raise
        finally:
            bar.close()
            writer.close()
        if p.status == "finished" and p.val_step != p.step and p.step == c.train.steps:
            p.val, p.val_step = self.evaluate(state.params), p.step  # a run resumed at its last step still reports
        self.state = state
        val = p.val if p.val_step == p.step else {}  # never a validation loss of another step beside this one
        if p.status == "finished" and self.test_batches:  # once, at the end: nothing is ever picked by it
            val = {**val, **self.evaluate(state.params, self.test_batches, "test")}
        self._write_status(p.status, p.step, **val, unigram=unigram)
        return Result(p.status, p.step, val.get("val_loss"), val.get("val_loss_per_byte"), unigram)

    def _loop(self, state, iterator, stop_at: int, p: "_Progress", writer: MetricWriter, bar, stop):
        """Steps until ``stop_at``, a stop signal, or an error; ``p`` follows along (also on an error).

        An update's metrics are fetched while the next update runs (one update late), so the host
        never stalls the device's queue between updates.  Where the state itself is used (an eval, a
        save, the end) the update's own metrics are fetched first: a divergence is always caught
        before the state it produced is evaluated or saved.
        """
        c = self.config
        profiler = profile.StepProfiler(self.workdir, c.train.profile_start, c.train.profile_steps)
        with contextlib.closing(profiler):
            self._last_t = time.perf_counter()
            # Also primes every process's preemption sync counter before the first step.
            stop_now = stop.reached(p.step) and p.step < c.train.steps
            if stop_now:
                p.status = "preempted"
            pending = None  # (step, metrics on device) of an update not yet checked
            while p.step < stop_at and not stop_now:
                batch = self.batch_layout.assemble(next(iterator))
                if profiler.before_step(p.step, self.train_step, state, batch):
                    self._last_t = time.perf_counter()  # the trace's start is not the step's time
                if p.step == p.start and stop.interruptible():
                    out = self._first_step(state, batch, stop)
                    if out is None:  # stopped while the first step compiled: nothing changed, nothing to save
                        p.status = "preempted"
                        self.compile_abandoned = True
                        log.warning("stopped during the first step's compilation at step %d; nothing to save "
                                    "(the state is that of step %d); rerun the same command to resume", p.step, p.step)
                        break
                    state, metrics = out
                else:
                    state, metrics = self.train_step(state, batch)
                p.step += 1
                if profiler.after_step(p.step, state, metrics):
                    self._last_t = time.perf_counter()  # nor is writing it out the next step's
                if pending is not None:
                    self._take(*pending, None, p, writer, bar)
                pending = (p.step, metrics)
                self.checkpointer.poll()
                stop_now = stop.reached(p.step)  # every process, every step
                stopping = p.step < c.train.steps and (stop_now or p.step == stop_at)
                saving = stopping or p.step % c.train.checkpoint_every == 0 or p.step == c.train.steps
                if saving or p.step % c.train.eval_every == 0:
                    self._take(*pending, state, p, writer, bar)
                    pending = None
                if saving:
                    self._check_finite(state, p)
                    self.checkpointer.protected = self.health.newest_good(self.checkpointer.sealed_steps())
                    self.checkpointer.save(p.step, state, iterator)
                if stopping:
                    p.status = "preempted" if stop_now else "paused"
                    break
        return state

    def _take(self, step: int, metrics, state, p: "_Progress", writer: MetricWriter, bar) -> None:
        """Fetch update ``step``'s metrics and act on them: stop on a divergence or a dead model, log,
        and (``state`` given: the state after ``step``) evaluate where due."""
        metrics = jax.device_get(metrics)  # one small transfer; the next update is already queued
        self._last_t = self._add_speed(metrics, self._last_t)
        metrics = _without_fill_loss(metrics)
        why_dead = self.health.observe(step, metrics)
        try:
            if not (math.isfinite(metrics.get("loss", 0.0)) and math.isfinite(metrics["grad_norm"])):
                raise TrainingDiverged(self._divergence_message(metrics, step, p.start))
            self._check_dead_start(metrics, step, p.start)
            if self.health.died():
                raise TrainingDiverged(
                    f"the model died: {why_dead} over the last {health_lib.DEAD_UPDATES} updates (stopped at "
                    f"step {step}). {self._last_good_text()} Lower config.optimizer.lr, raise warmup_steps, or "
                    "set config.optimizer.grad_clip.")
        except TrainingDiverged:
            p.step = step  # the run stands where it diverged (the next update, already run, is dropped)
            raise
        self._record(state, metrics, step, p, writer, bar)

    def _first_step(self, state, batch, stop):
        """The first update on a worker thread (it compiles the step), while this thread watches for a
        stop signal; None if one came before it finished (the compile is abandoned: exit soon)."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="first-step")
        future = pool.submit(self.train_step, state, batch)
        pool.shutdown(wait=False)
        while True:
            try:
                return future.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                if stop.reached(0):
                    return None

    def _check_finite(self, state, p: "_Progress") -> None:
        """Raise :class:`TrainingDiverged` if any float in ``state`` is NaN/inf (parameters, optimizer state,
        the engine's in-flight buffers): one flag per leaf, reduced on device, one small transfer."""
        paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(state)[0])
        floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
        # One program per set of devices the leaves live on (the mesh, or each of mpmd's groups).
        by_devices: dict = {}
        for i in floats:
            by_devices.setdefault(frozenset(leaves[i].sharding.device_set), []).append(i)
        flags = {}
        for devices, idx in by_devices.items():
            if devices not in self._all_finite:
                mesh = leaves[idx[0]].sharding.mesh
                self._all_finite[devices] = jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]),
                                                    out_shardings=NamedSharding(mesh, PartitionSpec()))
            flags.update(zip(idx, np.asarray(jax.device_get(self._all_finite[devices]([leaves[i] for i in idx])))))
        ok = np.asarray([flags[i] for i in floats])
        if ok.all():
            return
        bad = [jax.tree_util.keystr(paths[i]) for i, good in zip(floats, ok) if not good]
        shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise TrainingDiverged(
            f"the state after step {p.step} holds non-finite values ({len(bad)} leaves: {shown}) although the "
            "logged loss and grad norm were finite (under 2bw they belong to the previous batch); stopped "
            f"without saving. {self._last_good_text()} Lower config.optimizer.lr, raise warmup_steps, or set "
            "config.optimizer.grad_clip.")

    def _check_dead_start(self, metrics: dict, step: int, start: int) -> None:
        """Over the first updates of a fresh run that apply a gradient: a gradient norm of exactly 0 at
        each, or a cross-entropy equal to log(vocab) at each (uniform predictions), is a dead model."""
        if start != 0 or "loss" not in metrics or len(self._early) >= DEAD_START_UPDATES:
            return
        self._early.append((float(metrics.get("ce", metrics["loss"])), float(metrics["grad_norm"])))
        if len(self._early) < DEAD_START_UPDATES:
            return
        uniform = math.log(self.config.model.vocab_size)
        zero_grad = all(g == 0.0 for _, g in self._early)
        pinned = all(abs(ce - uniform) <= 1e-6 * uniform for ce, _ in self._early)
        if not (zero_grad or pinned):
            return
        m = self.config.model
        what = ("the gradient norm is exactly 0" if zero_grad else
                f"the loss is pinned at log(vocab_size) = {uniform:.6f} (uniform predictions)")
        raise DeadStart(
            f"dead start: over the first {DEAD_START_UPDATES} updates {what}, so the model cannot learn "
            f"(stopped at step {step}). Likely settings: config.model.init_std={m.init_std} (0.02 is usual; a "
            f"huge one saturates every layer), config.model.norm_eps={m.norm_eps} (1e-5 is usual; a huge one "
            "zeroes every normalized activation), or the data. Fix the setting and start a new --workdir.")

    def _record(self, state, metrics: dict, step: int, p: "_Progress", writer: MetricWriter, bar) -> None:
        """Log update ``step``; evaluate ``state`` (the state after it) where an eval is due."""
        c = self.config
        evaluated = state is not None and (step % c.train.eval_every == 0 or step == c.train.steps)
        if evaluated:
            p.val, p.val_step = self.evaluate(state.params), step
            metrics.update(p.val)
        if isinstance(self.corpus, Mixture):  # update `step` trained on global batch step - 1
            metrics.update(self.corpus.shares(step - 1, c.train.global_batch_size))
        if evaluated or step % c.train.log_every == 0:
            writer.write(step, metrics)
        self._console.update(step, metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.3f}",
                        **({"val": f"{p.val['val_loss']:.3f}"} if p.val else {}))

    # ------------------------------------------------------------------------------------------
    def _log_model(self, state) -> None:
        c = self.config
        log.info("model: %s parameters; data parallel over %d device(s); %d tokens per update; "
                 "%.3g model FLOPs per token (6N + attention)", f"{count_params(self.runner.model_shapes):,}",
                 self.data_size, c.train.global_batch_size * c.data.seq_len, self.flops_per_token)
        log.info("optimizer %s; parameter routing (also in routing.txt):\n%s", c.optimizer.name, self.routing)

    def _add_speed(self, metrics: dict, last_t: float) -> float:
        c = self.config
        now = time.perf_counter()
        metrics["step_time"] = now - last_t
        metrics["tokens_per_sec"] = c.train.global_batch_size * c.data.seq_len / metrics["step_time"]
        metrics["model_tflops_per_sec"] = metrics["tokens_per_sec"] * self.flops_per_token / 1e12
        if c.train.peak_tflops_per_device:
            metrics["mfu"] = metrics["model_tflops_per_sec"] / (c.train.peak_tflops_per_device * self.mesh.devices.size)
        return now

    def _divergence_message(self, metrics: dict, step: int, start: int) -> str:
        """Where the run stands and the likely cause.  The loss of update 1 is that of the initial
        weights, and update 2 follows one warmup-sized step: non-finite there is the initialization
        or a setting, not the learning rate."""
        saved = self._last_good_text()
        if start == 0 and step <= EARLY_STEPS:
            hint = (f"It happened within the first {EARLY_STEPS} updates of a fresh run, so the likely cause is the "
                    "initialization or a setting (config.model.init_std, norm_eps, z_loss, the data), not the "
                    f"learning rate; check the settings in {self.workdir / 'config.json'}.")
        else:
            hint = "Lower config.optimizer.lr, raise warmup_steps, or set config.optimizer.grad_clip."
        return (f"non-finite loss ({metrics.get('loss')}) or grad norm ({metrics['grad_norm']}) at step {step}; "
                f"stopped without saving. {saved} {hint}")

    def _last_good_text(self) -> str:
        good, moved = self._good_checkpoint()
        if good is not None:
            return f"The last good checkpoint is step {good} in {self.checkpointer.directory}.{moved}"
        if not moved:
            return "No checkpoint had been saved yet."
        return "No good checkpoint had been saved, so a rerun starts afresh." + moved

    def _good_checkpoint(self) -> tuple[int | None, str]:
        """On a divergence: ``(newest good step, a sentence on what was set aside)``.  In-flight saves
        land first; the sealed steps newer than the newest good one were never proven live
        (train/health.py) and are moved aside, so a rerun resumes from the good one.  Done once."""
        if self._retired is None:
            self._settle_checkpoints()
            sealed = self.checkpointer.sealed_steps()
            good = self.health.newest_good(sealed)
            unproven = [s for s in sealed if good is None or s > good]
            moved = ""
            if unproven:
                first = self.health.first_dead()
                since = f" (the model stopped being live at update {first[0]}: {first[1]})" if first else ""
                where = self.checkpointer.set_aside(unproven)
                moved = (f" Checkpoint(s) {', '.join(map(str, unproven))} were not proven by live updates after them{since} "
                         f"and were moved to {where}.")
            self._retired = (good, moved)
        return self._retired

    def last_sealed(self) -> int | None:
        """The newest checkpoint step that is sealed (complete and verified), or None."""
        steps = self.checkpointer.sealed_steps()
        return max(steps) if steps else None

    def release_workdir(self) -> None:
        """Give up the workdir's lock without closing (an abandoned compile still runs on a thread)."""
        self._lock.release()

    def _settle_checkpoints(self) -> None:
        """Let in-flight saves land while another error is already on its way out."""
        try:
            self.checkpointer.wait()
        except CheckpointError as e:
            log.error("%s", e)
