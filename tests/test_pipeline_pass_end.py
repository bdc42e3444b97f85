"""The end of a pass, on any number of ranks: a lane state says when its lane has delivered
its last item of the pass, so that a restore on M ranks of a state taken on N ranks
delivers exactly the rest of the pass (nothing, on a rank whose lanes have all ended), and
every rank's next run is the next pass (at once when the whole world had ended).

Several ranks run in this process: each rank is a pipeline with its ``world_size`` and
``global_rank``; their own states (``get_state``) are merged by the function the
multi-rank exchange uses (``merge_states``), which is what ``checkpoint()`` returns.
"""

from __future__ import annotations

import collections

import _pipeline_fns as F
import numpy as np
import pytest
from _resume import END, assert_resumes

from zephon import CheckpointError, Pipeline, RuntimeOptions, sources
from zephon.checkpoint import decode_state, encode_state
from zephon.checkpoint.aggregate import merge_states

C = 4
N = 23  # chunks of 2: lanes of 6, 6, 6 and 5 samples


def empty_lane_3(sample) -> bool:  # in source order, lane 3 reads the chunks 3, 7, 11
    return (sample["id"] // 2) % C != 3


CHAINS = {
    "cursor": lambda p: p.map(F.double).filter(F.keep_most).batch(2),
    "replay": lambda p: p.map(F.double).shuffle(3).batch(2),
    "pack": lambda p: p.map(F.double).pack_tokens(5).batch(2),
    "empty_lane": lambda p: p.filter(empty_lane_3).batch(2),
}


def pipeline(chain: str, world: int = 1, rank: int = 0, runner: str = "inline",
             mapping: str = "contiguous") -> Pipeline:
    base = Pipeline(sources.from_callable(N, F.make_sample), seed=5, chunk_size=2,
                    num_epochs=2, shuffle=chain != "empty_lane")
    return CHAINS[chain](base).options(RuntimeOptions(
        runner=runner, max_workers=2, canonical_replicas=C, world_size=world,
        global_rank=rank, mapping_strategy=mapping, flush_every_k_chunks=1))


def key(b) -> tuple:
    return (b.meta["lane"], tuple(map(tuple, b.meta["sample_ids"])),
            tuple(np.asarray(b["id"] if "id" in b else b["tokens"]).reshape(-1).tolist()))


def by_lane(items) -> dict:
    out = collections.defaultdict(list)
    for k in items:
        out[k[0]].append(k)
    return dict(out)


def epochs(items) -> set:
    return {e for k in items for _, _, e in k[1]}


def merged_checkpoint(iterators: list) -> bytes:
    """What ``checkpoint()`` returns on these ranks: their own states merged."""
    world = len(iterators)
    submissions = {r: dict(decode_state(it.get_state()), world=world)
                   for r, it in enumerate(iterators)}
    return encode_state(merge_states(submissions))


def take_on_ranks(chain: str, world: int, takes: list, runner: str = "inline"):
    """Each rank delivers ``takes[rank]`` items (all: None); their merged checkpoint."""
    iterators, head = [], []
    for rank in range(world):
        it = iter(pipeline(chain, world, rank, runner))
        want = takes[rank]
        head += [key(b) for b in (it if want is None else
                                   (next(it) for _ in range(want)))]
        iterators.append(it)
    state = merged_checkpoint(iterators)
    for it in iterators:
        it.close()
    return head, state


def restore_on_ranks(chain: str, world: int, state: bytes, runner: str = "inline"):
    """The next two runs of every rank restored from ``state``."""
    runs = []
    for rank in range(world):
        pipe = pipeline(chain, world, rank, runner)
        pipe.restore(state)
        runs.append(([key(b) for b in pipe], [key(b) for b in pipe]))
    return runs


def reference(chain: str) -> tuple[list, list]:
    pipe = pipeline(chain)
    return [key(b) for b in pipe], [key(b) for b in pipe]


def stream_length(chain: str, world: int, rank: int) -> int:
    return sum(1 for _ in pipeline(chain, world, rank))


def cases(chain: str, world: int) -> list:
    """Cuts per rank: nothing, some, a rank ended while others are not, all ended."""
    lengths = [stream_length(chain, world, r) for r in range(world)]
    half = [n // 2 for n in lengths]
    ended_first = [None, *half[1:]]
    ended_last = [*half[:-1], None]
    return [[0] * world, half, ended_first, ended_last, [None] * world,
            [n - 1 for n in lengths]]


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("old,new,runner", [(1, 2, "inline"), (2, 1, "threads"),
                                            (1, 4, "threads"), (4, 3, "inline"),
                                            (3, 2, "threads"), (2, 4, "inline")])
def test_a_restore_on_m_ranks_delivers_the_rest_of_the_pass_then_the_next(chain, old, new,
                                                                          runner):
    first, second = reference(chain)
    for takes in cases(chain, old):
        head, state = take_on_ranks(chain, old, takes, runner="threads" if runner == "inline"
                                    else "inline")
        runs = restore_on_ranks(chain, new, state, runner)
        rest = [k for run, _ in runs for k in run]
        following = [k for _, run in runs for k in run]
        got = by_lane(head + rest)
        if all(t is None for t in takes):  # every rank had ended: the next pass at once
            assert by_lane(head) == by_lane(first), (takes, chain)
            assert by_lane(rest) == by_lane(second), (takes, chain)
            continue
        assert got == by_lane(first), (takes, chain)  # nothing lost or repeated
        assert by_lane(following) == by_lane(second), (takes, chain)  # every rank: pass 1
        assert epochs(following) <= {2, 3}


@pytest.mark.parametrize("runner", ["threads", "process"])
def test_ranks_that_had_ended_agree_under_other_runners(runner):
    first, second = reference("pack")
    head, state = take_on_ranks("pack", 2, [None, 2], runner="inline")
    runs = restore_on_ranks("pack", 2, state, runner=runner)
    assert runs[0][0] == []  # rank 0 had ended: nothing more of the pass
    assert by_lane(head + runs[1][0]) == by_lane(first)
    assert by_lane(runs[0][1] + runs[1][1]) == by_lane(second)


def test_the_last_item_says_every_lane_of_the_rank_has_ended():
    it = iter(pipeline("pack"))
    items = list(it)
    lanes = decode_state(it.checkpoint())["lanes"]
    assert {lane: len(v) for lane, v in lanes.items()} == {str(i): 1 for i in range(C)}
    assert sum(v[0] for v in lanes.values()) == len(items)


def test_a_rank_with_nothing_in_the_pass_records_its_lane_as_ended():
    # on 4 ranks, rank 3 owns lane 3 alone, which the filter empties
    it = iter(pipeline("empty_lane", 4, 3))
    assert list(it) == []
    assert decode_state(it.get_state())["lanes"] == {"3": [0]}


def test_a_run_continued_after_its_last_item_is_the_next_pass_with_one_rank():
    first, second = reference("replay")
    pipe = pipeline("replay")
    it = iter(pipe)
    got = [key(next(it)) for _ in range(len(first))]  # never asked for one more
    it.close()
    assert got == first
    assert [key(b) for b in pipe] == second


def test_an_ended_lane_in_a_pass_that_never_ends_is_refused():
    pipe = Pipeline(sources.from_callable(N, F.make_sample), seed=5, chunk_size=2,
                    num_epochs=None).batch(2).options(RuntimeOptions(canonical_replicas=C))
    it = iter(pipe)
    next(it)
    state = decode_state(it.checkpoint())
    it.close()
    state["lanes"]["1"] = [3]
    with pytest.raises(CheckpointError, match="lane 1 is marked ended"):
        pipe.restore(encode_state(state))


def test_an_ended_lane_that_claims_more_items_than_its_pass_holds_is_refused():
    pipe = pipeline("cursor")
    it = iter(pipe)
    next(it)
    state = decode_state(it.checkpoint())
    it.close()
    state["lanes"]["2"] = [2 * 6 + 1]  # two epochs of 6 samples: at most 12 batches
    with pytest.raises(CheckpointError, match="lane 2 items delivered"):
        pipe.restore(encode_state(state))


def test_a_state_of_format_version_3_is_refused_by_name():
    it = iter(pipeline("cursor"))
    next(it)
    data = bytearray(it.checkpoint())
    it.close()
    data[8] = 3  # the previous stream definition: no ended lanes
    with pytest.raises(CheckpointError, match=r"version 3.*no ended lanes"):
        pipeline("cursor").restore(bytes(data))


@pytest.mark.parametrize("tail", [lambda p: p.batch(8), lambda p: p.map(F.double).shuffle(4)
                                  .batch(8)])
def test_no_item_waits_for_the_next_before_the_tail_of_the_pass(tail):
    # an endless pass never looks ahead: a finite one reads no more for its first items
    def reads_per_item(epochs) -> list:
        pipe = tail(Pipeline(sources.from_callable(4000, F.counted_sample), seed=1,
                             chunk_size=8, num_epochs=epochs)).options(
            RuntimeOptions(runner="inline", canonical_replicas=2))
        F.reset_reads()
        it = iter(pipe)
        out = []
        for _ in range(20):
            next(it)
            out.append(F.reads())
        it.close()
        return out

    assert reads_per_item(1) == reads_per_item(None)


@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_a_state_after_the_last_item_with_a_lane_dealt_nothing_restores_to_the_next_pass(
        runner):
    from zephon import Pipeline, RuntimeOptions, sources

    # 3 samples over 4 lanes of one-sample chunks: lane 3 is dealt nothing. The state after
    # the pass's last item must say every lane has ended (the empty one never held the
    # tail back, so lane 2's last item carries its ended state), and restore to epoch 1.
    def pipe():
        return (Pipeline(sources.from_callable(3, F.make_sample), seed=5, chunk_size=1,
                         num_epochs=1).map(F.double, parallelism=2)
                .options(RuntimeOptions(runner=runner, canonical_replicas=4)))

    # the state is taken at the last item, not past it; the restored run is epoch 1
    resumed = assert_resumes(pipe, END, key=lambda s: int(s["id"]))
    assert sorted(resumed.head) == [0, 1, 2] and resumed.rest == []
    nxt = pipe()
    nxt.set_epoch(1)
    assert resumed.after == [int(s["id"]) for s in nxt]
