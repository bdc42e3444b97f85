"""The shard-window epoch order (``Pipeline(source, shuffle="shards")``).

The global shuffle (``shuffle=True``) sends every chunk's reads all over the source:
fine in memory or on local disk, costly over object storage, where one sample read at
random means one ranged request (or one decoded row group) for a single row. This
order visits *shards* instead, the contiguous index ranges a source reads cheaply in
sequence (:meth:`~zephon.pipeline.sources.Source.shard_bounds`: Parquet row groups,
tar shards, jsonl files; a source without shards is cut into blocks of
:data:`BLOCK` indices).

Epoch ``e`` of the order, for a seed:

1. the ``S`` shards are visited in a seeded order (slot ``i`` holds shard
   ``sigma_e(i)``, the index-shuffle kernel over ``[0, S)``);
2. consecutive slots form *windows* of ``W`` shards (``shuffle_window``; the last
   window may hold fewer);
3. the samples of one window (the concatenation of its shards, ``m`` samples) are
   permuted together by the index-shuffle kernel over ``[0, m)``, keyed by
   ``(seed, e, window)``; the windows follow each other.

Position ``p`` of the epoch order is therefore found from ``O(W)`` offsets and two
kernel evaluations: nothing of size ``n`` exists. The offsets of the slots are a
closed form when all shards but the last are of one size (the block fallback: O(1)
memory, any ``n``); otherwise a table of ``S + 1`` offsets per epoch (8 bytes a
shard; the two latest epochs are kept), which is the only structure of size ``S``.

Promises (tested in ``tests/test_shard_shuffle.py``):

- every epoch is a bijection of ``[0, n)``; the order is a pure function of
  (seed, epoch, shard bounds, ``W``), like the global one, so lanes, chunks, runners,
  ranks, checkpoints and elastic restores work on it unchanged;
- **locality**: the samples of a shard occupy positions inside its window's span
  (at most the samples of ``W`` shards), and windows never interleave. So any
  sub-sequence read in position order (the whole epoch, or one lane's chunks) that
  keeps the ``W`` shards it touched last open opens each shard at most once per
  epoch, and a run of ``L`` consecutive positions touches at most
  ``W * (1 + windows it crosses)`` shards;
- the price: neighbouring samples come from the same ``W`` shards, not from the whole
  source (a shard's samples are spread over its window only). Size ``W`` so that a
  window spans many batches; ``docs/architecture.md`` has the figures measured by
  ``bench/shard_shuffle.py``.

A :class:`ShardShuffle` is built once per pipeline (it checks the source's bounds)
and travels with it; its per-epoch tables are a cache dropped when it is pickled.
"""

from __future__ import annotations

import threading

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.kernels import inverse_positions, order_key, permute_range

__all__ = ["BLOCK", "DEFAULT_WINDOW", "ShardShuffle", "resolve_order"]

#: indices per block when a source has no shards of its own
BLOCK = 4096
#: shards per window when ``shuffle_window`` is not given
DEFAULT_WINDOW = 8
#: tags of the shard order's and the windows' keys (other orders use other tags)
_SHARD_TAG, _WINDOW_TAG = 0x5A, 0x5B
#: epochs whose offset tables are kept (lanes of two neighbouring epochs run together)
_KEPT_EPOCHS = 2


def resolve_order(source, shuffle, window) -> "bool | ShardShuffle":
    """The epoch order ``Pipeline(source, shuffle=..., shuffle_window=...)`` asks for:
    True or False as given, or the :class:`ShardShuffle` of ``source`` for
    ``"shards"``; a ZephonConfigError naming a wrong value."""
    if isinstance(shuffle, str) and shuffle == "shards":
        if window is None:
            window = DEFAULT_WINDOW
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ZephonConfigError(f"Pipeline: shuffle_window must be an int >= 1, got "
                                    f"{window!r}")
        return ShardShuffle.of(source, window)
    if not isinstance(shuffle, bool):
        raise ZephonConfigError(f"Pipeline: shuffle must be True, False or \"shards\", got "
                                f"{shuffle!r}")
    if window is not None:
        raise ZephonConfigError(f"Pipeline: shuffle_window={window!r} needs "
                                f"shuffle=\"shards\", got shuffle={shuffle!r}")
    return shuffle


def _bounds_of(source, n: int) -> np.ndarray | None:
    """The source's shard bounds, checked; None: no shards."""
    bounds = source.shard_bounds()
    if bounds is None:
        return None
    what = f"{type(source).__name__}.shard_bounds()"
    arr = np.asarray(bounds)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or len(arr) < 1:
        raise ZephonConfigError(f"{what} must be a 1-D integer array of offsets, got "
                                f"shape {arr.shape}, dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr[0] != 0 or arr[-1] != n or (len(arr) > 1 and bool((np.diff(arr) < 0).any())):
        raise ZephonConfigError(f"{what} must rise from 0 to len(source) = {n}, got "
                                f"{arr[:3].tolist()}...{arr[-3:].tolist()}")
    return arr


class ShardShuffle:
    """The shard-window order of one source's ``n`` samples (see the module docstring).

    Args:
        n: the source's length.
        bounds: ``S + 1`` non-decreasing offsets from 0 to ``n`` (shard ``s`` is
            ``[bounds[s], bounds[s + 1])``; empty shards are dropped), or None for blocks
            of ``block`` indices.
        window: shards per window (``W >= 1``).
        block: indices per block when ``bounds`` is None.
    """

    def __init__(self, n: int, bounds: np.ndarray | None, window: int,
                 block: int = BLOCK) -> None:
        self.n, self.window, self.block = int(n), int(window), int(block)
        self.bounds = bounds
        self.sizes = np.zeros(0, dtype=np.int64)  # of each shard (bounds only)
        self.tail = 0  # samples of the last block (blocks only)
        if bounds is None:
            self.shards = -(-self.n // self.block)
            self.tail = self.n - (self.shards - 1) * self.block if self.n else 0
        else:  # empty shards dropped: a window holds W shards with samples
            self.bounds = bounds = np.asarray(bounds, dtype=np.int64)
            self.sizes = np.diff(bounds)
            if not self.sizes.all():
                self.bounds = bounds[np.concatenate([[True], self.sizes > 0])]
                self.sizes = self.sizes[self.sizes > 0]
            self.shards = len(self.bounds) - 1
        self._tables: dict = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, source, window: int) -> "ShardShuffle":
        """The order of ``source`` (its :meth:`shard_bounds`, else blocks)."""
        n = len(source)
        return cls(n, _bounds_of(source, n), window)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_tables", "_lock")}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._tables, self._lock = {}, threading.Lock()

    def __repr__(self) -> str:  # part of the pipeline fingerprint: what defines the order
        unit = "blocks" if self.bounds is None else "shards"
        return (f"shards(window={self.window}, {unit}={self.shards}"
                + (f", block={self.block})" if self.bounds is None else ")"))

    # -- slots: the seeded shard order of an epoch ------------------------------------
    def _shard_key(self, seed: int, epoch: int) -> int:
        return order_key(seed, _SHARD_TAG, epoch)

    def _table(self, seed: int, epoch: int) -> np.ndarray:
        """Epoch offsets of every slot (``S + 1``), for shards of uneven sizes."""
        table = self._tables.get((seed, epoch))
        if table is None:
            order = permute_range(self.shards, self._shard_key(seed, epoch), 0, self.shards)
            table = np.zeros(self.shards + 1, dtype=np.int64)
            np.cumsum(self.sizes[order], out=table[1:])
            self._keep(seed, epoch, table)
        return table

    def _short_slot(self, seed: int, epoch: int) -> int:
        """The slot of the short last block (blocks only)."""
        slot = self._tables.get((seed, epoch))
        if slot is None:
            slot = int(inverse_positions(self.shards, self._shard_key(seed, epoch),
                                         [self.shards - 1])[0])
            self._keep(seed, epoch, slot)
        return slot

    def _keep(self, seed: int, epoch: int, value) -> None:
        with self._lock:  # lanes of several pump threads share the order
            while len(self._tables) >= _KEPT_EPOCHS:
                self._tables.pop(next(iter(self._tables)))
            self._tables[(seed, epoch)] = value

    def _offsets(self, seed: int, epoch: int, slots: np.ndarray) -> np.ndarray:
        """Epoch position of the first sample of each slot (``slots`` may be ``S``)."""
        if self.bounds is not None:
            return self._table(seed, epoch)[slots]
        deficit = self.block - self.tail
        short = self._short_slot(seed, epoch)
        return slots * self.block - np.where(slots > short, deficit, 0)

    def _slot_of(self, seed: int, epoch: int, pos: int) -> int:
        """The slot holding epoch position ``pos``."""
        if self.bounds is not None:
            return int(np.searchsorted(self._table(seed, epoch), pos, side="right")) - 1
        short = self._short_slot(seed, epoch)
        if pos < short * self.block + self.tail:
            return pos // self.block
        return (pos + self.block - self.tail) // self.block

    def _shard_start(self, shards: np.ndarray) -> np.ndarray:
        if self.bounds is None:
            return shards * self.block
        return self.bounds[shards]

    # -- positions ----------------------------------------------------------------------
    def slice(self, seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of epoch ``epoch``'s order, as int64 source
        indices: O(stop - start + W) per window crossed."""
        stop = min(stop, self.n)
        if start >= stop:
            return np.zeros(0, dtype=np.int64)
        out = []
        w = self._slot_of(seed, epoch, start) // self.window
        while start < stop:
            out.append(self._window_part(seed, epoch, w, start, stop))
            start += len(out[-1])
            w += 1
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _window_part(self, seed: int, epoch: int, w: int, start: int,
                     stop: int) -> np.ndarray:
        """The positions of ``[start, stop)`` that lie in window ``w``."""
        lo, hi = w * self.window, min((w + 1) * self.window, self.shards)
        offsets = self._offsets(seed, epoch, np.arange(lo, hi + 1, dtype=np.int64))
        first, end = int(offsets[0]), int(offsets[-1])
        stop = min(stop, end)
        local = permute_range(end - first, order_key(seed, _WINDOW_TAG, epoch, w),
                              start - first, stop - first)
        inner = offsets - first
        slot = np.searchsorted(inner, local, side="right") - 1
        shards = permute_range(self.shards, self._shard_key(seed, epoch), lo, hi)[slot]
        return self._shard_start(shards) + local - inner[slot]

    def shard_of(self, indices) -> np.ndarray:
        """The shard holding each source index (for tools, tests and benches)."""
        idx = np.asarray(indices, dtype=np.int64)
        if self.bounds is None:
            return idx // self.block
        return np.searchsorted(self.bounds, idx, side="right") - 1
