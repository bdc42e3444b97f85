"""webdataset: samples from WebDataset tar shards, with random access.

A sample is the run of consecutive tar members sharing a key (the member path up
to the first dot of its file name: ``a/000123.jpg`` and ``a/000123.json`` are the
sample ``a/000123``); it comes out as ``{"__key__": key, "jpg": bytes, "json":
bytes}`` (the extension after the first dot is the field; decoding is the user's
``map``). Names without an extension are skipped.

Member kinds (every other case is a SourceError naming the shard and the member,
raised when the source is built):

- regular files are read as stored;
- GNU and PAX sparse files (``tar --sparse``) are read as ``tarfile`` extracts
  them: their stored segments placed by the sparse map, the holes as zero bytes;
- a hard link, or a symbolic link whose target (relative to the link's
  directory) names a file stored *earlier in the same shard*, is read as that
  file's bytes; a link to anything else (an absolute path, a later member, a
  path outside the shard) cannot be read from the shard and is refused;
- directories are skipped; fifos, devices and unknown member types are refused.

Two members with the same key and extension in one sample are refused (naming the
shard, the key and the extension): which one is meant cannot be told. Shards
must be plain tar: a compressed shard (gzip, bzip2, xz or zstd, recognised by its
first bytes whatever its name) is refused with a message saying to decompress it,
because a sample is read at a byte offset of the shard and a compressed stream
cannot be entered at an offset without decompressing everything before it.

Index: building the source scans every shard's tar headers once (a local shard's
by seeking over the member data; a remote shard is read whole, see Integrity) and
records, per sample, its members' offsets, stored sizes and
sparse maps; reading a sample is then one positional read of the byte span
holding its members (members far apart, through links, are read one by one).
With the cache enabled, a remote shard's index is stored beside the cached shard,
so a new run over the same shards neither re-downloads nor re-scans them.

Integrity of remote shards: a remote shard is indexed by a verified scan
(:meth:`zephon.io.FileReader.scan`): read whole, once, in order (one 8 MiB block in
memory at a time), a checksum of the store recomputed from the bytes and compared
(its ETag, else an additional checksum: :class:`zephon.io.remote.ObjectChecksum`; a
mismatch reads it again, ``download_retry`` times, then is
:class:`~zephon.io.ObjectCorrupt`; an object with neither is read twice and the reads
must agree), and the
SHA-256 (first 16 bytes) of every member's stored bytes recorded
in the index (``member_digest``, pickled with the source). A streamed read of a
sample compares each member it delivers with its digest and reads again
(``download_retry`` times) on a difference, then raises a SourceError naming the
shard, the members and the bytes (the io layer's :class:`~zephon.io.ObjectCorrupt`):
a sample built from altered bytes is never delivered. A shard whose first read at
build time finds another version than listed is looked up again and indexed as the
store has it then (:meth:`WebDatasetSource._build_index`). Cached reads are verified by the cache;
local shards are indexed by their headers only and read as they are.

Shard names may use brace ranges: ``train-{000..009}.tar``.
Failures name the shard and the member: a corrupt header when building, a shard
truncated after building when the member is read.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import tarfile
from typing import Any

import numpy as np

from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.index import learn, load_detail
from zephon.io.reader import RangeDigests
from zephon.io.remote import DIGEST_SIZE, ObjectChanged, expand, is_remote
from zephon.pipeline.sources.base import FileSource, SourceError
from zephon.pipeline.sources.files import require_regular_files, sniff_codec

__all__ = ["WebDatasetSource", "brace_expand"]
log = logging.getLogger("zephon.sources")

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_PLAIN = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
_INDEX_TAG = "wdsidx"
# members [ext, offset, stored size, sparse, digest, header name or None (the member's own
# name)]; an older layout is rebuilt
_INDEX_LAYOUT = 4
# a sample's members are read in one span unless the span holds this much more than them
_SPAN_SLACK = 64 << 10


def brace_expand(pattern: str) -> list[str]:
    """``a-{00..02}.tar`` -> ``[a-00.tar, a-01.tar, a-02.tar]`` (zero padding kept)."""
    match = _BRACE.search(pattern)
    if not match:
        return [pattern]
    lo, hi = match.group(1), match.group(2)
    width = len(lo) if lo.startswith("0") else 0
    out = []
    for n in range(int(lo), int(hi) + 1):
        out.extend(brace_expand(pattern[:match.start()] + str(n).zfill(width) +
                                pattern[match.end():]))
    return out


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name, None when it has no extension."""
    directory, _, base = name.rpartition("/")
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return (f"{directory}/{stem}" if directory else stem), ext


def unsparse(stored: bytes, entry: list) -> bytes:
    """The bytes of a sparse member from its stored segments: ``entry`` is ``[real
    size, [offset, length, offset, length, ...]]`` (tarfile's sparse map, flattened)."""
    real, flat = entry
    out = bytearray(real)
    pos = 0
    for k in range(0, len(flat), 2):
        at, n = flat[k], flat[k + 1]
        out[at:at + n] = stored[pos:pos + n]
        pos += n
    return bytes(out)


def _kind(info: tarfile.TarInfo) -> str:
    for test, word in ((info.ischr, "a character device"), (info.isblk, "a block device"),
                       (info.isfifo, "a fifo")):
        if test():
            return word
    return f"of unknown type {info.type!r}"


class _ShardIndex:
    """The index of one shard as its headers are scanned (see :func:`index_tar`)."""

    def __init__(self, shard: str, size: int, digest_range=None) -> None:
        self.shard, self.size = shard, size
        self.digest_range = digest_range  # ScanFile.digest_range of a verified scan, or None
        self.keys: list[str] = []
        self.members: list[list] = []
        self.files: dict[str, list] = {}  # normalised name -> [offset, stored, sparse]
        self.exts: set[str] = set()       # the extensions of the current sample
        self.last = "(start of the shard)"

    def fail(self, info: tarfile.TarInfo, what: str) -> SourceError:
        return SourceError(f"webdataset: {self.shard}: member {info.name!r} {what}")

    def slot(self, offset: int, stored: int) -> int | None:
        """The scan's digest slot of a member's stored bytes (None: not digested)."""
        return None if self.digest_range is None else self.digest_range(offset, offset + stored)

    def stored(self, info: tarfile.TarInfo) -> list:
        """[offset, stored size, sparse entry or None, digest slot] of a regular or sparse
        member."""
        stored = info.size
        sparse = None
        pairs: Any = info.sparse  # [(offset, length), ...] in the real file
        if pairs is not None:
            flat = [int(x) for pair in pairs for x in pair]
            stored, sparse = sum(flat[1::2]), [info.size, flat]
        end = info.offset_data + stored
        if end > self.size:
            raise SourceError(f"webdataset: {self.shard}: truncated: member {info.name!r} "
                              f"ends at byte {end}, the shard has {self.size}")
        return [info.offset_data, stored, sparse, self.slot(info.offset_data, stored),
                info.name]

    def linked(self, info: tarfile.TarInfo) -> list:
        """The entry of the earlier file a hard or symbolic link names."""
        target = info.linkname
        if info.issym():
            if target.startswith("/"):
                raise self.fail(info, f"is a symbolic link to the absolute path {target!r}, "
                                      f"which is not in the shard")
            target = posixpath.join(posixpath.dirname(info.name), target)
        target = posixpath.normpath(target)
        entry = self.files.get(target)
        if entry is None:
            kind = "symbolic" if info.issym() else "hard"
            raise self.fail(info, f"is a {kind} link to {target!r}, which is not a file "
                                  f"stored earlier in this shard (a shard must hold its "
                                  f"samples' bytes)")
        return entry

    def add(self, info: tarfile.TarInfo) -> None:
        name = info.name
        if info.type in _PLAIN and info.sparse is None:  # the common case, kept short
            if info.offset_data + info.size > self.size:
                self.stored(info)  # raises: truncated
            entry = [info.offset_data, info.size, None, self.slot(info.offset_data, info.size),
                     name]
        elif info.isdir():
            return
        elif info.isreg():  # sparse files
            entry = self.stored(info)
        elif info.islnk() or info.issym():
            entry = self.linked(info)
        else:
            raise self.fail(info, f"is {_kind(info)}, not a file")
        odd = "./" in name or "//" in name or name.endswith(".")  # normpath may change it
        self.files[posixpath.normpath(name) if odd else name] = entry
        parts = split_name(info.name)
        if parts is None:
            return
        key, ext = parts
        if not self.keys or self.keys[-1] != key:
            self.keys.append(key)
            self.members.append([])
            self.exts = set()
        if ext in self.exts:
            raise SourceError(f"webdataset: {self.shard}: sample {key!r} has two members "
                              f"with extension {ext!r} (the second is {info.name!r}): "
                              f"which one is meant cannot be told")
        self.exts.add(ext)
        member = [ext, *entry]
        if member[5] == name:  # the header before the data names this member (not a link)
            member[5] = None
        self.members[-1].append(member)


def _refuse_compressed(fileobj, shard: str) -> None:
    head = fileobj.read(8)
    fileobj.seek(0)
    codec = sniff_codec(head)
    if codec is not None:
        raise SourceError(f"webdataset: {shard} is {codec}-compressed: shards are read at "
                          f"byte offsets, which a compressed stream does not allow; "
                          f"decompress it to a plain .tar (e.g. `gzip -dk` / `zstd -d`) "
                          f"and point the source at that")


def index_tar(fileobj, shard: str, size: int, digest_range=None) -> dict:
    """The sample index of one tar of ``size`` bytes: keys, per sample its members
    ``[ext, offset, stored size, sparse entry or None, digest slot or None]`` (a slot of
    ``digest_range``, a :class:`~zephon.io.ScanFile`'s, when given). tarfile stops
    quietly at a corrupt header after the first; this checks that the scan ended at
    the end-of-archive marker (or the end of the file) and that every member lies
    inside the file. Member kinds and duplicates: see the module docstring."""
    _refuse_compressed(fileobj, shard)
    index = _ShardIndex(shard, size, digest_range)
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            for info in tar:
                index.add(info)
                index.last = info.name
            stop = tar.offset
        fileobj.seek(stop)
        block = fileobj.read(512)
        if block.strip(b"\0"):
            raise SourceError(f"webdataset: {shard}: corrupt or truncated tar after member "
                              f"{index.last!r}: unreadable header at byte {stop}")
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        raise SourceError(f"webdataset: {shard}: corrupt or truncated tar after member "
                          f"{index.last!r}: {type(exc).__name__}: {exc}") from None
    return {"layout": _INDEX_LAYOUT, "keys": index.keys, "members": index.members}


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256
        return int.from_bytes(field[1:], "big")
    return int(field.split(b"\0", 1)[0].strip() or b"-1", 8)


def check_header(header: bytes, shard: str, key: str, table: "_Table", m: int,
                 store: Any) -> None:
    """``header``, the 512 bytes before member ``m``'s data, is the tar header of that
    member: it names ``m``'s stored size and ``m`` (the member's own name, ``key.ext``, or
    for a link the name of the file it links to; a name longer than the header holds must
    begin with what it holds). A member table read from the shared index that does not
    place every member where the shard has it (forged, shifted, of another shard) fails
    here, naming the index. Sparse members are not checked (their data follows a sparse
    map, not the header). The header's checksum is not summed: the name and the size
    already tie the bytes to the member, at a tenth of the cost per member."""
    want = table.header_names.get(m) or f"{key}.{table.ext[m]}"
    try:
        size = _octal(header[124:136])
    except ValueError:
        size = -2
    name = header[:100].split(b"\0", 1)[0]
    expected = want.encode("utf-8", "surrogateescape")
    if name != expected and size == int(table.size[m]):
        prefix = header[345:500].split(b"\0", 1)[0] if header[257:263] == b"ustar\0" else b""
        full = prefix + b"/" + name if prefix else name
        named = full == expected or (len(expected) >= 100 and len(full) >= 99
                                     and expected.startswith(full))
    else:
        named = name == expected
    if not named or size != int(table.size[m]):
        where = store.top if store is not None else "the index"
        raise SourceError(f"webdataset: {shard}: {where} places member {key}."
                          f"{table.ext[m]} ({int(table.size[m])} bytes) at byte "
                          f"{int(table.offset[m])}, where the shard holds no such tar member: "
                          f"the index is forged or stale; rebuild it with "
                          f"`python -m zephon index --rebuild`")


class _Table:
    """One shard's samples as :func:`index_tar` found them, in arrays: per sample its key,
    its first member (``first[j] .. first[j + 1]``) and the byte span read at once; per
    member its extension, offset, stored size, sparse map and digest (remote shards)."""

    __slots__ = ("digest", "digested", "ext", "first", "from_index", "header_names", "keys",
                 "offset", "proven", "size", "span_end", "span_start", "sparse")

    def __init__(self, index: dict, digested: bool, from_index: bool) -> None:
        #: read from the shared index, not scanned here: every read also checks the tar
        #: header before each member (see :func:`check_header`)
        self.from_index = from_index
        #: per member whose header names another file (a link), that file's name
        self.header_names: dict[int, str] = {}
        #: per member, whether this process checked its header (see :func:`check_header`)
        self.proven = np.zeros(sum(len(group) for group in index["members"]), dtype=bool)
        self.keys = index["keys"]
        first: list[int] = []
        ext: list[str] = []
        offset: list[int] = []
        size: list[int] = []
        digests = bytearray()
        self.sparse: dict[int, list] = {}
        for group in index["members"]:
            first.append(len(ext))
            for e, o, n, sparse, digest, header in group:
                if header is not None:
                    self.header_names[len(ext)] = header
                if sparse is not None:
                    self.sparse[len(ext)] = sparse
                ext.append(e)
                offset.append(o)
                size.append(n)
                digests += bytes.fromhex(digest) if digest else bytes(DIGEST_SIZE)
        first.append(len(ext))
        self.digested = digested
        self.digest = bytes(digests)  # per member, the digest of its stored bytes
        self.first = np.asarray(first, dtype=np.int64)
        self.ext = ext
        self.offset = np.asarray(offset, dtype=np.int64)
        self.size = np.asarray(size, dtype=np.int64)
        self._spans()

    def _spans(self) -> None:
        """Per sample the byte span read at once: ``[span_start, span_end)``, or
        ``span_end == -1`` when its members lie far apart (read one by one). Every
        sample has at least one member."""
        if not self.keys:
            self.span_start = self.span_end = np.zeros(0, dtype=np.int64)
            return
        groups = self.first[:-1]
        ends = self.offset + self.size
        self.span_start = np.minimum.reduceat(self.offset, groups)
        self.span_end = np.maximum.reduceat(ends, groups)
        stored = np.add.reduceat(self.size, groups)
        self.span_end[self.span_end - self.span_start > stored + _SPAN_SLACK] = -1

    def digests(self, members: range) -> RangeDigests | None:
        if not self.digested:
            return None
        d = DIGEST_SIZE
        return [(int(self.offset[m]), int(self.offset[m] + self.size[m]),
                 self.digest[m * d:(m + 1) * d]) for m in members]


class WebDatasetSource(FileSource):
    _per_process = ("_tables",)

    def __init__(self, shards, name: str, io: IoConfig = DEFAULT_IO,
                 storage_options: dict | None = None, index: Any = None) -> None:
        patterns = [shards] if isinstance(shards, (str, os.PathLike)) else list(shards)
        expanded = [p for pattern in patterns for p in brace_expand(os.fspath(pattern))]
        self.name, self.io, self.storage_options = name, io, storage_options
        self._set_files(expand(expanded, "webdataset", io, storage_options, suffixes=(".tar",)))
        require_regular_files(self.refs, "webdataset")
        self._fresh()
        learnt = learn(self, "webdataset", _INDEX_LAYOUT, self._learn_shard, index=index,
                       detail=True)
        #: per shard ``[facts, detail]``: the detail inline, or the digest of its blob in
        #: the shared index (``index_store``), read when the shard is first read
        self.shard_entries = list(learnt)
        self.index_store = learnt.store
        self.index_counts = (learnt.read, learnt.scanned)
        counts = [int(facts["samples"]) for facts, _ in self.shard_entries]
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def _fresh(self) -> None:
        super()._fresh()
        self._tables: dict[int, _Table] = {}

    def _learn_shard(self, k: int) -> tuple[dict, dict]:
        index = self._build_index(k)
        self._readers.pop(k, None)
        # scanned here: this process uses the table as it is (no header checks)
        self._tables[k] = _Table(index, self.refs[k].remote, False)
        return {"samples": len(index["keys"])}, index

    def _table(self, k: int) -> _Table:
        table = self._tables.get(k)
        if table is None:
            facts, detail = self.shard_entries[k]
            index = load_detail(self.index_store, [facts, detail], self.files[k])
            if not isinstance(index, dict) or len(index.get("keys", ())) != facts["samples"]:
                where = self.index_store.top if self.index_store is not None else "the index"
                raise SourceError(f"webdataset: {self.files[k]}: the member table {where} "
                                  f"holds does not hold the {facts['samples']} samples its "
                                  f"entry names: forged or stale; rebuild it with "
                                  f"`python -m zephon index --rebuild`")
            table = _Table(index, self.refs[k].remote, isinstance(detail, str))
            if table.from_index:
                self._check_order(k, table)
            with self._lock:
                self._tables.setdefault(k, table)
        return table

    def _build_index(self, k: int) -> dict:
        """:meth:`_shard_index`, while the source is being built: a remote shard whose
        first read finds another version than the one listed is looked up once more and
        indexed as the store has it now (the listing's answer may have been altered on its
        way, or the object replaced in between: nothing was read from it yet)."""
        try:
            return self._shard_index(k)
        except ObjectChanged as exc:
            ref = self.refs[k]
            (now,) = expand(ref.url, "webdataset", self.io, self.storage_options)
            if now == ref:
                raise
            log.warning("webdataset: %s is %s, not %s as listed (its first read found %s); "
                        "indexing it as the store has it now", ref.url, now.version,
                        ref.version, exc.now)
            self.refs[k] = now
            self._readers.pop(k, None)
            return self._shard_index(k)

    def _shard_index(self, k: int) -> dict:
        ref, reader = self.refs[k], self.reader(k)
        cache = None
        if ref.remote and self.io.cache_enabled:
            from zephon.io.cache import FileCache

            cache = FileCache(self.io, self.storage_options)
            stored = cache.get_derived(ref, _INDEX_TAG)
            if stored is not None:
                index = json.loads(stored)
                if index.get("layout") == _INDEX_LAYOUT:
                    return index
        if ref.remote:  # read whole and verified: per-member digests for streamed reads
            index, digests = reader.scan(
                lambda fh: index_tar(fh, self.files[k], ref.size, fh.digest_range),
                "building the index")
            for group in index["members"]:
                for member in group:
                    member[4] = digests[member[4]].hex()
        else:
            with reader.file_object("building the index") as fh:
                index = index_tar(fh, self.files[k], ref.size)
        if cache is not None:
            cache.put_derived(ref, _INDEX_TAG, json.dumps(index).encode())
        return index

    def _check_order(self, k: int, table: _Table) -> None:
        """A member table from the shared index places the shard's own members (all but
        links) in the shard in tar order, none twice and none overlapping: a table that
        repeats or reorders samples fails here (each member's header is checked where it
        is read: :func:`check_header`)."""
        own = np.ones(len(table.ext), dtype=bool)
        own[list(table.header_names)] = False
        starts = table.offset[own]
        ends = starts + table.size[own]
        if len(starts) and ((starts[1:] < ends[:-1] + 512).any() or starts[0] < 512
                            or ends[-1] > self.refs[k].size):
            raise SourceError(f"webdataset: {self.files[k]}: the member table "
                              f"{self.index_store.top if self.index_store else 'the index'} "
                              f"holds does not place the shard's members in tar order: "
                              f"forged or stale; rebuild it with "
                              f"`python -m zephon index --rebuild`")

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def shard_bounds(self) -> np.ndarray:
        """The tar shards: each one's samples are consecutive indices."""
        return self.shard_starts

    def _read(self, k: int, table: _Table, start: int, size: int, context: str,
              members: range = range(0)) -> bytes:
        """``size`` bytes at ``start`` of shard ``k``, the stored bytes of ``members``
        compared with their digests when the shard has them (see the module docstring)."""
        try:
            return self.reader(k).pread(start, size, context, table.digests(members))
        except SourceError as exc:
            raise SourceError(f"webdataset: {exc}") from None

    def get(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(f"webdataset: sample {i} out of range [0, {len(self)})")
        k = int(np.searchsorted(self.shard_starts, i, side="right")) - 1
        table = self._table(k)
        j = i - int(self.shard_starts[k])
        lo, hi = int(table.first[j]), int(table.first[j + 1])
        key = table.keys[j]
        sample: dict[str, Any] = {"__key__": key}
        if hi == lo:
            return sample
        start, end = int(table.span_start[j]), int(table.span_end[j])
        context = f"member {key}.{table.ext[lo]}" if hi - lo == 1 else \
            f"members {key}.{{{','.join(table.ext[lo:hi])}}}"
        # a table from the shared index is proven as it is used: each member's header too
        check = table.from_index
        pad = 512 if check else 0
        span, base = None, start - pad
        if end >= 0 and base >= 0:
            span = self._read(k, table, base, end - base, context, range(lo, hi))
        for m in range(lo, hi):
            at, n = int(table.offset[m]), int(table.size[m])
            if span is not None:
                data = span[at - base:at - base + n]
                header = span[at - base - pad:at - base]
            elif at - pad >= 0:
                data = self._read(k, table, at - pad, n + pad, f"member {key}.{table.ext[m]}",
                                  range(m, m + 1))
                header, data = data[:pad], data[pad:]
            else:
                data = header = b""
            if check and not table.proven[m] and m not in table.sparse:
                check_header(header, self.files[k], key, table, m, self.index_store)
                table.proven[m] = True  # the shard holds it there: later reads need no check
            sparse = table.sparse.get(m)
            sample[table.ext[m]] = data if sparse is None else unsparse(data, sparse)
        return sample

    def describe(self) -> str:
        names = [f if is_remote(f) else os.path.basename(f) for f in self.files]
        return f"WebDatasetSource({self.name}, shards={names}, n={len(self)})"
