"""What the fast path of a stored serial run must keep: behaviour, not speed.

- A store that was empty at open skips the resume lookups and the DELETE of a failure
  record per success, yet a failure saved earlier in the same run is still removed by
  the subject's success; a store that was not empty removes a failure of an earlier run.
- Subjects that are all strings are their own ids, still checked: unique, non-empty.
- The driver keeps nothing per subject while the run iterates (beyond a byte of output
  state; the store's queue is bounded by its commit size): the traced peak of a run of 10x the subjects grows by far less than a Python
  object per subject (the loop once held a Counter of attempts, a list of index tuples
  and a list of int indexes: about 200 bytes a subject).
- Ordered and unordered output with retries: every subject once, in order when asked.
"""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest
from _job_fns import count_store_lookups

from zephon.errors import ZephonConfigError
from zephon.jobs import CheckpointStore, RunPolicy, run
from zephon.jobs import store as store_mod

ERROR = {"type": "ValueError", "message": "bad", "traceback": ""}


def test_an_empty_store_still_clears_a_failure_saved_in_the_same_run(tmp_path):
    root = str(tmp_path / "ckpt")
    with CheckpointStore(root, "fp", commit_interval_s=3600) as store:
        assert store.empty_at_open
        store.save_failure("a", "a", ERROR, attempts=1, duration_s=0.0)
        store.flush()  # the failure is in the database, not only queued
        store.save_success("a", "a", 1, attempts=2, duration_s=0.0)
        store.save_failure("b", "b", ERROR, attempts=1, duration_s=0.0)
        store.save_success("b", "b", 2, attempts=2, duration_s=0.0)  # still queued
        store.save_success("c", "c", 3, attempts=1, duration_s=0.0)
    with CheckpointStore(root, "fp") as store:
        assert not store.empty_at_open
        assert store.keys(1) == [] and sorted(store.keys(0)) == ["a", "b", "c"]


def test_a_store_with_entries_clears_a_failure_of_an_earlier_run(tmp_path):
    root = str(tmp_path / "ckpt")
    with CheckpointStore(root, "fp") as store:
        store.save_failure("a", "a", ERROR, attempts=1, duration_s=0.0)
    with CheckpointStore(root, "fp") as store:
        assert not store.empty_at_open
        store.save_success("a", "a", 1, attempts=2, duration_s=0.0)
    with CheckpointStore(root, "fp") as store:
        assert store.keys(1) == [] and store.keys(0) == ["a"]


def _flaky(subject):
    if subject.endswith("3") and not os.path.exists(subject + ".once"):
        raise ValueError(subject)
    return subject.upper()


def test_a_fresh_store_is_not_looked_up_and_a_resume_serves_everything(tmp_path,
                                                                       monkeypatch):
    root = str(tmp_path / "ckpt")
    subjects = [str(tmp_path / f"s{i:03d}") for i in range(40)]
    policy = RunPolicy(subject_timeout_sec=None, checkpoint_dir=root)
    looked_up = count_store_lookups(monkeypatch)
    first = list(run(_flaky, subjects, policy, progress=False))
    assert looked_up == []  # nothing to settle in an empty store
    assert [r.subject_id for r in first] == subjects
    assert [r.ok for r in first] == [not s.endswith("3") for s in subjects]
    for s in subjects:
        open(s + ".once", "w").close()
    retry = RunPolicy(subject_timeout_sec=None, checkpoint_dir=root,
                      retry_failed_subjects=True)
    again = list(run(_flaky, subjects, retry, progress=False))
    assert sum(looked_up) == len(subjects)
    assert [(r.ok, r.from_cache) for r in again] == [(True, not s.endswith("3"))
                                                     for s in subjects]
    assert [r.value for r in again] == [s.upper() for s in subjects]


@pytest.mark.parametrize("ordered", [True, False])
def test_retried_failures_come_out_once_each_in_either_order(tmp_path, ordered):
    subjects = [str(tmp_path / f"s{i:03d}") for i in range(30)]
    policy = RunPolicy(subject_timeout_sec=None, checkpoint_dir=str(tmp_path / "c"),
                       auto_retry_rounds=2)
    job = run(_flaky_until_third, subjects, policy, progress=False, ordered=ordered)
    out = list(job)
    ids = [r.subject_id for r in out]
    assert (ids == subjects) if ordered else (sorted(ids) == subjects)
    assert all(r.ok for r in out)
    attempts = {r.subject_id: r.attempts for r in out}
    assert attempts == {s: 3 if s.endswith("3") else 1 for s in subjects}
    assert job.summary["retried"] == 3 and job.summary["done"] == 30


def _flaky_until_third(subject):
    marks = subject + ".n"
    n = os.path.getsize(marks) if os.path.exists(marks) else 0
    if subject.endswith("3") and n < 2:
        with open(marks, "a") as f:
            f.write("x")
        raise ValueError(subject)
    return subject


def test_string_subjects_are_their_own_ids_and_still_checked():
    policy = RunPolicy(subject_timeout_sec=None, resume=False)
    with pytest.raises(ZephonConfigError, match="duplicate subject ids: \\['b'\\]"):
        run(len, ["a", "b", "c", "b"], policy, progress=False)
    with pytest.raises(ZephonConfigError, match="subject 1: subject_id must be"):
        run(len, ["a", "", "c"], policy, progress=False)
    job = run(len, ["ab", {"subject_id": "c"}], policy, progress=False)
    assert [(r.subject_id, r.value) for r in job] == [("ab", 2), ("c", 1)]


def _noop(subject):
    return subject


def _iteration_peak(tmp_path, n: int) -> int:
    """Traced peak bytes while a stored run of ``n`` subjects iterates (the subjects, the
    run's construction and the store's open are before the trace starts)."""
    subjects = [f"S{i:07d}" for i in range(n)]
    policy = RunPolicy(subject_timeout_sec=None, checkpoint_dir=str(tmp_path / f"c{n}"))
    job = run(_noop, subjects, policy, progress=False)
    it = iter(job)
    first = next(it)  # the store is open, the first subject ran
    gc.collect()
    tracemalloc.start()
    try:
        count = 1 + sum(1 for _ in it)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        assert first.ok and count == n


def test_the_driver_keeps_nothing_per_subject_while_a_run_iterates(tmp_path, monkeypatch):
    # the store's queue is bounded by 2 * COMMIT_EVERY entries: keep that bound well
    # under both runs, so it is the same for both
    monkeypatch.setattr(store_mod.CheckpointStore, "COMMIT_EVERY", 64)
    small, large = 2_000, 20_000
    growth = _iteration_peak(tmp_path, large) - _iteration_peak(tmp_path, small)
    per_subject = growth / (large - small)
    assert per_subject < 16, f"{per_subject:.1f} bytes per subject"
