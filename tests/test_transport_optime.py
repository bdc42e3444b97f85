"""OpClock: a unit's op time, less the time its thread waited for a CPU."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from zephon.transport import optime
from zephon.transport.optime import OpClock, run_queue_wait_s


def test_the_run_queue_wait_is_read_per_thread_where_the_kernel_says_it():
    first = run_queue_wait_s()
    if first is None:
        pytest.skip("no /proc/thread-self/schedstat here")
    assert first >= 0 and run_queue_wait_s() >= first  # a running total
    seen = []
    t = threading.Thread(target=lambda: seen.append(run_queue_wait_s()))
    t.start()
    t.join()
    assert seen[0] is not None and seen[0] >= 0


def test_op_time_is_never_negative_nor_more_than_the_wall_time():
    for work in (0, 10_000, 200_000):
        clock = OpClock()
        sum(range(work))
        seconds = clock.seconds()
        wall = time.perf_counter() - clock.started
        assert 0 <= seconds <= wall


def test_the_wait_for_a_cpu_is_taken_off(monkeypatch):
    waits = iter([5.0, 5.0 + 3600.0])  # an hour in the run queue meanwhile
    monkeypatch.setattr(optime, "run_queue_wait_s", lambda: next(waits))
    clock = OpClock()
    assert clock.seconds() == 0.0
    waits = iter([5.0, 5.0])  # no wait: the wall time
    clock = OpClock()
    time.sleep(0.01)  # blocked time counts: it is latency the unit really costs
    assert clock.seconds() == pytest.approx(time.perf_counter() - clock.started, abs=0.01)


def _in_a_thread(fn):
    """``fn()`` in a thread of its own (a thread opens its statistics at its first read)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_without_scheduler_statistics_it_is_the_wall_time(monkeypatch):
    monkeypatch.setattr(optime, "_SCHEDSTAT", "/nonexistent/schedstat")

    def timed():
        assert run_queue_wait_s() is None
        clock = OpClock()
        time.sleep(0.01)
        seconds = clock.seconds()
        return seconds, time.perf_counter() - clock.started

    seconds, wall = _in_a_thread(timed)
    assert 0.01 <= seconds <= wall


def test_each_thread_holds_one_descriptor_closed_when_it_ends():
    if run_queue_wait_s() is None:
        pytest.skip("no /proc/thread-self/schedstat here")
    before = len(os.listdir("/proc/self/fd"))
    seen = [_in_a_thread(lambda: [run_queue_wait_s() for _ in range(100)])
            for _ in range(20)]
    gc.collect()
    assert all(v is not None for reads in seen for v in reads)
    assert len(os.listdir("/proc/self/fd")) == before  # 20 threads ended: none left open
