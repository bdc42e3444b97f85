"""Elasticity: W ranks reproduce the one-rank stream lane by lane; a checkpoint aggregated
from ranks running as real processes restores on any number of ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import _pipeline_fns as F
from zephon import Pipeline, RuntimeOptions, sources

TESTS = os.path.dirname(os.path.abspath(__file__))
C = 4
#: the flush cadence each chain runs with
FLUSH = {"replay": None, "cursor": None, "pack": 1, "docs_greedy": 1, "docs_best_fit": 1,
         "shards": None, "ensure": 1}


def pipeline(chain: str = "replay"):
    """``replay``: a shuffle buffer (restore replays from a flush boundary); ``cursor``:
    only cursor-preserving ops (restore reads on from the source cursor); ``pack``: a
    packer then a batch, both carrying what they hold across flush boundaries;
    ``shards``: the shard-window order over uneven shards, then a shuffle buffer;
    ``ensure``: a mixture, a filter that drops half of one component and
    ``ensure_mixture``, whose queues carry across flush boundaries."""
    if chain == "ensure":  # run with flush_every_k_chunks=1 (FLUSH)
        import _mixture_fns as M

        mix = sources.mixture({"a": sources.from_callable(40, M.doc_a, name="a"),
                               "b": sources.from_callable(40, M.doc_b, name="b")},
                              {"a": 0.7, "b": 0.3})
        return Pipeline(mix, seed=11, chunk_size=3).filter(M.drop_half_of_a).ensure_mixture(
            max_buffer=16).batch(2)
    if chain == "shards":
        import _shard_fns as S

        src = S.ShardedSamples(70, S.uneven_bounds(70, 9, 5))
        return Pipeline(src, seed=11, chunk_size=3, shuffle="shards",
                        shuffle_window=2).map(F.double).shuffle(5).batch(2)
    base = Pipeline(sources.from_callable(70, F.make_sample), seed=11, chunk_size=3)
    if chain == "cursor":
        return base.map(F.double).filter(F.keep_most).batch(2)
    if chain == "pack":  # run with flush_every_k_chunks=1 (FLUSH): boundaries with a carry
        return base.map(F.double).pack_tokens(5).batch(2)
    if chain.startswith("docs_"):  # pack_documents: its open bins carry (flush 1 too)
        return base.map(F.double).pack_documents(
            5, algorithm=chain[len("docs_"):], open_bins=3).batch(2)
    return base.map(F.double).shuffle(5).batch(2)


def key(batch):
    if "id" not in batch:  # packed rows: their tokens (and layout) and samples
        layout = tuple(tuple(batch[k].reshape(-1).tolist()) for k in ("positions", "cu_seqlens")
                       if k in batch)
        return (batch.meta["lane"], batch.meta["lane_index"],
                tuple(map(tuple, batch.meta["sample_ids"])),
                tuple(t for row in batch["tokens"] for t in row.tolist()), layout)
    return (batch.meta["lane"], batch.meta["lane_index"], tuple(batch["id"].tolist()))


def interleave(by_lane: dict, start: dict | None = None) -> list:
    """Merge per-lane streams by the round-robin rule: fewest delivered first, lowest lane."""
    counts = dict(start or {lane: 0 for lane in by_lane})
    queues = {lane: list(items) for lane, items in by_lane.items()}
    out = []
    while any(queues.values()):
        lane = min((l for l in queues if queues[l]), key=lambda l: (counts[l], l))
        out.append(queues[lane].pop(0))
        counts[lane] += 1
    return out


def rank_outputs(world, **extra):
    per_rank = []
    for rank in range(world):
        opts = RuntimeOptions(world_size=world, global_rank=rank, canonical_replicas=C, **extra)
        per_rank.append([key(b) for b in pipeline().options(opts)])
    return per_rank


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mapping", ["contiguous", "interleaved"])
def test_ranks_merged_by_lane_equal_the_one_rank_stream(world, mapping):
    single = [key(b) for b in pipeline().options(RuntimeOptions(canonical_replicas=C))]
    by_lane = {}
    for outputs in rank_outputs(world, mapping_strategy=mapping):
        for item in outputs:
            by_lane.setdefault(item[0], []).append(item)
    assert sorted(by_lane) == list(range(C))
    assert interleave(by_lane) == single


RANK = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_pipeline_elastic import pipeline
    from zephon import RuntimeOptions

    if __name__ == "__main__":
        rank, world, take = {rank}, {world}, {take}
        pipe = pipeline({chain!r}).options(RuntimeOptions(
            world_size=world, global_rank=rank, canonical_replicas={lanes},
            flush_every_k_chunks={flush},
            aggregate_dir={agg!r}, run_id="job", aggregate_timeout_s={timeout}))
        it = iter(pipe)
        for _ in range(take):
            next(it)
        state = pipe.checkpoint()
        pipe.close()
        with open({out!r}, "wb") as fh:
            fh.write(state)
""")


def run_ranks(tmp_path, world, takes, timeout=60.0, only=None, chain="replay"):
    procs = []
    for rank in range(world):
        if only is not None and rank not in only:
            continue
        code = RANK.format(tests=TESTS, rank=rank, world=world, take=takes[rank], lanes=C,
                           chain=chain, flush=FLUSH[chain],
                           agg=str(tmp_path / "agg"), timeout=timeout,
                           out=str(tmp_path / f"state-{rank}"))
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    return results


@pytest.mark.parametrize("chain", ["replay", "cursor", "pack", "docs_greedy", "docs_best_fit",
                                   "shards", "ensure"])
def test_checkpoint_from_2_ranks_restores_on_1_and_on_4(tmp_path, chain):
    results = run_ranks(tmp_path, 2, takes=[6, 6], chain=chain)
    assert all(code == 0 for _, _, code in results), [err for _, err, _ in results]
    states = [(tmp_path / f"state-{r}").read_bytes() for r in range(2)]
    assert states[0] == states[1]  # every rank returns the same merged bytes
    state = states[0]
    if chain != "replay" and chain != "cursor":  # the packer and the batch held something
        from zephon.checkpoint import decode_state

        assert any(len(v) > 4 for v in decode_state(state)["lanes"].values())

    single = [key(b) for b in pipeline(chain).options(RuntimeOptions(
        canonical_replicas=C, flush_every_k_chunks=FLUSH[chain]))]
    by_lane = {}
    for item in single:
        by_lane.setdefault(item[0], []).append(item)
    delivered = {lane: 3 for lane in range(C)}  # 6 batches per rank over 2 lanes each
    expected = interleave({lane: items[3:] for lane, items in by_lane.items()}, delivered)

    one = pipeline(chain).options(RuntimeOptions(canonical_replicas=C,
                                                 flush_every_k_chunks=FLUSH[chain]))
    one.restore(state)
    assert [key(b) for b in one] == expected

    rest = {}
    for rank in range(4):
        pipe = pipeline(chain).options(RuntimeOptions(world_size=4, global_rank=rank,
                                                      canonical_replicas=C,
                                                      flush_every_k_chunks=FLUSH[chain]))
        pipe.restore(state)
        for item in pipe:
            rest.setdefault(item.meta["lane"], []).append(key(item))
    assert interleave(rest, delivered) == expected


def test_a_missing_rank_is_named_not_waited_for(tmp_path):
    results = run_ranks(tmp_path, 2, takes=[2, 2], timeout=1.5, only=[0])
    out, err, code = results[0]
    assert code != 0 and "AggregationTimeoutError" in err and "rank(s) [1]" in err


def test_replicas_that_disagree_are_reported(tmp_path):
    # world 2, one dp group: both ranks read the same lanes and must agree
    code = RANK.replace("canonical_replicas={lanes},", "canonical_replicas={lanes}, dp_degree=1,")
    procs = []
    for rank, take in ((0, 2), (1, 3)):
        text = code.format(tests=TESTS, rank=rank, world=2, take=take, lanes=C, chain="replay",
                           flush=FLUSH["replay"], agg=str(tmp_path / "agg"), timeout=5.0,
                           out=str(tmp_path / f"state-{rank}"))
        procs.append(subprocess.Popen([sys.executable, "-c", text], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert "disagree on lane" in errs[0] and "barrier" in errs[0]


def test_multi_rank_checkpoint_needs_an_aggregate_dir():
    pipe = pipeline().options(RuntimeOptions(world_size=2, global_rank=0, canonical_replicas=C))
    with pytest.raises(Exception, match="aggregate_dir"):
        pipe.checkpoint()



@pytest.mark.parametrize("chain", ["pack", "cursor"])
def test_a_rank_whose_lanes_had_ended_restores_in_step_with_the_others(tmp_path, chain):
    # rank 1 of 2 delivers its last item (and never asks for one more), rank 0 has more:
    # on 1 or 3 ranks the restore gives exactly the rest of the pass, then the next pass
    def opts(world=1, rank=0):
        return RuntimeOptions(world_size=world, global_rank=rank, canonical_replicas=C,
                              flush_every_k_chunks=FLUSH[chain])

    def lanes_of(batches) -> dict:
        out: dict = {}
        for b in batches:
            out.setdefault(b.meta["lane"], []).append(key(b)[2:])
        return out

    last = sum(1 for _ in pipeline(chain).options(opts(2, 1)))
    results = run_ranks(tmp_path, 2, takes=[2, last], chain=chain)
    assert all(code == 0 for _, _, code in results), [err for _, err, _ in results]
    state = (tmp_path / "state-0").read_bytes()
    reference = pipeline(chain).options(opts())
    first, second = lanes_of(reference), lanes_of(reference)
    rank0 = pipeline(chain).options(opts(2, 0))
    heads = {**lanes_of(b for _, b in zip(range(2), rank0, strict=False)),
             **{lane: items for lane, items in first.items() if lane in (2, 3)}}
    for world in (1, 3):
        rest, following = {}, {}
        for rank in range(world):
            pipe = pipeline(chain).options(opts(world, rank))
            pipe.restore(state)
            rest.update(lanes_of(pipe))
            following.update(lanes_of(pipe))
        assert {lane: heads.get(lane, []) + rest.get(lane, []) for lane in first} == first
        assert following == second, world
