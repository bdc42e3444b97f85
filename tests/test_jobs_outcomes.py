"""Exactly one outcome per subject: a slow consumer never turns a success into a timeout,
subjects finishing within a few milliseconds of their timeout never hang the run, and
every process a subject started is gone when the run ends.

Real spawn workers, real signals; every run is bounded by a pytest timeout, and nothing
asserts a wall-clock duration (the verdicts are checked against the workers' own reports).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from _procs import alive

import _job_fns as J
from zephon import SubjectTimeoutError
from zephon.jobs import RunPolicy, run

TIMEOUT = 1.0


@pytest.fixture
def helpers(tmp_path):
    """The log directory of the subjects; every helper process whose pid a subject wrote
    there is killed at teardown, whether the test passed or not."""
    d = tmp_path / "log"
    d.mkdir()
    yield str(d)
    for what in ("grandchild", "background", "daemon", "server"):
        for pid in J.helper_pids(str(d), what):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def slow_consumer_run(log_dir: str) -> list:
    """Subjects of 0.2-0.4 s, a 1 s timeout, 2 workers, and a loop body that spends 1.5 s on
    each result (the scenario that produced a false timeout and then hung)."""
    subs = [{"subject_id": f"S{i}", "dir": log_dir, "action": "sleep", "arg": a}
            for i, a in enumerate([0.2, 0.4, 0.3, 0.2, 0.4, 0.3])]
    job = run(J.work, subs, RunPolicy(workers=2, subject_timeout_sec=TIMEOUT,
                                      graceful_shutdown_sec=1.0, auto_retry_rounds=0,
                                      resume=False), progress=False)
    out = []
    for result in job:
        out.append(result)
        time.sleep(1.5)
    assert [r.subject_id for r in out] == [s["subject_id"] for s in subs]  # one each
    errors = {r.subject_id: repr(r.error) for r in out if not r.ok}
    assert not errors, f"a slow consumer turned successes into failures: {errors}"
    assert job.summary["timeouts"] == 0 and job.summary["done"] == len(subs)
    return out


def near_timeout_sweep(log_dir: str, timeout: float = 0.5) -> None:
    """Subjects that finish within a few ms of their timeout, on both sides of it."""
    offsets = [-0.1, -0.02, -0.005, -0.002, -0.001, 0.0, 0.001, 0.002, 0.005, 0.02]
    subs = [{"subject_id": f"T{i:02d}", "arg": timeout + off} for i, off in enumerate(offsets)]
    job = run(J.sleep_for, subs, RunPolicy(workers=2, subject_timeout_sec=timeout,
                                           graceful_shutdown_sec=1.0, auto_retry_rounds=0,
                                           resume=False), progress=False)
    out = list(job)
    assert [r.subject_id for r in out] == [s["subject_id"] for s in subs]
    for r, off in zip(out, offsets):
        if r.ok:  # a success is one the worker reported finishing within the timeout
            assert r.value == r.subject_id and r.duration_s <= timeout
        else:
            assert isinstance(r.error, SubjectTimeoutError), repr(r.error)
            assert off > -0.1, "a subject 100 ms inside its timeout was timed out"
    assert out[0].ok  # 100 ms of margin: never a timeout
    counted = job.summary["done"] + job.summary["failed"]
    assert counted == len(subs) and job.summary["timeouts"] == sum(not r.ok for r in out)


@pytest.mark.timeout(120)
def test_slow_consumer_never_turns_a_success_into_a_timeout(helpers):
    slow_consumer_run(helpers)


@pytest.mark.timeout(120)
def test_subjects_finishing_at_the_timeout_give_one_outcome_each_and_the_run_ends(helpers):
    near_timeout_sweep(helpers)


@pytest.mark.timeout(120)
def test_unordered_slow_consumer_gets_each_subject_once(helpers):
    subs = [{"subject_id": f"U{i}", "arg": a} for i, a in enumerate([0.3, 0.2, 0.4, 0.1])]
    job = run(J.sleep_for, subs, RunPolicy(workers=2, subject_timeout_sec=TIMEOUT,
                                           graceful_shutdown_sec=1.0, auto_retry_rounds=0,
                                           resume=False), progress=False, ordered=False)
    seen = []
    for r in job:
        seen.append(r.subject_id)
        assert r.ok, repr(r.error)
        time.sleep(1.5)
    assert sorted(seen) == sorted(s["subject_id"] for s in subs)


@pytest.mark.timeout(120)
def test_a_report_sent_after_the_timeout_is_not_a_second_outcome(helpers):
    # The worker ignores the SIGTERM and reports a success 0.5 s past its timeout, before
    # the SIGKILL: the subject timed out, once; the late report is no second outcome.
    subs = [{"subject_id": "L0", "dir": helpers, "action": "finish_late", "arg": 1.5},
            {"subject_id": "L1", "dir": helpers, "action": "sleep", "arg": 0.1}]
    job = run(J.work, subs, RunPolicy(workers=2, subject_timeout_sec=TIMEOUT,
                                      graceful_shutdown_sec=3.0, auto_retry_rounds=1,
                                      resume=False), progress=False)
    out = list(job)
    assert [r.subject_id for r in out] == ["L0", "L1"]
    assert isinstance(out[0].error, SubjectTimeoutError) and out[0].attempts == 2
    assert out[1].ok and out[1].attempts == 1
    assert job.summary["timeouts"] == 2 and job.summary["failed"] == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("repetition", range(50))
def test_slow_consumer_50_times(helpers, repetition):
    slow_consumer_run(helpers)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("repetition", range(50))
def test_near_timeout_sweep_50_times(helpers, repetition):
    near_timeout_sweep(helpers)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(120)
@pytest.mark.parametrize("repetition", range(3))
def test_slow_consumer_and_sweep_ci(helpers, repetition):
    slow_consumer_run(helpers)
    near_timeout_sweep(helpers)


# -- the whole process tree ------------------------------------------------------------

@pytest.mark.timeout(120)
def test_timeout_kills_a_grandchild_that_ignores_sigterm(helpers):
    subs = [{"subject_id": "G0", "dir": helpers, "action": "stubborn_grandchild"},
            {"subject_id": "G1", "dir": helpers, "action": "ok"}]
    job = run(J.work, subs, RunPolicy(workers=2, subject_timeout_sec=2.0,
                                      graceful_shutdown_sec=1.0, auto_retry_rounds=0,
                                      resume=False), progress=False)
    out = list(job)
    assert isinstance(out[0].error, SubjectTimeoutError) and out[1].ok
    assert out[0].error.subject_id == "G0" and "subject 'G0' (#0)" in str(out[0].error)
    grandchildren = J.helper_pids(helpers, "grandchild")
    assert len(grandchildren) == 1
    # The run has ended: nothing it started may still be alive (no waiting allowed here).
    assert not any(alive(p) for p in grandchildren), \
        "a grandchild ignoring SIGTERM outlived the run"


@pytest.mark.timeout(120)
def test_timeout_ends_a_daemon_that_left_the_process_group(helpers):
    subs = [{"subject_id": "D0", "dir": helpers, "action": "daemon_then_hang"}]
    job = run(J.work, subs, RunPolicy(workers=1, subject_timeout_sec=2.0,
                                      graceful_shutdown_sec=1.0, auto_retry_rounds=0,
                                      resume=False), progress=False)
    out = list(job)
    assert isinstance(out[0].error, SubjectTimeoutError)
    daemons = J.helper_pids(helpers, "daemon")
    assert len(daemons) == 1 and not any(alive(p) for p in daemons), \
        "a double-forked daemon in its own session outlived the timeout"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["persistent", "isolated"])
def test_processes_left_by_successful_subjects_are_gone_after_the_run(helpers, mode):
    subs = [{"subject_id": f"B{i}", "dir": helpers, "action": "background"} for i in range(2)]
    subs += [{"subject_id": "D0", "dir": helpers, "action": "daemon"},
             {"subject_id": "K0", "dir": helpers, "action": "ok"}]
    job = run(J.work, subs, RunPolicy(workers=2, subject_timeout_sec=30.0,
                                      graceful_shutdown_sec=1.0, parallel_mode=mode,
                                      auto_retry_rounds=0, resume=False), progress=False)
    out = list(job)
    assert all(r.ok for r in out), [repr(r.error) for r in out]
    left = J.helper_pids(helpers, "background") + J.helper_pids(helpers, "daemon")
    assert len(left) == 3
    assert not any(alive(p) for p in left), "a process started by a subject outlived the run"
    assert "process group" in job.explain() and "subreaper" in job.explain()


@pytest.mark.timeout(120)
def test_a_daemon_left_by_a_subject_does_not_survive_a_later_subject_killing_the_worker(
        helpers):
    """Persistent worker: a subject leaves a daemon in its own session and succeeds, the
    next subject on the same worker SIGKILLs it. The worker's own clean-up dies with it
    and the daemon left its group, so it must be ended when its subject is done."""
    subs = [{"subject_id": "D0", "dir": helpers, "action": "daemon"},
            {"subject_id": "X0", "dir": helpers, "action": "kill_self"}]
    job = run(J.work, subs, RunPolicy(workers=1, subject_timeout_sec=30.0,
                                      graceful_shutdown_sec=1.0, parallel_mode="persistent",
                                      auto_retry_rounds=0, resume=False), progress=False)
    out = list(job)
    assert out[0].ok and not out[1].ok
    assert "running subject 'X0' (#1)" in str(out[1].error)
    daemons = J.helper_pids(helpers, "daemon")
    assert len(daemons) == 1
    assert not alive(daemons[0]), "a subject's daemon outlived its worker's SIGKILL"


@pytest.mark.timeout(120)
def test_processes_started_by_setup_serve_every_subject_and_end_with_the_worker(helpers):
    """What setup() starts is the worker's, not a subject's: it stays up across subjects
    (while what each subject leaves is ended after it) and is ended when the run ends."""
    subs = [{"subject_id": f"B{i}", "dir": helpers, "action": "background"} for i in range(3)]
    job = run(J.WithServer(helpers), subs,
              RunPolicy(workers=1, subject_timeout_sec=30.0, graceful_shutdown_sec=1.0,
                        parallel_mode="persistent", auto_retry_rounds=0, resume=False),
              progress=False)
    out = list(job)
    assert all(r.ok for r in out), [repr(r.error) for r in out]
    assert all(r.value["server_alive"] for r in out)
    servers = J.helper_pids(helpers, "server")
    left = J.helper_pids(helpers, "background")
    assert len(servers) == 1 and len(left) == 3
    assert not any(alive(p) for p in servers + left)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fn", [J.LazyPool(), J.forkserver_pool], ids=["setup_pool", "forkserver"])
def test_pools_started_during_a_subject_keep_serving_later_subjects(fn):
    """Processes a pool starts on first use stay in the worker's process group: the end of
    a subject leaves them alone (and never reaps them behind the pool's back)."""
    subs = [{"subject_id": f"P{i}"} for i in range(4)]
    job = run(fn, subs, RunPolicy(workers=1, subject_timeout_sec=60.0,
                                  graceful_shutdown_sec=1.0, parallel_mode="persistent",
                                  auto_retry_rounds=0, resume=False), progress=False)
    out = list(job)
    assert all(r.ok for r in out), [repr(r.error) for r in out]
    assert {repr(r.value) for r in out} == {repr(out[0].value)}


@pytest.mark.timeout(120)
def test_a_stubborn_daemon_costs_its_own_subject_not_the_next(helpers):
    """Ending what a subject left (a daemon that ignores SIGTERM: grace/2, then SIGKILL)
    happens before its report: that time is its own; the next subject is not blamed."""
    subs = [{"subject_id": "D0", "dir": helpers, "action": "daemon"},
            {"subject_id": "K0", "dir": helpers, "action": "ok"}]
    job = run(J.work, subs, RunPolicy(workers=1, subject_timeout_sec=30.0,
                                      graceful_shutdown_sec=4.0, parallel_mode="persistent",
                                      auto_retry_rounds=0, resume=False), progress=False)
    out = list(job)
    assert all(r.ok for r in out), [repr(r.error) for r in out]
    assert out[0].duration_s >= 2.0 > out[1].duration_s  # grace/2 of waiting was D0's
    assert not any(alive(p) for p in J.helper_pids(helpers, "daemon"))
