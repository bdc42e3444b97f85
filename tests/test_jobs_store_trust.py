"""The checkpoint store trusts nothing it did not write, and one bad entry never aborts a
resumed run.

The store's directory and its files (``LOCK``, ``jobs.db`` and its log) are judged as
files: a symlink, a FIFO, a file of another user or one writable by others is refused
at open, never followed. Its entries are rows of ``jobs.db``: a bad row (damaged,
forged from another subject's record, a pickle not allowed) costs only its subject,
which is recomputed. Rows are damaged here the way anyone able to write the file
could, through SQLite itself, with the store closed.

Real files, real symlinks, a real FIFO, /dev/zero, and a real other user (``nobody``):
the suite runs as root in CI, so the tests create the foreign directory or entry
themselves and ``chown`` it; they are skipped, with the reason, when not root.
"""

from __future__ import annotations

import logging
import os
import pwd
import sqlite3
import stat

import msgpack
import pytest
import zstandard

import _job_fns as J
from zephon.errors import CheckpointError
from zephon.jobs import CheckpointStore, RunPolicy, run
from zephon.jobs.store_codec import frame
from zephon.jobs.subjects import cache_key_of

FAST = dict(graceful_shutdown_sec=2.0, subject_spawn_timeout_sec=60.0)

root_only = pytest.mark.skipif(os.geteuid() != 0,
                               reason="needs root to create files owned by another user")


def nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def subjects(tmp_path, n, action="ok"):
    d = tmp_path / "log"
    d.mkdir(parents=True, exist_ok=True)
    return [{"subject_id": f"S{i:03d}", "dir": str(d), "action": action} for i in range(n)]


def key_of(subject) -> str:
    return cache_key_of(J.work, subject, subject["subject_id"])


def db_path(store_dir) -> str:
    return os.path.join(store_dir, "jobs.db")


def read_record(store_dir, key, kind=0) -> bytes:
    """The raw record of an entry of a closed store (what an attacker with write access to
    the file could change)."""
    db = sqlite3.connect(db_path(store_dir))
    try:
        return db.execute("SELECT record FROM entries WHERE key = ? AND kind = ?",
                          (key, kind)).fetchone()[0]
    finally:
        db.close()


def write_record(store_dir, key, record, kind=0) -> None:
    """Replace (or add) the raw record of an entry of a closed store."""
    db = sqlite3.connect(db_path(store_dir))
    try:
        with db:
            db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)", (key, kind, record))
    finally:
        db.close()


def delete_record(store_dir, key, kind=0) -> None:
    db = sqlite3.connect(db_path(store_dir))
    try:
        with db:
            db.execute("DELETE FROM entries WHERE key = ? AND kind = ?", (key, kind))
    finally:
        db.close()


def go(subs, store_dir, **kwargs):
    extra = {"on_bad_entry": kwargs.pop("on_bad_entry")} if "on_bad_entry" in kwargs else {}
    job = run(J.work, subs, RunPolicy(checkpoint_dir=store_dir, auto_retry_rounds=0,
                                      **{**FAST, **kwargs}), progress=False, **extra)
    return job, list(job)


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    os.chmod(path, 0o644)
    return path


def untouched(victim) -> bool:
    return victim.read_text() == "precious" and stat.S_IMODE(os.stat(victim).st_mode) == 0o644


# -- the directory and its control files ------------------------------------------------

def test_a_lock_file_symlinked_to_a_victim_is_refused_and_the_victim_untouched(tmp_path,
                                                                             victim):
    store = tmp_path / "ckpt"
    CheckpointStore(str(store), "fp").close()
    os.unlink(store / "LOCK")
    os.symlink(victim, store / "LOCK")
    with pytest.raises(CheckpointError, match="LOCK.*symbolic link"):
        CheckpointStore(str(store), "fp")
    assert untouched(victim)


def test_a_symlinked_store_directory_is_refused_and_its_target_not_chmodded(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.chmod(target, 0o755)
    link = tmp_path / "ckpt"
    os.symlink(target, link)
    with pytest.raises(CheckpointError, match="symbolic link"):
        CheckpointStore(str(link), "fp")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755 and os.listdir(target) == []


@root_only
def test_a_store_owned_by_another_user_and_world_writable_is_refused(tmp_path):
    store = tmp_path / "ckpt"
    store.mkdir()
    os.chown(store, nobody(), nobody())
    os.chmod(store, 0o777)
    with pytest.raises(CheckpointError, match=f"owned by uid {nobody()}"):
        CheckpointStore(str(store), "fp")
    assert os.listdir(store) == [] and stat.S_IMODE(os.stat(store).st_mode) == 0o777


def test_a_store_of_ours_writable_by_others_is_refused(tmp_path):
    store = tmp_path / "ckpt"
    store.mkdir()
    os.chmod(store, 0o777)
    with pytest.raises(CheckpointError, match="writable by group or others"):
        CheckpointStore(str(store), "fp")
    assert os.listdir(store) == []


def test_a_symlinked_subdirectory_of_an_old_store_is_refused(tmp_path):
    store = tmp_path / "ckpt"
    store.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "entry").write_bytes(b"not ours to read")
    os.symlink(elsewhere, store / "ok")  # the old format's ok/ directory
    with pytest.raises(CheckpointError, match="ok.*symbolic link"):
        CheckpointStore(str(store), "fp")
    assert os.listdir(elsewhere) == ["entry"] and os.path.islink(store / "ok")


def test_leftover_temp_files_of_dead_writers_are_removed_at_open(tmp_path):
    store = tmp_path / "ckpt"
    CheckpointStore(str(store), "fp").close()
    (store / ".tmp-999999-0123456789ab").write_bytes(b"half a fingerprint")
    CheckpointStore(str(store), "fp").close()
    assert not [f for f in os.listdir(store) if f.startswith(".tmp-")]


def test_the_store_is_a_bounded_set_of_files(tmp_path):
    store = tmp_path / "ckpt"
    job, out = go(subjects(tmp_path, 50), str(store))
    assert len(out) == 50 and all(r.ok for r in out)
    assert sorted(os.listdir(store)) == ["FINGERPRINT", "LOCK", "jobs.db"]
    assert stat.S_IMODE(os.stat(store / "jobs.db").st_mode) == 0o600


# -- the database file and its log: refused as a whole, never followed ------------------

@pytest.mark.parametrize("name", ["jobs.db", "jobs.db-wal"])
def test_a_database_file_symlinked_to_a_victim_is_refused_and_the_victim_untouched(
        tmp_path, victim, name):
    store = tmp_path / "ckpt"
    CheckpointStore(str(store), "fp").close()
    if (store / name).exists():
        os.unlink(store / name)
    os.symlink(victim, store / name)
    with pytest.raises(CheckpointError, match=f"{name}.*symbolic link"):
        CheckpointStore(str(store), "fp")
    assert untouched(victim) and os.path.islink(store / name)


def test_a_log_symlinked_to_dev_zero_is_refused(tmp_path):
    store = tmp_path / "ckpt"
    CheckpointStore(str(store), "fp").close()
    os.symlink("/dev/zero", store / "jobs.db-wal")
    with pytest.raises(CheckpointError, match="jobs.db-wal.*symbolic link"):
        CheckpointStore(str(store), "fp")


@pytest.mark.timeout(60)
def test_a_fifo_database_is_refused_without_hanging(tmp_path):
    store = tmp_path / "ckpt"
    CheckpointStore(str(store), "fp").close()
    os.unlink(store / "jobs.db")
    os.mkfifo(store / "jobs.db", 0o600)
    with pytest.raises(CheckpointError, match="jobs.db.*not a regular file"):
        CheckpointStore(str(store), "fp")


def test_a_database_writable_by_others_is_refused(tmp_path):
    store = tmp_path / "ckpt"
    job, out = go(subjects(tmp_path, 2), str(store))
    os.chmod(store / "jobs.db", 0o666)
    with pytest.raises(CheckpointError, match="jobs.db.*writable by group or others"):
        go(subjects(tmp_path, 2), str(store))
    assert stat.S_IMODE(os.stat(store / "jobs.db").st_mode) == 0o666  # not chmodded


@root_only
def test_a_database_owned_by_another_user_is_refused(tmp_path):
    store = tmp_path / "ckpt"
    job, out = go(subjects(tmp_path, 2), str(store))
    os.chown(store / "jobs.db", nobody(), nobody())
    with pytest.raises(CheckpointError, match=f"jobs.db.*owned by uid {nobody()}"):
        go(subjects(tmp_path, 2), str(store))
    assert os.stat(store / "jobs.db").st_uid == nobody()


def test_a_database_that_is_not_one_is_set_aside_and_every_subject_recomputed(tmp_path,
                                                                            caplog):
    store = tmp_path / "ckpt"
    subs = subjects(tmp_path, 3)
    go(subs, str(store))
    (store / "jobs.db").write_bytes(os.urandom(8192))
    with caplog.at_level(logging.WARNING, logger="zephon.jobs"):
        job, out = go(subs, str(store))
    assert [r.from_cache for r in out] == [False] * 3 and all(r.ok for r in out)
    aside = [f for f in os.listdir(store) if f.startswith("jobs.db.damaged-")]
    assert len(aside) == 1 and any("damaged" in r.getMessage() for r in caplog.records)
    job, out = go(subs, str(store))
    assert all(r.from_cache for r in out)


# -- entries that are not what they claim -----------------------------------------------

def _stored(tmp_path, n=3):
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, n)
    job, out = go(subs, store)
    assert all(r.ok and not r.from_cache for r in out)
    return store, subs


def _check_one_refused(tmp_path, store, subs, caplog, what):
    with caplog.at_level(logging.WARNING, logger="zephon.jobs"):
        job, out = go(subs, store)
    assert [r.from_cache for r in out] == [True, False, True]
    assert all(r.ok for r in out)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                and "S001" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert what in warnings[0].getMessage() and "recomput" in warnings[0].getMessage()
    return warnings[0].getMessage()


@pytest.mark.timeout(120)
def test_an_entry_forged_from_another_subjects_record_is_not_served(tmp_path, caplog):
    store, subs = _stored(tmp_path)
    write_record(store, key_of(subs[1]), read_record(store, key_of(subs[0])))
    message = _check_one_refused(tmp_path, store, subs, caplog, "forged or moved")
    assert key_of(subs[0]) in message


def test_the_store_itself_raises_a_clear_error_for_each_refused_entry(tmp_path):
    store_dir = str(tmp_path / "ckpt")
    with CheckpointStore(store_dir, "fp") as store:
        for key in ("moved", "trunc", "text"):
            store.save_success(key, key, {"v": 1}, 1, 0.1)
    good = read_record(store_dir, "moved")
    write_record(store_dir, "moved", read_record(store_dir, "trunc"))
    write_record(store_dir, "trunc", good[:5])
    db = sqlite3.connect(db_path(store_dir))
    with db:
        db.execute("UPDATE entries SET record = 'a string' WHERE key = 'text'")
    db.close()
    with CheckpointStore(store_dir, "fp") as store:
        with pytest.raises(CheckpointError, match="'moved'.*written for key 'trunc'"):
            store.load("moved")
        with pytest.raises(CheckpointError, match="'trunc'.*corrupt"):
            store.load("trunc")
        with pytest.raises(CheckpointError, match="'text'.*corrupt: a str"):
            store.load("text")
        got = store.load_many(["moved", "absent", "trunc"])
        assert isinstance(got[0], CheckpointError) and got[1] is None
        assert isinstance(got[2], CheckpointError)


# -- one bad entry never aborts a resumed run ------------------------------------------

def _write_record(store_dir, key, record, kind=0):
    """A well-formed record with a good checksum (written by whoever can write the file):
    what it holds is judged, not its bytes."""
    blob = zstandard.ZstdCompressor().compress(msgpack.packb(record, use_bin_type=True))
    write_record(store_dir, key, frame(blob), kind)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["truncated", "garbage", "bad_array", "bad_record",
                                    "pickled", "bad_failure"])
def test_a_bad_entry_among_good_ones_is_recomputed_and_the_run_completes(tmp_path, caplog,
                                                                         damage):
    store, subs = _stored(tmp_path)
    key = key_of(subs[1])
    if damage == "truncated":
        record = read_record(store, key)
        write_record(store, key, record[:len(record) // 2])
    elif damage == "garbage":
        write_record(store, key, os.urandom(64))
    elif damage == "bad_array":  # well-formed entry, impossible array inside
        value = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<f4", [3, 3], b"\0" * 5],
                                                               use_bin_type=True)),
                              use_bin_type=True)
        _write_record(store, key, {"key": key, "subject": "S001", "fingerprint": "",
                                   "value": value, "attempts": 1, "duration_s": 0.1,
                                   "time": 0})
    elif damage == "bad_record":  # a record missing its fields, of the wrong types
        _write_record(store, key, {"key": key, "fingerprint": "", "value": 5,
                                   "attempts": "x"})
    elif damage == "pickled":  # a pickle entry, and this run does not allow pickle
        held = CheckpointStore(store, None, allow_pickle=True)
        held.save_success(key, "S001", {1, 2}, 1, 0.1)
        held.close()
    elif damage == "bad_failure":
        delete_record(store, key)
        _write_record(store, key, {"key": key, "subject": "S001", "fingerprint": "",
                                   "error": "boom", "attempts": 1, "duration_s": 0.1,
                                   "time": 0}, kind=1)
    with caplog.at_level(logging.WARNING, logger="zephon.jobs"):
        job, out = go(subs, store)
    assert [r.from_cache for r in out] == [True, False, True] and all(r.ok for r in out)
    assert job.summary["cached"] == 2 and job.summary["done"] == 1
    bad = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(bad) == 1 and "S001" in bad[0].getMessage()
    if damage in ("truncated", "garbage"):
        assert "checksum" in bad[0].getMessage() or "truncated" in bad[0].getMessage()
    else:  # checksummed bytes, refused for what they hold
        assert "checksum" not in bad[0].getMessage()
    job, out = go(subs, store)  # rewritten: served from now on
    assert all(r.from_cache and r.ok for r in out)


@pytest.mark.timeout(120)
def test_on_bad_entry_fail_marks_that_subject_failed_and_serves_the_others(tmp_path):
    store, subs = _stored(tmp_path)
    write_record(store, key_of(subs[1]), b"not zstd")
    job, out = go(subs, store, on_bad_entry="fail")
    assert [r.ok for r in out] == [True, False, True]
    assert isinstance(out[1].error, CheckpointError) and "S001" in str(out[1].error)
    assert job.summary["failed"] == 1 and job.summary["cached"] == 2


def test_on_bad_entry_is_validated():
    from zephon import ZephonConfigError

    with pytest.raises(ZephonConfigError, match="on_bad_entry"):
        run(J.work, ["S1"], RunPolicy(), on_bad_entry="ignore")
