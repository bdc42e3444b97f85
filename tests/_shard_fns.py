"""Sources with shards for the shard-window order's tests (module level: process workers
and rank scripts import them)."""

from __future__ import annotations

import numpy as np

from zephon.pipeline.sources import Source

import _pipeline_fns as F


def uneven_bounds(n: int, shards: int, seed: int = 0) -> np.ndarray:
    """``shards + 1`` rising offsets from 0 to ``n``, of uneven sizes (some empty)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, n + 1, size=shards - 1))
    return np.concatenate([[0], cuts, [n]]).astype(np.int64)


class ShardedSamples(Source):
    """``F.make_sample(i)`` over ``n`` indices cut into the given shards."""

    name = "sharded"

    def __init__(self, n: int, bounds) -> None:
        self.n, self.bounds = n, np.asarray(bounds, dtype=np.int64)

    def __len__(self) -> int:
        return self.n

    def get(self, i: int):
        return F.make_sample(i)

    def shard_bounds(self):
        return self.bounds

    def describe(self) -> str:
        return f"ShardedSamples(n={self.n}, shards={len(self.bounds) - 1})"


class CountingSource(ShardedSamples):
    """Records, in this process, the shard every ``get`` reads (``self.reads``)."""

    def __init__(self, n: int, bounds) -> None:
        super().__init__(n, bounds)
        self.reads: list[int] = []

    def get(self, i: int):
        self.reads.append(int(np.searchsorted(self.bounds, i, side="right")) - 1)
        return {"id": i}


class ConstantSource(Source):
    """``n`` samples (any ``n``: nothing per sample is stored) in the given shards."""

    name = "constant"

    def __init__(self, n: int, bounds) -> None:
        self.n, self.bounds = n, bounds

    def __len__(self) -> int:
        return self.n

    def get(self, i: int):
        return {"id": i}

    def shard_bounds(self):
        return self.bounds


def opens(shards, capacity: int) -> int:
    """How many times a reader that keeps the ``capacity`` shards it used last open
    (least recently used out) opens a shard, reading ``shards`` in order."""
    held: dict[int, None] = {}
    count = 0
    for s in shards:
        if s in held:
            held.pop(s)
        else:
            count += 1
            if len(held) >= capacity:
                held.pop(next(iter(held)))
        held[s] = None
    return count
