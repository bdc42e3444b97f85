"""Ops for the autotune tests (module level: spawn workers import them).

Their cost is CPU work or a blocking wait on an Event the test controls; none of
them changes a sample's value, so any worker count gives the same stream."""

from __future__ import annotations

import threading

#: While clear, ``gated`` blocks for a while on each sample (a slow op whose worker
#: waits, as one reading from storage does); once the test sets it the op is instant.
GATE = threading.Event()


def spin(n: int) -> int:
    s = 0
    for i in range(n):
        s += i
    return s


def slow(x):
    """A CPU-bound op (a few ms per sample)."""
    return x + (spin(30_000) & 0)


def cheap(x):
    return x * 2


def slow_then_fast(x):
    """CPU-bound for the samples below 400, nearly free for the others."""
    if x < 400:
        spin(30_000)
    return x + 1


def gated(x):
    """Blocks up to 10 ms per sample until the test sets GATE."""
    GATE.wait(0.01)
    return x + 1


def sleep_then(seconds: float):
    """Sleeps ``seconds`` (> 0), or spins for ``-seconds`` of CPU time (< 0)."""
    import time

    if seconds > 0:
        time.sleep(seconds)
    else:
        end = time.thread_time() - seconds
        while time.thread_time() < end:
            pass
    return seconds


def echo(x):
    """A pool handler: ``(x, a little CPU work)``."""
    spin(20_000)
    return x


def with_lock(x):
    """A map whose output holds a lock: fine inline, cannot go back from a process."""
    return {"x": x, "lock": threading.Lock()}


def drop_lock(sample):
    return sample["x"]


def lock_some(x):
    """A map whose output holds a lock for the samples named in $ZEPHON_TEST_LOCKED
    (comma-separated; set by the test before the run: workers inherit it)."""
    import os

    locked = {int(v) for v in os.environ.get("ZEPHON_TEST_LOCKED", "").split(",") if v}
    return {"x": x, "lock": threading.Lock()} if x in locked else {"x": x}


class HereOnly:
    """Pickles anywhere, unpickles only in the process that made it (a handle to a
    process-local resource): what a check of pickling alone does not see."""

    def __init__(self, x):
        import os

        self.x, self.pid = x, os.getpid()

    def __reduce__(self):
        return _rebuild_here_only, (self.x, self.pid)


def _rebuild_here_only(x, pid):
    import os

    if pid != os.getpid():
        raise RuntimeError(f"HereOnly({x}) made in process {pid} cannot be rebuilt in "
                           f"{os.getpid()}")
    return HereOnly(x)


def here_only_some(x):
    """HereOnly(x) for the samples named in $ZEPHON_TEST_LOCKED, else x."""
    import os

    named = {int(v) for v in os.environ.get("ZEPHON_TEST_LOCKED", "").split(",") if v}
    return HereOnly(x) if x in named else x


def unwrap(v):
    return v.x if isinstance(v, HereOnly) else v


def fail_named(x):
    """Raises ValueError for the samples named in $ZEPHON_TEST_LOCKED."""
    import os

    if str(x) in os.environ.get("ZEPHON_TEST_LOCKED", "").split(","):
        raise ValueError(f"sample {x} is bad")
    return x


#: What ``hoard`` keeps in the worker process that ran it (never in the test's process).
KEPT: list = []
#: Bytes ``hoard`` keeps per sample.
HOARD_BYTES = 8 << 20


def hoard(x):
    """A CPU-bound op (a few ms per sample) that keeps HOARD_BYTES per sample in a module
    list of the worker process running it (a cache, a leak), up to $ZEPHON_TEST_HOARD
    samples per worker (set by the test before the run: workers inherit it); inline (in
    the test's process) it keeps nothing. The sample's value is not changed."""
    import multiprocessing
    import os

    spin(30_000)
    if multiprocessing.parent_process() is not None and \
            len(KEPT) < int(os.environ.get("ZEPHON_TEST_HOARD", "0")):
        KEPT.append(b"\x01" * HOARD_BYTES)  # written: resident, not a zero page
    return x + 1
