"""Every RunPolicy field changes behaviour as documented: real processes, real signals.

Concurrency is measured from the start/end files the subjects write; processes are
checked through /proc; nothing asserts a wall-clock duration."""

from __future__ import annotations

import os

import pytest

from _procs import alive, wait_gone

import _job_fns as J
from zephon import SubjectTimeoutError, WorkerCrashedError, ZephonConfigError
from zephon.errors import CheckpointError
from zephon.jobs import JobSetupError, RecordedFailure, RunPolicy, run

FAST = dict(graceful_shutdown_sec=2.0, subject_spawn_timeout_sec=60.0)


def subjects(tmp_path, n, action="ok", arg=None, prefix="S"):
    d = tmp_path / "log"
    d.mkdir(parents=True, exist_ok=True)
    return [{"subject_id": f"{prefix}{i:03d}", "dir": str(d), "action": action, "arg": arg}
            for i in range(n)]


def go(fn, subs, **policy):
    kwargs = {k: policy.pop(k) for k in ("fingerprint", "ordered", "allow_pickle")
              if k in policy}
    r = run(fn, subs, RunPolicy(**{**FAST, **policy}), progress=False, **kwargs)
    return r, list(r)




def test_workers_bounds_the_observed_concurrency(tmp_path):
    # each subject first waits until two have started: a second worker that spawns late
    # cannot leave the first one to run all six alone
    subs = subjects(tmp_path, 6, "sleep_once_started", (2, 0.4))
    r, out = go(J.work, subs, workers=2, resume=False)
    assert all(x.ok for x in out)
    assert J.interval_overlap(subs[0]["dir"]) == 2
    r, out = go(J.work, subjects(tmp_path / "one", 3, "sleep", 0.2), workers=1, resume=False)
    assert J.interval_overlap(str(tmp_path / "one" / "log")) == 1


def test_backend_serial_runs_here_process_runs_elsewhere(tmp_path):
    r, out = go(J.work, subjects(tmp_path, 2), backend="serial", subject_timeout_sec=None,
                resume=False)
    assert r.backend_name == "serial" and {x.value["pid"] for x in out} == {os.getpid()}
    r, out = go(J.work, subjects(tmp_path, 2), backend="process", subject_timeout_sec=None,
                resume=False)
    assert r.backend_name == "process" and os.getpid() not in {x.value["pid"] for x in out}
    assert "requested" in r.explain()
    r = run(J.work, [], RunPolicy(backend="serial", subject_timeout_sec=5.0))
    assert r.backend_name == "process" and "cannot be enforced in-process" in r.explain()


def test_subject_timeout_kills_the_whole_process_group(tmp_path):
    subs = subjects(tmp_path, 3, "ok")
    subs[1]["action"] = "hang_with_child"
    r, out = go(J.work, subs, workers=2, subject_timeout_sec=2.0, auto_retry_rounds=0,
                resume=False)
    assert [x.ok for x in out] == [True, False, True]
    assert isinstance(out[1].error, SubjectTimeoutError) and r.summary["timeouts"] == 1
    child = int(open(os.path.join(subs[1]["dir"], "S001.child")).read())
    assert not wait_gone(child, 10), "the op's own child outlived the timeout"


def test_subject_spawn_timeout_bounds_a_hanging_setup():
    with pytest.raises(JobSetupError, match="did not become ready within 1.5 s"):
        list(run(J.HangingSetup(), ["S1"], RunPolicy(subject_spawn_timeout_sec=1.5,
                                                     graceful_shutdown_sec=1.0, resume=False),
                 progress=False))


def test_graceful_shutdown_sec_terms_then_kills(tmp_path):
    subs = subjects(tmp_path, 1, "ignore_term")
    r, out = go(J.work, subs, subject_timeout_sec=1.5, graceful_shutdown_sec=1.0,
                auto_retry_rounds=0, resume=False)
    assert isinstance(out[0].error, SubjectTimeoutError)
    assert os.path.exists(os.path.join(subs[0]["dir"], "S000.term"))  # SIGTERM came first
    pids = {int(f.split(".")[1]) for f in os.listdir(subs[0]["dir"]) if f.endswith(".start")}
    assert not any(alive(p) for p in pids)  # ...and SIGKILL finished it


def test_on_subject_failure_continue_and_fail_fast(tmp_path):
    subs = subjects(tmp_path, 4, "ok")
    subs[1]["action"] = "raise"
    r, out = go(J.work, subs, workers=1, auto_retry_rounds=0, resume=False)
    assert [x.ok for x in out] == [True, False, True, True]
    assert isinstance(out[1].error, ValueError) and "failed on purpose" in str(out[1].error)
    busy = subjects(tmp_path / "ff", 3, "sleep", 600)
    busy[2] = {**busy[2], "action": "raise"}
    pids_dir = busy[0]["dir"]
    job = run(J.work, busy, RunPolicy(workers=3, on_subject_failure="fail_fast",
                                      graceful_shutdown_sec=60.0, resume=False), progress=False)
    with pytest.raises(ValueError, match="S002 failed on purpose"):
        list(job)
    pids = {int(f.split(".")[1]) for f in os.listdir(pids_dir) if f.endswith(".start")}
    # S002 fails at once; on a loaded machine the sleepers may not have started yet, but
    # every subject that did start was stopped with the run
    assert 1 <= len(pids) <= 3 and not any(alive(p) for p in pids)


@pytest.mark.parametrize("action", ["kill_self", "memory_error"])
def test_oom_backoff_lowers_concurrency_for_the_rest_of_the_run(tmp_path, action):
    first = subjects(tmp_path, 1, action, prefix="A")
    # the B subjects sleep only once A000's worker is reaped (its OOM handled): however
    # late that worker runs, the other two cannot get through B003 before the back-off
    later = subjects(tmp_path, 8, "sleep_after_reaped", ("A000", 0.3), prefix="B")
    r, out = go(J.work, first + later, workers=3, oom_reduce_workers_by=2,
                auto_retry_rounds=1, resume=False)
    assert r.summary["oom_backoffs"] >= 1
    assert J.interval_overlap(first[0]["dir"], {s["subject_id"] for s in later[3:]}) == 1
    assert out[0].attempts == 2  # the retry round ran it again, at the lowered concurrency
    if action == "kill_self":
        assert isinstance(out[0].error, WorkerCrashedError) and "SIGKILL" in str(out[0].error)


def test_without_oom_backoff_concurrency_stays(tmp_path):
    first = subjects(tmp_path, 1, "kill_self", prefix="A")
    # each B waits until two B's have started: the other worker cannot take all six
    # while the killed one's replacement is still spawning
    later = subjects(tmp_path, 6, "sleep_once_started", (2, 0.5, "B"), prefix="B")
    r, out = go(J.work, first + later, workers=2, oom_backoff=False, auto_retry_rounds=0,
                resume=False)
    assert r.summary["oom_backoffs"] == 0
    assert J.interval_overlap(first[0]["dir"], {s["subject_id"] for s in later}) == 2


def test_cap_workers_to_gpu_pool_gives_distinct_slots(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    subs = subjects(tmp_path, 6, "sleep", 0.3)
    r = run(J.work, subs, RunPolicy(workers=4, cap_workers_to_gpu_pool=True,
                                    parallel_mode="isolated", resume=False, **FAST),
            progress=False)
    assert r.workers == 2 and "capped to 2 visible GPU" in r.explain()
    assert all(x.ok for x in r)
    pid_runs = [(f.split(".")[0], int(f.split(".")[1])) for f in os.listdir(subs[0]["dir"])
                if f.endswith(".start")]
    assert len({pid for _, pid in pid_runs}) == 6  # isolated: a fresh worker per subject
    r2 = run(J.work, subjects(tmp_path / "slots", 6, "ok"),
             RunPolicy(workers=4, cap_workers_to_gpu_pool=True, parallel_mode="isolated",
                       resume=False, **FAST), progress=False)
    seen = [x.value["slot"] for x in r2]
    assert set(seen) <= {"0", "1"} and len(set(seen)) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ZephonConfigError, match="no GPU is visible"):
        run(J.work, subs, RunPolicy(cap_workers_to_gpu_pool=True))


def test_resume_serves_a_sabotaged_rerun_entirely_from_the_store(tmp_path):
    store = str(tmp_path / "ckpt")
    good = subjects(tmp_path, 5, "ok")
    r, out = go(J.work, good, checkpoint_dir=store, fingerprint="v1")
    assert all(x.ok and not x.from_cache for x in out)
    sabotaged = [{**s, "action": "raise"} for s in good]  # same ids, would all fail
    r, again = go(J.work, sabotaged, checkpoint_dir=store, fingerprint="v1")
    assert all(x.ok and x.from_cache for x in again)
    assert [x.value for x in again] == [x.value for x in out]
    assert r.summary["cached"] == 5 and r.summary["done"] == 0
    r, fresh = go(J.work, good, checkpoint_dir=store, fingerprint="v1", resume=False)
    assert not any(x.from_cache for x in fresh)


def test_default_checkpoint_dir_is_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r, out = go(J.work, subjects(tmp_path, 2), backend="serial", subject_timeout_sec=None)
    assert r.store_dir.startswith(str(tmp_path / ".zephon_checkpoints"))
    assert os.path.isfile(os.path.join(r.store_dir, "jobs.db"))
    assert oct(os.stat(r.store_dir).st_mode & 0o777) == "0o700"


def test_parallel_mode_persistent_reuses_isolated_renews(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    r, out = go(J.WithSetup(str(d), wait_for=2), subjects(tmp_path / "p", 6), workers=2,
                resume=False)
    pids = {x.value["pid"] for x in out}
    assert len(pids) == 2
    assert sorted(f for f in os.listdir(d) if f.startswith("setup.")) == sorted(
        f"setup.{p}" for p in pids)  # setup() once per worker
    e = tmp_path / "i"
    e.mkdir()
    r, out = go(J.WithSetup(str(e)), subjects(tmp_path / "i", 4), workers=2,
                parallel_mode="isolated", resume=False)
    assert len({x.value["pid"] for x in out}) == 4
    assert len([f for f in os.listdir(e) if f.startswith("setup.")]) == 4


def test_auto_retry_rounds(tmp_path):
    subs = subjects(tmp_path, 1, "flaky", 2)  # fails twice, then succeeds
    r, out = go(J.work, subs, auto_retry_rounds=2, resume=False)
    assert out[0].ok and out[0].attempts == 3 and r.summary["retried"] == 1
    subs = subjects(tmp_path / "b", 1, "flaky", 2)
    r, out = go(J.work, subs, auto_retry_rounds=1, resume=False)
    assert not out[0].ok and out[0].attempts == 2


@pytest.mark.parametrize("backend", ["serial", "process"])
def test_a_failure_keeps_its_cause_and_its_record_keeps_the_traceback(tmp_path, backend):
    # The subject's ValueError arrives raised from its KeyError on either backend; the
    # record a later run replays holds the traceback of where the subject ran.
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, 1, "raise_from")
    r, out = go(J.work, subs, checkpoint_dir=store, auto_retry_rounds=0, backend=backend)
    err = out[0].error
    assert type(err) is ValueError and "has no entry" in str(err)
    assert type(err.__cause__) is KeyError and err.__cause__.args == ("S000",)
    r, out = go(J.work, subs, checkpoint_dir=store)
    replayed = out[0].error
    assert isinstance(replayed, RecordedFailure) and replayed.error_type == "ValueError"
    assert "raise ValueError" in replayed.traceback and "KeyError: 'S000'" in replayed.traceback


def test_retry_failed_subjects_reruns_recorded_failures(tmp_path):
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, 2, "ok")
    subs[1]["action"] = "raise"
    go(J.work, subs, checkpoint_dir=store, auto_retry_rounds=0)
    fixed = [{**s, "action": "ok"} for s in subs]
    r, out = go(J.work, fixed, checkpoint_dir=store)
    assert isinstance(out[1].error, RecordedFailure) and out[1].from_cache
    assert "ValueError" in str(out[1].error) and r.summary["replayed_failures"] == 1
    r, out = go(J.work, fixed, checkpoint_dir=store, retry_failed_subjects=True)
    assert out[1].ok and not out[1].from_cache and out[0].from_cache


def test_force_rerun_subjects_recomputes_only_those(tmp_path):
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, 3)
    go(J.work, subs, checkpoint_dir=store)
    r, out = go(J.work, subs, checkpoint_dir=store, force_rerun_subjects=["S001"])
    assert [x.from_cache for x in out] == [True, False, True]


def test_clear_checkpoint_on_success(tmp_path):
    store = str(tmp_path / "ckpt")
    go(J.work, subjects(tmp_path, 2), checkpoint_dir=store, clear_checkpoint_on_success=True)
    assert not os.path.exists(store)
    flaky = subjects(tmp_path / "f", 1, "flaky", 1)  # fails, then the retry succeeds
    go(J.work, flaky, checkpoint_dir=store, clear_checkpoint_on_success=True)
    assert not os.path.exists(store)


def test_clearing_keeps_failures_replayed_from_the_store(tmp_path):
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, 2)
    subs[1]["action"] = "raise"
    go(J.work, subs, checkpoint_dir=store, auto_retry_rounds=0)
    r, out = go(J.work, subs, checkpoint_dir=store, clear_checkpoint_on_success=True)
    assert isinstance(out[1].error, RecordedFailure)
    assert os.path.exists(store)
    r, out = go(J.work, subs, checkpoint_dir=store)
    assert isinstance(out[1].error, RecordedFailure)  # the record survived


def test_strict_checkpoint_hash(tmp_path):
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, 2)
    go(J.work, subs, checkpoint_dir=store, fingerprint="v1")
    with pytest.raises(CheckpointError, match="fingerprint 'v1'.*'v2'"):
        go(J.work, subs, checkpoint_dir=store, fingerprint="v2", strict_checkpoint_hash=True)
    r, out = go(J.work, subs, checkpoint_dir=store, fingerprint="v2")
    assert not any(x.from_cache for x in out)  # other fingerprint: ignored, not served
    r, out = go(J.work, subs, checkpoint_dir=store, fingerprint="v2")
    assert all(x.from_cache for x in out)


def test_max_consecutive_failures_restarts_the_worker(tmp_path):
    subs = subjects(tmp_path, 4, "raise")
    r, out = go(J.work, subs, workers=1, persistent_worker_max_consecutive_failures=2,
                auto_retry_rounds=0, resume=False)
    starts = sorted((float(open(os.path.join(subs[0]["dir"], f)).read()), int(f.split(".")[1]))
                    for f in os.listdir(subs[0]["dir"]) if f.endswith(".start"))
    pids = [p for _, p in starts]
    assert pids[0] == pids[1] != pids[2] == pids[3]
    r, out = go(J.work, subjects(tmp_path / "one", 3, "raise"), workers=1,
                auto_retry_rounds=0, resume=False)
    assert "restarts" not in r.summary  # the default (10): a few failures keep the worker
    assert r.summary["workers_started"] == 1


def test_recycling_every_3_tasks_over_200_subjects_loses_nothing(tmp_path):
    subs = subjects(tmp_path, 200, "pid")
    r, out = go(J.work, subs, workers=2, persistent_worker_recycle_after_tasks=3,
                auto_retry_rounds=0, resume=False)
    assert all(x.ok for x in out) and r.summary["failed"] == 0
    per_pid = {}
    for x in out:
        per_pid[x.value] = per_pid.get(x.value, 0) + 1
    assert max(per_pid.values()) <= 3 and len(per_pid) >= 67


def test_completion_order_option(tmp_path):
    # S000 ends only once the test has S001's result (not after a fixed sleep: a second
    # worker spawning late would see S000 end first)
    release = str(tmp_path / "release")
    subs = subjects(tmp_path, 2, "sleep", 0.01)
    subs[0].update(action="wait_for_file", arg=release)
    job = run(J.work, subs, RunPolicy(workers=2, resume=False, **FAST), progress=False,
              ordered=False)
    it = iter(job)
    try:
        first = next(it)
    finally:
        open(release, "w").close()
    out = [first, *it]
    assert [x.subject_id for x in out] == ["S001", "S000"]  # each once, as they finished
    later = subjects(tmp_path / "ordered", 2, "sleep", 0.01)
    later[0].update(action="wait_for_file",  # S000 ends after S001 has
                    arg=os.path.join(later[1]["dir"], "S001.*.end"))
    r, out = go(J.work, later, workers=2, resume=False)
    assert [x.subject_id for x in out] == ["S000", "S001"]
