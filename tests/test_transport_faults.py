"""Faults around the parent: SIGKILL of the parent, exit without close(), stale names.

A helper 'parent' runs as its own process (a real python), starts a pool whose
workers are busy, reports their pids, and is then killed or exits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from _procs import alive, wait_gone

from zephon.transport.arena import SEGMENT_PREFIX, segment_name, sweep_stale_segments

TESTS = os.path.dirname(os.path.abspath(__file__))

PARENT = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {tests!r})
    import _transport_handlers as H
    from zephon import RuntimeOptions
    from zephon.transport import WorkerPool

    if __name__ == "__main__":
        pool = WorkerPool(H.handle, 2, config=H.config(RuntimeOptions(
            ipc_transport={transport!r}, shm_min_new_allocation_bytes=0)))
        pool.start()
        held = []
        for k in range(2):
            pool.submit(("full", (4 << 20, k)), worker=k)
            held.append(pool.get(timeout=60))
        pids = []
        for k in range(2):
            pool.submit(("pid", None), worker=k)
            pids.append(pool.get(timeout=60).value)
        for k in range(2):
            pool.submit(("sleep", 120), worker=k)
        print(json.dumps(pids), flush=True)
        if {mode!r} == "exit":
            sys.exit(0)  # no close(): the interpreter's exit must clean up
        time.sleep(300)
""")




def shm_entries(parent_pid: int | None = None) -> set[str]:
    """Names in /dev/shm; with ``parent_pid``, only the segments of that parent's run
    (other processes on the machine create and remove their own names meanwhile)."""
    try:
        names = set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()
    if parent_pid is None:
        return names
    return {n for n in names if n.startswith(f"{SEGMENT_PREFIX}{parent_pid:x}_")}


def run_parent(transport: str, mode: str):
    code = PARENT.format(tests=TESTS, transport=transport, mode=mode)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while True:  # the pid list is the first JSON line; anything else is kept for the report
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"helper parent failed: {seen} {proc.stderr.read()}")
            try:
                return proc, json.loads(line)
            except ValueError:
                seen.append(line)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


@contextlib.contextmanager
def helper_parent(transport: str, mode: str):
    """The helper parent and its workers' pids; everything is killed and reaped after."""
    proc, pids = run_parent(transport, mode)
    try:
        yield proc, pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("transport", ["socketpair", "pipe"])
def test_sigkill_of_the_parent_takes_the_workers_down(transport):
    with helper_parent(transport, "kill") as (proc, pids):
        assert all(alive(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        left = wait_gone(pids, 5.0)
        assert not left, f"workers {left} outlived their parent by 5 s"
        assert shm_entries(proc.pid) == set()


@pytest.mark.parametrize("transport", ["socketpair", "pipe"])
def test_parent_exit_without_close_cleans_up(transport):
    with helper_parent(transport, "exit") as (proc, pids):
        assert proc.wait(30) == 0  # busy workers (120 s tasks) do not hold the exit
        assert not wait_gone(pids, 5.0)
        assert shm_entries(proc.pid) == set()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="names are listable on Linux only")
def test_sweep_removes_only_segments_of_dead_runs():
    import _posixshmem

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    dead_pid = int(dead)
    stale = segment_name(dead_pid, dead_pid, "beef", 0)
    ours = segment_name(os.getpid(), dead_pid, "beef", 1)  # our run: the parent is alive
    for name in (stale, ours):
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
    try:
        removed = sweep_stale_segments()
        assert stale in removed and ours not in removed
        assert stale not in shm_entries() and ours in shm_entries()
    finally:
        for name in (stale, ours):
            try:
                _posixshmem.shm_unlink("/" + name)
            except FileNotFoundError:
                pass
