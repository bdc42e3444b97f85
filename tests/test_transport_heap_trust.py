"""The shared heap trusts its reference counts only after a self-test at first use:
settle's walk must copy an array the op keeps and hand a fresh one over, and the
encoder must copy a kept heap array and send a fresh one by reference. When the counts
lie (forced here by making the count function lie, which tests the fallback, not the
walk), one warning says why, every array is copied and the heap turns off; that check
survives ``python -O``. A message that is never sent gives its heap arrays back."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import zephon.transport.heap as heap_mod
from zephon.pipeline.records import Record
from zephon.transport.arena import LeaseTable, ShmArena, SlabRegistry
from zephon.transport.codec import Encoder, PeerState, ShmPolicy
from zephon.transport.heap import WorkerHeap, settle

try:
    from zephon._kernels import heap as _heap_kernel  # noqa: F401
except ImportError:
    pytest.skip("the compiled kernels are not built", allow_module_level=True)

MIB = 1 << 20
N = 2 * MIB // 8
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def fresh_trust(monkeypatch):
    """The self-test not run yet in this process (restored afterwards)."""
    monkeypatch.setattr(heap_mod, "_TRUSTED", None)
    monkeypatch.setattr(heap_mod, "_DISTRUST_SAID", False)


def _lie_about(real, large_only: bool, held_once: bool = False):
    """``real`` (a count function) answering one reference less for arrays (of heap
    size with ``large_only``), or with ``held_once`` that their container alone holds
    them: an array someone keeps then looks exclusive."""
    def counts_of(values) -> list[int]:
        return [int(type(v) is np.ndarray and (not large_only or v.nbytes >= MIB))
                for v in values]

    def lying_items(container):
        counts = real(container)  # (before the list of values below holds them)
        values = list(dict.values(container)) if isinstance(container, dict) else container
        lies = counts_of(values)
        if held_once:
            return [1 if d else c for c, d in zip(counts, lies, strict=True)]
        return [c - d for c, d in zip(counts, lies, strict=True)]

    return lying_items


def _lie_about_one(real, large_only: bool):
    def lying_item(seq, i):
        v = seq[i]
        lie = type(v) is np.ndarray and (not large_only or v.nbytes >= MIB)
        del v
        return real(seq, i) - int(lie)

    return lying_item


@pytest.fixture
def heap():
    arena = ShmArena(1, "memfd", 64 * MIB, parent_pid=os.getpid())
    h = WorkerHeap(arena)
    assert h.install()
    yield h
    h.close()
    gc.collect()
    arena.close()


def _encode(h: WorkerHeap, value) -> bool:
    enc = Encoder(ShmPolicy(), LeaseTable(), SlabRegistry(), h.arena, h)
    peer = PeerState(can_map_fds=True)
    box = [value]
    del value
    before = h.sent
    header = enc.encode_owned(box, peer)[0]
    enc.abort(header, peer)
    return h.sent > before


def test_the_counts_pass_their_self_test_here(fresh_trust, heap, caplog):
    caplog.set_level(logging.WARNING, "zephon.transport.heap")
    assert heap_mod.counts_trusted()
    sent = _encode(heap, {"x": np.ones(N, dtype=np.int64)})  # verified, then sent
    assert sent
    assert heap.verified is True and heap.active and heap.sent == 1  # (the probe's: not)
    assert not caplog.records


def test_counts_that_lie_make_settle_copy_everything_with_one_warning(fresh_trust,
                                                                      monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "zephon.transport.heap")
    monkeypatch.setattr(heap_mod, "item_refcounts",
                        _lie_about(heap_mod.item_refcounts, large_only=False,
                                   held_once=True))
    ids = []
    for _ in range(3):
        r = Record({"x": np.zeros(4)}, [("s", 0, 0)])
        ids.append((id(r.value), id(r.value["x"])))
        settle(r)
        assert (id(r.value), id(r.value["x"])) != ids[-1]  # even a fresh one: copied
    assert heap_mod.exclusive_arrays([{"x": np.zeros(4)}]) == set()
    said = [r for r in caplog.records if "self-test" in r.getMessage()]
    assert len(said) == 1 and "passed as exclusive" in said[0].getMessage()


def test_an_encoder_that_would_send_a_kept_heap_array_turns_the_heap_off(
        fresh_trust, heap, monkeypatch, caplog):
    # the lie is about heap-sized arrays only: settle's own self-test (small arrays)
    # passes, the encoder's probe (a kept heap array) must catch it
    caplog.set_level(logging.WARNING, "zephon.transport.heap")
    monkeypatch.setattr(heap_mod, "item_refcounts",
                        _lie_about(heap_mod.item_refcounts, large_only=True))
    monkeypatch.setattr(heap_mod, "item_refcount",
                        _lie_about_one(heap_mod.item_refcount, large_only=True))
    sent = [_encode(heap, {"x": np.ones(N, dtype=np.int64)})]
    assert heap.verified is False and not heap.active  # off: NumPy gets malloc again
    sent.append(_encode(heap, {"x": np.ones(N, dtype=np.int64)}))
    assert sent == [False, False] and heap.sent == 0
    said = [r.getMessage() for r in caplog.records if "self-test" in r.getMessage()]
    assert len(said) == 1 and "module global" in said[0], said
    monkeypatch.undo()
    gc.collect()
    with heap.arena.cond:
        heap.arena._drain_gives()
    assert heap.arena.live_regions == 0  # every region came back, the heap off or not


def test_the_check_survives_python_dash_O():
    code = textwrap.dedent("""
        import json, logging, sys
        import numpy as np
        import zephon.transport.heap as H
        from zephon.pipeline.records import Record
        real = H.item_refcounts
        H.item_refcounts = lambda c: [n - 1 for n in real(c)]  # everything looks kept less
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        r = Record({"x": np.zeros(4)}, [0])
        before = id(r.value["x"])
        H.settle(r)
        print(json.dumps({"optimize": sys.flags.optimize, "copied": id(r.value["x"]) != before,
                          "trusted": H.counts_trusted()}))
    """)
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"optimize": 1, "copied": True, "trusted": False}
    assert "self-test" in proc.stderr


def test_a_by_reference_message_that_is_not_sent_gives_its_heap_array_back(heap):
    arena = heap.arena
    enc = Encoder(ShmPolicy(), LeaseTable(), SlabRegistry(), arena, heap)
    peer = PeerState(can_map_fds=True)
    box = [{"x": np.full(N, 3, dtype=np.int64)}]
    header = enc.encode_owned(box, peer)[0]
    assert heap.sent == 1 and arena.consumer_bytes >= 2 * MIB and peer.slabs  # claimed
    (token,) = [r[0] for r in header["r"]]
    enc.abort(header, peer)  # the send failed
    assert arena._heap == {token: 1} and arena.consumer_bytes == 0  # the worker's alone
    assert peer.slabs == set()
    assert int(box[0]["x"].min()) == 3 == int(box[0]["x"].max())  # still the worker's array
    del box  # the worker drops it: the region is free again
    gc.collect()
    with arena.cond:
        arena._drain_gives()
    assert arena._heap == {} and arena.live_regions == 0 and arena._held_bytes == 0
    # and a later message may take the region again, by reference
    box = [{"x": np.full(N, 4, dtype=np.int64)}]
    header = enc.encode_owned(box, peer)[0]
    assert heap.sent == 2
    enc.abort(header, peer)
    del box
