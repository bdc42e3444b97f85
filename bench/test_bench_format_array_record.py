"""ArrayRecord records in batches: zephon's process workers against Grain's DataLoader.

    python -m pytest bench/test_bench_format_array_record.py --benchmark-only [--enforce-ratios]

The corpus: 200,000 records of 0-1,023 bytes (uniform) in four shards written by
``ArrayRecordWriter`` with its default options (``group_size:1``, zstd), named as TFDS and
Grain write them (``bench.array_record-0000k-of-00004``). Both loaders read the records in
order as ``bytes`` and batch them by 64, on 2 worker processes:

- zephon: ``Pipeline(sources.array_record(paths), num_epochs=None).batch(64)`` with
  ``runner="process", max_workers=2, worker_allocation="per_stage_fixed"``;
- Grain 0.2.18: ``DataLoader(data_source=ArrayRecordDataSource(paths),
  sampler=IndexSampler(n, shuffle=False, num_epochs=1), operations=[Batch(64)],
  worker_count=2)`` (its default ``ReadOptions``: 16 reading threads per worker). Its
  worker processes are shut down after the benchmark (``close()`` of the dataset
  iterator under the DataLoaderIterator, which has none of its own), and the benchmark
  fails if any is left.

A round is 32 batches (2,048 records) of a running loader (its start and 3 rounds are
warm-up), so the ratio is Grain's time per 32 batches over zephon's. The bar is 1.2x.
Grain reads each record with ``ArrayRecordReader.read([position])``, which allocates a
list per chunk of the file on every call (its cost grows with the shard: about 0.1-0.4 ms
for a 50,000-record shard); zephon reads one with ``read(j, j + 1)`` (a few us).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

ar = pytest.importorskip("array_record.python.array_record_module")
grain = pytest.importorskip("grain.python")

SHARDS, PER_SHARD, MAX_SIZE = 4, 50_000, 1024
BATCH, PER_ROUND, ROUNDS, WARMUP = 64, 32, 15, 3
GROUP = "ArrayRecord bytes, batches of 64 on 2 workers: time per 32 batches"
NAME = "array_record_process2_vs_grain"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("array_record_bench")
    rng = np.random.default_rng(0)
    paths = []
    for k in range(SHARDS):
        path = str(root / f"bench.array_record-{k:05d}-of-{SHARDS:05d}")
        sizes = rng.integers(0, MAX_SIZE, PER_SHARD)
        blob = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8).tobytes()
        writer = ar.ArrayRecordWriter(path, "")
        at = 0
        for n in sizes.tolist():
            writer.write(blob[at:at + n])
            at += n
        writer.close()
        paths.append(path)
    return paths


def measure(benchmark, batches) -> None:
    it = iter(batches)

    def rounds():
        for _ in range(PER_ROUND):
            batch = next(it)
        assert len(batch) == BATCH

    benchmark.pedantic(rounds, rounds=ROUNDS, warmup_rounds=WARMUP)


def _children() -> list[int]:
    """The live (non-zombie) child processes of this process, but multiprocessing's
    resource tracker and forkserver (they live as long as the interpreter)."""
    me, out = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    fields = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read().decode(errors="replace")
            except OSError:
                continue
            helper = "multiprocessing.resource_tracker" in cmd or \
                "multiprocessing.forkserver" in cmd
            if fields[1] == me and fields[0] != "Z" and not helper:
                out.append(int(entry))
    return out


def test_grain_loader(benchmark, record_ratio, shards):
    from grain.sources import ArrayRecordDataSource

    benchmark.group = GROUP
    before = set(_children())
    source = ArrayRecordDataSource(shards)
    sampler = grain.IndexSampler(len(source), shard_options=grain.NoSharding(),
                                 shuffle=False, num_epochs=1)
    loader = grain.DataLoader(data_source=source, sampler=sampler,
                              operations=[grain.Batch(BATCH)], worker_count=2)
    it = iter(loader)
    try:
        measure(benchmark, it)
    finally:
        it._iterator.close()  # stops Grain's worker processes (no public close in 0.2.18)
    deadline = time.monotonic() + 30
    while set(_children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_children()) - before, "Grain's worker processes outlived close()"
    record_ratio(NAME, "baseline")


def test_zephon_array_record(benchmark, record_ratio, shards):
    from zephon import Pipeline, RuntimeOptions
    from zephon.pipeline.sources.array_record import array_record

    benchmark.group = GROUP
    pipe = Pipeline(array_record(shards), num_epochs=None).batch(BATCH).options(
        RuntimeOptions(runner="process", max_workers=2, worker_allocation="per_stage_fixed"))
    it = iter(pipe)
    try:
        measure(benchmark, it)
    finally:
        it.close()
    record_ratio(NAME, "subject", target=1.2)
