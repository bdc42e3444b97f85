"""Ways an op can keep what it returns, each of which must make the encoder copy the
array (never send its heap region by reference) and :func:`settle` replace it by a
copy: a weak reference's callback, a memoryview, a ``ctypes`` pointer, a suspended
generator, an iterator, a list in a closure, a dict subclass the op tracks weakly, and
bases the walk cannot vouch for (a bytearray, an mmap, an ``array.array``). Each attack
that can go either way has its control: the same result without the keeper goes by
reference (so the test can fail). In this process, with a real arena and heap."""

from __future__ import annotations

import array
import ctypes
import gc
import mmap
import os
import weakref

import numpy as np
import pytest

from zephon.pipeline.records import Batch, Record
from zephon.transport.arena import LeaseTable, ShmArena, SlabRegistry
from zephon.transport.codec import Encoder, PeerState, ShmPolicy
from zephon.transport.heap import WorkerHeap, settle

try:
    from zephon._kernels import heap as _heap_kernel  # noqa: F401
except ImportError:
    pytest.skip("the compiled kernels are not built", allow_module_level=True)

MIB = 1 << 20
N = 2 * MIB // 8  # int64 items of a heap-sized array


class _Anchor:
    pass


def _weakref_callback(keep):
    a = np.full(N, 1, dtype=np.int64)
    anchor = _Anchor()
    hold = [a] if keep else []
    ref = weakref.ref(anchor, lambda r, hold=hold: [x.fill(-1) for x in hold])
    return {"x": a}, (anchor, ref)


def _memoryview(keep):
    a = np.full(N, 1, dtype=np.int64)
    return {"x": a}, memoryview(a) if keep else None


def _memoryview_of_a_view(keep):
    a = np.full(N, 1, dtype=np.int64)
    return {"x": a}, memoryview(a[1:]) if keep else None


def _ctypes_pointer(keep):
    a = np.full(N, 1, dtype=np.int64)
    # numpy: "the returned pointer will keep a reference to the array"
    return {"x": a}, a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)) if keep else None


def _ctypes_from_buffer(keep):
    a = np.full(N, 1, dtype=np.int64)
    return {"x": a}, (ctypes.c_char * 8).from_buffer(a) if keep else None


def _generator(keep):
    a = np.full(N, 1, dtype=np.int64)

    def later(x):
        yield
        x.fill(-1)

    g = later(a) if keep else None
    if g is not None:
        next(g)
    return {"x": a}, g


def _nditer(keep):
    a = np.full(N, 1, dtype=np.int64)
    return {"x": a}, np.nditer(a) if keep else None


def _list_in_a_closure(keep):
    a = np.full(N, 1, dtype=np.int64)
    cache = [a] if keep else []

    def op():
        return cache

    return {"x": a}, op


def _view_of_a_view(keep):
    a = np.full(N, 1, dtype=np.int64)
    v1 = a[1:]
    out = {"x": v1[1:]}  # its base is a (NumPy collapses view chains)
    return out, v1 if keep else None


def _finalizer(keep):
    a = np.full(N, 1, dtype=np.int64)
    return {"x": a}, weakref.finalize(a, lambda: None) if keep else None


ATTACKS = [_weakref_callback, _memoryview, _memoryview_of_a_view, _ctypes_pointer,
           _ctypes_from_buffer, _generator, _nditer, _list_in_a_closure, _view_of_a_view,
           _finalizer]


@pytest.fixture
def heap():
    arena = ShmArena(1, "memfd", 64 * MIB, parent_pid=os.getpid())
    h = WorkerHeap(arena)
    assert h.install()
    yield h
    h.close()
    gc.collect()
    arena.close()


def _by_reference(heap: WorkerHeap, attack, keep: bool) -> bool:
    """Whether the result ``attack`` makes (held by nothing but the box, and by its
    keeper when ``keep``) went by reference."""
    enc = Encoder(ShmPolicy(), LeaseTable(), SlabRegistry(), heap.arena, heap)
    peer = PeerState(can_map_fds=True)
    value, keeper = attack(keep)
    box = [value]
    del value
    before = heap.sent
    header = enc.encode_owned(box, peer)[0]
    enc.abort(header, peer)
    del keeper
    return heap.sent > before


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda f: f.__name__.strip("_"))
def test_the_encoder_copies_an_array_the_op_keeps_and_sends_the_control(heap, attack):
    kept = _by_reference(heap, attack, keep=True)
    control = _by_reference(heap, attack, keep=False)
    assert (kept, control) == (False, True)


def _settled_shares_memory(attack, keep: bool) -> bool:
    value, keeper = attack(keep)
    before = value["x"].__array_interface__["data"][0]
    r = Record(value, [("s", 0, 0)])
    del value
    settle(r)
    del keeper
    return r.value["x"].__array_interface__["data"][0] == before


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda f: f.__name__.strip("_"))
def test_settle_copies_an_array_the_op_keeps_and_hands_the_control_over(attack):
    kept = _settled_shares_memory(attack, keep=True)
    control = _settled_shares_memory(attack, keep=False)
    assert (kept, control) == (False, True)


def _over_bytearray():
    ba = bytearray(64)
    return np.frombuffer(ba, dtype=np.int64), ba


def _over_mmap():
    m = mmap.mmap(-1, 64)
    return np.frombuffer(m, dtype=np.int64), m


def _over_array_array():
    aa = array.array("q", [1] * 8)
    return np.frombuffer(aa, dtype=np.int64), aa


@pytest.mark.parametrize("make", [_over_bytearray, _over_mmap, _over_array_array],
                         ids=lambda f: f.__name__.strip("_"))
def test_settle_copies_an_array_over_memory_the_walk_cannot_vouch_for(make):
    x, keeper = make()
    r = Record({"x": x}, [("s", 0, 0)])
    del x
    settle(r)
    out = r.value["x"]
    assert out.base is None  # a copy that owns its memory
    memoryview(keeper).cast("B")[:8] = b"\xff" * 8  # the op writes through what it kept
    assert int(out[0]) != -1
    del out, r
    if isinstance(keeper, mmap.mmap):
        gc.collect()
        keeper.close()


def test_settle_copies_a_dict_subclass_the_op_tracks_weakly():
    class Tracked(dict):
        pass

    def settled_ids(track: bool) -> tuple[bool, bool]:
        d = Tracked(x=np.ones(4))
        ref = weakref.ref(d) if track else None
        before = (id(d), id(d["x"]))
        r = Record(d, [("s", 0, 0)])
        del d
        settle(r)
        del ref
        return id(r.value) == before[0], id(r.value["x"]) == before[1]

    assert settled_ids(track=True) == (False, False)  # the dict and its array: copies
    assert settled_ids(track=False) == (True, True)  # the control: handed over


def _in_a_batch(attack):
    """``attack``'s result as the column of a batch, as a fused collate makes it."""

    def make(keep):
        value, keeper = attack(keep)
        return Record(Batch(value, meta={"sample_ids": [("s", 0, 0)]}), [("s", 0, 0)]), keeper

    make.__name__ = f"{attack.__name__}_in_a_batch"
    return make


@pytest.mark.parametrize("attack", [_in_a_batch(a) for a in ATTACKS],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_batch_column_the_op_keeps_is_copied_and_the_control_goes_by_reference(heap, attack):
    kept = _by_reference(heap, attack, keep=True)
    control = _by_reference(heap, attack, keep=False)
    assert (kept, control) == (False, True)


def _batch_kept(how: str):
    def make(keep):
        a = np.full(N, 1, dtype=np.int64)
        batch = Batch({"x": a}, meta={})
        keeper = None
        if keep and how == "weakly":
            keeper = weakref.ref(batch)
        elif keep and how == "in_meta":
            batch.meta["also"] = a  # reached twice: through the columns and through meta
        elif keep and how == "whole":
            keeper = batch
        return Record(batch, [("s", 0, 0)]), keeper

    make.__name__ = f"batch_kept_{how}"
    return make


@pytest.mark.parametrize("how", ["weakly", "in_meta", "whole"])
def test_a_batch_the_op_keeps_or_tracks_is_copied(heap, how):
    kept = _by_reference(heap, _batch_kept(how), keep=True)
    control = _by_reference(heap, _batch_kept(how), keep=False)
    assert (kept, control) == (False, True)


def test_an_array_only_in_a_batchs_meta_is_copied(heap):
    def make(keep):
        return Record(Batch({"y": 1}, meta={"x": np.full(N, 1, dtype=np.int64)}),
                      [("s", 0, 0)]), None

    assert _by_reference(heap, make, keep=False) is False
