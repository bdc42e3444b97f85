"""Byte-aware back-pressure: with default options, results waiting in the pipeline's own
queues never fill a worker's shared-memory arena, whatever the item size.

The arena falls back to sending results by copy through the channel (and the pool warns
once: "the consumer holds ... bytes of the ...-byte shared-memory arena") only after a
region did not come back in time; these tests fail on that warning, so they check which
path was taken, not how long anything took. The consumer here is slower than the workers
(it sleeps a little per item, as a training step would), so every queue of the pipeline
fills up; it drops each item before it asks for the next one, as a training loop does.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

from zephon import Pipeline, sources
from zephon.transport.budget import PIPELINE_ARENA_BYTES, split_arena


class Sized:
    """Sample ``i``: ``nbytes`` of int64 starting at ``i``."""

    def __init__(self, nbytes: int) -> None:
        self.elements = nbytes // 8

    def __call__(self, i: int) -> dict:
        return {"tokens": np.arange(self.elements, dtype=np.int64) + i, "seq": i}


def add_one(sample: dict) -> dict:
    return {"tokens": sample["tokens"] + 1, "seq": sample["seq"]}


def run_without_fallback(nbytes: int, n: int) -> list[int]:
    """The ``seq`` of every item of a default-options pipeline with 2 process workers;
    fails if any result left the shared-memory arena for the in-band fallback."""
    pipe = Pipeline(sources.from_callable(n, Sized(nbytes))).map(add_one, parallelism=2)
    seen = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="zephon: the consumer holds",
                                category=RuntimeWarning)
        it = iter(pipe)
        try:
            for item in it:
                assert int(item["tokens"][0]) == item["seq"] + 1
                seen.append(item["seq"])
                del item
                time.sleep(0.05)  # a training step: the pipeline's queues fill meanwhile
        finally:
            it.close()
    return seen


def test_64mib_items_never_fall_back_to_in_band():
    seen = run_without_fallback(64 << 20, 16)
    assert sorted(seen) == list(range(16))


@pytest.mark.slow
def test_256mib_items_never_fall_back_to_in_band():
    seen = run_without_fallback(256 << 20, 6)
    assert sorted(seen) == list(range(6))


def test_plan_bounds_in_flight_bytes_by_the_arena():
    pipe = Pipeline(sources.from_callable(8, Sized(4096))).map(add_one, parallelism=2)
    plan = pipe.plan()
    stage = plan.stages[0]
    assert stage.arena_bytes >= PIPELINE_ARENA_BYTES
    budget = split_arena(stage.arena_bytes, len(plan.owned))
    assert plan.memory == budget
    assert stage.budget_bytes == budget.lane_bytes and plan.prefetch_bytes == budget.prefetch_bytes
    # the lanes' part, the prefetch queue's and the heap's leave the rest to the consumer
    assert stage.budget_bytes * len(plan.owned) + plan.prefetch_bytes + budget.heap_bytes \
        + budget.consumer_bytes <= stage.arena_bytes
    assert budget.consumer_bytes >= stage.arena_bytes // 4
    assert "MiB/lane" in plan.explain()


def _stage(**fields):
    """A process stage of a plan (its fields as the plan sets them, changed by ``fields``)."""
    from zephon.pipeline.plan import Stage

    base = dict(index=0, ops=(), runner="process", workers=2, depth=4, split=True,
                item_cap=None, arena_bytes=1 << 30, budget_bytes=256 << 20)
    return Stage(**{**base, **fields})


def _lane_dispatch(workers: int = 2):
    from zephon.pipeline.dispatch import _LaneDispatch

    return _LaneDispatch(_stage(workers=workers))


def test_parts_grow_at_most_twofold_per_result():
    # Fast first samples must not make the rest of the lane one part: a run of slow
    # samples after them would then arrive all at once, and closing would wait for all.
    from zephon.pipeline.dispatch import DISPATCH_TARGET_BYTES, MIN_SAMPLE_BYTES

    d = _lane_dispatch()
    assert d.target() == 1  # nothing known yet
    for seq, cap in enumerate([2, 4, 8]):
        d.sent(seq, 1)
        d.done(seq, [], deterministic=False)
        d.per_item = 0.0  # tiny, fast samples: without the cap a part would be huge
        assert d.target() == cap
    d.cap = 1 << 30
    assert d.target() == DISPATCH_TARGET_BYTES // MIN_SAMPLE_BYTES


def test_samples_of_unseen_size_are_bounded_by_time():
    from zephon.pipeline.dispatch import (
        DISPATCH_TARGET_BYTES,
        DISPATCH_TARGET_SECONDS,
        MIN_SAMPLE_BYTES,
        SLOW_SAMPLE_S,
    )

    d = _lane_dispatch()
    d.cap = 1 << 30
    d.per_item = 0.0  # e.g. {"i": i}: no array the estimate can see
    assert d.target() == DISPATCH_TARGET_BYTES // MIN_SAMPLE_BYTES
    d.per_sample_s = 1.0  # one second per sample
    assert d.target() == 1
    d.per_sample_s = SLOW_SAMPLE_S * 2
    assert d.target() == int(DISPATCH_TARGET_SECONDS / (SLOW_SAMPLE_S * 2))
    d.per_sample_s = SLOW_SAMPLE_S / 2  # fast: measured time overstates work; bytes rule
    assert d.target() == DISPATCH_TARGET_BYTES // MIN_SAMPLE_BYTES


def test_parts_are_sized_by_the_op_time_the_workers_report_not_by_queueing():
    # A part's time from send to result counts its wait behind the parts queued before it
    # (depth / workers parts, more on a loaded machine): a tokenizer's ~1 ms per document
    # looked like 10-40 ms, and its parts shrank to one to three documents (a message
    # each). With the op time the executor reports, the part holds the documents that
    # fit DISPATCH_TARGET_SECONDS of work, however long it queued.
    from zephon.pipeline.dispatch import DISPATCH_TARGET_SECONDS

    d = _lane_dispatch()
    d.cap = 1 << 30
    d.sent(0, 4)
    d.sent_at[0] -= 10.0  # it came back 10 s after it was sent (queued behind others)
    d.done(0, [], deterministic=False, busy_s=4 * 1.25e-3)  # 1.25 ms of work per sample
    assert d.op_timed and d.per_sample_s == pytest.approx(1.25e-3)
    d.per_item = 800.0  # 400 uint16 tokens a document: the byte target allows thousands
    assert d.target() == int(DISPATCH_TARGET_SECONDS / 1.25e-3)
    # without an op time the time since sending stands in (and overstates the work)
    d.sent(1, 4)
    d.sent_at[1] -= 10.0
    d.done(1, [], deterministic=False)
    assert not d.op_timed and d.per_sample_s >= 2.5
    assert d.target() == 1


def test_op_time_bounds_parts_of_samples_faster_than_the_queueing_threshold():
    # SLOW_SAMPLE_S exists because send-to-result time overstates fast samples; a measured
    # op time does not, so 0.5 ms samples are bounded by time too (not by bytes alone,
    # which would make a part of 5,000 of them: 2.5 s of one worker's time).
    from zephon.pipeline.dispatch import DISPATCH_TARGET_SECONDS, SLOW_SAMPLE_S

    d = _lane_dispatch()
    d.cap, d.per_item = 1 << 30, 800.0
    d.sent(0, 10)
    d.done(0, [], deterministic=False, busy_s=10 * SLOW_SAMPLE_S / 2)
    assert d.target() == int(DISPATCH_TARGET_SECONDS / (SLOW_SAMPLE_S / 2))


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_every_executor_reports_op_time_without_execution_tracking(runner):
    # The dispatch needs the op time whatever the tracking: each executor's get() returns
    # it with the result (tracking off: nobody observes the stage's meter).
    from _pipeline_fns import square_unit

    from _executors import make_executor

    ex = make_executor(runner, square_unit)
    try:
        assert ex.meter.observer is None
        ex.submit(0, 7, 3)
        seq, result, busy_s = ex.get(0)
    finally:
        ex.close()
    assert (seq, result) == (7, 9)
    assert busy_s is not None and busy_s >= 0


def test_large_samples_travel_several_per_part_up_to_the_byte_ceiling():
    # One message per 4 MiB sample spent about two thirds of the consumer's process on
    # messages: a part holds MIN_PART_SAMPLES of them, as long as that stays within
    # DISPATCH_MAX_BYTES; above it, the part is one sample (memory matters more there).
    from zephon.pipeline.dispatch import (
        DISPATCH_MAX_BYTES,
        DISPATCH_TARGET_BYTES,
        MIN_PART_SAMPLES,
    )

    d = _lane_dispatch()
    d.cap = 1 << 30
    mib = 1 << 20
    expected = {
        64 << 10: DISPATCH_TARGET_BYTES // (64 << 10),  # small: the byte target rules
        1 * mib: DISPATCH_TARGET_BYTES // mib,
        4 * mib: MIN_PART_SAMPLES,
        DISPATCH_MAX_BYTES // 2: 2,
        DISPATCH_MAX_BYTES: 1,
        64 * mib: 1,
    }
    for per_item, samples in expected.items():
        d.per_item = float(per_item)
        assert d.target() == samples, per_item
        assert samples == 1 or d.target() * per_item <= max(DISPATCH_MAX_BYTES,
                                                            DISPATCH_TARGET_BYTES)


def test_parts_are_cut_when_sent_with_the_estimates_of_that_moment():
    # A unit read while its 4 MiB samples were fast would go out in parts of 4; if the
    # samples turn slow before those parts are sent, each part must hold one sample
    # (closing then waits for one slow op, not four). Likewise for samples that grow.
    d = _lane_dispatch(workers=2)
    d.cap = 1 << 30
    d.per_item = float(4 << 20)
    entry = d.pending(list(range(64)))
    part, rest = d.split_off(entry)
    assert len(part) == 4 and len(rest) == 60
    entry[0] = rest
    d.per_sample_s = 1.0  # a result just said: one second per sample
    part, rest = d.split_off(entry)
    assert part == [4] and len(rest) == 59
    entry[0] = rest
    d.per_sample_s = None
    d.per_item = float(64 << 10)  # small again: the byte target takes half the unit
    part, rest = d.split_off(entry)
    assert part == list(range(5, 37)) and rest == list(range(37, 64))
    # a unit is shared by the workers: at most ceil(n / workers) samples a part
    assert d.split_off(d.pending(list(range(10)))) == (list(range(5)), list(range(5, 10)))


def test_long_parts_queue_one_per_worker_and_short_ones_the_depth():
    # A fused batch of 64 images took 0.27 s of a worker: depth 4 beyond one per worker
    # kept six 37 MiB batches coming while the consumer was the slower side, each of them
    # memory. One queued part per worker hides a message's round trip hundreds of times
    # over; parts cut to DISPATCH_TARGET_SECONDS keep the whole depth.
    from zephon.pipeline.dispatch import DISPATCH_TARGET_SECONDS, LONG_PART_S

    d = _lane_dispatch(workers=2)
    deep = d.limit
    assert deep == d.depth + 2 and d.depth > 2

    from types import SimpleNamespace

    def result(seq, busy_s):
        d.sent(seq, 64)
        d.done(seq, [SimpleNamespace(value=np.zeros(8))] * 64, True, busy_s=busy_s)

    result(0, DISPATCH_TARGET_SECONDS)
    assert d.limit == deep
    result(1, 1.5 * LONG_PART_S)
    result(2, 1.5 * LONG_PART_S)
    assert d.limit == 2 + 2
    result(3, None)  # a part lost to a crash says nothing of the time
    assert d.limit == 2 + 2
    for seq in range(4, 12):  # the parts turned short again
        result(seq, DISPATCH_TARGET_SECONDS / 4)
    assert d.limit == deep


def test_the_feeder_sizes_each_part_when_it_sends_it():
    # The lane's feeder itself (not only the sizing rule): a unit read while 4 MiB samples
    # were fast goes out four to a part; once a result says they are slow, the next part
    # sent from the same unit holds one sample.
    from types import SimpleNamespace

    from zephon.pipeline.dispatch import _Feeder

    sent = []
    stage = _stage(index=1)
    workers = max(1, stage.workers)
    executor = SimpleNamespace(submit=lambda lane, seq, payload: sent.append(payload[1]),
                               runner=stage.runner, adaptive=False, workers=workers,
                               max_workers=workers)
    feed = _Feeder(executor, stage, iter([list(range(64))]), 0, None)
    feed.state.cap, feed.state.per_item = 1 << 30, float(4 << 20)
    feed.fill()
    assert [len(p) for p in sent] == [4] * feed.state.limit
    feed.state.per_sample_s = 1.0  # a result: one second per sample
    feed.inflight -= 1
    feed.fill()
    assert len(sent[-1]) == 1 and sent[-1][0] == 4 * feed.state.limit


def test_the_size_estimate_sees_arrays_nested_in_containers():
    from zephon.pipeline.dispatch import approx_nbytes

    leaf = np.zeros(1 << 20, dtype=np.uint8)
    assert approx_nbytes({"a": {"b": [{"c": (leaf,)}]}}) == leaf.nbytes


def test_a_lane_queues_depth_parts_beyond_one_per_worker():
    # With `depth` parts in flight over the whole lane, 2 workers at depth 4 waited for
    # their next part a fifth of the time, and 16 workers at depth 8 would leave half idle.
    for workers in (1, 2, 16):
        d = _lane_dispatch(workers)
        d.per_item = 1.0  # sizes known; the byte budget is far away
        assert d.room(4 + workers - 1, 1) and not d.room(4 + workers, 1)
    from zephon.pipeline.dispatch import _LaneDispatch

    inline = _LaneDispatch(_stage(depth=1, workers=1, split=False, runner="inline",
                                  arena_bytes=None, budget_bytes=None))
    assert not inline.room(1, 1)  # an inline stage does not read ahead


def test_closing_mid_part_waits_for_the_op_running_not_the_rest_of_its_part(tmp_path):
    # 4 MiB samples go four to a part while they are fast. When they turn slow, the
    # parts already sent hold four slow samples each: close() (after a break) must not
    # wait for all of them. Each worker gives up between samples once told to stop, so
    # at most one slow sample per worker starts after the consumer left.
    from _pipeline_fns import SlowFrom, big_sample

    from zephon import Pipeline, RuntimeOptions, sources

    slow_from = 100
    pipe = (Pipeline(sources.from_callable(160, big_sample), shuffle=False)
            .map(SlowFrom(tmp_path, slow_from, 0.3), parallelism=2)
            .options(RuntimeOptions(runner="process", max_workers=2)))
    it = iter(pipe)
    try:
        for item in it:
            if item["seq"] >= slow_from:
                break
        before = len(list(tmp_path.iterdir()))
    finally:
        it.close()
    after = len(list(tmp_path.iterdir()))
    # a worker in the middle of a slow sample finishes it and, racing the STOP, may
    # start one more; never the rest of its part (before: 5 or 6 of them here)
    assert after - before <= 2, (before, after)
