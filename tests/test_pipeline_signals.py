"""Ctrl-C, once or several times in quick succession, to a script iterating a pipeline on
process workers: the script ends, its workers are gone at once, and nothing is left (no
process of its group or of the workers' groups, no zephon name in /dev/shm), with one
``KeyboardInterrupt`` report and no worker traceback. Real scripts in their own process
group, real SIGINTs to the whole group (what a terminal's Ctrl-C does); a second or third
one lands while the first one's stop runs.

Each test prints how long the workers took to be gone after the first SIGINT (``-s``)."""

from __future__ import annotations

import glob
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _procs import HANG_S, live_processes
from _procs import alive as _alive

TESTS = os.path.dirname(os.path.abspath(__file__))

#: how soon after the first SIGINT the workers must be gone: a generous deadline on a
#: loaded machine (they take a few tens of milliseconds; the promise is under a second)
GONE_S = 5.0
#: between two SIGINTs of a series ("quick succession": within the first one's stop)
GAP_S = 0.02

SCRIPT = textwrap.dedent("""
    import multiprocessing, sys, time
    sys.path.insert(0, {tests!r})
    import _pipeline_fns as F
    from zephon import Pipeline, RuntimeOptions, sources

    def main():
        pipe = (Pipeline(sources.from_callable(10_000_000, F.make_sample), chunk_size=4)
                .map(F.double, parallelism=2).batch(4)
                .options(RuntimeOptions(runner="process", max_workers=2,
                                        ipc_transport="pipe")))  # names in /dev/shm
        it = iter(pipe)  # the workers start booting
        pids = [p.pid for p in multiprocessing.active_children()]
        if {phase!r} == "booting":
            print("PIDS", *pids, flush=True)
        for i, batch in enumerate(it):
            if i == 3:
                print("PIDS", *pids, flush=True)
            time.sleep(0.01)  # a training step

    if __name__ == "__main__":
        main()
""")


def alive(pid: int) -> bool:
    """:func:`_procs.alive`, for a process that may vanish while /proc is read."""
    try:
        return _alive(pid)
    except ProcessLookupError:
        return False


def _group_members(pgids: set[int]) -> list[int]:
    """Live processes (zombies excluded) whose process group is one of ``pgids``."""
    return [pid for pid, group, _, _ in live_processes() if group in pgids]


def _segments(pid: int) -> list[str]:
    """zephon's names in /dev/shm made for the run of process ``pid``."""
    return glob.glob(f"/dev/shm/zph_{pid:x}_*")


def _wait_until(predicate, timeout: float) -> float | None:
    """Seconds until ``predicate()`` held (polled), None if it did not within ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.005)
    return None


@pytest.fixture
def run_script(tmp_path):
    """Start the script in its own session; whatever the test leaves (its group, its
    workers' groups, its /dev/shm names) is killed and removed at the end."""
    started: list[tuple[subprocess.Popen, set[int]]] = []

    def start(phase: str):
        """``phase``: of :data:`SCRIPT`, or the name of a script already in tmp_path."""
        path = tmp_path / phase
        if not phase.endswith(".py"):
            path = tmp_path / "train.py"
            path.write_text(SCRIPT.format(tests=TESTS, phase=phase))
        proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        groups = {proc.pid}
        started.append((proc, groups))
        return proc, groups

    yield start
    for proc, groups in started:
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        for name in _segments(proc.pid):
            os.unlink(name)


def _interrupt(proc: subprocess.Popen, sigints: int,
               workers: list[int]) -> tuple[float, float | None]:
    """Send ``sigints`` SIGINTs to the script's group, :data:`GAP_S` apart, watching the
    workers meanwhile: (when the first was sent, the seconds from it until the workers
    were all gone: None if not within :data:`~_procs.HANG_S`)."""
    t0 = time.monotonic()
    sent, gone_s = 0, None
    while time.monotonic() - t0 < HANG_S:
        now = time.monotonic() - t0
        if sent < sigints and now >= sent * GAP_S:
            try:
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole group
            except ProcessLookupError:
                pass  # the script has ended already
            sent += 1
        if gone_s is None and not any(alive(p) for p in workers):
            gone_s = time.monotonic() - t0
        if gone_s is not None and sent == sigints:
            break
        time.sleep(0.002)
    return t0, gone_s


def _read_pids(proc: subprocess.Popen) -> list[int]:
    ready, _, _ = select.select([proc.stdout], [], [], HANG_S)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("PIDS"):
        proc.kill()
        pytest.fail(f"the script did not start: {line!r} {proc.communicate()}")
    return [int(p) for p in line.split()[1:]]


@pytest.mark.parametrize("sigints", [1, 2, 3])
@pytest.mark.parametrize("phase", ["booting", "running"])
def test_ctrl_c_ends_a_process_pipeline_at_once_and_leaves_nothing(run_script, phase,
                                                                    sigints):
    proc, groups = run_script(phase)
    workers = _read_pids(proc)
    assert len(workers) == 2, workers
    groups.update(workers)  # each worker leads a process group of its own
    t0, gone_s = _interrupt(proc, sigints, workers)
    try:
        _, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script did not end after {sigints} SIGINT(s) ({phase})")
    ended_s = time.monotonic() - t0
    print(f"\n{phase}, {sigints} SIGINT(s): workers gone "
          f"{'never' if gone_s is None else f'{gone_s:.3f} s'} after the first, "
          f"script ended after {ended_s:.3f} s")
    assert gone_s is not None and gone_s < GONE_S, (gone_s, err)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    # one report of the interrupt: no worker traceback (a worker that got the SIGINT
    # while starting up), no second KeyboardInterrupt out of a stop cut short
    assert "Fatal Python error" not in err and "Exception ignored" not in err, err
    assert err.count("Traceback") == 1, err
    assert _wait_until(lambda: not _group_members(groups), GONE_S) is not None, \
        _group_members(groups)
    assert _segments(proc.pid) == []


# -- a second Ctrl-C during a graceful stop ------------------------------------------------
# shutdown_mode="graceful": a Ctrl-C lets the op in flight finish (up to 10 s); a second
# one says "now": the workers, and the process the op started, are killed at once. Sample
# 2's op sleeps 30 s with a child process of its own (tests/_exit_fns.py: ``stall``).

GRACEFUL = textwrap.dedent("""
    import multiprocessing, sys
    sys.path.insert(0, {tests!r})
    import _exit_fns as X
    import _pipeline_fns as F
    from zephon import Pipeline, RuntimeOptions, sources

    def main():
        pipe = (Pipeline(sources.from_callable(1000, F.make_sample), chunk_size=1,
                         shuffle=False)
                .map(X.stall, parallelism=2)
                .options(RuntimeOptions(runner="process", max_workers=2,
                                        shutdown_mode="graceful")))
        for i, item in enumerate(pipe):
            if i == 0:
                pids = X.wait_for_stall() + [p.pid for p in multiprocessing.active_children()]
                print("PIDS", *pids, flush=True)

    if __name__ == "__main__":
        main()
""")


def test_a_second_ctrl_c_cuts_a_graceful_stop_short(run_script, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_TEST_DIR", str(tmp_path))
    (tmp_path / "graceful.py").write_text(GRACEFUL.format(tests=TESTS))
    proc, groups = run_script("graceful.py")
    pids = _read_pids(proc)  # the op's worker, its sleep child, then the workers
    assert len(pids) == 4, pids
    groups.update(pids[2:])
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)  # the stop waits for the 30 s op now
    assert all(alive(p) for p in pids[:2]), pids  # graceful: not killed by the first
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    gone_s = _wait_until(lambda: not any(alive(p) for p in pids), HANG_S)
    try:
        _, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the script did not end after a second SIGINT")
    print(f"\ngraceful, second SIGINT: every process gone after "
          f"{'never' if gone_s is None else f'{gone_s:.3f} s'}, script ended after "
          f"{time.monotonic() - t0:.3f} s")
    assert gone_s is not None and gone_s < GONE_S, (gone_s, err)
    assert not (tmp_path / "stall.done").exists()  # the op was not waited for
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    assert err.count("Traceback") == 1, err
    assert _wait_until(lambda: not _group_members(groups), GONE_S) is not None, \
        _group_members(groups)


# -- two Ctrl-Cs at once while the consumer waits for a batch -------------------------------
# The consumer (the main thread) waits in the hand-off from the pump thread most of the
# time (each sample's op sleeps). The first KeyboardInterrupt cuts that wait short, the
# second lands while the first unwinds. It broke the hand-off's lock (a threading.Condition
# wait is left half done): RuntimeError("release unlocked lock") instead of the
# KeyboardInterrupt, or close() deadlocked with the pump, the workers alive for good.

CATCHING = textwrap.dedent("""
    import multiprocessing, sys
    sys.path.insert(0, {tests!r})
    import _pipeline_fns as F
    from zephon import Pipeline, RuntimeOptions, sources

    def main():
        pipe = (Pipeline(sources.from_sequence([0.3] * 100_000), chunk_size=4,
                         shuffle=False)
                .map(F.slow_identity, parallelism=2).batch(4)
                .options(RuntimeOptions(runner="process", max_workers=2,
                                        ipc_transport="pipe")))
        it = iter(pipe)  # the workers start booting, the consumer waits for them
        print("PIDS", *[p.pid for p in multiprocessing.active_children()], flush=True)
        try:
            for batch in it:
                pass
        except KeyboardInterrupt:
            print("CAUGHT", flush=True)
            sys.exit(42)

    if __name__ == "__main__":
        main()
""")

#: tries of :func:`test_two_ctrl_c_at_once_while_waiting_for_a_batch` (the race is a
#: matter of timing: a few tries, each a few seconds)
TRIES = 6


def test_two_ctrl_c_at_once_while_waiting_for_a_batch(run_script, tmp_path):
    (tmp_path / "catching.py").write_text(CATCHING.format(tests=TESTS))
    for attempt in range(TRIES):
        proc, groups = run_script("catching.py")
        workers = _read_pids(proc)
        groups.update(workers)
        time.sleep(0.1 * attempt)  # at another point of the wait each time
        os.killpg(proc.pid, signal.SIGINT)
        spin = time.perf_counter() + 0.00002 * (attempt % 3)  # 0 to 40 us apart
        while time.perf_counter() < spin:
            pass
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"try {attempt}: the script hung after two SIGINTs at once")
        assert proc.returncode == 42 and "CAUGHT" in out, (attempt, proc.returncode, err)
        assert "RuntimeError" not in err, err
        left = _wait_until(lambda g=groups: not _group_members(g), GONE_S)
        assert left is not None, _group_members(groups)
        assert _segments(proc.pid) == []


def test_ctrl_c_at_any_point_of_the_handoff_leaves_it_working():
    """Deterministic: tests/_signal_handoff_storm.py interrupts the consumer's get() with
    real SIGINTs and lands a second KeyboardInterrupt at each point, one after another,
    where the interpreter handles a signal while the first unwinds (see its docstring)."""
    script = os.path.join(TESTS, "_signal_handoff_storm.py")
    try:
        done = subprocess.run([sys.executable, script, "2"], capture_output=True,
                              text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the hand-off under a SIGINT storm hung")
    assert done.returncode != 3, "get() stuck for good (the hand-off's lock left held)"
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (done.returncode, done.stderr[-3000:])
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["problems"] == [], result
    assert done.returncode == 0, done.stderr[-3000:]
    assert result["interrupts"] > 10 and result["taken"] > 100 and result["ordered"], result


#: signal points swept by :func:`test_a_second_ctrl_c_at_any_point_of_the_stop_closes_the_run`:
#: from the hand-off's get() through the iterator's close() into its stop (later points
#: reach the threads executor's close, outside this file's scope)
CLOSE_POINTS = (0, 44)


def test_a_second_ctrl_c_at_any_point_of_the_stop_closes_the_run():
    """Deterministic: tests/_signal_close_sweep.py lands a second KeyboardInterrupt at
    each signal point after the first one out of next(), one run per point. It broke the
    hand-off's lock (a hang), or left the run open with its pump running."""
    script = os.path.join(TESTS, "_signal_close_sweep.py")
    try:
        done = subprocess.run([sys.executable, script, *map(str, CLOSE_POINTS)],
                              capture_output=True, text=True, timeout=HANG_S * 2)
    except subprocess.TimeoutExpired:
        pytest.fail("a pipeline's stop hung after a second KeyboardInterrupt")
    assert done.returncode != 3, "a run hung for good (a lock left held)"
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (done.returncode, done.stderr[-3000:])
    assert json.loads(lines[-1][len("RESULT "):]) == {}, lines[-1]
    assert done.returncode == 0, done.stderr[-3000:]
