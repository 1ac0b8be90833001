"""A split's token stream read in place: its shards' memmaps end to end, never concatenated.

A prepared split is cut into shards (``train-00000.bin``, ...).  Concatenating their memmaps
(``np.concatenate``) would copy the whole split into every process's RAM (a 10B-token uint16 corpus
is 20 GB); :class:`ShardedStream` instead maps a position ``i`` of the stream to shard ``k`` with
``starts[k] <= i < starts[k + 1]`` and offset ``i - starts[k]``.  A slice inside one shard is a view
of that shard's memmap (no copy, pages are read when touched); only a slice that crosses a shard
boundary is copied, and then only its own tokens (a window of ``seq_len + 1``).
"""

from __future__ import annotations

import numpy as np


class ShardedStream:
    """Read-only, random-access token stream over ``shards`` (1-D arrays, usually ``np.memmap``)."""

    def __init__(self, shards):
        if not shards:
            raise ValueError("a token stream needs at least one shard")
        self.shards = list(shards)
        self.dtype = self.shards[0].dtype
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def _locate(self, i: int) -> int:
        return int(np.searchsorted(self.starts, i, side="right")) - 1

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("ShardedStream slices take step 1")
            return self._range(start, max(start, stop))
        i = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"token {key} out of range for a stream of {len(self)} tokens")
        k = self._locate(i)
        return self.shards[k][i - self.starts[k]]

    def _range(self, start: int, stop: int) -> np.ndarray:
        if start == stop:
            return self.shards[0][:0]
        first, last = self._locate(start), self._locate(stop - 1)
        if first == last:  # the common case: a view of one memmap
            base = self.starts[first]
            return self.shards[first][start - base:stop - base]
        pieces = [self.shards[k][max(start - self.starts[k], 0):min(stop, self.starts[k + 1]) - self.starts[k]]
                  for k in range(first, last + 1)]
        return np.concatenate(pieces)

    def bincount(self, minlength: int = 0) -> np.ndarray:
        """``np.bincount`` of the whole stream, one shard at a time."""
        total = np.zeros(minlength, np.int64)
        for s in self.shards:
            counts = np.bincount(s, minlength=minlength)
            if len(counts) > len(total):
                total = np.pad(total, (0, len(counts) - len(total)))
            total[:len(counts)] += counts
        return total

    def __array__(self, dtype=None, copy=None):
        # Only an explicit np.asarray(stream) lands here (tests, small corpora); the data
        # pipelines never call it.
        out = np.concatenate(self.shards)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"ShardedStream({len(self)} tokens in {len(self.shards)} shards)"
