"""The training loop: data → runner's ``train_step`` → eval, metrics, checkpoints.

Guarantees (each is tested):
- resume is exact: a run interrupted at a checkpoint and restarted ends with bit-identical params;
- SIGTERM (preemption) saves a checkpoint at the current step and returns cleanly;
- a non-finite loss stops the run with :class:`TrainingDiverged` before anything is saved, so the
  last good checkpoint is what remains;
- an exception waits for in-flight checkpoint writes, so no saved work is lost.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import signal
import threading
import time

import jax
from tqdm import tqdm

from asyncpp_jax import configs
from asyncpp_jax.data import load_corpus, make_eval_batches, make_train_iterator, prepare_corpus
from asyncpp_jax.models import count_params
from asyncpp_jax.models.flops import flops_per_token
from asyncpp_jax.optim import describe_routing
from asyncpp_jax.train import runner as runner_lib
from asyncpp_jax.train import step as step_lib
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


class _SigtermFlag:
    """Turns SIGTERM into a flag the loop polls between steps (handlers only in the main thread)."""

    def __init__(self):
        self.set = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.set = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class Trainer:
    def __init__(self, config, workdir: str | pathlib.Path, devices=None):
        config = configs.resolve(config)
        configs.validate(config)
        self.config = config
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        c = config

        d = c.data
        corpus_dir = prepare_corpus(
            d.source, tokenizer=d.tokenizer, cache_dir=d.cache_dir or None, val_fraction=d.val_fraction,
            split_seed=d.split_seed, eos_token=d.eos_token or None, hf_split=d.hf_split,
            hf_text_field=d.hf_text_field, hf_max_docs=d.hf_max_docs, log=log.info,
        )
        self.corpus = load_corpus(corpus_dir, verify=d.verify_checksums)
        configs.check_against_tokenizer(c, self.corpus.vocab_size)

        self.runner = r = runner_lib.build(c, devices if devices is not None else jax.devices())
        self.mesh, self.data_size, self.pipelined, self.shapes = r.mesh, r.data_size, r.pipelined, r.shapes
        self.optimizer, self.schedule, self.train_step = r.optimizer, r.schedule, r.train_step
        self.routing = describe_routing(c.optimizer, r.shapes)
        self.flops_per_token = flops_per_token(c.model, c.data.seq_len)
        if r.pipelined:
            log.info("pipeline engine, %s schedule:\n%s", c.pipeline.schedule, r.tick_table().render())
        self.eval_step = step_lib.make_eval_step(c.model, self.mesh)
        self.eval_batches = make_eval_batches(
            self.corpus, d.seq_len, c.train.global_batch_size // c.train.microbatches, c.train.eval_batches
        )
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
            process_index=jax.process_index(), process_count=jax.process_count(),
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
        pi, pc = jax.process_index(), jax.process_count()
        for batch in self.eval_batches:
            rows = batch.shape[0] // pc
            local = batch[pi * rows:(pi + 1) * rows]
            glob = jax.make_array_from_process_local_data(step_lib.eval_sharding(self.mesh), local)
            t, n = self.eval_step(params, glob)
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
            with _SigtermFlag() as sigterm:
                last_t = time.perf_counter()
                while step < stop_at:
                    batch = step_lib.to_global_batch(self.mesh, next(iterator), c.train.microbatches)
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
                    if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
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
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", **({"val": f"{val['val_loss']:.3f}"} if val else {}))
                    stopping = step < c.train.steps and (sigterm.set or step == stop_at)
                    if stopping or step % c.train.checkpoint_every == 0 or step == c.train.steps:
                        self.checkpointer.save(step, state, iterator)
                    if stopping:
                        status = "preempted" if sigterm.set else "paused"
                        if sigterm.set:
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

