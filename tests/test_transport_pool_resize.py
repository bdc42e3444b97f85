"""WorkerPool.add_worker / retire_worker (the autotune controller's grow and shrink):
a grown worker boots while the others serve and then takes tasks; a retired one
finishes what it has in flight, exits, and is never a crash; its slot is reused."""

from __future__ import annotations

import pytest

import _autotune_fns as F
from _procs import HANG_S, alive, wait_gone
from zephon import RuntimeOptions
from zephon.errors import TransportError
from zephon.pipeline.engine import pool_config
from zephon.transport import WorkerPool


@pytest.fixture
def pool():
    p = WorkerPool(F.echo, 1, config=pool_config(RuntimeOptions()))
    p.start()
    yield p
    pids = [h.pid for h in p.workers]
    p.close()
    assert not wait_gone(pids, HANG_S)


def _run(pool, n):
    """Submit ``n`` tasks, return ``{task id: (value, worker)}``."""
    ids = {pool.submit(i): i for i in range(n)}
    out = {}
    for _ in range(n):
        r = pool.get()
        out[r.task_id] = (r.value, r.worker)
    assert {t: v for t, (v, _) in out.items()} == ids
    return out


def test_a_grown_worker_boots_then_takes_tasks(pool):
    slot = pool.add_worker()
    assert slot == 1 and pool.booting == 1
    while pool.booting:  # its READY is read by get(), while worker 0 serves
        _run(pool, 2)
    workers = {w for _, w in _run(pool, 20).values()}
    assert workers == {0, 1}


def test_a_grown_worker_boots_while_the_others_always_have_results_waiting(pool):
    """Worker 0 is never idle and its results are always waiting (eight in flight, one
    submitted per one taken): the grown worker's READY is still read as soon as it
    arrives (it was starved: get() returned worker 0's result first every time, and the
    grown worker never came into service, nor did autotune decide anything after it)."""
    import time

    inflight = {pool.submit(i): i for i in range(8)}
    pool.add_worker()
    deadline, k = time.monotonic() + HANG_S, 8
    while pool.booting and time.monotonic() < deadline:
        r = pool.get()
        assert inflight.pop(r.task_id) == r.value
        inflight[pool.submit(k)] = k
        k += 1
        time.sleep(0.002)  # a training step: worker 0's next results wait meanwhile
    assert not pool.booting, "the grown worker's READY was never read"
    while inflight:
        r = pool.get()
        assert inflight.pop(r.task_id) == r.value
    assert {w for _, w in _run(pool, 20).values()} == {0, 1}


def test_a_retired_worker_finishes_its_tasks_and_is_no_crash(pool):
    pool.add_worker()
    while pool.booting:
        _run(pool, 2)
    ids = {pool.submit(i): i for i in range(20)}
    assert pool.workers[1].inflight  # it has tasks in flight when it is retired
    pid = pool.workers[1].pid
    pool.retire_worker(1)
    with pytest.raises(TransportError):
        pool.retire_worker(1)
    results = [pool.get() for _ in ids]
    assert sorted(r.value for r in results) == sorted(ids.values())
    assert any(r.worker == 1 for r in results)  # what it had in flight came back
    assert not wait_gone(pid, HANG_S)
    assert pool.crashes == [] and pool.exited == {}
    assert {w for _, w in _run(pool, 10).values()} == {0}  # no new task went to it
    # its slot is taken again by the next grow, by a new process
    assert pool.add_worker() == 1
    while pool.booting:
        _run(pool, 2)
    assert pool.workers[1].pid != pid and alive(pool.workers[1].pid)
    assert {w for _, w in _run(pool, 20).values()} == {0, 1}


def test_close_stops_a_booting_worker(pool):
    pool.add_worker()
    pid = pool.workers[1].pid
    pool.close()
    assert not wait_gone(pid, HANG_S)
