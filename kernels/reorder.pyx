# cython: language_level=3
"""Compiled ordered merge; behaviour specified by ``zephon.kernels.reorder_ref``.

Callers: ``ReorderBuffer`` by :mod:`zephon.pipeline.dispatch` (sequence order
inside a stage); ``LaneRoundRobin`` by
:mod:`zephon.pipeline.engine` (the ordered merge of a rank's lanes).

``ReorderBuffer`` keeps items in a ring of ``capacity`` slots indexed by
``seq % capacity`` with a byte flag per slot, so push and pop are O(1) with no
hashing; ``push_many`` takes a whole window in one call. ``LaneRoundRobin``
keeps one deque per lane and a C array of exhausted flags.
"""

cimport cython
from libc.stdint cimport int64_t
from libc.stdlib cimport calloc, free

import numbers
from collections import deque


cdef int64_t _as_seq(object seq) except? -1:
    if type(seq) is int:
        return seq
    if isinstance(seq, bool) or not isinstance(seq, numbers.Integral):
        raise ValueError(f"ReorderBuffer: seq must be an int, got {seq!r}")
    return int(seq)


cdef class ReorderBuffer:
    cdef readonly Py_ssize_t capacity
    cdef int64_t _cursor
    cdef list _slots
    cdef unsigned char* _full
    cdef Py_ssize_t _count

    def __cinit__(self, capacity, cursor=0):
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) \
                or capacity < 1:
            raise ValueError(f"ReorderBuffer: capacity must be an int >= 1, got {capacity!r}")
        if isinstance(cursor, bool) or not isinstance(cursor, numbers.Integral) or cursor < 0:
            raise ValueError(f"ReorderBuffer: cursor must be an int >= 0, got {cursor!r}")
        self.capacity = capacity
        self._cursor = cursor
        self._slots = [None] * self.capacity
        self._full = <unsigned char*>calloc(self.capacity, 1)
        if self._full == NULL:
            raise MemoryError()
        self._count = 0

    def __dealloc__(self):
        free(self._full)

    @property
    def cursor(self):
        return self._cursor

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cpdef push(self, object seq, object item):
        cdef int64_t s = _as_seq(seq)
        cdef Py_ssize_t slot
        if s < self._cursor:
            raise ValueError(f"ReorderBuffer: seq {s} is below the emit cursor {self._cursor} "
                             "(already emitted)")
        if s >= self._cursor + self.capacity:
            raise ValueError(f"ReorderBuffer: seq {s} is beyond the window [{self._cursor}, "
                             f"{self._cursor + self.capacity}) of capacity {self.capacity}")
        slot = s % self.capacity
        if self._full[slot]:
            raise ValueError(f"ReorderBuffer: duplicate seq {s}")
        self._slots[slot] = item
        self._full[slot] = 1
        self._count += 1

    def push_many(self, seqs, items):
        seqs = list(seqs)
        items = list(items)
        if len(seqs) != len(items):
            raise ValueError(f"ReorderBuffer.push_many: {len(seqs)} seqs but {len(items)} items")
        cdef Py_ssize_t i
        for i in range(len(seqs)):
            self.push(seqs[i], items[i])

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cpdef list pop_ready(self):
        cdef list out = []
        cdef Py_ssize_t slot = self._cursor % self.capacity
        while self._full[slot]:
            out.append(self._slots[slot])
            self._slots[slot] = None
            self._full[slot] = 0
            self._count -= 1
            self._cursor += 1
            slot += 1
            if slot == self.capacity:
                slot = 0
        return out

    def pending(self):
        cdef int64_t s
        return [s for s in range(self._cursor, self._cursor + self.capacity)
                if self._full[s % self.capacity]]

    def __len__(self):
        return self._count

    def state(self):
        return {"cursor": self._cursor}

    @classmethod
    def from_state(cls, capacity, state):
        return cls(capacity, cursor=state["cursor"])


cdef class LaneRoundRobin:
    cdef readonly tuple lanes
    cdef dict _pos
    cdef list _fifo
    cdef unsigned char* _exhausted
    cdef Py_ssize_t _n
    cdef Py_ssize_t _cursor

    def __cinit__(self, lanes, cursor=0):
        if isinstance(lanes, numbers.Integral) and not isinstance(lanes, bool):
            lane_ids = list(range(int(lanes)))
        else:
            lane_ids = [int(x) for x in lanes]
        if not lane_ids or len(set(lane_ids)) != len(lane_ids):
            raise ValueError(f"LaneRoundRobin: lanes must be a positive count or distinct lane "
                             f"ids, got {lanes!r}")
        if not 0 <= cursor < len(lane_ids):
            raise ValueError(f"LaneRoundRobin: cursor {cursor} outside [0, {len(lane_ids)})")
        self.lanes = tuple(lane_ids)
        self._n = len(lane_ids)
        self._pos = {lane: k for k, lane in enumerate(lane_ids)}
        self._fifo = [deque() for _ in range(self._n)]
        self._exhausted = <unsigned char*>calloc(self._n, 1)
        if self._exhausted == NULL:
            raise MemoryError()
        self._cursor = cursor

    def __dealloc__(self):
        free(self._exhausted)

    @property
    def cursor(self):
        return self._cursor

    cdef Py_ssize_t _index(self, object lane) except -1:
        try:
            return self._pos[lane]
        except (KeyError, TypeError):
            raise ValueError(f"LaneRoundRobin: unknown lane {lane!r} (lanes {self.lanes})") \
                from None

    cpdef push(self, object lane, object item):
        cdef Py_ssize_t k = self._index(lane)
        if self._exhausted[k]:
            raise ValueError(f"LaneRoundRobin: lane {lane} is marked exhausted")
        (<object>self._fifo[k]).append(item)

    def mark_exhausted(self, lane):
        self._exhausted[self._index(lane)] = 1

    cpdef list pop_ready(self):
        cdef list out = []
        cdef Py_ssize_t k, skipped = 0
        cdef object fifo
        while skipped < self._n:
            k = self._cursor
            fifo = self._fifo[k]
            if fifo:
                out.append((self.lanes[k], fifo.popleft()))
                skipped = 0
            elif not self._exhausted[k]:
                break
            else:
                skipped += 1
            self._cursor = k + 1 if k + 1 < self._n else 0
        return out

    @property
    def done(self):
        cdef Py_ssize_t k
        for k in range(self._n):
            if not self._exhausted[k] or self._fifo[k]:
                return False
        return True

    def pending(self):
        return {lane: len(f) for lane, f in zip(self.lanes, self._fifo) if f}

    def state(self):
        return {"cursor": self._cursor,
                "exhausted": [self.lanes[k] for k in range(self._n) if self._exhausted[k]]}

    @classmethod
    def from_state(cls, lanes, state):
        rr = cls(lanes, cursor=state["cursor"])
        for lane in state.get("exhausted", ()):
            rr.mark_exhausted(lane)
        return rr
