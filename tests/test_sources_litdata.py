"""sources.litdata: corpora written by litdata itself, read by zephon and checked against
``litdata.StreamingDataset``.

The big corpus (10^5 dict items: int, float, str, bytes, bool, NumPy arrays of fixed and
variable length in three dtypes, torch tensors of one and two dimensions, over several
chunks) and a token corpus (``item_loader=TokensLoader()``) are written by
``litdata.optimize`` in a subprocess: optimize sets the start method of its whole process
(forced to ``spawn`` unless told) and environment variables, which a subprocess keeps out
of this one, and its worker ends with it. It runs with ``start_method="fork"``: twice as
fast, and a forked worker's semaphores are never named in /dev/shm (a spawned one's
named semaphores were seen left behind there). The small corpora (each zstd layout,
Arrow-footer rows, nested items) are written in this process by litdata's ``Cache``, the
writer optimize drives.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

ld = pytest.importorskip("litdata")
# litdata's own reader and writer warn about what these corpora are made to have
pytestmark = [pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
              pytest.mark.filterwarnings("ignore:An item was larger than the target chunk")]
torch = pytest.importorskip("torch")  # litdata imports torch: its tensors are in the corpus

from _format_conformance import (  # noqa: E402
    check_restore_on_another_world,
    check_shuffle_modes,
    same_value,
)
from _streams import batch_key, keys_of  # noqa: E402

from zephon import Pipeline, RuntimeOptions  # noqa: E402
from zephon.errors import ZephonConfigError  # noqa: E402
from zephon.io.errors import SourceError  # noqa: E402
from zephon.pipeline.collate import collate  # noqa: E402
from zephon.pipeline.sources.litdata import LitDataSource, litdata  # noqa: E402

ITEMS, PER_INPUT = 100_000, 10_000
DOCS, DOCS_PER_INPUT, BLOCK = 3_000, 500, 96
TESTS = os.path.dirname(os.path.abspath(__file__))


_BYTES = bytes(range(256)) * 2


def record(i: int) -> dict:
    """Item ``i`` of the corpora: every leaf type litdata writes for a dict of values (the
    tensors made from NumPy: a torch op costs ~25 us, a third of the corpus's writing)."""
    return {
        "id": i,
        "score": i / 7,
        "text": f"row {i} " + "é" * (i % 5),
        "blob": _BYTES[i % 256:i % 256 + i % 11],
        "flag": i % 3 == 0,
        "emb": np.arange(6, dtype=np.float32).reshape(2, 3) + i,   # 'numpy' (2-D)
        "pos": np.arange(i % 6, dtype=np.int16) - i % 4,           # variable, maybe empty
        "vec": np.array([i, -i, i * i], dtype=np.int64),          # fixed 1-D
        "grid": torch.from_numpy(np.array([[0, i], [2 * i, 3 * i]], dtype=np.int32)),
        "w": torch.from_numpy(np.full(i % 3 + 1, i / 3)),          # 1-D: 'no_header_tensor'
    }


def records(k: int):
    """optimize's ``fn``: input ``k`` yields items ``k * PER_INPUT ...`` (one input per item
    costs litdata ~300 us of its own bookkeeping: 30 s for the corpus)."""
    for i in range(k * PER_INPUT, (k + 1) * PER_INPUT):
        yield record(i)


def document(d: int) -> np.ndarray:
    return ((np.arange(d % 397 + 1) * 31 + d) % 65_000).astype(np.uint16)


def documents(k: int):
    for d in range(k * DOCS_PER_INPUT, (k + 1) * DOCS_PER_INPUT):
        yield document(d)


WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
import litdata
from litdata.streaming.item_loader import TokensLoader
import test_sources_litdata as T

t = time.time()
litdata.optimize(fn=T.records, inputs=list(range(T.ITEMS // T.PER_INPUT)), output_dir={big!r},
                 chunk_bytes="2MB", num_workers=1, start_method="fork", verbose=False)
litdata.optimize(fn=T.documents, inputs=list(range(T.DOCS // T.DOCS_PER_INPUT)),
                 output_dir={tokens!r}, chunk_size=1 << 14, item_loader=TokensLoader(),
                 num_workers=1, start_method="fork", verbose=False)
print("WROTE", time.time() - t, flush=True)
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The big corpus and the token corpus, written by ``litdata.optimize``."""
    import psutil

    root = tmp_path_factory.mktemp("litdata")
    big, tokens = str(root / "big"), str(root / "tokens")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t = time.time()
    done = subprocess.run([sys.executable, "-c", WRITER.format(tests=TESTS, big=big,
                                                               tokens=tokens)],
                          capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"optimize wrote both corpora in {time.time() - t:.1f} s "
          f"({done.stdout.strip().splitlines()[-1]})")
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before, "litdata.optimize left a process behind"
    return big, tokens


def write(path: str, items, **options) -> str:
    """``items`` written by litdata's ``Cache`` (the writer optimize drives), in order."""
    from litdata.streaming import Cache

    cache = Cache(path, **options)
    for i, item in enumerate(items):
        cache[i] = item
    cache.done()
    cache.merge()
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write(str(tmp_path_factory.mktemp("litdata") / "small"),
                 (record(i) for i in range(1_200)), chunk_size=100)


def litdata_items(path: str, item_loader=None) -> list:
    """Every item as ``litdata.StreamingDataset`` gives it, read from a copy of the corpus
    (litdata decompresses a whole-file compressed chunk of a local corpus in place)."""
    copy = path.rstrip("/") + "-litdata-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(path, copy)
    ds = ld.StreamingDataset(input_dir=copy, item_loader=item_loader)
    items = [plain(ds[i]) for i in range(len(ds))]
    del ds
    return items


def plain(value):
    """litdata's value as zephon gives it: memoryviews as bytes, tensors as arrays."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, dict):
        return type(value)((k, plain(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


def mismatches(src, want: list) -> list[int]:
    assert len(src) == len(want)
    return [i for i in range(len(src)) if not same_value(src.get(i), want[i])]


# -- the big corpus ------------------------------------------------------------------------

def test_every_item_equals_what_litdata_reads(written):
    big, _ = written
    src = litdata(big)
    want = litdata_items(big)
    assert len(src) == len(want) == ITEMS
    bad = mismatches(src, want)
    assert not bad, (bad[:5], src.get(bad[0]), want[bad[0]])
    index = json.load(open(os.path.join(big, "index.json")))
    assert index["config"]["data_format"] == [
        "int", "float", "str", "bytes", "bool", "numpy", "no_header_numpy:1",
        "no_header_numpy:3", "tensor", "no_header_tensor:3"]
    got = src.get(12_345)
    assert same_value(got, plain(record(12_345)))  # what was written, too
    assert type(got["blob"]) is bytes and got["grid"].dtype == np.int32


def test_shards_are_the_chunks(written):
    big, _ = written
    src = litdata(big)
    chunks = json.load(open(os.path.join(big, "index.json")))["chunks"]
    assert len(chunks) >= 5
    sizes = [c["chunk_size"] for c in chunks]
    assert src.shard_bounds().tolist() == np.concatenate([[0], np.cumsum(sizes)]).tolist()
    assert src.sample_nbytes() == pytest.approx(sum(c["chunk_bytes"] for c in chunks) / ITEMS)
    names = [name for name, _, _ in src.stamps()]
    assert names == [c["filename"] for c in chunks] + ["index.json"]


def test_get_batch_is_what_batch_makes_of_the_items(written):
    big, _ = written
    src = litdata(big)
    cross = int(src.shard_bounds()[3])
    rng = np.random.default_rng(4)
    for idx in (np.arange(cross - 70, cross + 70),  # a run across two chunks
                rng.choice(ITEMS, 150, replace=False),  # scattered
                np.array([ITEMS - 1, 0, 0, 5]),
                np.arange(60, 66) * 6):  # equal-length 'pos': stacked
        got = src.get_batch(idx)
        assert same_value(got, collate([src.get(i) for i in idx.tolist()])), idx
        assert got["emb"].shape == (len(idx), 2, 3) and got["id"].dtype == np.int64
    assert src.get_batch([]) is None
    with pytest.raises(IndexError):
        src.get_batch([ITEMS])


def test_a_pass_of_batches_holds_every_item(written):
    big, _ = written
    pipe = Pipeline(litdata(big), shuffle=False, num_epochs=1).batch(512, drop_last=False)
    ids = np.concatenate([b["id"] for b in pipe])
    assert ids.tolist() == list(range(ITEMS))


# -- TokensLoader ----------------------------------------------------------------------------

def test_token_windows_equal_tokensloader(written):
    from litdata.streaming.item_loader import TokensLoader

    _, tokens = written
    src = litdata(tokens, block_size=BLOCK)
    want = litdata_items(tokens, TokensLoader(BLOCK))
    chunks = json.load(open(os.path.join(tokens, "index.json")))["chunks"]
    assert len(chunks) >= 5 and len(src) == len(want) == sum(c["dim"] // BLOCK for c in chunks)
    bad = [i for i in range(len(src)) if not same_value(src.get(i), {"tokens": want[i]})]
    assert not bad, bad[:5]
    assert src.known_tokens_per_sample() == BLOCK and src.sample_nbytes() == 2 * BLOCK
    cross = int(src.shard_bounds()[2])
    idx = np.concatenate([np.arange(cross - 5, cross + 5), [0, len(src) - 1]])
    assert same_value(src.get_batch(idx), collate([src.get(i) for i in idx.tolist()]))
    with pytest.raises(ZephonConfigError, match="block_size"):
        litdata(tokens)
    check_shuffle_modes(litdata(tokens, block_size=4 * BLOCK))


# -- the other layouts -----------------------------------------------------------------------

@pytest.mark.parametrize("level", ["batch", "chunk", "sample"])
def test_zstd_layouts(tmp_path, level):
    path = write(str(tmp_path / level), (record(i) for i in range(900)), chunk_bytes=40_000,
                 compression="zstd", compression_level=level)
    config = json.load(open(os.path.join(path, "index.json")))["config"]
    assert config["compression"] == "zstd"
    src = litdata(path, cache_bytes=100_000)  # smaller than the chunks: the LRU turns over
    assert len(src.files) >= 5
    want = litdata_items(path)
    assert not mismatches(src, want)
    assert same_value(src.get_batch(np.arange(len(src))), collate(want))
    if level == "chunk":
        # litdata's reader decompresses a local chunk in place (X.zstd.bin -> X.bin): the
        # corpus it leaves is read too
        copy = path + "-litdata-copy"
        assert any(not f.endswith(".zstd.bin") for f in os.listdir(copy) if f.endswith(".bin"))
        assert not mismatches(litdata(copy), want)


def test_arrow_footer_rows(tmp_path):
    pytest.importorskip("pyarrow")
    rows = [{"id": i, "text": f"t{i}", "tags": [f"a{k}" for k in range(i % 3)],
             "blob": b"x" * (i % 4), "maybe": None if i % 5 == 0 else i * 2}
            for i in range(1_000)]
    path = write(str(tmp_path / "rows"), rows, chunk_bytes=8_000)
    with open(os.path.join(path, sorted(os.listdir(path))[0]), "rb") as fh:
        assert fh.read()[-8:] == b"LDARW01\0"  # the rows live in the Arrow footer only
    src = litdata(path)
    want = litdata_items(path)
    assert not mismatches(src, want)
    assert src.get(10) == rows[10] and src.get(7)["tags"] == ["a0"]
    assert same_value(src.get_batch(np.arange(200, 700)), collate(want[200:700]))


def nested(i: int) -> dict:
    """A nested item: tuples, dicts and lists in it, a JSON-like list (litdata's 'json'
    leaf), a set (a 'pickle' leaf); an OrderedDict inside a tuple stays one (litdata makes
    a dict of a dict-typed field)."""
    return {"id": i, "pair": (i, f"p{i}", collections.OrderedDict([("z", i), ("y", i / 2)])),
            "inner": {"a": i, "l": [i, i + 1]}, "obj": {i, i + 1},
            "arr": np.arange(3, dtype=np.uint8) + i % 7}


def test_nested_items_and_litdata_leaves(tmp_path):
    path = write(str(tmp_path / "nested"), (nested(i) for i in range(500)), chunk_size=64)
    formats = json.load(open(os.path.join(path, "index.json")))["config"]["data_format"]
    assert {"json", "pickle"} <= set(formats)
    src = litdata(path)
    want = litdata_items(path)
    assert not mismatches(src, want)
    got = src.get(3)
    assert got["pair"][:2] == (3, "p3") and got["obj"] == {3, 4} and got["inner"]["l"] == [3, 4]
    assert type(got["pair"][2]) is collections.OrderedDict and list(got["pair"][2]) == ["z", "y"]
    assert same_value(src.get_batch([5, 6, 7, 99]), collate([want[i] for i in (5, 6, 7, 99)]))
    tuples = write(str(tmp_path / "tuples"), ((i, np.arange(i % 4)) for i in range(300)),
                   chunk_size=50)
    src = litdata(tuples)
    assert not mismatches(src, litdata_items(tuples))
    assert src.get_batch([1, 2]) is None  # not dicts: read one by one


# -- the conformance checks (small corpus) ----------------------------------------------------

def test_shuffle_modes(small):
    check_shuffle_modes(litdata(small))


# (2, 3) does not compare for any source: on 3 ranks the 4 lanes advance unevenly (see
# check_restore_on_another_world)
@pytest.mark.parametrize(("saved", "restored"), [(2, 4), (3, 1)])
def test_restore_on_another_world(small, tmp_path, saved, restored):
    check_restore_on_another_world(lambda: litdata(small), tmp_path, saved, restored,
                                   total=48, cut=24)


def test_process_workers_give_the_inline_stream(small):
    def run(**opts):
        pipe = Pipeline(litdata(small), shuffle=True, seed=3, chunk_size=32).batch(16)
        return keys_of(pipe.options(RuntimeOptions(**opts)), batch_key)

    assert run(runner="process", max_workers=2) == run(runner="inline")


def test_file_url_and_the_index_path(small):
    want = [litdata(small).get(i) for i in (0, 99, 100, 1_199)]
    for root in (f"file://{small}", os.path.join(small, "index.json"), small + "/"):
        src = litdata(root)
        assert len(src) == 1_200 and src.describe() == litdata(small).describe()
        assert all(same_value(src.get(i), w) for i, w in zip((0, 99, 100, 1_199), want,
                                                              strict=True))


def test_a_remote_root_reads_its_own_chunks_not_a_sub_folder_s(tmp_path):
    """A remote listing is recursive: a sub-corpus in a sub-folder holding chunks of the
    same names must not stand in for the root's (chunk-compressed corpora list the folder
    for the compressed files' sizes)."""
    import fsspec

    a = write(str(tmp_path / "a"), (record(i) for i in range(300)), chunk_size=100,
              compression="zstd", compression_level="chunk")
    b = write(str(tmp_path / "b"), (record(i + 5_000) for i in range(300)), chunk_size=100,
              compression="zstd", compression_level="chunk")
    fs = fsspec.filesystem("memory")
    try:
        for folder, target in ((a, "/litcorpus"), (b, "/litcorpus/v2")):
            for name in os.listdir(folder):
                fs.pipe(f"{target}/{name}", open(os.path.join(folder, name), "rb").read())
        src = litdata("memory://litcorpus")
        assert all("/v2/" not in f for f in src.files)
        want = litdata_items(a)
        assert not mismatches(src, want)
    finally:
        fs.rm("/litcorpus", recursive=True)


def test_a_directory_whose_name_holds_brackets_is_read_as_named(small, tmp_path):
    import shutil

    path = str(tmp_path / "runs" / "lr[0.1]")
    shutil.copytree(small, path)
    assert len(litdata(path)) == 1_200


def test_a_missing_pyarrow_for_arrow_footer_items_is_named_when_built(tmp_path):
    pytest.importorskip("pyarrow")
    path = write(str(tmp_path / "rows"), ({"id": i, "text": f"t{i}"} for i in range(300)),
                 chunk_bytes=4_000)
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            "from zephon.pipeline.sources.litdata import litdata\n"
            f"litdata({path!r})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "Arrow footers" in out.stderr and "pyarrow" in out.stderr


def test_pickling_keeps_no_handle_and_reads_the_same(small):
    src = litdata(small)
    first = [src.get(i) for i in (0, 150, 1_199)]
    assert src._readers and src._lru  # it read: readers and chunk headers are held
    state = src.__getstate__()
    assert not {"_readers", "_lock", "_lru", "_plan"} & set(state)
    blob = pickle.dumps(src)
    assert len(blob) < 20_000
    again = pickle.loads(blob)
    assert isinstance(again, LitDataSource) and not again._readers
    assert all(same_value(again.get(i), w) for i, w in zip((0, 150, 1_199), first,
                                                            strict=True))


# -- failures --------------------------------------------------------------------------------

def corrupt_copy(small, tmp_path, chunk: int, how) -> tuple[LitDataSource, str]:
    path = str(tmp_path / "corrupt")
    shutil.copytree(small, path)
    src = litdata(path)  # built before the damage: the index is intact
    name = src.files[chunk]
    with open(name, "r+b") as fh:
        how(fh, os.path.getsize(name))
    return src, os.path.basename(name)


def flip(offset_of):
    def how(fh, size):
        at = offset_of(size)
        fh.seek(at)
        data = bytearray(fh.read(256))
        fh.seek(at)
        fh.write(bytes(b ^ 0xFF for b in data))
    return how


def read_chunk(src, chunk: int) -> None:
    lo, hi = src.shard_bounds()[chunk:chunk + 2].tolist()
    for i in range(lo, hi):
        src.get(i)


@pytest.mark.parametrize("where", ["middle", "offsets", "truncated"])
def test_a_damaged_chunk_names_its_file(small, tmp_path, where):
    how = {"middle": flip(lambda size: size // 2),
           "offsets": flip(lambda size: 8),
           "truncated": lambda fh, size: fh.truncate(size // 2)}[where]
    src, name = corrupt_copy(small, tmp_path, 3, how)
    read_chunk(src, 2)  # the others still read
    with pytest.raises(SourceError, match=re.escape(name)):
        read_chunk(src, 3)
    with pytest.raises(SourceError, match=re.escape(name)):
        src.get_batch(np.arange(*src.shard_bounds()[3:5].tolist()))


@pytest.mark.parametrize("level", ["batch", "chunk"])
def test_a_damaged_compressed_chunk_names_its_file(tmp_path, level):
    path = write(str(tmp_path / level), (record(i) for i in range(600)), chunk_bytes=40_000,
                 compression="zstd", compression_level=level)
    src = litdata(path)
    name = src.files[1]
    with open(name, "r+b") as fh:
        fh.truncate(os.path.getsize(name) - 100)
    with pytest.raises(SourceError, match=re.escape(os.path.basename(name))):
        read_chunk(src, 1)


def edited(small, tmp_path, change) -> str:
    path = str(tmp_path / "edited")
    shutil.copytree(small, path)
    index = os.path.join(path, "index.json")
    data = json.load(open(index))
    change(data)
    with open(index, "w") as fh:
        json.dump(data, fh)
    return path


def test_what_cannot_be_read_is_refused_when_built(small, tmp_path):
    with pytest.raises(SourceError, match=r"index\.json"):
        litdata(str(tmp_path / "nowhere"))
    cases = [
        (lambda d: d["config"].update(encryption={"level": "chunk"}), "encrypted"),
        (lambda d: d["config"].update(item_loader="ParquetLoader"), "sources.parquet"),
        (lambda d: d["config"].update(compression="lz4"), "zstd only"),
        (lambda d: d["config"]["data_format"].__setitem__(0, "mystery"), "no litdata serializer"),
        (lambda d: d["config"]["data_format"].pop(), "leaves"),
        (lambda d: d.pop("chunks"), "not a litdata index"),
    ]
    for k, (change, message) in enumerate(cases):
        with pytest.raises(SourceError, match=message):
            litdata(edited(small, tmp_path / str(k), change))
    with pytest.raises(ZephonConfigError, match="block_size applies to TokensLoader"):
        litdata(small, block_size=8)
    wrong = edited(small, tmp_path / "count", lambda d: d["chunks"][0].update(chunk_size=99))
    with pytest.raises(SourceError, match=r"chunk-0-0\.bin: holds 100 items, index\.json says 99"):
        litdata(wrong).get(0)
