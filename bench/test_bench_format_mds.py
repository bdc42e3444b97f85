"""MDS shards (MosaicML Streaming): zephon's ``sources.mds`` against the library's loader.

    python -m pytest bench/test_bench_format_mds.py --benchmark-only -q [--enforce-ratios]

The corpus: 240,000 samples written by ``streaming.MDSWriter`` (loaded as
``tests/_mds_lib.py`` explains) in raw shards of 8 MiB: ``id`` (int), ``tokens``
(``ndarray:int32``, 64 tokens, shape stored per sample), ``text`` (str, 40-160 bytes),
``score`` (float32). Both loaders read it in order, in batches of 256, with 2 worker
processes:

- baseline: ``torch.utils.data.DataLoader(StreamingDataset(local=..., batch_size=256,
  shuffle=False), batch_size=256, num_workers=2)``;
- zephon: ``Pipeline(sources.mds(...), shuffle=False, num_epochs=None).batch(256)`` on
  ``RuntimeOptions(runner="process", max_workers=2, worker_allocation="per_stage_fixed")``.

A round is 32 batches (8,192 samples) of a running loader (its start is warm-up); the
ratio ``mds_process2_vs_streaming_loader`` is the library loader's time per round over
zephon's (target 1.2). StreamingDataset's shared memory and file locks are removed
after its run (``_mds_lib.library_session``).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import _mds_lib

if not _mds_lib.available():
    pytest.skip("mosaicml-streaming is not installed", allow_module_level=True)
torch = pytest.importorskip("torch")

SAMPLES, BATCH, TOKENS = 240_000, 256, 64
PER_ROUND, ROUNDS, WARMUP = 32, 20, 3  # 23 rounds of 32 batches: 188,416 samples, one epoch
NAME = "mds_process2_vs_streaming_loader"
GROUP = "MDS shards, in order, 2 workers: time per 32 batches of 256"
COLUMNS = {"id": "int", "tokens": "ndarray:int32", "text": "str", "score": "float32"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    lib = _mds_lib.load()
    out = str(tmp_path_factory.mktemp("mds-bench") / "ds")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, (SAMPLES, TOKENS), dtype=np.int32)
    lengths = rng.integers(40, 160, SAMPLES)
    letters = "abcdefghijklmnopqrstuvwxyz " * 6
    with lib.MDSWriter(out=out, columns=COLUMNS, size_limit=8 << 20) as writer:
        for i in range(SAMPLES):
            writer.write({"id": i, "tokens": tokens[i], "text": letters[:lengths[i]],
                          "score": np.float32(i / 7)})
    return out


def measure(benchmark, batches) -> None:
    it = iter(batches)
    seen = []

    def rounds():
        for _ in range(PER_ROUND):
            batch = next(it)
        assert len(batch["tokens"]) == BATCH
        seen.append(int(batch["id"][0]))

    benchmark.pedantic(rounds, rounds=ROUNDS, warmup_rounds=WARMUP)
    assert seen == sorted(seen) and seen[-1] < SAMPLES


def test_streaming_loader(benchmark, record_ratio, corpus):
    lib = _mds_lib.load()
    benchmark.group = GROUP
    with _mds_lib.library_session():
        dataset = lib.StreamingDataset(local=corpus, batch_size=BATCH, shuffle=False)
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=2)
        it = iter(loader)
        try:
            measure(benchmark, it)
        finally:
            del it, loader, dataset
    record_ratio(NAME, "baseline")


def test_zephon_mds(benchmark, record_ratio, corpus):
    from zephon import Pipeline, RuntimeOptions
    from zephon.pipeline.sources.mds import mds

    benchmark.group = GROUP
    pipe = Pipeline(mds(corpus), shuffle=False, num_epochs=None).batch(BATCH).options(
        RuntimeOptions(runner="process", max_workers=2, worker_allocation="per_stage_fixed"))
    it = iter(pipe)
    try:
        measure(benchmark, it)
    finally:
        it.close()
    record_ratio(NAME, "subject", target=1.2)
