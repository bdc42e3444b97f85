"""A message that is never sent gives back what it took: its arena regions (the arena's
accounting as before it), the heap arrays it claimed, and the slabs it announced to the
peer; a full allocator range table sends the array through malloc instead of losing
its region; a fork inside an op copies only the heap arrays the child can reach. Real
arenas, real sockets, real worker processes."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys

import _fork_handlers as FH
import numpy as np
import pytest

from zephon.transport import WorkerPool
from zephon.transport.arena import LeaseTable, ShmArena, SlabRegistry, segment_name
from zephon.transport.channel import SocketChannel
from zephon.transport.codec import Decoder, Encoder, PeerState, ShmPolicy
from zephon.transport.heap import WorkerHeap

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))

try:
    from zephon._kernels import heap as _heap_kernel  # noqa: F401
except ImportError:
    pytest.skip("the compiled kernels are not built", allow_module_level=True)


@pytest.fixture
def arena():
    made = []

    def make(kind="memfd"):
        a = ShmArena(1, kind, 64 * MIB, parent_pid=os.getpid())
        made.append(a)
        return a

    yield make
    gc.collect()
    for a in made:
        a.close()


@pytest.fixture
def channels():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield SocketChannel(a), SocketChannel(b)
    a.close()
    b.close()


def _fill(sock: socket.socket) -> int:
    """Fill the socket's send path so that the next send fails at once (EAGAIN)."""
    sock.setblocking(False)
    sent = 0
    try:
        while True:
            sent += sock.send(b"\0" * 65536)
    except BlockingIOError:
        return sent


def _drain(sock: socket.socket, n: int) -> None:
    while n:
        n -= len(sock.recv(min(n, 1 << 20)))


def test_a_send_that_fails_gives_its_regions_and_slabs_back(arena, channels):
    a = arena()
    sender, receiver = channels
    enc = Encoder(ShmPolicy(), LeaseTable(), SlabRegistry(), a)
    peer = PeerState(can_map_fds=True)
    payload = {"x": np.full(3 * MIB // 8, 5, dtype=np.int64)}
    header, frames, fds, _ = enc.encode(payload, peer)
    assert a.live_regions == 1 and a.consumer_bytes >= 3 * MIB and peer.slabs
    queued = _fill(sender.sock)
    with pytest.raises(BlockingIOError):
        sender.send(header, frames, fds)
    enc.abort(header, peer)
    assert a.live_regions == 0 and a.consumer_bytes == 0  # as before the message
    assert peer.slabs == set()  # the peer never got the slab's descriptor
    # the channel and the arena still work: the next message announces the slab again
    _drain(receiver.sock, queued)
    sender.sock.setblocking(True)
    header, frames, fds, _ = enc.encode(payload, peer)
    sender.send(header, frames, fds)
    got = Decoder(LeaseTable(), SlabRegistry(), lambda owner: None,
                  borrow_forwarded=False).decode(*receiver.recv())
    assert int(got["x"].min()) == 5 == int(got["x"].max())


def test_an_encoding_that_fails_after_claiming_a_heap_array_gives_it_back(arena):
    a = arena("named")
    big = np.full(20 * MIB // 8, 1, dtype=np.int64)  # malloc: made before the heap
    heap = WorkerHeap(a)
    assert heap.install()
    taken = None
    try:
        enc = Encoder(ShmPolicy(), LeaseTable(), SlabRegistry(), a, heap)
        peer = PeerState(can_map_fds=False)
        box = [{"h": np.full(2 * MIB // 8, 2, dtype=np.int64), "kept": big}]
        assert a.live_regions == 1  # the heap array's region
        # the slab the copy of ``big`` needs cannot be created: its name is taken
        taken = "/dev/shm/" + segment_name(a.parent_pid, os.getpid(), a._nonce, 1)
        open(taken, "wb").close()
        with pytest.raises(FileExistsError):
            enc.encode_owned(box, peer)
        assert a.consumer_bytes == 0  # the claim was undone: the array is the worker's
        del box
        gc.collect()
        with a.cond:
            a._drain_gives()
        assert a.live_regions == 0 and a.live_bytes == 0  # nothing lost
    finally:
        heap.close()
        if taken is not None:
            os.unlink(taken)


def test_a_full_range_table_sends_the_array_through_malloc_without_losing_a_region():
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_range_table_full.py")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["ranges_filled"] > 0 and out["right"]
    assert out["live_regions"] == 0 and out["held_bytes"] == 0, out


@pytest.fixture
def fork_pool():
    pool = WorkerPool(FH.ForkOps(), 1).start()
    yield pool
    pool.close()


def test_a_fork_inside_an_op_copies_only_the_heap_arrays_the_child_reaches(fork_pool):
    def call(op, arg):
        fork_pool.submit((op, arg))
        return fork_pool.get(timeout=120).value

    assert call("fill", (4 * MIB, 6)) == 1  # 24 MiB of heap slabs, one array kept
    out = call("fork", (2 * MIB, 9))
    assert out["ok"]  # the child read the live array's bytes
    assert int(out["live"].min()) == 9 == int(out["live"].max())  # its write stayed there
    # what the child holds of the slabs: the live arrays (4 + 2 MiB), not a copy of
    # every slab (24 MiB and more)
    assert out["slab_kib"] >= 16 * 1024, out
    assert out["child_slab_kib"] <= 7 * 1024, out
