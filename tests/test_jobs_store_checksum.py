"""A record of the jobs checkpoint store is checksummed: a flipped byte is caught, never
served (issue 40, finding 2).

The store is written by real runs (or by :class:`CheckpointStore` itself), then one
byte of a stored record is flipped through SQLite, with the store closed, the way a bad
disk, a bad copy or a stray writer would; the next run must report that entry once
(naming the subject and the store) and recompute the subject, whose result is then
correct. Both kinds of record are covered: plain msgpack (under 512 bytes) and zstd
frames. The sweeps flip every byte of a record, header and checksum included.

A store of the previous format (2, records without a checksum) is still opened: its
records are given their checksum once, at open, in one transaction (the store's
migration pattern, as for the first one-file-per-subject format).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3

import msgpack
import numpy as np
import pytest
import zstandard

from zephon.errors import CheckpointError
from zephon.jobs import CheckpointStore, RunPolicy, run
from zephon.jobs.store_codec import encode_value
from zephon.jobs.subjects import cache_key_of

PLAIN_BYTES = 32     # a record well under 512 bytes: plain msgpack
ZSTD_BYTES = 2000    # a record over 512 bytes: a zstd frame (random bytes: raw literals)


def result_of(subject: str) -> dict:
    """The subject's result: a dict with bytes that depend on the subject only."""
    kind, sid = subject.split(":")
    if kind == "plain":
        blob = hashlib.sha256(sid.encode()).digest()
    else:
        blob = np.random.default_rng(int(sid[1:])).bytes(ZSTD_BYTES)
    return {"id": sid, "blob": blob}


def db_file(store: str) -> str:
    return os.path.join(store, "jobs.db")


def go(subs, store):
    policy = RunPolicy(subject_timeout_sec=None, checkpoint_dir=store, auto_retry_rounds=0)
    job = run(result_of, subs, policy, progress=False)
    return list(job)


def read_record(store: str, key: str) -> bytes:
    db = sqlite3.connect(db_file(store))
    try:
        return db.execute("SELECT record FROM entries WHERE key = ? AND kind = 0",
                          (key,)).fetchone()[0]
    finally:
        db.close()


def write_records(store: str, rows: dict[str, bytes]) -> None:
    db = sqlite3.connect(db_file(store))
    try:
        with db:
            db.executemany("UPDATE entries SET record = ? WHERE key = ? AND kind = 0",
                           [(blob, key) for key, blob in rows.items()])
    finally:
        db.close()


def flipped(blob: bytes, at: int, mask: int = 0xFF) -> bytes:
    out = bytearray(blob)
    out[at] ^= mask
    return bytes(out)


def _bad_entry_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("zephon")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["plain", "zstd"])
def test_a_byte_flipped_inside_a_stored_result_is_reported_once_and_recomputed(
        tmp_path, caplog, kind):
    store = str(tmp_path / "ckpt")
    subs = [f"{kind}:S{i}" for i in range(3)]
    out = go(subs, store)
    assert all(r.ok and not r.from_cache for r in out)
    key = cache_key_of(result_of, subs[1], subs[1])
    record = read_record(store, key)
    assert (record.find(b"\x28\xb5\x2f\xfd") >= 0) == (kind == "zstd")  # the kind asked
    if kind == "plain":  # a byte of the result's own bytes, as stored
        at = record.index(result_of(subs[1])["blob"]) + 5
    else:  # the middle of the frame: raw literals of the random bytes
        at = len(record) // 2
    write_records(store, {key: flipped(record, at, 0x01)})

    with caplog.at_level(logging.WARNING, logger="zephon"):
        out = go(subs, store)
    assert [r.from_cache for r in out] == [True, False, True]
    assert [r.value for r in out] == [result_of(s) for s in subs]  # S1 correct: recomputed
    warnings = _bad_entry_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "S1" in warnings[0] and db_file(store) in warnings[0]
    assert "checksum" in warnings[0] and "recomput" in warnings[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zephon"):
        out = go(subs, store)  # rewritten by the recompute: served from now on
    assert all(r.from_cache for r in out) and [r.value for r in out] == [
        result_of(s) for s in subs]
    assert _bad_entry_warnings(caplog) == []


def _sweep(tmp_path, value, mask: int) -> tuple[int, list[str]]:
    """Save one record per byte position (same-length keys, the same value), flip byte
    ``i`` of the ``i``-th record, and load them all back: (record length, what was
    served wrong)."""
    store = str(tmp_path / f"ckpt-{mask:02x}")
    with CheckpointStore(store, "fp") as held:
        held.save_success("probe", "probe", value, attempts=1, duration_s=0.5)
    size = len(read_record(store, "probe")) + 16  # records of other keys: a little slack
    keys = [f"k{i:05d}" for i in range(size)]
    with CheckpointStore(store, "fp") as held:
        for key in keys:
            held.save_success(key, key, value, attempts=1, duration_s=0.5)
    rows = {}
    for i, key in enumerate(keys):
        record = read_record(store, key)
        if i < len(record):
            rows[key] = flipped(record, i, mask)
    write_records(store, rows)
    wrong = []
    with CheckpointStore(store, "fp") as held:
        for key, got in zip(rows, held.load_many(list(rows)), strict=True):
            if isinstance(got, CheckpointError):
                assert key in str(got) and db_file(store) in str(got)
                continue
            # A flip must be caught (or be harmless: the very same entry served).
            if got is None or not (got.ok and got.attempts == 1 and got.duration_s == 0.5
                                   and _same(got.value, value)):
                wrong.append(f"{key}: {got if got is None else got.value!r:.80}")
    return len(read_record(store, "probe")), wrong


def _same(a, b) -> bool:
    return msgpack.packb(encode_value(a, allow_pickle=False)) == \
        msgpack.packb(encode_value(b, allow_pickle=False))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mask", [0x01, 0xFF])
def test_a_flip_of_any_byte_of_a_plain_record_is_caught(tmp_path, mask):
    value = {"id": "S1", "n": 12345, "blob": b"\x00\x01" * 8}
    size, wrong = _sweep(tmp_path, value, mask)
    assert size < 512  # a plain record
    assert wrong == [], f"{len(wrong)} of {size} flips served: {wrong[:5]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mask", [0x01, 0xFF])
def test_a_flip_of_any_byte_of_a_zstd_record_is_caught(tmp_path, mask):
    value = {"id": "S1", "blob": np.random.default_rng(7).bytes(600),
             "text": "compressible " * 40}
    size, wrong = _sweep(tmp_path, value, mask)
    assert size >= 512  # a zstd frame
    assert wrong == [], f"{len(wrong)} of {size} flips served: {wrong[:5]}"


# -- a store of the previous format (2: no checksum) ---------------------------------------

def _format2_store(store: str, records: dict[str, dict]) -> None:
    """A store as format 2 wrote it: the same tables, records without a checksum (plain
    msgpack under 512 bytes, zstd without a content checksum from 512 on)."""
    os.makedirs(store, mode=0o700)
    db = sqlite3.connect(db_file(store))
    try:
        with db:
            db.execute("CREATE TABLE entries (key TEXT NOT NULL, kind INTEGER NOT NULL, "
                       "record BLOB NOT NULL, PRIMARY KEY (key, kind)) WITHOUT ROWID")
            db.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
            db.execute("INSERT INTO meta VALUES ('format', 'zephon-jobs-store/2')")
            for key, record in records.items():
                raw = msgpack.packb(record, use_bin_type=True)
                if len(raw) >= 512:
                    raw = zstandard.ZstdCompressor(level=3).compress(raw)
                db.execute("INSERT INTO entries VALUES (?, 0, ?)", (key, raw))
    finally:
        db.close()
    os.chmod(db_file(store), 0o600)


@pytest.mark.timeout(120)
def test_a_store_of_the_previous_format_is_checksummed_at_open_and_served(tmp_path, caplog):
    store = str(tmp_path / "ckpt")
    subs = [f"plain:S{i}" for i in range(2)] + [f"zstd:S{i}" for i in range(2)]
    records = {}
    for s in subs:
        key = cache_key_of(result_of, s, s)
        records[key] = {"key": key, "subject": s, "fingerprint": "",
                        "value": encode_value(result_of(s), allow_pickle=False),
                        "attempts": 1, "duration_s": 0.25, "time": 0.0}
    _format2_store(store, records)
    old = {key: read_record(store, key) for key in records}

    with caplog.at_level(logging.INFO, logger="zephon"):
        out = go(subs, store)
    assert all(r.from_cache for r in out) and [r.value for r in out] == [
        result_of(s) for s in subs]
    assert any("format" in r.getMessage() and "4 entries" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    db = sqlite3.connect(db_file(store))
    try:
        assert db.execute("SELECT value FROM meta WHERE name = 'format'").fetchone()[0] \
            == "zephon-jobs-store/3"
    finally:
        db.close()
    for key, blob in old.items():  # each record now carries a checksum: a flip is caught
        new = read_record(store, key)
        assert new != blob and blob in new
    key = cache_key_of(result_of, subs[0], subs[0])
    write_records(store, {key: flipped(read_record(store, key), 20, 0x01)})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zephon"):
        out = go(subs, store)
    assert [r.from_cache for r in out] == [False, True, True, True]
    assert [r.value for r in out] == [result_of(s) for s in subs]
    assert len(_bad_entry_warnings(caplog)) == 1


def test_a_store_of_an_unknown_format_is_refused_by_name(tmp_path):
    store = str(tmp_path / "ckpt")
    _format2_store(store, {})
    db = sqlite3.connect(db_file(store))
    with db:
        db.execute("UPDATE meta SET value = 'zephon-jobs-store/99' WHERE name = 'format'")
    db.close()
    with pytest.raises(CheckpointError, match=r"zephon-jobs-store/99.*another checkpoint_dir"):
        CheckpointStore(store, None)


def test_a_large_record_round_trips_and_a_flip_in_it_is_caught(tmp_path):
    store = str(tmp_path / "ckpt")
    value = {"a": np.random.default_rng(3).random(40_000), "b": np.zeros(100_000, np.uint8)}
    with CheckpointStore(store, None) as held:
        for key in ("good", "middle", "last"):
            held.save_success(key, key, value, attempts=1, duration_s=0.5)
    record = read_record(store, "middle")
    assert len(record) > 1 << 16  # read through a view of the record, not a copy
    write_records(store, {"middle": flipped(record, len(record) // 2, 0x10),
                          "last": flipped(read_record(store, "last"), -1, 0x80)})
    with CheckpointStore(store, None) as held:
        good = held.load("good").value
        assert np.array_equal(good["a"], value["a"]) and np.array_equal(good["b"], value["b"])
        for key in ("middle", "last"):
            with pytest.raises(CheckpointError, match=f"'{key}'.*checksum mismatch"):
                held.load(key)
