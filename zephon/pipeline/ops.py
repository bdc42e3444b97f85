"""Ops, the records they exchange, and the accumulators.

A lane's stream is a sequence of **units** (lists of :class:`Record`) and
:class:`Boundary` markers. A record is a value plus the identities of the
samples it came from ``(source, index, epoch)``, ``pos``, the lane position
``(epoch, p)`` of the last sample it consumed (what cursor resume restarts
after), and ``lin``, its *lineage* when an accumulator made it (see below).

A Boundary ``(epoch, k, carry)`` opens a replay segment. It is a resume point
only and never shows in the output: a ``shuffle`` buffer drains there and
restarts with state seeded from ``(seed, lane, epoch, k)`` (that only orders
samples), while ``batch`` and ``pack_tokens`` keep what they hold across it
(and across an epoch start inside one run), so every batch is full and every
packed row has ``seq_len`` tokens except the very last of the stream. As the
marker passes an accumulator it collects the lineage of what that accumulator
holds (``carry``, one entry per carrying accumulator in chain order): a batch
remainder is at most ``size - 1`` records, a packer's the pieces of fewer than
``seq_len`` tokens. A record's lineage is its ``pos`` for a sample (for a fused
batch: the ``size`` lane positions ending at ``pos``), the members' lineages
for a batch, and ``(lineage, first token, end token)`` per piece for a packed
row. :mod:`zephon.pipeline.carry` encodes it into the checkpoint and rebuilds
the held records from it on a restore (sources are random access, per-sample
ops deterministic, ``ctx.rng`` seeded by identity), so a lane replayed from a
boundary reproduces its stream exactly.

Stateless ops (``map``, ``filter``, ``map_batch``) run inside a stage program,
possibly in another process, on one unit at a time. Stateful ops run serially
per lane in the engine: ``shuffle(buffer_size)`` (a seeded shuffle buffer),
``batch(microbatch_size, drop_last, collate_fn)`` (collates samples as
torch's ``default_collate`` does, see :mod:`zephon.pipeline.collate`, or with
``collate_fn``: dict samples into a :class:`Batch`, tuples and lists into a
:class:`BatchList`; only the stream's last batch can be partial, and
``drop_last`` drops it) and ``pack_tokens(seq_len, field, drop_remainder)``
(concatenates token arrays and cuts rows of ``seq_len`` tokens, carrying the
remainder; the stream's final remainder is a last short row, dropped with
``drop_remainder=True``).

An accumulator state has ``push(records) -> emitted``, ``boundary(marker) ->
emitted`` (what it gives up at a boundary: a shuffle's buffer), ``carry()``
(the lineage of what it holds), ``load(held)`` (put rebuilt held records back)
and ``drain() -> emitted`` (the end of the stream).

Traits per op: ``parallelism`` (workers it asks for), ``preserves_cursor_order``
(False for shuffle and pack_tokens: they need flush boundaries), and
``batch_shape_sensitive`` (map_batch: the unit boundaries it sees matter).
Randomness for ops is ``ctx.rng``, seeded from the sample identity; a map
function taking two arguments receives ``ctx`` as the second.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
import zlib
from typing import Any, Callable, NamedTuple

import numpy as np

from zephon.errors import OpError, ZephonConfigError
from zephon.pipeline.collate import collate, collate_column

__all__ = [
    "Batch",
    "BatchList",
    "BatchOp",
    "Boundary",
    "DeferredList",
    "FilterOp",
    "MapBatchOp",
    "MapOp",
    "Op",
    "OpContext",
    "OpError",
    "PackTokensOp",
    "Record",
    "ShuffleOp",
    "collate",
    "collate_column",
    "fn_name",
    "make_batch",
]


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


class DeferredList(list):
    """A list whose items are made on first use: building many small objects (a tuple per
    sample, a record per micro-batch) can cost more than everything else a batch needs
    on its way through a process, and most of them are never looked at.

    Subclasses set ``_recipe`` (not None while the items are not made) and define
    ``_make()``. Every list method makes the items first (of both operands, for
    comparisons and ``+``), then behaves as on a plain list. C code that reads a list's
    storage without calling its methods (a plain ``list + x`` with this list as ``x``,
    some extensions after an ``isinstance(x, list)`` check) would see it empty, so such
    lists stay inside zephon: :attr:`Batch.meta` hands users plain lists."""

    __slots__ = ("_recipe",)
    _recipe: object  # not None until the items are made

    def _make(self) -> list:
        raise NotImplementedError

    def _fill(self) -> None:
        with _FILL_LOCK:  # two threads reading a new list at once make its items once
            if self._recipe is not None:
                list.extend(self, self._make())
                self._recipe = None


def _filling(name: str):
    method = getattr(list, name)

    def call(self, *args):
        if self._recipe is not None:
            self._fill()
        for arg in args:
            if isinstance(arg, DeferredList) and arg._recipe is not None:
                arg._fill()
        return method(self, *args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    return call


for _name in ("__len__", "__getitem__", "__iter__", "__reversed__", "__contains__",
              "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__add__",
              "__mul__", "__rmul__", "__iadd__", "__imul__", "__setitem__", "__delitem__",
              "__repr__", "__sizeof__", "append", "extend", "insert", "pop", "remove",
              "index", "count", "copy", "reverse", "clear"):
    setattr(DeferredList, _name, _filling(_name))


def _sort(self, *, key=None, reverse=False):
    if self._recipe is not None:
        self._fill()
    list.sort(self, key=key, reverse=reverse)


DeferredList.sort = _sort  # type: ignore[method-assign]
DeferredList.__hash__ = None


class _WithMeta:
    """``meta`` of a batch value (:class:`Batch`, :class:`BatchList`): a dict whose lists
    are plain lists (``sample_ids`` are made when they are first read here, not for every
    batch that passes)."""

    _meta: Any

    @property
    def meta(self) -> dict:
        """The batch's metadata, a dict.

        Example:
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

    Example:
        >>> b = zephon.Batch({"x": np.zeros((2, 3))}, meta={"lane": 0})
        >>> b["x"].shape, b.meta["lane"]
        ((2, 3), 0)
    """

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

    Example:
        >>> b = zephon.pipeline.ops.BatchList([np.zeros((2, 3)), np.arange(2)], meta={"lane": 0})
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


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())


class OpContext:
    """What an op may know about the sample it runs on; ``rng`` is seeded from its identity."""

    __slots__ = ("_rng", "sample_id", "seed")

    def __init__(self, sample_id, seed: int) -> None:
        self.sample_id, self.seed = sample_id, seed
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            source, index, epoch = self.sample_id
            self._rng = np.random.default_rng([self.seed, _stable_hash(source), index, epoch])
        return self._rng


def fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def stable_repr(value: Any, depth: int = 0) -> str:
    """A description of a plain value that is the same in every process and run: numbers,
    strings, bytes, None, and lists/tuples/dicts/sets of them; anything else is named by
    its type (never by a memory address)."""
    if depth > 4:
        return "..."
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return repr(value)
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value[:64])) + (f"+{len(value) - 64}" if len(value) > 64 else "")
    if isinstance(value, (list, tuple)):
        inner = ", ".join(stable_repr(v, depth + 1) for v in value[:32])
        return f"{type(value).__name__}[{inner}{', ...' if len(value) > 32 else ''}]"
    if isinstance(value, (set, frozenset)):
        return "set[" + ", ".join(sorted(stable_repr(v, depth + 1) for v in value)) + "]"
    if isinstance(value, dict):
        items = sorted((stable_repr(k, depth + 1), stable_repr(v, depth + 1))
                       for k, v in list(value.items())[:64])
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, np.ndarray):
        return f"ndarray({value.dtype.str}, {value.shape}, {zlib.crc32(value.tobytes()):08x})"
    if callable(value):
        return fn_identity(value, depth + 1)
    return type(value).__qualname__


#: How the main script's module is named in a fingerprint: ``__main__`` in the script (run
#: as a file or with ``python -m pkg.mod``), ``__mp_main__`` in its spawn children.
MAIN_SCRIPT = "<main>"


def _module_identity(module: str) -> str:
    """``module`` as a fingerprint names it: the main script's module (``__main__``, its
    spawn children's ``__mp_main__``, or the name ``python -m`` ran it under, should it
    also be imported by that name) is :data:`MAIN_SCRIPT`, whatever the process."""
    if module in ("__main__", "__mp_main__"):
        return MAIN_SCRIPT
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and module == getattr(spec, "name", None):
        return MAIN_SCRIPT
    return module


def _code_hash(code: types.CodeType) -> str:
    blob = code.co_code + stable_repr(code.co_consts).encode() + \
        stable_repr(code.co_names).encode()
    return f"#{zlib.crc32(blob):08x}"


def fn_identity(fn: Any, depth: int = 0) -> str:
    """What defines a user callable, for the pipeline fingerprint: its module and qualified
    name; for a ``functools.partial`` also its function and arguments; for a lambda, a
    nested function or a function of the main script also a hash of its code and
    constants (two lambdas differ, and so do two scripts' ``load``); for a callable object
    also its attributes. The main script's module is one name, :data:`MAIN_SCRIPT`, in
    the script, in its spawn children and under ``python -m``. Stable across processes
    and runs."""
    if isinstance(fn, functools.partial):
        args = ", ".join(stable_repr(a, depth + 1) for a in fn.args)
        kwargs = ", ".join(f"{k}={stable_repr(v, depth + 1)}"
                           for k, v in sorted(fn.keywords.items()))
        return f"partial({fn_identity(fn.func, depth + 1)}; {args}; {kwargs})"
    module = _module_identity(getattr(fn, "__module__", None) or "?")
    if isinstance(fn, (types.FunctionType, types.MethodType)):
        code = getattr(fn, "__code__", None)
        name = f"{module}.{fn.__qualname__}"
        if code is not None and ("<lambda>" in fn.__qualname__ or "<locals>" in fn.__qualname__):
            closure = [c.cell_contents for c in (fn.__closure__ or ()) if _cell_ok(c)]
            name += _code_hash(code) + (f"({stable_repr(closure, depth + 1)})"
                                        if closure else "")
        elif code is not None and module == MAIN_SCRIPT:
            name += _code_hash(code)
        if isinstance(fn, types.MethodType):
            name += f" of {stable_repr(fn.__self__, depth + 1)}"
        return name
    if isinstance(fn, types.BuiltinFunctionType):
        return f"{module}.{fn.__qualname__}"
    cls = type(fn)
    state = getattr(fn, "__dict__", None)
    shown = f"({stable_repr(state, depth + 1)})" if state else ""
    return f"{_module_identity(cls.__module__)}.{cls.__qualname__}{shown}"


def _cell_ok(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _wants_ctx(fn: Callable) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


def _check_int(op: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ZephonConfigError(f"{op}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class Op:
    kind = "op"
    stateless = True
    parallelism = 1
    preserves_cursor_order = True
    batch_shape_sensitive = False

    @property
    def name(self) -> str:
        return self.kind

    def describe(self) -> str:
        return self.name


class MapOp(Op):
    kind = "map"

    def __init__(self, fn: Callable, parallelism: int = 1) -> None:
        if not callable(fn):
            raise ZephonConfigError(f"map: fn must be callable, got {fn!r}")
        self.fn, self.parallelism = fn, _check_int("map", "parallelism", parallelism, 1)
        self.with_ctx = _wants_ctx(fn)

    @property
    def name(self) -> str:
        return f"{self.kind}({fn_name(self.fn)})"

    def describe(self) -> str:
        return f"{self.kind}({fn_identity(self.fn)})"

    def apply_one(self, r: Record, seed: int) -> Record | None:
        """This op on one record: its output record, or None when the sample is dropped.
        A stage runs each sample through all of its ops before the next sample
        (:class:`~zephon.pipeline.program.StageProgram`)."""
        try:
            value = self.fn(r.value, OpContext(r.ids[0], seed)) if self.with_ctx \
                else self.fn(r.value)
        except Exception as exc:
            raise _op_error(self, r, exc) from exc
        return Record(value, r.ids, r.pos, r.lin)


class FilterOp(MapOp):
    kind = "filter"

    def apply_one(self, r: Record, seed: int) -> Record | None:
        try:
            keep = self.fn(r.value, OpContext(r.ids[0], seed)) if self.with_ctx \
                else self.fn(r.value)
        except Exception as exc:
            raise _op_error(self, r, exc) from exc
        return r if keep else None


class MapBatchOp(MapOp):
    kind = "map_batch"
    batch_shape_sensitive = True

    def apply_one(self, r: Record, seed: int) -> Record | None:
        try:
            value = self.fn(r.value)
        except Exception as exc:
            raise _op_error(self, r, exc) from exc
        if isinstance(r.value, Batch) and isinstance(value, dict) and \
                not isinstance(value, Batch):
            value = Batch(value, meta=r.value.meta)
        elif isinstance(r.value, BatchList) and type(value) is list:
            value = BatchList(value, meta=r.value.meta)
        return Record(value, r.ids, r.pos, r.lin)


def _op_error(op: Op, record: Record, exc: BaseException) -> OpError:
    sample = record.ids[0] if len(record.ids) == 1 else list(record.ids)  # a plain list
    shown = sample if not isinstance(sample, list) or len(sample) <= 4 else \
        f"[{sample[0]}, ..., {sample[-1]}] ({len(sample)} samples)"
    return OpError(f"op {op.name} failed on sample {shown}: {type(exc).__name__}: {exc}",
                   op=op.name, sample_id=sample)


# -- accumulators ----------------------------------------------------------------------------

def _pos_lineage(record: Record) -> Any:
    """The lineage of a sample record (or of a fused batch: the lane positions up to its
    ``pos``): its lane position."""
    return record.pos


def _made_lineage(record: Record) -> Any:
    """The lineage of a record an accumulator made: what it recorded on ``lin``."""
    return record.lin


class ShuffleOp(Op):
    kind = "shuffle"
    stateless = False
    preserves_cursor_order = False

    def __init__(self, buffer_size: int) -> None:
        self.buffer_size = _check_int("shuffle", "buffer_size", buffer_size, 1)

    def describe(self) -> str:
        return f"shuffle({self.buffer_size})"

    def start(self, seed: int, lane: int, boundary: Boundary) -> "_ShuffleState":
        return _ShuffleState(self.buffer_size, seed, lane, boundary)


class _ShuffleState:
    """A seeded shuffle buffer: drains at every boundary and restarts with a generator
    seeded from it, so it never holds anything across one (no carry)."""

    carries = False

    def __init__(self, size: int, seed: int, lane: int, boundary: Boundary) -> None:
        self.size, self.seed, self.lane = size, seed, lane
        self.rng = self._rng(boundary)
        self.buf: list = []

    def _rng(self, boundary: Boundary) -> np.random.Generator:
        return np.random.default_rng([self.seed, 0x5F, self.lane, boundary.epoch, boundary.k])

    def push(self, records: list) -> list:
        out, buf = [], self.buf
        for r in records:
            if len(buf) < self.size:
                buf.append(r)
                continue
            j = int(self.rng.integers(self.size))
            out.append(buf[j])
            buf[j] = r
        return out

    def boundary(self, marker: Boundary) -> list:
        out = self.drain()
        self.rng = self._rng(marker)
        return out

    def drain(self) -> list:
        order = self.rng.permutation(len(self.buf))
        out = [self.buf[j] for j in order]
        self.buf = []
        return out


def make_batch(records: list, collate_fn: Callable | None = None) -> Record:
    """One batch record of ``records``: their values collated (by ``collate_fn``, else
    :func:`~zephon.pipeline.collate.collate`), their sample ids in ``meta["sample_ids"]``;
    it ends where the last record ends. A plain dict becomes a :class:`Batch`, a plain list
    a :class:`BatchList`; any other value (a namedtuple, an array) is the batch as it is,
    without ``meta``. A failure is an :class:`OpError` of the ``batch`` op naming the
    batch's samples."""
    ids = [i for r in records for i in r.ids]
    try:
        value = (collate_fn or collate)([r.value for r in records])
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


class BatchOp(Op):
    kind = "batch"
    stateless = False

    def __init__(self, microbatch_size: int, drop_last: bool = False,
                 collate_fn: Callable | None = None) -> None:
        self.size = _check_int("batch", "microbatch_size", microbatch_size, 1)
        if not isinstance(drop_last, bool):
            raise ZephonConfigError(f"batch: drop_last must be True or False, got {drop_last!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise ZephonConfigError(f"batch: collate_fn must be callable or None, got "
                                    f"{collate_fn!r}")
        self.drop_last, self.collate_fn = drop_last, collate_fn

    def describe(self) -> str:
        fn = "" if self.collate_fn is None else f", collate_fn={fn_identity(self.collate_fn)}"
        return f"batch({self.size}, drop_last={self.drop_last}{fn})"

    def start(self, seed: int, lane: int, boundary: Boundary) -> "_BatchState":
        return _BatchState(self.size, self.drop_last, self)

    def make(self, records: list) -> Record:
        """The batch record of ``records`` (what a full batch, or the last one, is)."""
        return make_batch(records, self.collate_fn)


class _BatchState:
    """Fills batches of exactly ``size`` records; what it holds at a boundary stays (it is
    the boundary's carry), so only the stream's last batch can be short."""

    carries = True

    def __init__(self, size: int, drop_last: bool, op: BatchOp) -> None:
        self.size, self.drop_last, self.op = size, drop_last, op
        self.buf: list = []
        #: lineage of an input record (set by the engine), and whether a batch it makes must
        #: record its members' lineage (a later accumulator may hold it at a boundary)
        self.lineage: Callable[[Record], Any] = _pos_lineage
        self.tracks = False

    def _make(self, records: list) -> Record:
        out = self.op.make(records)
        if self.tracks:
            out.lin = [self.lineage(r) for r in records]
        return out

    def push(self, records: list) -> list:
        out = []
        for r in records:
            self.buf.append(r)
            if len(self.buf) == self.size:
                out.append(self._make(self.buf))
                self.buf = []
        return out

    def boundary(self, marker: Boundary) -> list:
        return []

    def carry(self) -> list:
        return [self.lineage(r) for r in self.buf]

    def load(self, records: list) -> None:
        self.buf = list(records)

    def drain(self) -> list:
        buf, self.buf = self.buf, []
        if not buf or self.drop_last:
            return []
        return [self._make(buf)]


class PackTokensOp(Op):
    kind = "pack_tokens"
    stateless = False
    preserves_cursor_order = False

    def __init__(self, seq_len: int, field: str = "tokens", drop_remainder: bool = False) -> None:
        self.seq_len = _check_int("pack_tokens", "seq_len", seq_len, 1)
        if not isinstance(field, str) or not field:
            raise ZephonConfigError(f"pack_tokens: field must be a non-empty string, got {field!r}")
        if not isinstance(drop_remainder, bool):
            raise ZephonConfigError(f"pack_tokens: drop_remainder must be True or False, got "
                                    f"{drop_remainder!r}")
        self.field, self.drop_remainder = field, drop_remainder

    def describe(self) -> str:
        tail = ", drop_remainder=True" if self.drop_remainder else ""
        return f"pack_tokens({self.seq_len}, {self.field!r}{tail})"

    def start(self, seed: int, lane: int, boundary: Boundary) -> "_PackState":
        return _PackState(self)

    def tokens(self, record: Record) -> np.ndarray:
        """The flat token array of an input record (an OpError naming the sample if it has
        no such field)."""
        try:
            return np.asarray(record.value[self.field]).reshape(-1)
        except (KeyError, TypeError, IndexError) as exc:
            raise OpError(f"op pack_tokens failed on sample {record.ids[0]}: no token field "
                          f"{self.field!r} ({exc})", op="pack_tokens",
                          sample_id=record.ids[0]) from exc


class _PackState:
    """Cuts rows of exactly ``seq_len`` tokens from the concatenated inputs; the pieces of
    an unfinished row stay across boundaries (they are the boundary's carry). A piece is
    tokens ``[a, a + len)`` of one input record: ``arrays[i]`` (a view), ``recs[i]``,
    ``starts[i]`` (parallel lists: a tuple per piece cost more than the rest of a push)."""

    carries = True

    def __init__(self, op: PackTokensOp) -> None:
        self.op, self.seq_len, self.field = op, op.seq_len, op.field
        self.arrays: list[np.ndarray] = []
        self.recs: list[Record] = []
        self.starts: list[int] = []
        self.count = 0
        self.lineage: Callable[[Record], Any] = _pos_lineage
        self.tracks = False

    def _row(self) -> Record:
        arrays, recs = self.arrays, self.recs
        row = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # one piece: a view
        ids = recs[0].ids if len(recs) == 1 else [i for r in recs for i in r.ids]
        out = Record({self.field: row}, ids, recs[-1].pos)
        if self.tracks:
            out.lin = self._pieces()
        self.arrays, self.recs, self.starts, self.count = [], [], [], 0
        return out

    def _pieces(self) -> list:
        return [(self.lineage(r), a, a + t.size)
                for t, r, a in zip(self.arrays, self.recs, self.starts, strict=True)]

    def push(self, records: list) -> list:
        out = []
        seq_len, field = self.seq_len, self.field
        for r in records:
            try:
                tokens = np.asarray(r.value[field]).reshape(-1)
            except (KeyError, TypeError, IndexError):
                tokens = self.op.tokens(r)  # raises the OpError naming the sample
            n = tokens.size
            need = seq_len - self.count
            if n < need:  # the common case: the row is not full yet
                self.arrays.append(tokens)
                self.recs.append(r)
                self.starts.append(0)
                self.count += n
                continue
            a = 0
            while n - a >= need:  # this record completes a row
                b = a + need
                self.arrays.append(tokens if a == 0 and b == n else tokens[a:b])
                self.recs.append(r)
                self.starts.append(a)
                out.append(self._row())
                a, need = b, seq_len
            if a < n:
                self.arrays.append(tokens[a:])
                self.recs.append(r)
                self.starts.append(a)
                self.count = n - a
        return out

    def boundary(self, marker: Boundary) -> list:
        return []

    def carry(self) -> list:
        return self._pieces()

    def load(self, pieces: list) -> None:
        """Put back rebuilt pieces: ``(record, a, b)`` each."""
        self.arrays = [self.op.tokens(r)[a:b] for r, a, b in pieces]
        self.recs = [r for r, _, _ in pieces]
        self.starts = [a for _, a, _ in pieces]
        self.count = sum(b - a for _, a, b in pieces)

    def drain(self) -> list:
        if not self.arrays or self.op.drop_remainder:
            self.arrays, self.recs, self.starts, self.count = [], [], [], 0
            return []
        return [self._row()]
