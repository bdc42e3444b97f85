"""One death detector (zephon.transport.deaths) for the pool and the jobs backend.

A worker is killed (a real process, a real signal, or os._exit) while some waiter is
blocked: a consumer in WorkerPool.get(), a thread in wait_for_exit(), a job run's
driver waiting for a subject's result, a job run's dispatcher waiting for a free worker.
Each must wake and report which worker, which pid, how it died and what it was running,
the pool and the jobs backend alike. Order is asserted (the waiter is blocked before the
kill; it returns after), never a duration: the joins' timeouts are hang guards."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import selectors
import signal
import threading
import time

import _job_fns as J
import _transport_handlers as H
import pytest
from _procs import HANG_S, alive, wait_gone, wait_until_blocked_in
from _supervisor_children import obeys_stop

from zephon import WorkerCrashedError
from zephon.jobs import RunPolicy, run
from zephon.transport import WorkerPool
from zephon.transport.deaths import Death, DeathWatch
from zephon.transport.supervisor import Child, await_ready

SPAWN = multiprocessing.get_context("spawn")
#: Every crash report starts the same way, pool or job run.
REPORT = re.compile(r"^worker (\d+) \(pid (\d+)\) of (pool '\w+'|job run of \w+) died by "
                    r"(signal SIG[A-Z]+|exit code \d+)")


def kill_by(how: str, pid: int, cue: str) -> int:
    """End worker ``pid``: a signal sent to it, or (``"exit"``) the cue file the worker
    waits for before it calls ``os._exit(3)``; returns the exit code it will show."""
    if how == "exit":
        open(cue, "w").close()
        return 3
    sig = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}[how]
    os.kill(pid, sig)
    return -sig


def in_thread(target) -> tuple[threading.Thread, list]:
    """Run ``target()`` in a thread; the list gets what it returned or raised."""
    outcome: list = []

    def body():
        try:
            outcome.append(target())
        except BaseException as exc:  # noqa: BLE001 - what it raised is the outcome
            outcome.append(exc)

    thread = threading.Thread(target=body, name="waiter", daemon=True)
    thread.start()
    return thread, outcome


def assert_report(error, *, worker: int, pid: int, code: int, tasks_nonempty: bool = True):
    """The fields and the words of a crash report, the same whoever made it."""
    assert isinstance(error, WorkerCrashedError), error
    assert (error.worker, error.pid) == (worker, pid)
    assert error.signal == (-code if code < 0 else None)
    assert bool(error.tasks) == tasks_nonempty
    match = REPORT.match(str(error))
    assert match, str(error)
    assert (int(match[1]), int(match[2])) == (worker, pid)


# -- the detector itself ------------------------------------------------------------------

@pytest.fixture
def children():
    started: list[Child] = []

    def start() -> Child:
        child = Child.spawn(SPAWN, obeys_stop, name="zephon-test-child")
        started.append(child)
        await_ready({len(started): child}, HANG_S, "test")
        return child

    yield start
    for child in started:
        if child.exitcode is None:
            child.signal(signal.SIGKILL)
        child.reap(HANG_S)
        child.close_channel()


def test_a_death_wakes_a_select_and_a_thread_waiting_on_the_watch(children):
    first, second = children(), children()
    watch = DeathWatch("test")
    try:
        watch.watch(0, first)
        watch.watch(1, second)
        waiting, woke = in_thread(lambda: watch.wait(HANG_S))
        selector = selectors.DefaultSelector()
        selector.register(watch.fileno(), selectors.EVENT_READ)
        selecting, ready = in_thread(lambda: selector.select(HANG_S))
        wait_until_blocked_in(waiting, "wait")
        wait_until_blocked_in(selecting, "select")
        assert watch.take() == [] and watch.crashed() == {}  # nothing yet
        os.kill(second.pid, signal.SIGKILL)
        waiting.join(HANG_S)
        selecting.join(HANG_S)
        assert woke == [True] and len(ready[0]) == 1
        assert watch.take() == [Death(1, second, -signal.SIGKILL, False)]
        assert watch.crashed() == {1: -signal.SIGKILL}
        assert alive(first.pid)
        selector.close()
    finally:
        watch.close()
    assert not watch.running


def test_a_stopped_child_is_reported_as_stopped_never_as_a_crash(children, caplog):
    child = children()
    watch = DeathWatch("test", logger=logging.getLogger("zephon.test"))
    try:
        watch.watch(7, child)
        selector = selectors.DefaultSelector()
        selector.register(watch.fileno(), selectors.EVENT_READ)
        child.send_stop()  # marks it stopped first, as every owner does
        assert selector.select(HANG_S)
        assert watch.take() == [Death(7, child, 0, True)]
        assert watch.crashed() == {} and not watch.wait(0)
        assert "exited" not in caplog.text
        selector.close()
    finally:
        watch.close()


def test_a_death_is_seen_while_a_grandchild_holds_the_sentinel_open(tmp_path):
    # fork_holder leaves a grandchild with every descriptor the worker had, the sentinel's
    # write end and the channel included: no EOF, no readable sentinel; only the status
    with WorkerPool(H.handle, 1) as pool:
        pool.submit(("pid", None))
        pid = pool.get(timeout=HANG_S).value
        pool.submit(("fork_holder", 120))
        holder = pool.get(timeout=HANG_S).value
        try:
            pool.submit(("sleep", 120))
            consumer, outcome = in_thread(lambda: pool.get(timeout=HANG_S))
            wait_until_blocked_in(consumer, "select")
            os.kill(pid, signal.SIGKILL)
            consumer.join(HANG_S)
            assert not consumer.is_alive()
            assert_report(outcome[0], worker=0, pid=pid, code=-signal.SIGKILL)
            assert alive(holder)  # it really held everything open all along
        finally:
            os.kill(holder, signal.SIGKILL)
            assert not wait_gone(holder, HANG_S)


# -- the pool's waiters -------------------------------------------------------------------

@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "exit"])
def test_a_consumer_blocked_in_get_wakes_with_the_crash(tmp_path, how):
    cue = str(tmp_path / "cue")
    with WorkerPool(H.handle, 2, name="deaths") as pool:
        pool.submit(("pid", None), worker=1)
        pid = pool.get(timeout=HANG_S).value
        task = pool.submit(("exit_when", (cue, 3)), worker=1)
        consumer, outcome = in_thread(lambda: pool.get(timeout=HANG_S))
        watcher, exited = in_thread(lambda: pool.wait_for_exit(HANG_S))
        wait_until_blocked_in(consumer, "select")
        wait_until_blocked_in(watcher, "wait")
        code = kill_by(how, pid, cue)
        consumer.join(HANG_S)
        watcher.join(HANG_S)
        assert not consumer.is_alive() and not watcher.is_alive()
        assert exited == [{1: code}]
        assert_report(outcome[0], worker=1, pid=pid, code=code)
        assert outcome[0].tasks == [task]
        assert pool.live_workers() == [0]


# -- the jobs backend's waiters -----------------------------------------------------------

def started_pid(directory: str, subject_id: str) -> int:
    """The pid of the worker that started ``subject_id`` (its start file says)."""
    names = [n for n in os.listdir(directory) if n.startswith(subject_id + ".")
             and n.endswith(".start")]
    return int(names[0].split(".")[1]) if names else 0


def wait_started(directory: str, subject_id: str, driver: threading.Thread) -> int:
    """Wait until the driver is blocked in its loop and ``subject_id`` runs (the barrier
    is the subject's own start file); the pid of its worker."""
    wait_until_blocked_in(driver, "select")
    deadline = time.monotonic() + HANG_S
    while driver.is_alive() and time.monotonic() < deadline:
        pid = started_pid(directory, subject_id)
        if pid:
            return pid
        time.sleep(0.01)
    raise AssertionError(f"{subject_id} never started")


def job_run(subs, workers: int):
    policy = RunPolicy(workers=workers, graceful_shutdown_sec=2.0, auto_retry_rounds=0,
                       subject_spawn_timeout_sec=HANG_S, resume=False)
    return in_thread(lambda: list(run(J.work, subs, policy, progress=False)))


@pytest.mark.parametrize("how", ["SIGKILL", "exit"])
def test_a_job_driver_waiting_for_a_result_wakes_with_the_crash(tmp_path, how):
    cue = str(tmp_path / "cue")
    subs = [{"subject_id": "S000", "dir": str(tmp_path), "action": "exit_when",
             "arg": (cue, 3)}]
    driver, outcome = job_run(subs, workers=1)
    pid = wait_started(str(tmp_path), "S000", driver)
    code = kill_by(how, pid, cue)
    driver.join(HANG_S)
    assert not driver.is_alive()
    (result,) = outcome[0]
    assert not result.ok
    assert_report(result.error, worker=0, pid=pid, code=code)


def test_a_job_dispatcher_waiting_for_a_free_worker_wakes_when_it_dies(tmp_path):
    # one worker, two subjects: S001 waits for the worker S000 holds; S000's worker is
    # killed, its crash is S000's outcome and S001 runs on the next worker
    subs = [{"subject_id": "S000", "dir": str(tmp_path), "action": "sleep", "arg": 600},
            {"subject_id": "S001", "dir": str(tmp_path), "action": "ok"}]
    driver, outcome = job_run(subs, workers=1)
    pid = wait_started(str(tmp_path), "S000", driver)
    assert started_pid(str(tmp_path), "S001") == 0  # it waits for a worker
    os.kill(pid, signal.SIGKILL)
    driver.join(HANG_S)
    assert not driver.is_alive()
    first, second = outcome[0]
    assert_report(first.error, worker=0, pid=pid, code=-signal.SIGKILL)
    assert second.ok and second.value["pid"] != pid


def test_the_pool_and_a_job_run_report_a_death_alike(tmp_path):
    with WorkerPool(H.handle, 1, name="alike") as pool:
        pool.submit(("pid", None))
        pool_pid = pool.get(timeout=HANG_S).value
        pool.submit(("sleep", 600))
        os.kill(pool_pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError) as pool_crash:
            pool.get(timeout=HANG_S)
    subs = [{"subject_id": "S000", "dir": str(tmp_path), "action": "sleep", "arg": 600}]
    driver, outcome = job_run(subs, workers=1)
    job_pid = wait_started(str(tmp_path), "S000", driver)
    os.kill(job_pid, signal.SIGKILL)
    driver.join(HANG_S)
    job_crash = outcome[0][0].error
    for crash, pid in ((pool_crash.value, pool_pid), (job_crash, job_pid)):
        assert_report(crash, worker=0, pid=pid, code=-signal.SIGKILL)
    # then each says what was lost: the pool its tasks in flight, the run its subject
    assert "with task(s) [1] in flight" in str(pool_crash.value)
    assert "while running" in str(job_crash) and "S000" in str(job_crash)
