"""Weights a trainer sets (``set_mixture_weights``) on a position-keyed mixture: they
hold from the first position no lane has delivered, replay exactly after a restore on
another world size (three changes at random steps, a checkpoint between them), are
part of the checkpoint, and what cannot take them is refused by name."""

from __future__ import annotations

import collections

import _mixture_fns as F
import numpy as np
import pytest
from _aggregate_rank import ranks_in_threads
from _streams import sample_ids, take

from zephon import Pipeline, RuntimeOptions, sources
from zephon.checkpoint import decode_state
from zephon.errors import CheckpointError, ZephonConfigError

C, BATCH = 4, 16
SIZES = {"code": 3_000, "web": 50_000, "books": 7_000}
STEPS = [(0, {"code": 6, "web": 3, "books": 1}), (20_000, {"code": 1, "web": 5, "books": 4})]


def mixture():
    return sources.mixture({k: sources.from_callable(n, F.row, name=k) for k, n in SIZES.items()},
                           STEPS, schedule_unit="samples", interpolate="linear")


def pipe(world=1, rank=0, **opts):
    return Pipeline(mixture(), seed=3, chunk_size=64, num_epochs=None).batch(BATCH).options(
        RuntimeOptions(canonical_replicas=C, world_size=world, global_rank=rank, **opts))


def keyed(batches) -> dict:
    return {(b.meta["lane"], b.meta["lane_index"]): b.meta["sample_ids"] for b in batches}


def changes(seed):
    """Three (global step, weights) changes at random steps (multiples of 4: a step of
    every rank on 1, 2 and 4 ranks)."""
    rng = np.random.default_rng(seed)
    steps = sorted(rng.choice(np.arange(25, 450), 3, replace=False).tolist())
    weights = [{"code": 0.0, "web": 1.0, "books": 1.0}, {"code": 5.0, "web": 1.0, "books": 0.0},
               {"code": 1.0, "web": 1.0, "books": 1.0}]
    return [(4 * s, w) for s, w in zip(steps, weights, strict=True)]


def uninterrupted(plan, total):
    it = iter(pipe())
    out, todo = [], list(plan)
    for step in range(total):
        if todo and todo[0][0] == step:
            it.set_mixture_weights(todo.pop(0)[1])
        out.append(next(it))
    it.close()
    return out


def ranks_run(world, body, tmp_path, tag):
    return ranks_in_threads(world, lambda r: body(r, pipe(
        world, r, aggregate_dir=str(tmp_path / f"agg-{tag}"), run_id=tag,
        aggregate_timeout_s=60)))


@pytest.mark.parametrize("seed, saved, restored", [(1, 2, 4), (2, 4, 1), (3, 1, 2)])
def test_three_changes_with_a_checkpoint_between_replay_on_another_world_size(
        tmp_path, seed, saved, restored):
    plan = changes(seed)
    total = 4 * 480
    cut = plan[0][0] + 4 * int(np.random.default_rng(seed).integers(
        1, (plan[1][0] - plan[0][0]) // 4))  # between the first two changes
    want = keyed(uninterrupted(plan, total))
    assert want != keyed(take(pipe(), total))  # the changes changed the stream

    def first(rank, p):  # up to the cut, the first change made on the way
        it, got = iter(p), []
        for step in range(0, cut, saved):
            if step == plan[0][0]:
                it.set_mixture_weights(plan[0][1])
            got.append(next(it))
        state = it.checkpoint()
        it.close()
        return got, state

    out = ranks_run(saved, first, tmp_path, "saved")
    state = out[0][1]
    assert all(o[1] == state for o in out.values())
    assert decode_state(state)["mixture"][0][1] == [0.0, 1.0, 1.0]

    def second(rank, p):  # from the cut, the other two changes at their steps
        p.restore(state)
        it, got, todo = iter(p), [], list(plan[1:])
        for step in range(cut, total, restored):
            if todo and todo[0][0] == step:
                it.set_mixture_weights(todo.pop(0)[1])
            got.append(next(it))
        it.close()
        return got

    got = keyed([b for o in out.values() for b in o[0]])
    for batches in ranks_run(restored, second, tmp_path, "restored").values():
        got.update(keyed(batches))
    assert got == want


def test_the_weights_hold_from_the_first_undelivered_block_and_nothing_before_changes():
    plain = take(pipe(), 300)
    it = iter(pipe())
    head = [next(it) for _ in range(100)]
    at = it.set_mixture_weights({"code": 0, "web": 0, "books": 1})
    tail = [next(it) for _ in range(200)]
    it.close()
    assert at == 1_792  # 100 batches of 16 read by 4 lanes: 1,600 positions, a block up
    assert sample_ids(head) == sample_ids(plain[:100])
    after = collections.Counter(s[0].split("#")[0] for s in sample_ids(tail[12:]))
    assert set(after) == {"books"}  # once past the block the change rounded up to


@pytest.mark.parametrize("whose, past", [("iterator", 0), ("pipeline", 200)])
def test_the_change_is_in_the_checkpoint_and_a_plain_restore_keeps_it(whose, past):
    """The iterator's checkpoint right after a change, and the pipeline's once the lanes
    are past it (its proof reads the next samples under the change), both restore."""
    p = pipe()
    it = iter(p)
    for _ in range(40):
        next(it)
    it.set_mixture_weights({"code": 1, "web": 0, "books": 1})
    for _ in range(past):
        next(it)
    state = it.checkpoint() if whose == "iterator" else p.checkpoint()
    rest = [next(it) for _ in range(50)]
    it.close()
    again = pipe()
    again.restore(state)
    assert sample_ids(take(again, 50)) == sample_ids(rest)


@pytest.mark.parametrize("weights, match", [
    ({"code": 1, "web": 1}, "name exactly the components"),
    ({"code": 0, "web": 0, "books": 0}, "all 0"),
    ({"code": -1, "web": 1, "books": 1}, "0 or a positive finite number"),
    ({"code": float("nan"), "web": 1, "books": 1}, "0 or a positive finite number"),
])
def test_bad_weights_are_refused_and_the_run_goes_on(weights, match):
    it = iter(pipe())
    first = next(it)
    with pytest.raises(ZephonConfigError, match=match):
        it.set_mixture_weights(weights)
    assert sample_ids([next(it)]) == sample_ids(take(pipe(), 2)[1:])
    assert first is not None
    it.close()


def test_a_source_that_cannot_take_weights_is_refused_by_name():
    it = iter(Pipeline(sources.from_callable(100, F.row)).batch(4))
    with pytest.raises(ZephonConfigError, match="not a mixture with a position-keyed"):
        it.set_mixture_weights({"a": 1})
    it.close()
    epochs = sources.mixture({"a": sources.from_callable(10, F.row, name="a"),
                              "b": sources.from_callable(10, F.row, name="b")})
    it = iter(Pipeline(epochs).batch(4))
    with pytest.raises(ZephonConfigError, match="keys its weights by the epoch"):
        it.set_mixture_weights({"a": 1, "b": 1})
    it.close()


def test_a_checkpoint_with_changes_is_refused_by_a_pipeline_without_a_stream_mixture():
    it = iter(pipe())
    next(it)
    it.set_mixture_weights({"code": 1, "web": 1, "books": 0})
    state = decode_state(it.checkpoint())
    it.close()
    from zephon.pipeline.state import check_run

    state["mixture"] = [[512, [1.0, -1.0, 0.0]]]
    with pytest.raises(CheckpointError, match="each 0 or positive and finite"):
        check_run(state, pipe().plan())


def three():
    return sources.mixture({k: sources.from_callable(1_000, F.row, name=k) for k in "abc"},
                           {"a": 1, "b": 1, "c": 1}, schedule_unit="samples")


def one_lane(mix, **kw):
    return Pipeline(mix, seed=1, shuffle=False, num_epochs=None, **kw).batch(64).options(
        RuntimeOptions(canonical_replicas=1))


def test_a_change_never_redeals_a_delivered_position_where_blocks_start_early():
    """Three equal weights round a block's counts to 85 + 85 + 85 = 255: block 1 starts
    at 255; after 256 samples the change goes to block 2 (at 513), nothing delivered
    is dealt again."""
    plain = sample_ids(take(one_lane(three()), 24))
    it = iter(one_lane(three()))
    head = [next(it) for _ in range(4)]
    at = it.set_mixture_weights({"a": 1, "b": 1, "c": 2})
    ids = sample_ids(head + [next(it) for _ in range(20)])
    it.close()
    assert at == 513 and ids[:at] == plain[:at] and len(set(ids)) == len(ids)


def test_a_second_change_in_the_same_block_replaces_the_first_and_nothing_before_it():
    def linear():
        return sources.mixture({k: sources.from_callable(5_000, F.row, name=k) for k in "ab"},
                               [(0, {"a": 1, "b": 0}), (4_096, {"a": 0, "b": 1})],
                               schedule_unit="samples", interpolate="linear")

    plain = sample_ids(take(one_lane(linear()), 60))
    twice, once = iter(one_lane(linear())), iter(one_lane(linear()))
    head = [next(twice) for _ in range(30)]
    for _ in range(30):
        next(once)
    assert twice.set_mixture_weights({"a": 1, "b": 1}) == \
        twice.set_mixture_weights({"a": 3, "b": 1}) == once.set_mixture_weights({"a": 3, "b": 1})
    got = sample_ids(head + [next(twice) for _ in range(30)])
    assert got == sample_ids(head + [next(once) for _ in range(30)])
    assert got[:1_920] == plain[:1_920] and len(set(got)) == len(got)
    twice.close()
    once.close()


def test_a_closed_iterator_is_refused_and_stays_closed():
    from zephon.errors import IteratorClosedError

    it = iter(pipe())
    next(it)
    it.close()
    with pytest.raises(IteratorClosedError, match="set_mixture_weights on a closed"):
        it.set_mixture_weights({"code": 1, "web": 1, "books": 1})
    assert it.closed


def test_thousands_of_changes_build_in_one_pass_and_equal_one_at_a_time():
    """A trainer reweighting every few steps makes thousands of changes: the schedule
    with all of them equals the one built a few changes at a time."""
    stream = mixture().stream
    rng = np.random.default_rng(0)
    changes = [(256 * (4 * i + 1), rng.random(3) + 0.01) for i in range(3_000)]
    whole = stream.with_overrides(changes)
    step = stream
    for i in range(0, len(changes), 600):  # the same, a few at a time
        step = step.with_overrides(changes[:i + 600])
    t = np.arange(0, 256 * 4 * 3_000, 997)
    assert np.array_equal(whole.locate(t, 7)[0], step.locate(t, 7)[0])
    assert np.allclose(whole.share(t.astype(float))[::50], step.share(t.astype(float))[::50])
