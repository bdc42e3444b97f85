"""The store's durability window, crash safety, old-format migration and streaming resume.

- A real driver process is SIGKILLed five times mid-run, each time at a point chosen by
  the results it has yielded (not by a sleep), and resumed; every subject's final result
  is exactly once and correct, the database is intact after every kill, and each kill
  loses at most the documented window (``2 * commit_every`` entries here).
- An entry is committed within ``commit_interval_s`` without any further write: a
  process that saved one entry and then blocks is SIGKILLed once the log holds it, and
  the entry is there.
- A store of the first format (one file per subject) migrates on open.
- A resume streams: the first cached result comes before the store has been read to
  the end, and ordered output does not keep held-back successes in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import zstandard
from _job_fns import count_store_lookups

from zephon.jobs import CheckpointStore, RunPolicy, run
from zephon.jobs import runner as runner_mod
from zephon.jobs import store as store_mod

TESTS = os.path.dirname(os.path.abspath(__file__))
N = 6000
COMMIT_EVERY = 64

DRIVER = textwrap.dedent("""
    import hashlib, sys
    sys.path.insert(0, {tests!r})
    from zephon.jobs import RunPolicy, run
    from zephon.jobs.store import CheckpointStore

    CheckpointStore.COMMIT_EVERY = {commit_every}
    CheckpointStore.COMMIT_INTERVAL_S = 3600.0  # the count alone bounds the window here

    def fn(subject):
        digest = subject.encode()
        for _ in range(200):  # some work per subject, so the run outlasts the kill
            digest = hashlib.sha256(digest).digest()
        return {{"s": subject, "d": digest.hex(), "pad": digest * 64}}

    if __name__ == "__main__":
        subjects = [f"S{{i:05d}}" for i in range({n})]
        policy = RunPolicy(subject_timeout_sec=None, checkpoint_dir={store!r})
        for r in run(fn, subjects, policy, progress=False):
            assert r.ok, r.error
            v = r.value
            print(r.subject_id, int(r.from_cache), v["s"], v["d"],
                  hashlib.sha256(v["pad"]).hexdigest(), flush=True)
        print("done", flush=True)
""")


def expected(subject: str) -> dict:
    digest = subject.encode()
    for _ in range(200):
        digest = hashlib.sha256(digest).digest()
    return {"s": subject, "d": digest.hex(), "pad": digest * 64}


def _start(store: str) -> subprocess.Popen:
    code = DRIVER.format(tests=TESTS, commit_every=COMMIT_EVERY, n=N, store=store)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stored_successes(store: str) -> int:
    db = sqlite3.connect(os.path.join(store, "jobs.db"))
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return db.execute("SELECT count(*) FROM entries WHERE kind = 0").fetchone()[0]
    finally:
        db.close()


def _kill_after(proc: subprocess.Popen, fresh: int) -> tuple[int, int]:
    """SIGKILL the driver once it has yielded ``fresh`` computed results; returns how many
    results it yielded in all, and how many of those it computed."""
    yielded = computed = 0
    while computed < fresh:
        line = proc.stdout.readline()
        assert line and line.strip() != "done", f"the run ended early: {proc.stderr.read()}"
        yielded += 1
        computed += line.split()[1] == "0"
    proc.kill()
    rest = proc.stdout.read()  # through the buffered reader: it may hold read-ahead lines
    proc.wait(timeout=60)
    proc.stderr.read()
    # The kill may land while the driver prints: a last line without its newline is torn
    # (its result is counted by what the store holds, not by the output).
    complete = rest if rest.endswith("\n") else rest[:rest.rfind("\n") + 1]
    lines = [ln for ln in complete.splitlines() if ln and ln != "done"]
    assert proc.returncode == -signal.SIGKILL, "the run finished before the kill"
    return yielded + len(lines), computed + sum(ln.split()[1] == "0" for ln in lines)


@pytest.mark.timeout(600)
def test_sigkill_mid_run_loses_at_most_the_window_and_never_serves_a_torn_entry(tmp_path):
    store = str(tmp_path / "ckpt")
    served_before = 0  # successes in the store when the run started
    for fresh in (250, 700, 60, 900, 400):  # kill points, in computed results per run
        proc = _start(store)
        try:
            yielded, computed = _kill_after(proc, fresh)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        now = _stored_successes(store)  # the database is intact after every kill
        assert yielded >= computed >= fresh
        # what the killed run computed is in the store, but for the last window (and
        # perhaps one entry recorded just before the kill, not yet yielded)
        assert served_before + computed - 2 * COMMIT_EVERY <= now, (now, computed)
        assert now <= served_before + computed + 1
        served_before = now
    proc = _start(store)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[-1] == "done"
    rows = [ln.split() for ln in lines[:-1]]
    assert [r[0] for r in rows] == [f"S{i:05d}" for i in range(N)]  # each exactly once
    assert sum(r[1] == "1" for r in rows) == served_before  # all it stored, served
    for sid, _cached, s, d, pad in rows:  # and correct: no torn or mixed-up entry
        want = expected(sid)
        assert (s, d, pad) == (want["s"], want["d"], hashlib.sha256(want["pad"]).hexdigest())


WINDOW = textwrap.dedent("""
    import sys
    from zephon.jobs.store import CheckpointStore

    store = CheckpointStore({store!r}, "fp", commit_interval_s=0.2)
    store.save_success("k", "s", {{"v": 42}}, attempts=1, duration_s=0.1)
    print("saved", flush=True)
    sys.stdin.read()  # blocks: no further write, no close
""")


@pytest.mark.timeout(120)
def test_an_entry_is_committed_within_the_interval_without_further_writes(tmp_path):
    store = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-c", WINDOW.format(store=store)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved", proc.stderr.read()
        wal = os.path.join(store, "jobs.db-wal")
        deadline = time.monotonic() + 60
        before = os.path.getsize(wal)
        while os.path.getsize(wal) == before:  # the commit appends the entry to the log
            assert time.monotonic() < deadline and proc.poll() is None, "never committed"
            time.sleep(0.02)
        proc.kill()
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    with CheckpointStore(store, "fp") as store_:
        assert store_.load("k").value == {"v": 42}


def test_close_commits_and_a_clear_removes_everything(tmp_path):
    root = str(tmp_path / "ckpt")
    with CheckpointStore(root, "fp", commit_every=10**6, commit_interval_s=3600) as store:
        for i in range(100):
            store.save_success(f"k{i}", f"s{i}", i, attempts=1, duration_s=0.0)
        assert store.load("k7").value == 7  # queued entries are seen at once
    assert sorted(os.listdir(root)) == ["FINGERPRINT", "LOCK", "jobs.db"]  # log merged
    store = CheckpointStore(root, "fp")
    assert [store.load(f"k{i}").value for i in range(100)] == list(range(100))
    store.clear()
    assert not os.path.exists(root)


def test_a_success_then_a_failure_keeps_both_and_a_success_clears_the_failure(tmp_path):
    root = str(tmp_path / "ckpt")
    error = {"type": "ValueError", "message": "bad", "traceback": ""}
    with CheckpointStore(root, "fp", commit_interval_s=3600) as store:
        store.save_success("a", "a", 1, attempts=1, duration_s=0.0)
        store.save_failure("a", "a", error, attempts=2, duration_s=0.0)
        store.save_failure("b", "b", error, attempts=1, duration_s=0.0)
        store.flush()
        store.save_success("b", "b", 2, attempts=2, duration_s=0.0)
    with CheckpointStore(root, "fp") as store:
        assert store.load("a").ok and store.load("a").value == 1
        assert sorted(store.keys(1)) == ["a"] and sorted(store.keys(0)) == ["a", "b"]


# -- migration of the first format ---------------------------------------------------------

def _old_entry(directory, key, record):
    name = hashlib.sha256(key.encode()).hexdigest()[:40]
    blob = zstandard.ZstdCompressor().compress(msgpack.packb(record, use_bin_type=True))
    path = directory / name
    path.write_bytes(blob)
    return path


def test_an_old_one_file_per_subject_store_is_migrated_on_open(tmp_path, caplog):
    root = tmp_path / "ckpt"
    for sub in ("ok", "failed"):
        (root / sub).mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    (root / "FINGERPRINT").write_text(json.dumps({"fingerprint": "v1"}))
    value = store_mod.encode_value({"n": 1}, allow_pickle=False)
    _old_entry(root / "ok", "ka", {"key": "ka", "subject": "a", "fingerprint": "v1",
                                    "value": value, "attempts": 1, "duration_s": 0.5,
                                    "time": 0})
    _old_entry(root / "failed", "kb", {"key": "kb", "subject": "b", "fingerprint": "v1",
                                        "error": {"type": "E", "message": "m",
                                                  "traceback": ""},
                                        "attempts": 2, "duration_s": 0.1, "time": 0})
    os.symlink("/etc/passwd", root / "ok" / ("0" * 40))  # refused, never read
    (root / "ok" / "garbage").write_bytes(b"not zstd")
    with caplog.at_level("INFO", logger="zephon.jobs"):
        store = CheckpointStore(str(root), "v1")
    try:
        assert store.load("ka").value == {"n": 1} and store.load("ka").attempts == 1
        failure = store.load("kb")
        assert not failure.ok and failure.error["message"] == "m" and failure.attempts == 2
    finally:
        store.close()
    assert sorted(os.listdir(root)) == ["FINGERPRINT", "LOCK", "jobs.db"]
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "migrated 2 entries" in text and "2 entries of the old store" in text


# -- a resume streams -----------------------------------------------------------------------

def test_a_resume_yields_its_first_cached_result_before_reading_the_whole_store(
        tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    subjects = [f"S{i:05d}" for i in range(5 * runner_mod.RESUME_CHUNK)]
    policy = RunPolicy(subject_timeout_sec=None, checkpoint_dir=root)
    assert all(r.ok for r in run(len, subjects, policy, progress=False))
    looked_up = count_store_lookups(monkeypatch)
    it = iter(run(len, subjects, policy, progress=False))
    first = next(it)
    assert first.subject_id == "S00000" and first.from_cache
    assert looked_up == [runner_mod.RESUME_CHUNK]  # one chunk read, not the whole store
    rest = list(it)
    assert len(rest) == len(subjects) - 1 and all(r.from_cache for r in rest)
    assert sum(looked_up) == len(subjects)


def test_ordered_output_reads_held_back_successes_back_from_the_store(tmp_path,
                                                                     monkeypatch):
    """Subject 0 fails in round 1 and succeeds in round 2: every later success waits for
    it, kept as a mark, not a value, and comes back from the store intact and in order."""
    root = str(tmp_path / "ckpt")
    reads: list[str] = []
    original = store_mod.CheckpointStore.load

    def counting(self, key):
        reads.append(key)
        return original(self, key)

    monkeypatch.setattr(store_mod.CheckpointStore, "load", counting)
    flag = tmp_path / "failed-once"
    subjects = [{"subject_id": f"S{i:03d}", "flag": str(flag)} for i in range(300)]
    policy = RunPolicy(subject_timeout_sec=None, checkpoint_dir=root, auto_retry_rounds=1)
    job = run(_fail_first_once, subjects, policy, progress=False)
    out = list(job)
    assert len(reads) == 299  # every success after S000 was read back, none kept
    assert [r.subject_id for r in out] == [s["subject_id"] for s in subjects]
    assert all(r.ok and not r.from_cache for r in out)
    assert [r.value for r in out] == [[s["subject_id"], (1, 2)] for s in subjects]
    assert out[0].attempts == 2 and all(r.attempts == 1 for r in out[1:])
    assert job.summary["retried"] == 1 and job.summary["done"] == 300


def _fail_first_once(subject):
    if subject["subject_id"] == "S000" and not os.path.exists(subject["flag"]):
        open(subject["flag"], "w").close()
        raise ValueError("first attempt fails")
    return [subject["subject_id"], (1, 2)]
