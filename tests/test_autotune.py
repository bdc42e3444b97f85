"""worker_allocation="autotune" (zephon.pipeline.autotune): the stream is the one any
fixed worker count gives, the slow stage is grown and not the cheap one, the budget
holds, a workload that turns cheap is shrunk, close() leaves no process, and a
checkpoint taken under autotune restores exactly.

Runs stop as soon as what they wait for is in the controller's record (or the stream
ends, which fails the test): no timing is asserted, only decisions."""

from __future__ import annotations

import itertools

import _autotune_fns as F
import pytest
from _procs import HANG_S, wait_gone

from zephon import Pipeline, RuntimeOptions, sources
from zephon.pipeline.autotune import Controller
from zephon.pipeline.tuning import TuningParams, replay
from zephon.runners.contract import StageMeter

P = TuningParams()


def _pipe(n, runner, op=F.slow, second=F.cheap, shuffle=True, **kw):
    return (Pipeline(sources.from_sequence(list(range(n)), name=f"at{n}"), seed=3,
                     chunk_size=8, shuffle=shuffle)
            .map(op).shuffle(16).map(second).batch(4)
            .options(RuntimeOptions(runner=runner, **kw)))


def _reference(n, **kw):
    return [b.tolist() for b in _pipe(n, "inline", **kw)]


def _tuned(it) -> dict:
    return it.stats()["autotune"]


def _consume_until(it, done, got=None, each=None):
    """Take batches from ``it`` until ``done(snapshot)`` holds; False if the stream ended
    first."""
    for batch in it:
        if got is not None:
            got.append(batch.tolist())
        if each is not None:
            each(_tuned(it))
        if done(_tuned(it)):
            return True
    return False


def _grows(snap, stage):
    return [d for d in snap["decisions"] if d["stage"] == stage and d["after"] > d["before"]]


@pytest.fixture
def gate():
    F.GATE.clear()
    yield F.GATE
    F.GATE.clear()


# -- the controller applies the policy (the rule itself: test_autotune_policy.py) ----------------
class _FakeExecutor:
    """A threads stage's side of the executor contract, without threads."""

    runner, booting, adaptive, cpu_pool = "threads", 0, False, None

    def __init__(self):
        self.workers, self.max_workers, self.meter = 1, 1, StageMeter()

    def grow(self):
        self.workers += 1

    def shrink(self):
        self.workers -= 1

    def pids(self):
        return []


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _drive(tuner, clock, ex, seconds, per_item, until=None):
    """Items handed on every ``per_item`` seconds for ``seconds`` (or until ``until``
    decisions), the stage's workers all busy (their meter), the consumer waiting."""
    end = clock.now + seconds
    while clock.now < end and (until is None or len(tuner.decisions) < until):
        clock.now += per_item
        ex.meter.ran(per_item * ex.workers)
        tuner.waited(per_item)
        tuner.tick()


def test_the_controller_grows_and_takes_back_through_the_executor():
    """A grow that does not pay (a worker more gives no more items per second), taken
    back: both applied to the executor, recorded, and the recording replays to them."""
    clock, ex = _Clock(), _FakeExecutor()
    tuner = Controller({0: ex}, cpu_budget=4, memory_bytes=1 << 40, clock=clock)
    assert ex.max_workers == 4
    per_item = P.period_s / P.trial_items
    _drive(tuner, clock, ex, 10 * P.period_s, per_item, until=1)
    assert ex.workers == 2
    _drive(tuner, clock, ex, 10 * P.period_s, per_item, until=2)
    assert ex.workers == 1 and "did not pay" in tuner.decisions[-1].reason, tuner.decisions
    assert tuner.trials == [("grow", 0, False)]
    recording = tuner.recording()
    assert replay(P, recording) == [e["actions"] for e in recording if "signals" in e]


def test_the_record_stays_bounded():
    """An hour in which no worker more ever pays: the controller keeps the latest
    keep_decisions decisions, trials and periods, and counts the decisions all."""
    clock, ex = _Clock(), _FakeExecutor()
    tuner = Controller({0: ex}, cpu_budget=4, memory_bytes=1 << 40, clock=clock,
                       params=TuningParams(keep_decisions=8))
    _drive(tuner, clock, ex, 3600.0, P.period_s / P.trial_items)
    assert tuner.decided <= 2 * (3 + 3600 / P.hold_max_s) + 2, tuner.decided
    assert len(tuner.decisions) == 8 and len(tuner.trials) == 8
    assert tuner.decisions[-1].at > 3500 and tuner.snapshot()["decisions_total"] == tuner.decided
    assert f"{tuner.decided} decision(s)" in tuner.explain()[0]
    recording = tuner.recording()
    assert len(recording) == 9  # the state before the first kept period, and 8 periods
    assert replay(P, recording) == [e["actions"] for e in recording if "signals" in e]


def test_a_failed_resize_is_not_recorded_and_the_policy_goes_on():
    class Failing(_FakeExecutor):
        def grow(self):
            raise OSError("no worker")

    clock, ex = _Clock(), Failing()
    tuner = Controller({0: ex}, cpu_budget=4, memory_bytes=1 << 40, clock=clock)
    _drive(tuner, clock, ex, 4 * P.period_s, P.period_s / P.trial_items)
    assert ex.workers == 1 and not tuner.decisions and tuner.trials == []
    recording = tuner.recording()
    assert any(e.get("applied") is False for e in recording)
    assert replay(P, recording) == [e["actions"] for e in recording if "signals" in e]


# -- runs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_stream_is_the_fixed_one(runner):
    n = 300 if runner == "process" else 600
    pipe = _pipe(n, runner, worker_allocation="autotune", max_workers=3)
    try:
        got = [b.tolist() for b in pipe]
    finally:
        pipe.close()
    assert got == _reference(n)
    fixed = _pipe(n, runner, max_workers=2, worker_allocation="per_stage_fixed")
    assert [b.tolist() for b in fixed] == got


def test_slow_stage_gets_more_workers_than_the_cheap_one_threads(gate):
    pipe = _pipe(20_000, "threads", op=F.gated, worker_allocation="autotune", max_workers=4)
    with iter(pipe) as it:
        assert _consume_until(it, lambda s: s["workers"][0] >= 3), _tuned(it)
        snap = _tuned(it)
    assert _grows(snap, 0) and not _grows(snap, 1), snap
    assert snap["workers"][0] > snap["workers"][1] == 1
    assert "autotune (latest run): stage 0: 3, stage 1: 1" in pipe.explain()


def test_slow_stage_gets_more_workers_than_the_cheap_one_process():
    with iter(_pipe(6_000, "process", worker_allocation="autotune", max_workers=3)) as it:
        assert _consume_until(it, lambda s: s["workers"][0] >= 2), _tuned(it)
        snap = _tuned(it)
    assert _grows(snap, 0) and not _grows(snap, 1), snap


def test_total_workers_never_exceed_the_budget(gate):
    seen = []
    with iter(_pipe(20_000, "threads", op=F.gated, second=F.gated,
                    worker_allocation="autotune", max_workers=3)) as it:
        check = lambda s: seen.append(sum(s["workers"].values()))  # noqa: E731
        assert _consume_until(it, lambda s: sum(s["workers"].values()) >= 3, each=check)
        for _ in itertools.islice(it, 200):  # and stays there, full, for a while
            seen.append(sum(_tuned(it)["workers"].values()))
        snap = _tuned(it)
    assert max(seen) == 3 and snap["cpu_budget"] == 3, (seen, snap)
    running = {0: 1, 1: 1}
    for d in snap["decisions"]:
        running[d["stage"]] = d["after"]
        assert sum(running.values()) <= 3, snap


def test_a_workload_that_turns_cheap_is_shrunk(gate):
    """The op blocks (a slow op) until the test opens the gate, then costs nothing; the
    consumer does a little work per batch, so the run lasts while the stage idles."""
    with iter(_pipe(200_000, "threads", op=F.gated, worker_allocation="autotune",
                    max_workers=4)) as it:
        assert _consume_until(it, lambda s: s["workers"][0] >= 2), _tuned(it)
        gate.set()
        grown = _tuned(it)["workers"][0]

        def training_step(snap):
            F.spin(20_000)

        assert _consume_until(it, lambda s: s["workers"][0] < grown, each=training_step), \
            _tuned(it)
        snap = _tuned(it)
    shrinks = [d for d in snap["decisions"] if d["stage"] == 0 and d["after"] < d["before"]]
    assert shrinks and "periods" in shrinks[0]["reason"], snap


# Left out of the default run: whether the cheap phase reads as idle enough to shrink
# depends on CPU time measured on the machine, and a loaded 2-core machine (two suites at
# once) kept the stage above the threshold until the pass ended. The threads variant
# above pins the shrink with an Event the test controls.
@pytest.mark.slow
def test_a_process_workload_that_turns_cheap_is_shrunk():
    n = 20_000
    pipe = _pipe(n, "process", op=F.slow_then_fast, shuffle=False,
                 worker_allocation="autotune", max_workers=3)
    got: list = []
    with iter(pipe) as it:
        assert _consume_until(it, lambda s: s["workers"][0] >= 2, got), _tuned(it)

        def training_step(snap):
            F.spin(20_000)

        assert _consume_until(it, lambda s: s["workers"][0] < 2, got, each=training_step), \
            _tuned(it)
        got += [b.tolist() for b in it]  # nothing lost or repeated across the shrink
    assert got == _reference(n, op=F.slow_then_fast, shuffle=False)


def test_close_mid_run_leaves_no_process():
    it = iter(_pipe(6_000, "process", worker_allocation="autotune", max_workers=3))
    try:
        assert _consume_until(it, lambda s: bool(s["decisions"])), _tuned(it)
        pids = [p for ex in it.engine.executors.values() for p in ex.pids()]
        assert len(pids) >= 3  # the grown worker (perhaps still booting) among them
    finally:
        it.close()
    assert not wait_gone(pids, HANG_S)


def test_checkpoint_under_autotune_restores_exactly():
    n = 1_500
    ref = _reference(n)
    got: list = []
    with iter(_pipe(n, "process", worker_allocation="autotune", max_workers=3)) as it:
        _consume_until(it, lambda s: bool(s["decisions"]) and len(got) >= 20, got)
        state = it.checkpoint()
    again = _pipe(n, "threads", worker_allocation="autotune", max_workers=3)
    again.restore(state)
    assert got + [b.tolist() for b in again] == ref
