"""sources.lance: a Lance dataset read at a pinned version, checked against Lance itself.

The corpus is written by ``lance.write_dataset`` (several fragments), then rows are
deleted (deletion files; one fragment entirely) and rows appended (a later version),
so the pinned version has deletions and two generations of fragments. Every live row
zephon reads equals the row Lance's own ``to_table``/``take`` give at that version.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys

import numpy as np
import pytest

lance_lib = pytest.importorskip("lance")
pa = pytest.importorskip("pyarrow")

from _format_conformance import (  # noqa: E402
    check_restore_on_another_world,
    check_shuffle_modes,
    same_value,
)
from _streams import batch_key, keys_of  # noqa: E402

from zephon import Pipeline, RuntimeOptions  # noqa: E402
from zephon.checkpoint import decode_state  # noqa: E402
from zephon.errors import ResumeMismatchError, ZephonConfigError  # noqa: E402
from zephon.io.errors import SourceError  # noqa: E402
from zephon.pipeline.collate import collate  # noqa: E402
from zephon.pipeline.proof import ResumeMismatchWarning, files_proof  # noqa: E402
from zephon.pipeline.sources.lance import LanceSource, lance  # noqa: E402

ROWS, PER_FILE, APPENDED = 112_000, 16_000, 16_000
DELETE = "id % 13 = 5 OR (id >= 40000 AND id < 43000) OR id >= 96000"


def table(first: int, n: int, seed: int = 0):
    """``n`` rows from id ``first``: every kind of column a Lance dataset holds."""
    rng = np.random.default_rng(seed + first)
    ids = np.arange(first, first + n, dtype=np.int64)
    lengths = rng.integers(0, 7, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.table({
        "id": ids,
        "level": pa.array((ids % 200 - 100).astype(np.int16)),
        "score": rng.random(n),
        "text": pa.array([f"row {i} " + "é" * int(i % 5) for i in ids.tolist()]),
        "blob": pa.array([rng.bytes(int(i % 11)) for i in ids.tolist()], pa.binary()),
        "emb": pa.FixedSizeListArray.from_arrays(
            pa.array(rng.random(n * 8, dtype=np.float32)), 8),
        "var": pa.ListArray.from_arrays(pa.array(offsets), pa.array(
            rng.random(int(offsets[-1]), dtype=np.float32))),
        "flag": pa.array(ids % 3 == 0),
        "maybe": pa.array([None if i % 7 == 0 else int(i) for i in ids.tolist()], pa.int32()),
        "meta": pa.array([{"a": int(i % 4), "tag": f"t{i % 9}"} for i in ids.tolist()]),
    })


def build(path, rows: int, per_file: int, appended: int, delete: str) -> int:
    """Write, delete, append: the version with all three (returned)."""
    lance_lib.write_dataset(table(0, rows), path, max_rows_per_file=per_file)
    lance_lib.dataset(path).delete(delete)
    ds = lance_lib.write_dataset(table(rows, appended), path, mode="append",
                                 max_rows_per_file=per_file)
    return ds.version


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lance") / "big.lance")
    version = build(path, ROWS, PER_FILE, APPENDED, DELETE)
    return path, version


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lance") / "small.lance")
    version = build(path, 1500, 400, 300, "id % 5 = 1 OR (id >= 800 AND id < 1200)")
    return path, version


def reference_rows(tbl) -> list[dict]:
    """The rows as Lance's Arrow table gives them, in the form zephon promises: numbers
    as NumPy scalars (``to_numpy``), numeric lists as NumPy arrays, the rest
    ``to_pylist``."""
    columns = {}
    for name in tbl.column_names:
        col = tbl.column(name).combine_chunks()
        kind = col.type
        if col.null_count == 0 and (pa.types.is_integer(kind) or pa.types.is_floating(kind)
                                    or pa.types.is_boolean(kind)):
            columns[name] = list(col.to_numpy(zero_copy_only=False))
        elif pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind):
            columns[name] = list(col.to_numpy(zero_copy_only=False))
        else:
            columns[name] = col.to_pylist()
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(),
                                                                        strict=True)]


def test_every_live_row_equals_what_lance_reads_at_the_pinned_version(corpus):
    path, version = corpus
    src = lance(path)
    ds = lance_lib.dataset(path, version=version)
    assert src.version == version and len(src) == ds.count_rows() >= 100_000
    want = reference_rows(ds.to_table())
    assert len(want) == len(src)
    bad = [i for i in range(len(src)) if not same_value(src.get(i), want[i])]
    assert not bad, (bad[:5], src.get(bad[0]), want[bad[0]])
    # the deleted rows are gone, the appended ones there, in fragment order
    ids = [w["id"] for w in want]
    assert 5 not in ids and 40_000 not in ids and 96_000 not in ids and 95_999 in ids
    assert ids[-1] == ROWS + APPENDED - 1 and ids == sorted(ids)
    # Lance's own random access gives the same rows
    rng = np.random.default_rng(1)
    picks = np.sort(rng.choice(len(src), 300, replace=False))
    for i, row in zip(picks.tolist(), reference_rows(ds.take(picks)), strict=True):
        assert same_value(src.get(i), row), i


def test_shards_are_the_fragments_live_rows(corpus):
    path, version = corpus
    src = lance(path)
    fragments = lance_lib.dataset(path, version=version).get_fragments()
    live = [f.count_rows() for f in fragments if f.count_rows()]
    assert len(live) >= 7
    assert src.shard_bounds().tolist() == np.concatenate([[0], np.cumsum(live)]).tolist()
    assert any(f.metadata.deletion_file is not None for f in fragments)
    assert src.locate(int(src.shard_bounds()[1])) == (int(fragments[1].fragment_id), 0)


FLAT = ["id", "level", "score", "text", "blob", "emb", "var", "flag", "maybe"]


@pytest.mark.parametrize("batch_rows", [64, 4096])
def test_get_batch_is_what_batch_makes_of_the_rows(corpus, batch_rows):
    path, _ = corpus
    src = lance(path, columns=FLAT, batch_rows=batch_rows)
    cross = int(src.shard_bounds()[2])
    rng = np.random.default_rng(2)
    for idx in (np.arange(cross - 40, cross + 40),  # a run across two fragments
                rng.choice(len(src), 97, replace=False),  # scattered
                np.array([len(src) - 1, 0, 0, 3]),
                np.arange(10, 14)):  # equal-length ragged lists: stacked
        got = src.get_batch(idx)
        assert same_value(got, collate([src.get(i) for i in idx.tolist()])), idx
        assert isinstance(got["emb"], np.ndarray) and got["emb"].shape == (len(idx), 8)
    assert src.get_batch([]) is None
    with pytest.raises(IndexError):
        src.get_batch([len(src)])
    # a struct column collates per key in batch(): those batches are read row by row
    assert lance(path, columns=["id", "meta"]).get_batch(np.arange(8)) is None


def test_columns_are_selected(corpus):
    path, version = corpus
    src = lance(path, columns=["text", "emb"])
    row = src.get(10)
    assert list(row) == ["text", "emb"] and row["emb"].shape == (8,)
    want = lance_lib.dataset(path, version=version).take([10], columns=["text", "emb"])
    assert same_value(row, reference_rows(want)[0])
    assert lance(path, columns="id").get(0) == {"id": 0}
    with pytest.raises(SourceError, match=r"no column\(s\) \['nope'\]"):
        lance(path, columns=["id", "nope"])


def test_shuffle_modes(small):
    path, version = small
    check_shuffle_modes(lance(path, version=version, batch_rows=128))


@pytest.mark.parametrize(("saved", "restored"), [(2, 4), (4, 1)])
def test_restore_on_another_world(small, tmp_path, saved, restored):
    path, version = small
    check_restore_on_another_world(lambda: lance(path, version=version, batch_rows=128),
                                   tmp_path, saved, restored, total=48, cut=24)


def test_process_workers_give_the_inline_stream(small):
    path, version = small

    def run(**opts):
        pipe = Pipeline(lance(path, columns=FLAT, version=version, batch_rows=100),
                        shuffle=True, seed=3, chunk_size=32).batch(16)
        return keys_of(pipe.options(RuntimeOptions(**opts)), batch_key)

    assert run(runner="process", max_workers=2) == run(runner="inline")


def copy_of(small, tmp_path) -> str:
    path = str(tmp_path / "copy.lance")
    shutil.copytree(small[0], path)
    return path


def test_a_source_keeps_its_version_when_new_ones_are_written(small, tmp_path):
    path = copy_of(small, tmp_path)
    src = lance(path)
    pinned, n = src.version, len(src)
    before = [src.get(i) for i in range(n)]
    lance_lib.write_dataset(table(5000, 700), path, mode="append")
    lance_lib.dataset(path).delete("id < 100")
    assert lance_lib.dataset(path).version == pinned + 2
    for copy in (src, pickle.loads(pickle.dumps(src)), lance(path, version=pinned)):
        assert len(copy) == n and copy.version == pinned
        assert all(same_value(copy.get(i), before[i]) for i in range(0, n, 7))
    latest = lance(path)
    assert latest.version == pinned + 2 and len(latest) == n + 700 - 80
    assert src.stamps() == src.stamps(now=True) != latest.stamps()
    assert src.stamps()[0][2].startswith(f"lance-version:{pinned}@")
    lance_lib.dataset(path).tags.create("first", pinned)
    tagged = lance(path, version="first")
    assert tagged.version == pinned and tagged.stamps() == src.stamps()


def test_a_version_that_is_gone_or_recreated_is_refused_where_it_is_read(small, tmp_path):
    path = copy_of(small, tmp_path)
    with pytest.raises(SourceError, match="cannot open version 99"):
        lance(path, version=99)
    with pytest.raises(SourceError, match="cannot open the latest version"):
        lance(str(tmp_path / "nothing.lance"))
    src = lance(path, version=1)
    shipped = pickle.dumps(src)
    shutil.rmtree(path)  # re-created: version 1 exists again, with other contents
    lance_lib.write_dataset(table(0, 50), path)
    with pytest.raises(SourceError, match="version 1 is not the one this source was built on"):
        pickle.loads(shipped).get(0)
    assert pickle.loads(shipped).stamps(now=True) != src.stamps()
    shutil.rmtree(path)
    assert src.stamps(now=True)[0][2].startswith("missing:version 1")
    with pytest.raises(SourceError, match=r"cannot open version 1"):
        pickle.loads(shipped).get(0)


def test_a_checkpoint_names_the_version_and_a_restore_on_another_is_refused(small, tmp_path):
    path = copy_of(small, tmp_path)

    def pipe():
        return Pipeline(lance(path, columns=["id"]), seed=1, chunk_size=8).batch(4)

    it = iter(pipe())
    next(it)
    state = it.checkpoint()
    it.close()
    first = lance(path)
    assert files_proof(first.stamps())["stamps"][0][2] == first.stamps()[0][2]
    # a column added: a new version with the same fragments and rows (and description)
    lance_lib.dataset(path).add_columns({"twice": "id * 2"})
    again = pipe()
    assert again.fingerprint() == decode_state(state)["fingerprint"]
    with pytest.raises(ResumeMismatchError, match=r"lance-version:\d+@.* -> lance-version"):
        again.restore(state)
    accepting = Pipeline(lance(path, columns=["id"]), seed=1, chunk_size=8).batch(4).options(
        RuntimeOptions(resume_accept=("files",)))
    with pytest.warns(ResumeMismatchWarning, match="lance-version"):
        accepting.restore(state)
    pipe_at = Pipeline(lance(path, columns=["id"], version=first.version), seed=1,
                       chunk_size=8).batch(4)
    pipe_at.restore(state)  # the pinned version: restores silently


def data_file(src: LanceSource, fragment: int) -> str:
    return os.path.join(src.uri, "data", src.fragment_files[fragment][0])


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_data_file_is_a_source_error_naming_it(small, tmp_path, damage):
    path = copy_of(small, tmp_path)
    src = lance(path, batch_rows=64)
    target = data_file(src, 1)
    size = os.path.getsize(target)
    with open(target, "r+b") as fh:
        if damage == "truncate":
            fh.truncate(size // 2)
        else:  # 4 KiB in the middle flipped: pages and their layout no longer agree
            fh.seek(size // 2 - 2048)
            data = fh.read(4096)
            fh.seek(size // 2 - 2048)
            fh.write(bytes(b ^ 0xFF for b in data))
    name = os.path.basename(target)
    with pytest.raises(SourceError, match=name) as err:
        for i in range(int(src.shard_bounds()[1]), int(src.shard_bounds()[2])):
            src.get(i)
    assert f"fragment {int(src.fragment_ids[1])}" in str(err.value)
    assert src.get(0) is not None  # the other fragments still read


def test_a_file_url_reads_the_same(small):
    path, version = small
    plain = lance(path, version=version)
    url = lance("file://" + path, version=version)
    assert len(url) == len(plain)
    assert all(same_value(url.get(i), plain.get(i)) for i in range(0, len(plain), 5))


def test_pickling_keeps_no_handle_and_reads_the_same(small):
    path, version = small
    src = lance(path, version=version, batch_rows=50)
    want = [src.get(i) for i in range(0, len(src), 3)]
    src.sample_nbytes()
    state = src.__getstate__()
    assert not {"_ds", "_fragments", "_decoded", "_lock"} & set(state)
    blob = pickle.dumps(src)
    assert len(blob) < 20_000
    copy = pickle.loads(blob)
    assert copy._ds is None and not copy._decoded
    assert all(same_value(copy.get(i), w) for i, w in zip(range(0, len(src), 3), want,
                                                          strict=True))
    assert copy.sample_nbytes() == src.sample_nbytes() > 0
    assert copy.describe() == src.describe()


def test_blocks_fit_the_cache_budget(small):
    path, version = small
    assert lance(path).batch_rows == 4096
    src = lance(path, version=version, block_cache_bytes=64 << 10)
    assert 16 <= src.batch_rows < 400  # rows of ~100 bytes: an eighth of 64 KiB each
    plain = lance(path, version=version)
    for i in range(len(src)):
        assert same_value(src.get(i), plain.get(i))
        assert src._cache_bytes <= 64 << 10 or len(src._decoded) == 1
    assert len(src._decoded) < len(src) / src.batch_rows


def test_arguments_are_checked_and_a_missing_library_names_the_extra(small, monkeypatch):
    path, _ = small
    for bad in ({"batch_rows": 0}, {"batch_rows": True}, {"block_cache_bytes": -1},
                {"version": 1.5}):
        with pytest.raises(ZephonConfigError):
            lance(path, **bad)
    monkeypatch.setitem(sys.modules, "lance", None)
    with pytest.raises(SourceError, match=r'pip install -e "\.\[lance\]"'):
        lance(path)
