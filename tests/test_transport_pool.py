"""The worker pool end to end: round trips, zero copy, forwarding, compaction, recycling,
back-pressure, errors and faults, over both transports, with real processes."""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import select
import signal
import struct
import termios
import time
import warnings

import numpy as np
import pytest

import _transport_handlers as H
from _procs import alive
from zephon import RuntimeOptions, SerializationError, WorkerCrashedError
from zephon.errors import RemoteTraceback, TransportError
from zephon.transport.tokens import slab_owner
from zephon.transport import WorkerPool
from zephon.transport.budget import arena_bytes_for

TRANSPORTS = ["socketpair", "pipe"]


@pytest.fixture
def make_pool():
    pools = []

    def make(workers=2, transport="socketpair", handler=H.handle, **kwargs):
        opts = RuntimeOptions(ipc_transport=transport, **kwargs.pop("options", {}))
        pool = WorkerPool(handler, workers, config=H.config(opts, **kwargs))
        pools.append(pool)
        return pool.start()

    yield make
    for pool in pools:
        pool.close()


def assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        if a.dtype.hasobject:
            assert a.tolist() == b.tolist()
        else:
            assert a.tobytes() == b.tobytes()
    elif isinstance(a, H.Record):
        assert a.name == b.name and a.extra == b.extra
        assert_same(a.values, b.values)
    else:
        assert type(a) is type(b) and a == b


def arena_mapping(pool, array):
    """The parent's mapping of the slab a received array lives in, or None."""
    found = pool.leases.locate(array)
    return None if found is None else found[0].slab


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_nested_round_trip_exact_and_zero_copy(make_pool, transport):
    pool = make_pool(transport=transport, options={"shm_min_new_allocation_bytes": 0})
    ids = [pool.submit(("nested", seed)) for seed in range(4)]
    results = {r.task_id: r for r in (pool.get(timeout=60) for _ in ids)}
    for seed, task in enumerate(ids):
        got = results[task].value
        assert_same(H.nested_payload(seed), got)
        for key in ("big", "strided", "transposed"):
            slab = arena_mapping(pool, got[key])
            assert slab is not None, key
            assert np.shares_memory(got[key], np.frombuffer(slab.mapping, dtype=np.uint8))
            assert got[key].flags.c_contiguous and got[key].flags.writeable
        assert isinstance(got["bytes"], bytes) and isinstance(got["bytearray"], bytearray)
        assert arena_mapping(pool, got["small"]) is None  # 10 bytes travel in-band


def test_shm_disabled_is_plain_pickle5(make_pool):
    pool = make_pool(options={"shm_enabled": False})
    pool.submit(("nested", 1))
    got = pool.get(timeout=60).value
    assert_same(H.nested_payload(1), got)
    assert arena_mapping(pool, got["big"]) is None
    assert len(pool.registry._slabs) == 0


@pytest.mark.torch
def test_torch_tensors_round_trip_zero_copy(make_pool):
    torch = pytest.importorskip("torch")
    pool = make_pool(options={"shm_min_new_allocation_bytes": 0})
    pool.submit(("tensor", 4096))
    got = pool.get(timeout=60).value
    expected = torch.arange(4096, dtype=torch.float32).reshape(-1, 4)[:, 1:]
    assert isinstance(got["t"], torch.Tensor) and torch.equal(got["t"], expected)
    assert np.array_equal(got["n"], np.arange(4096))
    slabs = [np.frombuffer(s.mapping, dtype=np.uint8) for s in pool.registry._slabs.values()]
    for leaf in (got["t"].numpy(), got["n"]):  # both live in the worker's arena, no copy
        assert sum(np.shares_memory(leaf, slab) for slab in slabs) == 1
    del slabs


def test_forwarding_across_two_hops_keeps_sharing_memory(make_pool):
    pool = make_pool(workers=2)
    pool.submit(("full", (8 << 20, 7)))  # 8 MiB array in worker A's arena
    first = pool.get(timeout=60)
    data = first.value["data"]
    original = np.frombuffer(arena_mapping(pool, data).mapping, dtype=np.uint8)
    other = 1 - first.worker
    # hop 1: parent -> worker B by reference; hop 2: B returns a view of it, by reference
    pool.submit(("slice", (data, slice(1000, None))), worker=other)
    second = pool.get(timeout=60)
    assert second.worker == other
    assert np.array_equal(second.value, data[1000:])
    assert np.shares_memory(second.value, original)
    assert pool.leases.locate(second.value)[0].token == pool.leases.locate(data)[0].token


def test_small_view_of_big_region_is_compacted(make_pool):
    pool = make_pool(workers=2, options={"shm_min_new_allocation_bytes": 0})
    pool.submit(("full", (64 << 20, 3)))  # one 64 MiB region in worker A's arena
    first = pool.get(timeout=60)
    big = first.value["data"]
    region = pool.leases.locate(big)[0]
    other = 1 - first.worker
    # B receives the whole region by reference and returns a 1 MiB view of it: 64x more
    # backing than useful bytes and 63 MiB saved, so B compacts it into its own arena.
    pool.submit(("slice", (big, slice(0, (1 << 20) // 8))), worker=other)
    small = pool.get(timeout=60).value
    assert np.array_equal(small, big[:(1 << 20) // 8])
    moved = pool.leases.locate(small)[0]
    assert moved.token != region.token and moved.nbytes == 1 << 20
    assert slab_owner(moved.slab.slab_id) == other + 1  # a region of B's arena
    assert not np.shares_memory(small, big)
    # The parent has no arena: a small view it sends is copied in-band (compact or inline)
    pool.submit(("echo", big[:(1 << 20) // 8]), worker=other)
    echoed = pool.get(timeout=60).value
    assert np.array_equal(echoed, big[:(1 << 20) // 8])
    pool.submit(("echo", big[:100]), worker=other)  # below shm_min_forward_bytes
    tiny = pool.get(timeout=60).value
    assert np.array_equal(tiny, big[:100]) and not np.shares_memory(tiny, big)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_regions_recycle_under_a_fixed_bound(make_pool, transport):
    bound = 32 << 20
    pool = make_pool(workers=1, transport=transport, arena_bytes=bound)
    held = []
    for i in range(60):  # 60 x 4 MiB = 240 MiB through a 32 MiB arena
        pool.submit(("full", (4 << 20, i)))
        r = pool.get(timeout=60)
        assert r.value["data"][0] == i and r.value["value"] == i
        held.append(r.value)
        if len(held) > 3:  # a consumer that keeps the last few batches
            held.pop(0)
    slabs = [s for s in pool.registry._slabs.values()]
    assert 0 < sum(s.size for s in slabs) <= bound
    assert len(slabs) <= 4


def test_consumer_holding_everything_gets_copies_with_one_warning(make_pool):
    # The consumer keeps every result: once the 16 MiB its arena's messages may hold are
    # held, the worker waits once (briefly), then sends in-band until a region comes back;
    # one warning says so.
    bound = arena_bytes_for(16 << 20)
    pool = make_pool(workers=1, arena_bytes=bound)
    held = []
    with pytest.warns(RuntimeWarning, match="holds") as record:
        for i in range(8):
            pool.submit(("full", (4 << 20, i)))
            held.append(pool.get(timeout=60).value)
    assert [h["value"] for h in held] == list(range(8))
    assert all(h["data"][0] == h["value"] for h in held)
    in_arena = [arena_mapping(pool, h["data"]) is not None for h in held]
    assert in_arena == [True] * 4 + [False] * 4
    warned = [str(w.message) for w in record if "holds" in str(w.message)]
    assert len(warned) == 1
    assert "copy" in warned[0] and "prefetch_batches" in warned[0]
    assert f"{bound}-byte" in warned[0]
    del held, record
    # Regions came back: the next result lands in the arena again, with no new warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.submit(("full", (4 << 20, 8)))
        back = pool.get(timeout=60).value
    assert back["data"][0] == 8 and arena_mapping(pool, back["data"]) is not None


def test_remote_exception_reaches_the_consumer_with_its_traceback(make_pool):
    pool = make_pool(workers=1)
    pool.submit(("raise", "boom"))
    with pytest.raises(ValueError, match="op failed on purpose: boom") as info:
        pool.get(timeout=60)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "handle" in str(info.value.__cause__)
    pool.submit(("echo", 1))
    assert pool.get(timeout=60).value == 1  # the worker is still serving


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unpicklable_result_leaf_names_its_path(make_pool, transport):
    pool = make_pool(workers=1, transport=transport)
    pool.submit(("unpicklable", None))
    with pytest.raises(SerializationError, match=r"payload\['a'\]\[1\]") as info:
        pool.get(timeout=60)
    assert info.value.path == "payload['a'][1]"
    with pytest.raises(SerializationError, match=r"payload\[1\]\[1\]\['f'\]"):
        pool.submit(("echo", [0, {"f": lambda: 1}]))


def test_unpicklable_handler_fails_before_any_worker_starts():
    pool = WorkerPool(lambda x: x, 2)
    try:
        with pytest.raises(SerializationError, match="cannot be pickled"):
            pool.start()
        assert pool.workers == []
    finally:
        pool.close()


class _Unloadable:
    def __reduce__(self):
        return (_fail_on_load, ())

    def __call__(self, x):
        return x


def _fail_on_load():
    raise ImportError("this handler cannot be set up in a worker")


def test_handler_that_cannot_load_in_the_worker_is_a_clear_error():
    pool = WorkerPool(_Unloadable(), 2, config=H.config(spawn_timeout_s=60))
    try:
        with pytest.raises(ImportError, match="cannot be set up in a worker"):
            pool.start()
    finally:
        pool.close()
    assert all(not h.process.is_alive() for h in pool.workers)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkill_of_a_busy_worker_names_worker_and_tasks(make_pool, transport):
    pool = make_pool(workers=2, transport=transport)
    pids = {}
    for k in range(2):
        pool.submit(("pid", None), worker=k)
    for _ in range(2):
        r = pool.get(timeout=60)
        pids[r.worker] = r.value
    a = pool.submit(("sleep", 30), worker=0)
    b = pool.submit(("sleep", 30), worker=0)
    pool.submit(("sleep", 0.5), worker=1)
    os.kill(pids[0], signal.SIGKILL)  # wherever worker 0 is, both its tasks are lost
    outcomes = []
    for _ in range(2):
        try:
            outcomes.append(pool.get(timeout=60).value)
        except WorkerCrashedError as exc:
            outcomes.append(exc)
    crash = next(o for o in outcomes if isinstance(o, WorkerCrashedError))
    assert crash.worker == 0 and crash.signal == signal.SIGKILL and crash.seq == a
    assert crash.tasks == [a, b] and "SIGKILL" in str(crash)
    assert 0.5 in outcomes  # the other worker's result still arrives
    assert pool.live_workers() == [1]


def test_sigkill_mid_message_releases_the_dead_workers_arena(make_pool):
    pool = make_pool(workers=1, options={"ipc_buffer_bytes": 64 << 10})
    pool.submit(("full", (8 << 20, 1)))
    held = pool.get(timeout=60).value  # a view into the worker's arena
    pool.submit(("pid", None))
    pid = pool.get(timeout=60).value
    # A 64 MiB str result: never shared memory (it is no array), so it streams through the
    # 64 KiB socket and the worker cannot finish sending it while nobody reads. Its first
    # bytes arriving is the barrier; fewer bytes than the message waiting in the socket
    # proves the worker is mid-message when it is killed.
    text = pool.submit(("text", 64 << 20), worker=0)
    nested = pool.submit(("nested", 3))
    fd = pool.workers[0].channel.fileno()
    assert select.select([fd], [], [], 60)[0]
    pending = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    assert 0 < pending < 64 << 20
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerCrashedError, match="worker 0") as crash:
        while True:
            pool.get(timeout=60)
    assert crash.value.tasks == [text, nested]  # the half-sent result was not taken for one
    assert held["data"][123] == 1  # views the consumer still holds stay valid

    def dead_worker_mappings() -> int:
        # memfd slabs are named zph_<parent pid>_<worker pid>_...: count this process's
        # mappings of the dead worker's slabs
        tag = f"zph_{os.getpid():x}_{pid:x}_"
        with open("/proc/self/maps") as fh:
            return sum(tag in line for line in fh)

    assert dead_worker_mappings() >= 1  # still mapped: the held view needs it
    del held
    import gc

    gc.collect()
    assert dead_worker_mappings() == 0  # the last view went, and the memory with it


def test_descriptors_are_close_on_exec(make_pool):
    pool = make_pool(workers=1, options={"shm_min_new_allocation_bytes": 0})
    pool.submit(("full", (4 << 20, 1)))
    pool.get(timeout=60)
    pool.submit(("fds", None))
    fds = pool.get(timeout=60).value
    interesting = {fd: v for fd, v in fds.items() if fd > 2}
    assert any("memfd:" in target for target, _ in interesting.values())
    inheritable = {fd: t for fd, (t, inh) in interesting.items() if inh}
    assert not inheritable, inheritable
    for slab in pool.registry._slabs.values():
        assert slab.fd is None or not os.get_inheritable(slab.fd)


@pytest.mark.parametrize("mode", ["hard", "graceful"])
def test_close_reaps_every_worker_and_is_idempotent(mode):
    pool = WorkerPool(H.handle, 2, config=H.config(RuntimeOptions(shutdown_mode=mode))).start()
    procs = [h.process for h in pool.workers]
    if mode == "hard":
        pool.submit(("sleep", 60))  # a stuck task: hard shutdown must not wait for it
    pool.close()
    pool.close()
    assert all(not p.is_alive() for p in procs)
    with pytest.raises(TransportError):
        pool.submit(("echo", 1))


def test_dropped_pool_is_closed_by_its_finalizer():
    pool = WorkerPool(H.handle, 1).start()
    proc = pool.workers[0].process
    del pool
    import gc

    gc.collect()
    proc.join(15)
    assert not proc.is_alive()


def test_socket_buffer_clamp_warns_once_per_size():
    from zephon.transport import channel as ch

    requested = 3 * (64 << 20) + 17
    ch._warned_sizes.discard(requested)
    with pytest.warns(RuntimeWarning, match="granted") as record:
        pairs = [ch.channel_pair("socketpair", requested) for _ in range(3)]
    assert len([w for w in record if "granted" in str(w.message)]) == 1
    for a, b in pairs:
        a.close()
        b.close()
    assert ch.granted_buffer_bytes(64 << 10) >= 64 << 10


def test_watchdog_notices_a_death_without_anyone_in_get(make_pool, caplog):
    pool = make_pool(workers=2)
    pool.submit(("pid", None), worker=1)
    pid = pool.get(timeout=60).value
    with caplog.at_level(logging.ERROR, logger="zephon.transport.pool"):
        os.kill(pid, signal.SIGKILL)
        exited = pool.wait_for_exit(timeout=30)
        deadline = time.monotonic() + 5
        while "SIGKILL" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert exited == {1: -signal.SIGKILL}
    assert "worker 1" in caplog.text and "SIGKILL" in caplog.text


def test_named_segments_are_unlinked_once_both_sides_mapped(make_pool):
    pool = make_pool(workers=1, transport="pipe")
    assert pool.arena_kind == "named"
    held = []
    for i in range(3):
        pool.submit(("full", (8 << 20, i)))
        held.append(pool.get(timeout=60).value)
    # views are alive and mapped, but no name of this run is left to leak (names carry the
    # parent's pid: other processes' segments on the machine are not this test's business)
    assert [v["data"][0] for v in held] == [0, 1, 2]
    mine = f"zph_{os.getpid():x}_"
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(mine)]


def test_forwarding_without_descriptors_degrades_to_a_copy(make_pool):
    pool = make_pool(workers=2, transport="pipe")
    pool.submit(("full", (8 << 20, 5)))
    first = pool.get(timeout=60)
    data = first.value["data"]
    pool.submit(("slice", (data, slice(10, None))), worker=1 - first.worker)
    second = pool.get(timeout=60).value
    assert np.array_equal(second, data[10:]) and not np.shares_memory(second, data)


def test_restart_replaces_a_dead_worker_with_fresh_slab_ids(make_pool):
    pool = make_pool(workers=1, options={"shm_min_new_allocation_bytes": 0})
    pool.submit(("full", (4 << 20, 1)))
    old = pool.get(timeout=60).value  # held across the restart
    old_token = pool.leases.locate(old["data"])[0].token
    pool.submit(("kill_self", None))
    with pytest.raises(WorkerCrashedError):
        pool.get(timeout=60)
    pool.restart(0)
    pool.submit(("full", (4 << 20, 2)))
    new = pool.get(timeout=60).value
    assert new["data"][0] == 2 and old["data"][0] == 1  # the old view is intact
    assert pool.leases.locate(new["data"])[0].token != old_token
    with pytest.raises(TransportError, match="still alive"):
        pool.restart(0)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="glibc on Linux only")
def test_workers_reuse_large_buffers_without_page_faults(make_pool, monkeypatch):
    """A pool worker keeps freed 64 MiB arrays mapped (its malloc thresholds are raised), so
    allocating one again does not fault its pages in again; with the tuning turned off
    (``ZEPHON_WORKER_MALLOC_TUNING=0``) it does."""
    tuned = make_pool(1, handler=H.refault_count)
    tuned.submit(64)
    monkeypatch.setenv("ZEPHON_WORKER_MALLOC_TUNING", "0")  # read by the worker at start
    plain = make_pool(1, handler=H.refault_count)
    plain.submit(64)
    faults_tuned, faults_plain = tuned.get().value, plain.get().value
    assert faults_tuned <= 4 < faults_plain, (faults_tuned, faults_plain)


def test_a_dead_worker_wakes_get_even_while_its_channel_stays_open(make_pool):
    # The op forked a process (in a session of its own, so outside the worker's process
    # group) that inherited the worker's channel: when the worker is killed no EOF comes.
    # The watchdog's sight of the death must wake get() and report the crash.
    pool = make_pool(workers=1)
    pool.submit(("pid", None))
    pid = pool.get(timeout=60).value
    pool.submit(("fork_holder", 120))
    holder = pool.get(timeout=60).value
    try:
        task = pool.submit(("sleep", 120))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError) as info:
            pool.get(timeout=60)
        assert info.value.worker == 0 and info.value.signal == signal.SIGKILL
        assert info.value.tasks == [task]
        assert alive(holder)  # the channel was still open: no EOF told get()
        assert pool.live_workers() == []
    finally:
        os.kill(holder, signal.SIGKILL)


def test_results_sent_before_a_death_still_arrive_when_no_eof_comes(make_pool):
    pool = make_pool(workers=1)
    pool.submit(("pid", None))
    pid = pool.get(timeout=60).value
    pool.submit(("fork_holder", 120))
    holder = pool.get(timeout=60).value
    try:
        pool.submit(("echo", "sent before the death"))
        # the result is in the channel (readable) before the worker dies
        assert select.select([pool.workers[0].channel.fileno()], [], [], 60)[0]
        os.kill(pid, signal.SIGKILL)
        pool.wait_for_exit(timeout=60)
        assert pool.get(timeout=60).value == "sent before the death"
        with pytest.raises(WorkerCrashedError) as info:  # then the death, with no task lost
            pool.get(timeout=60)
        assert info.value.tasks == [] and info.value.signal == signal.SIGKILL
    finally:
        os.kill(holder, signal.SIGKILL)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_op_may_run_a_multiprocessing_pool(make_pool, transport):
    pool = make_pool(workers=1, transport=transport)
    pool.submit(("mp_pool", 5))
    got = pool.get(timeout=120).value
    assert got["squares"] == [0, 1, 4, 9, 16]
    assert len(got["pids"]) == 2 and not [p for p in got["pids"] if alive(p)]


def test_a_region_dropped_after_close_writes_nothing_to_a_reused_fd(make_pool):
    """The consumer may hold a result past ``close()``; dropping it then must not write the
    pool's wake-up byte to the fd number the closed pipe freed (another file's by then)."""
    pool = make_pool(workers=1)
    pool.submit(("full", (8 << 20, 7)))
    held = pool.get().value  # lives in the worker's arena until dropped
    pool.close()
    fds = [os.pipe() for _ in range(4)]  # take the freed numbers (the lowest free ones)
    try:
        del held
        gc.collect()
        for r, _ in fds:
            os.set_blocking(r, False)
            with pytest.raises(BlockingIOError):  # empty: nothing was written into it
                os.read(r, 16)
    finally:
        for pair in fds:
            for fd in pair:
                os.close(fd)
