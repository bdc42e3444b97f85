"""Back-pressure that never deadlocks and never stalls silently.

- a consumer that keeps every result gets them all (in-band once the arena is held),
  with one warning;
- a message never waits for space it holds itself: a result of several arrays that
  together exceed the arena bound, or one array larger than the bound, gets a dedicated
  slab, unmapped once the consumer drops it;
- the same at the pipeline level: ``list(pipe)`` over 300 batches of 4 MiB completes
  under the process runner and in MTP mode.

The ``get`` timeouts below detect a stall (the old behaviour waited 60 s per message);
how fast the keeping consumer is compared with a dropping one is measured in bench/."""

from __future__ import annotations

import gc
import os
import warnings

import pytest

import _transport_handlers as H
from zephon import Pipeline, RuntimeOptions, sources
from zephon.transport import WorkerPool
from zephon.transport.budget import arena_bytes_for

# Far below the 60 s wait a stalled message used to take; far above a normal result.
STALL_S = 30


@pytest.fixture
def make_pool():
    pools = []

    def make(workers=1, transport="socketpair", **kwargs):
        opts = RuntimeOptions(ipc_transport=transport, **kwargs.pop("options", {}))
        pool = WorkerPool(H.handle, workers, config=H.config(opts, **kwargs))
        pools.append(pool)
        return pool.start()

    yield make
    for pool in pools:
        pool.close()


def own_mappings(pool, token_owner: int) -> int:
    """How many slabs of worker ``token_owner`` this process has mapped (/proc/self/maps)."""
    pid = pool.workers[token_owner].pid
    tag = f"zph_{os.getpid():x}_{pid:x}_"
    with open("/proc/self/maps") as fh:
        return sum(tag in line for line in fh)


@pytest.mark.parametrize("transport", ["socketpair", "pipe"])
def test_consumer_keeping_300_results_of_4mib_completes(make_pool, transport):
    pool = make_pool(workers=2, transport=transport)
    kept = []
    with pytest.warns(RuntimeWarning, match="travel by copy") as record:
        for i in range(8):
            pool.submit(("full", (4 << 20, i)))
        nxt = 8
        while len(kept) < 300:
            kept.append(pool.get(timeout=STALL_S).value)
            if nxt < 300:
                pool.submit(("full", (4 << 20, nxt)))
                nxt += 1
    assert sorted(r["value"] for r in kept) == list(range(300))
    assert all(r["data"][-1] == r["value"] for r in kept)
    # once per pool, whichever worker starved first
    assert len([w for w in record if "travel by copy" in str(w.message)]) == 1


def test_result_of_ten_20mib_arrays_never_waits_for_itself(make_pool):
    # 200 MiB in one message against a 64 MiB arena: it cannot fit even an empty arena,
    # so it gets a dedicated slab at once instead of waiting for its own regions.
    pool = make_pool(arena_bytes=64 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to copies, no starvation warning
        for round_ in range(3):
            pool.submit(("arrays", (10, 20 << 20)))
            value = pool.get(timeout=STALL_S).value
            assert [int(a[0]) for a in value] == list(range(10))
            assert all(pool.leases.locate(a) is not None for a in value)  # zero copy
            assert own_mappings(pool, 0) >= 1
            del value
            gc.collect()
    pool.submit(("echo", 1))  # a round trip: the worker has processed the frees
    assert pool.get(timeout=STALL_S).value == 1
    # The dedicated slabs are unmapped on both sides once the consumer dropped them.
    assert not [s for s in pool.registry._slabs.values() if s.dedicated]
    assert own_mappings(pool, 0) <= 1  # at most one recycled slab of the worker


@pytest.mark.parametrize("transport", ["socketpair", "pipe"])
def test_many_arrays_within_the_bound_are_allocated_together(make_pool, transport):
    # 6 x 10 MiB = 60 MiB fits the 64 MiB an arena's messages may hold only if planned as
    # one request; the consumer drops each result at once, so nothing may ever wait or
    # fall back.
    pool = make_pool(transport=transport, arena_bytes=arena_bytes_for(64 << 20))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            pool.submit(("arrays", (6, 10 << 20)))
            value = pool.get(timeout=STALL_S).value
            assert [int(a[-1]) for a in value] == list(range(6))
            assert all(pool.leases.locate(a) is not None for a in value)
            del value


@pytest.mark.slow
def test_results_of_a_1gib_array_do_not_stall(make_pool):
    # The consumer holds the previous 1 GiB result while the next one is made (as a loop
    # body does): the next one must not wait for it, it gets a slab of its own.
    pool = make_pool()
    previous = None
    for i in range(3):
        pool.submit(("ones", 1 << 30))
        value = pool.get(timeout=STALL_S).value
        assert value.nbytes == 1 << 30 and value[0] == 1 and value[-1] == 1
        assert pool.leases.locate(value) is not None  # zero copy
        previous = value
        del value
    del previous
    gc.collect()


@pytest.mark.parametrize("mtp", [False, True], ids=["process", "mtp"])
def test_list_of_a_pipeline_keeping_300_batches_of_4mib_completes(mtp):
    pipe = Pipeline(sources.from_callable(300, H.load_4mib)).map(H.plus_one).options(
        RuntimeOptions(runner="process", max_workers=2, mtp_mode=mtp))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the starvation warning
        batches = list(pipe)
    pipe.close()
    assert len(batches) == 300
    assert sorted(int(b[0]) for b in batches) == list(range(1, 301))
    assert all(b.nbytes == 4 << 20 and b[-1] == b[0] for b in batches)
