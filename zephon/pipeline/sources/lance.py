"""lance: rows of a Lance dataset at a pinned version, random access by global row.

A Lance dataset is a directory (local or on an object store) of *fragments* (each one
or more ``data/*.lance`` files holding some columns of the same rows), *deletion files*
(``_deletions/``: the rows of a fragment deleted since it was written) and *manifests*
(``_versions/``: one per version, listing the fragments of that version with their row
counts and deletion files). A version never changes once written: a delete, an append
or an overwrite commits a new one.

Index space: the source pins one version when it is built (the latest, or the one
asked for) and records its number, timestamp and fragments. Sample ``i`` is the
``i``-th *live* row (deletions removed) of that version in fragment order, so it is
the same in every process and run; a version written later changes nothing. The
manifest is Lance's own index of the dataset (fragments, physical rows, deleted rows):
the source reads the counts from it and scans no data file, so it does not use the
shared index (:func:`zephon.io.index.learn`). Empty fragments (all rows deleted) are
left out; every other fragment is one shard (:meth:`LanceSource.shard_bounds`).

IO: Lance reads the dataset itself (its own object-store client, given
``storage_options``), so nothing goes through zephon's
:class:`~zephon.io.FileReader` (no zephon cache, no version-pinned ranged reads: the
pinned manifest names immutable files). ``io_options`` only set how often opening the
dataset is retried. :meth:`LanceSource.stamps` names the version (and its timestamp),
so a checkpoint's proof (:mod:`zephon.pipeline.proof`) records which version it read.

Reads: a row is read in a *block* of ``batch_rows`` neighbouring live rows of its
fragment (one scan of the fragment with an offset and a limit), decoded once
(:class:`zephon.pipeline.sources.parquet._Decoded`, the same values Parquet rows give;
fixed-size lists of numbers are read as lists, so they come out as NumPy arrays too)
and kept in a per-process LRU bounded by ``block_cache_bytes``. ``get_batch`` reads a
micro-batch column by column out of the blocks it touches.

Per-process state (the open dataset, its fragments, the decoded blocks) is dropped when
the source is pickled and rebuilt where it is read: a spawned worker reopens the
dataset at the pinned version and checks that its fragments are the recorded ones.

Failures (:class:`SourceError`, naming the dataset): a dataset or version that cannot
be opened, a missing column, and (in a worker) a pinned version that is gone or
differs from the recorded one; a block that cannot be read or decoded raises when read,
naming the fragment and its data files. Lance keeps no checksum of its pages: bytes
flipped inside a page of plain values read as other values, undetected.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import itertools
import os
import threading
import time
from typing import Any, Sequence

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.remote import is_remote, require
from zephon.pipeline.sources.base import (
    IoConfigured,
    PerProcessState,
    Source,
    SourceError,
    io_of,
)
from zephon.pipeline.sources.parquet import _Decoded, _gather

__all__ = ["DEFAULT_BATCH_ROWS", "LanceSource", "lance"]

#: live rows of one block (the unit read, decoded and cached)
DEFAULT_BATCH_ROWS = 4096
#: per-process budget of decoded blocks
DEFAULT_BLOCK_CACHE_BYTES = 256 << 20
#: rows read to estimate the bytes of a row (``sample_nbytes``)
_PROBE_ROWS = 256


def _lance():
    return require("lance", "lance", "sources.lance")


def _is_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a Rust panic surfaced by PyO3 (a BaseException, not an
    Exception): Lance panics on some corrupt pages instead of returning an error."""
    return type(exc).__name__ == "PanicException"


def _not_found(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "not found" in text or "does not exist" in text


def _normal_uri(uri) -> str:
    """A local path made absolute (workers may start elsewhere); URLs as given."""
    uri = os.fspath(uri)
    if "://" in uri:
        return uri
    return os.path.abspath(os.path.expanduser(uri))


def _check_args(version, batch_rows, block_cache_bytes) -> None:
    for what, value in (("batch_rows", 1 if batch_rows is None else batch_rows),
                        ("block_cache_bytes", block_cache_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ZephonConfigError(f"sources.lance: {what} must be an int >= 1, got "
                                    f"{value!r}")
    if version is not None and (isinstance(version, bool) or
                                not isinstance(version, (int, np.integer, str))):
        raise ZephonConfigError(f"sources.lance: version must be None, a version number or "
                                f"a tag name, got {version!r}")


def _listify(columns) -> list[str] | None:
    if columns is None:
        return None
    return [columns] if isinstance(columns, str) else [str(c) for c in columns]


def _live_rows(fragment) -> int:
    """Live rows of a fragment from its manifest entry (a fragment whose deletion file
    has no count in the manifest, written by an old Lance, is asked)."""
    meta = fragment.metadata
    deletion = meta.deletion_file
    deleted = 0 if deletion is None else deletion.num_deleted_rows
    if deleted is None:
        return int(fragment.count_rows())
    return int(meta.physical_rows) - int(deleted)


def _fragment_facts(ds) -> list[tuple[int, int, list[str], int]]:
    """``(fragment id, live rows, data file names, data file bytes)`` of every fragment
    of the open version ``ds``, in fragment order."""
    out = []
    for fragment in ds.get_fragments():
        files = fragment.metadata.files
        size = sum(int(f.file_size_bytes or 0) for f in files)
        out.append((int(fragment.fragment_id), _live_rows(fragment),
                    [str(f.path) for f in files], size))
    return out


def _auto_rows(facts: list[tuple], cache_bytes: int) -> int:
    """Rows per block when not given: :data:`DEFAULT_BATCH_ROWS`, fewer when the rows are
    wide (the data files' bytes per live row, all columns, from the manifest), so that a
    block takes at most an eighth of the cache budget (at least 16 rows)."""
    rows = sum(f[1] for f in facts)
    row_bytes = sum(f[3] for f in facts) / max(1, rows)
    fit = int(cache_bytes / 8 / max(1.0, row_bytes))
    return max(16, min(DEFAULT_BATCH_ROWS, fit))


def _layout_digest(facts: list[tuple]) -> str:
    """A digest of the fragments' ids, live rows and data files: what a reopened version
    must match."""
    h = hashlib.blake2b(digest_size=16)
    for fid, rows, files, _ in facts:
        h.update(f"{fid}\0{rows}\0{'/'.join(files)}\n".encode())
    return h.hexdigest()


def _as_lists(table):
    """``table`` with each null-free fixed-size-list-of-numbers column cast to a large
    list, so that :func:`parquet._column` stores it as an ``(rows, L)`` array."""
    import pyarrow as pa

    for k, field in enumerate(table.schema):
        kind = field.type
        if pa.types.is_fixed_size_list(kind) and (
                pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)):
            col = table.column(k)
            if col.null_count == 0:
                table = table.set_column(k, field.name,
                                         col.cast(pa.large_list(kind.value_type)))
    return table


def _nested_columns(schema, columns: list[str] | None) -> list[str]:
    """The chosen columns of a nested type (lists, structs, maps, unions): their values
    may be Python containers, which a batch collates row by row (see
    :meth:`LanceSource.get_batch`)."""
    import pyarrow as pa

    return [field.name for field in schema if pa.types.is_nested(field.type)
            and (columns is None or field.name in columns)]


def _rows_order(idx: np.ndarray) -> bool:
    """Whether ``idx`` is one run of consecutive rows."""
    n = idx.size
    return int(idx[-1]) - int(idx[0]) == n - 1 and (n == 1 or bool((np.diff(idx) == 1).all()))


class LanceSource(PerProcessState, IoConfigured):
    """The rows of one pinned version of a Lance dataset (see the module docstring)."""

    _per_process = ("_ds", "_fragments", "_decoded", "_cache_bytes", "_decode_locks",
                    "_last", "_starts", "_lock")

    def __init__(self, uri, columns: Sequence[str] | None, version, name: str,
                 io: IoConfig = DEFAULT_IO, storage_options: dict | None = None,
                 batch_rows: int | None = None,
                 block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES) -> None:
        _check_args(version, batch_rows, block_cache_bytes)
        self.uri, self.name = _normal_uri(uri), name
        self.columns = _listify(columns)
        self.io, self.storage_options = io, storage_options
        self.block_cache_bytes = int(block_cache_bytes)
        self._fresh()
        ds = self._open(version if version is None or isinstance(version, str)
                        else int(version))
        self._pin(ds, None if batch_rows is None else int(batch_rows))
        self._ds = ds
        self.row_nbytes: float | None = None

    def _pin(self, ds, batch_rows: int | None) -> None:
        """Record the version ``ds`` is at: its number, timestamp, size and fragments, and
        the rows of a block (``batch_rows``, or None: chosen from the data files)."""
        self.version = int(ds.version)
        info = ds.get_version()
        self.timestamp = info["timestamp"].isoformat()
        self.files_size = int(info.get("metadata", {}).get("total_files_size", 0) or 0)
        names = list(ds.schema.names)
        missing = [c for c in self.columns or () if c not in names]
        if missing:
            raise SourceError(f"lance: {self.uri} (version {self.version}) has no "
                              f"column(s) {missing}; it has {names}")
        #: columns that may decode to Python containers (see get_batch)
        self.nested = _nested_columns(ds.schema, self.columns)
        facts = _fragment_facts(ds)
        self.layout = _layout_digest(facts)
        kept = [f for f in facts if f[1] > 0]
        #: position among the non-empty fragments -> fragment id, live rows, data files
        self.fragment_ids = np.asarray([f[0] for f in kept], dtype=np.int64)
        self.fragment_rows = np.asarray([f[1] for f in kept], dtype=np.int64)
        self.fragment_files = [f[2] for f in kept]
        self.starts = np.concatenate([[0], np.cumsum(self.fragment_rows)]).astype(np.int64)
        self.batch_rows: int = _auto_rows(facts, self.block_cache_bytes) \
            if batch_rows is None else batch_rows
        most = int(self.fragment_rows.max()) if len(kept) else 0
        self._blocks_per_fragment = max(1, -(-most // self.batch_rows))

    # -- per-process state ------------------------------------------------------------

    def _fresh(self) -> None:
        self._lock = threading.RLock()
        self._ds = None
        self._fragments: dict[int, Any] = {}
        self._decoded: collections.OrderedDict = collections.OrderedDict()
        self._cache_bytes = 0
        self._last: tuple | None = None  # (first row, end row, decoded) of the last get
        self._starts: list | None = None
        self._decode_locks: dict[tuple, threading.Lock] = collections.defaultdict(
            threading.Lock)

    def _open(self, version):
        """``lance.dataset(uri, version)``, retried (``io.open_retry``) unless the dataset
        or version is not found; a SourceError naming both when it cannot be opened."""
        lib = _lance()
        attempts, delay, longest = self.io.open_retry
        for attempt in range(1, max(1, attempts) + 1):
            try:
                return lib.dataset(self.uri, version=version,
                                   storage_options=self.storage_options)
            except Exception as exc:  # noqa: BLE001 - Lance raises ValueError, OSError...
                if attempt >= attempts or _not_found(exc):
                    which = "the latest version" if version is None else f"version {version!r}"
                    raise SourceError(f"lance: {self.uri}: cannot open {which}: "
                                      f"{type(exc).__name__}: {exc}") from None
            time.sleep(delay)
            delay = min(longest, delay * 2 if delay else 0.0)
        raise AssertionError("unreachable")

    def _dataset(self):
        """This process's dataset handle at the pinned version (opened and checked once)."""
        ds = self._ds
        if ds is not None:
            return ds
        with self._lock:
            if self._ds is None:
                ds = self._open(self.version)
                when = ds.get_version()["timestamp"].isoformat()
                if when != self.timestamp or _layout_digest(_fragment_facts(ds)) != self.layout:
                    raise SourceError(
                        f"lance: {self.uri}: version {self.version} is not the one this "
                        f"source was built on (committed {self.timestamp}, now {when}, or "
                        "other fragments): the dataset was re-created")
                self._ds = ds
            return self._ds

    def _fragment(self, p: int):
        fragment = self._fragments.get(p)
        if fragment is None:
            fragment = self._dataset().get_fragment(int(self.fragment_ids[p]))
            if fragment is None:
                raise SourceError(f"lance: {self.uri} (version {self.version}) has no "
                                  f"fragment {int(self.fragment_ids[p])}")
            self._fragments[p] = fragment
        return fragment

    # -- blocks -------------------------------------------------------------------------

    def _block(self, p: int, b: int) -> _Decoded:
        """Block ``b`` (live rows ``b * batch_rows ...``) of fragment position ``p``."""
        key = (p, b)
        decoded = self._decoded.get(key)
        if decoded is not None:
            with self._lock:
                if key in self._decoded:
                    self._decoded.move_to_end(key)
            return decoded
        with self._decode_locks[key]:  # one read per block even with many threads
            decoded = self._decoded.get(key)
            if decoded is not None:
                return decoded
            decoded = self._decode(p, b)
            with self._lock:
                self._decoded[key] = decoded
                self._cache_bytes += decoded.nbytes
                while self._cache_bytes > self.block_cache_bytes and len(self._decoded) > 1:
                    _, old = self._decoded.popitem(last=False)
                    self._cache_bytes -= old.nbytes
        return decoded

    def _where(self, p: int, first: int, count: int) -> str:
        files = self.fragment_files[p]
        shown = ", ".join(f"data/{f}" for f in files[:4]) + (" ..." if len(files) > 4 else "")
        return (f"lance: {self.uri} (version {self.version}), fragment "
                f"{int(self.fragment_ids[p])} ({shown}), rows {first}..{first + count - 1}")

    def _read(self, p: int, first: int, count: int):
        """Live rows ``first .. first + count - 1`` of fragment position ``p`` as an Arrow
        table: one scan batch (a scan with an offset skips deleted rows as the index space
        does; faster here than ``take`` of the same rows)."""
        scanner = self._fragment(p).scanner(columns=self.columns, offset=first, limit=count,
                                            batch_size=count, batch_readahead=1)
        return scanner.to_table()

    def _decode(self, p: int, b: int) -> _Decoded:
        first = b * self.batch_rows
        count = min(self.batch_rows, int(self.fragment_rows[p]) - first)
        try:
            table = self._read(p, first, count)
        except SourceError:
            raise
        except BaseException as exc:
            if not isinstance(exc, Exception) and not _is_panic(exc):
                raise
            raise SourceError(f"{self._where(p, first, count)}: cannot read: "
                              f"{type(exc).__name__}: {_first_line(exc)}") from None
        if table.num_rows != count:
            raise SourceError(f"{self._where(p, first, count)}: read {table.num_rows} rows, "
                              f"the manifest has {count}")
        try:
            return _Decoded(_as_lists(table))
        except Exception as exc:  # noqa: BLE001
            raise SourceError(f"{self._where(p, first, count)}: cannot convert: "
                              f"{type(exc).__name__}: {exc}") from None

    # -- the Source contract ------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _starts_list(self) -> list:
        starts = self._starts
        if starts is None:
            starts = self._starts = self.starts.tolist()
        return starts

    def locate(self, i: int) -> tuple[int, int]:
        """(fragment id, live row in the fragment) of source row ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"lance: row {i} out of range [0, {len(self)})")
        p = bisect.bisect_right(self._starts_list(), i) - 1
        return int(self.fragment_ids[p]), i - int(self.starts[p])

    def get(self, i: int) -> Any:
        last = self._last  # the block of the previous call: neighbouring rows share it
        if last is not None and last[0] <= i < last[1]:
            return last[2].row(i - last[0])
        if not 0 <= i < len(self):
            raise IndexError(f"lance: row {i} out of range [0, {len(self)})")
        starts = self._starts_list()
        p = bisect.bisect_right(starts, i) - 1
        b = (i - starts[p]) // self.batch_rows
        lo = starts[p] + b * self.batch_rows
        decoded = self._block(p, b)
        self._last = (lo, lo + decoded.rows, decoded)
        return decoded.row(i - lo)

    def get_batch(self, indices) -> dict | None:
        """Rows ``indices`` collated, read column by column out of their blocks (see
        :meth:`Source.get_batch`): numbers and fixed-length numeric lists as one array per
        column, other columns through ``batch()``'s rule.

        None (the rows are then read one by one, out of the same cached blocks) when a
        column of the batch holds Python containers: a struct, a map, a list of other
        things than numbers, a numeric list with nulls. ``batch()`` collates those per
        key (a dict column keeps unequal lists as a list), which a column-wise
        collation does not reproduce."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return None
        if idx.min() < 0 or idx.max() >= len(self):
            raise IndexError(f"lance: rows out of range [0, {len(self)})")
        parts = self._run_parts(idx) if _rows_order(idx) else self._scattered_parts(idx)
        if any(d.columns[name][0] == "python" for name in self.nested for d, _, _ in parts):
            return None
        out: dict = {}
        for name in parts[0][0].columns:
            forms = [d.columns[name] for d, _, _ in parts]
            out[name] = _gather(name, forms, parts, idx.size)
        return out

    def _run_parts(self, idx: np.ndarray) -> list[tuple]:
        """``(decoded block, rows in it, places in the batch)`` of a run of consecutive
        rows: slices of the blocks it crosses."""
        starts, rows = self._starts_list(), self.batch_rows
        first, last = int(idx[0]), int(idx[-1])
        parts: list[tuple] = []
        i = first
        while i <= last:
            p = bisect.bisect_right(starts, i) - 1
            b = (i - starts[p]) // rows
            lo = starts[p] + b * rows
            end = min(starts[p + 1], lo + rows, last + 1)
            parts.append((self._block(p, b), slice(i - lo, end - lo),
                          slice(i - first, end - first)))
            i = end
        return parts

    def _scattered_parts(self, idx: np.ndarray) -> list[tuple]:
        """The parts of any set of rows: one group of rows per block (one stable sort)."""
        p = np.searchsorted(self.starts, idx, side="right") - 1
        local = idx - self.starts[p]
        b = local // self.batch_rows
        key = p * self._blocks_per_fragment + b
        order = np.argsort(key, kind="stable")
        grouped = key[order]
        cuts = np.flatnonzero(grouped[1:] != grouped[:-1]) + 1
        bounds = [0, *cuts.tolist(), len(order)]
        parts: list[tuple] = []
        for lo, hi in itertools.pairwise(bounds):
            where = order[lo:hi]
            pp, bb = divmod(int(grouped[lo]), self._blocks_per_fragment)
            parts.append((self._block(pp, bb), local[where] - bb * self.batch_rows, where))
        return parts

    def shard_bounds(self) -> np.ndarray:
        """One shard per non-empty fragment (its live rows), in fragment order."""
        return self.starts.copy()

    def sample_nbytes(self) -> float | None:
        """Decoded bytes per row of the chosen columns, measured on the first
        ``_PROBE_ROWS`` rows (read once, when first asked)."""
        if self.row_nbytes is None and len(self):
            count = min(_PROBE_ROWS, int(self.fragment_rows[0]))
            try:
                table = self._read(0, 0, count)
            except Exception:  # noqa: BLE001 - an estimate: a bad block raises when read
                return None
            self.row_nbytes = float(table.nbytes) / max(1, table.num_rows)
        return self.row_nbytes

    def permute_note(self) -> str | None:
        """Pipeline(shuffle=True) reads a block of ``batch_rows`` for each row it takes."""
        return (f"Pipeline(shuffle=True) draws each batch's rows from all over the "
                f"{len(self.fragment_ids)} fragments: each row read at random decodes its "
                f"block of {self.batch_rows} rows (kept while block_cache_bytes allows). "
                "Pipeline(shuffle=\"shards\") (fragments in a seeded order, rows shuffled "
                "within windows of them) reads each block once")

    def stamps(self, now: bool = False) -> list[tuple[str, int, str]] | None:
        """The dataset as one entry ``(uri, 0, "lance-version:<n>@<commit time>")`` (see
        :meth:`Source.stamps`): the version is what identifies the bytes (its data files'
        total is ``files_size``; the size field stays 0 so that a restore on another
        version names both versions). A version is never rewritten, so with ``now`` the
        pinned version is opened again (its manifest only): the same entry, or
        ``missing:...`` when it is gone (cleaned up, or the dataset re-created)."""
        stamp = f"lance-version:{self.version}@{self.timestamp}"
        if now:
            try:
                ds = _lance().dataset(self.uri, version=self.version,
                                      storage_options=self.storage_options)
                when = ds.get_version()["timestamp"].isoformat()
            except Exception as exc:  # noqa: BLE001 - any failure: the version is not there
                return [(self.uri, 0, f"missing:version {self.version}: "
                                      f"{_first_line(exc)[:200]}")]
            stamp = f"lance-version:{self.version}@{when}"
        return [(self.uri, 0, stamp)]

    def describe(self) -> str:
        where = self.uri if is_remote(self.uri) else os.path.basename(self.uri.rstrip("/"))
        return (f"LanceSource({self.name}, {where}, rows={len(self)}, "
                f"fragments={len(self.fragment_ids)}, columns={self.columns})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def lance(uri, *, columns: Sequence[str] | None = None, version: int | str | None = None,
          name: str = "lance", io_options=None, storage_options: dict | None = None,
          batch_rows: int | None = None,
          block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES) -> Source:
    """One dict ``{column: value}`` per live row of a Lance dataset (``lance`` extra:
    ``pylance``).

    The version is pinned when the source is built: sample ``i`` is the ``i``-th row
    (deleted rows left out) of that version in fragment order, in every process and
    run, whatever is written to the dataset afterwards; each fragment is a shard.
    Values as :func:`parquet` gives them: numeric and boolean columns NumPy scalars,
    lists and fixed-size lists of numbers NumPy arrays, strings ``str``, binaries
    ``bytes``, other types their Python value; nulls give None. Lance reads the
    dataset itself (local paths and its own object-store client), not through zephon's
    cache; a checkpoint's proof records the version.

    Args:
        uri: the dataset's directory: a local path, ``file://`` or an object-store URL
            Lance reads (``s3://``, ``gs://``, ``az://``).
        columns: the columns to read (None: all).
        version: the version to read: a number, a tag name, or None for the latest one
            (pinned when the source is built).
        name: the source's name, the first part of every sample identity.
        io_options: a :class:`~zephon.StoreOptions`: only its open retries apply (the
            attempts and back-off of opening the dataset; a missing dataset or version
            is not retried). None: the defaults.
        storage_options: Lance's object-store options (region, endpoint, credentials),
            passed to ``lance.dataset``.
        batch_rows: live rows read and decoded at once (a block); a row read at random
            costs its block. None: 4096, or fewer for wide rows (a block takes at most an
            eighth of ``block_cache_bytes``, judged from the data files' sizes).
        block_cache_bytes: per-process budget of decoded blocks (LRU).

    Returns:
        A :class:`Source` of one sample per live row.

    Raises:
        SourceError: pylance is missing (the message names ``python -m pip install -e
            ".[lance]"``), the dataset or version cannot be opened, or a column is
            missing; a worker whose pinned version is gone or re-created, or a block that
            cannot be read (a corrupt or truncated data file), raises it when read,
            naming the fragment and its data files.
        ZephonConfigError: ``batch_rows`` or ``block_cache_bytes`` is not a positive int,
            or ``version`` is neither None, an int nor a str.

    Examples:
        >>> import lance as pylance, pyarrow as pa  # doctest: +SKIP
        >>> _ = pylance.write_dataset(pa.table({"x": [1, 2, 3]}), "data.lance")  # doctest: +SKIP
        >>> src = sources.lance("data.lance", columns=["x"])  # doctest: +SKIP
        >>> len(src), src.get(2)  # doctest: +SKIP
        (3, {'x': np.int64(3)})
    """
    return LanceSource(uri, columns, version, name, io_of(io_options), storage_options,
                       batch_rows, block_cache_bytes)
