"""Persistent job workers keep their ``setup()``: an ordinary exception in a subject is
that subject's failure, not a reason to restart the worker. A worker is replaced only
after a crash, a timeout, or ``persistent_worker_max_consecutive_failures`` failures in
a row (default ``RunPolicy().persistent_worker_max_consecutive_failures``, 10). Real processes;
``setup()`` counts its calls in files (``_job_fns.WithSetup``)."""

from __future__ import annotations

import os

import _job_fns as J
from zephon.jobs import RunPolicy, run
from zephon import RunPolicy

RESTART_AFTER_FAILURES = RunPolicy().persistent_worker_max_consecutive_failures

FAST = dict(graceful_shutdown_sec=2.0, subject_spawn_timeout_sec=60.0, resume=False,
            backend="process", auto_retry_rounds=0)


def setups(directory) -> dict[int, int]:
    """pid -> how many times setup() ran in that process."""
    out = {}
    for name in os.listdir(directory):
        if name.startswith("setup."):
            with open(os.path.join(directory, name)) as fh:
                out[int(name.split(".")[1])] = len(fh.read())
    return out


def subjects(directory, actions) -> list[dict]:
    return [{"subject_id": f"S{i:03d}", "dir": str(directory), "action": action}
            for i, action in enumerate(actions)]


def test_failing_subjects_do_not_restart_a_persistent_worker(tmp_path):
    subs = subjects(tmp_path, ["raise"] * 5 + ["ok"])
    job = run(J.WithSetup(str(tmp_path)), subs, RunPolicy(workers=1, **FAST), progress=False)
    out = list(job)
    assert [x.ok for x in out] == [False] * 5 + [True]
    assert "failed on purpose" in str(out[0].error)
    assert list(setups(tmp_path).values()) == [1]  # one worker, set up once
    assert out[5].value["pid"] in setups(tmp_path)  # ... which ran the subject after them
    assert job.summary["workers_started"] == 1 and "restarts" not in job.summary
    assert f"restart after {RESTART_AFTER_FAILURES} consecutive" in job.explain()


def test_a_run_of_default_many_failures_restarts_it(tmp_path):
    n = RESTART_AFTER_FAILURES
    subs = subjects(tmp_path, ["raise"] * n + ["ok"])
    job = run(J.WithSetup(str(tmp_path)), subs, RunPolicy(workers=1, **FAST), progress=False)
    out = list(job)
    assert out[-1].ok and job.summary["restarts"] == 1
    assert sorted(setups(tmp_path).values()) == [1, 1]  # a fresh worker for the last one


def test_a_crash_still_replaces_the_worker(tmp_path):
    subs = subjects(tmp_path, ["kill_self", "ok"])
    job = run(J.WithSetup(str(tmp_path)), subs, RunPolicy(workers=1, oom_backoff=False,
                                                          **FAST), progress=False)
    out = list(job)
    assert not out[0].ok and out[1].ok
    assert len(setups(tmp_path)) == 2


def test_isolated_mode_still_gives_every_subject_a_fresh_worker(tmp_path):
    subs = subjects(tmp_path, ["raise", "raise", "ok"])
    job = run(J.WithSetup(str(tmp_path)), subs,
              RunPolicy(workers=1, parallel_mode="isolated", **FAST), progress=False)
    list(job)
    assert len(setups(tmp_path)) == 3
