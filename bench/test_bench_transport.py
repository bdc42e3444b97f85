"""Transport benchmarks (pytest-benchmark), zephon against a baseline in the same run.

    python -m pytest bench/test_bench_transport.py [--enforce-ratios]

- 4 MiB batches from 2 spawn workers: ``WorkerPool`` vs torch's DataLoader
  (skipped without torch); target ratio >= 5.
- codec round trip of a batch of 256 small dict items, encode + decode in one
  process, vs ``pickle.dumps`` + ``pickle.loads`` of the same batch: the
  per-message cost the transport adds on top of plain pickling (reported).
- a consumer that keeps all of 300 x 4 MiB results (``list(...)``: once the
  arena is held, results travel by copy) vs one that drops each at once
  (reported: the price of keeping, expected below 1, never a stall).
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_torch as C  # noqa: E402  (the workload shared with the comparison script)

from zephon.transport import WorkerPool  # noqa: E402
from zephon.transport.arena import LeaseTable, SlabRegistry  # noqa: E402
from zephon.transport.codec import Decoder, Encoder, PeerState, ShmPolicy  # noqa: E402

BATCHES = 64


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(C.make_batch, 2) as p:
        yield p


def drain_pool(pool):
    for i in range(8):
        pool.submit(i)
    nxt = 8
    for _ in range(BATCHES):
        value = pool.get().value
        assert value["tokens"][1] == 1 + value["seq"]
        del value
        if nxt < BATCHES:
            pool.submit(nxt)
            nxt += 1


def test_pool_4mib_batches(benchmark, record_ratio, pool):
    benchmark.group = "64 x 4 MiB batches, 2 spawn workers"
    benchmark.pedantic(drain_pool, args=(pool,), rounds=5, warmup_rounds=1)
    record_ratio("pool_4MiB_vs_torch_dataloader", "subject", target=5.0)


def test_torch_dataloader_4mib_batches(benchmark, record_ratio):
    tud = pytest.importorskip("torch.utils.data")
    loader = tud.DataLoader(C.BatchDataset(BATCHES, C.TOKENS), num_workers=2, batch_size=None,
                            multiprocessing_context="spawn", persistent_workers=True)

    def drain():
        for batch in loader:
            assert int(batch["tokens"][1]) == 1 + int(batch["seq"])

    benchmark.pedantic(drain, rounds=5, warmup_rounds=1)
    record_ratio("pool_4MiB_vs_torch_dataloader", "baseline")


def small_batch():
    return C.make_small_items(0)


def test_codec_round_trip(benchmark, record_ratio):
    benchmark.group = "codec: 256 x 4 KiB items"
    leases, registry = LeaseTable(), SlabRegistry()
    encoder = Encoder(ShmPolicy(), leases, registry)
    decoder = Decoder(leases, registry, lambda owner: None, borrow_forwarded=False)
    payload = small_batch()
    peer = PeerState(can_map_fds=False)

    def round_trip():
        header, frames, fds, _ = encoder.encode(payload, peer)
        frames = [bytearray(f) for f in frames]  # what the receiver gets off the wire
        return decoder.decode(header, frames, fds)

    out = benchmark(round_trip)
    assert np.array_equal(out[5]["tokens"], payload[5]["tokens"])
    record_ratio("codec_256_items_vs_pickle", "subject")


def test_pickle_round_trip(benchmark, record_ratio):
    benchmark.group = "codec: 256 x 4 KiB items"
    payload = small_batch()
    benchmark(lambda: pickle.loads(pickle.dumps(payload, protocol=5)))
    record_ratio("codec_256_items_vs_pickle", "baseline")


KEPT = 300


def pool_values(pool, n: int, keep: bool):
    kept = []
    for i in range(8):
        pool.submit(i)
    nxt = 8
    for _ in range(n):
        value = pool.get().value
        if keep:
            kept.append(value)
        del value
        if nxt < n:
            pool.submit(nxt)
            nxt += 1
    return len(kept)


def test_pool_keeping_300_results(benchmark, record_ratio, pool):
    benchmark.group = "300 x 4 MiB results, kept vs dropped"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the one starvation warning
        kept = benchmark.pedantic(pool_values, args=(pool, KEPT, True), rounds=3,
                                  warmup_rounds=1)
    assert kept == KEPT
    record_ratio("pool_keep_300_vs_drop_300", "subject")


def test_pool_dropping_300_results(benchmark, record_ratio, pool):
    benchmark.group = "300 x 4 MiB results, kept vs dropped"
    benchmark.pedantic(pool_values, args=(pool, KEPT, False), rounds=3, warmup_rounds=1)
    record_ratio("pool_keep_300_vs_drop_300", "baseline")
