"""The autotune memory budget is held after a move, not only estimated before one
(issue 40, finding 10): the controller reads its process workers' resident memory at each
period (the memory signal) and, while they pass ``autotune_memory_bytes``, takes workers
back (an adaptive stage's last one: back inline), recorded as a decision naming the memory
budget; grows are refused meanwhile. The stream is the inline one whatever was decided.

The real runs force the first move (the controller's test hooks: ``frozen`` until
``script`` has made it in the engine's thread at a given item; every later decision is the
controller's own), so they do not depend on the move's timing; nothing here asserts a
time."""

from __future__ import annotations

import itertools

import _autotune_fns as F
import pytest
from _procs import HANG_S, wait_gone
from test_autotune import _Clock, _drive, _FakeExecutor

from zephon import Pipeline, RuntimeOptions, sources
from zephon.pipeline import autotune as A
from zephon.pipeline.autotune import PERIOD_S, TRIAL_ITEMS, Controller, take_back

MIB = 1 << 20
#: The budget is held at the controller's periods: between the period that measured the
#: workers and the test's own read, a worker may have kept one more sample.
TOLERANCE = F.HOARD_BYTES


# -- the decision, a pure function of the memory signal ---------------------------------------
def test_take_back_gives_back_the_fewest_workers_that_bring_the_total_within_the_budget():
    rss = {0: (100 * MIB, 120 * MIB, 110 * MIB), 1: (50 * MIB,)}
    assert take_back(rss, 400 * MIB, {0: 3, 1: 1}, {0: 1, 1: 1}) is None  # 380 MiB fits
    # 380 > 300: the smallest of stage 0 (the stage holding the most) is counted, 100 MiB
    stage, after, why = take_back(rss, 300 * MIB, {0: 3, 1: 1}, {0: 1, 1: 1})
    assert (stage, after) == (0, 2) and why.startswith("memory budget") and "takes 1" in why
    # 380 > 150: two of stage 0 go (100 + 110 MiB), down to its floor of one worker
    assert take_back(rss, 150 * MIB, {0: 3, 1: 1}, {0: 1, 1: 1})[:2] == (0, 1)
    # an adaptive stage's floor is none: inline
    assert take_back(rss, 60 * MIB, {0: 3, 1: 1}, {0: 0, 1: 1})[:2] == (0, 0)
    # stage 0 at its floor: the next one gives back; none left: nothing to do, said why
    assert take_back(rss, 60 * MIB, {0: 1, 1: 1}, {0: 1, 1: 0})[:2] == (1, 0)
    stage, after, why = take_back(rss, 60 * MIB, {0: 1, 1: 1}, {0: 1, 1: 1})
    assert (stage, after) == (0, 1) and "no worker left to take back" in why
    # a pool parked by a move back inline (count 0) is stopped first
    assert take_back({0: (300 * MIB,), 1: (10 * MIB,)}, 100 * MIB, {0: 0, 1: 2},
                     {0: 0, 1: 1})[:2] == (0, 0)


class _FakeProcess(_FakeExecutor):
    """A process stage's controls; its workers' pids are made up (their sizes: the test's
    stand-in for /proc, ``autotune._rss``)."""

    runner = "process"

    def pids(self):
        return [900_000 + i for i in range(self.workers)]


def test_the_controller_takes_back_workers_past_the_memory_budget_and_holds(monkeypatch):
    """A stage grown to 3 workers whose workers then keep memory: past the budget, it
    gives back the fewest that fit (3 -> 2), recorded and shown; it is not grown again
    (no room: the grow is refused); at its last worker, which alone passes the budget,
    nothing is decided and the reason is held."""
    size = {"each": 10 * MIB}
    monkeypatch.setattr(A, "_rss", lambda pid: size["each"])
    clock, ex = _Clock(), _FakeProcess()
    tuner = Controller({0: ex}, cpu_budget=4, memory_bytes=100 * MIB, clock=clock)
    per_item = PERIOD_S / TRIAL_ITEMS  # a worker more pays: items come faster with each
    while ex.workers < 3 and clock.now < 30:
        _drive(tuner, clock, ex, PERIOD_S, per_item / ex.workers)
    assert ex.workers == 3, tuner.decisions
    size["each"] = 45 * MIB  # 135 MiB > 100 MiB: one goes
    _drive(tuner, clock, ex, 2 * PERIOD_S, per_item / ex.workers)
    last = tuner.decisions[-1]
    assert (last.before, last.after) == (3, 2) and "memory budget" in last.reason, last
    assert ex.workers == 2 and tuner.snapshot()["resident_bytes"] == {0: 90 * MIB}
    assert "memory: workers resident 90 MiB of the 100 MiB budget" in "\n".join(
        tuner.explain())
    decided = tuner.decided
    _drive(tuner, clock, ex, 40 * PERIOD_S, per_item / ex.workers)  # it would pay: no room
    assert ex.workers == 2 and tuner.decided == decided, tuner.decisions
    size["each"] = 80 * MIB  # 160 MiB: one more goes, down to the floor
    _drive(tuner, clock, ex, 2 * PERIOD_S, per_item / ex.workers)
    assert ex.workers == 1 and "memory budget" in tuner.decisions[-1].reason
    size["each"] = 120 * MIB  # one worker alone passes it: nothing left to take back
    decided = tuner.decided
    _drive(tuner, clock, ex, 4 * PERIOD_S, per_item)
    assert ex.workers == 1 and tuner.decided == decided
    assert "no worker left to take back" in tuner.held
    assert any("no worker left" in line for line in tuner.explain())


# -- a real run --------------------------------------------------------------------------------
def _pipe(n, **kw):
    return (Pipeline(sources.from_sequence(list(range(n)), name=f"mem{n}"), seed=7,
                     chunk_size=8)
            .map(F.hoard).shuffle(16).batch(4)
            .options(RuntimeOptions(**kw)))


def _resident(pids) -> int:
    return sum(A._rss(pid) for pid in pids)


@pytest.mark.parametrize("keep, budget_mib, inline", [
    # a worker keeps up to 24 samples (192 MiB): two pass 320 MiB, one fits; one goes
    (24, 320, False),
    # ... up to 40 (320 MiB): one alone passes 200 MiB: the stage goes back inline
    (40, 200, True),
])
def test_workers_that_keep_memory_are_taken_back_within_the_budget(monkeypatch, keep,
                                                                   budget_mib, inline):
    """An adaptive stage moved to two process workers whose op keeps 8 MiB per sample in
    them: the controller takes workers back (a decision naming the memory budget) until
    the workers' resident memory, read by the test from /proc of their pids three
    periods after the last such decision, is within the budget (TOLERANCE: a sample kept
    since the controller's read); the batches until then are the inline run's."""
    monkeypatch.setenv("ZEPHON_TEST_HOARD", str(keep))
    n, budget = 20_000, budget_mib * MIB  # (the run stops once the test has its reading)
    pipe = _pipe(n, worker_allocation="autotune", max_workers=2,
                 autotune_memory_bytes=budget, prefetch_batches=2)
    got: list = []
    pids: set = set()
    settled = None  # the workers' resident bytes, 3 periods after the last memory decision
    with iter(pipe) as it:
        tuner, ex = it.engine.tuner, it.engine.executors[0]
        tuner.frozen = True  # until the first move, forced at item 5 (a test's hook) ...
        tuner.script = {5: (0, 2, True)}
        seen, periods, measured, last = 0, 0, 0, None
        for batch in it:
            got.append(batch.tolist())
            if tuner.frozen and tuner.decisions:  # ... every later decision is its own
                tuner.frozen = False
            pids.update(ex.pids())
            memory = [d for d in tuner.decisions if "memory budget" in d.reason]
            if tuner.last is not last:  # a period measured
                periods, measured, last = periods + 1, measured + 1, tuner.last
            if len(memory) != seen:
                seen, periods = len(memory), 0
            if seen and periods >= 3:
                settled = _resident(ex.pids())
                break
            if measured >= 40:  # 10 s of periods and still no decision: it fails below
                break
        explained = pipe.explain()
    assert memory, tuner.decisions  # (before the fix: no decision after the move)
    assert all(d.after < d.before for d in memory), memory
    assert memory[0].before == 2, memory
    assert (memory[-1].after == 0) if inline else (memory[0].after == 1), memory
    assert settled is not None, ("the stream ended before the decisions settled",
                                 tuner.decisions)
    assert settled <= budget + TOLERANCE, (settled // MIB, tuner.decisions)
    assert "memory budget" in explained
    with iter(_pipe(n, runner="inline")) as ref:
        assert got == [b.tolist() for b in itertools.islice(ref, len(got))]
    assert not wait_gone(pids, HANG_S)


def test_an_adaptive_stage_past_the_budget_at_one_worker_goes_back_inline_and_is_held(
        monkeypatch):
    """Its last worker alone passing the budget, an adaptive stage goes back inline (its
    pool stopped), recorded, and is not moved to processes again for HOLD_S although it
    is the bottleneck inline."""
    from test_autotune_adaptive import _Clock as _AClock
    from test_autotune_adaptive import _drive as _adrive
    from test_autotune_adaptive import _FakeAdaptive

    class Moved(_FakeAdaptive):
        def pids(self):
            return [900_000 + i for i in range(self.procs)]

    size = {"each": 150 * MIB}
    monkeypatch.setattr(A, "_rss", lambda pid: size["each"])
    clock, ex = _AClock(), Moved()
    tuner = Controller({0: ex}, cpu_budget=4, memory_bytes=200 * MIB, clock=clock)
    assert tuner.force(0, 2)
    rate = TRIAL_ITEMS / PERIOD_S
    _adrive(tuner, clock, ex, 2 * PERIOD_S, lambda e: rate)  # 300 MiB: one goes
    assert ex.procs == 1 and "memory budget" in tuner.decisions[-1].reason, tuner.decisions
    size["each"] = 250 * MIB  # the last one alone: back inline
    _adrive(tuner, clock, ex, 2 * PERIOD_S, lambda e: rate)
    last = tuner.decisions[-1]
    assert ex.procs == 0 and ex.released and (last.before, last.after) == (1, 0), last
    assert "memory budget" in last.reason and f"held {A.HOLD_S:g} s" in last.reason
    size["each"] = 50 * MIB  # (a new worker would fit now: the hold is what keeps it)
    _adrive(tuner, clock, ex, A.HOLD_S - 2 * PERIOD_S, lambda e: rate)  # hot, but held
    assert ex.procs == 0 and tuner.decisions[-1] == last
    _adrive(tuner, clock, ex, 4 * PERIOD_S, lambda e: rate, until=len(tuner.decisions) + 1)
    assert ex.procs == 2, tuner.decisions  # the hold over: tried again
