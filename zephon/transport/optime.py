"""Op time: how long a unit of work took where it ran, less the time it waited for a CPU.

What it owns: :class:`OpClock`, the one clock every executor (the inline and thread
executors, a process worker) times a unit's program with. The pipeline's dispatch sizes
its parts by the result (:mod:`zephon.pipeline.dispatch`: a part holds about
``DISPATCH_TARGET_SECONDS`` of work). Execution tracking and autotune keep reading the
plain wall time of the op (their busy fractions are shares of wall-clock capacity).

What it measures: the wall time of the call in the calling thread, minus what that
thread spent *runnable but not running* (waiting in the scheduler's run queue, from
Linux's ``/proc/thread-self/schedstat``). On a machine shared with other loads a
CPU-bound op's wall time grows with the load (five-fold at a load of 10 on 2 cores),
and parts sized by it would shrink until messages cost more than the work; time the op spends
blocked (reading a file or a socket, waiting for a thread pool it started) still counts,
as it should: that is latency the part really costs. Where the scheduler statistics are
not available (not Linux, or ``/proc`` not mounted) it is the plain wall time.

Invariants: the result is never negative and never more than the wall time; reading the
statistics costs two ``pread`` calls per unit (about a microsecond each) on one descriptor
per thread that times units, opened at its first unit and closed when the thread ends
(its ``threading.local`` is cleared then): opening ``/proc`` for every reading cost
about 11 us a unit, 8 % of an inline pipeline of cheap per-sample ops.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["OpClock", "run_queue_wait_s"]

_SCHEDSTAT = "/proc/thread-self/schedstat"


class _Schedstat:
    """This thread's ``schedstat`` descriptor (-1: the kernel does not give one), closed
    when the object goes: when its thread ends and the thread's local storage is cleared."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        try:
            self.fd = os.open(_SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.fd = -1

    def __del__(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


_local = threading.local()


def run_queue_wait_s() -> float | None:
    """Seconds the calling thread has waited in the run queue since it started, or None
    when the kernel does not say (``schedstat``'s second field, in nanoseconds)."""
    stat = getattr(_local, "schedstat", None)
    if stat is None:
        stat = _local.schedstat = _Schedstat()
    if stat.fd < 0:
        return None
    try:
        fields = os.pread(stat.fd, 128, 0).split()
    except OSError:
        return None
    try:
        return int(fields[1]) * 1e-9
    except (IndexError, ValueError):
        return None


class OpClock:
    """Times one call in the calling thread: ``clock = OpClock()`` before it,
    ``clock.seconds()`` after it (in the same thread)."""

    __slots__ = ("started", "waited")

    def __init__(self) -> None:
        self.waited = run_queue_wait_s()
        self.started = time.perf_counter()

    def seconds(self) -> float:
        """Wall seconds since the clock was made, less the run-queue wait meanwhile."""
        wall = time.perf_counter() - self.started
        if self.waited is None:
            return wall
        now = run_queue_wait_s()
        if now is None:
            return wall
        return min(wall, max(0.0, wall - (now - self.waited)))
