"""Collation: the samples of a micro-batch into one batch value, as torch collates.

What ``Pipeline.batch()`` makes of its samples' values when no ``collate_fn`` is
given. The rules are those of ``torch.utils.data.default_collate``, with a NumPy
array wherever torch makes a tensor (``zephon.torch`` turns them into tensors
later), and without importing torch: a column of tensors is stacked with the
torch already imported by whoever made them.

Dispatch is on the type of the first sample's value, as in torch:

- a NumPy array: the arrays stacked on a new first axis (``np.array``); mixed
  dtypes promote as torch promotes (an integer or bool array stacked with a float
  one takes the float dtype);
- a NumPy number or bool scalar: an array of the scalars, in their dtype;
- a Python ``bool``, ``int`` (a column of only bools gives ``bool``, else
  ``int64``; an int-first column holding floats gives ``float32``, torch's
  default dtype) or ``float`` (``float64``);
- ``str`` and ``bytes`` (NumPy's too): the values as they came (a list, or a
  tuple inside a sequence, as torch hands them on);
- a torch tensor: ``torch.stack``;
- a mapping: the mapping of each key's values collated (keys of the first
  sample; a key another sample lacks reads as None there); a namedtuple: the
  namedtuple of each field collated; a tuple: the *list* of each position
  collated; another sequence (a list): one of the same type. Samples that are
  sequences of unequal length, or hold them in a tuple or list position, are an
  error (:class:`~zephon.errors.ZephonConfigError` naming the place), as in
  torch.

At the top level a batch of mapping samples is a plain ``dict`` (``batch()``
makes it a :class:`~zephon.Batch`); other samples give what the rules say (a
list for tuples or lists, a namedtuple, an array).

Where torch refuses (and raises), zephon keeps the values as a list: arrays of
unequal shapes (ragged), ``None`` or other objects, integers beyond ``int64``,
tensors that do not stack, and, as the values of a mapping key (a dict column),
sequences of unequal length (variable-length JSON arrays or Parquet lists). So
pipelines whose samples carry ragged arrays, variable-length lists or optional
values work as they are; the difference from torch is only that these raise
there. A dict column of lists of *equal* length is transposed, as torch does
(``[[1, 2], [3, 4]]`` gives ``[array([1, 3]), array([2, 4])]``).

**Collating as the samples come** (:class:`Collator`, the fused ``read -> map ->
batch`` stage's default collation): each sample's value is added as soon as its last
op returned, and each array of a dict sample is copied at once into its row of the
column's batch array, made when the first sample arrives (in a process worker, a
region of its shared heap: the batch is stacked straight into shared memory). The
sample's own array is then let go of while it is still in the CPU cache, and the
next sample's allocation reuses its memory: stacking 64 samples of 602 KB at the end
read 38.5 MB back from memory. The result is :func:`collate`'s, always: a column whose
arrays stop agreeing in shape or dtype, a sample that is no ``dict``, or a batch of
other samples is collated by :func:`collate` from what was added (the rows already
copied stand for their arrays: equal values, shape and dtype).
"""

from __future__ import annotations

import collections.abc
import copy
import sys

import numpy as np

from zephon.errors import ZephonConfigError

__all__ = ["Collator", "collate", "collate_column"]

_INT64 = np.dtype(np.int64)
_FLOAT32 = np.dtype(np.float32)
_FLOAT64 = np.dtype(np.float64)
_PY_DTYPES = {bool: np.dtype(np.bool_), int: _INT64, float: _FLOAT32,
              complex: np.dtype(np.complex64)}  # torch.tensor / as_tensor of Python numbers
_NUMERIC_KINDS = frozenset("biufc")


def collate(values) -> object:
    """The samples of one batch as one value (see the module docstring for the rules).

    Args:
        values: the samples' values, a non-empty list (empty: ``{}``).

    Returns:
        A dict of columns for mapping samples; else the collated value (a list for tuple
        or list samples, a namedtuple, an array, ...).

    Raises:
        ZephonConfigError: samples of unequal structure (sequences of unequal length, a
            mapping where the first sample has a sequence, ...), naming where.

    Examples:
        >>> out = collate([(np.zeros(2), 1), (np.ones(2), 2)])
        >>> type(out).__name__, out[0].shape, out[1].dtype
        ('list', (2, 2), dtype('int64'))
    """
    if not values:
        return {}
    first = values[0]
    if type(first) is dict or isinstance(first, collections.abc.Mapping):
        _check_mappings(values, ())
        return {key: _collate([v.get(key) for v in values], (key,), True) for key in first}
    return _collate(values, ())


def collate_column(column: list):
    """One column of a dict batch: ``collate`` applied to the column's values.

    Examples:
        >>> collate_column([np.arange(2), np.arange(2)]).shape
        (2, 2)
    """
    return _collate(column, ()) if len(column) else column


def _collate(column, path: tuple, keyed: bool = False):
    """``keyed``: the column holds the values of one mapping key (a dict column)."""
    first = column[0]
    t = type(first)
    if t is np.ndarray:
        return _arrays(column)
    if t is bool or t is int:
        return _python_ints(column)
    if t is float:
        return _python_floats(column)
    if t is str or t is bytes:
        return column
    return _collate_other(column, path, first, keyed)


def _collate_other(column, path: tuple, first, keyed: bool):
    """:func:`_collate` past the exact types: subclasses, tensors, containers, the rest."""
    if isinstance(first, np.ndarray):  # a subclass: np.memmap, ...
        return _arrays(column)
    if isinstance(first, (np.bool_, np.number)):
        return _scalars(column)
    if isinstance(first, float):
        return _python_floats(column)
    if isinstance(first, int):
        return _python_ints(column)
    if isinstance(first, (str, bytes)):
        return column
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)  # never imports torch
    if tensor is not None and isinstance(first, tensor):
        return _tensors(column)
    if isinstance(first, collections.abc.Mapping):
        return _mapping(column, path)
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # a namedtuple
        # torch zips without a length check (namedtuples of one type have one length)
        fields = zip(*column, strict=False)
        return type(first)(*(_collate(s, (*path, i)) for i, s in enumerate(fields)))
    if isinstance(first, collections.abc.Sequence):
        return _sequence(column, path, keyed)
    return _as_list(column)


def _as_list(column) -> list:
    return column if type(column) is list else list(column)


def _promote(dtypes) -> np.dtype:
    """The dtype torch gives a stack of these dtypes: floating (or complex) wins over
    integer and bool whatever its width (numpy would widen an int64 + float32 mix to
    float64, torch keeps float32); within a category as numpy promotes."""
    dtypes = set(dtypes)
    high = [d for d in dtypes if d.kind in "fc"]
    if high and len(high) < len(dtypes):
        return np.result_type(*high)
    return np.result_type(*dtypes)


def _arrays(column):
    first = column[0]
    try:
        out = np.array(column)  # stacks on a new axis; refuses ragged shapes
    except (ValueError, TypeError):
        return _as_list(column)
    if out.shape[1:] != first.shape:  # object arrays of arrays: numpy looked inside them
        return _as_list(column)
    if out.dtype != first.dtype and out.dtype.kind in _NUMERIC_KINDS:
        dtypes = [np.asarray(a).dtype for a in column]
        if all(d.kind in _NUMERIC_KINDS for d in dtypes):
            want = _promote(dtypes)
            if want != out.dtype:
                out = out.astype(want)
    return out


def _scalars(column):
    first = column[0]
    dtype = first.dtype
    if any(type(v) is not type(first) for v in column):
        dtypes = []
        for v in column:
            d = v.dtype if isinstance(v, (np.bool_, np.number)) else _PY_DTYPES.get(type(v))
            if d is None:
                return _as_list(column)
            dtypes.append(d)
        dtype = _promote(dtypes)
    try:
        return np.array(column, dtype=dtype)
    except (ValueError, TypeError, OverflowError):
        return _as_list(column)


def _python_ints(column):
    """``torch.tensor`` of an int-first column: bool if all are bools, int64, or float32
    (torch's default dtype) when floats are among them; anything else stays a list."""
    try:
        out = np.array(column)
    except (ValueError, TypeError, OverflowError):
        return _as_list(column)
    kind = out.dtype.kind
    if kind == "b" or out.dtype == _INT64:
        return out
    if kind == "f":
        return out.astype(_FLOAT32)
    if kind == "c":
        return out.astype(np.complex64)
    if kind == "i":  # a narrower int from NumPy scalars among Python ints
        return out.astype(_INT64)
    return _as_list(column)  # beyond int64, or not numbers at all


def _python_floats(column):
    """``torch.tensor(column, dtype=float64)``: floats, ints and bools as float64."""
    try:
        out = np.array(column)
    except (ValueError, TypeError, OverflowError):
        return _as_list(column)
    if out.dtype.kind not in "biuf" or out.ndim != 1:
        return _as_list(column)
    return out.astype(_FLOAT64, copy=out.dtype != _FLOAT64)


def _tensors(column):
    torch = sys.modules["torch"]
    try:
        return torch.stack(list(column))
    except (RuntimeError, TypeError):  # unequal shapes, devices, ...
        return _as_list(column)


def _where(path: tuple) -> str:
    return "the samples" + "".join(f"[{p!r}]" for p in path)


def _check_mappings(column, path: tuple) -> None:
    for i, v in enumerate(column):
        if type(v) is not dict and not isinstance(v, collections.abc.Mapping):
            raise ZephonConfigError(
                f"batch: cannot collate {_where(path)}: sample 0 has a "
                f"{type(column[0]).__name__} there, sample {i} a {type(v).__name__}")


def _mapping(column, path: tuple):
    """As torch: a copy of the first mapping updated with the collated values (a plain
    dict when its type cannot be copied or rebuilt)."""
    _check_mappings(column, path)
    first = column[0]
    values = {key: _collate([d.get(key) for d in column], (*path, key), True) for key in first}
    try:
        if isinstance(first, collections.abc.MutableMapping):
            clone = copy.copy(first)
            clone.update(values)
            return clone
        return type(first)(values)
    except TypeError:
        return values


def _sequence(column, path: tuple, keyed: bool):
    """As torch: equal lengths, transposed, each position collated; a tuple gives a list,
    a list (another mutable sequence) one of its type. Unequal lengths (or a value that
    is not a sequence) raise, except in a dict column (``keyed``): there the values stay
    a list, as variable-length fields (JSON arrays, Parquet lists) always did."""
    first = column[0]
    size = len(first)
    for i, v in enumerate(column):
        if keyed and (isinstance(v, (str, bytes)) or
                      not isinstance(v, collections.abc.Sequence) or len(v) != size):
            return _as_list(column)
        if isinstance(v, (str, bytes)) or not isinstance(v, collections.abc.Sequence):
            raise ZephonConfigError(
                f"batch: cannot collate {_where(path)}: sample 0 has a "
                f"{type(first).__name__} there, sample {i} a {type(v).__name__}")
        if len(v) != size:
            raise ZephonConfigError(
                f"batch: cannot collate {_where(path)}: each sample must have a sequence of "
                f"the same length there (sample 0 has {size} items, sample {i} has {len(v)}; "
                "torch's default_collate refuses this too); make them arrays (ragged "
                "arrays are kept as a list) or pass batch(collate_fn=...)")
    columns = [_collate(s, (*path, j)) for j, s in enumerate(zip(*column, strict=True))]
    if isinstance(first, tuple):
        return columns
    try:
        if isinstance(first, collections.abc.MutableSequence):
            clone = copy.copy(first)
            for j, value in enumerate(columns):
                clone[j] = value
            return clone
        return type(first)(columns)
    except TypeError:
        return columns


class Collator:
    """:func:`collate` of values added one at a time (see the module docstring).

    ``Collator(size)`` for a batch of at most ``size`` samples; ``add(value)`` per
    sample, in order (it never raises); ``result()`` once: ``collate`` of the values
    added, raising as ``collate`` does (the collator keeps no reference to it).

    Examples:
        >>> c = Collator(2)
        >>> c.add({"x": np.zeros(3), "y": 1}); c.add({"x": np.ones(3), "y": 2})
        >>> out = c.result()
        >>> out["x"].shape, out["y"].tolist()
        ((2, 3), [1, 2])
    """

    __slots__ = ("_columns", "_count", "_keys", "_size", "_values")

    def __init__(self, size: int) -> None:
        self._size = max(1, int(size))
        self._count = 0
        self._keys: list | None = None  # the first sample's keys, while all are dicts
        self._columns: list = []  # per key: a batch array being filled, or a list
        self._values: list | None = None  # every value as added (not rows: the fallback)

    def add(self, value) -> None:
        """Take sample ``value``: its arrays are copied into their rows now."""
        i, self._count = self._count, self._count + 1
        if self._values is not None:
            self._values.append(value)
        elif type(value) is not dict or i >= self._size:
            self._values = [*self._samples(), value]
        elif i == 0:
            self._keys = list(value)
            self._columns = [self._start(value[k]) for k in self._keys]
        else:
            self._add_row(value, i)

    def add_arrays(self, value) -> bool:
        """Take sample ``value`` when every field is a numeric array copied into its row of
        the batch (a dict of such arrays, as the first sample's or the batch's columns
        take them): True, and nothing of ``value`` is kept, so its caller need not make
        it independent of the op first (:func:`~zephon.transport.heap.settle`). False,
        with nothing taken, otherwise: :meth:`add` it then."""
        i = self._count
        if self._values is not None or type(value) is not dict or i >= self._size:
            return False
        if i == 0:
            for v in value.values():
                if type(v) is not np.ndarray or v.dtype.kind not in _NUMERIC_KINDS or \
                        not v.dtype.isnative:
                    return False
            self._count = 1
            self._keys = list(value)
            self._columns = [self._start(value[k]) for k in self._keys]
            return True
        keys = self._keys
        if keys is None or len(value) != len(keys):
            return False
        columns = self._columns
        for j, key in enumerate(keys):
            v = value.get(key)
            column = columns[j]
            if type(column) is list or type(v) is not np.ndarray or \
                    v.dtype != column.dtype or v.shape != column.shape[1:]:
                return False
        for j, key in enumerate(keys):
            columns[j][i] = value[key]
        self._count = i + 1
        return True

    def _start(self, first):
        if type(first) is np.ndarray and first.dtype.kind in _NUMERIC_KINDS and \
                first.dtype.isnative:
            out = np.empty((self._size, *first.shape), dtype=first.dtype)
            out[0] = first
            return out
        return [first]

    def _add_row(self, value: dict, i: int) -> None:
        columns = self._columns
        for j, key in enumerate(self._keys or ()):
            v = value.get(key)
            column = columns[j]
            if type(column) is list:
                column.append(v)
            elif type(v) is np.ndarray and v.dtype == column.dtype and \
                    v.shape == column.shape[1:]:
                column[i] = v
            else:  # the arrays stop agreeing: this column is a list of its values
                columns[j] = [*(column[r, ...] for r in range(i)), v]

    def _rows(self, j: int) -> list:
        column = self._columns[j]
        n = min(self._count, self._size)
        return column if type(column) is list else [column[r, ...] for r in range(n)]

    def _samples(self) -> list:
        """The values added so far as dicts (rows for the arrays already copied)."""
        keys = self._keys or []
        n = min(self._count - 1, self._size)
        columns = [self._rows(j)[:n] for j in range(len(keys))]
        return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)] \
            if keys else [{} for _ in range(n)]

    def result(self):
        """``collate`` of every value added."""
        if self._values is not None:
            return collate(self._values)
        if not self._count:
            return {}
        out = {}
        for j, key in enumerate(self._keys or ()):
            column = self._columns[j]
            if type(column) is list:
                out[key] = _collate(column, (key,), True)
            else:
                out[key] = column if self._count == self._size else column[:self._count].copy()
        self._columns = []  # the batch's arrays are the caller's alone (a worker's
        return out          # shared heap sends an array nothing else holds by reference)
