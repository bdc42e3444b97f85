"""The local cache of remote files: verified, atomic, shared between processes, LRU-bounded.

Layout under the cache directory (:meth:`IoConfig.cache_dir`)::

    files/<h[:2]>/<h>-<basename>         a complete copy of one remote object version
    files/<h[:2]>/<h>-<basename>.check   what was recorded at download (see Verified)
    files/<h[:2]>/<h>-<basename>.part-*  a download in progress (never served)
    files/<h[:2]>/<h>-<basename>.<tag>   derived data beside it (a tar index, ...)
    locks/<n>.lock                       64 striped entry locks
    cache.lock                           the accounting/eviction lock

``h`` hashes the URL, size, version and version id (see
:class:`~zephon.io.remote.FileRef`), so a changed object never hits an old copy.

Invariants:

- *Trusted*: the cache uses nothing it did not write. The cache directory, ``files``,
  its subdirectories and ``locks`` are opened with ``O_NOFOLLOW`` (a symlink is
  refused, never followed) and must be directories owned by the current user and not
  writable by group or others, else :class:`SourceError` naming the directory; they
  are created with mode 0700. Every file is opened with ``O_NOFOLLOW | O_NONBLOCK``
  and used only if it is a regular file owned by the current user and not writable
  by group or others; an entry that is not (a symlink, a FIFO, a file forged by
  another user) is removed and fetched again.
- *Verified*: a download is written to a ``.part`` file while the store's checksum
  (:class:`~zephon.io.remote.ObjectChecksum`: the ETag when it is an MD5 of the bytes,
  single-part or multipart, else an additional checksum of the object) and SHA-256
  are computed; on S3, every request is pinned to the recorded ETag (see
  :mod:`.remote`) and the bytes received must give the checksum, else the download is
  retried (``download_retry``) and finally refused with a SourceError: altered bytes
  are never cached. An object with no checksum zephon can check is read a second
  time and cached only when both reads have the same SHA-256 (or refused with
  ``unchecked_objects='refuse'``). Other protocols: the object's version is looked up
  again after the download. ``<entry>.check`` records the size, SHA-256, inode,
  mtime and ctime of the complete entry. Each open compares the entry's ``fstat``
  with that record (no pass over the bytes); on a difference the SHA-256 is
  recomputed once: equal, the record is renewed; different (the copy was altered),
  the entry is removed and downloaded again.
- *Atomic*: the ``.part`` file is fsynced and renamed into place, then its
  ``.check`` is written (atomically too); an entry without its ``.check`` is never
  served (it is downloaded again). A process killed mid-download leaves only a
  ``.part`` file, which is never served and is removed by the next process that
  takes the entry's lock, or by the pass that follows every insertion while no
  writer holds that lock.
- *Shared*: the processes of one run and concurrent runs take the entry's stripe
  ``flock`` before downloading, and look again once they hold it: an object is
  downloaded once, whoever asks first.
- *Leased*: :meth:`FileCache.open` returns the entry open with a shared ``flock``
  (taken under the stripe lock after a download, or checked to still be the linked
  entry after a lock-free hit). Eviction takes the stripe lock and an exclusive
  non-blocking ``flock`` on the entry before removing it: an entry some reader holds
  open is never removed, so its path stays valid for that reader until it closes.
- *LRU*: a hit touches ``<entry>.check``'s mtime (the entry's own stamps are part of
  the check); after every insertion the process holding ``cache.lock`` evicts the
  least recently used entries that are not leased (with their derived files) until
  the total is at most ``cache_limit_bytes``, logging a warning when leased entries
  keep it above.
- *Disk errors*: an OS error while writing the cache (a full disk, a quota, a
  read-only file system) is a SourceError naming the file and what to do; the
  partial file is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import stat
import uuid
from typing import Iterator

from zephon.io.config import IoConfig
from zephon.io.errors import SourceError
from zephon.io.remote import (
    BLOCK,
    FileRef,
    ObjectChecksum,
    check_version,
    fetch_range,
    read_range,
    refuse_unchecked,
)

__all__ = ["BLOCK", "FileCache"]

log = logging.getLogger("zephon.io.cache")
_STRIPES = 64
_CHECK = "check"  # the tag of the record beside each entry
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_READ = os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC
_FULL = (errno.ENOSPC, errno.EDQUOT)


class _Untrusted(Exception):
    """A file of the cache that is not a regular file of ours (removed, not served)."""


class _Corrupt(Exception):
    """A download whose bytes do not match the store's checksum."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _disk_error(exc: OSError, path: str, what: str) -> SourceError:
    """The SourceError for an OS error while writing ``path`` of the cache."""
    if exc.errno in _FULL:
        advice = ("free space there, lower cache_limit_bytes, point cache_root at a larger "
                  "disk, or set cache_enabled=False to stream the files instead")
    elif exc.errno == errno.EROFS:
        advice = "point cache_root at a writable directory or set cache_enabled=False"
    else:
        advice = "check the cache directory's disk, or set cache_enabled=False"
    return SourceError(f"cannot {what}: writing {path} failed: {exc.strerror or exc} "
                       f"(errno {exc.errno}); {advice}")


def _check_dir(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise SourceError(f"cache directory {path} is not a directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise SourceError(f"cache directory {path} is owned by {_owner(st.st_uid)}, not by "
                          f"this process's {_owner(uid)}; refusing to use it (its files could "
                          "be forged): set cache_root to a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise SourceError(f"cache directory {path} is writable by group or others (mode "
                          f"{mode:04o}); refusing to use it (its files could be forged): "
                          "chmod 0700 it or set cache_root to a directory of your own")


def _open_dir(path: str, create: bool) -> int:
    """The descriptor of the trusted cache directory ``path`` (made 0700 if asked)."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise _disk_error(exc, path, "create the cache directory") from None
        except OSError as exc:
            raise _disk_error(exc, path, "create the cache directory") from None
    try:
        fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError as exc:
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.lstat(path).st_mode):
                raise SourceError(f"cache directory {path} is a symbolic link; refusing to "
                                  "follow it: set cache_root to the real directory") from None
        raise SourceError(f"cannot open cache directory {path}: {exc}") from None
    try:
        _check_dir(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_file(fd: int) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or \
            stat.S_IMODE(st.st_mode) & 0o022:
        raise _Untrusted(f"mode {stat.filemode(st.st_mode)}, {_owner(st.st_uid)}")
    return st


def _open_file(path: str, flags: int = _READ, mode: int = 0o600) -> int:
    """``path`` opened without following a symlink; _Untrusted when it is not a regular
    file of ours; FileNotFoundError when it does not exist."""
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Untrusted("a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a FIFO without a writer, a socket
            raise _Untrusted("not a regular file") from None
        raise
    try:
        _check_file(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _flock(path: str, nonblocking: bool = False) -> Iterator[bool]:
    """Hold an exclusive ``flock`` of the lock file ``path``; with ``nonblocking``
    yields False (and holds nothing) when someone else has it."""
    try:
        fd = _open_file(path, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | os.O_NONBLOCK |
                        _O_CLOEXEC)
    except _Untrusted as exc:
        raise SourceError(f"cache lock {path} is not a file of this user ({exc}); refusing "
                          "it: remove it") from None
    except OSError as exc:
        raise _disk_error(exc, path, "create a cache lock") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if nonblocking else 0))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _sha256_fd(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while True:
        chunk = os.pread(fd, BLOCK, offset)
        if not chunk:
            return digest.hexdigest()
        digest.update(chunk)
        offset += len(chunk)


def _stamps(st: os.stat_result) -> dict:
    return {"size": st.st_size, "ino": st.st_ino, "dev": st.st_dev,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


class FileCache:
    """The cache in directory ``cfg.cache_dir()``, bounded by ``cfg.cache_limit_bytes``.

    >>> path, fh = FileCache(cfg).open(ref)   # doctest: +SKIP
    """

    def __init__(self, cfg: IoConfig, storage_options: dict | None = None) -> None:
        self.cfg, self.storage_options = cfg, storage_options
        self.root = cfg.cache_dir()

    # -- naming --------------------------------------------------------------------------
    def entry_path(self, ref: FileRef) -> str:
        key = f"{ref.url}\0{ref.size}\0{ref.version}\0{ref.version_id}"
        digest = hashlib.sha256(key.encode()).hexdigest()
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in ref.basename)[-80:]
        return os.path.join(self.root, "files", digest[:2], f"{digest[:32]}-{name}")

    def _lock_path(self, entry: str) -> str:
        stripe = int(hashlib.sha256(entry.encode()).hexdigest()[:8], 16) % _STRIPES
        return os.path.join(self.root, "locks", f"{stripe}.lock")

    def _ensure_dirs(self, entry: str) -> None:
        """Check (creating them) the directories ``entry`` lives in and ``locks``."""
        files = os.path.join(self.root, "files")
        for path in (self.root, files, os.path.dirname(entry), os.path.join(self.root, "locks")):
            os.close(_open_dir(path, create=True))

    # -- entries ---------------------------------------------------------------------------
    def open(self, ref: FileRef, context: str = "") -> tuple[str, io.BufferedReader]:
        """``(path, file)``: the verified local copy of ``ref`` (downloaded on a miss),
        open and leased: it is not evicted until ``file`` is closed."""
        entry = self.entry_path(ref)
        self._ensure_dirs(entry)
        fd = self._open_verified(entry, ref, full=False)
        if fd is None:
            with _flock(self._lock_path(entry)):
                fd = self._open_verified(entry, ref, full=True)  # another process did it?
                if fd is None:
                    self._remove_parts(entry)
                    self._download(ref, entry, context)
                    fd = self._open_verified(entry, ref, full=False)
            if fd is None:
                raise SourceError(f"cannot cache {ref.url}: the entry {entry} it was just "
                                  "written to does not verify")
            self.evict(keep=entry)
        self._touch(entry)
        return entry, os.fdopen(fd, "rb")

    def fetch(self, ref: FileRef, context: str = "") -> str:
        """A local path holding the complete bytes of ``ref`` (downloaded on a miss). It is
        not leased: prefer :meth:`open`, whose file keeps the entry from eviction."""
        path, fh = self.open(ref, context)
        fh.close()
        return path

    def put_derived(self, ref: FileRef, tag: str, data: bytes) -> None:
        """Store ``data`` beside ``ref``'s entry as ``<entry>.<tag>`` (atomically); it is
        evicted with the entry."""
        entry = self.entry_path(ref)
        self._ensure_dirs(entry)
        with _flock(self._lock_path(entry)):
            self._write_atomic(f"{entry}.{tag}", data, f"store derived data of {ref.url}")

    def get_derived(self, ref: FileRef, tag: str) -> bytes | None:
        target = f"{self.entry_path(ref)}.{tag}"
        try:
            fd = _open_file(target)
        except _Untrusted as exc:
            self._drop(target, str(exc))
            return None
        except OSError:
            return None
        with os.fdopen(fd, "rb") as fh:
            return fh.read()

    def _drop(self, path: str, why: str) -> None:
        log.warning("cache: removing %s (%s): not a file this cache wrote", path, why)
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _open_verified(self, entry: str, ref: FileRef, full: bool) -> int | None:
        """The entry's descriptor under a shared flock if it is present, trusted and
        matches its ``.check`` record, else None. ``full`` (the stripe lock held): an
        entry whose stamps differ from the record has its SHA-256 recomputed, and one
        that is not valid is removed."""
        try:
            fd = _open_file(entry)
        except _Untrusted as exc:
            if full:
                self._remove_entry(entry, str(exc))
            return None
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            if os.lstat(entry).st_ino != st.st_ino:  # evicted or replaced meanwhile
                raise FileNotFoundError(entry)
            verdict = self._verdict(entry, fd, st, ref, full)
        except OSError:
            verdict = "gone"
        except BaseException:
            os.close(fd)
            raise
        if verdict == "ok":
            return fd
        os.close(fd)
        if full and verdict != "gone":
            self._remove_entry(entry, verdict)
        return None

    def _verdict(self, entry: str, fd: int, st: os.stat_result, ref: FileRef,
                 full: bool) -> str:
        """'ok', or why the open entry ``fd`` must not be served."""
        if st.st_size != ref.size:
            return f"{st.st_size} bytes, {ref.size} expected"
        record = self._record(entry)
        if record is None:
            return "no valid .check record"
        if all(record.get(k) == v for k, v in _stamps(st).items()):
            return "ok"
        if not full:
            return "stamps differ"
        if _sha256_fd(fd) != record.get("sha256"):
            return "its SHA-256 differs from the one recorded at download"
        record.update(_stamps(os.fstat(fd)))  # intact (copied, restored): renew the stamps
        self._write_atomic(f"{entry}.{_CHECK}", json.dumps(record).encode(),
                           f"record the check of {ref.url}")
        return "ok"

    def _record(self, entry: str) -> dict | None:
        path = f"{entry}.{_CHECK}"
        try:
            fd = _open_file(path)
        except (OSError, _Untrusted):
            return None
        try:
            with os.fdopen(fd, "rb") as fh:
                record = json.loads(fh.read(1 << 16))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _touch(self, entry: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(f"{entry}.{_CHECK}", follow_symlinks=False)  # the LRU stamp

    def _remove_entry(self, entry: str, why: str) -> None:
        """Remove an entry and everything beside it (the stripe lock held)."""
        log.warning("cache: removing %s (%s); it will be downloaded again", entry, why)
        self._unlink_all(entry)

    @staticmethod
    def _unlink_all(entry: str) -> None:
        directory, base = os.path.split(entry)
        with contextlib.suppress(OSError):
            for name in os.listdir(directory):
                if name == base or name.startswith(base + "."):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(directory, name))

    def _remove_parts(self, entry: str) -> None:
        directory, base = os.path.split(entry)
        for name in os.listdir(directory):
            if name.startswith(base + ".part-") or name.startswith(base + f".{_CHECK}.part-"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))

    def _write_atomic(self, target: str, data: bytes, what: str) -> None:
        part = f"{target}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                         0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(part, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise _disk_error(exc, part, what) from None

    def _download(self, ref: FileRef, entry: str, context: str) -> None:
        """Download ``ref`` into ``entry`` with its ``.check`` record; a download whose
        bytes fail the store's checksum is retried ``download_retry`` times."""
        attempts = self.cfg.download_retry + 1
        for attempt in range(1, attempts + 1):
            try:
                record = self._download_once(ref, entry, context)
                break
            except _Corrupt as exc:
                if attempt == attempts:
                    raise SourceError(
                        f"cannot cache {ref.url}: {exc} in {attempts} download(s): something "
                        "between zephon and the store alters the data (a proxy, a faulty "
                        "network card); nothing was cached") from None
                log.warning("download of %s is corrupt (%s); attempt %d of %d", ref.url, exc,
                            attempt + 1, attempts)
        try:
            self._write_atomic(f"{entry}.{_CHECK}", json.dumps(record).encode(),
                               f"record the check of {ref.url}")
        except BaseException:
            self._unlink_all(entry)
            raise
        log.debug("cached %s (%d bytes) at %s", ref.url, ref.size, entry)

    def _download_once(self, ref: FileRef, entry: str, context: str) -> dict:
        part = f"{entry}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        checksum, sha = ObjectChecksum(ref, self.cfg, self.storage_options), hashlib.sha256()
        try:
            fd = _create(part, ref)
            try:
                for start in range(0, ref.size, BLOCK):
                    data, meta = fetch_range(ref, start, min(ref.size, start + BLOCK), self.cfg,
                                             self.storage_options, context)
                    checksum.update(data, meta)
                    sha.update(data)
                    _write_all(fd, data, part, ref)
                _sync(fd, part, ref)
                written = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if written != ref.size:
                raise SourceError(f"cannot cache {ref.url}: got {written} bytes, expected "
                                  f"{ref.size}")
            verified = checksum.verifiable
            mismatch = checksum.mismatch() if verified else self._read_again(ref, sha, context)
            if mismatch:
                raise _Corrupt(mismatch)
            if ref.version and not ref.conditional:
                check_version(ref, self.cfg, self.storage_options, context)  # same version?
            _replace(part, entry, ref)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        _fsync_dir(os.path.dirname(entry))
        st = os.lstat(entry)
        return {"url": ref.url, "version": ref.version, "version_id": ref.version_id,
                "sha256": sha.hexdigest(), "md5_verified": verified,
                "checked_by": checksum.name or "two reads that agreed", **_stamps(st)}

    def _read_again(self, ref: FileRef, sha, context: str) -> str | None:
        """An object with no checksum zephon can check is read a second time: None when
        the two reads agree (their SHA-256), else why not."""
        refuse_unchecked(ref, self.cfg, context)
        again = hashlib.sha256()
        for start in range(0, ref.size, BLOCK):
            again.update(read_range(ref, start, min(ref.size, start + BLOCK), self.cfg,
                                    self.storage_options, context))
        if again.digest() == sha.digest():
            log.info("%s offers no checksum zephon can check: two reads of it agreed",
                     ref.url)
            return None
        return ("two reads of it disagree (it offers no checksum zephon can check, so two "
                "reads must agree)")

    # -- eviction --------------------------------------------------------------------------
    def entries(self) -> list[tuple[float, int, str]]:
        """``(LRU stamp, size, path)`` of every complete entry (derived files counted in,
        the ``.check`` record not)."""
        files = os.path.join(self.root, "files")
        out: dict[str, list] = {}
        derived: list[tuple[str, int, int]] = []
        for directory, _, names in os.walk(files):
            present = set(names)
            for name in names:
                path = os.path.join(directory, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if ".part-" in name or not stat.S_ISREG(st.st_mode):
                    continue
                if "." in name.split("-", 1)[-1] and name.rsplit(".", 1)[0] in present:
                    derived.append((path, st.st_size, st.st_mtime_ns))
                else:
                    out[path] = [st.st_mtime_ns, st.st_size]
        for path, size, mtime in derived:
            base, tag = path.rsplit(".", 1)
            if base in out:
                if tag == _CHECK:  # bookkeeping, not counted: its mtime is the LRU stamp
                    out[base][0] = mtime
                else:
                    out[base][1] += size
        return [(m, s, p) for p, (m, s) in out.items()]

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove the ``.part`` files of dead writers, then the least recently used
        entries that no reader holds open until the cache fits ``cache_limit_bytes``;
        returns the removed entry paths."""
        limit = self.cfg.cache_limit_bytes
        removed: list[str] = []
        os.close(_open_dir(self.root, create=True))
        with _flock(os.path.join(self.root, "cache.lock")):
            self._remove_dead_parts()
            if limit is None:
                return removed
            entries = sorted(self.entries())
            total = sum(size for _, size, _ in entries)
            for _, size, path in entries:
                if total <= limit:
                    break
                if path != keep and self._evict_one(path):
                    total -= size
                    removed.append(path)
            if total > limit:
                log.warning("cache %s holds %d bytes, above cache_limit_bytes=%d: the entries "
                            "in use are larger than the limit", self.root, total, limit)
        if removed:
            log.debug("evicted %d cache entries: %s", len(removed), removed)
        return removed

    def _evict_one(self, path: str) -> bool:
        """Remove ``path`` and its derived files unless a reader holds it open."""
        with _flock(self._lock_path(path)):
            try:
                fd = os.open(path, _READ)
            except OSError:
                self._unlink_all(path)
                return True
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False  # leased: a reader has it open
                self._unlink_all(path)
                return True
            finally:
                os.close(fd)

    def _remove_dead_parts(self) -> None:
        """Remove ``.part`` files whose entry lock nobody holds (their writer died)."""
        for directory, _, names in os.walk(os.path.join(self.root, "files")):
            for name in names:
                if ".part-" not in name:
                    continue
                entry = os.path.join(directory, name.split(".part-", 1)[0])
                if entry.endswith(f".{_CHECK}"):
                    entry = entry[:-len(_CHECK) - 1]
                with _flock(self._lock_path(entry), nonblocking=True) as free:
                    if free:
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(directory, name))


def _create(part: str, ref: FileRef) -> int:
    try:
        return os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                       0o600)
    except OSError as exc:
        raise _disk_error(exc, part, f"cache {ref.url}") from None


def _write_all(fd: int, data: bytes, part: str, ref: FileRef) -> None:
    view, done = memoryview(data), 0
    try:
        while done < len(view):
            done += os.write(fd, view[done:])
    except OSError as exc:
        raise _disk_error(exc, part, f"cache {ref.url}") from None


def _sync(fd: int, part: str, ref: FileRef) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _disk_error(exc, part, f"cache {ref.url}") from None


def _replace(part: str, entry: str, ref: FileRef) -> None:
    try:
        os.replace(part, entry)
    except OSError as exc:
        raise _disk_error(exc, entry, f"cache {ref.url}") from None


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
