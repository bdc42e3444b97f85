"""A weighted mixture of a Parquet and a WebDataset source: the same stream under
every runner and world size, and a checkpoint taken mid-way restores exactly."""

from __future__ import annotations

import pytest

from zephon import MixtureReadConfig, Pipeline, RuntimeOptions, sources

pytest.importorskip("pyarrow")

import _sources_fns as F  # noqa: E402
from _resume import assert_resumes  # noqa: E402
from _sources_data import write_parquet, write_shards  # noqa: E402
from _streams import keys_of

C = 4  # canonical lanes


def pipeline(tmp_path, mode="weighted_random"):
    if not list(tmp_path.glob("*.parquet")):
        write_parquet(tmp_path, files=2, rows=90, row_group=32)
        write_shards(tmp_path, shards=2, per_shard=30, start=1000)
    mix = sources.mixture(
        {"pq": sources.parquet(str(tmp_path / "*.parquet"), columns=["id"]),
         "wds": sources.webdataset(str(tmp_path / "*.tar"))},
        {"pq": 0.7, "wds": 0.3}, config=MixtureReadConfig(mode=mode, seed=9,
                                                          within_component="shuffle"))
    return Pipeline(mix, seed=5, chunk_size=8).map(F.from_mixture).shuffle(6).batch(4)


def batch_key(b) -> tuple:
    return tuple(zip(b["src"].tolist(), b["n"].tolist()))


@pytest.mark.parametrize("mode", ["weighted_random", "weighted_round_robin"])
def test_mixture_same_stream_under_every_runner(tmp_path, mode):
    pipe = pipeline(tmp_path, mode)
    ref = keys_of(pipe.options(RuntimeOptions(runner="inline", canonical_replicas=C)), batch_key)
    flat = [s for b in ref for s in b]
    # 0.7 / 0.3 of 180 Parquet rows and 60 tar samples: the epoch reads every row once
    # (180 / 0.7 = 257 positions) and the tar shard's 60 samples 77 times (a repeat)
    pq, wds = [s for s in flat if s[0] == 0], [s for s in flat if s[0] == 1]
    assert sorted(pq) == [(0, i) for i in range(180)] and len(wds) == 77
    assert set(wds) == {(1, 1000 + i) for i in range(60)}
    for runner in ("threads", "process"):
        got = keys_of(pipe.options(RuntimeOptions(runner=runner, max_workers=2,
                                                  canonical_replicas=C)), batch_key)
        assert got == ref, runner


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_mixture_checkpoint_mid_way_restores(tmp_path, runner):
    opts = RuntimeOptions(runner=runner, max_workers=2, canonical_replicas=C)
    assert_resumes(lambda: pipeline(tmp_path).options(opts), 23, key=batch_key)


def test_mixture_checkpoint_from_2_ranks_restores_on_1(tmp_path):
    """Two ranks each read their lanes and checkpoint together; one rank restores."""
    import threading

    agg = tmp_path / "agg"
    data = tmp_path / "data"
    data.mkdir()
    pipeline(data)  # write the files once
    ref = keys_of(pipeline(data).options(RuntimeOptions(canonical_replicas=C)), batch_key)
    states, heads = {}, {}

    def rank(r):
        pipe = pipeline(data).options(RuntimeOptions(
            world_size=2, global_rank=r, canonical_replicas=C, aggregate_dir=str(agg),
            aggregate_timeout_s=60.0, run_id="mixture-2-ranks"))
        it = iter(pipe)
        heads[r] = [next(it) for _ in range(7)]
        states[r] = pipe.checkpoint()
        pipe.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert states[0] == states[1]
    one = pipeline(data).options(RuntimeOptions(canonical_replicas=C))
    one.restore(states[0])
    rest = keys_of(one, batch_key)
    seen = {tuple(zip(b["src"].tolist(), b["n"].tolist())) for r in heads for b in heads[r]}
    assert sorted(seen | set(rest)) == sorted(ref) and not seen & set(rest)
