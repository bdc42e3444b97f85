"""Source benchmarks (pytest-benchmark): zephon's file sources against plain readers
of the same files, measured in the same run.

    python -m pytest bench/test_bench_sources.py -p no:cacheprovider [--enforce-ratios]

- ``parquet_inline_vs_pyarrow``: rows/s of ``parquet(...) -> batch(256)`` on the
  inline runner vs pyarrow's ``iter_batches`` over the same files and columns,
  converted to numpy (target >= 0.8).
- ``parquet_process2_vs_inline``: the same pipeline with the process runner and 2
  workers (``worker_allocation="per_stage_fixed"``: a read-only stage otherwise gets one
  worker) vs inline, in the steady state: each round builds its source and pipeline
  and takes the first batch outside the timing (for the process runner that is
  spawning and starting the workers, reported as ``startup_s`` in the benchmark's
  ``extra_info``), then times the rest of the epoch (target >= 1.5; needs 2 idle
  cores). A 4M-row corpus takes under a second, so start-up would otherwise be what
  is measured; a real corpus takes hours per epoch.
- ``parquet_shuffled_vs_sequential``: ``parquet(..., shuffle=True)`` vs sequential
  reads of the same files (target >= 0.67, i.e. shuffled costs at most 1.5x).
- ``webdataset_vs_tarfile``: samples/s of ``webdataset(...)`` vs iterating the same
  shards with ``tarfile`` sequentially, grouping members by key (target >= 0.8).
- ``remote_epoch2_vs_local``: a second epoch over Parquet files on a moto S3 server
  on 127.0.0.1 (cache enabled) vs the same files on local disk (target >= 0.83,
  i.e. within 1.2x).
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
import time

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from zephon import Pipeline, RuntimeOptions, StoreOptions, sources  # noqa: E402

# A corpus a user would care about: 4M rows in 16 files of 5 row groups (about 1-2 s for
# pyarrow alone), so that a runner's start-up (spawning workers) is not what is measured.
FILES, ROWS, GROUP, BATCH = 16, 250_000, 50_000, 256
COLUMNS = ["id", "score", "vec"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for f in range(FILES):
        ids = np.arange(f * ROWS, (f + 1) * ROWS, dtype=np.int64)
        vec = pa.FixedSizeListArray.from_arrays(
            pa.array(rng.integers(0, 50_000, ROWS * 8, dtype=np.int32)), 8)
        table = pa.table({"id": ids, "score": rng.random(ROWS, dtype=np.float32),
                          "vec": pa.ListArray.from_arrays(
                              pa.array(np.arange(0, ROWS * 8 + 1, 8, dtype=np.int32)),
                              vec.flatten()),
                          "text": [f"row {i}" for i in ids]})
        pq.write_table(table, d / f"part-{f:03d}.parquet", row_group_size=GROUP)
    return d


def run_zephon(make_src, opts=None, shuffle=False) -> int:
    """One epoch, source built in the round: a source keeps a cache of decoded row groups,
    which must not carry a round's reads into the next."""
    pipe = Pipeline(make_src(), shuffle=shuffle, chunk_size=BATCH).batch(BATCH)
    if opts is not None:
        pipe = pipe.options(opts)
    rows = 0
    for batch in pipe:
        rows += len(batch["id"])
    assert rows == FILES * ROWS
    return rows


def started(make_src, opts, benchmark):
    """``pedantic`` setup of a steady-state round: source, pipeline and first batch (the
    runner's start-up), outside the timing."""
    def setup():
        t0 = time.perf_counter()
        it = iter(Pipeline(make_src(), shuffle=False, chunk_size=BATCH).batch(BATCH)
                  .options(opts))
        rows = len(next(it)["id"])
        benchmark.extra_info.setdefault("startup_s", []).append(time.perf_counter() - t0)
        return (it, rows), {}
    return setup


def drain(it, rows: int) -> int:
    for batch in it:
        rows += len(batch["id"])
    assert rows == FILES * ROWS
    return rows


def parquet_source(corpus, **kw):
    return lambda: sources.parquet(str(corpus), columns=COLUMNS, **kw)


def run_pyarrow(directory) -> int:
    rows = 0
    for path in sorted(directory.glob("*.parquet")):
        for rb in pq.ParquetFile(path).iter_batches(batch_size=BATCH, columns=COLUMNS):
            batch = {"id": rb.column(0).to_numpy(), "score": rb.column(1).to_numpy(),
                     "vec": rb.column(2).flatten().to_numpy().reshape(-1, 8)}
            rows += len(batch["id"])
    assert rows == FILES * ROWS
    return rows


def test_parquet_pyarrow_loop(benchmark, record_ratio, corpus):
    benchmark.group = "parquet rows"
    benchmark.pedantic(run_pyarrow, args=(corpus,), rounds=3, warmup_rounds=1)
    record_ratio("parquet_inline_vs_pyarrow", "baseline", target=0.8)


def test_parquet_inline(benchmark, record_ratio, corpus):
    benchmark.group = "parquet rows"
    benchmark.pedantic(run_zephon, args=(parquet_source(corpus), RuntimeOptions(
        runner="inline")), rounds=3, warmup_rounds=1)
    record_ratio("parquet_inline_vs_pyarrow", "subject", target=0.8)
    record_ratio("parquet_shuffled_vs_sequential", "baseline", target=0.67)


def test_parquet_inline_steady(benchmark, record_ratio, corpus):
    benchmark.group = "parquet rows, steady state"
    opts = RuntimeOptions(runner="inline")
    benchmark.pedantic(drain, setup=started(parquet_source(corpus), opts, benchmark),
                       rounds=5, warmup_rounds=1)
    record_ratio("parquet_process2_vs_inline", "baseline", target=1.5)


def test_parquet_process_2_workers(benchmark, record_ratio, corpus):
    benchmark.group = "parquet rows, steady state"
    opts = RuntimeOptions(runner="process", max_workers=2,
                          worker_allocation="per_stage_fixed")
    benchmark.pedantic(drain, setup=started(parquet_source(corpus), opts, benchmark),
                       rounds=5, warmup_rounds=1)
    record_ratio("parquet_process2_vs_inline", "subject", target=1.5)


def test_parquet_shuffled_at_the_source(benchmark, record_ratio, corpus):
    benchmark.group = "parquet rows"
    benchmark.pedantic(run_zephon, args=(parquet_source(corpus, shuffle=True, seed=1),
                                         RuntimeOptions(runner="inline")), rounds=3,
                       warmup_rounds=1)
    record_ratio("parquet_shuffled_vs_sequential", "subject", target=0.67)


# -- webdataset ------------------------------------------------------------------------------
SHARDS, PER_SHARD = 4, 2_500


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(1)
    for s in range(SHARDS):
        with tarfile.open(d / f"shard-{s:03d}.tar", "w") as tar:
            for k in range(PER_SHARD):
                for ext, size in (("jpg", 2_000), ("json", 100)):
                    data = rng.integers(0, 255, size, dtype=np.uint8).tobytes()
                    info = tarfile.TarInfo(f"{s * PER_SHARD + k:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return d


def run_tarfile(directory) -> int:
    n = 0
    for path in sorted(directory.glob("*.tar")):
        current, sample = None, {}
        with tarfile.open(path) as tar:
            for member in tar:
                key, ext = member.name.split(".", 1)
                if key != current:
                    n += bool(sample)
                    current, sample = key, {"__key__": key}
                sample[ext] = tar.extractfile(member).read()
        n += bool(sample)
    assert n == SHARDS * PER_SHARD
    return n


def run_webdataset(make_src) -> int:
    n = sum(1 for _ in Pipeline(make_src(), shuffle=False, chunk_size=256))
    assert n == SHARDS * PER_SHARD
    return n


def test_tarfile_loop(benchmark, record_ratio, shards):
    benchmark.group = "webdataset samples"
    benchmark.pedantic(run_tarfile, args=(shards,), rounds=3, warmup_rounds=1)
    record_ratio("webdataset_vs_tarfile", "baseline", target=0.8)


def test_webdataset_inline(benchmark, record_ratio, shards):
    benchmark.group = "webdataset samples"
    benchmark.pedantic(run_webdataset, args=(lambda: sources.webdataset(str(shards / "*.tar")),),
                       rounds=3, warmup_rounds=1)
    record_ratio("webdataset_vs_tarfile", "subject", target=0.8)


# -- remote (moto on loopback, cache enabled) vs local --------------------------------------------
@pytest.fixture(scope="module")
def remote_corpus(corpus, tmp_path_factory):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from _s3_server import BUCKET, MotoServer, storage_options

    server = MotoServer()
    try:
        for path in sorted(corpus.glob("*.parquet")):
            server.put(f"bench/{path.name}", path.read_bytes())
        io_opts = StoreOptions(cache_enabled=True,
                               cache_root=str(tmp_path_factory.mktemp("cache")))
        def src():  # built in each round: its footers come through the file cache too
            return sources.parquet(f"s3://{BUCKET}/bench/*.parquet", columns=COLUMNS,
                                   storage_options=storage_options(server.endpoint),
                                   io_options=io_opts)
        opts = RuntimeOptions(runner="inline", io_options=io_opts)
        run_zephon(src, opts)  # the first epoch fills the cache
        yield src, opts
    finally:
        server.stop()


def test_local_epoch(benchmark, record_ratio, corpus):
    benchmark.group = "remote vs local"
    benchmark.pedantic(run_zephon, args=(parquet_source(corpus), RuntimeOptions(
        runner="inline")), rounds=3, warmup_rounds=1)
    record_ratio("remote_epoch2_vs_local", "baseline", target=0.83)


def test_remote_second_epoch(benchmark, record_ratio, remote_corpus):
    benchmark.group = "remote vs local"
    src, opts = remote_corpus
    benchmark.pedantic(run_zephon, args=(src, opts), rounds=3, warmup_rounds=1)
    record_ratio("remote_epoch2_vs_local", "subject", target=0.83)
