"""Prompt exit and a quiet shutdown: interpreter exit never waits on a zephon process,
Ctrl-C to the process group is one KeyboardInterrupt in the main process, and workers
that zephon stops itself are never reported as crashes nor re-dispatched.

Each scenario runs a real helper script as its own process (its own session, so a
SIGINT to its group reaches only it and its workers)."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import _transport_handlers as H
from _procs import HANG_S, alive, wait_gone, wait_until_blocked_in

from zephon import RuntimeOptions
from zephon.errors import TransportError
from zephon.transport import WorkerPool

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_script(body: str, *, signal_after_ready: int | None = None):
    """Run ``body`` as ``python -c`` in a new session; returns (returncode, stdout lines,
    stderr, worker pids the script printed as its first JSON line)."""
    code = textwrap.dedent(f"""
        import json, logging, sys, time
        sys.path.insert(0, {TESTS!r})
        import _transport_handlers as H
        from zephon import RuntimeOptions
        from zephon.transport import WorkerPool
    """) + textwrap.dedent(body)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids: list[int] = []
    try:
        first = proc.stdout.readline()
        if first:
            pids = json.loads(first)
        if signal_after_ready is not None and first:
            wait_until_polling(proc.pid)  # the main process waits inside get()
            os.killpg(proc.pid, signal_after_ready)
        out, err = proc.communicate(timeout=HANG_S)
        return proc.returncode, out, err, pids
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def wait_until_polling(pid: int, timeout: float = HANG_S) -> None:
    """Wait until the main thread of ``pid`` sleeps in the kernel's poll (what
    ``selectors`` waits in): where it really is, not a sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/wchan") as fh:
                where = fh.read()
        except OSError:
            return  # no /proc: signal right away
        if "poll" in where or "select" in where:
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} never waited in poll")


def test_exit_without_close_never_waits_on_a_non_daemon_worker():
    # multiprocessing's exit handler joins non-daemon children and runs before atexit
    # callbacks registered earlier: the pool must be closed before it runs.
    rc, out, err, pids = run_script("""
        if __name__ == "__main__":
            pool = WorkerPool(H.handle, 2, daemon=False).start()
            pids = []
            for k in range(2):
                pool.submit(("pid", None), worker=k)
                pids.append(pool.get(timeout=60).value)
            pool.submit(("sleep", 0.2), worker=0)  # one task still in flight
            print(json.dumps(pids), flush=True)
            sys.exit(0)  # no close()
    """)
    assert rc == 0, err
    assert len(pids) == 2
    assert not wait_gone(pids, 5.0)
    assert "Traceback" not in err, err


def test_ctrl_c_to_the_group_is_one_keyboard_interrupt_and_no_worker_traceback():
    rc, out, err, pids = run_script("""
        if __name__ == "__main__":
            pool = WorkerPool(H.handle, 2, config=H.config(RuntimeOptions(
                shm_min_new_allocation_bytes=0))).start()
            pids = []
            for k in range(2):
                pool.submit(("pid", None), worker=k)
                pids.append(pool.get(timeout=60).value)
            print(json.dumps(pids), flush=True)
            while True:  # a consumer loop: workers busy, the main process in get()
                for k in range(2):
                    pool.submit(("full", (1 << 20, k)), worker=k)
                    pool.submit(("sleep", 0.05), worker=k)
                for _ in range(4):
                    pool.get(timeout=60)
    """, signal_after_ready=signal.SIGINT)
    assert rc != 0
    assert err.count("KeyboardInterrupt") == 1, err
    assert err.count("Traceback") == 1, err
    for noise in ("zephon-pool", "Process ", "worker_entry", "zephon-worker"):
        assert noise not in err, err
    assert not wait_gone(pids, 5.0)


@pytest.mark.parametrize("mtp", [False, True], ids=["process", "mtp"])
def test_pipeline_break_then_exit_is_prompt_and_reports_no_crash(mtp):
    # The pipeline is left after a break and never closed: the interpreter's exit stops its
    # workers (and the non-daemon MTP subprocess), which must not be logged as crashes,
    # re-dispatched, or waited on.
    rc, out, err, pids = run_script(f"""
        from zephon import Pipeline, sources

        if __name__ == "__main__":
            logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                                format="%(levelname)s %(name)s %(message)s")
            pipe = Pipeline(sources.from_callable(400, H.load_slow)).map(H.plus_one).options(
                RuntimeOptions(runner="process", max_workers=2, mtp_mode={mtp}))
            for n, item in enumerate(pipe):
                if n == 50:
                    break
            import multiprocessing
            print(json.dumps([p.pid for p in multiprocessing.active_children()]),
                  flush=True)
    """)
    assert rc == 0, err
    for noise in ("ERROR", "died by", "re-dispatching", "unknown cause", "Traceback"):
        assert noise not in err, err
    assert not wait_gone(pids, 5.0)


@pytest.fixture
def pool():
    pools = []

    def make(*args, **kwargs):
        p = WorkerPool(*args, **kwargs)
        pools.append(p)
        return p.start()

    yield make
    for p in pools:
        p.close()


@pytest.mark.parametrize("mode", ["immediate", "hard", "graceful"])
def test_close_under_a_blocked_get_is_not_a_crash(pool, caplog, tmp_path, mode):
    p = pool(H.handle, 2, config=H.config(RuntimeOptions(shutdown_mode=mode)))
    # each worker holds its task until it is told to stop, and says when it entered it
    marks = [str(tmp_path / f"held.{k}") for k in range(2)]
    for k in range(2):
        p.submit(("hold", marks[k]), worker=k)
    outcome = []

    def consumer():
        try:
            while True:
                p.get(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - what get() raised is the result
            outcome.append(exc)

    thread = threading.Thread(target=consumer)
    with caplog.at_level(logging.DEBUG, logger="zephon"):
        thread.start()
        wait_until_blocked_in(thread, "select")  # the consumer waits inside get()...
        for mark in marks:  # ...while both workers are inside their task
            assert wait_for_file(mark), f"{mark} never entered its task"
        p.close()
        thread.join(HANG_S)
    assert not thread.is_alive()
    assert len(outcome) == 1 and type(outcome[0]) is TransportError, outcome
    assert "closed" in str(outcome[0])
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]
    assert p.exited == {} and p.crashes == []
    stopped = [os.path.exists(mark + ".stopped") for mark in marks]
    if mode == "immediate":  # a busy worker is killed at once: its task never sees STOP
        assert stopped == [False, False]
    elif mode == "graceful":  # the task saw STOP and finished within the grace
        assert stopped == [True, True]


def wait_for_file(path: str, timeout: float = HANG_S) -> bool:
    """Wait until ``path`` exists (a worker writes it): True once it does."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_close_drains_a_worker_blocked_sending_its_result(pool, caplog):
    # A result larger than the socket buffers, with shared memory off: the worker is
    # blocked in send when STOP arrives; the graceful close() reads it away and the worker
    # exits by itself (exit code 0), without terminate.
    p = pool(H.handle, 1, config=H.config(RuntimeOptions(
        shm_enabled=False, shutdown_mode="graceful", ipc_buffer_bytes=64 << 10)))
    p.submit(("ones", 32 << 20))
    # the first bytes of the 32 MiB result are here: the worker is blocked sending the rest
    readable, _, _ = select.select([p.workers[0].channel.fileno()], [], [], HANG_S)
    assert readable
    proc = p.workers[0].process
    with caplog.at_level(logging.WARNING, logger="zephon"):
        p.close()
    assert proc.exitcode == 0
    assert not caplog.records
