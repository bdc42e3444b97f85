"""The stage program: what a worker (or the engine itself) runs on one unit.

A :class:`StageProgram` holds the source, the stateless ops of every parallel
stage and the seed; it is pickled once per worker process. ``program((stage,
unit))`` returns the unit's output records: stage 0 reads a
:class:`~zephon.pipeline.lanes.ReadUnit` from the source first (each record
carries its sample identity and its lane position). A stage that collates
(a ``batch`` fused into the stage that reads and maps its samples) returns one
:class:`~zephon.pipeline.ops.Batch` record per unit: the unit is exactly one
micro-batch. A failure in a user op is an
:class:`~zephon.pipeline.ops.OpError` naming the op and the sample; a failure
reading the source names the sample likewise.
"""

from __future__ import annotations

from typing import Any

from zephon.pipeline.ops import Batch, OpError, Record, make_batch

__all__ = ["StageProgram"]


class StageProgram:
    """``(stage, unit) -> records``: read (stage 0), the stage's ops, and for a stage that
    collates (a fused ``batch``) one batch of the unit's records."""

    def __init__(self, source, stages: list[list], seed: int,
                 collates: list[bool] | None = None) -> None:
        self.source, self.stages, self.seed = source, stages, seed
        self.collates = collates or [False] * len(stages)

    def read(self, unit) -> list:
        source, out = self.source, []
        epoch, pos = unit.epoch, unit.start
        for index in unit.indices.tolist():
            name, idx = source.identity(index)
            sid = (name, idx, epoch)
            try:
                value = source.get(index)
            except Exception as exc:  # noqa: BLE001 - named and re-raised for the consumer
                raise OpError(f"reading sample {sid} failed: {type(exc).__name__}: {exc}",
                              op="read", sample_id=sid) from exc
            out.append(Record(value, [sid], (epoch, pos)))
            pos += 1
        return out

    def read_batch(self, unit) -> list | None:
        """A whole micro-batch in one columnar read (a fused ``read -> batch`` stage over a
        source with :meth:`~zephon.pipeline.sources.Source.get_batch`), or None."""
        source, epoch = self.source, unit.epoch
        try:
            columns = source.get_batch(unit.indices)
        except Exception as exc:  # noqa: BLE001 - named per sample by the row-wise read
            del exc
            return None  # read row by row: the failing sample gets its own error
        if columns is None:
            return None
        ids = [(*source.identity(i), epoch) for i in unit.indices.tolist()]
        batch = Batch(columns, meta={"sample_ids": ids})
        return [Record(batch, ids, (epoch, unit.start + len(ids) - 1))]

    def __call__(self, payload: tuple[int, Any]) -> list:
        stage, unit = payload
        if stage == 0 and self.collates[0] and not self.stages[0]:
            fast = self.read_batch(unit)
            if fast is not None:
                return fast
        records = self.read(unit) if stage == 0 else unit
        for op in self.stages[stage]:
            records = op.apply(records, self.seed)
        if self.collates[stage] and records:
            return [make_batch(records)]
        return records
