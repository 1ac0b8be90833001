"""Checkpoints with orbax: the train state and the grain iterator state, saved together.

A checkpoint at step ``s`` holds the state *after* ``s`` updates and the data iterator positioned at
the first batch of update ``s + 1``, so a resumed run continues bit for bit.  Saves are asynchronous
(orbax copies device arrays to host before ``save`` returns, so the state may be donated right after).
"""

from __future__ import annotations

import json
import pathlib

import grain
import orbax.checkpoint as ocp


class _IteratorSnapshot:
    """The iterator's state captured at save time.

    grain's checkpoint handler reads ``get_state()`` when it writes, which with asynchronous saves
    could be after the trainer has already drawn the next batch; a snapshot pins the position.
    """

    def __init__(self, iterator):
        self._state = json.dumps(iterator.get_state(), indent=2).encode()

    def get_state(self) -> bytes:
        return self._state


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, keep: int, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.directory = pathlib.Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_iterator, force: bool = False) -> bool:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(_IteratorSnapshot(data_iterator)),
        )
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state, data_iterator):
        """Restore ``(state, iterator)`` at ``step``; ``abstract_state`` gives shapes and shardings."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(data_iterator),
        )
        out = self.manager.restore(step, args=args)
        return out.state, out.data

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

