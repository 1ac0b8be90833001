"""Checkpoints with orbax: the train state and the grain iterator state, saved together, sealed
with checksums, verified before they are trusted.

A checkpoint at step ``s`` holds the state *after* ``s`` updates and the data iterator positioned at
the first batch of update ``s + 1``, so a resumed run continues bit for bit.  Saves are asynchronous
(orbax copies device arrays to host before ``save`` returns, so the state may be donated right after).

Integrity (on top of orbax's atomic rename of a finished step directory):

* **Sealing.** Once orbax has finalized step ``s``, process 0 writes ``s/MANIFEST``: the size and
  SHA-256 of every file in the step directory, plus the state's layout (each leaf's path, shape
  and dtype).  Hashing runs on a worker thread, so training does not wait for it; but the next
  save does not start before every earlier step is sealed, so at any moment the newest sealed
  checkpoint is at most one save behind.  A checkpoint without a manifest (the process died
  between orbax's rename and the seal) counts as unsealed: never reported as saved, and set aside
  on resume (also when it is the only one: the run then starts afresh, which is all it had lost).
* **Retention.** Old steps are deleted by this class, not by orbax (whose ``max_to_keep`` deletes
  the previous step as soon as the new one is renamed, before it is sealed): only sealed steps
  beyond the newest ``keep`` are removed, before the next save starts and when the run ends.
* **Verification.** Before a restore, each step, newest first, is checked against its manifest; a
  missing, truncated or altered file, or a missing manifest, disqualifies it.  The newest intact
  step is restored; the disqualified newer ones are moved to ``<workdir>/checkpoints_unusable/`` so
  new saves do not collide with them.  No intact step at all is a :class:`CheckpointError`.
* **Fail fast on writes.** Before every save (and once when a run starts) each process checks that
  it can create a file in the checkpoint directory and that the free space there covers what it
  will write; with several processes the verdicts are combined with one tiny collective, so every
  process takes the same decision and none waits on a barrier for a peer that has given up.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import pathlib
import shutil

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from asyncpp_jax import limits

log = logging.getLogger("asyncpp_jax")

MANIFEST = "asyncpp_manifest.json"
UNUSABLE_DIR = "checkpoints_unusable"  # beside the checkpoint directory
_PROBE_BYTES = 1 << 16
_HASH_CHUNK = 1 << 23


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or none of those in the workdir can be trusted."""


class _IteratorSnapshot:
    """The iterator's state captured at save time.

    grain's checkpoint handler reads ``get_state()`` when it writes, which with asynchronous saves
    could be after the trainer has already drawn the next batch; a snapshot pins the position.
    """

    def __init__(self, iterator):
        self._state = json.dumps(iterator.get_state(), indent=2).encode()

    def get_state(self) -> bytes:
        return self._state


# ----------------------------------------------------------------------------------------------
# Manifests: what was written, and whether it is still there unchanged.

def state_layout(tree) -> dict[str, list]:
    """``{leaf path: [shape, dtype]}`` of a state (arrays or ShapeDtypeStructs)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): [list(x.shape), str(x.dtype)] for p, x in leaves}


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: pathlib.Path, step: int, layout: dict, run: dict | None = None) -> None:
    """Seal a finalized step directory: size and SHA-256 of each file, the state layout, and ``run``:
    what the state was trained under (its ``config`` and ``identity``, train/resume.py)."""
    files = {str(p.relative_to(step_dir)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(step_dir)}
    tmp = step_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "files": files, "layout": layout, **({"run": run} if run else {})}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def read_manifest(step_dir: pathlib.Path) -> dict | None:
    """The manifest if it is readable and well formed (a ``files`` table of sizes and hashes)."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(files, dict) and all(isinstance(v, dict) and {"bytes", "sha256"} <= set(v)
                                            for v in files.values())):
        return None
    return manifest


def is_unsealed(step_dir: pathlib.Path) -> bool:
    """No manifest at all: the write was cut off before its seal (not damaged afterwards)."""
    return not (step_dir / MANIFEST).exists()


def verify(step_dir: pathlib.Path) -> str | None:
    """Why the checkpoint in ``step_dir`` cannot be trusted, or None if every byte checks out."""
    manifest = read_manifest(step_dir)
    if manifest is None:
        if is_unsealed(step_dir):
            return f"no readable {MANIFEST}: the write was cut off before it was sealed"
        return f"its {MANIFEST} is unreadable or lacks its table of files (damaged after the write)"
    for name, want in manifest["files"].items():
        path = step_dir / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path} has {size} bytes where {want['bytes']} were written (truncated or altered)"
        if _sha256(path) != want["sha256"]:
            return f"{path} fails its SHA-256 checksum (its bytes changed after the write)"
    return None


def step_dirs(directory: pathlib.Path) -> dict[int, pathlib.Path]:
    """The finalized step directories (orbax names them by the step number)."""
    if not directory.is_dir():
        return {}
    return {int(p.name): p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()}


def saved_layout(directory: pathlib.Path) -> dict | None:
    """The state layout recorded by the newest readable manifest, if any."""
    for step, path in sorted(step_dirs(directory).items(), reverse=True):
        manifest = read_manifest(path)
        if manifest is not None and "layout" in manifest:
            return manifest["layout"]
    return None


def saved_run(directory: pathlib.Path) -> tuple[int, dict] | None:
    """``(step, run record)`` of the newest readable manifest that has one (the config and identity
    the state was trained under); None when no manifest records them (checkpoints older than it)."""
    for step, path in sorted(step_dirs(directory).items(), reverse=True):
        manifest = read_manifest(path)
        if manifest is not None and isinstance(manifest.get("run"), dict):
            return step, manifest["run"]
    return None


# ----------------------------------------------------------------------------------------------
# Write checks, agreed between processes.

def _local_write_problem(directory: pathlib.Path, needed_bytes: int) -> str | None:
    """Why this process cannot write ``needed_bytes`` into ``directory`` (None: it can)."""
    probe = directory / f".write_probe.{jax.process_index()}.{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"cannot write {probe.parent}: {e.strerror or e}"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        return (f"only {free / 2**20:.1f} MiB free on the file system of {directory}, and this checkpoint "
                f"needs about {needed_bytes / 2**20:.1f} MiB")
    return None


def _agree(problem: str | None) -> list[int]:
    """The process indices that reported a problem: the same list on every process."""
    if jax.process_count() == 1:
        return [0] if problem else []
    flags = multihost_utils.process_allgather(np.array([problem is not None], dtype=np.int32))
    return [int(i) for i in np.flatnonzero(np.asarray(flags).reshape(-1))]


def _bytes_written_here(state) -> int:
    """Bytes this process writes for ``state`` (orbax writes each shard's first replica)."""
    total = 0
    for x in jax.tree.leaves(state):
        try:
            total += sum(s.data.nbytes for s in x.addressable_shards if s.replica_id == 0)
        except (AttributeError, TypeError):  # host values, typed PRNG keys: small, count them whole
            total += int(getattr(x, "nbytes", 0) or 0)
    return total


# ----------------------------------------------------------------------------------------------
class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, keep: int, async_save: bool = True):
        # max_to_keep=None: retention is ours (_delete_old), so a step is deleted only once a newer one is sealed.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True, enable_async_checkpointing=async_save
        )
        self.keep = keep
        self.directory = pathlib.Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))
        self._sealer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-seal")
        self._unsealed: dict[int, tuple] = {}  # step -> (layout, run record), saved but not yet sealed
        self._seals: list[concurrent.futures.Future] = []
        self.failed = False  # a CheckpointError was raised: close() then only logs further ones
        self.protected: int | None = None  # a step retention never deletes: the run's newest good one (train/health.py)
        self.run_record: dict | None = None  # sealed into each manifest: the config and identity it was trained under

    def _error(self, message: str) -> CheckpointError:
        self.failed = True
        return CheckpointError(message + limits.file_size_note(message))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def has_checkpoints(self) -> bool:
        return bool(step_dirs(self.directory))

    def sealed_steps(self) -> list[int]:
        """Steps whose manifest is on disk (intact as far as the write went)."""
        return sorted(s for s, p in step_dirs(self.directory).items() if (p / MANIFEST).is_file())

    # -- writing ---------------------------------------------------------------------------------
    def check_writable(self, needed_bytes: int = 0) -> None:
        """Raise :class:`CheckpointError` on every process if any process cannot write ``needed_bytes``."""
        problem = _local_write_problem(self.directory, int(needed_bytes * 1.05) * jax.process_count())
        failed = _agree(problem)
        if failed:
            where = problem or f"process(es) {failed} cannot write it (see their logs)"
            raise self._error(f"cannot write checkpoints to {self.directory}: {where}.")

    def save(self, step: int, state, data_iterator, force: bool = False) -> bool:
        self._finish_pending()  # orbax's save would wait for it anyway; this names its step if it failed
        # Every earlier step sealed before this one's files appear: a kill during this save then costs
        # only the work since the previous save.
        self._wait_for_seals()
        self._delete_old()
        self.check_writable(_bytes_written_here(state))
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(_IteratorSnapshot(data_iterator)),
        )
        try:
            saved = self.manager.save(step, args=args, force=force)
        except Exception as e:  # orbax raises whatever the file system raised
            raise self._error(f"writing the checkpoint of step {step} to {self.directory} failed: "
                                  f"{type(e).__name__}: {e}") from e
        if saved:
            self._unsealed[step] = (state_layout(state), self.run_record)
            if not self.manager.is_saving_in_progress():  # synchronous save: seal right away
                self.poll()
        return saved

    def _finish_pending(self) -> None:
        if self._unsealed:
            try:
                self.manager.wait_until_finished()
            except Exception as e:
                steps, self._unsealed = sorted(self._unsealed), {}
                raise self._error(f"writing the checkpoint of step(s) {steps} to {self.directory} failed: "
                                  f"{type(e).__name__}: {e}") from e
        self.poll()

    def poll(self) -> None:
        """Seal the saves orbax has finished (cheap; the trainer calls it every step)."""
        self._raise_failed_seals()
        if not self._unsealed or self.manager.is_saving_in_progress():
            return
        try:
            self.manager.check_for_errors()
        except Exception as e:
            steps, self._unsealed = sorted(self._unsealed), {}
            raise self._error(f"writing the checkpoint of step(s) {steps} to {self.directory} failed: "
                                  f"{type(e).__name__}: {e}") from e
        for step, (layout, run) in sorted(self._unsealed.items()):
            step_dir = self.directory / str(step)
            if not step_dir.is_dir() and jax.process_index() == 0:
                self._unsealed = {}
                raise self._error(f"the checkpoint of step {step} never appeared in {step_dir}: orbax did "
                                      "not finalize it (see the log above for the file system's error).")
            if jax.process_index() == 0:
                self._seals.append(self._sealer.submit(write_manifest, step_dir, step, layout, run))
        self._unsealed = {}

    def _raise_failed_seals(self) -> None:
        done = [f for f in self._seals if f.done()]
        self._seals = [f for f in self._seals if not f.done()]
        for f in done:
            if f.exception() is not None:
                e = f.exception()
                raise self._error(f"sealing a checkpoint in {self.directory} failed: {type(e).__name__}: {e}")

    def _wait_for_seals(self) -> None:
        concurrent.futures.wait(self._seals)
        self._raise_failed_seals()

    def _delete_old(self) -> None:
        """Delete the steps beyond the newest ``keep`` (called when every step on disk is sealed), except
        ``protected``: while the newer ones are unproven, the newest good one stays beside them."""
        steps = sorted(self.manager.all_steps())
        kept = set(steps[-self.keep:]) | {self.protected}
        for step in (s for s in steps if s not in kept):
            try:
                self.manager.delete(step)
            except Exception as e:  # noqa: BLE001 - a leftover old step costs disk, not correctness
                log.warning("could not delete the old checkpoint %s: %s", self.directory / str(step), e)

    def wait(self) -> None:
        """Let in-flight saves land and seal them; then drop the steps beyond ``keep``."""
        self._finish_pending()
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._error(f"writing a checkpoint to {self.directory} failed: {type(e).__name__}: {e}") from e
        self.poll()  # a save orbax finished during the wait is sealed too
        self._wait_for_seals()
        self._delete_old()

    def close(self) -> None:
        try:
            self.wait()
        except CheckpointError as e:
            if not self.failed:
                raise
            log.error("while closing: %s", e)
        finally:
            self._sealer.shutdown(wait=True)
            self.manager.close()

    # -- reading ---------------------------------------------------------------------------------
    def select_intact(self) -> tuple[int | None, list[tuple[int, str]]]:
        """``(newest intact step or None, [(newer step, why it is unusable), ...])``.

        Process 0 verifies and broadcasts, so every process restores the same step.  None with
        rejected steps: every step was cut off before its seal (a kill during the first save), so
        the run starts afresh; a sealed step that fails its checks with none intact is an error.
        """
        found = step_dirs(self.directory)
        chosen, rejected = None, []
        if jax.process_index() == 0:
            for step in sorted(found, reverse=True):
                problem = verify(found[step])
                if problem is None:
                    chosen = step
                    break
                rejected.append((step, problem))
        # Only cut-off writes (never reported as saved) and nothing intact: start afresh.
        afresh = bool(found) and chosen is None and all(is_unsealed(found[s]) for s, _ in rejected)
        if jax.process_count() > 1:
            code = -2 if afresh else (-1 if chosen is None else chosen)
            code = int(multihost_utils.broadcast_one_to_all(np.int64(code)))
            chosen, afresh = (None if code < 0 else code), code == -2
            rejected = [(s, "rejected by process 0's checksum check") for s in sorted(found, reverse=True)
                        if chosen is None or s > chosen]
        if afresh:
            return None, rejected
        if found and chosen is None:
            lines = "\n  ".join(f"step {s} ({self.directory / str(s)}): {why}" for s, why in rejected)
            raise self._error(
                f"none of the {len(found)} checkpoint(s) in {self.directory} is intact:\n  {lines}\n"
                f"Move {self.directory} aside to start afresh (or use a new --workdir); nothing was changed.")
        return chosen, rejected

    def set_aside(self, steps: list[int]) -> pathlib.Path:
        """Move unusable step directories out of orbax's sight (so later saves do not collide)."""
        target = self.directory.parent / UNUSABLE_DIR
        if jax.process_index() == 0:
            target.mkdir(exist_ok=True)
            for s in steps:
                dest = target / str(s)
                n = 1
                while dest.exists():
                    dest, n = target / f"{s}.{n}", n + 1
                shutil.move(str(self.directory / str(s)), dest)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("asyncpp_checkpoints_set_aside")
        self.manager.reload()
        return target

    def restore(self, step: int, abstract_state, data_iterator, data_position: bool = True):
        """Restore ``(state, iterator)`` at ``step``; ``abstract_state`` gives shapes and shardings.
        ``data_position=False`` leaves ``data_iterator`` at its start (the run's data was changed on
        purpose: the saved position belongs to other data)."""
        items = dict(state=ocp.args.StandardRestore(abstract_state))
        if data_position:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        args = ocp.args.Composite(**items)
        try:
            out = self.manager.restore(step, args=args)
        except Exception as e:
            raise self._error(
                f"restoring {self.directory / str(step)} failed although its checksums match: "
                f"{type(e).__name__}: {str(e)[:500]}. The saved state does not fit this code's model/optimizer "
                "layout; resume with the code and settings that wrote it, or use a new --workdir.") from e
        return out.state, (out.data if data_position else data_iterator)
