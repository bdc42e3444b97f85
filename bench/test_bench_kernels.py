"""Kernel benchmarks: each compiled kernel against its baseline, in the same run.

Run: ``python -m pytest bench/test_bench_kernels.py`` (add ``--enforce-ratios``
to fail when a target is missed). Targets (ratio = baseline time / kernel time):

- pack 1,000 leaves of 4 KiB over 4 dtypes, kernel vs reference: >= 5
- pack 4 leaves of 16 MiB, kernel vs ``np.copyto`` of the same bytes: >= 0.8
- ReorderBuffer, 1,000,000 items shuffled within windows of 64, kernel vs the
  dict-based reference: >= 10 (windows pushed with ``push_many``); the
  item-at-a-time API is reported beside it
- compaction_plan, 10,000 views on 100 regions, kernel vs reference: >= 10
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from zephon.kernels import compaction_ref, pack_ref, reorder_ref

pack_c = pytest.importorskip("zephon._kernels.pack")
compaction_c = pytest.importorskip("zephon._kernels.compaction")
reorder_c = pytest.importorskip("zephon._kernels.reorder")

PACK_POLICY = dict(min_item_bytes=4096, coalesce=True, max_coalesced_bytes=16 << 20,
                   min_new_allocation_bytes=0, alignment=64)


def small_leaves():
    dtypes = [np.float32, np.int64, np.uint8, np.float64]
    return [np.full(4096 // np.dtype(dtypes[i % 4]).itemsize, i % 128, dtype=dtypes[i % 4])
            for i in range(1000)]


def packer(module, leaves):
    plan = module.pack_plan(leaves, **PACK_POLICY)
    buffers = [np.empty(int(n), dtype=np.uint8) for n in plan.group_nbytes]

    def run():
        p = module.pack_plan(leaves, **PACK_POLICY)
        module.pack_copy(leaves, p, buffers)

    return run


@pytest.mark.parametrize("role,module", [("subject", pack_c), ("baseline", pack_ref)])
def test_pack_small_leaves(benchmark, record_ratio, role, module):
    benchmark.group = "pack 1000 x 4 KiB"
    benchmark(packer(module, small_leaves()))
    record_ratio("pack_1000x4KiB_vs_reference", role, target=5.0)


def big_leaves():
    return [np.full(16 << 20 >> 3, i, dtype=np.int64) for i in range(4)]


def test_pack_big_leaves_kernel(benchmark, record_ratio):
    benchmark.group = "pack 4 x 16 MiB"
    leaves = big_leaves()
    benchmark.pedantic(packer(pack_c, leaves), rounds=20, warmup_rounds=2)
    record_ratio("pack_4x16MiB_vs_copyto", "subject", target=0.8)


def test_pack_big_leaves_copyto(benchmark, record_ratio):
    benchmark.group = "pack 4 x 16 MiB"
    leaves = big_leaves()
    dests = [np.empty_like(a) for a in leaves]

    def run():
        for d, a in zip(dests, leaves):
            np.copyto(d, a)

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    record_ratio("pack_4x16MiB_vs_copyto", "baseline")


N_ITEMS, WINDOW = 1_000_000, 64


@pytest.fixture(scope="module")
def arrivals():
    rng = random.Random(0)
    windows = []
    for start in range(0, N_ITEMS, WINDOW):
        chunk = list(range(start, start + WINDOW))
        rng.shuffle(chunk)
        windows.append(chunk)
    return windows


def reorder_windows(module, windows):
    buf = module.ReorderBuffer(WINDOW)
    out = 0
    for chunk in windows:
        buf.push_many(chunk, chunk)
        out += len(buf.pop_ready())
    assert out == N_ITEMS


def reorder_items(module, windows):
    buf = module.ReorderBuffer(WINDOW)
    push, pop = buf.push, buf.pop_ready
    out = 0
    for chunk in windows:
        for seq in chunk:
            push(seq, seq)
            out += len(pop())
    assert out == N_ITEMS


@pytest.mark.parametrize("role,module", [("subject", reorder_c), ("baseline", reorder_ref)])
def test_reorder_windows(benchmark, record_ratio, arrivals, role, module):
    benchmark.group = "reorder 1M items, push_many per window"
    benchmark.pedantic(reorder_windows, args=(module, arrivals), rounds=3, iterations=1)
    record_ratio("reorder_1M_push_many_vs_reference", role, target=10.0)


@pytest.mark.parametrize("role,module", [("subject", reorder_c), ("baseline", reorder_ref)])
def test_reorder_items(benchmark, record_ratio, arrivals, role, module):
    benchmark.group = "reorder 1M items, one push + pop_ready per item"
    benchmark.pedantic(reorder_items, args=(module, arrivals), rounds=3, iterations=1)
    record_ratio("reorder_1M_per_item_vs_reference", role)


@pytest.fixture(scope="module")
def views():
    rng = np.random.default_rng(0)
    n, regions = 10_000, 100
    ids = rng.integers(0, regions, n)
    sizes = np.full(n, 64 << 20, dtype=np.int64)
    starts = rng.integers(0, (64 << 20) - (1 << 20), n)
    ends = starts + rng.integers(0, 1 << 20, n)
    return ids, sizes, starts, ends


COMPACTION_POLICY = dict(min_forward_bytes=128 << 10, compact_above_ratio=8.0,
                         compact_min_savings_bytes=16 << 20)


@pytest.mark.parametrize("role,module", [("subject", compaction_c),
                                         ("baseline", compaction_ref)])
def test_compaction_plan(benchmark, record_ratio, views, role, module):
    benchmark.group = "compaction_plan 10k views / 100 regions"
    benchmark(module.compaction_plan, *views, **COMPACTION_POLICY)
    record_ratio("compaction_10k_views_vs_reference", role, target=10.0)
