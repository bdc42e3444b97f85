"""Ops, the records they exchange, and the accumulators.

A lane's stream is a sequence of **units** (lists of :class:`Record`) and
:class:`Boundary` markers. A record is a value plus the identities of the
samples it came from ``(source, index, epoch)`` and ``pos``, the lane position
``(epoch, p)`` of the last sample it consumed (what cursor resume restarts
after). A Boundary ``(epoch, k)``
opens a replay segment: every accumulator drains what it holds, then restarts
with state seeded from ``(seed, lane, epoch, k)``, so a lane replayed from a
boundary reproduces its stream exactly.

Stateless ops (``map``, ``filter``, ``map_batch``) run inside a stage program,
possibly in another process, on one unit at a time. Stateful ops run serially
per lane in the engine: ``shuffle(buffer_size)`` (a seeded shuffle buffer),
``batch(microbatch_size, drop_last)`` (collates dict samples into a
:class:`Batch`; a partial batch is emitted at a boundary, or dropped with
``drop_last``) and ``pack_tokens(seq_len, field)`` (concatenates token arrays
and cuts fixed-length rows, carrying the remainder; the remainder left at a
boundary is dropped).

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
    """A value with the identities of its samples and the lane position it ends at."""

    __slots__ = ("ids", "pos", "value")
    #: a worker's shared heap may send arrays under ``value`` by reference when nothing
    #: else holds them (zephon.transport.heap.exclusive_arrays): ids and pos hold none
    __heap_walk__ = True

    def __init__(self, value: Any, ids: list, pos: tuple = (0, -1)) -> None:
        self.value, self.ids, self.pos = value, ids, pos

    def __reduce__(self):
        return (Record, (self.value, self.ids, self.pos))


class Boundary(NamedTuple):
    epoch: int
    k: int  # lane-chunk index within the epoch where the segment starts


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


class Batch(dict):
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

    @property
    def meta(self) -> dict:
        """The batch's metadata, a dict (its lists are plain lists: ``sample_ids`` are
        made when they are first read here, not for every batch that passes).

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

    def __reduce__(self):
        return (_rebuild_batch, (dict(self), self._meta))

    def __repr__(self) -> str:
        return f"Batch({dict.__repr__(self)}, meta={self.meta!r})"


def _rebuild_batch(data, meta):
    return Batch(data, meta=meta)


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
        return Record(value, r.ids, r.pos)


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
        return Record(value, r.ids, r.pos)


def _op_error(op: Op, record: Record, exc: BaseException) -> OpError:
    sample = record.ids[0] if len(record.ids) == 1 else list(record.ids)  # a plain list
    shown = sample if not isinstance(sample, list) or len(sample) <= 4 else \
        f"[{sample[0]}, ..., {sample[-1]}] ({len(sample)} samples)"
    return OpError(f"op {op.name} failed on sample {shown}: {type(exc).__name__}: {exc}",
                   op=op.name, sample_id=sample)


# -- accumulators ----------------------------------------------------------------------------

class ShuffleOp(Op):
    kind = "shuffle"
    stateless = False
    preserves_cursor_order = False

    def __init__(self, buffer_size: int) -> None:
        self.buffer_size = _check_int("shuffle", "buffer_size", buffer_size, 1)

    def describe(self) -> str:
        return f"shuffle({self.buffer_size})"

    def start(self, seed: int, lane: int, boundary: Boundary) -> "_ShuffleState":
        return _ShuffleState(self.buffer_size, np.random.default_rng(
            [seed, 0x5F, lane, boundary.epoch, boundary.k]))


class _ShuffleState:
    def __init__(self, size: int, rng: np.random.Generator) -> None:
        self.size, self.rng = size, rng
        self.buf: list = []

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

    def drain(self) -> list:
        order = self.rng.permutation(len(self.buf))
        out = [self.buf[j] for j in order]
        self.buf = []
        return out


def make_batch(records: list) -> Record:
    """One :class:`Batch` record of ``records`` (their values collated, their sample ids in
    ``meta["sample_ids"]``); it ends where the last record ends."""
    ids = [i for r in records for i in r.ids]
    return Record(Batch(collate([r.value for r in records]), meta={"sample_ids": ids}), ids,
                  records[-1].pos)


class BatchOp(Op):
    kind = "batch"
    stateless = False

    def __init__(self, microbatch_size: int, drop_last: bool = False) -> None:
        self.size = _check_int("batch", "microbatch_size", microbatch_size, 1)
        if not isinstance(drop_last, bool):
            raise ZephonConfigError(f"batch: drop_last must be True or False, got {drop_last!r}")
        self.drop_last = drop_last

    def describe(self) -> str:
        return f"batch({self.size}, drop_last={self.drop_last})"

    def start(self, seed: int, lane: int, boundary: Boundary) -> "_BatchState":
        return _BatchState(self.size, self.drop_last)


class _BatchState:
    def __init__(self, size: int, drop_last: bool) -> None:
        self.size, self.drop_last = size, drop_last
        self.buf: list = []

    def _make(self, records: list) -> Record:
        return make_batch(records)

    def push(self, records: list) -> list:
        out = []
        for r in records:
            self.buf.append(r)
            if len(self.buf) == self.size:
                out.append(self._make(self.buf))
                self.buf = []
        return out

    def drain(self) -> list:
        buf, self.buf = self.buf, []
        if not buf or self.drop_last:
            return []
        return [self._make(buf)]


class PackTokensOp(Op):
    kind = "pack_tokens"
    stateless = False
    preserves_cursor_order = False

    def __init__(self, seq_len: int, field: str = "tokens") -> None:
        self.seq_len = _check_int("pack_tokens", "seq_len", seq_len, 1)
        if not isinstance(field, str) or not field:
            raise ZephonConfigError(f"pack_tokens: field must be a non-empty string, got {field!r}")
        self.field = field

    def describe(self) -> str:
        return f"pack_tokens({self.seq_len}, {self.field!r})"

    def start(self, seed: int, lane: int, boundary: Boundary) -> "_PackState":
        return _PackState(self.seq_len, self.field)


class _PackState:
    def __init__(self, seq_len: int, field: str) -> None:
        self.seq_len, self.field = seq_len, field
        self.parts: list[np.ndarray] = []
        self.count = 0
        self.ids: list = []

    def push(self, records: list) -> list:
        out = []
        for r in records:
            try:
                tokens = np.asarray(r.value[self.field]).reshape(-1)
            except (KeyError, TypeError, IndexError) as exc:
                raise OpError(f"op pack_tokens failed on sample {r.ids[0]}: no token field "
                              f"{self.field!r} ({exc})", op="pack_tokens",
                              sample_id=r.ids[0]) from exc
            self.parts.append(tokens)
            self.count += tokens.size
            self.ids.extend(r.ids)
            if self.count >= self.seq_len:
                flat = np.concatenate(self.parts)
                rows = flat.size // self.seq_len
                for j in range(rows):
                    row = flat[j * self.seq_len:(j + 1) * self.seq_len]
                    out.append(Record({self.field: row}, list(self.ids), r.pos))
                rest = flat[rows * self.seq_len:]
                self.parts = [rest] if rest.size else []
                self.count = rest.size
                self.ids = list(r.ids) if rest.size else []
        return out

    def drain(self) -> list:
        self.parts, self.count, self.ids = [], 0, []
        return []
