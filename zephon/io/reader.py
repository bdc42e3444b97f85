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

Reads are exact: fewer bytes than asked (a file truncated after the source was
built) is a :class:`SourceError` naming the file and the caller's context. A read
of any size is served: ``os.pread`` returns at most 2,147,479,552 bytes per call
on Linux, so larger reads are completed in a loop.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from typing import Any

from zephon.io.config import IoConfig, is_transient
from zephon.io.errors import SourceError
from zephon.io.remote import FileRef, check_version, read_range

__all__ = ["MAX_PREAD", "FileReader", "RangeFile", "open_with_retry", "pread_exact"]

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

    def pread(self, offset: int, size: int, context: str = "") -> bytes:
        """Exactly ``size`` bytes at ``offset``, or a SourceError naming the file."""
        if self.streamed:
            if not self._checked:
                if not self.ref.conditional:
                    check_version(self.ref, self.cfg, self.storage_options, context)
                self._checked = True
            return read_range(self.ref, offset, offset + size, self.cfg, self.storage_options,
                              context)
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
