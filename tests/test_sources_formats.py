"""File-format sources on local files: Parquet, WebDataset tar shards, token files,
compressed jsonl and Hugging Face datasets; their errors name the file and the
row group / member, also when raised in a worker process."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from zephon import OpError, Pipeline, RuntimeOptions, sources
from zephon.pipeline.sources import SourceError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import _sources_fns as F  # noqa: E402
from _sources_data import write_parquet, write_shards  # noqa: E402


# -- parquet -------------------------------------------------------------------------------------
def test_parquet_random_access_matches_pyarrow(tmp_path):
    paths = write_parquet(tmp_path)
    src = sources.parquet(str(tmp_path / "*.parquet"))
    table = pa.concat_tables(pq.read_table(p) for p in paths)
    assert len(src) == table.num_rows == 750
    for i in (0, 63, 64, 249, 250, 511, 749, 300, 5):
        row = src.get(i)
        assert int(row["id"]) == i and row["text"] == f"row {i}"
        assert row["score"] == np.float32(i * 0.5)
        assert isinstance(row["vec"], np.ndarray) and row["vec"].tolist() == list(range(i % 5))
    assert src.locate(300) == (1, 0, 50)
    narrow = sources.parquet(paths, columns=["id"])
    assert set(narrow.get(10)) == {"id"}
    with pytest.raises(SourceError, match=r"part-000\.parquet has no column\(s\) \['nope'\]"):
        sources.parquet(paths, columns=["nope"])
    with pytest.raises(SourceError, match="no file matches"):
        sources.parquet(str(tmp_path / "*.csv"))


def test_parquet_directory_and_file_url(tmp_path):
    write_parquet(tmp_path, files=2)
    a = sources.parquet(str(tmp_path))
    b = sources.parquet(f"file://{tmp_path}/*.parquet")
    assert len(a) == len(b) == 500 and a.describe() == b.describe()


def test_parquet_source_shuffle_is_a_seeded_permutation_in_row_group_blocks(tmp_path):
    write_parquet(tmp_path)
    src = sources.parquet(str(tmp_path), columns=["id"], shuffle=True, seed=5)
    ids = [int(src.get(i)["id"]) for i in range(len(src))]
    assert sorted(ids) == list(range(750)) and ids != list(range(750))
    again = sources.parquet(str(tmp_path), columns=["id"], shuffle=True, seed=5)
    assert [int(again.get(i)["id"]) for i in range(0, 750, 7)] == ids[::7]
    other = sources.parquet(str(tmp_path), columns=["id"], shuffle=True, seed=6)
    assert [int(other.get(i)["id"]) for i in range(750)] != ids
    # each run of 64 consecutive positions stays inside one row group
    first = {i // 64 for i in ids[:64]}
    assert len({(i // 250, (i % 250) // 64) for i in ids[:64]}) == 1, first


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_parquet_pipeline_same_stream_under_every_runner(tmp_path, runner):
    write_parquet(tmp_path)
    src = sources.parquet(str(tmp_path), columns=["id", "score"])
    pipe = Pipeline(src, seed=3, chunk_size=16).map(F.pick_parquet).batch(32)
    ref = [b["n"].tolist() for b in pipe.options(RuntimeOptions(runner="inline"))]
    got = [b["n"].tolist() for b in pipe.options(RuntimeOptions(runner=runner, max_workers=2))]
    assert got == ref and sorted(sum(ref, [])) == list(range(750))


def test_parquet_truncated_file_is_named_when_building(tmp_path):
    (path,) = write_parquet(tmp_path, files=1)
    data = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 2])
    with pytest.raises(SourceError, match=r"part-000\.parquet: not a readable Parquet file"):
        sources.parquet(path)


def _corrupt_row_group(path: str, group: int) -> None:
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(group).column(0)
    start = col.data_page_offset
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(b"\xff" * 64)  # the page header of the group's first column


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_parquet_corrupt_row_group_is_named_in_the_consumer(tmp_path, runner):
    paths = write_parquet(tmp_path, files=2)
    src = sources.parquet(paths)  # footers are intact
    _corrupt_row_group(paths[1], 2)
    pipe = Pipeline(src, shuffle=False, chunk_size=32).map(F.pick_parquet).batch(16)
    with pytest.raises(OpError, match=r"part-001\.parquet, row group 2: cannot decode") as info:
        list(pipe.options(RuntimeOptions(runner=runner, max_workers=2)))
    assert info.value.sample_id[1] == 250 + 2 * 64  # the first row of that group


def test_parquet_file_truncated_after_building_names_file_and_row_group(tmp_path):
    (path,) = write_parquet(tmp_path, files=1)
    src = sources.parquet(path)
    data = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 3])
    with pytest.raises(SourceError, match=r"part-000\.parquet, row group \d"):
        src.get(0)


# -- webdataset ----------------------------------------------------------------------------------
def test_webdataset_samples_group_members_by_key(tmp_path):
    write_shards(tmp_path)
    src = sources.webdataset(str(tmp_path / "shard-{000..002}.tar"))
    assert len(src) == 120
    for i in (0, 39, 40, 119, 77):
        sample = src.get(i)
        assert sample["__key__"] == f"{i:06d}" and sample["txt"] == f"sample {i}".encode()
        assert json.loads(sample["json"])["n"] == i
    again = sources.webdataset(sorted(str(p) for p in tmp_path.glob("*.tar")))
    assert again.describe() == src.describe()


def test_webdataset_shuffled_pipeline_equals_tarfile_contents(tmp_path):
    paths = write_shards(tmp_path, shards=2, per_shard=30)
    expected = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for m in tar:
                key, ext = m.name.split(".", 1)
                expected.setdefault(key, {})[ext] = tar.extractfile(m).read()
    src = sources.webdataset(paths)
    got = {s["__key__"]: {k: v for k, v in s.items() if k != "__key__"}
           for s in Pipeline(src, seed=1, shuffle=True, chunk_size=8)}
    assert got == expected


def test_webdataset_corrupt_header_is_named_when_building(tmp_path):
    (path,) = write_shards(tmp_path, shards=1, per_shard=10)
    with open(path, "r+b") as fh:
        fh.seek(3 * 1024)  # the header of the fourth member (000001.json)
        fh.write(b"\x01" * 512)
    with pytest.raises(SourceError, match=r"shard-000\.tar: corrupt or truncated tar after "
                                          r"member '000001\.txt': unreadable header at byte 3072"):
        sources.webdataset(path)


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_webdataset_truncated_member_is_named_in_the_consumer(tmp_path, runner):
    paths = write_shards(tmp_path, shards=2, per_shard=20)
    src = sources.webdataset(paths)
    data = open(paths[1], "rb").read()
    with open(paths[1], "wb") as fh:
        fh.write(data[: len(data) // 2])
    pipe = Pipeline(src, shuffle=False, chunk_size=8).map(F.decode_wds).batch(4)
    with pytest.raises(OpError, match=r"shard-001\.tar, members 0000\d\d\.\{txt,json\}: "
                                      r"truncated"):
        list(pipe.options(RuntimeOptions(runner=runner, max_workers=2)))


# -- token files -----------------------------------------------------------------------------
def test_token_windows_uint32_bin_and_npy(tmp_path):
    tokens = (np.arange(5000, dtype=np.uint64) * 104729 % (2**32 - 5)).astype(np.uint32)
    tokens.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens)
    a = sources.token_windows(str(tmp_path / "t.bin"), 100, "uint32")
    b = sources.token_windows(str(tmp_path / "t.npy"), 100, dtype=None)
    assert len(a) == len(b) == 50 and b.dtype == np.uint32
    for i in (0, 17, 49):
        assert np.array_equal(a.get(i)["tokens"], tokens[i * 100:(i + 1) * 100])
        assert np.array_equal(b.get(i)["tokens"], tokens[i * 100:(i + 1) * 100])
    with pytest.raises(SourceError, match=r"holds uint32, dtype='uint16'"):
        sources.token_windows(str(tmp_path / "t.npy"), 100, "uint16")
    flat = np.concatenate([s["tokens"] for s in Pipeline(b, shuffle=False)
                           .options(RuntimeOptions(runner="process", max_workers=2))])
    assert np.array_equal(flat, tokens)


# -- jsonl ---------------------------------------------------------------------------------------
def test_jsonl_compressed_files(tmp_path):
    import zstandard

    lines = [json.dumps({"i": i}) + "\n" for i in range(30)]
    (tmp_path / "a.jsonl").write_text("".join(lines[:10]))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as fh:
        fh.write("".join(lines[10:20]) + "\n")
    (tmp_path / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("".join(lines[20:29] + ['{"i": 29, bad}\n']).encode()))
    src = sources.jsonl(str(tmp_path / "*.jsonl*"))
    assert len(src) == 30
    assert [src.get(i)["i"] for i in range(29)] == list(range(29))
    with pytest.raises(SourceError, match=r"c\.jsonl\.zst, line 10: invalid JSON .*; the line starts at byte 90$"):
        src.get(29)
    out = list(Pipeline(sources.jsonl([str(tmp_path / "b.jsonl.gz")]), shuffle=False)
               .options(RuntimeOptions(runner="process", max_workers=2)))
    assert [s["i"] for s in out] == list(range(10, 20))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(SourceError, match=r"bad\.jsonl\.gz: cannot decompress"):
        sources.jsonl(str(tmp_path / "bad.jsonl.gz"))


# -- hugging face datasets -----------------------------------------------------------------------
def test_hf_dataset_loaded_and_saved(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(40)],
                                     "ids": [[i, i + 1] for i in range(40)],
                                     "label": list(range(40))})
    ds.save_to_disk(str(tmp_path / "saved"))
    for src in (sources.hf_dataset(ds), sources.hf_dataset(str(tmp_path / "saved")),
                sources.hf_dataset(datasets.load_from_disk(str(tmp_path / "saved")))):
        assert len(src) == 40
        row = src.get(7)
        assert row["text"] == "t7" and row["ids"].tolist() == [7, 8] and int(row["label"]) == 7
    src = sources.hf_dataset(str(tmp_path / "saved"), columns=["label", "ids"])
    pipe = Pipeline(src, seed=2, chunk_size=8).batch(8)
    ref = [b["label"].tolist() for b in pipe.options(RuntimeOptions(runner="inline"))]
    got = [b["label"].tolist() for b in pipe.options(RuntimeOptions(runner="process",
                                                                     max_workers=2))]
    assert got == ref and sorted(sum(ref, [])) == list(range(40))
    with pytest.raises(SourceError, match="load_from_disk"):
        sources.hf_dataset(str(tmp_path / "missing"))


# -- what a worker imports -----------------------------------------------------------------------
def test_unpickling_a_source_loads_only_what_it_needs(tmp_path):
    write_parquet(tmp_path, files=1)
    (tmp_path / "a.jsonl").write_text('{"i": 1}\n')
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    blobs = {"jsonl": sources.jsonl(str(tmp_path / "a.jsonl")),
             "tokens": sources.token_windows(str(tmp_path / "t.bin"), 10),
             "parquet": sources.parquet(str(tmp_path / "part-000.parquet"))}
    script = ("import pickle, sys\n"
              "src = pickle.loads(sys.stdin.buffer.read())\n"
              "src.get(0)\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & "
              "{'pyarrow', 'fsspec', 's3fs', 'datasets'}))\n")
    for kind, src in blobs.items():
        out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(src),
                             capture_output=True, check=True).stdout.decode().strip()
        assert out == ("['pyarrow']" if kind == "parquet" else "[]"), (kind, out)


@pytest.mark.parametrize("module, extra, call", [
    ("pyarrow", "parquet", "sources.parquet('x.parquet')"),
    ("fsspec", "remote", "sources.jsonl('s3://bucket/a.jsonl')"),
    ("datasets", "hf", "sources.hf_dataset('saved')"),
])
def test_a_missing_extra_names_the_pip_line(module, extra, call):
    script = (f"import sys; sys.modules[{module!r}] = None\n"
              "from zephon import sources\n"
              "from zephon.pipeline.sources import SourceError\n"
              f"try:\n    {call}\nexcept SourceError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert f'python -m pip install -e ".[{extra}]"' in out, out
