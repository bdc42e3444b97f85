"""Batches read column by column, in the compact form they cross processes in.

A fused ``read -> batch`` stage over a source with a columnar read
(:meth:`~zephon.pipeline.sources.Source.get_batch`) makes each micro-batch with
one vectorised read. This module owns what those batches look like on the way
from a worker to the consumer, so that the consumer's process, which also
trains, does almost nothing per batch:

- :class:`SampleIds`: a batch's ``[(name, index, epoch), ...]``, held (and
  pickled) as the name, the epoch and the indices packed as int64 bytes; the
  tuples are made only when something reads the list (a tuple per sample costs
  more than the rest of a batch's trip from a worker).
- :class:`BatchRun`: the records of several consecutive micro-batches of one
  lane (a :class:`~zephon.pipeline.lanes.BatchGroup`) read with ONE columnar
  read. It is a list of ordinary batch records (made on first use, so a worker
  that only ships the run never makes them); pickled, it is the group's
  columns (one array per column, so each column is one region of the worker's
  shared-memory arena) plus the batch lengths, and the receiving process cuts
  it back into batches whose arrays are views of those regions (no copy).

Invariant: the batches are exactly those of reading each micro-batch on its
own. A column that the group read collates to an array is sliced (every
subset of rows collates to the same dtype and row shape); a column that
stays a list (strings, nulls, ragged values) is collated again per batch
with ``batch()``'s rule, because a subset of rows may stack where the whole
group does not.
"""

from __future__ import annotations

from itertools import pairwise, repeat

import numpy as np

from zephon.pipeline.collate import collate_column
from zephon.pipeline.records import Batch, DeferredList, Record

__all__ = ["BatchRun", "SampleIds", "sample_ids"]


class SampleIds(DeferredList):
    """``[(name, index, epoch), ...]`` of a batch read column by column: a plain list of
    tuples to whoever reads it, made on first use and pickled compactly (see the module
    docstring); it arrives as the same kind of list. A list changed after it was made is
    pickled as a plain list. :attr:`Batch.meta <zephon.Batch.meta>` hands it to users
    as a plain list.

    Example::

        >>> ids = SampleIds("train", np.arange(3), 0)
        >>> ids == [("train", 0, 0), ("train", 1, 0), ("train", 2, 0)]
        True
    """

    __slots__ = ("_epoch", "_name", "_packed")

    def __init__(self, name: str, indices, epoch: int) -> None:
        super().__init__()
        if not isinstance(indices, bytes):
            indices = np.ascontiguousarray(indices, dtype=np.int64).tobytes()
        self._name, self._epoch, self._packed = name, epoch, indices
        self._recipe = True

    def _make(self) -> list:
        return _unpack_ids(self._name, self._packed, self._epoch)

    def __reduce__(self):
        if self._recipe is not None or \
                list.__eq__(self, _unpack_ids(self._name, self._packed, self._epoch)):
            return SampleIds, (self._name, self._packed, self._epoch)
        return list, (list(self),)


def _unpack_ids(name: str, indices, epoch: int) -> list:
    """``[(name, i, epoch) for i in indices]`` (indices: an int64 array or its bytes)."""
    if isinstance(indices, bytes):
        indices = np.frombuffer(indices, dtype=np.int64)
    n = len(indices)
    return list(zip(repeat(name, n), indices.tolist(), repeat(epoch, n), strict=True))


def sample_ids(source, indices: np.ndarray, epoch: int) -> list:
    """``[(name, index, epoch), ...]`` of ``indices``: a :class:`SampleIds` when the source
    keeps the default identity (its own name and the index itself)."""
    from zephon.pipeline.sources.base import Source

    if type(source).identity is Source.identity:
        return SampleIds(source.name, indices, epoch)
    return [(*source.identity(i), epoch) for i in indices.tolist()]


class BatchRun(DeferredList):
    """The batch records of consecutive micro-batches read with one columnar read.

    Arguments: ``columns`` (the group's collated columns, ``{name: array or list}``),
    ``name`` (the source's name: its identity is the default one), ``indices`` (the
    group's source indices, in order), ``epoch``, ``lengths`` (rows per micro-batch) and
    ``starts`` (each micro-batch's first lane position). The records are made on first
    use: a worker that only ships the run pickles its columns and never makes them."""

    __slots__ = ("_state",)

    def __init__(self, columns: dict, name: str, indices: np.ndarray, epoch: int,
                 lengths: list[int], starts: list[int]) -> None:
        super().__init__()
        bounds = np.cumsum([0, *lengths]).tolist()
        arrays: dict = {}
        lists: dict = {}
        for key, column in columns.items():
            if isinstance(column, np.ndarray):
                arrays[key] = column
            else:  # collate each batch's rows again: a subset may stack
                lists[key] = [collate_column(column[a:b])
                              for a, b in pairwise(bounds)]
        packed = np.ascontiguousarray(indices, dtype=np.int64).tobytes()
        self._state = (list(columns), arrays, lists, name, packed, epoch, lengths, starts)
        self._recipe = True

    def _make(self) -> list:
        return _records(*self._state)

    def __reduce__(self):
        return _records, self._state


def _records(order: list, arrays: dict, lists: dict, name: str, packed: bytes, epoch: int,
             lengths: list[int], starts: list[int]) -> list:
    """The batch records a :class:`BatchRun` stands for (arrays become views, sample ids
    are made on first use)."""
    out, a = [], 0
    for k, (n, start) in enumerate(zip(lengths, starts, strict=True)):
        b = a + n
        columns = {key: arrays[key][a:b] if key in arrays else lists[key][k]
                   for key in order}
        ids = SampleIds(name, packed[8 * a:8 * b], epoch)
        out.append(Record(Batch(columns, meta={"sample_ids": ids}), ids,
                          (epoch, start + n - 1)))
        a = b
    return out
