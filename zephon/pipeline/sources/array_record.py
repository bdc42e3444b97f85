"""array_record: the records of ArrayRecord files, with random access by global index.

Owned here: listing ArrayRecord files (paths, globs, directories, ``name@N`` shard specs,
fsspec URLs), their record counts, and reading record ``i`` through the ArrayRecord
library (``array_record`` extra).

On disk: an ArrayRecord file is a Riegeli file (64 KiB blocks, each opened by a 24-byte
block header) of chunks; each chunk holds ``group_size`` records (the writer's option,
``group_size:1`` by default since array_record 0.5), compressed as a whole (``zstd:3``
by default; ``brotli``, ``snappy`` or ``uncompressed`` as the writer chose) and guarded
by a HighwayHash of its header and of its data. The last chunk is the footer: the file
offset of every chunk; a postscript in the last 64 KiB block points to it. TFDS and Grain
write shards as ``name.array_record-00000-of-00004``, named ``name.array_record@4``.

Sample ``i`` is the ``i``-th record over the files in order (each glob sorted; shards of
a ``name@N`` spec in shard order): ``bytes``, or ``decode(bytes)`` when a ``decode`` is
given. The record count of each file comes from its footer, read once per file through
the shared index (:func:`zephon.io.index.learn`); nothing per record is kept.

Reads: the library only opens paths, so a remote file is read from its verified local
copy (``FileReader.local_file``: the source turns the cache on for remote files). Each
process opens one ``ArrayRecordReader`` per file on first use (never pickled). A file of
``group_size:1`` is read one record per ``read(j, j + 1)`` (about 3 us: one ``pread``,
the hash check, one decompression). The library's ``read([indices])`` is not used for
those: it allocates a list per chunk of the file on every call, whatever the number of
indices (measured: 7 us at 10^3 chunks, 80 us at 10^4, 0.2-0.7 ms at 10^5), and a range
``read(a, b)`` of a few records costs more per record than single reads. A file of ``group_size > 1`` is read a chunk at
a time (one ``read(a, b)`` of the chunk's records) into a per-process LRU of decoded
chunks bounded by :data:`CHUNK_CACHE_BYTES`, so neighbouring records cost one
decompression; its shards (``shard_bounds``, for ``Pipeline(shuffle="shards")``) are its
chunks, a ``group_size:1`` file is one shard.

Reading the bytes without the library was considered and not done: a record costs ~3 us
through it, most of which (the ``pread``, the zstd decompression of the chunk) a pure
Python reader would pay too, plus the Riegeli framing (block headers splitting chunks
every 64 KiB, varint-coded record sizes, transposed chunks) and, to keep the integrity
checks, a HighwayHash in Python.

Failures: a file that is not ArrayRecord, truncated, or whose footer is corrupt is a
:class:`SourceError` naming it when the source is built; a corrupt chunk (a hash that
does not match, a compressed stream that does not decode), or a file whose record count
changed since the source was built, when the record is read (naming the file and the
record).
"""

from __future__ import annotations

import bisect
import collections
import os
import re
from typing import Any, Callable, Sequence

import numpy as np

from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.index import learn
from zephon.io.remote import expand, is_remote, require, strip_file_url
from zephon.pipeline.sources.base import FileSource, Source, SourceError, io_config, io_of

__all__ = ["CHUNK_CACHE_BYTES", "ArrayRecordSource", "array_record", "expand_specs"]

#: per-process budget of decoded chunks of ``group_size > 1`` files (least recently used out)
CHUNK_CACHE_BYTES = 64 << 20
#: reader options: no read-ahead (random access), as Grain opens its readers
_READER_OPTIONS = "readahead_buffer_size:0"
_SUFFIX = ".array_record"
_SHARD = re.compile(r"\.array_record-\d{5}-of-\d{5}$")
_SPEC = re.compile(r"^(.+)@(\d+)$")
_GROUP = re.compile(r"(?:^|,)group_size:(\d+)(?:,|$)")
_KIND, _LAYOUT = "array_record", 1


def _module():
    return require("array_record.python.array_record_module", "array_record",
                   "sources.array_record")



def _with_cache(io: IoConfig) -> IoConfig:
    """``io`` with the local cache on: the library reads only local paths."""
    if io.cache_enabled:
        return io
    kw = {name: getattr(io, name) for name in IoConfig.__slots__}
    kw["cache_enabled"] = True
    return IoConfig(**kw)


def expand_specs(paths) -> list[str]:
    """The user's ``paths`` with each ``name@N`` shard spec (one that is not an existing
    local file) replaced by its ``N`` shard names ``name-00000-of-0000N``, and each local
    directory by its ArrayRecord files (``*.array_record`` and TFDS shards), sorted.

    Examples:
        >>> expand_specs("data/train.array_record@2")
        ['data/train.array_record-00000-of-00002', 'data/train.array_record-00001-of-00002']
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for item in items:
        path = os.fspath(item)
        if not isinstance(path, str):
            raise SourceError(f"array_record: paths must be strings, got {path!r}")
        out.extend(_expand_one(path))
    return out


def _expand_one(path: str) -> list[str]:
    local = None if is_remote(path) else strip_file_url(path)
    match = _SPEC.match(path)
    if match and not (local is not None and os.path.exists(local)):
        count = int(match.group(2))
        if count <= 0:
            raise SourceError(f"array_record: {path!r}: a shard spec needs @N with N >= 1")
        return [f"{match.group(1)}-{n:05d}-of-{count:05d}" for n in range(count)]
    if local is not None and os.path.isdir(local):
        return _directory(local, path)
    return [path]


def _directory(local: str, path: str) -> list[str]:
    """The ArrayRecord files of local directory ``local`` (given as ``path``), sorted."""
    names = sorted(f for f in os.listdir(local) if f.endswith(_SUFFIX) or _SHARD.search(f))
    if not names:
        raise SourceError(f"array_record: no *.array_record file in directory {path!r}")
    return [os.path.join(local, f) for f in names]


class ArrayRecordSource(FileSource):
    """Records of ArrayRecord files (see the module docstring); build with
    :func:`array_record`."""

    _per_process = ("_ars", "_chunks", "_chunk_bytes", "_starts_list")

    def __init__(self, paths, decode: Callable[[bytes], Any] | None, name: str,
                 io: IoConfig = DEFAULT_IO, storage_options: dict | None = None,
                 index: Any = None) -> None:
        _module()
        if decode is not None and not callable(decode):
            raise SourceError(f"array_record: decode must be callable or None, got {decode!r}")
        self.decode, self.name = decode, name
        self.storage_options = storage_options
        refs = expand(expand_specs(paths), "array_record", io, storage_options,
                      suffixes=(_SUFFIX,))
        self.io = _with_cache(io) if any(r.remote for r in refs) else io
        self._set_files(refs)
        self._fresh()
        facts = learn(self, _KIND, _LAYOUT, self._scan, index=index)
        self.index_store = facts.store
        self.index_counts = (facts.read, facts.scanned)
        self.counts = np.asarray([f["records"] for f in facts], dtype=np.int64)
        self.group_sizes = np.asarray([f["group_size"] for f in facts], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        sizes = sum(r.size for r in self.refs)
        self.row_nbytes = sizes / max(1, int(self.starts[-1]))

    def _fresh(self) -> None:
        super()._fresh()
        self._ars: dict[int, Any] = {}
        self._chunks: collections.OrderedDict = collections.OrderedDict()
        self._chunk_bytes = 0
        self._starts_list: list | None = None

    def _scan(self, k: int) -> dict:
        """File ``k``'s facts: ``{"records": count, "group_size": records per chunk}``
        (its footer read by a reader opened and closed here)."""
        ar = self._open(k, "footer")
        try:
            options = ar.writer_options_string() or ""
            records = int(ar.num_records())
        finally:
            _close(ar)
            reader = self._readers.pop(k, None)
            if reader is not None:
                reader.close()
        group = _GROUP.search(options)
        return {"records": records, "group_size": int(group.group(1)) if group else 1}

    def configured(self, opts) -> Source:
        """This source under ``opts.io_options`` (the cache kept on for remote files)."""
        cfg = io_config(opts)
        if any(r.remote for r in self.refs):
            cfg = _with_cache(cfg)
        if cfg == self.io:
            return self
        clone = self.__copy__()
        clone.io = cfg
        return clone

    def _reader_of(self, k: int, context: str):
        """This process's ``ArrayRecordReader`` of file ``k`` (opened on first use)."""
        ar = self._ars.get(k)
        if ar is not None:
            return ar
        with self._lock:
            ar = self._ars.get(k)
            if ar is None:
                ar = self._ars[k] = self._open(k, context)
        return ar

    def _open(self, k: int, context: str):
        path = local = self.files[k]
        if self.refs[k].remote:  # the verified local copy (the cache pins it while open)
            try:
                local = self.reader(k).local_file(context)
            except SourceError as exc:
                raise SourceError(f"array_record: {path}, {context}: {exc}") from None
        try:
            ar = _module().ArrayRecordReader(local, _READER_OPTIONS)
            # a bad footer does not raise: the reader is built failed (num_records() 0)
            failed = None if ar.ok() else (_close(ar) or "the reader failed")
        except Exception as exc:  # noqa: BLE001 - the library raises ValueError/RuntimeError
            failed = f"{type(exc).__name__}: {exc}"
        if failed is not None:
            raise SourceError(f"array_record: {path}: not a readable ArrayRecord file "
                              f"({context}): {failed}")
        counts = getattr(self, "counts", None)
        if counts is not None and int(ar.num_records()) != int(counts[k]):
            found = int(ar.num_records())
            _close(ar)
            store = getattr(self, "index_store", None)
            read = getattr(self, "index_counts", (0, 0))[0]
            also = f"; or the shared index {store.top} it was built from is stale or forged: " \
                f"rebuild it with `python -m zephon index --rebuild`" if store and read else ""
            raise SourceError(f"array_record: {path}: has {found} records, {int(counts[k])} "
                              f"when the source was built (the file changed{also})")
        return ar

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """``(file, record in file)`` of sample ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"array_record: index {i} out of range [0, {len(self)})")
        starts = self._starts_list
        if starts is None:
            starts = self._starts_list = self.starts.tolist()
        k = bisect.bisect_right(starts, i) - 1
        return k, i - starts[k]

    def get(self, i: int) -> Any:
        k, j = self.locate(i)
        group = int(self.group_sizes[k])
        record = self._record(k, j) if group == 1 else self._chunk(k, j // group)[j % group]
        return record if self.decode is None else self.decode(record)

    def _record(self, k: int, j: int) -> bytes:
        context = f"record {j}"
        ar = self._reader_of(k, context)
        try:
            return ar.read(j, j + 1)[0]
        except Exception as exc:  # noqa: BLE001 - the library raises RuntimeError/IndexError
            raise SourceError(f"array_record: {self.files[k]}, {context}: cannot read: "
                              f"{type(exc).__name__}: {exc}") from None

    def _chunk(self, k: int, c: int) -> list:
        """The records of chunk ``c`` of file ``k`` (a ``group_size > 1`` file), from the
        per-process LRU or one range read."""
        key = (k, c)
        records = self._chunks.get(key)
        if records is not None:
            with self._lock:
                if key in self._chunks:
                    self._chunks.move_to_end(key)
            return records
        group = int(self.group_sizes[k])
        lo, hi = c * group, min((c + 1) * group, int(self.counts[k]))
        context = f"records {lo}-{hi - 1} (chunk {c})"
        ar = self._reader_of(k, context)
        try:
            records = ar.read(lo, hi)
        except Exception as exc:  # noqa: BLE001
            raise SourceError(f"array_record: {self.files[k]}, {context}: cannot read: "
                              f"{type(exc).__name__}: {exc}") from None
        nbytes = sum(len(r) for r in records) + 64 * len(records)
        with self._lock:
            if key not in self._chunks:
                self._chunks[key] = records
                self._chunk_bytes += nbytes
                while self._chunk_bytes > CHUNK_CACHE_BYTES and len(self._chunks) > 1:
                    _, old = self._chunks.popitem(last=False)
                    self._chunk_bytes -= sum(len(r) for r in old) + 64 * len(old)
        return records

    def permute_note(self) -> str | None:
        """What ``Pipeline(shuffle=True)`` costs over files of ``group_size > 1``."""
        group = int(self.group_sizes.max()) if len(self.group_sizes) else 1
        if group <= 1:
            return None
        return (f"files written with group_size up to {group}: Pipeline(shuffle=True) "
                f"decompresses a whole chunk of up to {group} records for most records it "
                "reads (unless the per-process cache of decoded chunks holds it); "
                "Pipeline(shuffle=\"shards\") visits the chunks in a seeded order and "
                "decompresses each once per window; or rewrite the files with group_size:1, "
                "as Grain and TFDS write them")

    def shard_bounds(self) -> np.ndarray:
        """One shard per file of ``group_size:1``, one per chunk of other files (a chunk
        decompresses once for all its records); files without records left out."""
        parts = [self.starts[:-1][self.group_sizes <= 1]]
        for k in np.flatnonzero(self.group_sizes > 1).tolist():
            step = int(self.group_sizes[k])
            parts.append(self.starts[k] + np.arange(0, int(self.counts[k]), step))
        return np.unique(np.concatenate([*parts, self.starts[-1:]])).astype(np.int64)

    def sample_nbytes(self) -> float | None:
        """Bytes per record on disk (the files' sizes over their records): the records'
        size for uncompressed files, less for compressed ones."""
        return self.row_nbytes

    def describe(self) -> str:
        from zephon.pipeline.fingerprint import fn_identity

        names = [f if is_remote(f) else os.path.basename(f) for f in self.files]
        decode = "bytes" if self.decode is None else fn_identity(self.decode)
        return (f"ArrayRecordSource({self.name}, files={names}, "
                f"records={self.counts.tolist()}, decode={decode})")


def _close(ar) -> str:
    """Close an ``ArrayRecordReader``; the error it had (close raises it), or ''."""
    try:
        ar.close()
    except Exception as exc:  # noqa: BLE001 - a failed reader raises its status on close
        return str(exc)
    return ""


def array_record(paths: str | Sequence[str], *, decode: Callable[[bytes], Any] | None = None,
                 name: str = "array_record", io_options=None,
                 storage_options: dict | None = None,
                 index: str | bool | None = None) -> Source:
    """The records of ArrayRecord files, with random access (``array_record`` extra).

    Sample ``i`` is the ``i``-th record over the files in order: its ``bytes``, or
    ``decode(bytes)``. Each file's record count is read from its footer once; a process
    opens each file on first use. Remote files are read from a verified local copy in
    the cache (turned on for them: the ArrayRecord library reads only local files).

    Args:
        paths: a file, a glob (sorted), a directory (its ``*.array_record`` files and
            TFDS shards ``*.array_record-NNNNN-of-NNNNN``), a shard spec
            ``name.array_record@N`` (the files ``name.array_record-00000-of-0000N`` ...
            as TFDS and Grain write them), an fsspec URL, or a list of them.
        decode: a function of a record's bytes giving the sample (picklable, for
            process workers: a module-level function); None gives the bytes.
        name: the source's name, the first part of every sample identity.
        io_options: a :class:`~zephon.StoreOptions` (caching, retries, timeouts) for the
            reads made while building the source; while iterating, the pipeline's
            ``RuntimeOptions.io_options`` govern. None: the defaults.
        storage_options: fsspec options for remote paths (endpoint, credentials).
        index: the shared index of the files' record counts (see :mod:`zephon.io.index`):
            None reads ``_zephon_index/`` beside the first file (and writes it there when
            local); a path or URL names the index directory; False: none.

    Returns:
        A :class:`Source` of one sample per record.

    Raises:
        SourceError: the ``array_record`` package is missing (the message names
            ``python -m pip install -e ".[array_record]"``), no file matches, or a file
            is not a readable ArrayRecord file (truncated, corrupt footer), naming it; a
            corrupt chunk raises it when its record is read, naming the file and record.

    Examples:
        >>> import array_record.python.array_record_module as ar  # doctest: +SKIP
        >>> writer = ar.ArrayRecordWriter("data.array_record", "group_size:1")  # doctest: +SKIP
        >>> for record in (b"hello", b"world"):  # doctest: +SKIP
        ...     writer.write(record)
        >>> writer.close()  # doctest: +SKIP
        >>> src = sources.array_record("data.array_record")  # doctest: +SKIP
        >>> len(src), src.get(1)  # doctest: +SKIP
        (2, b'world')
    """
    return ArrayRecordSource(paths, decode, name, io_of(io_options), storage_options, index)
