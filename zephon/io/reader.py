"""FileReader: positional reads of one input file, wherever it lives.

A reader belongs to one process (sources drop their readers when pickled and
make new ones lazily where they read) and is safe to share between threads:

- a local file is opened once (``open_retry_attempts`` tries, with back-off, for
  transient errors only: see :func:`open_with_retry`) and read with ``os.pread``;
- a remote file with the cache enabled is fetched into the
  :class:`~zephon.io.cache.FileCache` once and opened under a lease (the entry
  cannot be evicted while the reader is open), then read like a local file; its
  path (:meth:`FileReader.local_path`) stays valid until :meth:`FileReader.close`;
- a remote file with the cache disabled is read by byte range on every call
  (each request retried per ``download_retry`` / ``download_timeout_s``, pinned
  to the version the source was built on: see :mod:`.remote`).

Verified streaming: :meth:`FileReader.scan` reads a whole file once, in order and
in :data:`~zephon.io.remote.BLOCK`-sized requests (a :class:`ScanFile` that the
caller parses as it goes, holding one block in memory), and returns the
:func:`~zephon.io.remote.range_digest` of every byte range the caller named while
parsing. A streamed remote scan is checked against the object's checksum where the
store offers one (:class:`~zephon.io.remote.ObjectChecksum`, as the cache checks a
download); a mismatch, or a parse that failed on bytes that do not match, repeats
the scan up to ``download_retry`` times and then raises
:class:`~zephon.io.remote.ObjectCorrupt`. An object with no such checksum is scanned
again and used only when two scans read the same bytes (their SHA-256; up to
``download_retry + 2`` scans), or refused (``unchecked_objects='refuse'``), so digests
are only ever taken from checked or agreeing bytes. A cached file is scanned from its
checked local copy. Later,
``pread(..., digests=...)`` of a streamed file compares each named range with its
digest before returning, re-reads up to ``download_retry`` times on a difference,
and then raises :class:`~zephon.io.remote.ObjectCorrupt` naming the object, the
caller's context and the bytes; local and cached reads skip the comparison (a
cached copy was verified when it was written).

Reads are exact: fewer bytes than asked (a file truncated after the source was
built) is a :class:`SourceError` naming the file and the caller's context. A read
of any size is served: ``os.pread`` returns at most 2,147,479,552 bytes per call
on Linux, so larger reads are completed in a loop.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from zephon.io.config import IoConfig, is_transient
from zephon.io.errors import SourceError
from zephon.io.remote import (
    BLOCK,
    DIGEST_SIZE,
    FileRef,
    ObjectChecksum,
    ObjectCorrupt,
    check_version,
    fetch_range,
    range_digest,
    read_range,
    refuse_unchecked,
)

__all__ = ["MAX_PREAD", "FileReader", "RangeFile", "ScanFile", "open_with_retry",
           "pread_exact"]
T = TypeVar("T")
# (start, end, digest): bytes [start, end) of a file must have this range_digest
RangeDigests = Sequence[tuple[int, int, bytes]]

log = logging.getLogger("zephon.io")
MAX_PREAD = 0x7FFFF000  # the most bytes one read(2)/pread(2) returns on Linux


def pread_exact(fd: int, size: int, offset: int) -> bytes:
    """Up to ``size`` bytes at ``offset`` of ``fd``: fewer only at the end of the file.
    One ``os.pread`` when ``size`` fits in one call (the common case, no copy), else
    calls of at most :data:`MAX_PREAD` bytes joined."""
    if size <= MAX_PREAD:
        data = os.pread(fd, size, offset)
        if len(data) == size or not data:
            return data
        parts = [data]
    else:
        parts = []
    got = sum(len(p) for p in parts)
    while got < size:
        chunk = os.pread(fd, min(size - got, MAX_PREAD), offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def open_with_retry(path: str, mode: str, retry: tuple) -> Any:
    """``open`` with ``attempts`` tries and doubling back-off (``retry`` is
    ``(open_retry_attempts, retry_backoff_initial_s, retry_backoff_max_s)``):
    transient failures of shared file systems (a stale handle, an I/O error, too
    many open files: :func:`~zephon.io.config.is_transient`) get another chance and
    the last attempt's error is raised; a deterministic one (no such file, a
    directory, no permission, ...) is raised at once."""
    attempts, delay, longest = retry
    for attempt in range(1, attempts + 1):
        try:
            return open(path, mode)
        except OSError as exc:
            if attempt == attempts or not is_transient(exc):
                raise
            log.warning("opening %s failed (%s); attempt %d of %d in %.2f s", path, exc,
                        attempt + 1, attempts, delay)
            time.sleep(delay)
            delay = min(longest, delay * 2 if delay else 0.0)
    raise AssertionError("unreachable")


class FileReader:
    """Reads of ``ref`` under ``cfg`` (see the module docstring)."""

    def __init__(self, ref: FileRef, cfg: IoConfig, storage_options: dict | None = None) -> None:
        self.ref, self.cfg, self.storage_options = ref, cfg, storage_options
        self._lock = threading.Lock()
        self._fh: io.BufferedIOBase | None = None
        self._path: str | None = None
        self._checked = False  # streamed: the version was looked up in this process

    @property
    def streamed(self) -> bool:
        """True when reads go to the remote store each time (no local copy)."""
        return self.ref.remote and not self.cfg.cache_enabled

    def local_path(self, context: str = "") -> str | None:
        """The local file holding the data (downloading it into the cache if needed);
        None when the file is streamed."""
        if self.streamed:
            return None
        self._ensure_open(context)
        return self._path

    def local_file(self, context: str = "") -> str:
        """Like :meth:`local_path` for a reader that is not streamed: the local file's
        path; a SourceError naming the file when it is streamed (no local copy)."""
        path = self.local_path(context)
        if path is None:
            raise SourceError(f"{self.ref.url} is streamed: it has no local file")
        return path

    def _ensure_open(self, context: str) -> io.BufferedIOBase:
        """The open local file (fetched into the cache first when it is remote)."""
        if self._fh is not None:
            return self._fh
        with self._lock:
            if self._fh is not None:
                return self._fh
            if self.ref.remote:
                from zephon.io.cache import FileCache

                path, fh = FileCache(self.cfg, self.storage_options).open(self.ref, context)
            else:
                path = self.ref.url
                try:
                    fh = open_with_retry(path, "rb", self.cfg.open_retry)
                except OSError as exc:
                    raise SourceError(f"cannot open {self.ref.url}: {exc}") from None
            self._path, self._fh = path, fh
            return fh

    def _check_version_once(self, context: str) -> None:
        """Streamed: look the version up on this process's first read (unless every
        request names it: :attr:`FileRef.conditional`)."""
        if not self._checked:
            if not self.ref.conditional:
                check_version(self.ref, self.cfg, self.storage_options, context)
            self._checked = True

    def pread(self, offset: int, size: int, context: str = "",
              digests: RangeDigests | None = None) -> bytes:
        """Exactly ``size`` bytes at ``offset``, or a SourceError naming the file.

        ``digests``: ``(start, end, digest)`` ranges inside the read whose
        :func:`~zephon.io.remote.range_digest` a :meth:`scan` recorded; a streamed read
        is compared with them (see the module docstring), a local or cached one is not.
        """
        if self.streamed:
            self._check_version_once(context)
            if digests:
                return self._verified_range(offset, size, context, digests)
            return read_range(self.ref, offset, offset + size, self.cfg, self.storage_options,
                              context)
        return self._pread_local(offset, size, context)

    def _verified_range(self, offset: int, size: int, context: str,
                        digests: RangeDigests) -> bytes:
        """A streamed read whose ``digests`` ranges match, re-read on a difference."""
        attempts = self.cfg.download_retry + 1
        bad: tuple[int, int] = (offset, offset + size)
        for attempt in range(1, attempts + 1):
            data = read_range(self.ref, offset, offset + size, self.cfg, self.storage_options,
                              context)
            view = memoryview(data)
            wrong = [(lo, hi) for lo, hi, digest in digests
                     if range_digest(view[lo - offset:hi - offset]) != digest]
            if not wrong:
                return data
            bad = wrong[0]
            if attempt < attempts:
                log.warning("%s (%s): bytes %d-%d read do not match their digest; attempt %d "
                            "of %d", self.ref.url, context, bad[0], bad[1], attempt + 1,
                            attempts)
        raise ObjectCorrupt(self.ref, f"bytes {bad[0]}-{bad[1]} do not match the digest "
                                      f"recorded when the source was built (from bytes that "
                                      f"matched the object's checksum or, with none, two "
                                      f"reads that agreed)", attempts, context)

    def _fetch(self, offset: int, size: int, context: str) -> tuple[bytes, dict]:
        """``size`` bytes at ``offset`` and, streamed, the response's headers."""
        if self.streamed:
            self._check_version_once(context)
            return fetch_range(self.ref, offset, offset + size, self.cfg, self.storage_options,
                               context)
        return self._pread_local(offset, size, context), {}

    def scan(self, parse: Callable[["ScanFile"], T], context: str = "",
             block: int = BLOCK) -> tuple[T, list[bytes]]:
        """``(parse(f), digests)``: ``parse`` reads the whole file through ``f`` (a
        :class:`ScanFile`), naming ranges with ``f.digest_range``; ``digests`` are
        theirs, by slot. Verified and repeated as the module docstring says."""
        attempts = self.cfg.download_retry + 1 if self.streamed else 1
        reads: list[str] = []  # the SHA-256 of each read of an object with no checksum
        attempt, why = 0, ""
        while attempt < attempts + (1 if reads else 0):  # no checksum: two reads must agree
            attempt += 1
            scan = ScanFile(self, context, block)
            error: Exception | None = None
            try:
                result = parse(scan)
            except Exception as exc:
                if scan.failed or not scan.checked:
                    raise  # a read that failed, or a local or cached file: the parse's error
                error = exc
            verdict = self._judge(scan, reads)
            if verdict is None:
                if error is not None:
                    raise error  # the bytes are the object's: the error is the parse's
                return result, scan.digests()
            why = verdict
            more = attempt < attempts + (1 if reads else 0)
            if more and (len(reads) != 1 or scan.mismatch):
                log.warning("%s (%s): %s; reading it again, attempt %d", self.ref.url,
                            context, why, attempt + 1)
        raise ObjectCorrupt(self.ref, why, attempt, context)

    def _judge(self, scan: "ScanFile", reads: list[str]) -> str | None:
        """None when ``scan``'s bytes can be trusted: a local or cached file, bytes that
        match the store's checksum, or (no checksum) the same bytes as an earlier read in
        ``reads``; else why not (the SHA-256 of an unchecked read is added to ``reads``)."""
        if scan.altered():
            return scan.mismatch
        if not scan.checked or scan.verified():
            return None
        refuse_unchecked(self.ref, self.cfg, scan.context)
        digest = scan.whole.hexdigest()
        if digest in reads:
            log.info("%s offers no checksum zephon can check (no MD5 ETag, no additional "
                     "checksum it can compute): two reads of it agreed", self.ref.url)
            return None
        reads.append(digest)
        if len(reads) == 1:
            return "it offers no checksum zephon can check: it is read twice"
        return (f"{len(reads)} reads of it disagree (it offers no checksum zephon can "
                f"check, so two reads must agree)")

    def _pread_local(self, offset: int, size: int, context: str) -> bytes:
        fh = self._ensure_open(context)
        try:
            data = pread_exact(fh.fileno(), size, offset)
        except OSError as exc:
            where = f", {context}" if context else ""
            raise SourceError(f"{self.ref.url}{where}: cannot read {size} bytes at offset "
                              f"{offset}: {exc}") from None
        if len(data) != size:
            where = f", {context}" if context else ""
            raise SourceError(f"{self.ref.url}{where}: truncated: expected {size} bytes at "
                              f"offset {offset}, the file has {len(data)} "
                              f"(is it shorter than when the source was built?)")
        return data

    def file_object(self, context: str = ""):
        """A seekable binary file object over the data (a new one per call)."""
        path = self.local_path(context)
        if path is not None:
            return open(path, "rb")
        return io.BufferedReader(RangeFile(self), buffer_size=1 << 20)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


class RangeFile(io.RawIOBase):
    """A seekable raw file over a streamed remote object (each read one range request)."""

    def __init__(self, reader: FileReader) -> None:
        self.reader, self.pos = reader, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        size = self.reader.ref.size
        self.pos = {0: offset, 1: self.pos + offset, 2: size + offset}[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        size = self.reader.ref.size
        n = max(0, min(len(buffer), size - self.pos))
        if n == 0:
            return 0
        data = self.reader.pread(self.pos, n)
        buffer[:n] = data
        self.pos += n
        return n


class ScanFile(io.RawIOBase):
    """A forward-only file over all of ``reader``'s bytes (see :meth:`FileReader.scan`).

    It holds one block (``block`` bytes, one request when streamed); reads and seeks go
    anywhere at or after that block's start; every block passes through the object's
    checksum (streamed) and the digests of the ranges named with :meth:`digest_range`.
    """

    def __init__(self, reader: FileReader, context: str, block: int) -> None:
        self.reader, self.context, self.block = reader, context, int(block)
        self.size = reader.ref.size
        self.pos = 0
        self.start, self.data = 0, b""  # the block in hand: [start, start + len(data))
        self.checksum = ObjectChecksum(reader.ref, reader.cfg, reader.storage_options) \
            if reader.streamed else None
        self.pending: list[list] = []  # [start, end, sha256, slot] not complete yet
        self.done: list[bytes | None] = []
        self.whole = hashlib.sha256()  # of all the bytes read (streamed)
        self.mismatch: str | None = None
        self.failed = False  # a read failed (after its retries): the scan is not repeated

    @property
    def checked(self) -> bool:
        """True when the bytes are compared with the object's (a streamed scan)."""
        return self.checksum is not None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        if pos < self.start:
            raise OSError(f"{self.reader.ref.url}: a verified scan reads forward: byte {pos} "
                          f"is before the block in hand (from byte {self.start})")
        self.pos = pos
        return pos

    def readinto(self, buffer) -> int:
        self._reach(min(self.pos + 1, self.size))
        at = self.pos - self.start
        n = max(0, min(len(buffer), len(self.data) - at))
        buffer[:n] = self.data[at:at + n]
        self.pos += n
        return n

    def _reach(self, end: int) -> None:
        """Load blocks, in order, until the one in hand holds the byte before ``end``."""
        while self.start + len(self.data) < end:
            start = self.start + len(self.data)
            try:
                data, meta = self.reader._fetch(start, min(self.block, self.size - start),
                                                self.context)
            except BaseException:
                self.failed = True
                raise
            self.start, self.data = start, data
            if self.checksum is not None:
                self.checksum.update(data, meta)
                self.whole.update(data)
            self._feed()

    def _feed(self) -> None:
        """Pass the block in hand to the open ranges; close those it completes."""
        lo, hi = self.start, self.start + len(self.data)
        view = memoryview(self.data)
        for entry in self.pending:
            start, end, digest, slot = entry
            if start < hi and end > lo:
                digest.update(view[max(start, lo) - lo:min(end, hi) - lo])
            if end <= hi:
                self.done[slot] = digest.digest()[:DIGEST_SIZE]
        self.pending = [e for e in self.pending if e[1] > hi]

    def digest_range(self, start: int, end: int) -> int:
        """Name bytes ``[start, end)`` (not before the block in hand): their digest will be
        ``digests()[slot]``; returns the slot."""
        if start < self.start or end > self.size or end < start:
            raise OSError(f"{self.reader.ref.url}: bytes {start}-{end} cannot be digested by "
                          f"a forward scan at byte {self.start} of {self.size}")
        slot = len(self.done)
        self.done.append(None)
        lo, hi = self.start, self.start + len(self.data)
        digest = hashlib.sha256()
        if start < hi:
            digest.update(memoryview(self.data)[start - lo:min(end, hi) - lo])
        if end <= hi:
            self.done[slot] = digest.digest()[:DIGEST_SIZE]
        else:
            self.pending.append([start, end, digest, slot])
        return slot

    def altered(self) -> bool:
        """Read to the end and say whether the bytes are not the object's (the reason
        in :attr:`mismatch`). A read error on the way is raised."""
        self._reach(self.size)
        if self.checksum is not None:
            self.mismatch = self.checksum.mismatch()
        return self.mismatch is not None

    def verified(self) -> bool:
        """True when the bytes were compared with a checksum of the store (or come from
        the verified cache); False for a local file or a store that offers none."""
        if self.checksum is None:
            return self.reader.ref.remote
        return self.checksum.verifiable

    def digests(self) -> list[bytes]:
        """The digest of each named range, by slot (after :meth:`altered`)."""
        assert not self.pending and all(d is not None for d in self.done)
        return [d for d in self.done if d is not None]
