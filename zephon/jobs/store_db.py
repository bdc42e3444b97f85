"""The SQLite database of the checkpoint store: opening it safely, and its transactions.

Owns ``<checkpoint_dir>/jobs.db`` (and ``jobs.db-wal``): vetting the files before
SQLite opens them (:mod:`zephon.jobs.store_files`'s rules, the database files also
not writable by group or others), checking after opening that the path still names
the vetted directory and file, the journal setup (WAL, ``locking_mode=EXCLUSIVE``,
``synchronous=FULL``), the format version, setting a file that is not a database
aside, migrating a store of an earlier format, and the batch transaction. The
durability and locking story is :mod:`zephon.jobs.store`'s; this module holds no
state.

Formats (``meta.format``): 3 (:data:`STORE_FORMAT`) stores every record framed with
its checksum (:mod:`zephon.jobs.store_codec`). A database of format 2 (the same
tables, records without a checksum) is upgraded when opened: one transaction frames
every record, its bytes unchanged inside, and sets the format to 3 (a crash before the
commit leaves format 2, upgraded again at the next open; an upgrade that fails for
want of space raises :class:`~zephon.errors.CheckpointError`, the store unchanged); the
checksum then protects the record from that point on. An earlier zephon refuses a
format-3 store by name; a store of any other format is refused, naming it and the way
out.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from typing import Any, Sequence

from zephon.errors import CheckpointError
from zephon.jobs.store_codec import RecordCodec, frame
from zephon.jobs.store_files import O_CLOEXEC, O_NOFOLLOW, open_vetted
from zephon.jobs.store_legacy import legacy_entries, remove_legacy

__all__ = ["DB_NAME", "STORE_FORMAT", "migrate", "open_db", "select_records", "write_batch"]

log = logging.getLogger("zephon.jobs")

DB_NAME = "jobs.db"
STORE_FORMAT = "zephon-jobs-store/3"
#: The previous format: the same tables, records without a checksum (upgraded at open).
_FORMAT_UNCHECKSUMMED = "zephon-jobs-store/2"
_LOOKUP_CHUNK = 500  # keys per SELECT ... IN (...)
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries (key TEXT NOT NULL, kind INTEGER NOT NULL, "
    "record BLOB NOT NULL, PRIMARY KEY (key, kind)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
)


def _vet_db_files(root: str, dir_fd: int) -> int:
    """Check ``jobs.db`` (creating it 0600 if absent) and its ``-wal``/``-shm``
    companions; returns a descriptor of the vetted ``jobs.db``."""
    db_file = os.path.join(root, DB_NAME)
    for suffix in ("-wal", "-shm"):
        fd = open_vetted(dir_fd, DB_NAME + suffix, db_file + suffix,
                         "checkpoint database file", private=True)
        if fd is not None:
            os.close(fd)
    fd = open_vetted(dir_fd, DB_NAME, db_file, "checkpoint database", private=True)
    if fd is None:
        try:
            fd = os.open(DB_NAME, os.O_RDONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW |
                         O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            raise CheckpointError(f"cannot create {db_file}: {exc}") from exc
    return fd


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _connect(root: str, dir_fd: int, vetted: os.stat_result) -> sqlite3.Connection:
    """Open the vetted database, check it is the file that was vetted, set the journal
    up; raises sqlite3.DatabaseError when the file is not a database."""
    db_file = os.path.join(root, DB_NAME)
    db = sqlite3.connect(db_file, isolation_level=None, check_same_thread=False, timeout=0)
    try:
        db.execute("PRAGMA locking_mode=EXCLUSIVE")
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if not (_same_file(os.stat(root), os.fstat(dir_fd))
                and _same_file(os.stat(db_file), vetted)):
            raise CheckpointError(f"{db_file} was replaced while the store opened it; "
                                  "refused")
        if str(mode).lower() != "wal":
            raise CheckpointError(f"{db_file}: SQLite refused WAL mode ({mode})")
        db.execute("PRAGMA synchronous=FULL")
        for statement in _SCHEMA:
            db.execute(statement)
        _check_format(db, db_file)
    except BaseException:
        db.close()
        raise
    return db


def _check_format(db: sqlite3.Connection, db_file: str) -> None:
    row = db.execute("SELECT value FROM meta WHERE name = 'format'").fetchone()
    if row is None:
        db.execute("INSERT INTO meta VALUES ('format', ?)", (STORE_FORMAT,))
    elif row[0] == _FORMAT_UNCHECKSUMMED:
        _add_checksums(db, db_file)
    elif row[0] != STORE_FORMAT:
        raise CheckpointError(
            f"{db_file} is a store of format {row[0]!r:.100}, this version reads "
            f"{STORE_FORMAT!r}; use another checkpoint_dir or clear this one")


def _frame_record(record: Any) -> Any:
    """SQL function of :func:`_add_checksums`: a record of format 2 framed; anything
    that is not bytes is left as it is (refused when read, like any bad entry)."""
    return frame(record) if isinstance(record, bytes) and record else record


def _add_checksums(db: sqlite3.Connection, db_file: str) -> None:
    """Upgrade a store of format 2 to :data:`STORE_FORMAT` in one transaction: every
    record framed with its checksum (see the module docstring)."""
    started = time.monotonic()
    db.create_function("zephon_frame_record", 1, _frame_record, deterministic=True)
    db.execute("BEGIN")
    try:
        count = db.execute("UPDATE entries SET record = zephon_frame_record(record)").rowcount
        db.execute("UPDATE meta SET value = ? WHERE name = 'format'", (STORE_FORMAT,))
        db.execute("COMMIT")
    except BaseException as exc:
        if db.in_transaction:
            db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.OperationalError):  # disk full, I/O: not a damaged file
            raise CheckpointError(
                f"upgrading {db_file} from format {_FORMAT_UNCHECKSUMMED} to {STORE_FORMAT} "
                f"failed ({exc}); the store is unchanged: free some space (the upgrade "
                "rewrites every entry once) and run again, or use another checkpoint_dir"
            ) from exc
        raise
    finally:
        db.create_function("zephon_frame_record", 1, None)
    log.info("upgraded %s from format %s to %s: checksummed its %d entr%s in %.1f s",
             db_file, _FORMAT_UNCHECKSUMMED, STORE_FORMAT, count,
             "y" if count == 1 else "ies", time.monotonic() - started)


def _set_damaged_aside(root: str, dir_fd: int, exc: BaseException) -> None:
    aside = f"{DB_NAME}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(3).hex()}"
    log.warning("checkpoint database %s is damaged (%s); moved it aside as %s and "
                "starting a new store: every subject is recomputed",
                os.path.join(root, DB_NAME), exc, aside)
    for suffix in ("", "-wal", "-shm"):
        try:
            os.rename(DB_NAME + suffix, aside + suffix, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def open_db(root: str, dir_fd: int) -> sqlite3.Connection:
    """The store's database in the directory ``dir_fd`` (``root``), created if absent;
    a file that is not a database is set aside once and a new one started."""
    for attempt in (0, 1):
        fd = _vet_db_files(root, dir_fd)
        try:
            return _connect(root, dir_fd, os.fstat(fd))
        except sqlite3.DatabaseError as exc:
            if attempt:
                raise CheckpointError(f"{os.path.join(root, DB_NAME)}: {exc}") from exc
            _set_damaged_aside(root, dir_fd, exc)
        finally:
            os.close(fd)
    raise AssertionError("unreachable")


def migrate(db: sqlite3.Connection, root: str, dir_fd: int, codec: RecordCodec) -> None:
    """Copy an old-format store (``ok/``, ``failed/``) into the database, each record
    framed with its checksum, then remove its directories (see
    :mod:`zephon.jobs.store_legacy`); entries already in the database are kept."""
    skipped: list[str] = []
    moved = 0
    db.execute("BEGIN")
    try:
        for key, kind, blob in legacy_entries(root, dir_fd, codec, skipped):
            db.execute("INSERT OR IGNORE INTO entries VALUES (?, ?, ?)",
                       (key, kind, frame(blob)))
            moved += 1
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    remove_legacy(root, dir_fd)
    log.info("migrated %d entr%s of the old one-file-per-subject store %s into %s",
             moved, "y" if moved == 1 else "ies", root, DB_NAME)
    if skipped:
        log.warning("%d entr%s of the old store %s not migrated (recomputed when needed), "
                    "e.g. %s", len(skipped), "y" if len(skipped) == 1 else "ies", root,
                    skipped[0])


def write_batch(db: sqlite3.Connection, batch: dict[tuple[str, int], bytes | None],
                db_file: str) -> None:
    """One transaction writing ``batch`` (``{(key, kind): record, or None to delete}``)."""
    puts = [(k, kind, blob) for (k, kind), blob in batch.items() if blob is not None]
    dels = [(k, kind) for (k, kind), blob in batch.items() if blob is None]
    try:
        db.execute("BEGIN")
        db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)", puts)
        db.executemany("DELETE FROM entries WHERE key = ? AND kind = ?", dels)
        db.execute("COMMIT")
    except BaseException as exc:
        if db.in_transaction:
            db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise CheckpointError(f"committing to {db_file} failed: {exc}") from exc
        raise


def select_records(db: sqlite3.Connection, keys: Sequence[str], db_file: str,
                   found: dict[str, dict[int, Any]]) -> None:
    """Add ``{key: {kind: record}}`` of ``keys`` to ``found``, ``_LOOKUP_CHUNK`` keys per
    query."""
    for start in range(0, len(keys), _LOOKUP_CHUNK):
        chunk = keys[start:start + _LOOKUP_CHUNK]
        marks = ",".join("?" * len(chunk))
        try:
            rows = db.execute(f"SELECT key, kind, record FROM entries WHERE key IN ({marks})",
                              chunk).fetchall()
        except sqlite3.DatabaseError as exc:
            raise CheckpointError(f"{db_file} cannot be read: {exc}") from exc
        for key, kind, record in rows:
            found.setdefault(key, {})[kind] = record
