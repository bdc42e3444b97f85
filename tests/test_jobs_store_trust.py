"""The checkpoint store trusts nothing it did not write, and one bad entry never aborts a
resumed run.

Real files, real symlinks, a real FIFO, /dev/zero, and a real other user (``nobody``):
the suite runs as root in CI, so the tests create the foreign directory or entry
themselves and ``chown`` it; they are skipped, with the reason, when not root.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat

import msgpack
import pytest
import zstandard

import _job_fns as J
from zephon.errors import CheckpointError
from zephon.jobs import CheckpointStore, RunPolicy, run
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


def entry_path(store_dir, subject, kind="ok") -> str:
    key = cache_key_of(J.work, subject, subject["subject_id"])
    return os.path.join(store_dir, kind, CheckpointStore._name(key))


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


def test_a_symlinked_subdirectory_is_refused(tmp_path):
    store = tmp_path / "ckpt"
    CheckpointStore(str(store), "fp").close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rmdir(store / "ok")
    os.symlink(elsewhere, store / "ok")
    with pytest.raises(CheckpointError, match="ok.*symbolic link"):
        CheckpointStore(str(store), "fp")
    assert os.listdir(elsewhere) == []


def test_leftover_temp_files_of_dead_writers_are_removed_at_open(tmp_path):
    store = tmp_path / "ckpt"
    CheckpointStore(str(store), "fp").close()
    for sub in ("ok", "failed", "."):
        (store / sub / ".tmp-999999-0123456789ab").write_bytes(b"half an entry")
    CheckpointStore(str(store), "fp").close()
    for sub in ("ok", "failed", "."):
        assert not [f for f in os.listdir(store / sub) if f.startswith(".tmp-")]


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
def test_an_entry_symlinked_to_a_victim_is_refused_and_the_victim_untouched(tmp_path,
                                                                           victim, caplog):
    store, subs = _stored(tmp_path)
    path = entry_path(store, subs[1])
    os.unlink(path)
    os.symlink(victim, path)
    _check_one_refused(tmp_path, store, subs, caplog, "symbolic link")
    assert untouched(victim) and not os.path.islink(path)


@pytest.mark.timeout(120)
def test_an_entry_symlinked_to_dev_zero_is_refused(tmp_path, caplog):
    store, subs = _stored(tmp_path)
    path = entry_path(store, subs[1])
    os.unlink(path)
    os.symlink("/dev/zero", path)
    _check_one_refused(tmp_path, store, subs, caplog, "symbolic link")


@pytest.mark.timeout(120)
def test_a_fifo_entry_is_refused_without_hanging(tmp_path, caplog):
    store, subs = _stored(tmp_path)
    path = entry_path(store, subs[1])
    os.unlink(path)
    os.mkfifo(path, 0o600)
    _check_one_refused(tmp_path, store, subs, caplog, "not a regular file")


@root_only
@pytest.mark.timeout(120)
def test_an_entry_forged_by_another_user_is_not_served(tmp_path, caplog):
    store, subs = _stored(tmp_path)
    path = entry_path(store, subs[1])
    os.chown(path, nobody(), nobody())
    _check_one_refused(tmp_path, store, subs, caplog, f"owned by uid {nobody()}")
    assert os.stat(path).st_uid == os.geteuid()  # recomputed and rewritten by us


def test_the_store_itself_raises_a_clear_error_for_each_refused_entry(tmp_path):
    store_dir = tmp_path / "ckpt"
    store = CheckpointStore(str(store_dir), "fp")
    try:
        for key in ("fifo", "zero", "trunc"):
            store.save_success(key, key, {"v": 1}, 1, 0.1)
        os.unlink(store._path("ok", "fifo"))
        os.mkfifo(store._path("ok", "fifo"))
        os.unlink(store._path("ok", "zero"))
        os.symlink("/dev/zero", store._path("ok", "zero"))
        with open(store._path("ok", "trunc"), "r+b") as fh:
            fh.truncate(5)
        with pytest.raises(CheckpointError, match="fifo.*not a regular file"):
            store.load("fifo")
        with pytest.raises(CheckpointError, match="zero.*symbolic link"):
            store.load("zero")
        with pytest.raises(CheckpointError, match="trunc.*corrupt"):
            store.load("trunc")
    finally:
        store.close()


# -- one bad entry never aborts a resumed run ------------------------------------------

def _write_record(path, record):
    blob = zstandard.ZstdCompressor().compress(msgpack.packb(record, use_bin_type=True))
    with open(path, "wb") as fh:
        fh.write(blob)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["truncated", "garbage", "bad_array", "bad_record",
                                    "pickled", "bad_failure"])
def test_a_bad_entry_among_good_ones_is_recomputed_and_the_run_completes(tmp_path, caplog,
                                                                         damage):
    store, subs = _stored(tmp_path)
    key = cache_key_of(J.work, subs[1], subs[1]["subject_id"])
    path = entry_path(store, subs[1])
    if damage == "truncated":
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
    elif damage == "garbage":
        with open(path, "wb") as fh:
            fh.write(os.urandom(64))
    elif damage == "bad_array":  # well-formed entry, impossible array inside
        value = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<f4", [3, 3], b"\0" * 5],
                                                               use_bin_type=True)),
                              use_bin_type=True)
        _write_record(path, {"key": key, "subject": "S001", "fingerprint": "",
                             "value": value, "attempts": 1, "duration_s": 0.1, "time": 0})
    elif damage == "bad_record":  # a record missing its fields, of the wrong types
        _write_record(path, {"key": key, "fingerprint": "", "value": 5, "attempts": "x"})
    elif damage == "pickled":  # a pickle entry, and this run does not allow pickle
        held = CheckpointStore(store, None, allow_pickle=True)
        held.save_success(key, "S001", {1, 2}, 1, 0.1)
        held.close()
    elif damage == "bad_failure":
        os.unlink(path)
        _write_record(entry_path(store, subs[1], "failed"),
                      {"key": key, "subject": "S001", "fingerprint": "", "error": "boom",
                       "attempts": 1, "duration_s": 0.1, "time": 0})
    with caplog.at_level(logging.WARNING, logger="zephon.jobs"):
        job, out = go(subs, store)
    assert [r.from_cache for r in out] == [True, False, True] and all(r.ok for r in out)
    assert job.summary["cached"] == 2 and job.summary["done"] == 1
    bad = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(bad) == 1 and "S001" in bad[0].getMessage()
    job, out = go(subs, store)  # rewritten: served from now on
    assert all(r.from_cache and r.ok for r in out)


@pytest.mark.timeout(120)
def test_on_bad_entry_fail_marks_that_subject_failed_and_serves_the_others(tmp_path):
    store, subs = _stored(tmp_path)
    with open(entry_path(store, subs[1]), "wb") as fh:
        fh.write(b"not zstd")
    job, out = go(subs, store, on_bad_entry="fail")
    assert [r.ok for r in out] == [True, False, True]
    assert isinstance(out[1].error, CheckpointError) and "S001" in str(out[1].error)
    assert job.summary["failed"] == 1 and job.summary["cached"] == 2


def test_on_bad_entry_is_validated():
    from zephon import ZephonConfigError

    with pytest.raises(ZephonConfigError, match="on_bad_entry"):
        run(J.work, ["S1"], RunPolicy(), on_bad_entry="ignore")
