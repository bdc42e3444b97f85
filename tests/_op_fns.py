"""Ops defined outside zephon, through the op contracts and the registry only.

Process workers import this module to unpickle the ops (their classes are named by
module), which registers them there too. Appending an op to a pipeline is what a
``Pipeline`` builder method does: :func:`with_op`.
"""

from __future__ import annotations

import numpy as np

from zephon.pipeline.ops import CarryingAccumulator, HoldsRecords, StatelessOp, register
from zephon.pipeline.records import Record


def with_op(pipe, op):
    """``pipe`` with ``op`` appended (the body of every builder method)."""
    return pipe._with(op)


@register
class OffsetOp(StatelessOp):
    """``x + k`` for every sample (a stateless op: it runs in a stage, on any runner)."""

    kind = "test_offset"
    one_to_one = True

    def __init__(self, k: int, parallelism: int = 1) -> None:
        self.k, self.parallelism = k, parallelism

    def describe(self) -> str:
        return f"test_offset({self.k})"

    def apply_one(self, r: Record, seed: int) -> Record | None:
        return Record({**r.value, "x": r.value["x"] + self.k}, r.ids, r.pos, r.lin)


@register
class WindowOp(HoldsRecords):
    """Every ``size`` consecutive records of a lane as one ``{"ids", "total"}`` record (a
    serial op that holds records across boundaries: its remainder is a checkpoint's
    carry, rebuilt with :meth:`remake` on a restore)."""

    kind = "test_window"

    def __init__(self, size: int) -> None:
        self.size = size

    def describe(self) -> str:
        return f"test_window({self.size})"

    def start(self, seed, lane, boundary) -> _WindowState:
        return _WindowState(self)

    def make(self, members: list) -> Record:
        value = {"ids": np.array([m.value["id"] for m in members]),
                 "total": int(sum(int(np.sum(m.value["x"])) for m in members))}
        return Record(value, [i for m in members for i in m.ids], members[-1].pos)

    def made_size(self) -> int:
        return self.size

    def remake(self, members: list, lin) -> Record:
        out = self.make(members)
        out.lin = lin
        return out


class _WindowState(CarryingAccumulator):
    def __init__(self, op: WindowOp) -> None:
        super().__init__()
        self.op, self.buf = op, []

    def _emit(self) -> Record:
        out = self.op.make(self.buf)
        if self.tracks:
            out.lin = [self.lineage(r) for r in self.buf]
        self.buf = []
        return out

    def push(self, records: list) -> list:
        out = []
        for r in records:
            self.buf.append(r)
            if len(self.buf) == self.op.size:
                out.append(self._emit())
        return out

    def boundary(self, marker) -> list:
        return []

    def drain(self) -> list:
        return [self._emit()] if self.buf else []

    def carry(self) -> list:
        return [self.lineage(r) for r in self.buf]

    def load(self, held: list) -> None:
        self.buf = list(held)


# -- ops that leave with a BaseException (tests/test_op_exit.py) -------------------------
#: the sample whose op raises
EXIT_AT = 4


def exit_at(s):
    """Raise what ``$ZEPHON_EXIT_KIND`` names (``SystemExit`` with code 3, or
    ``KeyboardInterrupt``) at sample :data:`EXIT_AT`, after appending a line to
    ``$ZEPHON_TEST_DIR/exit-runs`` (the count of runs of the op on that sample, whatever
    process ran it)."""
    import os

    if s["id"] != EXIT_AT:
        return s
    with open(os.path.join(os.environ["ZEPHON_TEST_DIR"], "exit-runs"), "a") as fh:
        fh.write(f"{os.getpid()}\n")
    if os.environ.get("ZEPHON_EXIT_KIND") == "KeyboardInterrupt":
        raise KeyboardInterrupt
    raise SystemExit(3)
