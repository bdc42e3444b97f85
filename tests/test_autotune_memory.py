"""The autotune memory budget is held after a move, not only estimated before one
the controller reads its process workers' resident memory at each
period (the memory signal) and, while they pass ``autotune_memory_bytes``, takes workers
back (an adaptive stage's last one: back inline), recorded as a decision naming the memory
budget; grows are refused meanwhile. The stream is the inline one whatever was decided.

The real runs force the first move (the controller's test hooks: ``frozen`` until
``script`` has made it in the engine's thread at a given item; every later decision is the
controller's own), so they do not depend on the move's timing; nothing here asserts a
time."""

from __future__ import annotations

import itertools
import os

import _autotune_fns as F
import pytest
from _procs import HANG_S, wait_gone

from zephon import Pipeline, RuntimeOptions, sources
from zephon.pipeline.tuning import take_back

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


# (the controller's decisions over memory signals: test_autotune_policy.py)


# -- a real run --------------------------------------------------------------------------------
def _pipe(n, **kw):
    return (Pipeline(sources.from_sequence(list(range(n)), name=f"mem{n}"), seed=7,
                     chunk_size=8)
            .map(F.hoard).shuffle(16).batch(4)
            .options(RuntimeOptions(**kw)))


def _resident(pids) -> int:
    """The resident bytes of ``pids`` (``/proc/<pid>/statm``; 0 for one gone)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", encoding="ascii") as fh:
                total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total


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
    assert memory, tuner.decisions
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
