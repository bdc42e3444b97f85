"""What flows down a lane: records, boundary markers, and the batch values ops make.

A lane's stream is a sequence of **units** (lists of :class:`Record`) and
:class:`Boundary` markers. A record is a value plus the identities of the
samples it came from ``(source, index, epoch)``, ``pos``, the lane position
``(epoch, p)`` of the last sample it consumed (what cursor resume restarts
after), and ``lin``, its *lineage* when an accumulator made it (see
:mod:`zephon.pipeline.carry`).

A Boundary ``(epoch, k, carry)`` opens a replay segment. It is a resume point
only and never shows in the output; as it passes a carrying accumulator it
collects the lineage of what that accumulator holds (``carry``, one entry per
carrying accumulator in chain order).

Batch values: ``batch()`` turns dict samples into a :class:`Batch` and tuple or
list samples into a :class:`BatchList`, both with ``meta``. A
:class:`DeferredList` is a list whose items are made on first use (sample ids
of a batch read column by column, the records of a
:class:`~zephon.pipeline.columnar.BatchRun`); ``meta`` hands users plain lists.

Nothing here knows about ops or plans: this module is the bottom of the
pipeline's own layers (``tests/test_layers.py``).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

__all__ = ["Batch", "BatchList", "Boundary", "DeferredList", "Record"]


class Record:
    """A value with the identities of its samples, the lane position it ends at and, for
    a record an accumulator made while a later accumulator may hold it, its lineage."""

    __slots__ = ("ids", "lin", "pos", "value")
    #: a worker's shared heap may send arrays under ``value`` by reference when nothing
    #: else holds them (zephon.transport.heap.exclusive_arrays): ids, pos and lin hold none
    __heap_walk__ = True

    def __init__(self, value: Any, ids: list, pos: tuple = (0, -1), lin: Any = None) -> None:
        self.value, self.ids, self.pos, self.lin = value, ids, pos, lin

    def __reduce__(self):
        if self.lin is None:
            return (Record, (self.value, self.ids, self.pos))
        return (Record, (self.value, self.ids, self.pos, self.lin))


class Boundary(NamedTuple):
    """A resume point of a lane: lane chunk ``k`` of ``epoch``. ``carry`` is what the
    accumulators it passed held there (one lineage entry per carrying accumulator,
    appended as the marker flows down the lane)."""

    epoch: int
    k: int  # lane-chunk index within the epoch where the segment starts
    carry: tuple = ()


_FILL_LOCK = threading.RLock()

#: Every ``list`` method that reads or writes the list's storage. CPython's list methods
#: read the storage directly (none of them goes through ``__len__`` or ``__iter__``), so
#: each of them must make the deferred items first: patching a few would leave the others
#: seeing an empty list.
_STORAGE_METHODS = (
    "__len__", "__getitem__", "__iter__", "__reversed__", "__contains__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__mul__", "__rmul__", "__iadd__",
    "__imul__", "__setitem__", "__delitem__", "__repr__", "__sizeof__", "append", "extend",
    "insert", "pop", "remove", "index", "count", "copy", "reverse", "clear", "sort")


class DeferredList(list):
    """A list whose items are made on first use: building many small objects (a tuple per
    sample, a record per micro-batch) can cost more than everything else a batch needs
    on its way through a process, and most of them are never looked at.

    Subclasses set ``_recipe`` (not None while the items are not made) and define
    ``_make()``. Every list method (:data:`_STORAGE_METHODS`) makes the items first (of
    both operands, for comparisons and ``+``), then behaves as on a plain list. C code
    that reads a list's storage without calling its methods (a plain ``list + x`` with
    this list as ``x``, some extensions after an ``isinstance(x, list)`` check) would see
    it empty, so such lists stay inside zephon: :attr:`Batch.meta` hands users plain
    lists."""

    __slots__ = ("_recipe",)
    _recipe: object  # not None until the items are made
    __hash__ = None  # a list: unhashable

    def _make(self) -> list:
        raise NotImplementedError

    def _fill(self) -> None:
        with _FILL_LOCK:  # two threads reading a new list at once make its items once
            if self._recipe is not None:
                list.extend(self, self._make())
                self._recipe = None


def _filling(name: str):
    """``list.<name>``, made to fill the deferred operands before it runs."""
    method = getattr(list, name)

    def call(self, *args, **kwargs):
        if self._recipe is not None:
            self._fill()
        for arg in args:
            if isinstance(arg, DeferredList) and arg._recipe is not None:
                arg._fill()
        return method(self, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    return call


for _name in _STORAGE_METHODS:
    setattr(DeferredList, _name, _filling(_name))


class _WithMeta:
    """``meta`` of a batch value (:class:`Batch`, :class:`BatchList`): a dict whose lists
    are plain lists (``sample_ids`` are made when they are first read here, not for every
    batch that passes)."""

    _meta: Any

    @property
    def meta(self) -> dict:
        """The batch's metadata, a dict.

        Examples:
            >>> zephon.Batch({"x": np.zeros(2)}, meta={"lane": 1}).meta
            {'lane': 1}
        """
        meta = self._meta
        if isinstance(meta, dict):
            for key, value in meta.items():
                if isinstance(value, DeferredList):
                    meta[key] = list(value)
        return meta

    @meta.setter
    def meta(self, value: dict) -> None:
        self._meta = value


class Batch(_WithMeta, dict):
    """A batch: ``{column: array or list}`` plus ``meta``.

    What ``Pipeline.batch()`` produces: a dict whose columns are stacked arrays (where
    the samples' shapes agree) or lists, with ``meta`` saying where it came from:
    ``sample_ids`` (``(source, index, epoch)`` per sample), ``lane`` and
    ``lane_index`` (the batch's position in its lane). It pickles with its ``meta``.

    Args:
        *args: as for ``dict``.
        meta: the batch's metadata (None: empty).
        **kwargs: as for ``dict``.

    Examples:
        >>> b = zephon.Batch({"x": np.zeros((2, 3))}, meta={"lane": 0})
        >>> b["x"].shape, b.meta["lane"]
        ((2, 3), 0)
    """

    #: a worker's shared heap may send its columns by reference when nothing else holds
    #: them (zephon.transport.heap.exclusive_arrays): it pickles as dict(self) and meta
    __heap_walk_items__ = True

    def __init__(self, *args, meta: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._meta = meta if meta is not None else {}

    def __reduce__(self):
        return (_rebuild_batch, (dict(self), self._meta))

    def __repr__(self) -> str:
        return f"Batch({dict.__repr__(self)}, meta={self.meta!r})"


def _rebuild_batch(data, meta):
    return Batch(data, meta=meta)


class BatchList(_WithMeta, list):
    """A batch of tuple or list samples: the list of its collated positions, plus ``meta``.

    What ``Pipeline.batch()`` produces for ``(image, label)`` samples, as torch's
    ``default_collate`` gives a list: ``images, labels = batch`` works, and ``meta``
    says where the batch came from, as :attr:`Batch.meta` does. It pickles with its
    ``meta``.

    Args:
        items: the batch's positions (an iterable).
        meta: the batch's metadata (None: empty).

    Examples:
        >>> b = zephon.BatchList([np.zeros((2, 3)), np.arange(2)], meta={"lane": 0})
        >>> x, y = b
        >>> x.shape, b.meta["lane"]
        ((2, 3), 0)
    """

    def __init__(self, items=(), meta: dict | None = None) -> None:
        super().__init__(items)
        self._meta = meta if meta is not None else {}

    def __reduce__(self):
        return (_rebuild_batch_list, (list(self), self._meta))

    def __repr__(self) -> str:
        return f"BatchList({list.__repr__(self)}, meta={self.meta!r})"


def _rebuild_batch_list(items, meta):
    return BatchList(items, meta=meta)
