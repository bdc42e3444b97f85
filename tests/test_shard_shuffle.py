"""The shard-window epoch order (``Pipeline(shuffle="shards")``, zephon.pipeline.shards).

What is pinned: each epoch is a bijection; the closed form of the block fallback is the
table form of equal shards; the locality promise (a shard's samples lie in its window's
span and windows never interleave, so a reader keeping the last W shards open opens
each shard once per epoch, on the whole stream and on every lane's); determinism over
runners; resume, elastic restore; bounded cost at n = 10^10 with 10^6 shards; the
sources' shard bounds; the fingerprint and the option checks.
"""

from __future__ import annotations

import functools
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _pipeline_fns as F
import _shard_fns as S
from _resume import END, assert_resumes, passes
from _sources_data import write_parquet, write_shards
from zephon import CheckpointError, Pipeline, RuntimeOptions, ZephonConfigError, sources
from zephon.pipeline import lanes
from zephon.pipeline.records import Boundary
from zephon.pipeline.shards import BLOCK, ShardShuffle


def order_of(n, bounds, window, seed=3, epoch=0):
    return ShardShuffle(n, bounds, window).slice(seed, epoch, 0, n)


def shard_ids(bounds, indices):
    return np.searchsorted(bounds, indices, side="right") - 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 400), shards=st.integers(1, 40), window=st.integers(1, 9),
       seed=st.integers(0, 2**32), epoch=st.integers(0, 5), cut=st.integers(1, 50))
def test_every_epoch_is_a_bijection_and_slices_agree(n, shards, window, seed, epoch, cut):
    bounds = S.uneven_bounds(n, shards, seed % 1000)
    order = ShardShuffle(n, bounds, window)
    whole = order.slice(seed, epoch, 0, n)
    assert sorted(whole.tolist()) == list(range(n))
    parts = [order.slice(seed, epoch, a, a + cut) for a in range(0, n, cut)]
    assert np.concatenate([whole[:0], *parts]).tolist() == whole.tolist()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), block=st.integers(1, 60), window=st.integers(1, 6),
       seed=st.integers(0, 2**32), epoch=st.integers(0, 3))
def test_blocks_in_closed_form_equal_the_table_of_equal_shards(n, block, window, seed,
                                                                epoch):
    table = np.append(np.arange(0, n, block), n)
    closed = ShardShuffle(n, None, window, block=block).slice(seed, epoch, 0, n)
    assert closed.tolist() == ShardShuffle(n, table, window).slice(seed, epoch, 0, n).tolist()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 600), shards=st.integers(1, 50), window=st.integers(1, 8),
       seed=st.integers(0, 2**32))
def test_a_shard_lies_in_its_window_and_windows_never_interleave(n, shards, window, seed):
    bounds = S.uneven_bounds(n, shards, seed % 1000)
    visited = shard_ids(bounds, order_of(n, bounds, window, seed))
    # the window of each position: shards in first-visit order, W at a time
    first_seen = {s: i for i, s in reversed(list(enumerate(visited)))}
    rank = {s: r for r, s in enumerate(sorted(first_seen, key=first_seen.get))}
    windows = np.array([rank[s] // window for s in visited])
    assert (np.diff(windows) >= 0).all()
    sizes = np.diff(bounds)
    for w in np.unique(windows):
        members = {s for s in visited[windows == w]}
        assert len(members) <= window
        span = np.flatnonzero(windows == w)
        assert span[-1] - span[0] + 1 == sizes[list(members)].sum()
    assert S.opens(visited.tolist(), window) == len(first_seen)


@pytest.mark.parametrize("lanes_count", [1, 3, 4])
def test_each_lane_opens_each_shard_at_most_once_per_epoch(lanes_count):
    n, window = 3000, 4
    bounds = S.uneven_bounds(n, 60, 7)
    order = ShardShuffle(n, bounds, window)
    for lane in range(lanes_count):
        for epoch in (0, 1):
            units = lanes.lane_units(n, 5, order, 16, lanes_count, lane, 0, epoch + 1,
                                     Boundary(epoch, 0))
            read = np.concatenate([u.indices for u in units if not isinstance(u, Boundary)])
            shards = shard_ids(bounds, read).tolist()
            assert S.opens(shards, window) == len(set(shards))


def test_epochs_and_seeds_give_other_orders():
    n, bounds = 1000, S.uneven_bounds(1000, 30, 1)
    orders = {tuple(order_of(n, bounds, 4, seed, epoch)) for seed in (0, 1)
              for epoch in (0, 1, 2)}
    assert len(orders) == 6
    first_shards = {int(shard_ids(bounds, order_of(n, bounds, 4, 0, e)[:1])[0])
                    for e in range(8)}
    assert len(first_shards) > 1  # the shard order itself changes per epoch


def test_locality_through_the_pipeline_against_the_global_shuffle():
    """A window of 1000 consecutive samples touches at most 2 W shards (it crosses at
    most one window edge here: windows hold about 2000 samples); the global shuffle
    touches nearly all 100; an LRU(W) reader opens each shard once per epoch."""
    n, window = 50_000, 4
    bounds = np.linspace(0, n, 101).astype(np.int64)
    touched, opened = {}, {}
    for mode in (True, "shards"):
        src = S.CountingSource(n, bounds)
        extra = {"shuffle_window": window} if mode == "shards" else {}
        pipe = Pipeline(src, shuffle=mode, chunk_size=64, num_epochs=2, **extra)
        got = [b["id"] for b in pipe.batch(500).options(RuntimeOptions(canonical_replicas=1))]
        assert sorted(np.concatenate(got).tolist()) == sorted(list(range(n)) * 2)
        reads = np.array(src.reads[len(src.reads) - 2 * n:])  # after the validation probe
        assert len(src.reads) - 2 * n <= 1
        touched[mode] = max(len(set(reads[a:a + 1000].tolist())) for a in range(0, n, 1000))
        opened[mode] = [S.opens(reads[e * n:(e + 1) * n].tolist(), window) for e in (0, 1)]
    assert touched["shards"] <= 2 * window
    assert touched[True] > 90
    assert opened["shards"] == [100, 100]
    assert min(opened[True]) > n // 2


def chain(src, **extra):
    return Pipeline(src, seed=4, chunk_size=5, shuffle="shards", shuffle_window=3,
                    num_epochs=2, **extra).map(F.double).filter(F.keep_most).batch(4)


def batch_key(b):
    return (b.meta["lane"], b.meta["lane_index"], tuple(b["tokens"][0].tolist()),
            tuple(tuple(i) for i in b.meta["sample_ids"]))


@pytest.mark.parametrize("runner,workers", [("threads", 3), ("process", 2)])
def test_runners_agree_with_inline(runner, workers):
    pipe = chain(S.ShardedSamples(300, S.uneven_bounds(300, 17, 2)))
    reference = [batch_key(b) for b in pipe.options(RuntimeOptions(canonical_replicas=2))]
    got = [batch_key(b) for b in pipe.options(RuntimeOptions(
        canonical_replicas=2, runner=runner, max_workers=workers, prefetch_batches=3))]
    assert got == reference


def _resumable(kind: str):
    src = S.ShardedSamples(300, S.uneven_bounds(300, 17, 2))
    opts = RuntimeOptions(canonical_replicas=3)
    if kind == "cursor":
        return chain(src).options(opts)
    return Pipeline(src, seed=4, chunk_size=5, shuffle="shards",
                    num_epochs=2).shuffle(7).batch(3).options(opts)


@functools.cache
def _uninterrupted(kind: str) -> tuple:
    """The first two passes of a :func:`_resumable` pipeline (made once per kind)."""
    return tuple(passes(lambda: _resumable(kind), 2, batch_key))


@pytest.mark.parametrize("k", [1, 37, 80, END])
def test_cursor_and_replay_resume(k):
    for kind in ("cursor", "replay"):
        reference, following = _uninterrupted(kind)
        assert_resumes(lambda kind=kind: _resumable(kind), k, key=batch_key,
                       reference=reference, following=following)


def test_the_mode_is_in_the_fingerprint_and_a_state_refuses_another_mode():
    src = S.ShardedSamples(100, S.uneven_bounds(100, 9, 3))
    prints = {Pipeline(src, **kw).fingerprint() for kw in (
        {}, {"shuffle": False}, {"shuffle": "shards"},
        {"shuffle": "shards", "shuffle_window": 2})}
    assert len(prints) == 4
    plain = Pipeline(src, shuffle=True)
    assert Pipeline(src, shuffle=True).fingerprint() == plain.fingerprint()
    it = iter(Pipeline(src, shuffle="shards"))
    next(it)
    state = it.checkpoint()
    it.close()
    with pytest.raises(CheckpointError, match="from a different pipeline"):
        plain.restore(state)


@pytest.mark.parametrize("kw,match", [
    ({"shuffle": "blocks"}, "shuffle must be True, False or \"shards\""),
    ({"shuffle": 1}, "shuffle must be"),
    ({"shuffle": "shards", "shuffle_window": 0}, "shuffle_window must be an int >= 1"),
    ({"shuffle": "shards", "shuffle_window": True}, "shuffle_window must be"),
    ({"shuffle": True, "shuffle_window": 4}, "shuffle_window=4 needs shuffle=\"shards\""),
])
def test_options_are_checked(kw, match):
    with pytest.raises(ZephonConfigError, match=match):
        Pipeline(sources.from_sequence([1, 2, 3]), **kw)


@pytest.mark.parametrize("bounds", [[1, 5], [0, 4], [0, 3, 2, 5], [[0, 5]], [0.0, 5.0]])
def test_wrong_shard_bounds_are_named(bounds):
    with pytest.raises(ZephonConfigError, match=r"ConstantSource\.shard_bounds"):
        Pipeline(S.ConstantSource(5, np.asarray(bounds)), shuffle="shards")


def test_a_source_without_shards_is_read_in_blocks():
    n = 3 * BLOCK + 5
    pipe = Pipeline(sources.from_callable(n, int), shuffle="shards", shuffle_window=1,
                    chunk_size=1000)
    got = np.array(list(pipe))
    assert sorted(got.tolist()) == list(range(n))
    blocks = got // BLOCK
    assert (np.diff(np.flatnonzero(np.diff(blocks))) > 0).all()
    assert len(np.flatnonzero(np.diff(blocks))) == 3  # four blocks, each in one stretch
    assert "shards(window=1, blocks=4, block=4096)" in pipe.plan().explain()


def test_shard_bounds_of_the_file_sources(tmp_path):
    pytest.importorskip("pyarrow")
    parquet = sources.parquet(write_parquet(tmp_path, files=2, rows=100, row_group=30))
    assert parquet.shard_bounds().tolist() == [0, 30, 60, 90, 100, 130, 160, 190, 200]
    tars = sources.webdataset(write_shards(tmp_path, shards=3, per_shard=7))
    assert tars.shard_bounds().tolist() == [0, 7, 14, 21]
    for k, rows in enumerate((3, 0, 2)):
        (tmp_path / f"f{k}.jsonl").write_text("".join(f'{{"k": {k}}}\n' for _ in range(rows)))
    lines = sources.jsonl([str(tmp_path / f"f{k}.jsonl") for k in range(3)])
    bounds = lines.shard_bounds()
    assert bounds.tolist() == [0, 3, 3, 5]
    for s in range(3):
        assert {lines.get(i)["k"] for i in range(bounds[s], bounds[s + 1])} <= {s}
    ids = [i for b in Pipeline(parquet, shuffle="shards", shuffle_window=2).batch(10)
           for i in b["id"].tolist()]
    assert sorted(ids) == list(range(200))


@pytest.mark.parametrize("with_table", [True, False])
def test_ten_billion_samples_in_a_million_shards_start_in_bounded_memory(with_table):
    """The first batch costs the shard table (8 bytes a shard, per epoch kept), never
    anything of the epoch's size (8 * 10^10 bytes)."""
    n, shards = 10**10, 10**6
    bounds = None
    if with_table:
        bounds = np.linspace(0, n, shards + 1).astype(np.int64)
        bounds[1:-1] += np.random.default_rng(0).integers(-4000, 4000, shards - 1)
    table_bytes = 8 * (shards + 1)
    tracemalloc.start()
    try:
        pipe = Pipeline(S.ConstantSource(n, bounds), shuffle="shards", num_epochs=None)
        it = iter(pipe.batch(64))
        batch = next(it)
        it.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(batch["id"]) == 64
    assert peak <= (6 * table_bytes if with_table else 0) + (16 << 20), peak
    if with_table:  # the first batch comes from the first window's 8 shards
        assert len(set(shard_ids(bounds, batch["id"]).tolist())) <= 8
