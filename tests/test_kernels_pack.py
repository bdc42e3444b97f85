"""Packing: compiled kernel == reference on random inputs; exact round trips; refusals."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon import kernels
from zephon.kernels import pack_ref
from zephon.kernels.types import dtype_from_token, dtype_token

compiled = pytest.importorskip("zephon._kernels.pack", reason="kernels not built")
IMPLS = {"compiled": compiled, "reference": pack_ref}

DTYPES = ["b1", "i1", "u1", "<i2", ">i2", "<u2", "<i4", "<u4", "<i8", ">i8", "<u8", "<f2",
          "<f4", ">f4", "<f8", "<c8", "<c16", "M8[ms]", "m8[s]", "S3", "<U2",
          [("a", "<i4"), ("b", "<f8")]]


@st.composite
def leaf_arrays(draw):
    """Arrays of any dtype, views with random offsets, steps (negative too) and broadcasts."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    size = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize))
    base = np.frombuffer(raw, dtype=np.uint8).copy().view(dtype).reshape(shape)
    kind = draw(st.sampled_from(["plain", "step", "transpose", "broadcast", "fortran"]))
    if kind == "step" and ndim:
        axis = draw(st.integers(0, ndim - 1))
        step = draw(st.sampled_from([-2, -1, 2, 3]))
        index = [slice(None)] * ndim
        index[axis] = slice(None, None, step)
        return base[tuple(index)]
    if kind == "transpose":
        return base.T
    if kind == "broadcast" and ndim:
        return np.broadcast_to(base[..., :1] if shape[-1] else base, (*shape[:-1], 3)) \
            if shape[-1] else base
    if kind == "fortran":
        return np.asfortranarray(base)
    return base


leaves_st = st.lists(
    st.one_of(
        leaf_arrays(),
        st.binary(max_size=300),
        st.binary(max_size=300).map(bytearray),
        st.binary(max_size=300).map(memoryview),
        st.just(np.array([1, "x"], dtype=object)),
        st.just(np.zeros(3, dtype=[("o", object), ("f", "f8")])),
        st.integers(-5, 5).map(np.int32),  # numpy scalar
    ),
    max_size=24,
)
policy_st = st.fixed_dictionaries({
    "min_item_bytes": st.integers(0, 200),
    "coalesce": st.booleans(),
    "max_coalesced_bytes": st.one_of(st.none(), st.integers(1, 600)),
    "min_new_allocation_bytes": st.integers(0, 400),
    "alignment": st.sampled_from([1, 2, 8, 64, 256]),
})


def leaf_as_array(leaf):
    return pack_ref.as_leaf_array(leaf, 0)


def run_pack(impl, leaves, policy, buffer_kind="bytearray"):
    plan = impl.pack_plan(leaves, **policy)
    buffers = []
    for n in plan.group_nbytes:
        if buffer_kind == "bytearray":
            buffers.append(bytearray(int(n)))
        else:
            buffers.append(np.zeros(int(n), dtype=np.uint8))
    impl.pack_copy(leaves, plan, buffers)
    return plan, buffers, views_of(buffers, plan.descriptors)


def views_of(buffers, descriptors):
    """Each packed leaf as a zero-copy view of its buffer, built the way the codec's
    decoder builds it (``np.ndarray`` over the buffer at the descriptor's offset)."""
    return [None if d is None else
            np.ndarray(tuple(d.shape), dtype_from_token(d.dtype), buffer=buffers[d.group],
                       offset=d.offset)
            for d in descriptors]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(leaves_st, policy_st)
def test_kernel_equals_reference(leaves, policy):
    plan_c, bufs_c, out_c = run_pack(compiled, leaves, policy)
    plan_r, bufs_r, out_r = run_pack(pack_ref, leaves, policy, buffer_kind="numpy")
    assert plan_c == plan_r
    assert [bytes(b) for b in bufs_c] == [bytes(b) for b in bufs_r]
    for a, b in zip(out_c, out_r, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(leaves_st, policy_st, st.sampled_from(sorted(IMPLS)))
def test_round_trip_is_exact_and_zero_copy(leaves, policy, impl_name):
    impl = IMPLS[impl_name]
    plan, buffers, out = run_pack(impl, leaves, policy)
    cap = policy["max_coalesced_bytes"]
    views = [np.frombuffer(b, dtype=np.uint8) for b in buffers]
    for i, (leaf, rebuilt) in enumerate(zip(leaves, out, strict=True)):
        g = int(plan.leaf_group[i])
        if g < 0:
            assert rebuilt is None
            continue
        src = leaf_as_array(leaf)
        assert not src.dtype.hasobject
        assert src.nbytes >= policy["min_item_bytes"]
        assert rebuilt.dtype == src.dtype and rebuilt.shape == src.shape
        assert rebuilt.flags.c_contiguous
        assert rebuilt.tobytes() == src.tobytes()  # exact bytes, NaN payloads included
        if src.size:
            assert np.shares_memory(rebuilt, views[g])
        assert int(plan.leaf_offset[i]) % policy["alignment"] == 0
    # group invariants: sizes within the cap unless a lone oversized leaf; useful bytes
    for g in range(plan.n_groups):
        members = np.flatnonzero(plan.leaf_group == g)
        useful = int(plan.leaf_nbytes[members].sum())
        assert useful >= policy["min_new_allocation_bytes"]
        if cap is not None and len(members) > 1:
            assert int(plan.group_nbytes[g]) <= cap
        if not policy["coalesce"]:
            assert len(members) == 1
        assert {dtype_token(leaf_as_array(leaves[i]).dtype) for i in members} == {
            plan.group_dtype[g]}


def test_rebuilt_views_share_an_mmap_region():
    region = mmap.mmap(-1, 1 << 16)
    leaves = [np.arange(1000, dtype=np.int64)[::-3], np.ones((7, 9), dtype=np.float32).T]
    plan = kernels.pack_plan(leaves, 0, True, None, 0)
    assert plan.n_groups == 2
    buffers = [memoryview(region)[:int(plan.group_nbytes[0])],
               memoryview(region)[8192:8192 + int(plan.group_nbytes[1])]]
    kernels.pack_copy(leaves, plan, buffers)
    out = views_of(buffers, plan.descriptors)
    whole = np.frombuffer(region, dtype=np.uint8)
    for leaf, rebuilt in zip(leaves, out, strict=True):
        assert np.array_equal(rebuilt, leaf) and np.shares_memory(rebuilt, whole)
    del out, buffers, whole, rebuilt
    region.close()


def test_grouping_rules_worked_example():
    f4 = [np.zeros(250, np.float32) for _ in range(5)]  # 1000 bytes each
    big = np.zeros(3000, np.uint8)
    small = np.zeros(5, np.float64)  # 40 bytes: below min_item_bytes
    plan = kernels.pack_plan([*f4[:3], big, small, *f4[3:]], min_item_bytes=50, coalesce=True,
                             max_coalesced_bytes=2500, min_new_allocation_bytes=0,
                             alignment=64)
    # f4 leaves 0,1 fit in 2048+... : 0 at 0, 1 at 1024 (end 2024); 2 would end at 3048 > 2500
    assert plan.leaf_group.tolist() == [0, 0, 1, 2, -1, 1, 3]
    assert plan.leaf_offset.tolist() == [0, 1024, 0, 0, 0, 1024, 0]
    assert plan.group_dtype == ("<f4", "<f4", "|u1", "<f4")
    assert plan.group_nbytes.tolist() == [2024, 2024, 3000, 1000]
    dissolved = kernels.pack_plan(f4, 0, True, 2500, 1500)
    # groups of 2000 useful bytes stay, the last lone leaf (1000 bytes) goes in-band
    assert dissolved.leaf_group.tolist() == [0, 0, 1, 1, -1]


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_refused_inputs(impl):
    m = IMPLS[impl]
    ok = dict(min_item_bytes=0, coalesce=True, max_coalesced_bytes=None,
              min_new_allocation_bytes=0)
    with pytest.raises(TypeError, match="leaf 1 is a list"):
        m.pack_plan([np.zeros(3), [1, 2]], **ok)
    for bad in (dict(alignment=3), dict(alignment=0), dict(min_item_bytes=-1),
                dict(max_coalesced_bytes=0), dict(min_new_allocation_bytes=-5),
                dict(coalesce=1), dict(min_item_bytes=True)):
        with pytest.raises(ValueError):
            m.pack_plan([np.zeros(3)], **{**ok, **bad})
    leaves = [np.arange(100, dtype=np.int64)]
    plan = m.pack_plan(leaves, **ok)
    with pytest.raises(TypeError, match="buffer 0"):
        m.pack_copy(leaves, plan, [bytes(800)])  # read-only destination
    with pytest.raises(ValueError, match="holds 799 bytes"):
        m.pack_copy(leaves, plan, [bytearray(799)])
    with pytest.raises(ValueError, match="buffers"):
        m.pack_copy(leaves, plan, [])
    with pytest.raises(ValueError, match="leaves"):
        m.pack_copy(leaves + leaves, plan, [bytearray(800)])
    with pytest.raises(ValueError, match="plan says"):
        m.pack_copy([np.arange(99, dtype=np.int64)], plan, [bytearray(800)])


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_object_leaves_go_in_band_never_crash(impl):
    m = IMPLS[impl]
    leaves = [np.array([{"a": 1}] * 1000, dtype=object),
              np.zeros(100, dtype=[("o", object), ("x", "f8")]),
              np.zeros(1000, dtype="V0") if hasattr(np, "zeros") else None,
              np.zeros(1000)]
    plan = m.pack_plan(leaves, 0, True, None, 0)
    assert plan.leaf_group.tolist() == [-1, -1, -1, 0]


@pytest.mark.parametrize("dtype", [
    *DTYPES,
    np.dtype({"names": ["x", "y"], "formats": ["<i2", "<f8"], "offsets": [0, 8],
              "itemsize": 24}),
    [("nested", [("a", "u1"), ("b", "<f4", (2,))]), ("c", "S2")],
    [(("a title", "t"), "<i4"), ("u", "<U3", (2, 2))],
])
def test_dtype_token_round_trips(dtype):
    dtype = np.dtype(dtype)
    token = dtype_token(dtype)
    assert isinstance(token, str)
    assert dtype_from_token(token) == dtype
