"""Reference ordered merge: the specification of ``kernels/reorder.pyx``.

Callers: ``ReorderBuffer`` by :mod:`zephon.pipeline.dispatch` (sequence order
inside a stage); ``LaneRoundRobin`` by
:mod:`zephon.pipeline.engine` (the ordered merge of a rank's lanes).

``ReorderBuffer(capacity, cursor=0)``
    Restores sequence order inside a stage. ``push(seq, item)`` accepts any
    arrival order within the window ``[cursor, cursor + capacity)``;
    ``pop_ready()`` returns, as a list, every item from the cursor on that is
    present, in sequence order, and advances the cursor past them.
    ``push_many(seqs, items)`` pushes several (validated one by one, in order).
    Refused with ``ValueError`` (nothing changes): a seq below the cursor, a seq
    at or beyond ``cursor + capacity``, a seq already held, a non-integer seq.
    ``pending()`` lists held seqs ascending; ``len()`` counts them.
    ``state()`` -> ``{"cursor": int}``; ``ReorderBuffer.from_state(capacity,
    state)`` rebuilds an empty buffer at that cursor (items in flight are not
    state: they are re-produced on replay).

``LaneRoundRobin(lanes, cursor=0)``
    The tail merge. ``lanes`` is a lane count or a sequence of distinct lane ids
    (a rank's owned lanes, in round-robin order). ``push(lane, item)`` appends
    to that lane's FIFO; ``pop_ready()`` returns ``(lane, item)`` pairs in
    strict round robin: the lane under the cursor must yield its next item
    before any other lane may; a lane is skipped only once it is marked with
    ``mark_exhausted(lane)`` and its FIFO is empty. ``done`` is True when every
    lane is exhausted and drained. ``state()`` -> ``{"cursor": position,
    "exhausted": [lane ids]}``; ``from_state(lanes, state)`` restores it.
    Pushing to an unknown or exhausted lane is a ``ValueError``.
"""

from __future__ import annotations

import numbers
from collections import deque
from typing import Any, Iterable, Sequence, cast

__all__ = ["LaneRoundRobin", "ReorderBuffer"]


def _check_seq(seq: Any) -> int:
    if isinstance(seq, bool) or not isinstance(seq, numbers.Integral):
        raise ValueError(f"ReorderBuffer: seq must be an int, got {seq!r}")
    return int(seq)


class ReorderBuffer:
    def __init__(self, capacity: int, cursor: int = 0) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) \
                or capacity < 1:
            raise ValueError(f"ReorderBuffer: capacity must be an int >= 1, got {capacity!r}")
        if isinstance(cursor, bool) or not isinstance(cursor, numbers.Integral) or cursor < 0:
            raise ValueError(f"ReorderBuffer: cursor must be an int >= 0, got {cursor!r}")
        self.capacity: int = int(capacity)
        self.cursor: int = int(cursor)
        self._held: dict[int, Any] = {}

    def push(self, seq: int, item: Any) -> None:
        seq = _check_seq(seq)
        if seq < self.cursor:
            raise ValueError(f"ReorderBuffer: seq {seq} is below the emit cursor {self.cursor} "
                             "(already emitted)")
        if seq >= self.cursor + self.capacity:
            raise ValueError(f"ReorderBuffer: seq {seq} is beyond the window [{self.cursor}, "
                             f"{self.cursor + self.capacity}) of capacity {self.capacity}")
        if seq in self._held:
            raise ValueError(f"ReorderBuffer: duplicate seq {seq}")
        self._held[seq] = item

    def push_many(self, seqs: Iterable[int], items: Iterable[Any]) -> None:
        seqs, items = list(seqs), list(items)
        if len(seqs) != len(items):
            raise ValueError(f"ReorderBuffer.push_many: {len(seqs)} seqs but {len(items)} items")
        for seq, item in zip(seqs, items, strict=True):
            self.push(seq, item)

    def pop_ready(self) -> list:
        out = []
        held = self._held
        while self.cursor in held:
            out.append(held.pop(self.cursor))
            self.cursor += 1
        return out

    def pending(self) -> list[int]:
        return sorted(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def state(self) -> dict:
        return {"cursor": self.cursor}

    @classmethod
    def from_state(cls, capacity: int, state: dict) -> "ReorderBuffer":
        return cls(capacity, cursor=state["cursor"])


class LaneRoundRobin:
    def __init__(self, lanes: int | Sequence[int], cursor: int = 0) -> None:
        if isinstance(lanes, numbers.Integral) and not isinstance(lanes, bool):
            lane_ids = list(range(int(lanes)))
        else:
            lane_ids = [int(x) for x in cast("Sequence[int]", lanes)]
        if not lane_ids or len(set(lane_ids)) != len(lane_ids):
            raise ValueError(f"LaneRoundRobin: lanes must be a positive count or distinct lane "
                             f"ids, got {lanes!r}")
        if not 0 <= cursor < len(lane_ids):
            raise ValueError(f"LaneRoundRobin: cursor {cursor} outside [0, {len(lane_ids)})")
        self.lanes = tuple(lane_ids)
        self._pos = {lane: k for k, lane in enumerate(lane_ids)}
        self._fifo: list[deque[Any]] = [deque() for _ in lane_ids]
        self._exhausted = [False] * len(lane_ids)
        self.cursor: int = int(cursor)

    def _index(self, lane: int) -> int:
        try:
            return self._pos[lane]
        except (KeyError, TypeError):
            raise ValueError(f"LaneRoundRobin: unknown lane {lane!r} (lanes {self.lanes})") \
                from None

    def push(self, lane: int, item: Any) -> None:
        k = self._index(lane)
        if self._exhausted[k]:
            raise ValueError(f"LaneRoundRobin: lane {lane} is marked exhausted")
        self._fifo[k].append(item)

    def mark_exhausted(self, lane: int) -> None:
        self._exhausted[self._index(lane)] = True

    def pop_ready(self) -> list:
        out = []
        n = len(self.lanes)
        skipped = 0
        while skipped < n:
            k = self.cursor
            if self._fifo[k]:
                out.append((self.lanes[k], self._fifo[k].popleft()))
                skipped = 0
            elif not self._exhausted[k]:
                break
            else:
                skipped += 1
            self.cursor = (k + 1) % n
        return out

    @property
    def done(self) -> bool:
        return all(self._exhausted) and not any(self._fifo)

    def pending(self) -> dict:
        return {lane: len(f) for lane, f in zip(self.lanes, self._fifo, strict=True) if f}

    def state(self) -> dict:
        return {"cursor": self.cursor,
                "exhausted": [lane for lane, e in zip(self.lanes, self._exhausted, strict=True) if e]}

    @classmethod
    def from_state(cls, lanes: int | Sequence[int], state: dict) -> "LaneRoundRobin":
        rr = cls(lanes, cursor=state["cursor"])
        for lane in state.get("exhausted", ()):
            rr.mark_exhausted(lane)
        return rr
