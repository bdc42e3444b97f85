"""batch() collates as torch's default_collate; one compute thread per worker; token dtypes.

- parity with ``torch.utils.data.default_collate`` over hypothesis-drawn sample
  structures (same structure, types modulo ndarray/Tensor, shapes, dtypes, values);
- what zephon does where torch raises (ragged arrays and None stay lists, unequal
  sequences are an OpError of the batch op), without importing torch;
- ``Pipeline.batch()`` of tuple samples end to end on every runner, fused and not;
- ``collate_fn=``: used, fingerprinted, validated.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict, namedtuple

import _collate_fns as F
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon import Pipeline, RuntimeOptions, sources
from zephon.errors import OpError, ValidationError, ZephonConfigError
from zephon.pipeline.collate import collate
from zephon.pipeline.ops import BatchOp
from zephon.pipeline.records import Batch, BatchList

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NT2 = namedtuple("NT2", ["a", "b"])
NT3 = namedtuple("NT3", ["a", "b", "c"])

DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32",
          "float64", "complex64"]


# -- parity with torch ---------------------------------------------------------------

def schemas(depth: int = 0):
    """A description of one sample structure: leaves and containers."""
    leaves = st.one_of(
        st.tuples(st.just("array"), st.sampled_from(DTYPES),
                  st.lists(st.integers(0, 3), max_size=3).map(tuple)),
        st.tuples(st.just("npscalar"), st.sampled_from(DTYPES)),
        st.tuples(st.just("int")), st.tuples(st.just("float")), st.tuples(st.just("bool")),
        st.tuples(st.just("str")), st.tuples(st.just("bytes")))
    if depth >= 3:
        return leaves
    inner = st.deferred(lambda: schemas(depth + 1))
    return st.one_of(
        leaves,
        st.tuples(st.just("dict"), st.dictionaries(st.text("abcxyz", min_size=1, max_size=3),
                                                   inner, min_size=1, max_size=3)),
        st.tuples(st.just("tuple"), st.lists(inner, min_size=1, max_size=3)),
        st.tuples(st.just("list"), st.lists(inner, min_size=1, max_size=3)),
        st.tuples(st.just("nt"), st.lists(inner, min_size=2, max_size=3)))


def draw_value(data, schema):
    kind = schema[0]
    if kind == "array":
        dtype, shape = np.dtype(schema[1]), schema[2]
        flat = data.draw(st.lists(st.integers(-100, 100), min_size=int(np.prod(shape)),
                                  max_size=int(np.prod(shape))))
        return np.array(flat, dtype=np.int64).astype(dtype).reshape(shape)
    if kind == "npscalar":
        return np.dtype(schema[1]).type(data.draw(st.integers(0, 100)))
    if kind == "int":
        return data.draw(st.integers(-(2**40), 2**40))
    if kind == "float":
        return data.draw(st.floats(-1e6, 1e6, allow_nan=False))
    if kind == "bool":
        return data.draw(st.booleans())
    if kind == "str":
        return data.draw(st.text(max_size=4))
    if kind == "bytes":
        return data.draw(st.binary(max_size=4))
    if kind == "dict":
        return {k: draw_value(data, v) for k, v in schema[1].items()}
    items = [draw_value(data, s) for s in schema[1]]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    return (NT2 if len(items) == 2 else NT3)(*items)


def assert_same_as_torch(ours, theirs, where="batch"):
    import torch

    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, np.ndarray), (where, type(ours))
        assert ours.shape == tuple(theirs.shape), where
        assert torch.from_numpy(np.ascontiguousarray(ours)).dtype == theirs.dtype, \
            (where, ours.dtype, theirs.dtype)
        assert np.array_equal(ours, theirs.numpy()), where
        return
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), where
        for key in theirs:
            assert_same_as_torch(ours[key], theirs[key], f"{where}[{key!r}]")
        return
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same_as_torch(a, b, f"{where}[{i}]")
        return
    assert ours == theirs, where


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), schema=schemas(), n=st.integers(1, 5))
def test_collate_is_default_collate_with_arrays_for_tensors(data, schema, n):
    torch = pytest.importorskip("torch")
    samples = [draw_value(data, schema) for _ in range(n)]
    ours = collate(samples)
    theirs = torch.utils.data.default_collate(samples)
    if isinstance(samples[0], dict):
        assert type(ours) is dict  # the top level of dict samples: batch() makes it a Batch
        theirs = dict(theirs)
    assert_same_as_torch(ours, theirs)


@pytest.mark.parametrize("samples", [
    [1, 2.5], [1.0, 2], [True, 2], [True, False], [np.int32(1), 5],
    [np.int32(1), np.int64(2)], [np.float32(1), np.float32(2)], [np.uint16(3), np.uint16(4)],
    [np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64)],
    [np.arange(3, dtype=np.float32), np.arange(3, dtype=np.int64)],
    [np.arange(3, dtype=np.uint8), np.arange(3, dtype=np.int8)],
    [np.array(1.5), np.array(2.5)], [np.float64(1.5), 2.5],
    [OrderedDict(a=1, b="x"), OrderedDict(a=2, b="y")],
    [{"a": {"b": (1, 2.0)}}, {"a": {"b": (3, 4.0)}}],
    [[np.zeros(2), "s"], [np.ones(2), "t"]], ["a", "b"], [b"a", b"b"],
], ids=repr)
def test_mixed_and_edge_columns_match_torch(samples):
    torch = pytest.importorskip("torch")
    ours, theirs = collate(samples), torch.utils.data.default_collate(samples)
    if isinstance(samples[0], dict):
        theirs = dict(theirs)
    assert_same_as_torch(ours, theirs)


# -- where torch raises --------------------------------------------------------------

def test_ragged_arrays_none_and_missing_keys_stay_lists_in_dict_columns():
    samples = [{"x": np.zeros(2), "opt": None, "k": 1}, {"x": np.zeros(3), "opt": 5}]
    out = collate(samples)
    assert isinstance(out["x"], list) and [a.shape for a in out["x"]] == [(2,), (3,)]
    assert out["opt"] == [None, 5]
    assert out["k"] == [1, None]  # a key the second sample lacks reads as None there


def test_ragged_arrays_stay_lists_inside_tuples_too():
    out = collate([(np.zeros(2), 1), (np.zeros(3), 2)])
    assert isinstance(out[0], list) and [a.shape for a in out[0]] == [(2,), (3,)]
    assert out[1].tolist() == [1, 2] and out[1].dtype == np.int64


def test_sequences_of_unequal_length_raise_naming_where():
    with pytest.raises(ZephonConfigError, match=r"sample 0 has 2 items, sample 1 has 1"):
        collate([(1, 2), (3,)])
    with pytest.raises(ZephonConfigError, match=r"the samples\[1\]: .*sample 0 has 2 items"):
        collate([(np.zeros(1), [1, 2]), (np.zeros(1), [3])])
    with pytest.raises(ZephonConfigError, match="sample 0 has a dict there, sample 1 a tuple"):
        collate([{"a": 1}, (1,)])


def test_lists_of_unequal_length_in_dict_columns_stay_lists():
    out = collate([{"ids": [1, 2], "tags": ["a"]}, {"ids": [3], "tags": None}])
    assert out["ids"] == [[1, 2], [3]] and out["tags"] == [["a"], None]
    even = collate([{"ids": [1, 2]}, {"ids": [3, 4]}])  # equal lengths: transposed, as torch
    assert [a.tolist() for a in even["ids"]] == [[1, 3], [2, 4]]


def test_collate_never_imports_torch():
    code = ("import sys, numpy as np; from zephon.pipeline.collate import collate; "
            "out = collate([(np.zeros(2), 1, 'a'), (np.ones(2), 2, 'b')]); "
            "assert out[0].shape == (2, 2); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_tensor_columns_are_stacked():
    torch = pytest.importorskip("torch")
    out = collate([{"t": torch.ones(2)}, {"t": torch.zeros(2)}])
    assert isinstance(out["t"], torch.Tensor) and out["t"].shape == (2, 2)
    ragged = collate([{"t": torch.ones(2)}, {"t": torch.zeros(3)}])
    assert isinstance(ragged["t"], list)


# -- batch() end to end --------------------------------------------------------------

def expected_tuple_batches(n: int, size: int) -> list:
    out = []
    for start in range(0, n, size):
        idx = list(range(start, min(n, start + size)))
        out.append((np.stack([np.full((2, 3), i, np.float32) for i in idx]),
                    [i % 5 for i in idx], idx))
    return out


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
@pytest.mark.parametrize("fused", [True, False])
def test_batch_of_tuples_on_every_runner(runner, fused):
    pipe = Pipeline(sources.from_callable(10, F.image_label), shuffle=False, chunk_size=64)
    if not fused:  # a filter in between: the batch is made by the serial accumulator
        pipe = pipe.filter(bool)
    pipe = pipe.batch(4).options(RuntimeOptions(runner=runner, max_workers=2))
    assert ("collated in the stage" in pipe.explain()) == fused
    got = list(pipe)
    want = expected_tuple_batches(10, 4)
    assert len(got) == len(want)
    for batch, (images, labels, idx) in zip(got, want, strict=True):
        assert type(batch) is BatchList and len(batch) == 2
        x, y = batch
        assert x.dtype == np.float32 and np.array_equal(x, images)
        assert y.dtype == np.int64 and y.tolist() == labels
        assert [i for _, i, _ in batch.meta["sample_ids"]] == idx


def test_batch_list_meta_has_lane_and_lane_index():
    pipe = Pipeline(sources.from_callable(8, F.image_label), shuffle=False).batch(4)
    got = [(b.meta.get("lane"), b.meta.get("lane_index")) for b in pipe]
    assert got == [(0, 0), (0, 1)]


def test_map_batch_of_a_batch_list_keeps_its_meta():
    pipe = Pipeline(sources.from_callable(4, F.image_label), shuffle=False).batch(2) \
        .map_batch(F.double_images)
    got = list(pipe)
    assert [type(b) for b in got] == [BatchList, BatchList]
    assert got[1][0][0, 0, 0] == 4.0 and got[1][1].tolist() == [2, 3]
    assert [i for _, i, _ in got[1].meta["sample_ids"]] == [2, 3]


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_namedtuple_samples_give_a_namedtuple_batch(runner):
    pipe = Pipeline(sources.from_callable(6, F.pair), shuffle=False).batch(3).options(
        RuntimeOptions(runner=runner, max_workers=2))
    got = list(pipe)
    assert [type(b) for b in got] == [F.Pair, F.Pair]
    assert got[1].image.dtype == np.int16 and got[1].image.tolist() == [[3, 3], [4, 4],
                                                                          [5, 5]]
    assert got[1].label.tolist() == [3, 4, 5]


def test_dict_batches_are_still_batches_with_lane_meta():
    src = sources.from_callable(6, lambda i: {"x": np.arange(3) + i, "name": f"s{i}"})
    got = list(Pipeline(src, shuffle=False).batch(3))
    assert [type(b) for b in got] == [Batch, Batch]
    assert got[0]["x"].shape == (3, 3) and got[0]["name"] == ["s0", "s1", "s2"]
    assert (got[1].meta["lane"], got[1].meta["lane_index"]) == (0, 1)


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_unequal_sequences_are_an_op_error_of_the_batch(runner):
    pipe = Pipeline(sources.from_callable(6, F.ragged_tuple), shuffle=False).batch(3).options(
        RuntimeOptions(runner=runner, max_workers=2))
    with pytest.raises(OpError, match=r"op batch failed on samples.*same length") as info:
        list(pipe)
    assert info.value.op == "batch"


def test_variable_length_list_fields_batch_as_lists():
    got = list(Pipeline(sources.from_callable(6, F.ragged_list), shuffle=False).batch(3))
    assert [b["ids"] for b in got] == [[[0], [0, 1], [0, 1, 2]]] * 2


# -- collate_fn ----------------------------------------------------------------------

@pytest.mark.parametrize("runner", ["inline", "process"])
@pytest.mark.parametrize("fused", [True, False])
def test_collate_fn_makes_the_batches(runner, fused):
    pipe = Pipeline(sources.from_callable(6, F.image_label), shuffle=False)
    if not fused:
        pipe = pipe.filter(bool)
    pipe = pipe.batch(3, collate_fn=F.sum_collate).options(
        RuntimeOptions(runner=runner, max_workers=2))
    got = list(pipe)
    assert [type(b) for b in got] == [Batch, Batch]
    assert [b["total"] for b in got] == [6.0 * (0 + 1 + 2), 6.0 * (3 + 4 + 5)]
    assert got[1]["labels"] == [3, 4, 0]
    assert [i for _, i, _ in got[1].meta["sample_ids"]] == [3, 4, 5]


def test_collate_fn_is_part_of_the_fingerprint_and_checked():
    src = sources.from_callable(6, F.image_label)
    plain = Pipeline(src, shuffle=False).batch(3)
    custom = Pipeline(src, shuffle=False).batch(3, collate_fn=F.sum_collate)
    assert BatchOp(3).describe() == "batch(3, drop_last=False)"  # unchanged without one
    assert "collate_fn=_collate_fns.sum_collate" in BatchOp(3, collate_fn=F.sum_collate) \
        .describe()
    assert plain.fingerprint() != custom.fingerprint()
    assert custom.fingerprint() == Pipeline(src, shuffle=False).batch(
        3, collate_fn=F.sum_collate).fingerprint()
    with pytest.raises(ZephonConfigError, match="collate_fn must be callable"):
        plain.batch(3, collate_fn="stack")


def test_a_collate_fn_that_fails_is_an_op_error_naming_it():
    def broken(values):
        raise KeyError("nope")

    pipe = Pipeline(sources.from_callable(4, F.image_label), shuffle=False).batch(
        2, collate_fn=broken)
    with pytest.raises(OpError, match=r"batch\(collate_fn=.*broken\) failed.*KeyError"):
        list(pipe)


def test_an_unpicklable_collate_fn_is_refused_for_the_process_runner():
    pipe = Pipeline(sources.from_callable(4, F.image_label), shuffle=False).batch(
        2, collate_fn=lambda values: values).options(RuntimeOptions(runner="process",
                                                                    max_workers=2))
    with pytest.raises(ValidationError, match=r"Z001.*batch"):
        list(pipe)
