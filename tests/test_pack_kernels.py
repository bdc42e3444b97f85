"""Document-packing kernels: compiled == reference on random inputs, and the reference's
own rules (first fit, best fit, bounded bins, row layout)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.kernels import pack_docs_ref as ref

compiled = pytest.importorskip("zephon._kernels.pack_docs", reason="kernels not built")


@st.composite
def placements(draw):
    seq_len = draw(st.integers(2, 40))
    max_bins = draw(st.integers(1, 6))
    fills = draw(st.lists(st.integers(1, seq_len - 1), max_size=max_bins))
    lengths = draw(st.lists(st.integers(1, seq_len - 1), max_size=60))
    return lengths, fills, seq_len, max_bins, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(placements())
def test_fit_place_compiled_equals_reference(args):
    want, got = ref.fit_place(*args), compiled.fit_place(*args)
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])


@settings(max_examples=200, deadline=None)
@given(placements())
def test_fit_place_never_overfills_and_bounds_the_open_bins(args):
    lengths, fills, seq_len, max_bins, _ = args
    target, closed = ref.fit_place(*args)
    fill = dict(enumerate(fills))
    for n, t, c in zip(lengths, target.tolist(), closed.tolist(), strict=True):
        if c >= 0 and c != t:  # an eviction happens before the document is placed
            fill.pop(c)
        fill[t] = fill.get(t, 0) + n
        assert fill[t] <= seq_len and len(fill) <= max_bins
        if c == t:
            assert fill.pop(t) == seq_len  # a bin closes after it by filling exactly


def test_first_fit_takes_the_first_bin_and_best_fit_the_fullest():
    # open bins of 2 and 5 tokens (seq_len 8); a document of 3 fits both
    assert ref.fit_place([3], [2, 5], 8, 4, False)[0].tolist() == [0]
    assert ref.fit_place([3], [2, 5], 8, 4, True)[0].tolist() == [1]
    assert ref.fit_place([3], [2, 5], 8, 4, True)[1].tolist() == [1]  # 5 + 3 fills it


def test_a_full_set_of_bins_closes_its_fullest_for_a_document_that_fits_none():
    target, closed = ref.fit_place([7], [6, 3], 8, 2, False)
    assert target.tolist() == [2] and closed.tolist() == [0]


@pytest.mark.parametrize("impl", [ref, compiled])
def test_fit_place_refuses_bad_arguments(impl):
    with pytest.raises(ValueError, match="outside"):
        impl.fit_place([8], [], 8, 2, False)  # a whole row never reaches a bin
    with pytest.raises(ValueError, match="max_bins"):
        impl.fit_place([1], [1, 1, 1], 8, 2, False)
    with pytest.raises(ValueError, match="seq_len"):
        impl.fit_place([1], [], 1, 2, False)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64).flatmap(lambda s: st.tuples(
    st.just(s), st.lists(st.integers(1, 8), max_size=12).filter(lambda v: sum(v) <= s))))
def test_segment_layout_compiled_equals_reference_and_restarts_positions(args):
    seq_len, lengths = args
    positions, cu = ref.segment_layout(lengths, seq_len)
    got = compiled.segment_layout(lengths, seq_len)
    assert np.array_equal(positions, got[0]) and np.array_equal(cu, got[1])
    assert positions.dtype == cu.dtype == np.int32 and cu.shape == (seq_len + 1,)
    assert cu[:len(lengths) + 1].tolist() == [0, *np.cumsum(lengths, dtype=int).tolist()]
    assert (cu[len(lengths) + 1:] == ref.CU_SENTINEL).all()
    want = [p for n in lengths for p in range(n)]
    assert positions.tolist() == want + [0] * (seq_len - len(want))


@pytest.mark.parametrize("impl", [ref, compiled])
def test_segment_layout_refuses_rows_that_do_not_fit(impl):
    with pytest.raises(ValueError, match="exceed"):
        impl.segment_layout([3, 3], 5)
    with pytest.raises(ValueError, match="segment of 0"):
        impl.segment_layout([0], 5)
