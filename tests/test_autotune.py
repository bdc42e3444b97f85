"""worker_allocation="autotune" (zephon.pipeline.autotune): the stream is the one any
fixed worker count gives, the slow stage is grown and not the cheap one, the budget
holds, a workload that turns cheap is shrunk, close() leaves no process, and a
checkpoint taken under autotune restores exactly.

Runs stop as soon as what they wait for is in the controller's record (or the stream
ends, which fails the test): no timing is asserted, only decisions."""

from __future__ import annotations

import pytest

import _autotune_fns as F
from _procs import HANG_S, wait_gone
from zephon import Pipeline, RuntimeOptions, sources
from zephon.pipeline import autotune as A
from zephon.pipeline.autotune import (
    BUSY_GROW,
    HOLD_MAX_S,
    HOLD_S,
    PERIOD_S,
    SHRINK_PERIODS,
    TRIAL_ITEMS,
    WAIT_GROW,
    Controller,
    _Signals,
    choose,
    judge,
)


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


# -- the rule ---------------------------------------------------------------------------------
def _sig(workers, busy, wait):
    return _Signals(dict(enumerate(workers)), dict(enumerate(busy)), wait)


def test_rule_grows_the_busiest_stage_while_the_consumer_waits():
    caps = {0: 3, 1: 3}
    assert choose(_sig([1, 1], [0.95, 0.2], 0.5), caps, 4, {}, lambda s: True)[:2] == (0, 1)
    # no wait: nothing to gain
    assert choose(_sig([1, 1], [0.95, 0.2], WAIT_GROW / 2), caps, 4, {}, lambda s: True) is None
    # nobody busy: the bottleneck is elsewhere
    assert choose(_sig([1, 1], [BUSY_GROW / 2, 0.1], 0.9), caps, 4, {}, lambda s: True) is None
    # memory refuses the grow
    assert choose(_sig([1, 1], [0.95, 0.2], 0.5), caps, 4, {}, lambda s: False) is None


def test_rule_never_exceeds_the_cpu_budget_and_moves_a_spare_worker():
    caps = {0: 2, 1: 2}
    # budget full, no stage can spare a worker: nothing
    assert choose(_sig([2, 1], [0.99, 0.99], 0.9), caps, 3, {}, lambda s: True) is None
    # budget full, stage 1 would stay below BUSY_GROW with one fewer: it gives one up
    stage, delta, reason = choose(_sig([1, 2], [0.99, 0.1], 0.9), caps, 3, {}, lambda s: True)
    assert (stage, delta) == (1, -1) and "gives a worker to stage 0" in reason
    # at its cap a stage is not grown
    assert choose(_sig([2, 1], [0.99, 0.1], 0.9), {0: 2, 1: 2}, 8, {}, lambda s: True) is None


def test_rule_shrinks_an_idle_stage_only_after_several_periods():
    idle: dict = {}
    for _ in range(SHRINK_PERIODS - 1):
        assert choose(_sig([3, 1], [0.1, 0.5], 0.0), {0: 3, 1: 3}, 4, idle, lambda s: True) \
            is None
    assert choose(_sig([3, 1], [0.1, 0.5], 0.0), {0: 3, 1: 3}, 4, idle,
                  lambda s: True)[:2] == (0, -1)
    # a busy period in between starts the count again
    idle = {}
    choose(_sig([3, 1], [0.1, 0.5], 0.0), {0: 3, 1: 3}, 4, idle, lambda s: True)
    choose(_sig([3, 1], [0.9, 0.5], 0.0), {0: 3, 1: 3}, 4, idle, lambda s: True)
    assert idle[0] == 0


def test_rule_grows_a_waiting_process_stage_past_the_cpu_budget():
    waiting = {0: 8}
    # budget 2 full, stage 0's two workers busy but asking 5 % of a core: a third one
    # more: it doubles (two more), as the CPU the new ones need fits
    sig = _Signals({0: 2}, {0: 0.99}, 0.9, {0: 0.05})
    stage, delta, reason = choose(sig, {0: 2}, 2, {}, lambda s, n=1: True, waiting)
    assert (stage, delta) == (0, 2) and "past the CPU budget" in reason
    # the doubling stops at the waiting cap (6 -> 8, not 12) ...
    assert choose(_Signals({0: 6}, {0: 0.99}, 0.9, {0: 0.05}), {0: 2}, 2, {},
                  lambda s, n=1: True, waiting)[:2] == (0, 2)
    # ... at what the measured CPU leaves (4 workers at 28 % of a core use 1.12 of 2:
    # room for 3 more; 5 at 29 % use 1.45: room for 1) ...
    assert choose(_Signals({0: 4}, {0: 0.99}, 0.9, {0: 0.28}), {0: 2}, 2, {},
                  lambda s, n=1: True, waiting)[:2] == (0, 3)
    assert choose(_Signals({0: 5}, {0: 0.99}, 0.9, {0: 0.29}), {0: 2}, 2, {},
                  lambda s, n=1: True, waiting)[:2] == (0, 1)
    # ... and at what the memory budget holds (halved until it fits)
    assert choose(_Signals({0: 4}, {0: 0.99}, 0.9, {0: 0.01}), {0: 2}, 2, {},
                  lambda s, n=1: n <= 2, waiting)[:2] == (0, 2)
    assert choose(_Signals({0: 4}, {0: 0.99}, 0.9, {0: 0.01}), {0: 2}, 2, {},
                  lambda s, n=1: False, waiting) is None
    # without a waiting cap (a thread stage) the budget holds
    assert choose(sig, {0: 2}, 2, {}, lambda s: True) is None
    # a CPU-bound stage (its workers ask a core all the time they are busy): it holds
    assert choose(_Signals({0: 2}, {0: 0.99}, 0.9, {0: 0.95}), {0: 2}, 2, {},
                  lambda s: True, waiting) is None
    # the measured demand of all workers, plus one more, must fit in the budget
    assert choose(_Signals({0: 6}, {0: 0.99}, 0.9, {0: 0.29}), {0: 2}, 2, {},
                  lambda s, n=1: True, waiting) is None
    # and the waiting cap
    assert choose(_Signals({0: 8}, {0: 0.99}, 0.9, {0: 0.01}), {0: 2}, 2, {},
                  lambda s, n=1: True, waiting) is None


def test_judge_keeps_only_a_grow_that_paid():
    assert judge(100.0, 110.0)
    assert not judge(100.0, 100.0) and not judge(100.0, 90.0)


class _FakeExecutor:
    runner, booting = "threads", 0

    def __init__(self):
        self.workers, self.meter, self.max_workers = 1, None, 1

    def grow(self):
        self.workers += 1

    def shrink(self):
        self.workers -= 1


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _drive(tuner, clock, ex, seconds, per_item, until=None):
    """Items handed on every ``per_item`` seconds for ``seconds`` (or until ``until``
    decisions), the stage's workers all busy, the consumer waiting all the time."""
    end = clock.now + seconds
    while clock.now < end and (until is None or len(tuner.decisions) < until):
        clock.now += per_item
        tuner.meters[0].ran(per_item * ex.workers)
        tuner.waited(per_item)
        tuner.tick()


def test_a_grow_that_does_not_pay_is_taken_back_and_held():
    """The stage looks like the bottleneck (busy, the consumer waits), but a worker more
    gives no more items per second (the cores are used by something else): it is taken
    back, and not tried again for HOLD_S."""
    clock, ex = _Clock(), _FakeExecutor()
    tuner = Controller({0: ex}, cpu_budget=4, memory_bytes=1 << 40, clock=clock)
    per_item = PERIOD_S / TRIAL_ITEMS  # TRIAL_ITEMS per period, whatever the workers
    _drive(tuner, clock, ex, 10 * PERIOD_S, per_item, until=1)
    assert ex.workers == 2
    _drive(tuner, clock, ex, 10 * PERIOD_S, per_item, until=2)
    assert ex.workers == 1 and "did not pay" in tuner.decisions[-1].reason, tuner.decisions
    undone = clock.now
    _drive(tuner, clock, ex, HOLD_S - 2 * PERIOD_S, per_item)
    assert ex.workers == 1 and len(tuner.decisions) == 2  # held
    _drive(tuner, clock, ex, 4 * PERIOD_S, per_item, until=3)
    assert ex.workers == 2 and tuner.decisions[-1].at >= undone + HOLD_S - PERIOD_S


def test_grows_that_never_pay_are_held_longer_each_time_and_the_record_stays_bounded(
        monkeypatch):
    """An hour in which no worker more ever pays: each failed grow in a row doubles the
    hold (5, 10, 20, 40, 40 ... s), so the stage is tried about once per HOLD_MAX_S, not
    every HOLD_S; the controller keeps the latest KEEP_DECISIONS decisions and trials
    and counts them all."""
    monkeypatch.setattr(A, "KEEP_DECISIONS", 8)
    clock, ex = _Clock(), _FakeExecutor()
    tuner = Controller({0: ex}, cpu_budget=4, memory_bytes=1 << 40, clock=clock)
    per_item = PERIOD_S / TRIAL_ITEMS
    _drive(tuner, clock, ex, 3600.0, per_item)
    undone = [d for d in tuner.decisions if "did not pay" in d.reason]
    holds = [float(d.reason.split("(held ")[1].split(" s")[0]) for d in undone]
    assert holds[-3:] == [HOLD_MAX_S] * 3, tuner.decisions
    grows = [d.at for d in tuner.decisions if d.after > d.before]
    assert all(b - a >= HOLD_MAX_S for a, b in zip(grows, grows[1:])), grows
    # first hour: 5 + 10 + 20 s of holds, then one failed grow per ~40 s: ~2 x 90 decisions
    assert tuner.decided <= 2 * (3 + 3600 / HOLD_MAX_S) + 2, tuner.decided
    assert len(tuner.decisions) == 8 and len(tuner.trials) == 8
    assert tuner.decisions[-1].at > 3500 and tuner.snapshot()["decisions_total"] == tuner.decided
    assert f"{tuner.decided} decision(s)" in tuner.explain()[0]


class _FakeWaitingProcess(_FakeExecutor):
    runner = "process"

    def pids(self):
        return []


class _WaitingController(Controller):
    """Its process stage's workers ask 1 % of a core each (they wait on storage)."""

    def _cpu_take(self):
        return {s: 0.01 * self.executors[s].workers * PERIOD_S for s in self._procs}


def test_a_waiting_stage_doubles_and_a_doubling_that_does_not_pay_is_taken_back_whole():
    """Items per second rise with the workers up to two (what the storage gives), then not:
    the stage grows to 2 (within the budget), doubles past it (2 -> 4: its workers ask
    1 % of a core each) in one decision, and that grow is taken back whole (4 -> 2)."""
    clock, ex = _Clock(), _FakeWaitingProcess()
    tuner = _WaitingController({0: ex}, cpu_budget=2, memory_bytes=1 << 40, clock=clock)
    base = PERIOD_S / TRIAL_ITEMS
    while len(tuner.decisions) < 3 and clock.now < 20:
        per_item = base / min(ex.workers, 2)
        clock.now += per_item
        tuner.meters[0].ran(per_item * ex.workers)
        tuner.waited(per_item)
        tuner.tick()
    d = [(x.before, x.after) for x in tuner.decisions]
    assert d == [(1, 2), (2, 4), (4, 2)], tuner.decisions
    assert "past the CPU budget" in tuner.decisions[1].reason
    assert "did not pay" in tuner.decisions[2].reason and ex.workers == 2


def test_a_grow_that_pays_is_kept():
    clock, ex = _Clock(), _FakeExecutor()
    tuner = Controller({0: ex}, cpu_budget=2, memory_bytes=1 << 40, clock=clock)
    base = PERIOD_S / TRIAL_ITEMS
    end = clock.now + 8 * PERIOD_S
    while clock.now < end:  # items come twice as fast with two workers
        per_item = base / ex.workers
        clock.now += per_item
        tuner.meters[0].ran(per_item * ex.workers)
        tuner.waited(per_item)
        tuner.tick()
    assert ex.workers == 2 and len(tuner.decisions) == 1, tuner.decisions


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
    with iter(_pipe(20_000, "threads", op=F.gated, worker_allocation="autotune",
                    max_workers=4)) as it:
        assert _consume_until(it, lambda s: s["workers"][0] >= 3), _tuned(it)
        snap = _tuned(it)
    assert _grows(snap, 0) and not _grows(snap, 1), snap
    assert snap["workers"][0] > snap["workers"][1] == 1
    assert "autotune (latest run): stage 0: 3, stage 1: 1" in it.pipeline.explain()


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
        for _, batch in zip(range(200), it):  # and stays there, full, for a while
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
