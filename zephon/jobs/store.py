"""The resumable checkpoint store of a job run: one SQLite database, group-committed.

Layout of ``<checkpoint_dir>`` (mode 0700), a bounded set of files whatever the
number of subjects::

    LOCK           flock'ed for the whole run: a second run on the same directory
                   fails at once with the holder's pid
    FINGERPRINT    the fingerprint of the last run that opened the store
    jobs.db        the entries: table ``entries(key, kind, record)``, kind 0 = the
                   success of a subject, 1 = its last recorded failure (kept apart)
    jobs.db-wal    SQLite's write-ahead log, present while the store is open (and
                   after a crash, until the next open replays it)

A record is the bytes :mod:`zephon.jobs.store_codec` describes (msgpack ``{key,
subject, fingerprint, value | error, attempts, duration_s, time}``, zstd-compressed
from 512 bytes on; values msgpack-native, NumPy arrays and scalars, tuples, big
integers; a pickle only with ``allow_pickle=True``), framed with a CRC-32 of all its
bytes: a byte damaged on disk is caught when the record is read, never served. A
stored ``None`` is a value like any other: a hit.

Durability (group commit): ``save_success``/``save_failure`` queue the entry in
memory (``load`` sees it at once); a background thread writes every queued entry in
one SQLite transaction when ``commit_every`` entries wait, and else at most
``commit_interval_s`` after its previous commit (the saving thread commits itself
when ``2 * commit_every`` wait: the disk is behind); :meth:`flush` and :meth:`close`
commit at once. The database runs in WAL mode with ``locking_mode=EXCLUSIVE`` (no
``-shm`` file: the store is single-process by its lock) and ``synchronous=FULL``:
the log is fsync'ed at every commit, so a committed entry survives a power loss as
well as a crash. (``synchronous=NORMAL`` would skip that fsync: still safe against a
process crash, but a power loss could roll back the last commits; with one fsync per
group of entries FULL costs little.) So a SIGKILL, an OOM kill or a power loss
loses at most the entries of the last ``commit_interval_s`` seconds (0.5 s by
default) and of the commit under way, never more than ``2 * commit_every`` entries;
a resumed run recomputes their subjects. A transaction is atomic, so a torn entry
is never served.

Per-entry cost: a save packs the value and the record with packers the store keeps
(one per kind of bytes), and queues it under one lock; a commit is one
``executemany`` per kind of statement. A store that held no entry when it was
opened (``empty_at_open``) holds no failure record but those this run saved (their
keys are remembered), so a success queues no DELETE of one; a store with entries
queues one per success. The run does not look up a store that was empty at open.

Trust: the store uses nothing it did not write. The directory is opened once with
``O_NOFOLLOW`` and must be a real directory owned by the current user and not
writable by group or others, else opening raises
:class:`~zephon.errors.CheckpointError` without touching it (one merely readable by
others is tightened to 0700 through its descriptor). ``LOCK``, ``FINGERPRINT``,
``jobs.db`` and ``jobs.db-wal`` are opened relative to that descriptor with
``O_NOFOLLOW | O_NONBLOCK`` and accepted only as regular files owned by the current
user (the database files also not writable by group or others): a symlink, a FIFO,
a device or a file of another user is refused, never followed, read or truncated.
SQLite opens the database by path; the store then checks that the path still names
the directory and the file it vetted (same device and inode) before using it.
Temporary files left by writers that died are removed at open.

Bad entries: :meth:`load` and :meth:`load_many` report every kind of bad entry
(a checksum mismatch, truncated or corrupt, a record with missing or mistyped fields, a record written
for another key, a value that does not decode, a pickle this store does not allow)
as a :class:`~zephon.errors.CheckpointError` naming the entry, the subject key and
what is wrong; the run decides (recompute, or fail that subject); a bad entry is
never a reason to abort a run. A ``jobs.db`` that is not a database at all (damaged
beyond SQLite's recovery) is moved aside as ``jobs.db.damaged-<time>`` with a
warning, and the run starts a new one (every subject is recomputed).

Fingerprints: every entry records the fingerprint it was written under and is served
only to a run with the same fingerprint. With ``strict=True`` opening a store whose
FINGERPRINT differs raises :class:`~zephon.errors.CheckpointError`; otherwise the
other fingerprint's entries are simply not served (and are overwritten as subjects
are recomputed).

Old stores: a directory in the first format (``ok/`` and ``failed/``, one file per
subject) is migrated when opened (:mod:`zephon.jobs.store_legacy`): its trusted
entries are copied into ``jobs.db`` in one transaction (each record unchanged inside
its checksum frame), then the two directories are removed; a crash in between
migrates again (entries already in the database are kept). A ``jobs.db`` of the
second format (records without a checksum) is upgraded in place when opened, in one
transaction (:mod:`zephon.jobs.store_db`); a store of a format this version does not
know is refused by name.

Modules: this one owns the lock, the fingerprint, the queue and its commit thread,
and the API; :mod:`zephon.jobs.store_db` the database (opening, transactions,
migration), :mod:`zephon.jobs.store_files` the trust rules of files and directories,
:mod:`zephon.jobs.store_codec` the bytes of an entry, :mod:`zephon.jobs.store_legacy`
reading the first format.

Lifecycle: open (lock, vet, migrate, fingerprint, start the commit thread) ->
load/save from one thread -> :meth:`close` (commit, stop the thread, checkpoint the
log into ``jobs.db``, unlock) or :meth:`clear` (remove everything, unlock).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from typing import Any, Sequence

from zephon.errors import CheckpointError
from zephon.jobs.store_codec import (
    KIND_FAILED,
    KIND_OK,
    RecordCodec,
    decode_value,
    encode_value,
)
from zephon.jobs.store_db import DB_NAME, migrate, open_db, select_records, write_batch
from zephon.jobs.store_files import O_CLOEXEC, O_NOFOLLOW, check_file, open_dir, read_vetted
from zephon.jobs.store_legacy import has_legacy_layout

__all__ = ["CheckpointStore", "StoredEntry", "decode_value", "encode_value"]

log = logging.getLogger("zephon.jobs")

_TMP_PREFIX = ".tmp-"


class StoredEntry:
    __slots__ = ("attempts", "duration_s", "error", "ok", "value")

    def __init__(self, ok: bool, value: Any, error: dict | None, attempts: int,
                 duration_s: float) -> None:
        self.ok, self.value, self.error = ok, value, error
        self.attempts, self.duration_s = attempts, duration_s


class CheckpointStore:
    """One run's view of a checkpoint directory (see the module docstring).

    Opening it creates the store if needed and takes its lock; :meth:`load`,
    :meth:`load_many`, :meth:`save_success`, :meth:`save_failure`, :meth:`flush`;
    :meth:`close` commits and releases the lock, :meth:`clear` removes the store.
    ``zephon.jobs.run`` opens one itself; use it directly (or as a context manager)
    to inspect a store.

    Args:
        root: the store directory.
        fingerprint: what the results depend on; entries of another fingerprint are
            not served (None: the empty fingerprint).
        strict: refuse a store last opened under another fingerprint.
        allow_pickle: store and load values msgpack cannot encode with pickle.
        commit_every: commit at once when this many entries wait (default
            :attr:`COMMIT_EVERY`).
        commit_interval_s: the longest an entry waits for its commit (default
            :attr:`COMMIT_INTERVAL_S`): the durability window.

    Raises:
        CheckpointError: the directory or a file of the store cannot be trusted,
            another run holds its lock, it is of an unknown format, or (``strict``) it
            was written under another fingerprint.

    Examples:
        >>> store = zephon.jobs.CheckpointStore("ckpt", "v1")
        >>> store.save_success("key-a", "a", {"n": 3}, attempts=1, duration_s=0.5)
        >>> store.load("key-a").value, store.load("key-b")
        ({'n': 3}, None)
        >>> store.close()
    """

    #: Entries that trigger a commit at once.
    COMMIT_EVERY = 4096
    #: Seconds an entry waits at most for its commit.
    COMMIT_INTERVAL_S = 0.5

    def __init__(self, root: str, fingerprint: str | None, *, strict: bool = False,
                 allow_pickle: bool = False, commit_every: int | None = None,
                 commit_interval_s: float | None = None) -> None:
        self.root = os.path.abspath(root)
        self._db_file = os.path.join(self.root, DB_NAME)
        self.fingerprint = "" if fingerprint is None else str(fingerprint)
        self.allow_pickle = allow_pickle
        self.commit_every = int(commit_every or self.COMMIT_EVERY)
        self.commit_interval_s = float(commit_interval_s or self.COMMIT_INTERVAL_S)
        self._codec = RecordCodec(allow_pickle)
        self.empty_at_open = False  # the database held no entry when this run opened it
        self._failed_keys: set[str] = set()  # keys given a failure since (empty_at_open)
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None
        self._db: sqlite3.Connection | None = None
        self._pending: dict[tuple[str, int], bytes | None] = {}  # None: delete
        self._committing: dict[tuple[str, int], bytes | None] = {}  # being written
        self._mutex = threading.Lock()  # the queued entries
        self._db_lock = threading.Lock()  # the connection (taken before _mutex)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        parent = os.path.dirname(self.root)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create {parent} for the checkpoint store: "
                                  f"{exc}") from exc
        self._dir_fd = open_dir(self.root, create=True)
        try:
            self._lock_fd = self._lock()
            self._remove_leftover_temp_files()
            self._db = open_db(self.root, self._dir_fd)
            if has_legacy_layout(self._dir_fd):
                migrate(self._db, self.root, self._dir_fd, self._codec)
            self._check_fingerprint(strict)
            self.empty_at_open = self._db.execute(
                "SELECT 1 FROM entries LIMIT 1").fetchone() is None
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._commit_loop, daemon=True,
                                        name=f"zephon-store-commit:{self.root}")
        self._thread.start()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- lock, leftovers and fingerprint -----------------------------------------------------
    def _lock(self) -> int:
        import fcntl

        assert self._dir_fd is not None
        path = os.path.join(self.root, "LOCK")
        try:
            fd = os.open("LOCK", os.O_RDWR | os.O_CREAT | O_NOFOLLOW | os.O_NONBLOCK |
                         O_CLOEXEC, 0o600, dir_fd=self._dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(
                    f"{path} is a symbolic link; refusing to follow it (someone else put it "
                    "there: remove it)") from None
            raise CheckpointError(f"cannot open {path}: {exc}") from exc
        try:
            check_file(fd, path)
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

    def _remove_leftover_temp_files(self) -> None:
        removed = 0
        for name in os.listdir(self._dir_fd):
            if name.startswith(_TMP_PREFIX):
                try:
                    os.unlink(name, dir_fd=self._dir_fd)
                    removed += 1
                except OSError:
                    pass
        if removed:
            log.info("removed %d temporary file(s) left in %s by writers that died", removed,
                     self.root)

    def _check_fingerprint(self, strict: bool) -> None:
        assert self._dir_fd is not None
        path = os.path.join(self.root, "FINGERPRINT")
        try:
            blob = read_vetted(self._dir_fd, "FINGERPRINT", path, "fingerprint file")
            recorded = None if blob is None else json.loads(blob.decode())["fingerprint"]
            if recorded is not None and not isinstance(recorded, str):
                raise CheckpointError(f"the fingerprint is a {type(recorded).__name__}")
        except (CheckpointError, ValueError, KeyError, TypeError) as exc:
            if strict:
                raise CheckpointError(f"{path} is unreadable ({exc}) and "
                                      "strict_checkpoint_hash is on") from exc
            log.warning("%s is unreadable (%s); rewriting it", path, exc)
            recorded = None
            try:
                os.unlink("FINGERPRINT", dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass
        if recorded is not None and recorded != self.fingerprint and strict:
            raise CheckpointError(
                f"checkpoint directory {self.root} was written under fingerprint "
                f"{recorded!r}, this run's is {self.fingerprint!r} (strict_checkpoint_hash); "
                "use a new checkpoint_dir, clear this one, or disable strict_checkpoint_hash")
        self.previous_fingerprint = recorded
        if recorded != self.fingerprint:
            self._atomic_write("FINGERPRINT",
                               json.dumps({"fingerprint": self.fingerprint}).encode())

    def _atomic_write(self, name: str, data: bytes) -> None:
        dfd = self._dir_fd
        assert dfd is not None
        tmp = f"{_TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC,
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

    # -- commits -----------------------------------------------------------------------------
    def _commit_loop(self) -> None:
        while True:
            self._wake.wait(self.commit_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.flush()
            except BaseException as exc:  # noqa: BLE001 - reported by the next save/close
                self._thread_error = exc
                return

    def _raise_thread_error(self) -> None:
        if self._thread_error is not None:
            raise CheckpointError(f"committing to {self._db_file} failed: "
                                  f"{self._thread_error}") from self._thread_error

    def flush(self) -> None:
        """Commit every queued entry now (one transaction, one fsync).

        Raises:
            CheckpointError: the commit failed (the entries stay queued).

        Examples:
            >>> with zephon.jobs.CheckpointStore("ckpt", None) as store:
            ...     store.save_success("k", "s", 1, attempts=1, duration_s=0.1)
            ...     store.flush()
        """
        with self._db_lock:  # one commit at a time; saves go on meanwhile
            with self._mutex:
                if not self._pending or self._db is None:
                    return
                batch = self._committing = self._pending
                self._pending = {}
            try:
                write_batch(self._db, batch, self._db_file)
            except BaseException:
                with self._mutex:  # queued again; what was saved since is newer
                    batch.update(self._pending)
                    self._pending, self._committing = batch, {}
                raise
            with self._mutex:
                self._committing = {}

    def _queue(self, key: str, kind: int, blob: bytes, clear_failure: bool = False) -> None:
        """Queue ``blob`` as the ``kind`` entry of ``key`` (and the removal of its failure
        record with ``clear_failure``); commit or wake the commit thread when due."""
        self._raise_thread_error()
        if self._db is None:
            raise CheckpointError(f"checkpoint store {self.root} is closed")
        with self._mutex:
            if clear_failure:
                self._pending[(key, KIND_FAILED)] = None
            self._pending[(key, kind)] = blob
            waiting = len(self._pending)
        if waiting >= 2 * self.commit_every:
            self.flush()  # the commit thread is behind: wait for the disk here
        elif waiting >= self.commit_every:
            self._wake.set()

    # -- entries -----------------------------------------------------------------------------
    def _rows(self, keys: Sequence[str]) -> dict[str, dict[int, Any]]:
        """``{key: {kind: record bytes}}`` of ``keys``: the database overlaid with the
        queued entries."""
        found: dict[str, dict[int, Any]] = {}
        with self._db_lock:
            if self._db is None:
                raise CheckpointError(f"checkpoint store {self.root} is closed")
            select_records(self._db, keys, self._db_file, found)
        with self._mutex:
            for queued in (self._committing, self._pending):  # committed since: the same
                if queued:
                    for key in keys:
                        for kind in (KIND_OK, KIND_FAILED):
                            if (key, kind) in queued:
                                found.setdefault(key, {})[kind] = queued[(key, kind)]
        return found

    def _entry(self, key: str, kinds: dict[int, Any]) -> StoredEntry | None:
        """The stored outcome of ``key`` given its records (see :meth:`load`)."""
        where = f"checkpoint entry for {key!r}: {self._db_file}"
        blob = kinds.get(KIND_OK)
        if blob is not None:
            record = self._codec.judge(blob, key, KIND_OK, self.fingerprint, f"{where} (success)")
            if record is not None:
                try:
                    value = decode_value(record["value"], allow_pickle=self.allow_pickle)
                except CheckpointError as exc:
                    raise CheckpointError(f"{where} (success): {exc}") from None
                except Exception as exc:  # noqa: BLE001 - whatever the bad bytes raise
                    raise CheckpointError(
                        f"{where} (success) is corrupt: its value does not decode: "
                        f"{type(exc).__name__}: {exc}") from None
                return StoredEntry(True, value, None, record["attempts"], record["duration_s"])
        blob = kinds.get(KIND_FAILED)
        if blob is not None:
            record = self._codec.judge(blob, key, KIND_FAILED, self.fingerprint,
                                       f"{where} (failure)")
            if record is not None:
                return StoredEntry(False, None, record["error"], record["attempts"],
                                   record["duration_s"])
        return None

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

        Examples:
            >>> store = zephon.jobs.CheckpointStore("ckpt", None)
            >>> store.load("missing") is None
            True
            >>> store.close()
        """
        return self._entry(key, self._rows([key]).get(key, {}))

    def load_many(self, keys: Sequence[str]) -> list[StoredEntry | CheckpointError | None]:
        """The stored outcomes of ``keys``, in order, looked up in batches: per key what
        :meth:`load` returns, or the CheckpointError it would raise.

        Args:
            keys: the subjects' cache keys.

        Returns:
            One ``StoredEntry``, ``None`` or ``CheckpointError`` per key.

        Examples:
            >>> with zephon.jobs.CheckpointStore("ckpt", None) as store:
            ...     store.save_success("a", "a", 1, attempts=1, duration_s=0.1)
            ...     [e if e is None else e.value for e in store.load_many(["a", "b"])]
            [1, None]
        """
        rows = self._rows(list(keys))
        out: list[StoredEntry | CheckpointError | None] = []
        for key in keys:
            try:
                out.append(self._entry(key, rows.get(key, {})))
            except CheckpointError as exc:
                out.append(exc)
        return out

    def save_success(self, key: str, subject_id: str, value: Any, attempts: int,
                     duration_s: float) -> None:
        """Record a success of ``key`` (it replaces an earlier entry and removes the
        subject's failure record; committed within the durability window).

        Args:
            key: the subject's cache key.
            subject_id: the subject's id.
            value: the result (msgpack-native types, NumPy arrays and scalars, tuples;
                anything else only with ``allow_pickle``).
            attempts: how many times the subject ran.
            duration_s: seconds the last attempt took.

        Raises:
            SerializationError: a value that cannot be stored.
            CheckpointError: a failed commit, or a closed store.

        Examples:
            >>> store = zephon.jobs.CheckpointStore("ckpt", None)
            >>> store.save_success("k", "s", np.arange(3), attempts=1, duration_s=0.1)
            >>> store.load("k").value.tolist()
            [0, 1, 2]
            >>> store.close()
        """
        data = self._codec.encode(value)
        blob = self._codec.pack({"key": key, "subject": subject_id,
                                 "fingerprint": self.fingerprint, "value": data,
                                 "attempts": attempts, "duration_s": duration_s,
                                 "time": time.time()})
        # A store that was empty at open holds no failure but those this run saved: no
        # DELETE per success for a failure record that cannot exist.
        clear_failure = not self.empty_at_open or key in self._failed_keys
        if clear_failure:
            self._failed_keys.discard(key)
        self._queue(key, KIND_OK, blob, clear_failure=clear_failure)

    def save_failure(self, key: str, subject_id: str, error: dict, attempts: int,
                     duration_s: float) -> None:
        """Record a failure of ``key`` (kept apart from successes).

        Args:
            key: the subject's cache key.
            subject_id: the subject's id.
            error: ``{"type", "message", "traceback"}`` of the failure.
            attempts: how many times the subject ran.
            duration_s: seconds the last attempt took.

        Examples:
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
        blob = self._codec.pack(record)
        if self.empty_at_open:
            self._failed_keys.add(key)
        self._queue(key, KIND_FAILED, blob)

    def keys(self, kind: int = KIND_OK) -> list[str]:
        """The keys holding an entry of ``kind``, of any fingerprint (what is queued is
        committed first).

        Args:
            kind: 0 for successes, 1 for recorded failures.

        Returns:
            The keys, in no particular order.

        Examples:
            >>> with zephon.jobs.CheckpointStore("ckpt", None) as store:
            ...     store.save_success("a", "a", 1, attempts=1, duration_s=0.1)
            ...     sorted(store.keys())
            ['a']
        """
        self.flush()
        with self._db_lock:
            if self._db is None:
                raise CheckpointError(f"checkpoint store {self.root} is closed")
            rows = self._db.execute("SELECT key FROM entries WHERE kind = ?",
                                    (kind,)).fetchall()
        return [row[0] for row in rows]

    # -- closing -----------------------------------------------------------------------------
    def _stop_thread(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def _release(self) -> None:
        """Close the database, the lock and the directory descriptor (no commit)."""
        if self._db is not None:
            with self._db_lock:
                db, self._db = self._db, None
                try:
                    db.close()  # checkpoints the log into jobs.db, removes jobs.db-wal
                except sqlite3.Error as exc:
                    log.warning("closing %s: %s", self._db_file, exc)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def close(self) -> None:
        """Commit what is queued, then release the database and the lock (idempotent).

        Raises:
            CheckpointError: the last commit failed (the store is released all the same).

        Examples:
            >>> store = zephon.jobs.CheckpointStore("ckpt", None)
            >>> store.close()
        """
        self._stop_thread()
        try:
            self.flush()
            self._raise_thread_error()
        finally:
            self._release()

    def clear(self) -> None:
        """Remove the whole store, then release the lock (the run holds it while removing).

        Examples:
            >>> store = zephon.jobs.CheckpointStore("ckpt", None)
            >>> store.clear()
            >>> import os; os.path.exists("ckpt")
            False
        """
        self._stop_thread()
        with self._mutex:
            self._pending.clear()
        lock_fd, self._lock_fd = self._lock_fd, None  # held until the files are gone
        try:
            self._release()
            shutil.rmtree(self.root, ignore_errors=True)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
