"""parquet: rows of Parquet files with random access by global row.

Building the source reads each file's footer (its row groups and their row
counts); global row ``r`` then maps to (file, row group, row in group) by a
binary search. Reading a row decodes its whole row group (the chosen columns)
with pyarrow and keeps it in a per-process LRU of decoded row groups bounded by
``row_group_cache_bytes``, so a chunk of neighbouring rows costs one read.

``shuffle=True`` visits the row groups in a seeded order and the rows of each
group in a seeded order: a shuffled stream at the cost of sequential reads.

Failures name the file and the row group: a file whose footer cannot be read is
a :class:`SourceError` when the source is built; a row group that cannot be
decoded (a corrupt page, a file truncated after building) when it is read.
Values: see :func:`zephon.sources.parquet`.
"""

from __future__ import annotations

import bisect
import collections
import os
import threading
from typing import Any, Sequence

import numpy as np

from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.remote import expand, is_remote, require
from zephon.pipeline.sources.base import FileSource, SourceError

__all__ = ["ParquetSource"]


def _pyarrow():
    return require("pyarrow.parquet", "parquet", "sources.parquet")


class _Decoded:
    """One decoded row group: per column a numpy array, an offsets+values pair for
    list-of-numeric columns, or a Python list."""

    __slots__ = ("columns", "nbytes", "rows", "_plan")

    def __init__(self, table) -> None:
        import pyarrow as pa

        self.rows = table.num_rows
        self.nbytes = int(table.nbytes)
        self.columns = {}
        for name in table.column_names:
            col = table.column(name).combine_chunks()
            kind = col.type
            if (pa.types.is_integer(kind) or pa.types.is_floating(kind)
                    or pa.types.is_boolean(kind)) and col.null_count == 0:
                self.columns[name] = ("array", col.to_numpy(zero_copy_only=False))
            elif (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and \
                    col.null_count == 0 and (pa.types.is_integer(kind.value_type) or
                                             pa.types.is_floating(kind.value_type)) and \
                    col.values.null_count == 0:
                offsets = col.offsets.to_numpy()
                values = col.values.to_numpy(zero_copy_only=False)
                self.columns[name] = ("lists", ((offsets - offsets[0]).tolist(),
                                                values[offsets[0]:]))
            else:
                self.columns[name] = ("python", col.to_pylist())

        self._plan = [(name, kind == "lists", data) for name, (kind, data) in
                      self.columns.items()]

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


class ParquetSource(FileSource):
    _per_process = ("_files", "_decoded", "_cache_bytes", "_decode_locks", "_orders", "_last",
                    "_starts")

    def __init__(self, paths, columns: Sequence[str] | None, name: str, shuffle: bool,
                 seed: int, row_group_cache_bytes: int, io: IoConfig = DEFAULT_IO,
                 storage_options: dict | None = None) -> None:
        pq = _pyarrow()
        if columns is not None:
            columns = [columns] if isinstance(columns, str) else list(columns)
        self.columns, self.name = columns, name
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.row_group_cache_bytes = int(row_group_cache_bytes)
        self.io, self.storage_options = io, storage_options
        self._set_files(expand(paths, "parquet", io, storage_options, suffixes=(".parquet",)))
        self._fresh()
        group_rows, group_file, group_index = [], [], []
        for k, path in enumerate(self.files):
            try:
                with self.reader(k).file_object("footer") as fh:
                    meta = pq.ParquetFile(fh).metadata
                    schema = meta.schema.to_arrow_schema()
            except SourceError:
                raise
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several classes
                raise SourceError(f"parquet: {path}: not a readable Parquet file (footer): "
                                  f"{type(exc).__name__}: {exc}") from None
            if columns is not None:
                missing = [c for c in columns if c not in schema.names]
                if missing:
                    raise SourceError(f"parquet: {path} has no column(s) {missing}; it has "
                                      f"{schema.names}")
            for g in range(meta.num_row_groups):
                group_rows.append(meta.row_group(g).num_rows)
                group_file.append(k)
                group_index.append(g)
            self.readers_done(k)
        self.group_rows = np.asarray(group_rows, dtype=np.int64)
        self.group_file = np.asarray(group_file, dtype=np.int32)
        self.group_index = np.asarray(group_index, dtype=np.int32)
        order = np.arange(len(self.group_rows))
        if self.shuffle:
            order = np.random.default_rng([self.seed, 0x9A]).permutation(len(order))
        self.group_order = order  # visiting position -> global row group
        self.starts = np.concatenate([[0], np.cumsum(self.group_rows[order])])

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
        self._orders: dict[int, list] = {}
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
            j = int(self._row_order(g)[j])
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
                        pf = self._files[k] = (pq.ParquetFile(source), threading.Lock())
            pfile, lock = pf
            with lock:
                table = pfile.read_row_group(rg, columns=self.columns)
        except SourceError as exc:
            raise SourceError(f"parquet: {path}, {context}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several classes
            raise SourceError(f"parquet: {path}, {context}: cannot decode: "
                              f"{type(exc).__name__}: {exc}") from None
        if table.num_rows != int(self.group_rows[g]):
            raise SourceError(f"parquet: {path}, {context}: has {table.num_rows} rows, the "
                              f"footer said {int(self.group_rows[g])}")
        try:
            return _Decoded(table)
        except Exception as exc:  # noqa: BLE001
            raise SourceError(f"parquet: {path}, {context}: cannot convert: "
                              f"{type(exc).__name__}: {exc}") from None

    def get(self, i: int) -> Any:
        # Fast path: the row group of the previous call (neighbouring rows share it).
        last = self._last
        if last is not None and last[0] <= i < last[1]:
            lo, _, g, decoded = last
            j = i - lo
            return decoded.row(self._row_order(g)[j] if self.shuffle else j)
        if not 0 <= i < len(self):
            raise IndexError(f"parquet: row {i} out of range [0, {len(self)})")
        pos = bisect.bisect_right(self._starts_list(), i) - 1
        g = int(self.group_order[pos])
        lo = int(self.starts[pos])
        decoded = self._row_group(g)
        self._last = (lo, int(self.starts[pos + 1]), g, decoded)
        j = i - lo
        return decoded.row(self._row_order(g)[j] if self.shuffle else j)

    def get_batch(self, indices) -> dict | None:
        """Rows ``indices`` collated, read column by column (see :meth:`Source.get_batch`):
        numeric columns are one ``take`` per row group, fixed-length numeric lists one
        gather; other columns go through the same rule as ``batch()``."""
        from zephon.pipeline.ops import collate_column

        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return None
        if idx.min() < 0 or idx.max() >= len(self):
            raise IndexError(f"parquet: rows out of range [0, {len(self)})")
        pos = np.searchsorted(self.starts, idx, side="right") - 1
        parts = []  # (row group, decoded, rows within it, where in the batch)
        for p in np.unique(pos).tolist():
            where = np.nonzero(pos == p)[0]
            g = int(self.group_order[p])
            rows = idx[where] - int(self.starts[p])
            if self.shuffle:
                rows = np.asarray(self._row_order(g), dtype=np.int64)[rows]
            parts.append((self._row_group(g), rows, where))
        n = idx.size
        out: dict = {}
        for name, (kind, _) in parts[0][0].columns.items():
            if any(d.columns[name][0] != kind for d, _, _ in parts):
                kind = "python"  # row groups disagree on the column's form: row by row
            if kind == "array":
                first = parts[0][0].columns[name][1]
                column = np.empty(n, dtype=first.dtype)
                for d, rows, where in parts:
                    column[where] = d.columns[name][1][rows]
                out[name] = column
                continue
            if kind == "lists":
                gathered = self._gather_lists(parts, name, n)
                if gathered is not None:
                    out[name] = gathered
                    continue
            values: list = [None] * n
            for d, rows, where in parts:
                for r, w in zip(rows.tolist(), where.tolist()):
                    values[w] = d.row_value(name, r)
            out[name] = collate_column(values)
        return out

    @staticmethod
    def _gather_lists(parts, name, n):
        """A fixed-length numeric list column as one (n, L) array, or None if ragged or of
        mixed dtypes (then the per-row rule decides)."""
        length = dtype = None
        for d, rows, _ in parts:
            offsets, values = d.columns[name][1]
            starts = np.asarray(offsets, dtype=np.int64)
            lengths = starts[1:] - starts[:-1]
            sel = lengths[rows]
            if sel.size and (sel.min() != sel.max() or (length is not None and
                                                        sel[0] != length)):
                return None
            length = int(sel[0]) if sel.size else length
            if dtype is not None and values.dtype != dtype:
                return None
            dtype = values.dtype
        out = np.empty((n, length), dtype=dtype)
        for d, rows, where in parts:
            offsets, values = d.columns[name][1]
            begin = np.asarray(offsets, dtype=np.int64)[rows]
            out[where] = values[begin[:, None] + np.arange(length)]
        return out

    def _starts_list(self) -> list:
        starts = self._starts
        if starts is None:
            starts = self._starts = self.starts.tolist()
        return starts

    def _row_order(self, g: int) -> list:
        order = self._orders.get(g)
        if order is None:
            order = self._orders[g] = np.random.default_rng([self.seed, 0x9B, g]).permutation(
                int(self.group_rows[g])).tolist()
        return order

    def describe(self) -> str:
        names = [f if is_remote(f) else os.path.basename(f) for f in self.files]
        return (f"ParquetSource({self.name}, files={names}, rows={len(self)}, "
                f"row_groups={len(self.group_rows)}, columns={self.columns}, "
                f"shuffle={self.shuffle}, seed={self.seed})")
