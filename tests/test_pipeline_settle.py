"""What the consumer receives of a sample is fixed when the sample's last op returns:
an op that reuses its output buffer, keeps the dict it returns or writes to its result
from a thread afterwards never changes a sample already returned, on any runner; a
fresh result is handed over without a copy. Real pipelines, real worker processes."""

from __future__ import annotations

import _reuse_fns as F
import numpy as np
import pytest

from zephon import Pipeline, RuntimeOptions, sources
from zephon.pipeline.records import Record
from zephon.transport.heap import settle

N = 200

# (validation off: it runs an op twice on one sample, and these ops remember the last)
RUNNERS = {
    "inline": dict(runner="inline", auto_validation="off"),
    "threads": dict(runner="threads", max_workers=2, auto_validation="off"),
    "process": dict(runner="process", max_workers=2, auto_validation="off"),
    "process-no-heap": dict(runner="process", max_workers=2, auto_validation="off"),
    "mtp": dict(runner="inline", mtp_mode=True, auto_validation="off"),
}


def _values(pipe) -> list[tuple[int, int, int]]:
    """(sample, min, max) of every item, read after the whole stream was received."""
    items = list(pipe)  # every item kept: later writes by the op would show below
    return sorted((int(it["i"]), int(it["x"].min()), int(it["x"].max())) for it in items)


def _check(pipe) -> None:
    got = _values(pipe)
    wrong = [(i, lo, hi) for i, lo, hi in got if not lo == hi == 2 * i]
    assert [i for i, _, _ in got] == list(range(N))  # each sample once
    assert not wrong, f"{len(wrong)}/{N} wrong, e.g. {wrong[:3]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("op", ["reuse_buffer", "reuse_dict", "scribble_later"])
def test_an_op_that_holds_its_result_never_changes_a_sample_it_returned(runner, op,
                                                                      monkeypatch):
    if runner == "process-no-heap":
        monkeypatch.setenv("ZEPHON_WORKER_SHARED_HEAP", "0")
    pipe = (Pipeline(sources.from_callable(N, F.load), seed=0, chunk_size=16)
            .map(getattr(F, op), parallelism=2).options(RuntimeOptions(**RUNNERS[runner])))
    _check(pipe)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("runner", ["inline", "process"])
def test_a_reused_heap_sized_buffer_is_copied_per_sample(runner):
    n = 40
    pipe = (Pipeline(sources.from_callable(n, F.load_big), seed=0, chunk_size=8)
            .map(F.reuse_buffer, parallelism=2).options(RuntimeOptions(**RUNNERS[runner])))
    got = _values(pipe)
    assert [g[0] for g in got] == list(range(n))
    assert [g for g in got if not g[1] == g[2] == 2 * g[0]] == []


@pytest.mark.timeout(600)
def test_a_batch_of_a_buffer_reusing_op_holds_every_sample():
    pipe = (Pipeline(sources.from_callable(64, F.load), seed=0, chunk_size=16)
            .map(F.reuse_buffer).batch(8).options(RuntimeOptions(**RUNNERS["inline"])))
    for batch in pipe:
        assert (batch["x"] == 2 * np.asarray(batch["i"])[:, None]).all()


@pytest.mark.timeout(600)
def test_a_later_stage_passing_an_array_on_keeps_the_stream_right():
    pipe = (Pipeline(sources.from_callable(N, F.load), seed=0, chunk_size=16)
            .map(F.reuse_buffer, parallelism=2).shuffle(8).map(F.pass_on, parallelism=2)
            .options(RuntimeOptions(**RUNNERS["process"])))
    _check(pipe)


# -- settle itself, in this process ----------------------------------------------------

def test_settle_hands_fresh_arrays_over_and_copies_held_ones():
    kept = np.arange(8)
    value = {"a": np.arange(4), "b": [np.ones(3), (np.zeros(2), kept)], "k": kept[2:]}
    fresh_id = [id(value["a"]), id(value["b"][0]), id(value["b"][1][0])]
    r = Record(value, [("s", 0, 0)])
    del value
    settle(r)
    v = r.value
    assert [id(v["a"]), id(v["b"][0]), id(v["b"][1][0])] == fresh_id  # no copy
    assert v["b"][1][1] is not kept and (v["b"][1][1] == kept).all()
    assert v["k"].base is None and (v["k"] == kept[2:]).all()  # a view of a kept array
    kept[:] = -1
    assert v["b"][1][1][0] == 0 and v["k"][0] == 2


def test_settle_copies_a_container_the_op_keeps_with_everything_under_it():
    held = {"x": np.arange(3), "inner": [np.arange(2)]}
    r = Record(held, [("s", 0, 0)])
    settle(r)
    assert r.value is not held and r.value["inner"] is not held["inner"]
    held["x"][:] = 7
    held["inner"][0][:] = 7
    assert r.value["x"].tolist() == [0, 1, 2] and r.value["inner"][0].tolist() == [0, 1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_a_fresh_result_is_handed_over_without_a_copy(runner):
    F.MADE.clear()
    pipe = (Pipeline(sources.from_callable(40, F.load), seed=0, chunk_size=8)
            .map(F.fresh_noted, parallelism=2).shuffle(4).map(F.pass_on, parallelism=2)
            .options(RuntimeOptions(**RUNNERS[runner])))
    items = list(pipe)  # all alive: no address can be reused
    assert len(items) == 40
    # the arrays the first stage made, passed on by the second stage's op: never copied
    assert all(it["x"].ctypes.data in F.MADE for it in items)


def test_settle_copies_a_long_list_the_op_keeps_and_skips_one_it_does_not():
    kept = list(range(1000))
    r = Record({"ids": kept, "fresh": list(range(1000))}, [("s", 0, 0)])
    fresh = r.value["fresh"]
    del fresh  # (only the dict holds it again)
    settle(r)
    assert r.value["ids"] is not kept and r.value["ids"] == kept
    kept.append(-1)
    assert r.value["ids"][-1] == 999
