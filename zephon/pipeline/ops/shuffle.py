"""``shuffle(buffer_size)``: a seeded shuffle buffer per lane (serial, holds nothing).

The buffer emits a random held record for each record past ``buffer_size``,
drains (in a seeded permutation) at every boundary and restarts with a
generator seeded from ``(seed, lane, epoch, k)`` of that boundary: it only
orders samples and never holds anything across a boundary, so it has no carry.
It does not preserve cursor order: a pipeline with it resumes by replay.
"""

from __future__ import annotations

import numpy as np

from zephon.pipeline.ops.base import PASSES_ON, Accumulator, Aligned, SerialOp, check_int
from zephon.pipeline.records import Boundary

__all__ = ["ShuffleOp"]


class ShuffleOp(SerialOp):
    """``shuffle(buffer_size)``: a seeded shuffle buffer of ``buffer_size`` records."""

    kind = "shuffle"
    preserves_cursor_order = False

    def __init__(self, buffer_size: int) -> None:
        self.buffer_size = check_int("shuffle", "buffer_size", buffer_size, 1)

    def describe(self) -> str:
        return f"shuffle({self.buffer_size})"

    def aligned_with(self, field: str) -> Aligned:
        return PASSES_ON  # it only reorders its input records

    def start(self, seed: int, lane: int, boundary: Boundary) -> _ShuffleState:
        return _ShuffleState(self.buffer_size, seed, lane, boundary)


class _ShuffleState(Accumulator):
    """A seeded shuffle buffer: drains at every boundary and restarts with a generator
    seeded from it, so it never holds anything across one (no carry)."""

    def __init__(self, size: int, seed: int, lane: int, boundary: Boundary) -> None:
        self.size, self.seed, self.lane = size, seed, lane
        self.rng = self._rng(boundary)
        self.buf: list = []

    def _rng(self, boundary: Boundary) -> np.random.Generator:
        return np.random.default_rng([self.seed, 0x5F, self.lane, boundary.epoch, boundary.k])

    def push(self, records: list) -> list:
        out, buf = [], self.buf
        for r in records:
            if len(buf) < self.size:
                buf.append(r)
                continue
            j = int(self.rng.integers(self.size))
            out.append(buf[j])
            buf[j] = r
        return out

    def boundary(self, marker: Boundary) -> list:
        out = self.drain()
        self.rng = self._rng(marker)
        return out

    def drain(self) -> list:
        order = self.rng.permutation(len(self.buf))
        out = [self.buf[j] for j in order]
        self.buf = []
        return out
