"""Distinct string ids: the compiled kernel answers as its reference does (a hash match,
"maybe not distinct", is the only answer it may give where the reference says 1), and the
jobs runner decides such an answer exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.errors import ZephonConfigError
from zephon.jobs import runner
from zephon.kernels import ids_ref

compiled = pytest.importorskip("zephon._kernels.ids", reason="kernels not built")
IMPLS = {"compiled": compiled, "reference": ids_ref}


class _Str(str):
    pass


# a small alphabet makes equal items likely; every kind of str (1, 2 and 4 bytes per code
# point) and NUL, which NumPy's fixed-width strings would drop at the end
_text = st.text(alphabet=st.sampled_from(["a", "b", "\0", "é", "Ω", "😀"]), max_size=4)
_item = st.one_of(_text, _text.map(_Str), st.integers(0, 3), st.none())


@settings(max_examples=400, deadline=None)
@given(st.lists(_item, max_size=12))
def test_the_kernel_answers_as_its_reference_does(items):
    want = ids_ref.distinct_str_ids(items)
    assert compiled.distinct_str_ids(items) == want
    if want == -1:
        assert any(type(s) is not str or not s for s in items)
    else:
        assert want == (1 if len(set(items)) == len(items) else 0)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("where", [0, 1, 4095, 99_998])
def test_one_duplicate_among_many_is_found_wherever_it_is(impl, where):
    ids = [f"S{i:08d}" for i in range(100_000)]  # many parts of the kernel's partition
    assert IMPLS[impl].distinct_str_ids(ids) == 1
    ids[-1] = ids[where]
    assert IMPLS[impl].distinct_str_ids(ids) == 0


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_kinds_and_lengths_are_part_of_an_id(impl):
    # the same bytes in another kind, a NUL at the end, a prefix: all distinct
    ids = ["a", "a\0", "\0a", "aa", "é", "\xe9\0", "Ω", "😀", "a" * 1000, "a" * 1001]
    assert IMPLS[impl].distinct_str_ids(ids) == 1
    assert IMPLS[impl].distinct_str_ids([]) == 1
    assert IMPLS[impl].distinct_str_ids(["a", _Str("b")]) == -1
    assert IMPLS[impl].distinct_str_ids(["a", ""]) == -1
    assert IMPLS[impl].distinct_str_ids(["a", "a", 5]) == -1  # a bad item comes first


def test_a_hash_match_of_distinct_ids_is_decided_exactly(monkeypatch):
    import zephon.kernels

    monkeypatch.setattr(zephon.kernels, "distinct_str_ids", lambda ids: 0)
    ids = ["a", "b", "c"]
    assert runner._subject_ids(ids) is ids  # distinct: no error, the list itself
    with pytest.raises(ZephonConfigError, match=r"duplicate subject ids: \['b'\]"):
        runner._subject_ids(["a", "b", "c", "b"])


def test_ids_of_objects_are_checked_too():
    subjects = [{"subject_id": "x"}, {"subject_id": "y"}, "z"]
    assert runner._subject_ids(subjects) == ["x", "y", "z"]
    with pytest.raises(ZephonConfigError, match=r"duplicate subject ids: \['x'\]"):
        runner._subject_ids([{"subject_id": "x"}, "x"])
    with pytest.raises(ZephonConfigError, match="subject 1: subject_id must be"):
        runner._subject_ids(["a", ""])
