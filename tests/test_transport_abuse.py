"""Odd payloads and channel limits: messages of any number of leaves on both transports,
a worker's failed send reported as an error (not a death), tensors keeping
``requires_grad``."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import _transport_handlers as H
from zephon import RuntimeOptions
from zephon.errors import TransportError, WorkerCrashedError
from zephon.transport import WorkerPool
from zephon.transport.channel import channel_pair


@pytest.fixture
def make_pool():
    pools = []

    def make(workers=1, transport="socketpair", **options):
        pool = WorkerPool(H.handle, workers,
                          config=H.config(RuntimeOptions(ipc_transport=transport, **options)))
        pools.append(pool)
        return pool.start()

    yield make
    for pool in pools:
        pool.close()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "no-shm"])
@pytest.mark.parametrize("transport", ["socketpair", "pipe"])
def test_5000_arrays_in_one_message_round_trip_exactly(make_pool, transport, shm):
    pool = make_pool(transport=transport, shm_enabled=shm)
    # worker -> parent: 5000 arrays of 4 KiB + 8 bytes (each its own region or frame)
    pool.submit(("many", (5000, 513)))
    got = pool.get(timeout=120).value
    assert len(got) == 5000
    assert all(a.shape == (513,) and a[0] == i and a[-1] == i for i, a in enumerate(got))
    # parent -> worker -> parent: 5000 arrays the parent sends (frames from its memory)
    sent = [np.full(600, -i, dtype=np.int64) for i in range(5000)]
    pool.submit(("echo", sent))
    back = pool.get(timeout=120).value
    assert len(back) == 5000
    assert all(np.array_equal(a, b) for a, b in zip(sent, back))


def test_channel_carries_more_descriptors_and_frames_than_one_sendmsg_takes():
    a, b = channel_pair("socketpair")
    fds = [os.memfd_create(f"t{i}") for i in range(600)]  # > SCM_MAX_FD (253)
    frames = [np.full(3, i, dtype=np.int64) for i in range(3000)]  # > IOV_MAX (1024)
    header = {"s": [[i, "x" * 8] for i in range(600)]}
    got = []
    try:
        sender = threading.Thread(target=lambda: a.send(header, frames, fds))
        sender.start()
        header_back, frames_back, got = b.recv()
        sender.join()
        assert header_back == header
        assert [np.frombuffer(f, dtype=np.int64)[0] for f in frames_back] == list(range(3000))
        assert len(got) == 600
        # the same files, in order: the i-th received descriptor is the i-th memfd
        assert [os.readlink(f"/proc/self/fd/{fd}") for fd in got] == \
            [os.readlink(f"/proc/self/fd/{fd}") for fd in fds]
    finally:
        for fd in fds + got:
            os.close(fd)
        a.close()
        b.close()


def test_a_failed_send_in_the_worker_is_an_error_naming_it(make_pool):
    pool = make_pool()
    pool.submit(("fail_next_send", 5))
    with pytest.raises(TransportError, match=r"worker 0 could not send the result of task "
                                             r"\d+: OSError: .*Message too long"):
        pool.get(timeout=60)
    assert pool.crashes == [] and pool.live_workers() == [0]
    pool.submit(("echo", 7))  # the channel is intact and the worker still serves
    assert pool.get(timeout=60).value == 7


@pytest.mark.torch
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "no-shm"])
def test_tensors_keep_requires_grad(make_pool, shm):
    torch = pytest.importorskip("torch")
    pool = make_pool(shm_enabled=shm, shm_min_new_allocation_bytes=0)
    pool.submit(("grad", 4096))
    got = pool.get(timeout=60).value
    assert got["w"].requires_grad and got["w"].is_leaf
    assert not got["x"].requires_grad and not got["i"].requires_grad
    assert torch.equal(got["w"].detach(), torch.ones(4096))
    # the other direction: the parent's tensor keeps it on the way to the worker and back
    w = torch.zeros(5000, requires_grad=True)
    pool.submit(("echo", {"w": w, "x": torch.zeros(5000)}))
    back = pool.get(timeout=60).value
    assert back["w"].requires_grad and not back["x"].requires_grad
    (back["w"] * 2).sum().backward()  # a leaf that can take gradients
    assert torch.equal(back["w"].grad, torch.full((5000,), 2.0))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="names are listable on Linux only")
def test_names_of_a_worker_killed_by_a_signal_are_swept(make_pool):
    pool = make_pool(transport="pipe")
    pool.submit(("pid", None))
    pid = pool.get(timeout=60).value
    tag = f"zph_{os.getpid():x}_{pid:x}_"
    pool.submit(("leak_segment_and_die", None))
    with pytest.raises(WorkerCrashedError, match="SIGKILL"):
        pool.get(timeout=60)
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(tag)]
