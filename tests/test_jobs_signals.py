"""Ctrl-C during ``zephon.jobs.run``: real SIGINTs to the process group of a real script
(``_jobs_signal_run.py``: 2 process workers whose subjects shrug off SIGTERM, so the
first Ctrl-C's graceful stop really waits).

- one Ctrl-C: the graceful stop (SIGTERM to each busy worker's group, SIGKILL after
  ``graceful_shutdown_sec``), then the KeyboardInterrupt reaches the script;
- a second (and a third) Ctrl-C while that graceful stop waits, whether the first one
  landed in the run or in the caller's loop body: every worker is killed outright, the
  script ends with its KeyboardInterrupt at once (a 60 s grace is not waited out), and
  nothing of its session is left: no worker, no helper process, no zephon /dev/shm
  segment of its processes;
- two Ctrl-Cs at the same instant (0 ms apart): the same, and the KeyboardInterrupt
  reaches the caller's ``except KeyboardInterrupt`` with the store unlocked (the second
  one used to land between the run's ``except`` and its stop: the stop was skipped and
  the script hung at exit joining workers that shrug off SIGTERM).

Deadlines are generous hang guards, never measures of speed; the finalizer kills the
whole session whatever happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from _procs import HANG_S, alive, live_processes

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(TESTS, "_jobs_signal_run.py")
#: a graceful stop this long is never waited out by a test that passes
LONG_GRACE_S = 60.0
#: how long everything may take to be gone after the last Ctrl-C (the promise is 1 s;
#: generous for a loaded 2-core machine, and far below LONG_GRACE_S)
GONE_S = 10.0


def session_members(sid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live, non-zombie process of session ``sid``."""
    return [(pid, cmd) for pid, _, session, cmd in live_processes() if session == sid]


def session_gone(sid: int, timeout: float) -> list[tuple[int, str]]:
    """Wait up to ``timeout`` seconds until session ``sid`` has no live process; returns
    those still alive (multiprocessing's helper exits just after its parent)."""
    deadline = time.monotonic() + timeout
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return session_members(sid)


def shm_segments_of(pids) -> list[str]:
    """zephon /dev/shm segments whose name says one of ``pids`` made them."""
    from zephon.transport.arena import SEGMENT_PREFIX

    marks = {f"{SEGMENT_PREFIX}{pid:x}_" for pid in pids}
    marks |= {f"_{pid:x}_" for pid in pids}
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith(SEGMENT_PREFIX) and any(m in n for m in marks)]


class Script:
    def __init__(self, tmp_path, grace: float, body: bool, *flags: str) -> None:
        self.log = tmp_path / "log"
        self.log.mkdir(parents=True)
        self.out = ""  # its stdout after it ended
        self.proc = subprocess.Popen(
            [sys.executable, SCRIPT, str(self.log), str(tmp_path / "ckpt"), str(grace),
             *(["body"] if body else []), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)  # its own session and process group, like a terminal's

    def count(self, suffix: str) -> int:
        return sum(f.endswith(suffix) for f in os.listdir(self.log))

    def wait_for(self, suffix: str, n: int) -> None:
        deadline = time.monotonic() + HANG_S
        while self.count(suffix) < n:
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, f"never saw {n} {suffix} files"
            time.sleep(0.02)

    def worker_pids(self) -> set[int]:
        return {int(f.split(".")[1]) for f in os.listdir(self.log) if f.endswith(".start")}

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group

    def kill_all(self) -> None:
        for pid, _ in session_members(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def script(tmp_path):
    made: list[Script] = []

    def start(grace: float, body: bool = False, *flags: str) -> Script:
        s = Script(tmp_path / f"run{len(made)}", grace, body, *flags)
        made.append(s)
        assert s.proc.stdout.readline().strip() == "ready"
        s.wait_for(".start", 2)  # both workers are running a subject
        if body:  # ... and the caller's loop body is running (S0 has returned)
            assert s.proc.stdout.readline().strip() == "result S0"
        return s

    yield start
    for s in made:  # the whole session, whatever happened
        s.kill_all()


def assert_interrupted_and_gone(s: Script, within: float) -> None:
    """The script ends with its KeyboardInterrupt within ``within`` seconds, having ended
    its workers itself, and nothing of its session (workers, multiprocessing's helper)
    nor a segment of theirs is left."""
    try:
        s.proc.wait(timeout=within)  # its exit, not the end of its output (that a live
    except subprocess.TimeoutExpired:  # worker, which inherited the pipes, holds open)
        left = session_members(s.proc.pid)
        pytest.fail(f"the script did not end within {within} s of the last Ctrl-C; alive: "
                    f"{left}")
    # the script ended its workers before it exited (not their own watch on their parent
    # afterwards): a worker outliving the script is a leak
    workers_left = [pid for pid in s.worker_pids() if alive(pid)]
    s.out, err = s.proc.communicate(timeout=HANG_S)
    assert workers_left == [], err
    assert s.proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT, 1), err
    assert "KeyboardInterrupt" in err, err
    pids = {s.proc.pid} | s.worker_pids()
    assert session_gone(s.proc.pid, within) == []
    assert shm_segments_of(pids) == []


def test_one_ctrl_c_stops_the_workers_gracefully_then_interrupts(script):
    s = script(grace=2.0)
    s.ctrl_c()
    s.wait_for(".term", 2)  # the graceful stop: SIGTERM to each busy worker first
    # they shrug it off: SIGKILL after the 2 s grace, then the KeyboardInterrupt
    assert_interrupted_and_gone(s, within=2.0 + HANG_S)


@pytest.mark.parametrize("presses", [2, 3])
def test_more_ctrl_c_during_the_graceful_stop_end_everything_at_once(script, presses):
    s = script(grace=LONG_GRACE_S)
    s.ctrl_c()
    s.wait_for(".term", 2)  # the first Ctrl-C's graceful stop is waiting on the workers
    for _ in range(presses - 1):
        s.ctrl_c()
        time.sleep(0.05)  # in quick succession
    assert_interrupted_and_gone(s, within=GONE_S)



def test_two_ctrl_c_while_the_loop_body_runs_end_everything_at_once(script):
    # the first lands in the caller's code; leaving the loop stops the run gracefully,
    # and the second cuts that stop short
    s = script(grace=LONG_GRACE_S, body=True)
    s.ctrl_c()
    s.wait_for(".term", 1)  # S1's worker is busy: SIGTERM (S0's, idle, got STOP)
    s.ctrl_c()
    assert_interrupted_and_gone(s, within=GONE_S)

TWIN_TRIES = 3  # a few tries, each bounded


def test_two_ctrl_c_at_the_same_instant_end_everything_at_once(script):
    # the second lands right behind the first, while the first one's KeyboardInterrupt
    # unwinds the run, before its stop: it must be held and cut the stop short, never
    # skip the stop. The kernel merges two SIGINTs sent before the first is delivered
    # (then it is one Ctrl-C: a graceful stop); the script's "twin" mode sends itself
    # the second one as the first one's KeyboardInterrupt leaves the run's wait
    for _ in range(TWIN_TRIES):
        s = script(LONG_GRACE_S, False, "catch", "twin")
        s.ctrl_c()
        s.ctrl_c()  # 0 ms apart
        assert_interrupted_and_gone(s, within=GONE_S)
        # the KeyboardInterrupt reached the caller's except, the store closed
        assert "caught\nunlocked" in s.out, s.out


KEPT = """
import sys
sys.path.insert(0, {tests!r})
import _job_fns as J
from zephon.jobs import RunPolicy, run

if __name__ == "__main__":
    subs = [{{"subject_id": f"S{{i}}", "dir": {log!r}, "action": "ok"}} for i in range(4)]
    it = iter(run(J.work, subs, RunPolicy(workers=2, resume=False), progress=False))
    print(next(it).subject_id, flush=True)
    sys.exit(0)  # the run is left unfinished, its iterator kept
"""


def test_a_script_that_exits_with_a_run_unfinished_does_not_hang(tmp_path):
    # its workers are not daemons: multiprocessing's exit handler joined them for ever
    log = tmp_path / "log"
    log.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", KEPT.format(tests=TESTS, log=str(log))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script hung at exit; alive: {session_members(proc.pid)}")
    finally:
        for pid, _ in session_members(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and out.strip() == "S0", err
    assert session_gone(proc.pid, GONE_S) == []
