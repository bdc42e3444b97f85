"""The columnar read of a Parquet source gives exactly the batches of the row-by-row read:
same columns, dtypes, shapes and values, for every column kind, order and runner."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import _pipeline_fns as F  # noqa: E402
from zephon import Pipeline, RuntimeOptions, sources  # noqa: E402
from zephon.pipeline.ops import collate  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("pq")
    rng = np.random.default_rng(1)
    for f in range(3):
        n = 50 + 7 * f
        ids = np.arange(n, dtype=np.int64) + 1000 * f
        ragged = [list(range(int(k % 4))) for k in ids]
        table = pa.table({
            "id": ids,
            "score": rng.random(n).astype(np.float32),
            "flag": (ids % 3 == 0),
            "vec": pa.array([list(range(int(k), int(k) + 4)) for k in ids],
                            type=pa.list_(pa.int32())),
            "ragged": pa.array(ragged, type=pa.list_(pa.int64())),
            "text": [f"row {k}" for k in ids],
            "maybe": pa.array([None if k % 5 == 0 else int(k) for k in ids], type=pa.int64()),
        })
        pq.write_table(table, d / f"part-{f}.parquet", row_group_size=16)
    return d


def same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and \
            a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), shuffle=st.booleans())
def test_get_batch_equals_collating_rows(corpus, data, shuffle):
    src = sources.parquet(str(corpus / "*.parquet"), shuffle=shuffle, seed=3)
    indices = data.draw(st.lists(st.integers(0, len(src) - 1), min_size=1, max_size=40))
    got = src.get_batch(np.asarray(indices))
    want = collate([src.get(i) for i in indices])
    assert list(got) == list(want)
    for key in want:
        assert same(got[key], want[key]), key


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_a_read_batch_pipeline_equals_the_row_by_row_one(corpus, runner):
    def run(pipe):
        return [(b.meta["lane"], b.meta["lane_index"], b.meta["sample_ids"], b["id"].tolist(),
                 b["vec"].tolist(), b["text"]) for b in pipe]

    src = sources.parquet(str(corpus / "*.parquet"), columns=["id", "vec", "text"])
    opts = RuntimeOptions(runner=runner, max_workers=2, canonical_replicas=2)
    columnar = Pipeline(src, seed=4, chunk_size=8).batch(5).options(opts)
    rows = Pipeline(src, seed=4, chunk_size=8).map(F.identity).batch(5).options(opts)
    assert run(columnar) == run(rows)
