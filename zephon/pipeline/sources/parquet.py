"""parquet: rows of Parquet files with random access by global row.

Building the source reads each file's footer (its row groups and their row
counts); global row ``r`` then maps to (file, row group, row in group) by a
binary search. Reading a row decodes its whole row group (the chosen columns)
with pyarrow and keeps it in a per-process LRU of decoded row groups bounded by
``row_group_cache_bytes``, so a chunk of neighbouring rows costs one read.

``shuffle=True`` visits the row groups in a seeded order and the rows of each
group in a seeded order: a shuffled stream at the cost of sequential reads. The
group order is an array of one entry per row group; a group's row order is the
index bijection of :func:`zephon.kernels.permute_range`, computed when the group
is decoded (and per row by :meth:`ParquetSource.locate`) and never kept, so
nothing of the source's row count is held.

Failures name the file and the row group: a file whose footer cannot be read is
a :class:`SourceError` when the source is built; a row group that cannot be
decoded (a corrupt page, a file truncated after building) when it is read.
Values: see :func:`zephon.sources.parquet`.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import multiprocessing
import os
import threading
from typing import Any, Sequence

import numpy as np

from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.index import learn
from zephon.io.remote import expand, is_remote, require
from zephon.kernels import order_key, permute_range
from zephon.pipeline.sources.base import FileSource, SourceError

__all__ = ["ParquetSource"]

#: tags the key of a row group's row order (the group order keeps its NumPy permutation:
#: one entry per row group)
_ROW_ORDER_TAG = 0x9B


def _pyarrow():
    return require("pyarrow.parquet", "parquet", "sources.parquet")


class _Decoded:
    """One decoded row group, per column one of:

    - ``("array", a)``: a numeric column without nulls, a 1-D numpy array;
    - ``("fixed", a)``: a list-of-numeric column whose lists all have one length ``L``,
      an ``(rows, L)`` numpy array (row ``j`` is the view ``a[j]``);
    - ``("lists", (offsets, values))``: a ragged list-of-numeric column, int64 offsets
      (from 0) and the flat values array (row ``j`` is a view of ``values``);
    - ``("python", list)``: anything else (strings, nulls, nested), Python objects.

    Everything is numpy so that a batch of rows is a slice or a ``take``, never a
    conversion whose cost grows with the row group."""

    __slots__ = ("_plan", "columns", "nbytes", "rows")

    def __init__(self, table) -> None:
        self.rows = table.num_rows
        self.nbytes = int(table.nbytes)
        self.columns = {name: _column(table.column(name).combine_chunks())
                        for name in table.column_names}
        plan = []
        for name, (kind, data) in self.columns.items():
            if kind == "lists":
                offsets, values = data
                data = (offsets.tolist(), values)  # Python ints: cheap row slicing
            plan.append((name, kind == "lists", data))
        self._plan = plan

    def row_value(self, name: str, j: int):
        """Row ``j`` of one column, as :meth:`row` gives it."""
        kind, data = self.columns[name]
        if kind == "lists":
            offsets, values = data
            return values[offsets[j]:offsets[j + 1]]
        return data[j]

    def row(self, j: int) -> dict:
        out = {}
        for name, ragged, data in self._plan:
            if ragged:
                offsets, values = data
                out[name] = values[offsets[j]:offsets[j + 1]]
            else:
                out[name] = data[j]
        return out


def _column(col) -> tuple[str, Any]:
    """The stored form of one combined Arrow column (see :class:`_Decoded`)."""
    import pyarrow as pa

    kind = col.type
    if (pa.types.is_integer(kind) or pa.types.is_floating(kind)
            or pa.types.is_boolean(kind)) and col.null_count == 0:
        return "array", _numbers(col)
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and col.null_count == 0 and \
            (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)) \
            and col.values.null_count == 0:
        offsets = _numbers(col.offsets).astype(np.int64)
        values = _numbers(col.values)[offsets[0]:offsets[-1]]
        offsets -= offsets[0]
        lengths = np.diff(offsets)
        if len(col) and lengths.min() == lengths.max():
            return "fixed", values.reshape(len(col), int(lengths[0]))
        return "lists", (offsets, values)
    return "python", col.to_pylist()


class ParquetSource(FileSource):
    _per_process = ("_files", "_decoded", "_cache_bytes", "_decode_locks", "_last", "_starts")

    def __init__(self, paths, columns: Sequence[str] | None, name: str, shuffle: bool,
                 seed: int, row_group_cache_bytes: int, io: IoConfig = DEFAULT_IO,
                 storage_options: dict | None = None, index: Any = None) -> None:
        _pyarrow()  # a missing extra is named when the source is built
        if columns is not None:
            columns = [columns] if isinstance(columns, str) else list(columns)
        self.columns, self.name = columns, name
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.row_group_cache_bytes = int(row_group_cache_bytes)
        self.io, self.storage_options = io, storage_options
        self._set_files(expand(paths, "parquet", io, storage_options, suffixes=(".parquet",)))
        self._fresh()
        learnt = learn(self, "parquet", 1, self._learn_file, index=index)
        self.index_store = learnt.store
        self.index_counts = (learnt.read, learnt.scanned)
        group_rows, group_file, group_index = [], [], []
        group_bytes = 0  # uncompressed bytes of the chosen columns, from the footers
        for k, facts in enumerate(learnt):
            if columns is not None:
                missing = [c for c in columns if c not in facts["names"]]
                if missing:
                    raise SourceError(f"parquet: {self.files[k]} has no column(s) {missing}; "
                                      f"it has {facts['names']}")
            for g, (rows, sizes) in enumerate(facts["groups"]):
                group_rows.append(int(rows))
                group_bytes += sum(int(v) for c, v in sizes.items()
                                   if columns is None or c in columns)
                group_file.append(k)
                group_index.append(g)
        self.group_rows = np.asarray(group_rows, dtype=np.int64)
        self.group_file = np.asarray(group_file, dtype=np.int32)
        self.group_index = np.asarray(group_index, dtype=np.int32)
        order = np.arange(len(self.group_rows))
        if self.shuffle:
            order = np.random.default_rng([self.seed, 0x9A]).permutation(len(order))
        self.group_order = order  # visiting position -> global row group
        self.row_nbytes = group_bytes / max(1, int(self.group_rows.sum()))
        self.starts = np.concatenate([[0], np.cumsum(self.group_rows[order])])

    def _learn_file(self, k: int) -> dict:
        """File ``k``'s footer facts: its column names, and per row group its rows and the
        uncompressed bytes of each top-level column."""
        pq = _pyarrow()
        path = self.files[k]
        try:
            with self.reader(k).file_object("footer") as fh:
                meta = pq.ParquetFile(fh).metadata
                names = meta.schema.to_arrow_schema().names
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several classes
            raise SourceError(f"parquet: {path}: not a readable Parquet file (footer): "
                              f"{type(exc).__name__}: {exc}") from None
        groups = []
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            sizes: dict[str, int] = {}
            for c in range(group.num_columns):
                chunk = group.column(c)
                top = chunk.path_in_schema.split(".")[0]
                sizes[top] = sizes.get(top, 0) + chunk.total_uncompressed_size
            groups.append([group.num_rows, sizes])
        self.readers_done(k)
        return {"names": names, "groups": groups}

    def _check_footer(self, k: int, meta) -> None:
        """The footer a reading process opens has the row groups the source was built with
        (from the footer then, or from the shared index: one forged or stale fails here)."""
        want = self.group_rows[np.flatnonzero(self.group_file == k)].tolist()
        have = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        if have != want:
            where = f"the shared index {self.index_store.top}" \
                if self.index_store is not None and self.index_counts[0] else "its footer"
            raise SourceError(f"parquet: {self.files[k]}: has row groups of {have} rows, "
                              f"{where} said {want} when the source was built (the file "
                              f"changed, or the index is forged or stale: rebuild it with "
                              f"`python -m zephon index --rebuild`)")

    def readers_done(self, k: int) -> None:
        """Builder: drop the reader of file ``k`` (the footer pass keeps nothing open)."""
        reader = self._readers.pop(k, None)
        if reader is not None:
            reader.close()

    def _fresh(self) -> None:
        super()._fresh()
        self._files: dict[int, Any] = {}
        self._decoded: collections.OrderedDict = collections.OrderedDict()
        self._cache_bytes = 0
        self._last: tuple | None = None  # (first row, end row, group, decoded) of the last get
        self._starts: list | None = None
        self._decode_locks: dict[int, threading.Lock] = collections.defaultdict(threading.Lock)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, i: int) -> tuple[int, int, int]:
        """(file index, row group in file, row in group) of source row ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"parquet: row {i} out of range [0, {len(self)})")
        pos = int(np.searchsorted(self.starts, i, side="right")) - 1
        g = int(self.group_order[pos])
        j = i - int(self.starts[pos])
        if self.shuffle:
            j = int(permute_range(int(self.group_rows[g]), self._row_key(g), j, j + 1)[0])
        return int(self.group_file[g]), int(self.group_index[g]), j

    def _row_group(self, g: int) -> _Decoded:
        decoded = self._decoded.get(g)
        if decoded is not None:
            with self._lock:
                if g in self._decoded:
                    self._decoded.move_to_end(g)
            return decoded
        with self._decode_locks[g]:  # one decode per group even with many threads
            decoded = self._decoded.get(g)
            if decoded is not None:
                return decoded
            decoded = self._decode(g)
            with self._lock:
                self._decoded[g] = decoded
                self._cache_bytes += decoded.nbytes
                while self._cache_bytes > self.row_group_cache_bytes and len(self._decoded) > 1:
                    _, old = self._decoded.popitem(last=False)
                    self._cache_bytes -= old.nbytes
        return decoded

    def _decode(self, g: int) -> _Decoded:
        pq = _pyarrow()
        k, rg = int(self.group_file[g]), int(self.group_index[g])
        path = self.files[k]
        context = f"row group {rg}"
        try:
            pf = self._files.get(k)
            if pf is None:
                with self._lock:
                    pf = self._files.get(k)
                    if pf is None:
                        reader = self.reader(k)
                        local = reader.local_path(context)
                        if local is not None:
                            import pyarrow as pa

                            source = pa.memory_map(local, "r")
                        else:
                            source = reader.file_object(context)
                        pfile = pq.ParquetFile(source)
                        self._check_footer(k, pfile.metadata)
                        pf = self._files[k] = (pfile, threading.Lock())
            pfile, lock = pf
            with lock:
                table = pfile.read_row_group(rg, columns=self.columns,
                                             use_threads=_decode_threads())
        except SourceError as exc:
            raise SourceError(f"parquet: {path}, {context}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several classes
            raise SourceError(f"parquet: {path}, {context}: cannot decode: "
                              f"{type(exc).__name__}: {exc}") from None
        if table.num_rows != int(self.group_rows[g]):
            raise SourceError(f"parquet: {path}, {context}: has {table.num_rows} rows, the "
                              f"footer said {int(self.group_rows[g])} when the source was "
                              f"built (or the shared index did: forged or stale; rebuild "
                              f"it with `python -m zephon index`)")
        try:
            if self.shuffle:  # the rows in their seeded order once: a batch is then a slice
                table = table.take(self._row_order(g))
            return _Decoded(table)
        except Exception as exc:  # noqa: BLE001
            raise SourceError(f"parquet: {path}, {context}: cannot convert: "
                              f"{type(exc).__name__}: {exc}") from None

    def get(self, i: int) -> Any:
        # Fast path: the row group of the previous call (neighbouring rows share it).
        last = self._last
        if last is not None and last[0] <= i < last[1]:
            lo, _, g, decoded = last
            return decoded.row(i - lo)
        if not 0 <= i < len(self):
            raise IndexError(f"parquet: row {i} out of range [0, {len(self)})")
        pos = bisect.bisect_right(self._starts_list(), i) - 1
        g = int(self.group_order[pos])
        lo = int(self.starts[pos])
        decoded = self._row_group(g)
        self._last = (lo, int(self.starts[pos + 1]), g, decoded)
        return decoded.row(i - lo)

    def get_batch(self, indices) -> dict | None:
        """Rows ``indices`` collated, read column by column (see :meth:`Source.get_batch`).

        A run of consecutive rows (a sequential pipeline's micro-batch) is a slice of one
        or two decoded row groups, any other set one ``take`` per row group: numeric
        columns and fixed-length numeric lists come out as one array each, copied out of
        the cache; other columns go through the same rule as ``batch()``."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return None
        if idx.min() < 0 or idx.max() >= len(self):
            raise IndexError(f"parquet: rows out of range [0, {len(self)})")
        parts = self._parts(idx)
        n = idx.size
        out: dict = {}
        for name in parts[0][0].columns:
            forms = [d.columns[name] for d, _, _ in parts]
            out[name] = _gather(name, forms, parts, n)
        return out

    def _parts(self, idx: np.ndarray) -> list[tuple]:
        """``(decoded row group, rows in it, places in the batch)`` covering ``idx``; rows
        and places are slices for a run of consecutive source rows, index arrays else."""
        n = idx.size
        first, last = int(idx[0]), int(idx[-1])
        if last - first == n - 1 and (n == 1 or bool((np.diff(idx) == 1).all())):
            starts, i = self._starts_list(), first
            parts: list[tuple] = []
            while i <= last:
                pos = bisect.bisect_right(starts, i) - 1
                lo, end = starts[pos], min(starts[pos + 1], last + 1)
                g = int(self.group_order[pos])
                rows: Any = slice(i - lo, end - lo)
                parts.append((self._row_group(g), rows, slice(i - first, end - first)))
                i = end
            return parts
        return self._scattered_parts(idx)

    def _scattered_parts(self, idx: np.ndarray) -> list[tuple]:
        """:meth:`_parts` of any set of rows: one ``take`` per row group."""
        positions = np.searchsorted(self.starts, idx, side="right") - 1
        # One stable sort groups the batch's rows by row group (in batch order within a
        # group); each part is then a slice of it, not a scan of the whole batch per group.
        order = np.argsort(positions, kind="stable")
        grouped = positions[order]
        cuts = np.flatnonzero(grouped[1:] != grouped[:-1]) + 1
        bounds = [0, *cuts.tolist(), len(order)]
        starts = self._starts_list()
        parts: list[tuple] = []
        for a, b in itertools.pairwise(bounds):
            where = order[a:b]
            p = int(grouped[a])
            g = int(self.group_order[p])
            rows = idx[where] - starts[p]
            parts.append((self._row_group(g), rows, where))
        return parts

    def _starts_list(self) -> list:
        starts = self._starts
        if starts is None:
            starts = self._starts = self.starts.tolist()
        return starts

    def _row_order(self, g: int) -> np.ndarray:
        """The seeded order of the rows of row group ``g`` (shuffle=True): position ``j`` of
        the group holds its row ``order[j]`` (a decoded group is stored in this order).
        Computed when the group is decoded and not kept: a bijection evaluated per
        position (:func:`zephon.kernels.permute_range`), so that no process ever holds an
        order per row of the source."""
        return permute_range(int(self.group_rows[g]), self._row_key(g), 0,
                             int(self.group_rows[g]))

    def _row_key(self, g: int) -> int:
        return order_key(self.seed, _ROW_ORDER_TAG, g)

    def shard_bounds(self) -> np.ndarray:
        """The row groups, in their visiting order: each decodes once for all its rows."""
        return self.starts.astype(np.int64)

    def permute_note(self) -> str | None:
        """Pipeline(shuffle=True) draws each batch's rows from all over the files."""
        decoded = self.row_nbytes * len(self)
        fits = decoded <= self.row_group_cache_bytes
        return ("Pipeline(shuffle=True) draws each batch's rows from all over the "
                f"{len(self.group_rows)} row groups: a batch gathers from many of them "
                "(about 10x slower than in order on a 4M-row corpus)"
                + ("" if fits else f"; the chosen columns (~{decoded / 2**20:.0f} MiB "
                   f"decoded) exceed row_group_cache_bytes ({self.row_group_cache_bytes >> 20}"
                   " MiB), so most rows cost a row-group decode")
                + ". Pipeline(shuffle=\"shards\") (row groups in a seeded order, "
                "rows shuffled within windows of them), or sources.parquet(..., "
                "shuffle=True) with Pipeline(shuffle=False), shuffles at the cost of "
                "reading in order")

    def sample_nbytes(self) -> float | None:
        """Uncompressed bytes per row of the chosen columns, as the footers give them."""
        return self.row_nbytes

    def describe(self) -> str:
        names = [f if is_remote(f) else os.path.basename(f) for f in self.files]
        return (f"ParquetSource({self.name}, files={names}, rows={len(self)}, "
                f"row_groups={len(self.group_rows)}, columns={self.columns}, "
                f"shuffle={self.shuffle}, seed={self.seed})")


def _decode_threads() -> bool:
    """Whether pyarrow may decode a row group's columns on its thread pool: in the main
    process yes; in a child process (a worker of a process stage) no, because its
    sibling workers already use the cores and a pool per worker only adds contention
    (2 workers read a 4M-row corpus in 0.65-0.75 s with one thread each, 0.77-0.94 s with
    pyarrow's pool)."""
    return multiprocessing.parent_process() is None


def _numbers(arr) -> np.ndarray:
    """A null-free numeric or boolean Arrow array as numpy, read from its data buffer
    (``Array.to_numpy`` would import pandas, a second or so in every worker)."""
    import pyarrow as pa

    kind, n, data = arr.type, len(arr), arr.buffers()[1]
    if pa.types.is_boolean(kind):
        bits = np.frombuffer(data, dtype=np.uint8) if data is not None else \
            np.zeros(0, np.uint8)
        return np.unpackbits(bits, bitorder="little")[arr.offset:arr.offset + n].astype(bool)
    if pa.types.is_floating(kind):
        dtype = np.dtype(f"f{kind.bit_width // 8}")
    else:
        signed = pa.types.is_signed_integer(kind)
        dtype = np.dtype(f"{'i' if signed else 'u'}{kind.bit_width // 8}")
    if data is None or n == 0:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=n, offset=arr.offset * dtype.itemsize)


def _positions(index) -> list:
    """A slice or an index array as a list of ints."""
    if isinstance(index, slice):
        return list(range(index.start, index.stop))
    return index.tolist()


def _gather(name: str, forms: list, parts: list, n: int):
    """Column ``name`` of a batch of ``n`` rows from its stored forms in the parts' row
    groups: one array when every part stores it as numbers of one dtype (and, for lists,
    one length), else the values row by row through ``batch()``'s rule."""
    from zephon.pipeline.collate import collate_column

    kinds = {kind for kind, _ in forms}
    kind = kinds.pop() if len(kinds) == 1 else "mixed"
    if kind in ("array", "fixed") and len({(a.dtype, a.shape[1:]) for _, a in forms}) == 1:
        first = forms[0][1]
        column = np.empty((n, *first.shape[1:]), dtype=first.dtype)
        for (_, data), (_, rows, where) in zip(forms, parts, strict=True):
            column[where] = data[rows]
        return column
    if kind == "lists":
        gathered = _gather_lists(forms, parts, n)
        if gathered is not None:
            return gathered
    values: list = [None] * n
    for (form, data), (decoded, rows, where) in zip(forms, parts, strict=True):
        if form == "python" and isinstance(rows, slice):
            values[where] = data[rows]
            continue
        for r, w in zip(_positions(rows), _positions(where), strict=True):
            values[w] = decoded.row_value(name, r)
    return collate_column(values)


def _gather_lists(forms: list, parts: list, n: int):
    """A ragged-stored numeric list column whose selected rows all have one length, as one
    ``(n, L)`` array; None if they are ragged or of mixed dtypes (then the per-row rule
    decides)."""
    length = dtype = None
    selected = []
    for (_, (offsets, values)), (_, rows, _) in zip(forms, parts, strict=True):
        begin = offsets[:-1][rows]
        sel = offsets[1:][rows] - begin
        if sel.size and (sel.min() != sel.max() or (length is not None and
                                                    sel[0] != length)):
            return None
        length = int(sel[0]) if sel.size else length
        if dtype is not None and values.dtype != dtype:
            return None
        dtype = values.dtype
        selected.append(begin)
    out = np.empty((n, length or 0), dtype=dtype)
    for (_, (_, values)), (_, _, where), begin in zip(forms, parts, selected, strict=True):
        out[where] = values[begin[:, None] + np.arange(length or 0)]
    return out
