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
from _resume import assert_resumes, passes  # noqa: E402
from _streams import keys_of  # noqa: E402

from zephon import Pipeline, RuntimeOptions, sources  # noqa: E402
from zephon.pipeline.collate import collate  # noqa: E402


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
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_a_shuffled_source_serves_each_row_once_where_locate_says(corpus):
    # shuffle=True stores each decoded row group in its seeded order; get(i) must still be
    # the file's row that locate(i) names, and every row must come out exactly once.
    src = sources.parquet(str(corpus / "*.parquet"), columns=["id", "text"], shuffle=True,
                          seed=5)
    files = sorted(corpus.glob("*.parquet"))
    seen = []
    for i in range(len(src)):
        f, g, j = src.locate(i)
        direct = pq.ParquetFile(files[f]).read_row_group(g, columns=["id"]).column(0)
        row = src.get(i)
        assert int(row["id"]) == direct[j].as_py() and row["text"] == f"row {row['id']}"
        seen.append(int(row["id"]))
    assert sorted(seen) == sorted(int(k) for f in files
                                  for k in pq.read_table(f, columns=["id"]).column(0).to_pylist())
    assert seen != sorted(seen)  # it is shuffled


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


# -- several micro-batches per message (process runner) ------------------------------------------
def batch_key(b):
    return (b.meta["lane"], b.meta["lane_index"], list(b.meta["sample_ids"]),
            {k: (v.dtype.str, v.shape, v.tolist()) if isinstance(v, np.ndarray) else
             [(x.dtype.str, x.tolist()) if isinstance(x, np.ndarray) else x for x in v]
             for k, v in b.items()})


GROUPED = RuntimeOptions(runner="process", max_workers=2, worker_allocation="per_stage_fixed",
                         canonical_replicas=2, op_queue_capacity=16)


@pytest.mark.parametrize("source_shuffle,pipe_shuffle", [(False, False), (True, True)])
def test_grouped_batches_equal_the_inline_stream(corpus, source_shuffle, pipe_shuffle):
    """Batches read a group at a time in workers (one columnar read per message) are the
    inline stream: same batches, dtypes, ids, lanes; every column kind, including columns
    that stack in one batch and not in another (nulls, ragged lists)."""
    from zephon.pipeline.engine import Plan
    from zephon.pipeline.program import batches_per_message

    src = sources.parquet(str(corpus / "*.parquet"), shuffle=source_shuffle, seed=5)
    pipe = Pipeline(src, seed=4, chunk_size=6, shuffle=pipe_shuffle, num_epochs=2).batch(5)
    assert batches_per_message(src, 5, Plan(pipe.spec, GROUPED).stages[0]) == 8
    inline = keys_of(pipe.options(RuntimeOptions(runner="inline", canonical_replicas=2)),
                     batch_key)
    assert keys_of(pipe.options(GROUPED), batch_key) == inline
    assert any(isinstance(b[3]["maybe"], tuple) for b in inline)  # stacked in some batches
    assert any(isinstance(b[3]["maybe"], list) for b in inline)  # a list in others


@pytest.mark.parametrize("source_shuffle", [False, True])
def test_grouped_resume_mid_row_group(corpus, source_shuffle):
    """A checkpoint taken after a few grouped batches (mid row group, mid message) restores
    to exactly the rest of the stream, on another runner and on the same one."""
    src = sources.parquet(str(corpus / "*.parquet"), columns=["id", "vec", "text"],
                          shuffle=source_shuffle, seed=2)
    pipe = Pipeline(src, seed=7, chunk_size=4, shuffle=True).batch(3)
    expected, following = passes(lambda: pipe.options(RuntimeOptions(
        runner="inline", canonical_replicas=2)), 2, batch_key)
    for opts in (RuntimeOptions(runner="inline", canonical_replicas=2), GROUPED):
        assert_resumes(lambda: pipe.options(GROUPED), 7, key=batch_key, reference=expected,
                       following=following, again=lambda opts=opts: pipe.options(opts))


def test_a_group_is_read_once_and_cut_into_views(corpus):
    """The grouped path reads a message's batches with one columnar read and cuts the
    pickled group back into batches whose arrays are views of one array per column."""
    import pickle

    from zephon.pipeline.lanes import BatchGroup, ReadUnit
    from zephon.pipeline.program import StageProgram

    src = sources.parquet(str(corpus / "*.parquet"), columns=["id", "maybe", "text"])
    calls = []

    class Counting(type(src)):
        def get_batch(self, indices):
            calls.append(len(indices))
            return super().get_batch(indices)

    counting = pickle.loads(pickle.dumps(src))
    counting.__class__ = Counting
    program = StageProgram(counting, [[]], 0, [True])
    units = [ReadUnit(0, 4 * k, np.arange(4 * k, 4 * k + 4)) for k in range(5)]
    grouped = pickle.loads(pickle.dumps(program((0, BatchGroup(units)))))
    assert calls == [20]
    single = [r for u in units for r in StageProgram(src, [[]], 0, [True])((0, u))]
    assert [r.pos for r in grouped] == [r.pos for r in single]
    for g, s in zip(grouped, single, strict=True):
        assert g.ids == s.ids == g.value.meta["sample_ids"]
        assert list(g.value) == list(s.value)
        assert all(same(g.value[k], s.value[k]) for k in s.value)
    bases = {id(r.value["id"].base) for r in grouped}
    assert len(bases) == 1  # views of one array


def test_sample_ids_pickle_compactly_and_stay_a_list():
    import pickle

    from zephon.pipeline.columnar import SampleIds

    ids = SampleIds("pq", np.arange(1000, 1256), 3)
    assert ids == [("pq", i, 3) for i in range(1000, 1256)]
    back = pickle.loads(pickle.dumps(ids))
    assert isinstance(back, list) and back == ids and list(back) == list(ids)
    _, args = SampleIds("pq", np.arange(3), 3).__reduce__()
    assert [type(a) for a in args] == [str, bytes, int]  # not one object per sample
    ids[0] = ("changed", 0, 0)  # a changed list travels as what it now holds
    assert pickle.loads(pickle.dumps(ids))[0] == ("changed", 0, 0)


def test_grouped_units_never_cross_a_boundary():
    from zephon.pipeline.lanes import BatchGroup, ReadUnit, grouped_units
    from zephon.pipeline.records import Boundary

    units = [Boundary(0, 0), *[ReadUnit(0, k, np.arange(k, k + 1)) for k in range(5)],
             Boundary(1, 0), ReadUnit(1, 0, np.arange(1))]
    out = list(grouped_units(iter(units), 2))
    kinds = [type(u).__name__ for u in out]
    assert kinds == ["Boundary", "BatchGroup", "BatchGroup", "ReadUnit", "Boundary",
                     "ReadUnit"]
    flat = [u for x in out if not isinstance(x, Boundary)
            for u in (x.units if isinstance(x, BatchGroup) else [x])]
    assert [u.start for u in flat] == [0, 1, 2, 3, 4, 0]
    assert list(grouped_units(iter(units), 1)) == units


def test_grouped_units_ramp_up_to_the_group_size():
    """The first groups of a lane are small (the first batches arrive early), then full."""
    from zephon.pipeline.lanes import BatchGroup, ReadUnit, grouped_units

    units = [ReadUnit(0, k, np.arange(k, k + 1)) for k in range(30)]
    out = list(grouped_units(iter(units), 8, first=2))
    assert [len(g.units) for g in out] == [2, 4, 8, 8, 8]
    assert all(isinstance(g, BatchGroup) for g in out)
    assert [u.start for g in out for u in g.units] == list(range(30))
    assert [len(g.units) if isinstance(g, BatchGroup) else 1
            for g in grouped_units(iter(units[:3]), 8, first=1)] == [1, 2]


def test_sample_ids_behave_as_a_list_before_and_after_first_use():
    """Sample ids are made on first use; every way of reading the list sees them, and a
    mutation before any read applies to the made list."""
    import copy
    import json
    import pickle

    from zephon.pipeline.columnar import SampleIds

    want = [("s", i, 1) for i in range(5, 9)]

    def fresh():
        return SampleIds("s", np.arange(5, 9), 1)

    assert len(fresh()) == 4 and bool(fresh())
    assert fresh()[0] == want[0] and fresh()[-1] == want[-1] and fresh()[1:3] == want[1:3]
    assert list(fresh()) == want and list(reversed(fresh())) == want[::-1]
    assert want[2] in fresh() and ("s", 99, 1) not in fresh()
    assert fresh() == want and want == fresh() and not (fresh() != want)
    assert fresh() + [1] == [*want, 1] and [1, *fresh()] == [1, *want]  # noqa: RUF005
    assert tuple(fresh()) == tuple(want) and sorted(fresh()) == want
    assert fresh().index(want[1]) == 1 and fresh().count(want[0]) == 1
    assert repr(fresh()) == repr(want) and str(fresh()) == str(want)
    assert json.loads(json.dumps(fresh())) == [list(t) for t in want]
    assert np.asarray(fresh(), dtype=object).shape == (4, 3)
    assert copy.copy(fresh()) == want and copy.deepcopy(fresh()) == want
    ids = fresh()
    ids.append(("x", 0, 0))  # a mutation first makes the list, then applies
    assert ids == [*want, ("x", 0, 0)]
    assert pickle.loads(pickle.dumps(ids)) == [*want, ("x", 0, 0)]
    ids = fresh()
    ids[1] = ("y", 1, 1)
    assert ids[1] == ("y", 1, 1) and len(ids) == 4
    assert pickle.loads(pickle.dumps(fresh())) == want
    with pytest.raises(TypeError):
        hash(fresh())


def test_batch_run_ships_columns_without_making_its_records():
    """A worker that only pickles a BatchRun never makes its records; the receiving side
    gets the same batches as a run made in place."""
    import pickle

    from zephon.pipeline.columnar import BatchRun

    run = BatchRun({"x": np.arange(10)}, "src", np.arange(100, 110), 0, [4, 4, 2], [0, 4, 8])
    assert run._recipe is not None
    back = pickle.loads(pickle.dumps(run))
    assert run._recipe is not None  # pickling did not make the records
    made = list(run)
    assert [r.pos for r in back] == [r.pos for r in made] == [(0, 3), (0, 7), (0, 9)]
    for a, b in zip(back, made, strict=True):
        assert a.ids == b.ids == b.value.meta["sample_ids"]
        assert (a.value["x"] == b.value["x"]).all()
    assert back[2].ids == [("src", 108, 0), ("src", 109, 0)]


def test_users_get_plain_sample_id_lists(tmp_path):
    """``Batch.meta`` hands out plain lists (C code that reads a list's storage directly,
    such as ``[] + ids`` or ``sum(lists, [])``, sees every id), made only when read."""
    import pickle

    from zephon.pipeline.columnar import SampleIds
    from zephon.pipeline.records import Batch

    ids = SampleIds("s", np.arange(3), 0)
    batch = Batch({"x": np.arange(3)}, meta={"sample_ids": ids, "lane": 0})
    assert pickle.loads(pickle.dumps(batch))._meta["sample_ids"]._recipe is not None
    assert type(batch.meta["sample_ids"]) is list
    assert [] + batch.meta["sample_ids"] == [("s", 0, 0), ("s", 1, 0), ("s", 2, 0)]
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"v": np.arange(1000)}), tmp_path / "a.parquet",
                   row_group_size=300)
    pipe = Pipeline(sources.parquet(str(tmp_path)), shuffle=False, chunk_size=100).batch(100)
    opts = RuntimeOptions(runner="process", max_workers=2, worker_allocation="per_stage_fixed")
    with iter(pipe.options(opts)) as it:
        got = [b.meta["sample_ids"] for b in it]
    assert all(type(g) is list for g in got)
    assert sum(got, []) == [("parquet", i, 0) for i in range(1000)]  # noqa: RUF017


def test_explain_says_what_a_pipeline_shuffle_costs_over_parquet(tmp_path):
    """The default Pipeline(shuffle=True) over Parquet gathers each batch from all over the
    row groups; explain() says so and names the cheap alternative, and only then."""
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"v": np.arange(1000)}), tmp_path / "a.parquet",
                   row_group_size=100)
    src = sources.parquet(str(tmp_path))
    text = Pipeline(src).batch(10).explain()
    assert "note: Pipeline(shuffle=True) draws each batch's rows from all over the 10 " \
           "row groups" in text and "sources.parquet(..., shuffle=True)" in text
    assert "exceed row_group_cache_bytes" not in text
    small_cache = sources.parquet(str(tmp_path), row_group_cache_bytes=1000)
    assert "exceed row_group_cache_bytes" in Pipeline(small_cache).batch(10).explain()
    assert "note:" not in Pipeline(src, shuffle=False).batch(10).explain()
    assert "note:" not in Pipeline(sources.from_sequence(list(range(9)))).explain()


def test_sample_ids_made_once_when_threads_read_them_at_once():
    """Several threads reading a new list at the same moment make its items once."""
    import threading

    from zephon.pipeline.columnar import SampleIds

    for _ in range(100):
        ids = SampleIds("s", np.arange(5000), 0)
        start = threading.Barrier(4)
        lengths = []

        def read(ids=ids, start=start, lengths=lengths):
            start.wait()
            lengths.append(len(ids))

        threads = [threading.Thread(target=read) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert lengths == [5000] * 4 and len(ids) == 5000


def test_batch_meta_may_be_replaced_by_anything():
    from zephon.pipeline.records import Batch

    batch = Batch({"x": np.arange(2)}, meta={"lane": 0})
    batch.meta = None
    assert batch.meta is None and "meta=None" in repr(batch)
    batch.meta = {"k": [1]}
    assert batch.meta == {"k": [1]}


def test_an_op_error_after_a_columnar_batch_names_its_samples_in_a_plain_list(tmp_path):
    """The ids an OpError carries out of a worker are a plain list (a lazily made list
    crossing a process must not come out empty to C code such as ``[] + ids``)."""
    import pickle

    from zephon import OpError

    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"v": np.arange(40)}), tmp_path / "a.parquet")
    opts = RuntimeOptions(runner="process", max_workers=2, worker_allocation="per_stage_fixed")
    pipe = Pipeline(sources.parquet(str(tmp_path)), shuffle=False).batch(8) \
        .map_batch(F.fail_always).options(opts)
    with pytest.raises(OpError) as info:
        list(pipe)
    for error in (info.value, pickle.loads(pickle.dumps(info.value))):
        assert type(error.sample_id) is list
        assert [] + error.sample_id == [("parquet", i, 0) for i in range(8)]
    assert "(8 samples)" in str(info.value)


def test_struct_and_string_list_columns_arrive_as_inline_gives_them(tmp_path):
    """batch() collates a struct column into a dict of fields and equal-length lists of
    strings into tuples per position: such columns cannot be cut by rows, so a grouped read
    on the process runner reads each micro-batch on its own (it once sent a group's rows
    untransposed, and crashed on the struct)."""
    table = pa.table({"id": list(range(64)), "tags": [[f"a{i}", "b"] for i in range(64)],
                      "st": [{"x": i, "y": f"s{i}"} for i in range(64)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=16)

    def key(b):
        return (list(b.meta["sample_ids"]), b["id"].tolist(), b["tags"],
                b["st"]["x"].tolist(), b["st"]["y"])

    src = sources.parquet(str(tmp_path / "t.parquet"), columns=["id", "tags", "st"])
    inline = keys_of(Pipeline(src, shuffle=False, num_epochs=1).batch(4), key)
    grouped = keys_of(Pipeline(src, shuffle=False, num_epochs=1).batch(4).options(GROUPED),
                      key)
    assert grouped == inline
    assert inline[0][2] == [("a0", "a1", "a2", "a3"), ("b", "b", "b", "b")]
