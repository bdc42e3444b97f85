"""Job callables for the jobs tests (module level: spawn workers import them).

A subject is a dict: ``subject_id``, ``dir`` (a directory the subject logs to),
``action`` and optional ``arg``. Every run writes ``<dir>/<id>.<pid>.start`` and
``.end`` files holding monotonic-clock times, from which the tests measure the
concurrency that really happened.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np


def _log(subject, what: str) -> None:
    path = os.path.join(subject["dir"], f"{subject['subject_id']}.{os.getpid()}.{what}")
    with open(path, "w") as fh:
        fh.write(repr(time.monotonic()))


def work(subject):
    _log(subject, "start")
    action, arg = subject.get("action", "ok"), subject.get("arg")
    try:
        if action == "ok":
            return {"id": subject["subject_id"], "pid": os.getpid(),
                    "slot": os.environ.get("ZEPHON_GPU_SLOT")}
        if action == "sleep":
            time.sleep(arg)
            return arg
        if action == "raise":
            raise ValueError(f"subject {subject['subject_id']} failed on purpose")
        if action == "sys_exit":  # the subject's own code gives up: sys.exit(arg)
            sys.exit(arg)
        if action == "raise_interrupt":  # the subject's own code raises KeyboardInterrupt
            raise KeyboardInterrupt(f"subject {subject['subject_id']} gave up")
        if action == "raise_from":  # a subject's own error, raised from what caused it
            try:
                {}[subject["subject_id"]]
            except KeyError as err:
                raise ValueError(f"subject {subject['subject_id']} has no entry") from err
        if action == "raise_once_started":  # fail once `arg` subjects have started
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline and sum(
                    f.endswith(".start") for f in os.listdir(subject["dir"])) < arg:
                time.sleep(0.02)
            raise ValueError(f"subject {subject['subject_id']} failed on purpose")
        if action == "sleep_once_started":  # arg (n, seconds[, prefix]): barrier, then sleep
            n, seconds, prefix = (*arg, "")[:3]
            _wait_until(lambda: sum(f.startswith(prefix) and f.endswith(".start")
                                    for f in os.listdir(subject["dir"])) >= n)
            time.sleep(seconds)
            return seconds
        if action == "sleep_after_reaped":  # arg (subject id, seconds): wait until that
            other, seconds = arg             # subject's first worker was reaped, then sleep
            _wait_until(lambda: _reaped(subject["dir"], other))
            time.sleep(seconds)
            return seconds
        if action == "wait_for_file":  # returns once a file matching the glob `arg` exists
            _wait_until(lambda: glob.glob(arg))
            return arg
        if action == "memory_error":
            raise MemoryError("pretend allocation failure")
        if action == "kill_self":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "exit_when":  # os._exit(code) once the file `path` exists
            path, code = arg
            _wait_until(lambda: os.path.exists(path))
            os._exit(code)
        if action == "hang_with_child":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            with open(os.path.join(subject["dir"], f"{subject['subject_id']}.child"), "w") as fh:
                fh.write(str(child.pid))
            time.sleep(600)
        if action == "ignore_term":
            signal.signal(signal.SIGTERM, lambda *a: open(
                os.path.join(subject["dir"], f"{subject['subject_id']}.term"), "w").close())
            time.sleep(600)
        if action == "finish_late":  # shrug off SIGTERM, then report after the timeout
            signal.signal(signal.SIGTERM, lambda *a: None)
            time.sleep(arg)
            return "late"
        if action == "none":
            return None
        if action == "array":
            return {"a": np.arange(arg, dtype=np.float32), "t": (1, "x")}
        if action == "object":
            return {1, 2}
        if action == "lock_in_result":  # a value that cannot be pickled, deep inside
            import threading
            return {"id": subject["subject_id"], "model": [1.0, threading.Lock()]}
        if action == "flaky":  # fails until it has been tried `arg` times
            with open(os.path.join(subject["dir"], f"{subject['subject_id']}.tries"),
                      "a+") as fh:  # every attempt, whichever worker (or pid) runs it
                fh.write("x")
                fh.seek(0)
                tries = len(fh.read())
            if tries <= arg:
                raise RuntimeError(f"flaky attempt {tries}")
            return tries
        if action == "pid":
            return os.getpid()
        if action == "stubborn_grandchild":  # a grandchild that ignores SIGTERM, then hang
            _start_helper(subject, "grandchild", ignore_term=True)
            time.sleep(600)
        if action == "background":  # leave a process behind (same group), then succeed
            _start_helper(subject, "background", ignore_term=True)
            return "left a background process"
        if action == "daemon_then_hang":  # a daemon in its own session, then time out
            _start_helper(subject, "daemon", ignore_term=True, daemon=True)
            time.sleep(600)
        if action == "daemon":  # a double-forked daemon in its own session, then succeed
            _start_helper(subject, "daemon", ignore_term=True, daemon=True)
            return "left a daemon"
        raise KeyError(action)
    finally:
        _log(subject, "end")


def _wait_until(ready, seconds: float = 60.0) -> None:
    """Poll ``ready()`` every 20 ms until true or ``seconds`` passed (then go on: the
    test's own assertion reports what did not happen)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not ready():
        time.sleep(0.02)


def _reaped(directory: str, subject_id: str) -> bool:
    """True once a worker has started ``subject_id`` and is gone from /proc: exited and
    reaped by the parent, which has therefore handled its end (a crash, an OOM)."""
    pids = [int(f.split(".")[1]) for f in os.listdir(directory)
            if f.startswith(subject_id + ".") and f.endswith(".start")]
    return any(not os.path.exists(f"/proc/{pid}") for pid in pids)


HELPER = """
import os, signal, sys, time
if {daemon}:
    if os.fork():
        os._exit(0)
    os.setsid()
if {ignore_term}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
tmp = {path!r} + ".tmp"
with open(tmp, "w") as fh:
    fh.write(str(os.getpid()))
os.rename(tmp, {path!r})
time.sleep(600)
"""


def _start_helper(subject, what: str, *, ignore_term: bool, daemon: bool = False) -> int:
    """Start a helper process that writes its pid to ``<dir>/<id>.<what>`` once it is set
    up (its SIGTERM handler installed), and wait for that file; returns the pid."""
    path = os.path.join(subject["dir"], f"{subject['subject_id']}.{what}")
    subprocess.Popen([sys.executable, "-c", HELPER.format(
        daemon=daemon, ignore_term=ignore_term, path=path)])
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"helper {what} did not start")
        time.sleep(0.01)
    with open(path) as fh:
        return int(fh.read())


def helper_pids(directory: str, what: str) -> list[int]:
    """Pids written by the helpers named ``what`` in ``directory``."""
    out = []
    for name in os.listdir(directory):
        if name.endswith("." + what):
            with open(os.path.join(directory, name)) as fh:
                out.append(int(fh.read()))
    return out


def sleep_for(subject):
    """Sleep ``subject["arg"]`` seconds (a string-free, log-free subject for timing sweeps);
    returns the subject id."""
    time.sleep(subject["arg"])
    return subject["subject_id"]


class WithSetup:
    """A callable object with setup(): each setup writes a file named after the pid.

    With ``wait_for=N`` a subject first waits (up to 60 s) until N workers have run
    setup(), so a test that expects N workers to share the subjects does not depend
    on how fast the others spawn."""

    def __init__(self, directory: str, wait_for: int = 0) -> None:
        self.directory = directory
        self.wait_for = wait_for

    def setup(self) -> None:
        with open(os.path.join(self.directory, f"setup.{os.getpid()}"), "a") as fh:
            fh.write("x")

    def __call__(self, subject):
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and sum(
                f.startswith("setup.") for f in os.listdir(self.directory)) < self.wait_for:
            time.sleep(0.02)
        return work(subject)


class WithServer:
    """setup() starts a helper process (its pid in ``<dir>/setup-<pid>.server``) that
    every subject may use; a subject returns whether that helper is alive, after what
    ``work`` does for it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.server: int | None = None

    def setup(self) -> None:
        self.server = _start_helper({"dir": self.directory,
                                     "subject_id": f"setup-{os.getpid()}"},
                                    "server", ignore_term=False, daemon=True)

    def __call__(self, subject):
        value = work(subject)
        with open(f"/proc/{self.server}/stat") as fh:
            server_alive = fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        return {"value": value, "server_alive": server_alive}


class ExitsInSetup:
    """setup() gives up with sys.exit (a worker that finds no GPU, say)."""

    def setup(self) -> None:
        raise SystemExit("no GPU on this worker")

    def __call__(self, subject):
        return subject


def square(x: int) -> int:
    return x * x


class LazyPool:
    """setup() makes a process pool whose workers start on first use (during the first
    subject): they are the worker's, not that subject's, and serve every subject."""

    def setup(self) -> None:
        import concurrent.futures
        import multiprocessing

        self.pool = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"))

    def __call__(self, subject):
        return sum(self.pool.map(square, range(4)))


def forkserver_pool(subject):
    """A forkserver pool per subject (the forkserver itself outlives the subject)."""
    import multiprocessing

    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        return pool.map(abs, [-1, -2])


class HangingSetup:
    def setup(self) -> None:
        time.sleep(600)

    def __call__(self, subject):
        return subject


class KeyedWork:
    def cache_key(self, subject) -> str:
        return f"custom:{subject['subject_id']}:{subject.get('arg')}"

    def __call__(self, subject):
        return work(subject)


def _cannot_load():
    raise ImportError("module 'vanished_module' is not importable in the worker")


class Unloadable:
    """Pickles fine here, cannot be rebuilt in a worker (like a callable whose module
    the worker cannot import)."""

    def __reduce__(self):
        return (_cannot_load, ())

    def __call__(self, subject):
        return subject


def interval_overlap(directory: str, ids=None) -> int:
    """The largest number of subjects that were running at the same moment."""
    events = []
    for name in os.listdir(directory):
        parts = name.rsplit(".", 2)
        if len(parts) != 3 or parts[2] not in ("start", "end"):
            continue
        if ids is not None and parts[0] not in ids:
            continue
        with open(os.path.join(directory, name)) as fh:
            t = float(fh.read())
        events.append((t, 1 if parts[2] == "start" else -1))
    level = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        level += delta
        peak = max(peak, level)
    return peak


def count_store_lookups(monkeypatch) -> list[int]:
    """Count the store's batched lookups from now on: a list that gets the number of keys
    of every ``CheckpointStore.load_many`` call (the calls still happen)."""
    from zephon.jobs import store as store_mod

    looked_up: list[int] = []
    original = store_mod.CheckpointStore.load_many

    def counting(self, keys):
        looked_up.append(len(keys))
        return original(self, keys)

    monkeypatch.setattr(store_mod.CheckpointStore, "load_many", counting)
    return looked_up
