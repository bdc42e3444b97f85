"""The per-sample ops: ``map``, ``filter`` and ``map_batch`` (stateless, in a stage).

Each wraps a user callable. ``map`` and ``filter`` pass ``ctx``
(:class:`~zephon.pipeline.ops.base.OpContext`, whose ``rng`` is seeded by the
sample identity) as a second argument to a function that takes two; a failure
is an :class:`~zephon.errors.OpError` naming the op and the sample. A ``map`` or
``map_batch`` function returns the new sample (batch): None is refused at the first
sample it is returned for (a forgotten ``return``; a sample is dropped with ``filter``),
the same on every runner (each runs :meth:`MapOp.apply_one`). The
function's identity (:func:`~zephon.pipeline.fingerprint.fn_identity`) is the
op's part of the fingerprint. A ``map`` or ``filter`` whose function draws from torch's,
NumPy's legacy or Python's global generator gets them seeded from the sample's identity
before each call (its ``global_rngs``, decided by validation per run): the stage
program does that around :meth:`MapOp.apply_one` (:mod:`zephon.pipeline.rngs`).
"""

from __future__ import annotations

from typing import Callable

from zephon.errors import ZephonConfigError
from zephon.pipeline.fingerprint import fn_identity, fn_name
from zephon.pipeline.ops.base import (
    PASSES_ON,
    Aligned,
    OpContext,
    StatelessOp,
    check_int,
    op_error,
    op_refusal,
    wants_ctx,
)
from zephon.pipeline.records import Batch, BatchList, Record

__all__ = ["FilterOp", "MapBatchOp", "MapOp"]


class MapOp(StatelessOp):
    """``map(fn, parallelism)``: each sample's value becomes ``fn(value[, ctx])``."""

    kind = "map"
    one_to_one = True
    #: the op's place among the pipeline's per-sample ops (``ctx.rng``'s stream)
    ordinal = 0

    def __init__(self, fn: Callable, parallelism: int = 1, *, ordinal: int = 0) -> None:
        if not callable(fn):
            raise ZephonConfigError(f"map: fn must be callable, got {fn!r}")
        self.fn, self.parallelism = fn, check_int("map", "parallelism", parallelism, 1)
        self.ordinal = check_int("map", "ordinal", ordinal, 0)
        self.with_ctx = wants_ctx(fn)

    @property
    def name(self) -> str:
        return f"{self.kind}({fn_name(self.fn)})"

    def describe(self) -> str:
        # an op drawing from a ctx.rng stream of its own says which: a checkpoint of the
        # stream where every op shared the first op's draws restores into no such pipeline
        stream = f", ctx.rng stream {self.ordinal}" if self.with_ctx and self.ordinal else ""
        return f"{self.kind}({fn_identity(self.fn)}{stream})"

    def apply_one(self, r: Record, seed: int) -> Record | None:
        try:
            value = self.fn(r.value, OpContext(r.ids[0], seed, self.ordinal)) if self.with_ctx \
                else self.fn(r.value)
        except Exception as exc:
            raise op_error(self, r, exc) from exc
        if value is None:
            raise op_refusal(self, r, "the function returned None: a map returns the new "
                             "sample (a dict, an array, ...; a missing `return`?); to drop "
                             "samples use .filter(pred) instead")
        return Record(value, r.ids, r.pos, r.lin)


class FilterOp(MapOp):
    """``filter(pred, parallelism)``: a sample goes on when ``pred(value[, ctx])`` is true."""

    kind = "filter"
    one_to_one = False

    def apply_one(self, r: Record, seed: int) -> Record | None:
        try:
            keep = self.fn(r.value, OpContext(r.ids[0], seed, self.ordinal)) if self.with_ctx \
                else self.fn(r.value)
        except Exception as exc:
            raise op_error(self, r, exc) from exc
        return r if keep else None

    def aligned_with(self, field: str) -> Aligned:
        return PASSES_ON  # it hands the records it keeps on as they are


class MapBatchOp(MapOp):
    """``map_batch(fn, parallelism)``: ``fn(batch)`` on each unit's value (a batch after a
    ``batch``); a plain dict or list it returns keeps the batch's ``meta``."""

    kind = "map_batch"
    one_to_one = False  # it sees whole units: fusing a batch after it would change them
    batch_shape_sensitive = True

    def apply_one(self, r: Record, seed: int) -> Record | None:
        try:
            value = self.fn(r.value)
        except Exception as exc:
            raise op_error(self, r, exc) from exc
        if value is None:
            raise op_refusal(self, r, "the function returned None: a map_batch returns the "
                             "new batch (a dict or a Batch; a missing `return`?)")
        if isinstance(r.value, Batch) and isinstance(value, dict) and \
                not isinstance(value, Batch):
            value = Batch(value, meta=r.value.meta)
        elif isinstance(r.value, BatchList) and type(value) is list:
            value = BatchList(value, meta=r.value.meta)
        return Record(value, r.ids, r.pos, r.lin)
