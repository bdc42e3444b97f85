"""The resume helper can fail: fed a pipeline whose restore is wrong in one way, it names
the way.

``FakePipe`` is a pipeline in miniature (passes of shuffled items, runs that go on
after the previous one, a checkpoint of the delivered position and a restore of it)
with one fault switched on at a time: a restore that skips an item, a restored run
whose next pass repeats the epoch instead of advancing, an end-of-pass state that
restores to an empty run. The correct fake, and a real pipeline, pass at every cut.
"""

from __future__ import annotations

import random

import _pipeline_fns as F
import pytest
from _resume import END, assert_resumes, assert_resumes_at, assert_same, passes
from _streams import batch_key, id_key, keys_of, lane_key, take

from zephon import Pipeline, RuntimeOptions, sources

N = 7


class FakeRun:
    """One run of a :class:`FakePipe` from ``(epoch, pos)``; it tells the pipeline where
    the next run starts after each item it hands over."""

    def __init__(self, pipe: FakePipe, epoch: int, pos: int, empty: bool = False):
        self.pipe, self.epoch, self.pos = pipe, epoch, pos
        self.order = random.Random(epoch).sample(range(N), N)
        self.end = pos if empty else N

    def __iter__(self) -> FakeRun:
        return self

    def __next__(self) -> tuple:
        if self.pos >= self.end:
            self.pipe.ended(self.epoch)
            raise StopIteration
        item = (self.epoch, self.order[self.pos])
        self.pos += 1
        self.pipe.delivered(self.epoch, self.pos)
        return item

    def checkpoint(self) -> tuple:
        return self.pipe.position

    def close(self) -> None:
        pass


class FakePipe:
    """Passes of ``N`` items, epoch after epoch; ``fault`` names one wrong restore."""

    def __init__(self, fault: str | None = None):
        self.fault = fault
        self.position = (0, 0)  # the last delivered item: (epoch, items of it delivered)
        self.restored = False

    def __iter__(self) -> FakeRun:
        epoch, pos = self.position
        empty = self.restored and self.fault == "end_empty" and pos == N
        if pos == N and not empty:
            epoch, pos = epoch + 1, 0
        return FakeRun(self, epoch, pos, empty)

    def delivered(self, epoch: int, pos: int) -> None:
        self.position = (epoch, pos)

    def ended(self, epoch: int) -> None:
        stale = self.restored and self.fault == "stale_epoch"
        self.position = (epoch - 1 if stale else epoch, N)
        self.restored = False

    def restore(self, state: tuple) -> None:
        epoch, pos = state
        if self.fault == "skip" and pos < N:
            pos += 1
        self.position, self.restored = (epoch, pos), True


def test_a_correct_restore_passes_at_every_cut_and_at_the_end_of_the_pass():
    reference, following = passes(FakePipe)
    assert sorted(i for _, i in reference) == list(range(N)) and following[0][0] == 1
    results = assert_resumes_at(FakePipe)
    assert len(results) == N + 1
    assert results[-1].rest == [] and results[-1].after == following
    assert assert_resumes(FakePipe, END).head == reference


@pytest.mark.parametrize("k", [0, 3, N - 1])
def test_a_restore_that_skips_an_item_is_caught(k):
    with pytest.raises(AssertionError, match=rf"restored after {k} item\(s\): .* position {k} "):
        assert_resumes(FakePipe, k, again=lambda: FakePipe("skip"))


def test_a_restore_that_skips_an_item_is_caught_on_an_endless_stream():
    with pytest.raises(AssertionError, match="restored after 2 item"):
        assert_resumes(FakePipe, 2, again=lambda: FakePipe("skip"), limit=5)
    assert assert_resumes(FakePipe, 2, limit=5).rest == take(FakePipe(), 5)[2:]


@pytest.mark.parametrize("k", [0, 4])
def test_a_next_pass_that_repeats_the_epoch_is_caught_only_by_the_next_pass_check(k):
    stale = lambda: FakePipe("stale_epoch")  # noqa: E731
    resumed = assert_resumes(FakePipe, k, again=stale, next_pass=False)
    assert resumed.head + resumed.rest == resumed.reference  # the rest of the pass is right
    with pytest.raises(AssertionError, match="the pass after the rest"):
        assert_resumes(FakePipe, k, again=stale)


def test_an_end_of_pass_state_that_restores_to_an_empty_run_is_caught():
    empty = lambda: FakePipe("end_empty")  # noqa: E731
    assert_resumes(FakePipe, 3, again=empty)  # mid-pass states are right
    with pytest.raises(AssertionError, match=rf"restored after {N} item\(s\), the pass after "
                                             r"the state: .* \(0 items against 7\)"):
        assert_resumes(FakePipe, END, again=empty)


def test_a_cut_outside_the_pass_is_refused():
    with pytest.raises(ValueError, match="outside the pass"):
        assert_resumes(FakePipe, N + 1)


def test_assert_same_names_the_first_difference_and_both_lengths():
    assert_same([1, 2], [1, 2], "x")
    with pytest.raises(AssertionError, match=r"x: .* position 1 \(2 items against 3\): "
                                             r"\[5\] != \[2\]"):
        assert_same([1, 5], [1, 2, 3], "x")
    with pytest.raises(AssertionError, match=r"position 2 \(2 items against 3\): \[\] != \[3\]"):
        assert_same([1, 2], [1, 2, 3], "x")


def _small(runner: str = "inline"):
    return Pipeline(sources.from_callable(11, F.make_sample), seed=2, chunk_size=2) \
        .shuffle(3).batch(2).options(RuntimeOptions(runner=runner, canonical_replicas=2))


def test_a_real_pipeline_passes_at_every_cut_and_the_end_of_its_pass():
    results = assert_resumes_at(_small, key=batch_key,
                                again=lambda: _small("threads"))
    ends = results[-1]
    assert ends.rest == [] and ends.after == ends.following
    assert {e for b in ends.following for _, _, e in b[2]} == {1}  # the next epoch


def test_the_stream_keys_see_what_they_name():
    batches = take(_small(), 3)
    assert [id_key(b) for b in batches] == [b["id"].tolist() for b in batches]
    assert lane_key(batches[0])[:2] == (batches[0].meta["lane"], batches[0].meta["lane_index"])
    full = batch_key(batches[0])
    assert full[:3] == lane_key(batches[0]) and dict(full[3])["id"][1] == (2,)
    assert keys_of(batches, id_key) == [id_key(b) for b in batches]


def test_with_a_reference_alone_the_next_pass_comes_from_the_heads_pipeline():
    reference = passes(FakePipe, 1)[0]
    resumed = assert_resumes(FakePipe, 2, reference=reference)
    assert resumed.following == passes(FakePipe)[1]
    with pytest.raises(AssertionError, match="the pass after the rest"):
        assert_resumes(FakePipe, 2, reference=reference, again=lambda: FakePipe("stale_epoch"))
