"""The resumable checkpoint store of a job run.

Layout of ``<checkpoint_dir>`` (mode 0700)::

    LOCK              flock'ed for the whole run: a second run on the same
                      directory fails at once with the holder's pid
    FINGERPRINT       the fingerprint of the last run that opened the store
    ok/<key hash>     one success entry per subject
    failed/<key hash> the last recorded failure of a subject, kept apart

An entry is zstd-compressed msgpack ``{key, subject, fingerprint, value |
error, attempts, duration_s, time}``. Values are msgpack-native types plus
extension types for NumPy arrays and scalars, tuples and integers wider than
64 bits; any other object is stored with pickle only when the store was opened
with ``allow_pickle=True``, and such an entry is refused at load time otherwise
(loading a pickle runs code). A stored ``None`` is a value like any other: a
hit, never a miss.

Writes are atomic: a unique temporary name in the same directory, ``fsync``,
``os.replace``, then ``fsync`` of the directory. A crash or Ctrl-C leaves
either the old entry or the new one, never a torn file.

Trust: the store uses nothing it did not write. The directory is opened once
with ``O_NOFOLLOW`` and every file in it is reached relative to that descriptor
(so the directory cannot be swapped under the run); the directory and its
``ok``/``failed`` subdirectories must be real directories (not symlinks) owned
by the current user and not writable by group or others, else opening the
store raises :class:`~zephon.errors.CheckpointError` without touching them (an
own directory that is merely readable by others is tightened to 0700 through
its descriptor, never through a path). ``LOCK``, ``FINGERPRINT`` and entries
are opened with ``O_NOFOLLOW | O_NONBLOCK`` and accepted only as regular files
owned by the current user: a symlink (to a victim file, to /dev/zero), a FIFO,
a device or a file forged by another user is refused, never followed, read,
truncated or chmodded. Temporary files left by writers that died are removed
when the store is opened (the lock guarantees no live writer owns them).

Loading an entry raises :class:`~zephon.errors.CheckpointError` for every kind
of bad entry (refused as above, truncated or corrupt, a record with missing or
mistyped fields, a value that does not decode, a pickle this store does not
allow): one message naming the entry, the subject key and what is wrong. The
run decides what to do with it (recompute, or fail that subject); a bad entry
is never a reason to abort a run.

Fingerprints: every entry records the fingerprint it was written under and is
served only to a run with the same fingerprint. With ``strict=True`` opening a
store whose FINGERPRINT differs raises :class:`~zephon.errors.CheckpointError`;
otherwise the other fingerprint's entries are simply not served (and are
overwritten as subjects are recomputed).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
import stat
import time
from typing import Any

import msgpack
import numpy as np
import zstandard

from zephon.errors import CheckpointError, SerializationError
from zephon.kernels.types import dtype_from_token, dtype_token

__all__ = ["CheckpointStore", "StoredEntry", "decode_value", "encode_value"]

log = logging.getLogger("zephon.jobs")

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC
_TMP_PREFIX = ".tmp-"

_EXT_ARRAY, _EXT_BIGINT, _EXT_TUPLE, _EXT_SCALAR, _EXT_PICKLE = 1, 2, 3, 4, 5
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1


def encode_value(value: Any, *, allow_pickle: bool) -> bytes:
    """msgpack bytes of ``value`` (see the module docstring for what is allowed)."""

    def default(obj):
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            data = np.ascontiguousarray(obj)
            return msgpack.ExtType(_EXT_ARRAY, msgpack.packb(
                [dtype_token(obj.dtype), list(obj.shape), data.tobytes()], use_bin_type=True))
        if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return msgpack.ExtType(_EXT_SCALAR, msgpack.packb(
                [dtype_token(obj.dtype), obj.tobytes()], use_bin_type=True))
        if isinstance(obj, tuple):
            return msgpack.ExtType(_EXT_TUPLE, pack(list(obj)))
        if isinstance(obj, int) and not isinstance(obj, bool):
            return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
        if allow_pickle:
            return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj, protocol=5))
        raise SerializationError(
            f"cannot store a {type(obj).__name__} in the checkpoint store without pickle; "
            "return msgpack-able values (numbers, strings, bytes, lists, dicts, tuples, NumPy "
            "arrays) or open the run with allow_pickle=True")

    def pack(obj):
        return msgpack.packb(obj, default=default, use_bin_type=True, strict_types=True)

    return pack(value)


def decode_value(data: bytes, *, allow_pickle: bool) -> Any:
    def ext_hook(code, payload):
        if code == _EXT_ARRAY:
            dtype, shape, raw = msgpack.unpackb(payload, raw=False)
            return np.frombuffer(raw, dtype=dtype_from_token(dtype)).reshape(shape).copy()
        if code == _EXT_SCALAR:
            dtype, raw = msgpack.unpackb(payload, raw=False)
            return np.frombuffer(raw, dtype=dtype_from_token(dtype))[0]
        if code == _EXT_TUPLE:
            return tuple(unpack(payload))
        if code == _EXT_BIGINT:
            return int(payload.decode())
        if code == _EXT_PICKLE:
            if not allow_pickle:
                raise CheckpointError(
                    "the stored value was pickled; refusing to unpickle it (that runs code) "
                    "unless the run is opened with allow_pickle=True")
            return pickle.loads(payload)
        return msgpack.ExtType(code, payload)

    def unpack(raw):
        return msgpack.unpackb(raw, raw=False, ext_hook=ext_hook, strict_map_key=False)

    return unpack(data)


class StoredEntry:
    __slots__ = ("attempts", "duration_s", "error", "ok", "value")

    def __init__(self, ok: bool, value: Any, error: dict | None, attempts: int,
                 duration_s: float) -> None:
        self.ok, self.value, self.error = ok, value, error
        self.attempts, self.duration_s = attempts, duration_s


def _owner_text(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _open_dir(path: str, *, dir_fd: int | None = None, create: bool) -> int:
    """Open (creating it 0700 if asked) a store directory that must be a real directory
    owned by us and not writable by group or others; its descriptor."""
    name = path if dir_fd is None else os.path.basename(path)
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {path}: {exc}") from exc
    try:
        fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as exc:
        try:
            link = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
        except OSError:
            link = False
        if link or exc.errno == errno.ELOOP:
            raise CheckpointError(
                f"checkpoint directory {path} is a symbolic link; refusing to follow it (give "
                "the real path of a directory you own)") from None
        raise CheckpointError(f"cannot open checkpoint directory {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"checkpoint directory {path} is not a directory")
        uid = os.geteuid()
        if st.st_uid != uid:
            raise CheckpointError(
                f"checkpoint directory {path} is owned by {_owner_text(st.st_uid)}, not by "
                f"this run's {_owner_text(uid)}; refusing to use it (its entries could be "
                "forged): use a directory of your own")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            raise CheckpointError(
                f"checkpoint directory {path} is writable by group or others (mode "
                f"{mode:04o}); refusing to use it (its entries could be forged): use a "
                "directory of your own with mode 0700, or chmod 0700 this one")
        if mode & 0o077:
            os.fchmod(fd, 0o700)  # through the descriptor: never a symlink's target
    except BaseException:
        os.close(fd)
        raise
    return fd


class CheckpointStore:
    """One run's view of a checkpoint directory (see the module docstring).

    Opening it creates the store if needed and takes its lock; :meth:`load`,
    :meth:`save_success`, :meth:`save_failure`; :meth:`close` releases the lock,
    :meth:`clear` removes the store. ``zephon.jobs.run`` opens one itself; use it
    directly to inspect a store.

    Args:
        root: the store directory.
        fingerprint: what the results depend on; entries of another fingerprint are
            not served (None: the empty fingerprint).
        strict: refuse a store last opened under another fingerprint.
        allow_pickle: store and load values msgpack cannot encode with pickle.

    Raises:
        CheckpointError: the directory cannot be trusted, another run holds its lock,
            or (``strict``) it was written under another fingerprint.

    Example:
        >>> store = zephon.jobs.CheckpointStore("ckpt", "v1")
        >>> store.save_success("key-a", "a", {"n": 3}, attempts=1, duration_s=0.5)
        >>> store.load("key-a").value, store.load("key-b")
        ({'n': 3}, None)
        >>> store.close()
    """

    def __init__(self, root: str, fingerprint: str | None, *, strict: bool = False,
                 allow_pickle: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.fingerprint = "" if fingerprint is None else str(fingerprint)
        self.allow_pickle = allow_pickle
        self._uid = os.geteuid()
        self._cctx = zstandard.ZstdCompressor(level=3)
        self._dctx = zstandard.ZstdDecompressor()
        self._lock_fd = None
        self._fds: dict[str, int] = {}
        parent = os.path.dirname(self.root)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create {parent} for the checkpoint store: "
                                  f"{exc}") from exc
        self._fds["."] = _open_dir(self.root, create=True)
        try:
            for sub in ("ok", "failed"):
                self._fds[sub] = _open_dir(os.path.join(self.root, sub),
                                           dir_fd=self._fds["."], create=True)
            self._lock_fd = self._lock()
            self._remove_leftover_temp_files()
            self._check_fingerprint(strict)
        except BaseException:
            self.close()
            raise

    # -- lock and fingerprint ------------------------------------------------------------
    def _lock(self) -> int:
        import fcntl

        path = os.path.join(self.root, "LOCK")
        try:
            fd = os.open("LOCK", os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | os.O_NONBLOCK |
                         _O_CLOEXEC, 0o600, dir_fd=self._fds["."])
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(
                    f"{path} is a symbolic link; refusing to follow it (someone else put it "
                    "there: remove it)") from None
            raise CheckpointError(f"cannot open {path}: {exc}") from exc
        try:
            self._check_file(fd, path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    raise CheckpointError(
                        f"checkpoint directory {self.root} is in use by another run (pid "
                        f"{holder}); wait for it to finish or use another checkpoint_dir"
                    ) from None
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_file(self, fd: int, path: str) -> os.stat_result:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file; refused")
        if st.st_uid != self._uid:
            raise CheckpointError(f"{path} is owned by {_owner_text(st.st_uid)}, not by "
                                  f"this run's {_owner_text(self._uid)}; refused")
        return st

    def _remove_leftover_temp_files(self) -> None:
        removed = 0
        for fd in self._fds.values():
            for name in os.listdir(fd):
                if name.startswith(_TMP_PREFIX):
                    try:
                        os.unlink(name, dir_fd=fd)
                        removed += 1
                    except OSError:
                        pass
        if removed:
            log.info("removed %d temporary file(s) left in %s by writers that died", removed,
                     self.root)

    def _read_file(self, kind: str, name: str, what: str) -> bytes | None:
        """The bytes of a file of the store, or None when it does not exist; a file that is
        not a regular file of ours raises CheckpointError (never followed, never blocks)."""
        path = os.path.join(self.root, name) if kind == "." else \
            os.path.join(self.root, kind, name)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self._fds[kind])
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(f"{what} {path} is a symbolic link; refused "
                                      "(not followed)") from None
            raise CheckpointError(f"{what} {path} cannot be opened: {exc}") from exc
        try:
            st = self._check_file(fd, f"{what} {path}")
            chunks, size = [], 0
            while True:
                chunk = os.read(fd, max(1 << 16, st.st_size - size + 1))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _check_fingerprint(self, strict: bool) -> None:
        path = os.path.join(self.root, "FINGERPRINT")
        try:
            blob = self._read_file(".", "FINGERPRINT", "fingerprint file")
            recorded = None if blob is None else json.loads(blob.decode())["fingerprint"]
            if recorded is not None and not isinstance(recorded, str):
                raise CheckpointError(f"the fingerprint is a {type(recorded).__name__}")
        except (CheckpointError, ValueError, KeyError, TypeError) as exc:
            if strict:
                raise CheckpointError(f"{path} is unreadable ({exc}) and "
                                      "strict_checkpoint_hash is on") from exc
            log.warning("%s is unreadable (%s); rewriting it", path, exc)
            recorded = None
            self._unlink(".", "FINGERPRINT")
        if recorded is not None and recorded != self.fingerprint and strict:
            raise CheckpointError(
                f"checkpoint directory {self.root} was written under fingerprint "
                f"{recorded!r}, this run's is {self.fingerprint!r} (strict_checkpoint_hash); "
                "use a new checkpoint_dir, clear this one, or disable strict_checkpoint_hash")
        self.previous_fingerprint = recorded
        if recorded != self.fingerprint:
            self._atomic_write(".", "FINGERPRINT",
                               json.dumps({"fingerprint": self.fingerprint}).encode())

    def close(self) -> None:
        """Release the lock and the directory descriptors (idempotent).

        Example:
            >>> store = zephon.jobs.CheckpointStore("ckpt", None)
            >>> store.close()
        """
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    # -- entries ---------------------------------------------------------------------------
    @staticmethod
    def _name(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:40]

    def _path(self, kind: str, key: str) -> str:
        return os.path.join(self.root, kind, self._name(key))

    def _unlink(self, kind: str, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._fds[kind])
        except FileNotFoundError:
            pass

    def _atomic_write(self, kind: str, name: str, data: bytes) -> None:
        dfd = self._fds[kind]
        tmp = f"{_TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                     0o600, dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.close(fd)
            fd = -1  # closed
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        os.fsync(dfd)

    def _read(self, kind: str, key: str) -> dict | None:
        what = f"checkpoint entry for {key!r}:"
        blob = self._read_file(kind, self._name(key), what)
        if blob is None:
            return None
        path = self._path(kind, key)
        try:
            record = msgpack.unpackb(self._dctx.decompress(blob), raw=False)
        except Exception as exc:  # noqa: BLE001 - corrupt entry: recompute, do not serve
            raise CheckpointError(f"{what} {path} is corrupt (truncated or damaged): "
                                  f"{type(exc).__name__}: {exc}") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{what} {path} is corrupt: not a record")
        if record.get("key") != key or record.get("fingerprint") != self.fingerprint:
            return None  # another key (hash clash) or another fingerprint: not served
        attempts, duration = record.get("attempts"), record.get("duration_s")
        if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 0 or \
                not isinstance(duration, (int, float)) or isinstance(duration, bool):
            raise CheckpointError(f"{what} {path} is corrupt: attempts={attempts!r}, "
                                  f"duration_s={duration!r}")
        if kind == "ok" and not isinstance(record.get("value"), bytes):
            raise CheckpointError(f"{what} {path} is corrupt: it holds no encoded value")
        if kind == "failed":
            error = record.get("error")
            if not isinstance(error, dict) or not isinstance(error.get("type"), str) or \
                    not isinstance(error.get("message"), str) or \
                    not isinstance(error.get("traceback", ""), str):
                raise CheckpointError(f"{what} {path} is corrupt: error={error!r:.200}")
        return record

    def load(self, key: str) -> StoredEntry | None:
        """The stored outcome of ``key`` under this fingerprint.

        Args:
            key: the subject's cache key.

        Returns:
            A ``StoredEntry`` (``ok``, ``value``, ``error``, ``attempts``, ``duration_s``):
            a success if one is stored, else the recorded failure; None when there is none.

        Raises:
            CheckpointError: an entry that cannot be trusted or read (see the module
                docstring).

        Example:
            >>> store = zephon.jobs.CheckpointStore("ckpt", None)
            >>> store.load("missing") is None
            True
            >>> store.close()
        """
        record = self._read("ok", key)
        if record is not None:
            try:
                value = decode_value(record["value"], allow_pickle=self.allow_pickle)
            except CheckpointError as exc:
                raise CheckpointError(f"checkpoint entry for {key!r}: "
                                      f"{self._path('ok', key)}: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - whatever the bad bytes raise
                raise CheckpointError(
                    f"checkpoint entry for {key!r}: {self._path('ok', key)} is corrupt: its "
                    f"value does not decode: {type(exc).__name__}: {exc}") from None
            return StoredEntry(True, value, None, record["attempts"], record["duration_s"])
        record = self._read("failed", key)
        if record is not None:
            return StoredEntry(False, None, record["error"], record["attempts"],
                               record["duration_s"])
        return None

    def save_success(self, key: str, subject_id: str, value: Any, attempts: int,
                     duration_s: float) -> None:
        """Record a success of ``key`` (atomically; it replaces an earlier entry).

        Args:
            key: the subject's cache key.
            subject_id: the subject's id.
            value: the result (msgpack-native types, NumPy arrays and scalars, tuples;
                anything else only with ``allow_pickle``).
            attempts: how many times the subject ran.
            duration_s: seconds the last attempt took.

        Raises:
            CheckpointError: a value that cannot be stored, or a failed write.

        Example:
            >>> store = zephon.jobs.CheckpointStore("ckpt", None)
            >>> store.save_success("k", "s", np.arange(3), attempts=1, duration_s=0.1)
            >>> store.load("k").value.tolist()
            [0, 1, 2]
            >>> store.close()
        """
        data = encode_value(value, allow_pickle=self.allow_pickle)
        record = {"key": key, "subject": subject_id, "fingerprint": self.fingerprint,
                  "value": data, "attempts": attempts, "duration_s": duration_s,
                  "time": time.time()}
        name = self._name(key)
        self._atomic_write("ok", name, self._cctx.compress(
            msgpack.packb(record, use_bin_type=True)))
        self._unlink("failed", name)

    def save_failure(self, key: str, subject_id: str, error: dict, attempts: int,
                     duration_s: float) -> None:
        """Record a failure of ``key`` (kept apart from successes).

        Args:
            key: the subject's cache key.
            subject_id: the subject's id.
            error: ``{"type", "message", "traceback"}`` of the failure.
            attempts: how many times the subject ran.
            duration_s: seconds the last attempt took.

        Example:
            >>> store = zephon.jobs.CheckpointStore("ckpt", None)
            >>> store.save_failure("k", "s", {"type": "ValueError", "message": "bad",
            ...                    "traceback": ""}, attempts=3, duration_s=0.1)
            >>> entry = store.load("k")
            >>> entry.ok, entry.error["message"]
            (False, 'bad')
            >>> store.close()
        """
        record = {"key": key, "subject": subject_id, "fingerprint": self.fingerprint,
                  "error": error, "attempts": attempts, "duration_s": duration_s,
                  "time": time.time()}
        self._atomic_write("failed", self._name(key), self._cctx.compress(
            msgpack.packb(record, use_bin_type=True)))

    def clear(self) -> None:
        """Remove the whole store, then release the lock (the run holds it while removing).

        Example:
            >>> store = zephon.jobs.CheckpointStore("ckpt", None)
            >>> store.clear()
            >>> import os; os.path.exists("ckpt")
            False
        """
        shutil.rmtree(self.root, ignore_errors=True)
        self.close()
