"""The training loop: data → runner's ``train_step`` → eval, metrics, checkpoints.

Guarantees (each is tested):
- resume is exact: a run interrupted at a checkpoint and restarted ends with bit-identical params;
- SIGTERM (preemption) saves a checkpoint at the current step and returns cleanly; with several
  processes, SIGTERM to any one stops every process at the same saved step (``train.preemption``);
- a non-finite loss stops the run with :class:`TrainingDiverged` before anything is saved, so the
  last good checkpoint is what remains;
- an exception waits for in-flight checkpoint writes, so no saved work is lost.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import time

import jax
import numpy as np
from tqdm import tqdm

from asyncpp_jax import configs
from asyncpp_jax.data import load_corpus, make_eval_batches, make_train_iterator, prepare_corpus_for
from asyncpp_jax.models import count_params, dense
from asyncpp_jax.models.flops import flops_per_token
from asyncpp_jax.optim import describe_routing
from asyncpp_jax.train import preemption
from asyncpp_jax.train import runner as runner_lib
from asyncpp_jax.train import step as step_lib
from asyncpp_jax.train.batch_layout import batch_layout, from_host
from asyncpp_jax.train.checkpoint import Checkpointer
from asyncpp_jax.train.metrics import MetricWriter

log = logging.getLogger("asyncpp_jax")


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; nothing after the last good checkpoint was saved."""


@dataclasses.dataclass
class Result:
    status: str  # 'finished' | 'preempted' (SIGTERM) | 'paused' (until_step)
    step: int
    val_loss: float | None = None  # nats per token
    val_loss_per_byte: float | None = None  # nats per byte
    unigram: dict | None = None  # baselines in nats per byte


def _without_fill_loss(metrics: dict) -> dict:
    """The pipeline engine's ``2bw`` logs the loss of the batch whose gradient an update applies;
    at a fill update (the first delayed one) none is applied, so there is no loss to log."""
    if metrics.get("loss_microbatches", 1) > 0:
        return metrics
    dropped = ("loss", "ce", "z_loss", *dense.MOE_METRICS)
    return {k: v for k, v in metrics.items() if k not in dropped}


class Trainer:
    def __init__(self, config, workdir: str | pathlib.Path, devices=None):
        config = configs.resolve(config)
        configs.validate(config)
        self.config = config
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        c = config

        d = c.data
        corpus_dir = prepare_corpus_for(d, log=log.info)
        self.corpus = load_corpus(corpus_dir, verify=d.verify_checksums)
        configs.check_against_tokenizer(c, self.corpus.vocab_size)

        if c.optimizer.name == "soap" and jax.default_backend() == "cpu" and len(os.sched_getaffinity(0)) > 1:
            log.warning("SOAP on XLA:CPU with more than one core can deadlock (jaxlib 0.10.2); call "
                        "asyncpp_jax.host_setup.prepare(optimizer_name='soap') before JAX starts, as "
                        "asyncpp_jax.main does.")
        self.runner = r = runner_lib.build(c, devices if devices is not None else jax.devices())
        self.mesh, self.data_size, self.pipelined, self.shapes = r.mesh, r.data_size, r.pipelined, r.shapes
        self.optimizer, self.schedule, self.train_step = r.optimizer, r.schedule, r.train_step
        self.routing = describe_routing(c.optimizer, r.shapes)
        # Rows of every global batch this process loads: those of the data replicas its devices hold.
        self.batch_layout = batch_layout(self.mesh, c.train.global_batch_size, c.train.microbatches)
        self.flops_per_token = flops_per_token(c.model, c.data.seq_len)
        if r.pipelined:
            log.info("pipeline engine, %s schedule:\n%s", c.pipeline.schedule, r.tick_table().render())
        self.eval_step = r.eval_step()
        batches = make_eval_batches(
            self.corpus, d.seq_len, c.train.global_batch_size // c.train.microbatches, c.train.eval_batches
        )
        group = r.eval_group()
        self.eval_batches = [np.concatenate(batches[i:i + group]) for i in range(0, len(batches), group)]
        self.checkpointer = Checkpointer(self.workdir / "checkpoints", c.train.keep_checkpoints,
                                         c.train.async_checkpoint)
        self._write_config()

    # ------------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        path = self.workdir / "config.json"
        new = json.loads(configs.to_json(self.config))
        if path.exists():
            changed = configs.diff(json.loads(path.read_text()), new)
            if changed:
                log.warning("config differs from the one saved in %s:\n  %s", path, "\n  ".join(changed))
        if jax.process_index() == 0:
            path.write_text(configs.to_json(self.config))
            (self.workdir / "routing.txt").write_text(self.routing + "\n")

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
        latest = self.checkpointer.latest_step()
        abstract = self.runner.abstract_state(key)
        if latest is None:
            shardings = jax.tree.map(lambda x: x.sharding, abstract)
            return jax.jit(self.runner.init_fn(), out_shardings=shardings)(key), iterator
        state, iterator = self.checkpointer.restore(latest, abstract, iterator)
        log.info("resumed from %s at step %d", self.checkpointer.directory, latest)
        return state, iterator

    def evaluate(self, params) -> dict:
        total = count = 0.0
        for batch in self.eval_batches:  # every process holds the whole eval batch
            t, n = self.eval_step(params, from_host(step_lib.eval_sharding(self.mesh), batch))
            total, count = total + float(t), count + float(n)
        loss = total / count
        return {"val_loss": loss, "val_loss_per_byte": loss / self.corpus.bytes_per_token("val")}

    def close(self) -> None:
        self.checkpointer.close()

    def _write_status(self, status: str, step: int, **extra) -> None:
        if jax.process_index() == 0:
            payload = {"status": status, "step": step, **extra}
            (self.workdir / "status.json").write_text(json.dumps(payload, indent=2))

    # ------------------------------------------------------------------------------------------
    def run(self, until_step: int | None = None) -> Result:
        """Train to ``config.train.steps``, or stop early at ``until_step`` with a checkpoint there.

        ``until_step`` leaves the schedule untouched (it is a pause, not a shorter run): a later
        ``run()`` in the same workdir resumes and ends exactly where an uninterrupted run would.
        """
        c = self.config
        stop_at = c.train.steps if until_step is None else min(until_step, c.train.steps)
        state, iterator = self.restore_or_init()
        start = int(state.step)
        writer = MetricWriter(self.workdir)
        unigram = self.corpus.unigram_entropy_nats_per_byte()
        if start == 0:
            log.info("model: %s parameters; data parallel over %d device(s); %d tokens per update; "
                     "%.3g model FLOPs per token (6N + attention)", f"{count_params(state.params):,}",
                     self.data_size, c.train.global_batch_size * c.data.seq_len, self.flops_per_token)
            log.info("optimizer %s; parameter routing (also in routing.txt):\n%s", c.optimizer.name, self.routing)
        tokens_per_step = c.train.global_batch_size * c.data.seq_len
        val: dict = {}
        bar = tqdm(total=c.train.steps, initial=start, desc=c.name, unit="step", dynamic_ncols=True,
                   disable=not c.train.progress_bar or jax.process_index() != 0)
        step = start
        status = "finished"
        try:
            with preemption.Preemption(self.checkpointer.manager) as preemption_watch:
                last_t = time.perf_counter()
                # Also primes every process's preemption sync counter before the first step.
                preempted = preemption_watch.reached(step)
                status = "preempted" if preempted and step < c.train.steps else status
                while step < stop_at and not preempted:
                    batch = self.batch_layout.assemble(next(iterator))
                    state, metrics = self.train_step(state, batch)
                    metrics = jax.device_get(metrics)  # one small sync per step: guards every update
                    step += 1
                    now = time.perf_counter()
                    metrics["step_time"], last_t = now - last_t, now
                    metrics["tokens_per_sec"] = tokens_per_step / metrics["step_time"]
                    metrics["model_tflops_per_sec"] = metrics["tokens_per_sec"] * self.flops_per_token / 1e12
                    if c.train.peak_tflops_per_device:
                        metrics["mfu"] = metrics["model_tflops_per_sec"] / (
                            c.train.peak_tflops_per_device * self.mesh.devices.size)
                    metrics = _without_fill_loss(metrics)
                    if not (math.isfinite(metrics.get("loss", 0.0)) and math.isfinite(metrics["grad_norm"])):
                        raise TrainingDiverged(
                            f"non-finite loss ({metrics['loss']}) or grad norm ({metrics['grad_norm']}) at step "
                            f"{step}; stopped without saving. The last good checkpoint is step "
                            f"{self.checkpointer.latest_step()} in {self.checkpointer.directory}. Lower "
                            "config.optimizer.lr, raise warmup_steps, or set config.optimizer.grad_clip."
                        )
                    evaluated = step % c.train.eval_every == 0 or step == c.train.steps
                    if evaluated:
                        val = self.evaluate(state.params)
                        metrics.update(val)
                    if evaluated or step % c.train.log_every == 0:
                        writer.write(step, metrics)
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.3f}", **({"val": f"{val['val_loss']:.3f}"} if val else {}))
                    preempted = preemption_watch.reached(step)  # every process, every step
                    stopping = step < c.train.steps and (preempted or step == stop_at)
                    if stopping or step % c.train.checkpoint_every == 0 or step == c.train.steps:
                        self.checkpointer.save(step, state, iterator)
                    if stopping:
                        status = "preempted" if preempted else "paused"
                        if preempted:
                            log.warning("SIGTERM: saved a checkpoint at step %d; rerun the same command to resume", step)
                        break
        except TrainingDiverged:
            self._write_status("diverged", step)
            raise
        finally:
            bar.close()
            writer.close()
            self.checkpointer.wait()  # in-flight async saves land, also on an exception
        if status == "finished" and not val and step == c.train.steps:
            val = self.evaluate(state.params)  # a run resumed at its last step still reports
        self.state = state
        self._write_status(status, step, **val, unigram=unigram)
        return Result(status, step, val.get("val_loss"), val.get("val_loss_per_byte"), unigram)

