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
import os
import pickle
import shutil
import time
from typing import Any

import msgpack
import numpy as np
import zstandard

from zephon.errors import CheckpointError, SerializationError
from zephon.kernels.types import dtype_from_token, dtype_token

__all__ = ["CheckpointStore", "StoredEntry", "encode_value", "decode_value"]

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
    __slots__ = ("ok", "value", "error", "attempts", "duration_s")

    def __init__(self, ok: bool, value: Any, error: dict | None, attempts: int,
                 duration_s: float) -> None:
        self.ok, self.value, self.error = ok, value, error
        self.attempts, self.duration_s = attempts, duration_s


class CheckpointStore:
    """One run's view of a checkpoint directory (see the module docstring)."""

    def __init__(self, root: str, fingerprint: str | None, *, strict: bool = False,
                 allow_pickle: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.fingerprint = "" if fingerprint is None else str(fingerprint)
        self.allow_pickle = allow_pickle
        self._cctx = zstandard.ZstdCompressor(level=3)
        self._dctx = zstandard.ZstdDecompressor()
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)
        for sub in ("ok", "failed"):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        self._lock_fd = self._lock()
        try:
            self._check_fingerprint(strict)
        except BaseException:
            self.close()
            raise

    # -- lock and fingerprint ------------------------------------------------------------
    def _lock(self) -> int:
        import fcntl

        path = os.path.join(self.root, "LOCK")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise CheckpointError(
                    f"checkpoint directory {self.root} is in use by another run (pid "
                    f"{holder}); wait for it to finish or use another checkpoint_dir") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def _check_fingerprint(self, strict: bool) -> None:
        path = os.path.join(self.root, "FINGERPRINT")
        try:
            with open(path, encoding="utf-8") as fh:
                recorded = json.load(fh)["fingerprint"]
        except FileNotFoundError:
            recorded = None
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{path} is corrupt: {exc}") from exc
        if recorded is not None and recorded != self.fingerprint and strict:
            raise CheckpointError(
                f"checkpoint directory {self.root} was written under fingerprint "
                f"{recorded!r}, this run's is {self.fingerprint!r} (strict_checkpoint_hash); "
                "use a new checkpoint_dir, clear this one, or disable strict_checkpoint_hash")
        self.previous_fingerprint = recorded
        if recorded != self.fingerprint:
            self._atomic_write(path, json.dumps({"fingerprint": self.fingerprint}).encode())

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- entries ---------------------------------------------------------------------------
    @staticmethod
    def _name(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:40]

    def _path(self, kind: str, key: str) -> str:
        return os.path.join(self.root, kind, self._name(key))

    def _atomic_write(self, path: str, data: bytes) -> None:
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".tmp-{os.getpid()}-{os.urandom(6).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _read(self, kind: str, key: str) -> dict | None:
        try:
            with open(self._path(kind, key), "rb") as fh:
                blob = fh.read()
        except FileNotFoundError:
            return None
        try:
            record = msgpack.unpackb(self._dctx.decompress(blob), raw=False)
        except Exception as exc:  # noqa: BLE001 - corrupt entry: recompute, do not serve
            raise CheckpointError(f"corrupt checkpoint entry for {key!r}: {exc}") from exc
        if record.get("key") != key or record.get("fingerprint") != self.fingerprint:
            return None  # another key (hash clash) or another fingerprint: not served
        return record

    def load(self, key: str) -> StoredEntry | None:
        """The stored outcome of ``key`` under this fingerprint, or None."""
        record = self._read("ok", key)
        if record is not None:
            value = decode_value(record["value"], allow_pickle=self.allow_pickle)
            return StoredEntry(True, value, None, record["attempts"], record["duration_s"])
        record = self._read("failed", key)
        if record is not None:
            return StoredEntry(False, None, record["error"], record["attempts"],
                               record["duration_s"])
        return None

    def save_success(self, key: str, subject_id: str, value: Any, attempts: int,
                     duration_s: float) -> None:
        data = encode_value(value, allow_pickle=self.allow_pickle)
        record = {"key": key, "subject": subject_id, "fingerprint": self.fingerprint,
                  "value": data, "attempts": attempts, "duration_s": duration_s,
                  "time": time.time()}
        self._atomic_write(self._path("ok", key), self._cctx.compress(
            msgpack.packb(record, use_bin_type=True)))
        try:
            os.unlink(self._path("failed", key))
        except FileNotFoundError:
            pass

    def save_failure(self, key: str, subject_id: str, error: dict, attempts: int,
                     duration_s: float) -> None:
        record = {"key": key, "subject": subject_id, "fingerprint": self.fingerprint,
                  "error": error, "attempts": attempts, "duration_s": duration_s,
                  "time": time.time()}
        self._atomic_write(self._path("failed", key), self._cctx.compress(
            msgpack.packb(record, use_bin_type=True)))

    def clear(self) -> None:
        """Remove the whole store (the run still holds the lock while it does)."""
        self.close()
        shutil.rmtree(self.root, ignore_errors=True)
