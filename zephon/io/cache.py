"""The local cache of remote files: atomic, shared between processes, LRU-bounded.

Layout under the cache directory (:meth:`IoConfig.cache_dir`)::

    files/<h[:2]>/<h>-<basename>        a complete copy of one remote object version
    files/<h[:2]>/<h>-<basename>.part-* a download in progress (never served)
    files/<h[:2]>/<h>-<basename>.<tag>  derived data beside it (a tar index, ...)
    locks/<n>.lock                      64 striped entry locks
    cache.lock                          the accounting/eviction lock

``h`` hashes the URL, size and version (ETag/mtime), so a changed object never
hits an old copy.

Invariants:

- *Atomic*: a download goes to a ``.part`` file in the same directory, is checked
  against the expected size, fsynced, then renamed into place. A process killed
  mid-download leaves only a ``.part`` file, which is never served and is removed
  by the next process that takes the entry's lock.
- *Shared*: the processes of one run and concurrent runs take the entry's
  ``flock`` before downloading, and look again once they hold it: an object is
  downloaded once, whoever asks first. Readers of a complete entry need no lock
  (an entry only ever appears by ``rename``).
- *LRU*: a hit touches the entry's mtime (``os.utime``); after every insertion the
  process holding ``cache.lock`` evicts the least recently used entries (and
  their derived files) until the total is at most ``cache_limit_bytes``. The entry
  just inserted is never evicted by its own insertion. A reader that already has
  an evicted file open keeps reading it (POSIX unlink semantics).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import uuid

from zephon.io.config import IoConfig
from zephon.io.errors import SourceError
from zephon.io.remote import FileRef, read_range

__all__ = ["BLOCK", "FileCache"]

log = logging.getLogger("zephon.io.cache")
BLOCK = 8 << 20  # one download request (one attempt) covers at most this many bytes
_STRIPES = 64


@contextlib.contextmanager
def _flock(path: str):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


class FileCache:
    """The cache in directory ``cfg.cache_dir()``, bounded by ``cfg.cache_limit_bytes``.

    >>> path = FileCache(cfg).fetch(ref)   # doctest: +SKIP
    """

    def __init__(self, cfg: IoConfig, storage_options: dict | None = None) -> None:
        self.cfg, self.storage_options = cfg, storage_options
        self.root = cfg.cache_dir()

    # -- naming --------------------------------------------------------------------------
    def entry_path(self, ref: FileRef) -> str:
        digest = hashlib.sha256(f"{ref.url}\0{ref.size}\0{ref.version}".encode()).hexdigest()
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in ref.basename)[-80:]
        return os.path.join(self.root, "files", digest[:2], f"{digest[:32]}-{name}")

    def _lock_path(self, entry: str) -> str:
        stripe = int(hashlib.sha256(entry.encode()).hexdigest()[:8], 16) % _STRIPES
        return os.path.join(self.root, "locks", f"{stripe}.lock")

    def _ensure_dirs(self, entry: str) -> None:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        os.makedirs(os.path.join(self.root, "locks"), exist_ok=True)

    # -- entries ---------------------------------------------------------------------------
    def fetch(self, ref: FileRef, context: str = "") -> str:
        """A local path holding the complete bytes of ``ref`` (downloaded on a miss)."""
        entry = self.entry_path(ref)
        if self._hit(entry, ref.size):
            return entry
        self._ensure_dirs(entry)
        with _flock(self._lock_path(entry)):
            if self._hit(entry, ref.size):  # another process finished it meanwhile
                return entry
            self._remove_parts(entry)
            self._download(ref, entry, context)
        self.evict(keep=entry)
        return entry

    def put_derived(self, ref: FileRef, tag: str, data: bytes) -> None:
        """Store ``data`` beside ``ref``'s entry as ``<entry>.<tag>`` (atomically); it is
        evicted with the entry."""
        entry = self.entry_path(ref)
        self._ensure_dirs(entry)
        target = f"{entry}.{tag}"
        part = f"{target}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(part, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(part, target)

    def get_derived(self, ref: FileRef, tag: str) -> bytes | None:
        target = f"{self.entry_path(ref)}.{tag}"
        try:
            with open(target, "rb") as fh:
                return fh.read()
        except OSError:
            return None

    def _hit(self, entry: str, size: int) -> bool:
        try:
            st = os.stat(entry)
        except OSError:
            return False
        if st.st_size != size:
            return False
        try:
            os.utime(entry)  # the LRU stamp
        except OSError:
            return False  # evicted between the stat and now
        return True

    def _remove_parts(self, entry: str) -> None:
        directory, base = os.path.split(entry)
        for name in os.listdir(directory):
            if name.startswith(base + ".part-"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))

    def _download(self, ref: FileRef, entry: str, context: str) -> None:
        part = f"{entry}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(part, "wb") as fh:
                for start in range(0, ref.size, BLOCK):
                    end = min(ref.size, start + BLOCK)
                    fh.write(read_range(ref, start, end, self.cfg, self.storage_options,
                                        context))
                fh.flush()
                os.fsync(fh.fileno())
            if os.path.getsize(part) != ref.size:
                raise SourceError(f"cannot cache {ref.url}: got {os.path.getsize(part)} "
                                  f"bytes, expected {ref.size}")
            os.replace(part, entry)
            with contextlib.suppress(OSError):
                dfd = os.open(os.path.dirname(entry), os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        log.debug("cached %s (%d bytes) at %s", ref.url, ref.size, entry)

    # -- eviction --------------------------------------------------------------------------
    def entries(self) -> list[tuple[float, int, str]]:
        """``(mtime, size, path)`` of every complete entry (derived files counted in)."""
        files = os.path.join(self.root, "files")
        out: dict[str, list] = {}
        derived: list[tuple[str, int]] = []
        for directory, _, names in os.walk(files):
            for name in names:
                path = os.path.join(directory, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if ".part-" in name:
                    continue
                if "." in name.split("-", 1)[-1] and self._is_derived(directory, name, names):
                    derived.append((path, st.st_size))
                else:
                    out[path] = [st.st_mtime_ns, st.st_size]
        for path, size in derived:
            base = path.rsplit(".", 1)[0]
            if base in out:
                out[base][1] += size
        return [(m, s, p) for p, (m, s) in out.items()]

    @staticmethod
    def _is_derived(directory: str, name: str, names: list) -> bool:
        return name.rsplit(".", 1)[0] in names

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used entries until the cache fits ``cache_limit_bytes``;
        returns the removed entry paths."""
        limit = self.cfg.cache_limit_bytes
        if limit is None:
            return []
        removed = []
        os.makedirs(self.root, exist_ok=True)
        with _flock(os.path.join(self.root, "cache.lock")):
            entries = sorted(self.entries())
            total = sum(size for _, size, _ in entries)
            for _, size, path in entries:
                if total <= limit:
                    break
                if path == keep:
                    continue
                with _flock(self._lock_path(path)):
                    directory, base = os.path.split(path)
                    for name in os.listdir(directory):
                        if name == base or name.startswith(base + "."):
                            with contextlib.suppress(OSError):
                                os.unlink(os.path.join(directory, name))
                total -= size
                removed.append(path)
            if total > limit:
                log.warning("cache %s holds %d bytes, above cache_limit_bytes=%d: the entry "
                            "in use is larger than the limit", self.root, total, limit)
        if removed:
            log.debug("evicted %d cache entries: %s", len(removed), removed)
        return removed
