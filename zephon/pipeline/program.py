"""The stage program: what a worker (or the engine itself) runs on one unit.

A :class:`StageProgram` holds the source, the stateless ops of every parallel
stage and the seed; it is pickled once per worker process. ``program((stage,
unit))`` returns the unit's output records, or the unit's
:class:`~zephon.transport.failure.UnitFailure`: stage 0 reads a
:class:`~zephon.pipeline.lanes.ReadUnit` from the source first (each record
carries its sample identity and its lane position). A stage that collates
(a ``batch`` fused into the stage that reads and maps its samples) returns one
batch record per unit (collated by the batch's ``collate_fn``, if it has one):
the unit is exactly one micro-batch. A failure in a user op is an
:class:`~zephon.errors.OpError` naming the op and the sample; a failure
reading the source names the sample likewise.

Each sample goes through all of the stage's ops before the next is read
(:meth:`StageProgram.run_ops`): the first failing sample of a unit is the one
that fails it, whatever the dispatch made the unit's parts. Its failure holds the
error and the records made before that sample (none for a unit that is one batch),
which go on before the error is raised; inside the program it travels up by
:class:`~zephon.transport.failure.Unwind`, and ``program(...)`` returns it. A result
a process worker cannot send (a record whose value does not pickle) fails the same
way, at its first such record (:meth:`StageProgram.unencodable`, marked
``unsendable``). A unit abandoned because its worker was told to stop
(:class:`~zephon.transport.stopping.TaskAbandoned`) raises, as nobody waits for it.

``worker_compute_threads`` is the :class:`~zephon.options.RuntimeOptions` field of
that name, for the process worker that unpickles the program: it limits the
worker's numerical thread pools (:mod:`zephon.transport.threads`) before the
first task.

**Seeded ops** (``seed_global_rngs``, :mod:`zephon.pipeline.rngs`). The program is
given the generators of each op (``global_rngs``, the plan's decision for the run). A unit of a stage without a seeded op runs
the ops as they are; in a stage with one, each seeded op runs as a
:class:`~zephon.pipeline.rngs.SeededOp` (its generators seeded from the sample's
identity and the op's ordinal before each call, under the process's one lock), and
where the unit runs decides how the process's own states are kept
(:func:`~zephon.pipeline.rngs.placement`): not at all in a worker process (they are the
worker's), saved once before the unit and restored once after it in the consumer's
main thread, around each seeded call on any other thread of the consumer's process.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from zephon.errors import OpError
from zephon.pipeline.collate import Collator
from zephon.pipeline.columnar import BatchRun, sample_ids
from zephon.pipeline.lanes import BatchGroup, ReadParts
from zephon.pipeline.ops import FilterOp, make_batch
from zephon.pipeline.records import Batch, Record
from zephon.pipeline.rngs import CALL, UNIT, SeededOp, kept, placement
from zephon.pipeline.sources.base import Source
from zephon.transport.codec import find_unpicklable
from zephon.transport.failure import UnitFailure, Unwind
from zephon.transport.heap import settle
from zephon.transport.stopping import TaskAbandoned
from zephon.transport.stopping import check as check_stop

__all__ = ["StageProgram", "batches_per_message"]

#: Bytes of batches one message to or from a worker aims at when a stage reads whole batches
#: column by column: large enough that the per-message cost vanishes next to the read, and
#: that few messages split a source block (a Parquet row group) between two workers, each
#: of which then decodes it (4 MiB made a worker decode 1.28x its share of row groups).
#: A batch the consumer keeps keeps its message's region (at most this much) alive.
GROUP_TARGET_BYTES = 16 << 20
#: ... and at most this many batches (the records one message makes in the consumer). The
#: first messages of a lane are smaller (see :func:`~zephon.pipeline.lanes.grouped_units`),
#: so the first batches arrive early whatever the target.
GROUP_MAX_BATCHES = 1024
#: Samples one message aims at when the stage runs per-sample ops: a message costs the
#: consumer about 0.4 ms (a submit, a result, their encoding and wake-ups), which next to
#: a cheap op (a window made into int64 x/y: about 15 us a sample) halved the process
#: runner's rate at one batch of 16 per message; 256 samples make it about 1.5 us a sample.
OPS_GROUP_SAMPLES = 256
#: ... and at most this many bytes of the source's samples (their estimate, as read): an op
#: may make its output several times larger (uint16 windows made int64 x/y: 8x), and samples
#: this large (decoded images) already make a message whose cost vanishes next to them.
OPS_GROUP_BYTES = 2 << 20


def batches_per_message(source, batch_size: int, stage) -> int:
    """How many micro-batches of a fused ``read -> batch`` stage travel in one message
    (see :class:`~zephon.pipeline.lanes.BatchGroup`): several only on the process runner
    over a source that can estimate its sample size (1 otherwise: the batch is the
    message). A stage without ops over a source that reads batches column by column sends
    up to :data:`GROUP_TARGET_BYTES` a message; a stage with per-sample ops sends
    :data:`OPS_GROUP_SAMPLES` samples a message, at most :data:`OPS_GROUP_BYTES` of the
    source's bytes. Either leaves every worker a message of its own within the stage's
    items-in-flight bound (``stage.item_cap`` batches per lane, when the stage has one;
    otherwise its byte budget bounds what is in flight)."""
    if stage.runner != "process":
        return 1
    row = source.sample_nbytes()
    if not row:
        return 1
    batch_bytes = max(1.0, row * batch_size)
    if stage.ops:
        per = min(-(-OPS_GROUP_SAMPLES // max(1, batch_size)),
                  int(OPS_GROUP_BYTES // batch_bytes))
    elif type(source).get_batch is Source.get_batch:
        return 1
    else:
        per = int(GROUP_TARGET_BYTES // batch_bytes)
    if stage.item_cap is not None:
        per = min(per, stage.item_cap // max(1, stage.workers))
    return max(1, min(GROUP_MAX_BATCHES, per))


_WARNED_ROW_READS: set[type] = set()


def _row_reads_warning(source, exc: Exception) -> None:
    """Say once per process and source class that a columnar read failed and its rows are
    read one by one: right for a bad row (it then gets its own error), but a get_batch
    that always fails would otherwise only make the run slower, silently."""
    if type(source) in _WARNED_ROW_READS:
        return
    _WARNED_ROW_READS.add(type(source))
    warnings.warn(f"zephon: {type(source).__name__}.get_batch raised "
                  f"{type(exc).__name__}: {exc}; reading those rows one by one instead "
                  "(much slower; said once per process)", RuntimeWarning, stacklevel=3)


def _taker(records):
    """``take()`` -> the next record or None: a list is emptied as it is read (its caller
    hands it over), anything else is iterated."""
    if type(records) is list:
        records.reverse()
        return lambda: records.pop() if records else None
    it = iter(records)
    return lambda: next(it, None)


def _handed_on(r: Record, mapped: bool, collator: Collator | None) -> Record:
    """What goes on of a sample that passed every op (``mapped``: there was one): settled,
    or with a ``collator`` added to the batch (a value whose fields are all numeric arrays
    copied into their rows without settling first) and kept as its identity alone."""
    if collator is None:
        if mapped:
            settle(r)
        return r
    if not collator.add_arrays(r.value):
        if mapped:
            settle(r)
        collator.add(r.value)
    return Record(None, r.ids, r.pos)


class StageProgram:
    """``(stage, unit) -> records``: read (stage 0), the stage's ops, and for a stage that
    collates (a fused ``batch``) one batch of the unit's records."""

    def __init__(self, source, stages: list[list], seed: int,
                 collates: list[bool] | None = None, collate_fn=None,
                 worker_compute_threads: int = 0,
                 global_rngs: list[list[frozenset[str]]] | None = None) -> None:
        self.source, self.stages, self.seed = source, stages, seed
        self.collates = collates or [False] * len(stages)
        self.collate_fn = collate_fn  # of the fused batch (None: the default collation)
        self.worker_compute_threads = worker_compute_threads
        self._stage = 0  # the stage of the unit run last (unencodable names its op)
        #: the generators each op is seeded for (the plan's ``global_rngs``), per stage,
        #: and the union over each stage's ops (empty: the stage runs its ops as they are)
        self.global_rngs = global_rngs or [[frozenset() for _ in ops] for ops in stages]
        self._stage_rngs = [frozenset().union(*rngs) for rngs in self.global_rngs]
        self._home = os.getpid()  # a copy in another process is a worker's: its generators
        #: each stage's ops with the seeded ones wrapped, by placement (made on first use)
        self._seeded: dict[str, list[list]] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_seeded"] = {}  # made again where the copy runs
        # what the last unit run here was: not the program (a kept pool's workers are
        # checked against the program's bytes, :meth:`WorkerPool.runs`)
        state["_stage"] = 0
        return state

    def _seeded_ops(self, where: str) -> list[list]:
        """Each stage's ops, a seeded one as a :class:`~zephon.pipeline.rngs.SeededOp`
        for placement ``where`` (the ordinal counts the stateless ops of every stage in
        chain order: the pipeline's per-sample ops)."""
        made = self._seeded.get(where)
        if made is None:
            made, ordinal = [], 0
            for ops, rngs in zip(self.stages, self.global_rngs, strict=True):
                made.append([SeededOp(op, which, ordinal + i, where == CALL) if which else op
                             for i, (op, which) in enumerate(zip(ops, rngs, strict=True))])
                ordinal += len(ops)
            self._seeded[where] = made
        return made

    def unencodable(self, result, error: BaseException) -> UnitFailure | None:
        """The failure of a unit whose ``result`` a process worker cannot send (its
        encoder raised ``error``), marked ``unsendable``: an :class:`~zephon.errors.OpError`
        naming the op that made the first record that cannot be pickled (the stage's last
        map, or the read), the record's sample, and the offending object's type and path
        inside the value, with the records before it, delivered first. None when
        ``result`` is not a list of records (the error stays as it is). The inline and
        threads runners never pickle results: there the same op just works."""
        if not isinstance(result, list):
            return None
        for i, record in enumerate(result):
            if not isinstance(record, Record):
                return None
            found = find_unpicklable(record.value, "value")
            if found is None:
                continue
            makers = [op for op in self.stages[self._stage] if not isinstance(op, FilterOp)]
            op = makers[-1].name if makers else "read"
            sample = record.ids[0] if len(record.ids) == 1 else list(record.ids)
            failure = OpError(
                f"op {op} made a value for sample {sample} that cannot be sent from a process "
                f"worker: {found[0]} cannot be pickled ({found[1]}); return plain data "
                "(arrays, numbers, strings, containers of them), or run the stage on "
                "runner='threads' or 'inline', which never pickle", op=op, sample_id=sample)
            failure.__cause__ = error
            return UnitFailure(failure, result[:i], unsendable=True)
        return None

    def read(self, unit):
        """The unit's records, read one at a time as they are asked for (each goes
        through the stage's ops before the next is read). A generator, so a
        ``StopIteration`` escaping the source (from ``identity``, say) is an error, not
        the end of the unit; and it keeps no reference to a record it has handed out.
        A :class:`~zephon.pipeline.lanes.ReadParts` (a batch of two epochs) is read part
        by part."""
        if isinstance(unit, ReadParts):
            for part in unit.parts:
                yield from self.read(part)
            return
        epoch, pos = unit.epoch, unit.start
        try:
            view = self.source.view(unit.indices, epoch)
        except Exception as exc:
            sid = (getattr(self.source, "name", type(self.source).__name__),
                   int(unit.indices[0]) if len(unit.indices) else -1, epoch)
            raise OpError(f"reading sample {sid} failed: the source's view() raised "
                          f"{type(exc).__name__}: {exc}", op="read", sample_id=sid) from exc
        for n, index in enumerate(unit.indices.tolist()):
            yield self._read_one(view, n, index, epoch, pos)
            pos += 1

    def _read_one(self, view, n: int, index: int, epoch: int, pos: int) -> Record:
        try:
            name, idx = view.identity(n)
        except Exception as exc:
            sid = (getattr(self.source, "name", type(self.source).__name__), index, epoch)
            raise OpError(f"reading sample {sid} failed: its identity() raised "
                          f"{type(exc).__name__}: {exc}", op="read", sample_id=sid) from exc
        sid = (name, idx, epoch)
        try:
            value = view.get(n)
        except Exception as exc:
            raise OpError(f"reading sample {sid} failed: {type(exc).__name__}: {exc}",
                          op="read", sample_id=sid) from exc
        return Record(value, [sid], (epoch, pos))

    def run_ops(self, records, ops: list, collator: Collator | None = None) -> list:
        """Each record through every op of the stage, **one sample at a time**: a sample
        is read, mapped and filtered before the next is read. So the first failure in
        sample order is the one raised, whatever the dispatch made the unit's parts, and
        a sample's temporaries are freed before the next sample's are made (a worker's
        shared heap reuses them while they are still in the cache).

        What goes on of a sample is fixed when its last op returns
        (:func:`~zephon.transport.heap.settle`): an array the op can still reach (a
        reused output buffer, a cache, a thread it started) is copied then, a fresh one
        goes on as it is, on every runner. A list of records (a later stage's input) is
        emptied as it is read, and an input record the first op has replaced lets go of
        its value, so an array passed on from it counts as the op's alone (the dispatch
        may still hold the list a part was cut from).

        With a ``collator`` (a fused batch's default collation), each record's value goes
        to it and the record keeps only its identity and position: the collator has
        copied its arrays into the batch's rows, so the sample's memory is freed before
        the next sample is made. A value whose fields are all numeric arrays is not
        settled first (:meth:`~zephon.pipeline.collate.Collator.add_arrays`: the row copy
        already makes the batch independent of the op; settling copied views such as
        ``t[:-1]``, ``t[1:]`` a second time); any other value is settled, then added."""
        if any(op.batched for op in ops):
            return self._run_batched(records, ops)
        seed, take, given = self.seed, _taker(records), type(records) is list
        out: list[Record] = []
        try:
            while True:
                check_stop()  # a worker told to stop gives up between samples
                r = take()
                if r is None:
                    return out
                source: Record | None = r if given else None
                for op in ops:
                    check_stop()  # ... and between the ops of a sample
                    r = op.apply_one(r, seed)
                    if source is not None and r is not source:
                        source.value = None
                        source = None
                    if r is None:
                        break
                else:
                    out.append(_handed_on(r, bool(ops), collator))
        except (TaskAbandoned, Unwind):
            raise
        except BaseException as exc:  # noqa: BLE001 - an op's SystemExit too: what came before goes on
            raise Unwind(UnitFailure(exc, out)) from None

    def _run_batched(self, records, ops: list) -> list:
        """The ops of a stage with a *batched* op (``tokenize``: ``op.batched`` and
        ``op.apply_many(records, seed)``): the per-sample ops around it run sample by
        sample (:meth:`run_ops`), the batched op on every record that reached it at once.

        The error raised is still the first failing sample's: a failure stops a
        segment, and the segments after it only see the records before that sample, so
        a later failure is always of an earlier sample. The last error raised is the one
        that goes out, with the records the last segment made (those before it)."""
        groups: list[list] = [[]]
        for op in ops:
            if op.batched:
                groups += [[op], []]
            else:
                groups[-1].append(op)
        error: BaseException | None = None
        for group in groups:
            try:
                if group and group[0].batched:
                    check_stop()
                    records = group[0].apply_many(records, self.seed)
                    for r in records:
                        settle(r)
                else:
                    records = self.run_ops(records, group)
            except TaskAbandoned:
                raise
            except Unwind as unwind:  # the segment's error and the records before it
                error, records = unwind.failure.error, list(unwind.failure.done)
            except BaseException as exc:  # noqa: BLE001 - the op's error, raised below
                error, records = exc, []
        if error is not None:
            raise Unwind(UnitFailure(error, records))
        return records

    def read_batch(self, unit) -> list | None:
        """A whole micro-batch in one columnar read (a fused ``read -> batch`` stage over a
        source with :meth:`~zephon.pipeline.sources.Source.get_batch`), or None."""
        if isinstance(unit, ReadParts):  # samples of two epochs: read row by row
            return None
        source, epoch = self.source, unit.epoch
        try:
            columns = source.get_batch(unit.indices)
        except Exception as exc:  # noqa: BLE001 - named per sample by the row-wise read
            _row_reads_warning(source, exc)
            return None  # read row by row: the failing sample gets its own error
        if columns is None:
            return None
        ids = sample_ids(source, unit.indices, epoch)
        batch = Batch(columns, meta={"sample_ids": ids})
        return [Record(batch, ids, (epoch, unit.start + len(unit.indices) - 1))]

    def read_group(self, group: BatchGroup) -> list | None:
        """The micro-batches of ``group`` with ONE columnar read, as a
        :class:`~zephon.pipeline.columnar.BatchRun` (the same batches as reading each
        member on its own), or None when the members must be read one by one (a stage
        with ops, a source without a columnar read or with its own identities, members
        of several epochs, or a read that failed: each member then names its samples)."""
        source, units = self.source, group.units
        if not self.collates[0] or self.stages[0] or \
                type(source).identity is not Source.identity or \
                len({u.epoch for u in units}) != 1:
            return None
        indices = np.concatenate([u.indices for u in units])
        try:
            columns = source.get_batch(indices)
        except Exception as exc:  # noqa: BLE001 - named per sample by the row-wise read
            _row_reads_warning(source, exc)
            return None
        if columns is None or not _rows_first(columns, len(indices)):
            return None  # each member's own columnar read (read_unit)
        return BatchRun(columns, source.name, indices, units[0].epoch,
                        [len(u) for u in units], [u.start for u in units])

    def __call__(self, payload: tuple[int, Any]) -> list | UnitFailure:
        """The unit's records, or its :class:`~zephon.transport.failure.UnitFailure`."""
        try:
            which = self._stage_rngs[payload[0]]
            if not which:
                return self._unit(payload, self.stages)
            where = placement(self._home)
            if where != UNIT:
                return self._unit(payload, self._seeded_ops(where))
            with kept(which):  # the consumer's states, given back once the unit is done
                return self._unit(payload, self._seeded_ops(where))
        except Unwind as unwind:
            return unwind.failure

    def _unit(self, payload: tuple[int, Any], stages: list[list]) -> list:
        """The unit's records, each stage's ops taken from ``stages`` (the program's own,
        or with the seeded ones wrapped)."""
        stage, unit = payload
        self._stage = stage
        if isinstance(unit, BatchGroup):  # several micro-batches, each collated on its own
            fast = self.read_group(unit) if stage == 0 else None
            if fast is not None:
                return fast
            out: list = []
            for member in unit.units:
                try:
                    out.extend(self._unit((stage, member), stages))
                except Unwind as unwind:  # the whole batches before the failing one go on
                    raise Unwind(UnitFailure(unwind.failure.error, out)) from None
                except TaskAbandoned:
                    raise
                except BaseException as exc:  # noqa: BLE001 - a member's collation or read, an op's SystemExit
                    raise Unwind(UnitFailure(exc, out)) from None
            return out
        if stage == 0 and self.collates[0] and not self.stages[0]:
            fast = self.read_batch(unit)
            if fast is not None:
                return fast
        collator = self._collator(stage, unit)
        try:
            records = self.run_ops(self.read(unit) if stage == 0 else unit,
                                   stages[stage], collator)
        except Unwind as unwind:
            if self.collates[stage]:  # the unit is one batch: no part of it goes on
                unwind.failure.done = []
            raise
        if self.collates[stage] and records:
            return [make_batch(records, self.collate_fn,
                               collator.result if collator is not None else None)]
        return records

    def _collator(self, stage: int, unit) -> Collator | None:
        """The :class:`~zephon.pipeline.collate.Collator` of a unit that is one batch
        collated by default, sample by sample (None: the stage does not collate, it has
        a ``collate_fn`` or a batched op)."""
        if not self.collates[stage] or self.collate_fn is not None or \
                any(op.batched for op in self.stages[stage]):
            return None
        if stage != 0:
            return Collator(len(unit))
        parts = unit.parts if isinstance(unit, ReadParts) else [unit]
        return Collator(sum(len(p.indices) for p in parts))


def _rows_first(columns: dict, n: int) -> bool:
    """Whether every collated column holds one entry per row in order (an array, or a list
    of scalar values: strings, bytes, numbers and Nones), so that a :class:`BatchRun` can cut it into micro-batches; a
    column ``batch()`` collated otherwise (a dict of a struct's fields, a list of lists
    transposed) cannot be cut by rows."""
    for column in columns.values():
        if isinstance(column, np.ndarray):
            if column.ndim == 0 or len(column) != n:
                return False
        elif not (type(column) is list and len(column) == n
                  and not any(isinstance(v, (tuple, list, dict)) for v in column)):
            return False
    return True

