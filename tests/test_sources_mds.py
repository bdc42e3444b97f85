"""sources.mds against MosaicML Streaming's own writer and reader.

Every corpus is written by ``streaming.MDSWriter`` (loaded as :mod:`_mds_lib` explains:
the package's ``__init__`` needs torchvision, which cannot be installed here) and every
value zephon reads is compared with ``StreamingDataset(local=..., shuffle=False)[i]``:

- ``big``: 100,000 samples of 8 columns (``int``, ``str``, ``bytes``, ``json``, fixed-shape
  and dynamic ``ndarray``, ``float64``, ``pkl``) over 16 raw shards;
- ``packed``: 30,000 samples of every sized numeric encoding, ``str_int``,
  ``str_float``, ``str_decimal`` and ``ndarray`` of a fixed dtype, in zstd-compressed
  shards with sha1 and xxh64 hashes;
- ``images``: 1,500 samples of every image encoding (``pil``, ``jpeg``, ``png``,
  ``list[...]``, ``jpeg_array``), decoded through the library's ``mds_decode``;
- one small corpus per other compression (gz, bz2, br, snappy), and ``small`` (2,000
  samples in 18 shards) for the pipeline checks, corruption and remote reads (an
  fsspec ``memory://`` root, and an ``s3://`` one on a moto server).

``StreamingDataset`` leaves shared memory in /dev/shm and file locks in the temporary
directory: each use is a :func:`_mds_lib.library_session`, and the module checks that no
shared memory is left.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import sys
from decimal import Decimal

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _mds_lib

if not _mds_lib.available():
    pytest.skip("mosaicml-streaming is not installed", allow_module_level=True)
pytest.importorskip("zstandard")
PIL = pytest.importorskip("PIL.Image")

from _format_conformance import (  # noqa: E402
    check_restore_on_another_world,
    check_shuffle_modes,
    same_value,
)

from zephon import Pipeline, RuntimeOptions  # noqa: E402
from zephon.errors import ZephonConfigError  # noqa: E402
from zephon.pipeline.sources import SourceError  # noqa: E402
from zephon.pipeline.sources.mds import mds  # noqa: E402

try:
    lib = _mds_lib.load()
except ImportError as exc:  # a dependency of mosaicml-streaming's own modules
    pytest.skip(f"mosaicml-streaming cannot be loaded: {exc}", allow_module_level=True)

BIG_COLUMNS = {"id": "int", "text": "str", "blob": "bytes", "meta": "json",
               "vec": "ndarray:float32:4", "arr": "ndarray", "score": "float64", "obj": "pkl"}
PACKED_COLUMNS = {"id": "int", "u8": "uint8", "u16": "uint16", "u32": "uint32",
                  "u64": "uint64", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
                  "f16": "float16", "f32": "float32", "sint": "str_int", "sfloat": "str_float",
                  "sdec": "str_decimal", "text": "str", "grid": "ndarray:uint8:2,3",
                  "nd16": "ndarray:int16"}
IMAGE_COLUMNS = {"id": "int", "pil": "pil", "jpeg": "jpeg", "png": "png",
                 "pils": "list[pil]", "jpegs": "list[jpeg]", "pngs": "list[png]",
                 "jarr": "jpeg_array"}
DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.float16, np.uint32, np.int32,
          np.float32, np.uint64, np.int64, np.float64]
WORDS = ["alpha", "beta", "", "δέλτα", "ε\n"]


@pytest.fixture(scope="module", autouse=True)
def no_shared_memory_left():
    before = _mds_lib.shm_entries()
    yield
    assert not _mds_lib.shm_entries() - before


def write(out, columns, samples, **kw) -> str:
    with lib.MDSWriter(out=str(out), columns=columns, **kw) as writer:
        for sample in samples:
            writer.write(sample)
    return str(out)


def library_samples(root, tmp) -> list:
    """Every sample as StreamingDataset reads it (from a copy: for compressed shards it
    writes the decompressed ones beside them)."""
    copy = os.path.join(str(tmp), "library-copy")
    shutil.copytree(root, copy)
    try:
        with _mds_lib.library_session():
            ds = lib.StreamingDataset(local=copy, shuffle=False, allow_unsafe_types=True)
            out = [ds[i] for i in range(ds.num_samples)]
            del ds
    finally:
        shutil.rmtree(copy)
    return out


def big_sample(i: int, vec: np.ndarray) -> dict:
    shape = (1 + i % 3,) if i % 2 else (1 + i % 2, 1 + i % 4)
    if i % 97 == 0:
        shape = (300,)  # a shape past 255: stored as uint16
    return {"id": i - 50_000, "text": WORDS[i % 5] * (i % 4), "blob": bytes([i % 256]) * (i % 9),
            "meta": {"i": i, "l": [i, str(i), None, i / 4]}, "vec": vec[i],
            "arr": np.arange(int(np.prod(shape))).astype(DTYPES[i % 11]).reshape(shape),
            "score": i / 7, "obj": (i, {"x": i % 3})}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("mds-big")
    vec = np.random.default_rng(0).random((100_000, 4), dtype=np.float32)
    root = write(d / "ds", BIG_COLUMNS, (big_sample(i, vec) for i in range(100_000)),
                 size_limit=1 << 20)
    return root, library_samples(root, d)


def packed_sample(i: int) -> dict:
    return {"id": i, "u8": i % 256, "u16": i % 65_536, "u32": i * 40_000 % 2**32,
            "u64": 2**64 - 1 - i, "i8": i % 256 - 128, "i16": i % 65_536 - 32_768,
            "i32": i - 70_000, "i64": -(2**62) + i, "f16": i / 3, "f32": i / 3,
            "sint": (i - 15_000) * 10**20, "sfloat": i / 9, "sdec": Decimal(i) / Decimal(8),
            "text": WORDS[i % 5] * (i % 6),
            "grid": np.arange(6, dtype=np.uint8).reshape(2, 3) + np.uint8(i % 200),
            "nd16": np.full(1 + i % 5, i % 3000 - 1000, np.int16)}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("mds-packed")
    root = write(d / "ds", PACKED_COLUMNS, (packed_sample(i) for i in range(30_000)),
                 compression="zstd:7", hashes=["sha1", "xxh64"], size_limit=1 << 18)
    return root, library_samples(root, d)


def image_pool() -> list[dict]:
    """Pre-encoded values of each image column (the writer's own encoders): the writer
    stores bytes as they are, so the corpus costs no image encoding per sample."""
    from streaming.base.format.mds.encodings import mds_encode

    pool = []
    for k in range(8):
        pixels = (np.arange(5 * 4 * 3).reshape(5, 4, 3) * (k + 1) % 256).astype(np.uint8)
        rgb, grey = PIL.fromarray(pixels), PIL.fromarray(pixels[..., 0])
        buf = io.BytesIO()
        rgb.save(buf, format="JPEG")
        values = {"pil": rgb if k % 2 else grey, "jpeg": rgb, "png": grey if k % 2 else rgb,
                  "pils": [rgb, grey][: 1 + k % 2], "jpegs": [rgb] * (1 + k % 3),
                  "pngs": [grey, rgb], "jarr": [buf.getvalue()] * (1 + k % 2)}
        pool.append({c: mds_encode(IMAGE_COLUMNS[c], v) for c, v in values.items()})
    return pool


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("mds-images")
    pool = image_pool()
    root = write(d / "ds", IMAGE_COLUMNS, ({"id": i, **pool[i % 8]} for i in range(1_500)),
                 compression="gz", size_limit=1 << 16)
    return root, library_samples(root, d)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("mds-small")
    columns = {"id": "int", "text": "str", "arr": "ndarray", "score": "float32"}
    samples = ({"id": i, "text": f"sample {i}", "arr": np.arange(i % 7 + 1, dtype=np.int64),
                "score": np.float32(i / 3)} for i in range(2_000))
    return write(d / "ds", columns, samples, size_limit=8_000)


def copy_of(root: str, tmp_path) -> str:
    return shutil.copytree(root, str(tmp_path / "copy"))


def shard_path(root: str, k: int) -> str:
    entry = json.load(open(os.path.join(root, "index.json")))["shards"][k]
    return os.path.join(root, (entry["zip_data"] or entry["raw_data"])["basename"])


def assert_same(src, want) -> None:
    assert len(src) == len(want)
    bad = [i for i in range(len(want)) if not same_value(src.get(i), want[i])]
    assert not bad, (bad[:5], src.get(bad[0]), want[bad[0]])


# --- 1. every record equals the library's ------------------------------------------


def test_every_record_of_raw_shards_equals_the_library(big):
    root, want = big
    src = mds(root, allow_unsafe_types=True)
    assert len(src) == 100_000 and len(src.refs) > 10
    assert_same(src, want)
    assert type(src.get(3)["id"]) is int and src.get(3)["arr"].dtype == np.int16
    bounds = src.shard_bounds()
    assert bounds[0] == 0 and bounds[-1] == 100_000 and len(bounds) == len(src.refs) + 1


def test_every_record_of_zstd_shards_equals_the_library(packed):
    root, want = packed
    src = mds(root, shard_cache_bytes=1 << 20)  # a few shards: evictions and reloads
    assert all(f.endswith(".mds.zstd") for f in src.files) and len(src.refs) > 4
    assert_same(src, want)
    assert src.shard_check[0][0] == "xxh64"  # the cheapest hash listed is checked
    assert src.get(3)["u8"].dtype == np.uint8 and type(src.get(3)["u8"]) is np.uint8


def test_every_image_encoding_goes_through_the_library(images):
    root, want = images
    src = mds(root)
    assert_same(src, want)
    assert isinstance(src.get(0)["jpeg"], PIL.Image) and len(src.get(1)["pils"]) == 2


def test_image_encodings_without_the_package_init(images, monkeypatch):
    """Where ``streaming``'s ``__init__`` cannot be imported (it needs torchvision), the
    library's encodings module is loaded from its file; with no package at all, the
    error names the encoding and the extra."""
    import importlib
    import importlib.util

    module = importlib.import_module("zephon.pipeline.sources.mds")  # the module, not sources.mds

    root, want = images
    monkeypatch.setattr(module, "_LIBRARY", {})
    monkeypatch.setitem(sys.modules, "streaming.base.format.mds.encodings", None)
    src = mds(root, columns=["jpegs", "pil"])
    assert module._LIBRARY["module"].__name__ == "_zephon_mds_encodings"
    for i in (0, 1, 2, 3):
        assert same_value(src.get(i), {k: want[i][k] for k in ("jpegs", "pil")})
    monkeypatch.setattr(module, "_LIBRARY", {})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(SourceError, match=r"encoding 'jpeg' .*pip install mosaicml-streaming"):
        mds(root, columns=["jpeg"])
    assert mds(root, columns=["id"]).get(5) == {"id": 5}  # what zephon decodes needs nothing


def test_a_raw_copy_beside_a_compressed_shard_changes_nothing(packed, tmp_path):
    """A directory StreamingDataset decompressed into holds both forms of a shard: the
    listed (compressed) file is the one read and stamped, so a checkpoint taken before the
    copy appeared restores after it."""
    import zstandard

    from zephon import Pipeline

    root, want = packed
    root = copy_of(root, tmp_path)
    pipe = Pipeline(mds(root), seed=1).batch(10)
    it = iter(pipe)
    next(it)
    state = it.checkpoint()
    it.close()
    entry = json.load(open(os.path.join(root, "index.json")))["shards"][1]
    raw = zstandard.ZstdDecompressor().decompress(open(shard_path(root, 1), "rb").read())
    with open(os.path.join(root, entry["raw_data"]["basename"]), "wb") as fh:
        fh.write(raw)
    src = mds(root)
    assert all(f.endswith(".zstd") for f in src.files)
    assert_same(src, want)
    Pipeline(src, seed=1).batch(10).restore(state)  # not refused


@pytest.mark.parametrize("codec", ["gz:1", "bz2", "br:3", "snappy"])
def test_every_compression_reads_as_the_library(tmp_path, codec):
    root = write(tmp_path / "ds", PACKED_COLUMNS, (packed_sample(i) for i in range(600)),
                 compression=codec, size_limit=1 << 13)
    src = mds(root)
    assert len(src.refs) > 2
    assert_same(src, library_samples(root, tmp_path))


def test_columns_choose_what_is_decoded(big):
    root, want = big
    src = mds(root, columns=["vec", "id"])  # pkl left out: no allow_unsafe_types needed
    for i in (0, 1, 77_777, 99_999):
        assert list(src.get(i)) == ["id", "vec"]
        assert same_value(src.get(i)["vec"], want[i]["vec"]) and src.get(i)["id"] == i - 50_000
    with pytest.raises(SourceError, match=r"no column\(s\) \['nope'\]"):
        mds(root, columns=["id", "nope"])
    with pytest.raises(SourceError, match=r"\['obj'\] are pkl .*allow_unsafe_types=True"):
        mds(root)


def test_a_split_and_several_roots_are_read_in_order(small, tmp_path):
    for split in ("train", "val"):
        shutil.copytree(small, tmp_path / split)
    one = mds(small)
    both = mds([str(tmp_path), str(tmp_path)], split="train")
    assert len(both) == 2 * len(one) and len(both.shard_bounds()) == 2 * len(one.refs) + 1
    assert all(same_value(both.get(len(one) + i), one.get(i)) for i in range(0, len(one), 7))
    globbed = mds(str(tmp_path / "*"))  # a glob of dataset directories: train, then val
    assert len(globbed) == 2 * len(one) and globbed.index_files[0].endswith(
        os.path.join("train", "index.json"))


# --- 2. shuffle modes and restores on another world ---------------------------------


def test_shuffle_modes(small):
    check_shuffle_modes(mds(small))


@pytest.mark.parametrize(("saved", "restored"), [(2, 4), (3, 1)])
def test_restore_on_another_world(small, tmp_path, saved, restored):
    check_restore_on_another_world(lambda: mds(small, columns=["id"]), tmp_path, saved,
                                   restored, total=48, cut=24)


# --- 3. process runner ----------------------------------------------------------------


def test_process_runner_gives_the_inline_stream(small, packed):
    src = mds([small, packed[0]], columns=["id"])

    def run(**opts):
        pipe = Pipeline(src, shuffle="shards", seed=3, num_epochs=1).batch(64,
                                                                           drop_last=False)
        return [b["id"].tolist() for b in pipe.options(RuntimeOptions(**opts))]

    inline = run(runner="inline")
    assert run(runner="process", max_workers=2) == inline
    assert sorted(i for b in inline for i in b) == sorted([*range(2_000), *range(30_000)])


# --- 4. corrupt shards ---------------------------------------------------------------


def flip(path: str, offset: int, n: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        data = fh.read(n)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in data))


def read_all(src, shard: int) -> None:
    bounds = src.shard_bounds()
    for i in range(int(bounds[shard]), int(bounds[shard + 1])):
        src.get(i)


def test_a_corrupt_header_is_a_source_error_naming_the_shard(small, tmp_path):
    root = copy_of(small, tmp_path)
    target = shard_path(root, 2)
    n = json.load(open(os.path.join(root, "index.json")))["shards"][2]["samples"]
    flip(target, 4 * (1 + n // 2), 2)  # an offset in the middle of the header's table
    src = mds(root)
    with pytest.raises(SourceError, match=rf"{re.escape(target)}: corrupt header"):
        read_all(src, 2)
    assert same_value(src.get(0), mds(small).get(0))  # the other shards still read


def test_a_corrupt_sample_is_a_source_error_naming_the_shard(small, tmp_path):
    root = copy_of(small, tmp_path)
    target = shard_path(root, 3)
    size = os.path.getsize(target)
    src = mds(root)
    offsets = src._shard(3).offsets
    middle = int(offsets[np.searchsorted(offsets, size // 2)])
    flip(target, middle, 4)  # the middle sample's first column size
    j = int(np.searchsorted(offsets, size // 2))
    with pytest.raises(SourceError, match=rf"{re.escape(target)}: sample {j} cannot be "
                                          r"decoded: ValueError: its column sizes"):
        read_all(src, 3)


def test_a_truncated_shard_is_a_source_error_naming_it(small, tmp_path):
    root = copy_of(small, tmp_path)
    target = shard_path(root, 1)
    src = mds(root)  # built on the whole file
    with open(target, "r+b") as fh:
        fh.truncate(os.path.getsize(target) // 2)
    with pytest.raises(SourceError, match=rf"{re.escape(target)}.*truncated"):
        read_all(src, 1)
    with pytest.raises(SourceError, match=rf"shard {re.escape(target)} has \d+ bytes, "
                                          r"index.json says"):
        mds(root)
    os.remove(target)
    with pytest.raises(SourceError, match=rf"shard {re.escape(target)} .*cannot read"):
        mds(root)


def test_a_corrupt_compressed_shard_is_a_source_error_naming_it(packed, tmp_path):
    root = copy_of(packed[0], tmp_path)
    target = shard_path(root, 1)
    flip(target, os.path.getsize(target) // 2, 64)
    src = mds(root)
    with pytest.raises(SourceError, match=rf"{re.escape(target)}: its xxh64 is not"):
        read_all(src, 1)
    assert same_value(src.get(0), packed[1][0])  # the other shards still read
    target = shard_path(root, 2)
    with open(target, "r+b") as fh:
        fh.truncate(os.path.getsize(target) - 1)
    with pytest.raises(SourceError, match=rf"{re.escape(target)}.*truncated"):
        read_all(src, 2)


@pytest.mark.parametrize("algo", ["sha224", "sha3_256", "blake2s"])
def test_any_hash_the_writer_lists_that_hashlib_has_is_checked(tmp_path, algo):
    root = write(tmp_path / "ds", {"id": "int", "vec": "ndarray:float32:64"},
                 ({"id": i, "vec": np.full(64, i, np.float32)} for i in range(300)),
                 compression="snappy", hashes=[algo], size_limit=1 << 13)
    target = shard_path(root, 0)
    flip(target, os.path.getsize(target) // 2, 8)
    with pytest.raises(SourceError, match=rf"{re.escape(target)}: its {algo} is not"):
        read_all(mds(root), 0)


def test_a_shard_of_another_version_is_refused(small, tmp_path):
    root = copy_of(small, tmp_path)
    index = os.path.join(root, "index.json")
    obj = json.load(open(index))
    obj["shards"][0]["version"] = 7
    json.dump(obj, open(index, "w"))
    with pytest.raises(SourceError, match=r"shard version 7"):
        mds(root)


def test_a_bad_index_is_a_source_error_naming_it(small, tmp_path):
    root = copy_of(small, tmp_path)
    index = os.path.join(root, "index.json")
    with pytest.raises(SourceError, match=r"index\.json.*the directory MDSWriter wrote"):
        mds(str(tmp_path))
    good = open(index).read()
    for text, match in [("{", "not JSON"), ('{"version": 1, "shards": []}', "version 2"),
                        (good.replace('"mds"', '"json"', 1), "format 'json'"),
                        (good.replace('"shard.00000.mds"', '"../shard.00000.mds"', 1),
                         "leaves the dataset directory")]:
        with open(index, "w") as fh:
            fh.write(text)
        with pytest.raises(SourceError, match=re.escape(index) + ".*" + match):
            mds(root)


def test_arguments_are_checked_and_a_missing_library_names_the_extra(packed, monkeypatch):
    root = packed[0]
    for bad in ({"shard_cache_bytes": -1}, {"shard_cache_bytes": True}, {"columns": []},
                {"split": ""}, {"allow_unsafe_types": 1}):
        with pytest.raises(ZephonConfigError):
            mds(root, **bad)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(SourceError, match=r'zstandard.*pip install -e "\.\[mds\]"'):
        mds(root)


# --- 5. file:// URLs, globs, and a remote (fsspec) root --------------------------------


def test_a_file_url_reads_the_same(small):
    plain, url = mds(small), mds("file://" + small)
    assert url.files == plain.files
    assert all(same_value(url.get(i), plain.get(i)) for i in range(len(plain)))


def test_a_remote_root_reads_index_json_and_lists_once(small, packed):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    try:
        for name, root in (("small", small), ("packed", packed[0])):
            for f in os.listdir(root):
                fs.pipe(f"/mds-test/{name}/{f}", open(os.path.join(root, f), "rb").read())
        src = mds(["memory://mds-test/small", "memory://mds-test/packed"])
        local = mds([small, packed[0]])
        assert [r.size for r in src.refs] == [r.size for r in local.refs]
        assert all(r.remote for r in src.refs)
        assert all(same_value(src.get(i), local.get(i)) for i in range(0, len(src), 11))
    finally:
        fs.rm("/mds-test", recursive=True)


# --- 6. pickling ---------------------------------------------------------------------


def test_pickling_keeps_no_handle_and_reads_the_same(small, packed):
    src = mds([small, packed[0]])
    want = [src.get(i) for i in range(0, len(src), 13)]
    assert src._readers and src._loaded
    state = src.__getstate__()
    assert not {"_readers", "_lock", "_loaded", "_plans", "_last"} & set(state)
    blob = pickle.dumps(src)
    assert len(blob) < 20_000
    copy = pickle.loads(blob)
    assert not copy._readers and not copy._loaded
    assert all(same_value(copy.get(i), w) for i, w in zip(range(0, len(src), 13), want,
                                                          strict=True))
    assert copy.describe() == src.describe() and copy.sample_nbytes() == src.sample_nbytes()


def test_an_s3_root_builds_from_index_json_and_one_listing(small, packed):
    """Building reads index.json and lists the directory: no shard object is read; then
    every sample reads as from the local copy (raw shards by range, zstd shards whole)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from _s3_server import BUCKET, FaultProxy, MotoServer, storage_options

    server = MotoServer()
    proxy = FaultProxy(server.port)
    try:
        shards = []
        for name, root in (("small", small), ("packed", packed[0])):
            for f in os.listdir(root):
                server.put(f"mds/{name}/{f}", open(os.path.join(root, f), "rb").read())
                shards += [f] if f != "index.json" else []
        proxy.requests.clear()
        src = mds([f"s3://{BUCKET}/mds/small", f"s3://{BUCKET}/mds/packed"],
                  storage_options=storage_options(proxy.endpoint))
        built = list(proxy.requests)
        assert not [p for _, p in built if p.rsplit("/", 1)[-1] in shards]
        gets = [p for m, p in built if m == "GET"]
        assert sum(p.endswith("/index.json") for p in gets) == 2 and len(built) <= 12, built
        assert all(r.version.startswith("etag:") for r in src.refs)
        local = mds([small, packed[0]])
        assert all(same_value(src.get(i), local.get(i)) for i in range(0, len(src), 7))
    finally:
        proxy.close()
        server.stop()
