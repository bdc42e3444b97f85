"""``batch(microbatch_size, drop_last, collate_fn)``: micro-batches (serial, holds records).

Collates samples as torch's ``default_collate`` does (see
:mod:`zephon.pipeline.collate`), or with ``collate_fn``: dict samples into a
:class:`~zephon.pipeline.records.Batch`, tuples and lists into a
:class:`~zephon.pipeline.records.BatchList`. The accumulator keeps what it
holds across boundaries and epoch starts (it is the boundary's carry), so only
the stream's last batch can be partial; ``drop_last`` drops it. A packer's short
last row (:class:`~zephon.pipeline.ops.pack_tokens.ShortRow`, fewer than
``seq_len`` tokens) is never stacked with full rows, which would make a ragged
batch (a list of rows, not an array): it is set aside and becomes a batch of its
own after the lane's last batch of full rows; ``drop_last`` drops it too, so that
``pack_tokens(n).batch(b, drop_last=True)`` gives only ``(b, n)`` batches. It
preserves cursor order: right after it emits, it holds nothing. A ``batch`` right after
a stage that only reads and maps is fused into that stage (the plan decides,
:func:`~zephon.pipeline.plan.build_plan`), which then calls :func:`make_batch`.
"""

from __future__ import annotations

from typing import Any, Callable

from zephon.errors import OpError, ZephonConfigError
from zephon.pipeline.collate import collate
from zephon.pipeline.fingerprint import fn_identity, fn_name
from zephon.pipeline.ops.base import CarryingAccumulator, HoldsRecords, check_int
from zephon.pipeline.ops.pack_tokens import ShortRow
from zephon.pipeline.records import Batch, BatchList, Boundary, Record

__all__ = ["BatchOp", "make_batch"]


def make_batch(records: list, collate_fn: Callable | None = None,
               collated: Callable[[], Any] | None = None) -> Record:
    """One batch record of ``records``: their values collated (by ``collate_fn``, else
    :func:`~zephon.pipeline.collate.collate`; or ``collated()``, what a
    :class:`~zephon.pipeline.collate.Collator` made of their values as they came), their
    sample ids in ``meta["sample_ids"]``;
    it ends where the last record ends. A plain dict becomes a :class:`Batch`, a plain list
    a :class:`BatchList`; any other value (a namedtuple, an array) is the batch as it is,
    without ``meta``. A failure is an :class:`OpError` of the ``batch`` op naming the
    batch's samples."""
    ids = [i for r in records for i in r.ids]
    try:
        value = collated() if collated is not None else \
            (collate_fn or collate)([r.value for r in records])
    except Exception as exc:
        shown = ids if len(ids) <= 4 else f"[{ids[0]}, ..., {ids[-1]}] ({len(ids)} samples)"
        name = "batch" if collate_fn is None else f"batch(collate_fn={fn_name(collate_fn)})"
        raise OpError(f"op {name} failed on samples {shown}: {type(exc).__name__}: {exc}",
                      op="batch", sample_id=ids) from exc
    kind = type(value)
    if kind is dict:
        value = Batch(value, meta={"sample_ids": ids})
    elif kind is list:
        value = BatchList(value, meta={"sample_ids": ids})
    elif isinstance(value, (Batch, BatchList)):
        value._meta["sample_ids"] = ids
    return Record(value, ids, records[-1].pos)


class BatchOp(HoldsRecords):
    """``batch(microbatch_size, drop_last, collate_fn)``: batches of exactly
    ``microbatch_size`` records (the stream's last may be short)."""

    kind = "batch"

    def __init__(self, microbatch_size: int, drop_last: bool = False,
                 collate_fn: Callable | None = None) -> None:
        self.size = check_int("batch", "microbatch_size", microbatch_size, 1)
        if not isinstance(drop_last, bool):
            raise ZephonConfigError(f"batch: drop_last must be True or False, got {drop_last!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise ZephonConfigError(f"batch: collate_fn must be callable or None, got "
                                    f"{collate_fn!r}")
        self.drop_last, self.collate_fn = drop_last, collate_fn

    def describe(self) -> str:
        fn = "" if self.collate_fn is None else f", collate_fn={fn_identity(self.collate_fn)}"
        return f"batch({self.size}, drop_last={self.drop_last}{fn})"

    def start(self, seed: int, lane: int, boundary: Boundary) -> _BatchState:
        return _BatchState(self.size, self.drop_last, self)

    def make(self, records: list) -> Record:
        """The batch record of ``records`` (what a full batch, or the last one, is)."""
        return make_batch(records, self.collate_fn)

    def made_size(self) -> int:
        return self.size

    def remake(self, members: list, lin: Any) -> Record:
        out = self.make(members)
        out.lin = lin
        return out


class _BatchState(CarryingAccumulator):
    """Fills batches of exactly ``size`` records; what it holds at a boundary stays (it is
    the boundary's carry), so only the stream's last batch can be short. A packer's short
    row waits in ``short`` for the end (it comes after every boundary: never carried)."""

    def __init__(self, size: int, drop_last: bool, op: BatchOp) -> None:
        super().__init__()
        self.size, self.drop_last, self.op = size, drop_last, op
        self.buf: list = []
        self.short: list = []

    def _make(self, records: list) -> Record:
        out = self.op.make(records)
        if self.tracks:
            out.lin = [self.lineage(r) for r in records]
        return out

    def push(self, records: list) -> list:
        out = []
        for r in records:
            if type(r) is ShortRow:
                self.short.append(r)
                continue
            self.buf.append(r)
            if len(self.buf) == self.size:
                out.append(self._make(self.buf))
                self.buf = []
        return out

    def boundary(self, marker: Boundary) -> list:
        return []

    def carry(self) -> list:
        return [self.lineage(r) for r in self.buf]

    def load(self, held: list) -> None:
        self.buf = list(held)

    def drain(self) -> list:
        buf, short, self.buf, self.short = self.buf, self.short, [], []
        if self.drop_last:
            return []
        return [self._make(part) for part in (buf, short) if part]
