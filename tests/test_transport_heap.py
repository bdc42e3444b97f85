"""The worker's shared heap: large arrays an op makes live in the arena and go to the
consumer by reference, never when the worker can still write to them, and a region is
reused only once both sides are done with it. Real worker processes, plus the arena's
bookkeeping in this process."""

from __future__ import annotations

import gc
import itertools
import os
import time
import warnings
from typing import ClassVar

import _transport_handlers as H
import numpy as np
import pytest

from zephon import RuntimeOptions
from zephon.transport import WorkerPool
from zephon.transport.arena import LeaseTable, ShmArena, SlabRegistry
from zephon.transport.budget import arena_bytes_for
from zephon.transport.codec import Encoder, PeerState, ShmPolicy
from zephon.transport.heap import WorkerHeap, exclusive_owner

MIB = 1 << 20

try:
    from zephon._kernels import heap as _heap_kernel  # noqa: F401
except ImportError:
    pytest.skip("the compiled kernels are not built", allow_module_level=True)


@pytest.fixture
def make_pool():
    pools = []

    def make(workers=1, **kwargs):
        opts = RuntimeOptions(**kwargs.pop("options", {}))
        pool = WorkerPool(H.HeapOps(), workers, config=H.config(opts, **kwargs))
        pools.append(pool)
        return pool.start()

    yield make
    for pool in pools:
        pool.close()


def call(pool, op, arg=None):
    pool.submit((op, arg))
    return pool.get(timeout=60).value


def test_a_fresh_result_goes_by_reference_with_the_right_bytes(make_pool):
    pool = make_pool()
    assert call(pool, "stats")["sent"] == 0
    held = [call(pool, "fresh", (4 * MIB, v)) for v in range(6)]
    held.append(call(pool, "fresh_view", (4 * MIB, 6)))
    for v, r in enumerate(held):
        assert r["v"] == v and int(r["data"].min()) == v == int(r["data"].max())
    assert held[-1]["data"].shape == (4 * MIB // 64, 8)  # every other of 1 Mi
    assert call(pool, "stats")["sent"] == 7  # no copy for any of them


def test_a_result_the_op_keeps_is_copied_so_its_later_writes_never_reach_the_consumer(
        make_pool):
    pool = make_pool()
    kept = call(pool, "keep", (2 * MIB, 5))
    assert call(pool, "scribble", 99) == "scribbled"
    assert int(kept["data"].min()) == 5 == int(kept["data"].max())
    view = call(pool, "keep_base", (2 * MIB, 6))  # a view of an array the op keeps
    call(pool, "scribble", 98)
    assert int(view["data"].min()) == 6 == int(view["data"].max())
    twice = call(pool, "twice", (2 * MIB, 7))  # one array in two places of the payload
    assert int(twice["a"].min()) == 7 and int(twice["b"].max()) == 7
    small = call(pool, "small_view", (8 * MIB, 9))  # would pin 8 MiB for 2 MiB
    assert small["data"].shape == (MIB // 4,) and int(small["data"].max()) == 9
    assert call(pool, "stats")["sent"] == 0


def test_a_result_reachable_from_what_the_op_keeps_is_copied(make_pool):
    pool = make_pool()
    kept = [call(pool, "keep_container", (2 * MIB, v)) for v in range(3)]  # keeps the dict
    via = [call(pool, "via_reduce", (2 * MIB, v)) for v in range(3, 6)]  # via __reduce__
    call(pool, "scribble_containers", -1)
    call(pool, "scribble_arrays", -2)
    for v, r in enumerate(kept):
        assert int(r["data"].min()) == v == int(r["data"].max())
    for v, r in enumerate(via, start=3):
        assert int(r["ref"].min()) == v == int(r["ref"].max())
    assert call(pool, "stats")["sent"] == 0


def test_an_error_raised_while_a_heap_array_is_freed_reaches_the_consumer(make_pool):
    pool = make_pool()
    pool.submit(("raise_over_temp", None))
    with pytest.raises(KeyError, match="missing"):  # not a SystemError, not a crash
        pool.get(timeout=60)
    assert int(call(pool, "fresh", (4 * MIB, 2))["data"].max()) == 2


def test_a_result_the_op_tracks_weakly_is_copied(make_pool):
    pool = make_pool()
    held = [call(pool, "weakly_tracked", (2 * MIB, v)) for v in range(3)]
    # the op regained each array (a finaliser, after the encoder's check) and reuses it
    call(pool, "scribble_weak", -1)
    for v, r in enumerate(held):
        assert int(r["data"].min()) == v == int(r["data"].max())


def test_a_forked_childs_writes_stay_in_the_child(make_pool):
    pool = make_pool()
    for v in range(3):
        r = call(pool, "fork_writes", (4 * MIB, v))
        assert int(r["data"].min()) == v == int(r["data"].max())


def test_a_worker_exits_cleanly_while_its_thread_still_reads_a_heap_array(make_pool):
    # graceful: the idle worker exits by itself however loaded the machine is (under the
    # default "immediate" one that takes over 0.3 s is SIGKILLed: -9, the flake this was)
    pool = make_pool(options={"shutdown_mode": "graceful"})
    assert call(pool, "daemon_reader", (4 * MIB, 3)) > 0  # its reader thread is running
    procs = [h.process for h in pool.workers]
    pool.close()
    assert [p.exitcode for p in procs] == [0]  # not -11: its slabs stay mapped to the end


def test_arrays_the_op_keeps_do_not_shrink_what_the_consumer_can_hold(make_pool):
    pool = make_pool(arena_bytes=arena_bytes_for(64 * MIB))  # and 16 MiB for the heap
    assert call(pool, "keep_table", 16 * MIB) == "kept"  # in the heap, for good
    held: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "the consumer holds ... of the arena" would fail
        for v in range(30):  # the consumer holds the last 13 results: 52 of 64 MiB
            held = [*held[-12:], call(pool, "fresh", (4 * MIB, v))]
            assert int(held[-1]["data"].min()) == v == int(held[-1]["data"].max())


def test_a_region_the_consumer_holds_is_not_reused_and_one_it_drops_is(make_pool):
    pool = make_pool()
    first = call(pool, "fresh", (4 * MIB, 1))
    for v in range(2, 40):  # each result dropped at once: its region comes back
        r = call(pool, "fresh", (4 * MIB, v))
        assert int(r["data"][0]) == v == int(r["data"][-1])
        del r
    assert int(first["data"].min()) == 1 == int(first["data"].max())
    stats = call(pool, "stats")
    assert stats["sent"] == 39
    # recycled, not grown: the held result, one in flight, the op's temporaries
    assert stats["slab_bytes"] <= 32 * MIB, stats
    assert stats["heap_regions"] >= 1  # `first`'s region, still the consumer's
    del first
    gc.collect()
    deadline = time.monotonic() + 30  # FREE messages travel on their own
    while call(pool, "stats")["heap_regions"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call(pool, "stats")["heap_regions"] == 0


def test_zeros_from_a_recycled_region_are_zero(make_pool):
    pool = make_pool()
    for _ in range(3):
        r = call(pool, "fresh", (4 * MIB, -1))
        del r
    for _ in range(4):
        z = call(pool, "zeros", 4 * MIB)["data"]
        assert not z.any()
        del z


def test_a_reallocated_array_keeps_its_data(make_pool):
    pool = make_pool()
    a = call(pool, "resized", (2 * MIB, 3))["data"]
    half = 2 * MIB // 8
    assert a.shape == (2 * half,)
    assert int(a[:half].min()) == 3 == int(a[:half].max()) and not a[half:].any()


def test_arrays_made_in_an_ops_own_thread_are_right(make_pool):
    pool = make_pool()
    r = call(pool, "in_thread", (4 * MIB, 8))
    assert int(r["data"].min()) == 8 == int(r["data"].max())


def test_a_consumer_that_keeps_every_result_neither_stalls_nor_corrupts(make_pool):
    pool = make_pool(arena_bytes=16 * MIB)
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the arena fills up: in-band, said once
        for v in range(24):
            kept.append(call(pool, "fresh", (2 * MIB, v)))
    for v, r in enumerate(kept):
        assert int(r["data"].min()) == v == int(r["data"].max())


def test_a_child_an_op_forks_never_allocates_from_the_arena(make_pool):
    pool = make_pool()
    held = call(pool, "fresh", (4 * MIB, 1))  # a region the consumer holds
    for v in range(10, 13):
        r = call(pool, "fork_and_scribble", (4 * MIB, v))
        assert int(r["before"].min()) == v == int(r["before"].max())
        assert int(r["after"].min()) == v + 1 == int(r["after"].max())
    assert int(held["data"].min()) == 1 == int(held["data"].max())
    call(pool, "fork_background", (4 * MIB, 1.0))  # a child writing while results are made
    try:
        results = [call(pool, "fresh", (4 * MIB, v)) for v in range(20)]
    finally:
        call(pool, "reap")
    for v, r in enumerate(results):
        assert int(r["data"].min()) == v == int(r["data"].max())


def test_the_environment_turns_the_heap_off(make_pool, monkeypatch):
    monkeypatch.setenv("ZEPHON_WORKER_SHARED_HEAP", "0")
    pool = make_pool()
    r = call(pool, "fresh", (4 * MIB, 4))
    assert int(r["data"].min()) == 4 == int(r["data"].max())
    assert call(pool, "stats") is None


# -- in this process: exclusivity and the two-party release ----------------------------

@pytest.fixture
def arena():
    a = ShmArena(1, "memfd", 64 * MIB, parent_pid=os.getpid())
    yield a
    gc.collect()
    a.close()


def test_exclusive_owner_follows_references():
    fresh = {"x": np.arange(10)}
    assert exclusive_owner([fresh["x"]], 0) is not None
    kept = np.arange(10)
    payload = {"x": kept}
    assert exclusive_owner([payload["x"]], 0) is None  # the op keeps it too
    base = np.arange(20)
    payload = {"x": base[2:]}
    assert exclusive_owner([payload["x"]], 0) is None  # the op keeps its base
    chain = {"x": np.arange(20)[::2].reshape(2, 5)}  # every base only held by its view
    owner = exclusive_owner([chain["x"]], 0)
    assert owner is not None and owner.base is None and owner.size == 20


def test_a_heap_region_is_reused_after_both_sides_in_either_order(arena):
    # the worker frees first, then the consumer
    token = _sent_region(arena)
    with arena.cond:
        arena._drain_gives()
    assert arena._heap == {token: 2} and arena.live_regions == 1
    arena.free([token])
    assert arena._heap == {} and arena.live_regions == 0
    # the consumer frees first, then the worker
    _, _, token = arena.take(MIB, 8 * MIB)
    assert arena.mark_sent(token) and not arena.mark_sent(token)
    arena.free([token])
    assert arena.live_regions == 1 and arena._held_bytes == MIB
    arena.give(token)
    with arena.cond:
        arena._drain_gives()
    assert arena.live_regions == 0 and arena._held_bytes == 0 and arena._heap == {}


def _sent_region(arena) -> int:
    _, _, token = arena.take(MIB, 8 * MIB)
    assert arena.mark_sent(token)
    arena.give(token)
    return token


def test_the_heap_holds_at_most_its_share_and_never_waits(arena):
    got = [arena.take(4 * MIB, 8 * MIB) for _ in range(3)]
    assert got[0] is not None and got[1] is not None and got[2] is None  # share: 8 MiB
    assert arena._held_bytes == 8 * MIB
    # the transport still finds room: what the worker holds is not waited for
    regions = arena.alloc_many([40 * MIB])
    assert len(regions) == 1
    for _, _, token in got[:2]:
        arena.give(token)
    arena.free([regions[0][2]])
    with arena.cond:
        arena._drain_gives()
    assert arena.live_regions == 0


def test_the_encoder_sends_a_heap_array_by_reference_and_copies_a_kept_one(arena):
    heap = WorkerHeap(arena)
    assert heap.install()
    try:
        enc = Encoder(ShmPolicy(), LeaseTable(), SlabRegistry(), arena, heap)
        peer = PeerState(can_map_fds=True)
        box = [{"x": np.full(MIB // 8, 3, dtype=np.int64)}]
        header, _, _, _ = enc.encode_owned(box, peer)
        assert heap.sent == 1 and len(header["r"]) == 1
        del box
        kept = np.full(MIB // 8, 4, dtype=np.int64)
        enc.encode_owned([{"x": kept}], peer)
        inner = {"x": np.full(MIB // 8, 5, dtype=np.int64)}
        enc.encode_owned([[inner]], peer)  # the array's dict is held here too
        enc.encode({"x": np.full(MIB // 8, 6, dtype=np.int64)}, peer)  # not handed over
        assert heap.sent == 1  # all three copied
        del kept, inner
    finally:
        heap.close()


class _Bomb:
    """Cyclic garbage whose finalizer makes a heap-sized array: the collector may run it
    inside an arena method (its lock held), where the allocation must not touch the
    free lists."""

    made: ClassVar[list] = []

    def __init__(self, v: int) -> None:
        self.me, self.v = self, v

    def __del__(self) -> None:
        _Bomb.made.append(np.full(MIB // 8, self.v, dtype=np.int64))


def test_garbage_collection_inside_the_arena_never_hands_out_a_region_twice(arena):
    import random

    heap = WorkerHeap(arena)
    assert heap.install()
    rng = random.Random(0)
    threshold = gc.get_threshold()
    live: list = []
    try:
        bad = 0
        for i in range(3000):
            gc.set_threshold(rng.randint(1, 12), 1000, 1000)  # collections fall anywhere
            _Bomb(-(i + 1))
            live.append(np.full(MIB // 8, i, dtype=np.int64))
            del live[:-2], _Bomb.made[:-2]
            arrays = live + _Bomb.made
            spans = sorted((a.__array_interface__["data"][0], a.nbytes) for a in arrays)
            bad += sum(p0 + n0 > p1 for (p0, n0), (p1, _) in itertools.pairwise(spans))
            bad += sum(int(a.min()) != int(a.max()) for a in arrays)
            del arrays
        assert bad == 0
    finally:
        gc.set_threshold(*threshold)
        live.clear()
        _Bomb.made.clear()
        gc.collect()
        heap.close()


# -- through a pipeline ------------------------------------------------------------------

def _stream(runner: str) -> list:
    import _pipeline_fns as F

    from zephon import Pipeline, sources

    pipe = (Pipeline(sources.from_callable(24, F.big_sample), seed=3)
            .map(F.add_one, parallelism=2).batch(3)
            .options(RuntimeOptions(runner=runner, max_workers=2)))
    out = []
    for batch in pipe:
        tokens = batch["tokens"]
        out.append((tokens.shape, int(tokens[:, 0].sum()), int(tokens[:, -1].sum()),
                    [int(s) for s in batch["seq"]]))
    return out


def test_a_pipeline_streams_the_same_batches_with_the_heap_as_with_threads():
    assert _stream("process") == _stream("threads")


def test_the_workers_own_temporaries_do_not_end_starvation():
    # Starved (the consumer holds the messages' room), every message goes in-band at
    # once; a heap temporary freed by the worker used to end that state, so each following
    # message waited the full timeout again (300 kept results: 2 s -> 119 s).
    from zephon.errors import ArenaFull

    a = ShmArena(1, "memfd", arena_bytes_for(16 * MIB), parent_pid=os.getpid(),
                 wait_timeout_s=0.05)
    try:
        held = a.alloc_many([16 * MIB])  # the consumer's: all that messages may hold
        with pytest.raises(ArenaFull):
            a.alloc_many([MIB])
        assert a.starved
        _, _, token = a.take(MIB, 4 * MIB)  # a temporary of the next task
        a.give(token)
        waits = a.waits
        with pytest.raises(ArenaFull):
            a.alloc_many([MIB])
        assert a.starved and a.waits == waits  # raised at once, without a new wait
        a.free([held[0][2]])  # the consumer's free ends it
        assert not a.starved
    finally:
        a.close()


def test_leaving_a_pipeline_early_keeps_the_batches_held_intact():
    import _pipeline_fns as F

    from zephon import Pipeline, sources

    pipe = (Pipeline(sources.from_callable(64, F.big_sample), seed=5)
            .map(F.add_one, parallelism=2)
            .options(RuntimeOptions(runner="process", max_workers=2)))
    held = []
    it = iter(pipe)
    for item in it:
        held.append(item)
        if len(held) == 5:
            break  # workers still have results in flight and in their heaps
    it.close()
    for item in held:  # views of regions the workers made, still whole after close()
        assert int(item["tokens"].min()) == int(item["seq"]) + 1 == int(item["tokens"].max())


def test_an_mtp_worker_can_fork_the_workers_of_its_stages():
    # The MTP subprocess is a pool worker: its heap is installed in the thread that runs
    # the engine, and that thread starts the stage's own workers. With fork, the child
    # inherited the installed heap and could not install its own ("installed already"):
    # every stage worker died while starting.
    import multiprocessing

    import _pipeline_fns

    from zephon import Pipeline, sources

    opts = RuntimeOptions(runner="process", mtp_mode=True,
                          mp_context=multiprocessing.get_context("fork"))
    pipe = (Pipeline(sources.from_sequence([{"x": np.full(1 << 18, i)} for i in range(12)]),
                     seed=0, chunk_size=2)
            .map(_pipeline_fns.double).options(opts))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a clamped socket buffer
            got = sorted(int(item["x"][0]) for item in pipe)
    finally:
        pipe.close()
    assert got == [2 * i for i in range(12)]


def test_a_workers_sample_temporaries_reuse_one_region():
    # load makes a 4 MiB array, the map makes the output from it and drops it. Each
    # sample goes through the map before the next is read, so its temporary is freed
    # before the next sample's is made and the heap's first fit puts that one in the
    # same region: still in the CPU cache (bench/hot_vs_cold_writes.py: a cold one made
    # the two NumPy ops of a sample take ~1.6x as long with two workers). Reading a
    # whole part first kept a region per sample of the part.
    import collections

    import _pipeline_fns as F

    from zephon import Pipeline, sources

    pipe = (Pipeline(sources.from_callable(48, F.big_sample), seed=5, shuffle=False)
            .map(F.input_address, parallelism=2)
            .options(RuntimeOptions(runner="process", max_workers=2,
                                    auto_validation="off")))  # the addresses vary
    where = collections.defaultdict(set)
    for item in pipe:
        assert int(item["tokens"][0]) == int(item["seq"]) + 1
        where[int(item["pid"])].add(int(item["input_at"]))
    assert len(where) == 2
    for addresses in where.values():
        assert len(addresses) <= 2, addresses


@pytest.mark.parametrize("unpicklable", [False, True])
def test_what_a_task_made_before_it_failed_comes_with_its_error(make_pool, unpicklable):
    # A pipeline stage's failure (UnitFailure) holds the records made before its failing
    # sample. They travel with the ERROR as a result does, through the arena and by
    # reference, not inside the pickled exception: an exception that does not pickle
    # (sent as a RuntimeError with its text) still brings them, and 24 MiB of them cost
    # no pickle round trip in the worker.
    from zephon.transport.failure import UnitFailure

    pool = make_pool()
    task = pool.submit(("fail_after", (4 * MIB, 6, unpicklable)))
    failure = pool.get(timeout=60, failures=True).value
    assert type(failure) is UnitFailure and failure.task_id == task
    assert type(failure.error) is (RuntimeError if unpicklable else ValueError)
    done = failure.done
    assert [int(a[0]) for a in done] == list(range(6))
    assert all(int(a.min()) == int(a.max()) == v for v, a in enumerate(done))
    assert call(pool, "stats")["sent"] == 6  # by reference, from the worker's heap
    del done, failure
    gc.collect()
    held = [call(pool, "fresh", (4 * MIB, v)) for v in range(3)]  # the regions came back
    assert [int(h["data"][0]) for h in held] == [0, 1, 2]
    pool.submit(("fail_after", (8, 1, unpicklable)))
    with pytest.raises(RuntimeError if unpicklable else ValueError):
        pool.get(timeout=60)  # without failures=True the task's error is raised
