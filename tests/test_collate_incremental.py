"""Collator: collating samples as they come gives exactly what collate() gives.

- over hypothesis-drawn sample structures (tests/test_collate.py's schemas), with a
  second structure mixed in part way (arrays that stop agreeing, keys that go missing,
  samples that are no dict), and a batch size above, at or below the number added;
- the errors collate() raises, raised the same by result();
- the batch's arrays are copies: writing to a sample after it was added changes
  nothing, and a column of agreeing arrays is one array made for the batch;
- a fused read -> map -> batch stage on every runner streams its samples collated.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_collate import draw_value, schemas

from zephon import Pipeline, RuntimeOptions, sources
from zephon.pipeline.collate import Collator, collate


def assert_same(ours, theirs, where="batch"):
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
        assert np.array_equal(ours, theirs, equal_nan=ours.dtype.kind in "fc"), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


def incremental(samples, size, arrays_first=False):
    """The collator fed as a fused stage feeds it: with ``arrays_first``, each sample is
    offered to ``add_arrays`` first (taken when every field is a numeric array that goes
    into its row) and ``add``-ed only when refused."""
    c = Collator(size)
    for s in samples:
        if not (arrays_first and c.add_arrays(s)):
            c.add(s)
    return c.result()


def outcome(make):
    try:
        return make(), None
    except Exception as exc:  # noqa: BLE001 - compared: the same type and message
        return None, (type(exc), str(exc))


def check(samples, size):
    want, want_error = outcome(lambda: collate(list(samples)))
    for arrays_first in (False, True):
        got, got_error = outcome(lambda a=arrays_first: incremental(samples, size, a))
        assert got_error == want_error
        if want_error is None:
            assert_same(got, want)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), first=schemas(), other=schemas(), n=st.integers(1, 6),
       switch=st.integers(0, 7), slack=st.integers(-2, 2))
def test_the_collator_is_collate(data, first, other, n, switch, slack):
    samples = [draw_value(data, first if i < switch else other) for i in range(n)]
    check(samples, max(1, n + slack))


def _img(v, shape=(3, 4, 4), dtype=np.float32):
    return np.full(shape, v, dtype=dtype)


@pytest.mark.parametrize("samples", [
    [{"x": _img(i), "y": i} for i in range(5)],
    [{"x": _img(0)}, {"x": _img(1)}, {"x": _img(2, (3, 4, 5))}],  # ragged from the third
    [{"x": _img(0)}, {"x": _img(1, dtype=np.float64)}],  # promoted
    [{"x": _img(0, dtype=np.int32)}, {"x": _img(1, dtype=np.float32)}],
    [{"x": _img(0)}, {"y": _img(1)}],  # a missing key reads as None
    [{"x": _img(0)}, {"x": None}],
    [{"x": np.array(1.5)}, {"x": np.array(2.5)}],  # 0-d arrays
    [{"x": _img(0, dtype=">f4")}, {"x": _img(1, dtype=">f4")}],  # not native
    [{"x": _img(0)}, {"x": _img(1).view(np.memmap)}],  # a subclass
    [{"x": np.array(["a", "b"])}, {"x": np.array(["c", "d"])}],
    [{"x": _img(0), "s": "a"}, {"x": _img(1), "s": "b"}],
    [{}, {}],
], ids=lambda s: f"{len(s)}_samples")
@pytest.mark.parametrize("slack", [-1, 0, 2])
def test_edge_columns(samples, slack):
    check(samples, max(1, len(samples) + slack))


@pytest.mark.parametrize("samples", [
    [{"x": _img(0)}, [1, 2]],  # a sample that is no dict: collate's error
    [{"x": _img(0)}, {"x": _img(1)}, 5],
    [(1, [1, 2]), (2, [1])],
], ids=["dict_then_list", "dicts_then_int", "unequal_sequences"])
def test_collates_errors_are_raised_by_result(samples):
    _, error = outcome(lambda: collate(samples))
    assert error is not None
    check(samples, len(samples))


def test_the_batch_copies_each_sample_when_it_is_added():
    c = Collator(3)
    samples = [{"x": _img(i)} for i in range(3)]
    for s in samples:
        c.add(s)
        s["x"].fill(-1)  # the op writes to its array after it returned it
    out = c.result()["x"]
    assert out.shape == (3, 3, 4, 4) and out.base is None
    assert [float(out[i].max()) for i in range(3)] == [0.0, 1.0, 2.0]


def test_a_short_batch_owns_its_memory():
    c = Collator(4)
    c.add({"x": _img(1)})
    out = c.result()["x"]
    assert out.shape == (1, 3, 4, 4) and out.base is None


def _sample(i):
    return {"x": np.full((2, 3), i, dtype=np.float32), "i": i}


def _reshape_late(s):
    if s["i"] % 7 == 6:  # some batches turn ragged part way
        return {"x": np.full((2, 4), s["i"], dtype=np.float32), "i": s["i"]}
    return s


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_a_fused_stage_streams_the_collated_samples(runner):
    opts = RuntimeOptions(runner=runner, max_workers=2)
    pipe = Pipeline(sources.from_callable(40, _sample), seed=1).map(_reshape_late)
    samples = list(pipe.options(opts))
    got = list(pipe.batch(5).options(opts))
    assert len(got) == 8
    for k, batch in enumerate(got):
        assert_same(dict(batch), collate(samples[5 * k:5 * k + 5]))


def test_arrays_taken_whole_are_copied_and_anything_else_is_refused():
    buffer = np.arange(8, dtype=np.int64)
    c = Collator(3)
    assert c.add_arrays({"x": buffer[:-1], "y": buffer[1:]})  # views of one array: copied
    buffer[:] = -1  # the op reuses its buffer: the batch does not see it
    assert not c.add_arrays({"x": buffer[:-1], "y": 7})  # a plain value: add() it
    assert not c.add_arrays({"x": buffer[:-1]})  # another set of keys
    assert not c.add_arrays({"x": buffer[:-2], "y": buffer[2:]})  # another shape
    c.add({"x": buffer[:-1], "y": 7})
    assert not c.add_arrays({"x": buffer[:-1], "y": buffer[1:]})  # a list column now
    out = c.result()
    assert out["x"][0].tolist() == list(range(7))
    assert Collator(1).add_arrays({}) and not Collator(1).add_arrays([buffer])


def test_the_collator_keeps_no_reference_to_its_result():
    import weakref

    c = Collator(2)
    c.add({"x": _img(0)})
    c.add({"x": _img(1)})
    out = c.result()
    ref = weakref.ref(out["x"])
    del out
    assert ref() is None  # (a worker's heap sends an array nothing else holds)
