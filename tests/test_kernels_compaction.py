"""Compaction planning: kernel == reference; extents for any strides; refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.kernels import COMPACT, FORWARD, INLINE, byte_extent, compaction_ref

compiled = pytest.importorskip("zephon._kernels.compaction", reason="kernels not built")
IMPLS = {"compiled": compiled, "reference": compaction_ref}


@st.composite
def views(draw):
    n_regions = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(0, 5000), min_size=n_regions, max_size=n_regions))
    region_ids = draw(st.lists(st.integers(-3, 1 << 40), min_size=n_regions,
                               max_size=n_regions, unique=True))
    rows = []
    for _ in range(draw(st.integers(0, 40))):
        r = draw(st.integers(0, n_regions - 1))
        a = draw(st.integers(0, sizes[r]))
        b = draw(st.integers(a, sizes[r]))
        rows.append((region_ids[r], sizes[r], a, b))
    return rows


policy = st.fixed_dictionaries({
    "min_forward_bytes": st.integers(0, 3000),
    "compact_above_ratio": st.one_of(st.none(), st.floats(1.0, 20.0)),
    "compact_min_savings_bytes": st.integers(0, 4000),
})


def plan(impl, rows, pol):
    cols = list(zip(*rows)) if rows else [[], [], [], []]
    return impl.compaction_plan(*cols, **pol)


@settings(max_examples=400, deadline=None)
@given(views(), policy)
def test_kernel_equals_reference(rows, pol):
    assert plan(compiled, rows, pol) == plan(compaction_ref, rows, pol)


@settings(max_examples=200, deadline=None)
@given(views(), policy)
def test_useful_bytes_are_the_union_and_decisions_follow_the_rules(rows, pol):
    result = plan(compiled, rows, pol).as_dict()
    assert sorted(result) == sorted({r[0] for r in rows})
    for rid, (useful, decision) in result.items():
        covered = set()
        for r, size, a, b in rows:
            if r == rid:
                covered.update(range(a, b))
                region_size = size
        assert useful == len(covered)
        ratio = pol["compact_above_ratio"]
        if useful < pol["min_forward_bytes"]:
            assert decision == "inline"
        elif ratio is not None and region_size > useful * ratio and \
                region_size - useful >= pol["compact_min_savings_bytes"]:
            assert decision == "compact"
        else:
            assert decision == "forward"


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_worked_example(impl):
    m = IMPLS[impl]
    mib = 1 << 20
    # region 7: 64 MiB with one 1 MiB view -> compact; region 3: two overlapping views
    # [0, 200 KiB) and [100 KiB, 300 KiB) of a 1 MiB region -> 300 KiB useful -> forward;
    # region 9: a 4 KiB view -> inline.
    out = m.compaction_plan(
        [7, 3, 3, 9], [64 * mib, mib, mib, mib],
        [0, 0, 100 << 10, 0], [mib, 200 << 10, 300 << 10, 4096],
        min_forward_bytes=128 << 10, compact_above_ratio=8.0,
        compact_min_savings_bytes=16 * mib)
    assert out.as_dict() == {3: (300 << 10, "forward"), 7: (mib, "compact"),
                             9: (4096, "inline")}
    assert out.decision.tolist() == [FORWARD, COMPACT, INLINE]
    disabled = m.compaction_plan([7], [64 * mib], [0], [mib], min_forward_bytes=0,
                                 compact_above_ratio=None, compact_min_savings_bytes=0)
    assert disabled.as_dict() == {7: (mib, "forward")}


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_refused_inputs(impl):
    m = IMPLS[impl]
    pol = dict(min_forward_bytes=0, compact_above_ratio=8.0, compact_min_savings_bytes=0)
    with pytest.raises(ValueError, match="same length"):
        m.compaction_plan([1, 2], [10], [0], [1], **pol)
    with pytest.raises(ValueError, match="not inside"):
        m.compaction_plan([1], [10], [5], [11], **pol)
    with pytest.raises(ValueError, match="not inside"):
        m.compaction_plan([1], [10], [6], [5], **pol)
    with pytest.raises(ValueError, match="not inside"):
        m.compaction_plan([1], [10], [-1], [5], **pol)
    with pytest.raises(ValueError, match="two sizes"):
        m.compaction_plan([1, 1], [10, 20], [0, 0], [5, 5], **pol)
    for bad in (dict(min_forward_bytes=-1), dict(compact_above_ratio=0.5),
                dict(compact_above_ratio=float("nan")), dict(compact_min_savings_bytes=-2),
                dict(min_forward_bytes=True)):
        with pytest.raises(ValueError):
            m.compaction_plan([1], [10], [0], [5], **{**pol, **bad})


@st.composite
def strided_views(draw):
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    itemsize = draw(st.sampled_from([1, 2, 4, 8, 16]))
    strides = draw(st.lists(st.integers(-64, 64), min_size=len(shape), max_size=len(shape)))
    offset = draw(st.integers(0, 1000))
    return offset, tuple(shape), tuple(strides), itemsize


@settings(max_examples=500, deadline=None)
@given(strided_views())
def test_byte_extent_covers_exactly_the_touched_bytes(view):
    offset, shape, strides, itemsize = view
    lo, hi = byte_extent(offset, shape, strides, itemsize)
    starts = [offset + sum(i * s for i, s in zip(index, strides))
              for index in itertools.product(*[range(n) for n in shape])]
    if not starts:
        assert lo == hi
        return
    assert lo == min(starts) and hi == max(starts) + itemsize


def test_byte_extent_of_real_numpy_views():
    region = np.zeros(4096, dtype=np.uint8)
    base = region.view(np.float64).reshape(32, 16)
    for view in (base[3:9, ::-2], base.T[::3], base[::-1, 5], base[4:4], base[2, 3, ...]):
        assert view.size == 0 or np.shares_memory(view, region)
        offset = view.__array_interface__["data"][0] - region.ctypes.data
        lo, hi = byte_extent(offset, view.shape, view.strides, view.itemsize)
        touched = np.zeros(4096, dtype=bool)
        for idx in np.ndindex(view.shape):
            start = offset + sum(i * s for i, s in zip(idx, view.strides))
            touched[start:start + view.itemsize] = True
        if view.size:
            assert lo == np.flatnonzero(touched)[0] and hi == np.flatnonzero(touched)[-1] + 1
        else:
            assert lo == hi and not touched.any()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2**20), st.integers(0, 2**20)),
                min_size=1, max_size=30), policy)
def test_huge_regions_take_the_lexsort_fallback_and_agree(rows, pol):
    # Regions near 2**62 bytes make rank * (max_size + 1) overflow int64, so the kernel
    # must order with lexsort instead; the answer must not change.
    huge = (1 << 62) - 1
    full = [(rid, huge, (1 << 61) + min(a, b), (1 << 61) + max(a, b)) for rid, a, b in rows]
    assert plan(compiled, full, pol) == plan(compaction_ref, full, pol)
