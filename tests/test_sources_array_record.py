"""sources.array_record: ArrayRecord files written by ArrayRecordWriter, read by zephon.

The corpus: 100,000 records over four shards named as TFDS and Grain write them
(``corpus.array_record-0000k-of-00004``), each with other writer options (the default
``group_size:1`` with zstd, ``uncompressed``, ``snappy``, and ``group_size:64`` with
brotli, which zephon reads a chunk at a time), plus an empty shard; record sizes vary from
0 bytes to over 64 KiB (a record spanning Riegeli's 64 KiB blocks). Every record zephon
reads is compared with ``ArrayRecordReader.read_all`` and with Grain's
``ArrayRecordDataSource``.
"""

from __future__ import annotations

import glob
import os
import pickle
import zlib

import numpy as np
import pytest
from _format_conformance import check_restore_on_another_world, check_shuffle_modes

from zephon import Pipeline, RuntimeOptions
from zephon.pipeline.sources.array_record import array_record
from zephon.pipeline.sources.base import SourceError

ar = pytest.importorskip("array_record.python.array_record_module")

N = 100_000
#: (records, writer options) per shard of the big corpus
SHARDS = [(30_000, ""), (25_000, "uncompressed"), (25_000, "group_size:1,snappy"),
          (20_000, "group_size:64,brotli:1")]
STEM = "corpus.array_record"


def _records(n: int, seed: int) -> list[bytes]:
    """``n`` records: mostly 0-300 bytes (some empty), every 2,500th one of 65-200 KiB."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 300, n)
    sizes[rng.random(n) < 0.05] = 0
    sizes[::2500] = rng.integers(65 << 10, 200 << 10, len(sizes[::2500]))
    blob = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8).tobytes()
    ends = np.cumsum(sizes).tolist()
    return [blob[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def _write(path, records, options: str = "") -> str:
    writer = ar.ArrayRecordWriter(str(path), options)
    for record in records:
        writer.write(record)
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``(directory, [shard paths], all records in order)``."""
    root = tmp_path_factory.mktemp("array_record")
    records = _records(N, 0)
    paths, at = [], 0
    for k, (n, options) in enumerate(SHARDS):
        paths.append(_write(root / f"{STEM}-{k:05d}-of-{len(SHARDS):05d}",
                            records[at:at + n], options))
        at += n
    return str(root), paths, records


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 300-record corpus of three files (one empty) for the pipeline checks."""
    root = tmp_path_factory.mktemp("array_record_small")
    records = _records(300, 1)
    for k, (lo, hi, options) in enumerate([(0, 120, ""), (120, 120, ""),
                                           (120, 300, "group_size:16")]):
        _write(root / f"part-{k}.array_record", records[lo:hi], options)
    return str(root / "*.array_record"), records


def test_every_record_matches_the_library_and_grain(corpus):
    from grain.sources import ArrayRecordDataSource

    root, paths, records = corpus
    src = array_record(f"{root}/{STEM}@{len(SHARDS)}")
    assert len(src) == N and src.files == paths
    # a shard per group_size:1 file, a shard per chunk of the group_size:64 one
    assert src.shard_bounds().tolist() == [0, 30_000, 55_000, *range(80_000, N, 64), N]
    library = [r for p in paths for r in ar.ArrayRecordReader(p).read_all()]
    assert library == records
    grain = ArrayRecordDataSource(paths)
    assert len(grain) == N
    step = 5000
    for lo in range(0, N, step):
        want = grain.__getitems__(list(range(lo, lo + step)))
        got = [src.get(i) for i in range(lo, lo + step)]
        assert got == want == records[lo:lo + step], lo
        assert all(type(g) is bytes for g in got)
    sizes = [len(r) for r in records]
    assert min(sizes) == 0 and max(sizes) > 64 << 10


def test_decode_and_random_order(corpus):
    _, paths, records = corpus
    src = array_record(paths, decode=zlib.crc32, name="crc")
    order = np.random.default_rng(3).permutation(N)[:20_000].tolist()
    assert [src.get(i) for i in order] == [zlib.crc32(records[i]) for i in order]
    assert src.identity(7) == ("crc", 7)
    assert "decode=zlib.crc32)" in src.describe()


def test_path_forms_give_the_same_files(corpus, tmp_path):
    root, paths, records = corpus
    forms = [root, f"{root}/{STEM}-*", f"file://{root}/{STEM}@4", [f"file://{p}" for p in paths],
             f"file://{root}/{STEM}-0000[0-3]-of-00004"]
    for form in forms:
        src = array_record(form)
        assert [os.path.basename(f) for f in src.files] == \
            [os.path.basename(p) for p in paths], form
        assert len(src) == N and src.get(N - 1) == records[-1], form
    with pytest.raises(SourceError, match="no file matches"):
        array_record(str(tmp_path / "nothing-*.array_record"))
    with pytest.raises(SourceError, match=r"no \*\.array_record file in directory"):
        array_record(str(tmp_path))


def test_shuffle_modes(small):
    pattern, _ = small
    check_shuffle_modes(array_record(pattern))


# (2 -> 3) fails for any source, from_sequence too: with 4 lanes on 3 ranks the lanes
# advance unequally, so the restored run's (lane, index) keys are not the first 48 of the
# one-rank run (the samples of the keys both have agree)
@pytest.mark.parametrize(("saved", "restored"), [(2, 4), (3, 1)])
def test_restore_on_another_world(small, tmp_path, saved, restored):
    pattern, _ = small
    check_restore_on_another_world(lambda: array_record(pattern), tmp_path, saved, restored,
                                   total=48, cut=24)


def test_process_runner_gives_the_inline_stream(small):
    pattern, records = small
    src = array_record(pattern)

    def stream(opts):
        pipe = Pipeline(src, shuffle=True, seed=5, num_epochs=1).batch(16, drop_last=False)
        return [(list(b.meta["sample_ids"]), list(b)) for b in pipe.options(opts)]

    inline = stream(RuntimeOptions(runner="inline"))
    assert inline == stream(RuntimeOptions(runner="process", max_workers=2))
    got = {sid[1]: v for ids, values in inline for sid, v in zip(ids, values, strict=True)}
    assert got == dict(enumerate(records))


def test_pickling_keeps_no_reader(small):
    pattern, records = small
    src = array_record(pattern)
    assert src.get(250) == records[250] and src._ars  # readers open in this process
    clone = pickle.loads(pickle.dumps(src))
    assert not clone._ars and not clone._readers and not clone._chunks
    assert [clone.get(i) for i in range(len(records))] == records


def test_corrupt_shards_name_the_file(corpus, tmp_path):
    _, paths, records = corpus
    # flipped bytes in the middle of a shard: the chunk there fails its hash when read
    flipped = tmp_path / "flipped.array_record"
    data = bytearray(open(paths[0], "rb").read())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    flipped.write_bytes(bytes(data))
    src = array_record(str(flipped))
    errors = []
    for i in range(len(src)):
        try:
            assert src.get(i) == records[i]
        except SourceError as exc:
            errors.append(str(exc))
    assert errors and all("flipped.array_record" in e for e in errors)
    # truncated: the footer is gone, the source refuses to build
    truncated = tmp_path / "truncated.array_record"
    truncated.write_bytes(open(paths[1], "rb").read()[: os.path.getsize(paths[1]) // 2])
    with pytest.raises(SourceError, match=r"truncated\.array_record: not a readable"):
        array_record(str(truncated))
    # not ArrayRecord at all
    junk = tmp_path / "junk.array_record"
    junk.write_bytes(os.urandom(200_000))
    with pytest.raises(SourceError, match=r"junk\.array_record: not a readable"):
        array_record([str(flipped), str(junk)])


def test_a_file_changed_after_building_is_named(small, tmp_path):
    _, records = small
    path = _write(tmp_path / "moving.array_record", records[:50])
    src = array_record(path)
    clone = pickle.loads(pickle.dumps(src))  # a worker's copy: opens the file on first read
    _write(path, records[:40])
    with pytest.raises(SourceError, match=r"moving\.array_record: has 40 records, 50 when"):
        clone.get(0)


def test_remote_files_read_through_the_verified_cache(small, tmp_path):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from _s3_server import BUCKET, MotoServer, storage_options

    from zephon import StoreOptions

    pattern, records = small
    local = sorted(glob.glob(pattern))
    server = MotoServer()
    try:
        for k, path in enumerate(local):
            server.put(f"ar/small.array_record-{k:05d}-of-{len(local):05d}",
                       open(path, "rb").read())
        io = StoreOptions(cache_root=str(tmp_path / "cache"))  # cache_enabled=False
        so = storage_options(server.endpoint)
        for spec in (f"s3://{BUCKET}/ar/small.array_record@{len(local)}",
                     f"s3://{BUCKET}/ar/*"):
            src = array_record(spec, io_options=io, storage_options=so)
            assert len(src) == len(records) and src.files[0].startswith("s3://")
            assert [src.get(i) for i in range(len(src))] == records
        cached = [f for _, _, fs in os.walk(tmp_path / "cache") for f in fs]
        assert len([f for f in cached if "small.array_record" in f]) >= len(local)
        opts = RuntimeOptions(io_options=io, runner="process", max_workers=2)
        got = [r for b in Pipeline(src, shuffle=False, num_epochs=1).batch(32, drop_last=False)
               .options(opts) for r in b]
        assert got == records
    finally:
        server.stop()
