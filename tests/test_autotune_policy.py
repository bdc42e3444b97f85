"""The autotune policy (:mod:`zephon.pipeline.tuning`), pure: the rule's decisions over
constructed signal sequences, and save and replay.

:class:`World` stands in for the controller and its executors without a clock, a thread
or a process: it hands items on at a rate the test gives (one "tick" per item, as the
engine's), sums each period's signals as the controller samples them, calls
:func:`~zephon.pipeline.tuning.decide`, and applies the actions to its own counts. It
records every period as the controller does, so each test can replay its run."""

from __future__ import annotations

import itertools
import json

import pytest

from zephon.pipeline.autotune import Decision
from zephon.pipeline.tuning import (
    ActionKind,
    Measures,
    Signals,
    StageSignals,
    TuningParams,
    choose,
    decide,
    fitting,
    initial_state,
    judge,
    judge_inline,
    replay,
    to_plain,
)

P = TuningParams()
MIB = 1 << 20


class World:
    """Stages (``kinds``: stage -> "adaptive", "threads" or "process") as the policy
    sees them, driven tick by tick (see the module docstring).

    ``counts``: workers per stage (0: an adaptive stage inline); ``boot``: seconds a move
    to processes boots (the stage runs inline meanwhile); ``rss``: stage -> resident bytes
    of each of its workers; ``cpu(world, stage)``: the share of a core each busy process
    worker asks (default 1: CPU-bound); ``progress(world)``: the run's (read, left)."""

    def __init__(self, kinds, cpu_budget=4, memory_bytes=1 << 40, params=P, boot=0.0,
                 progress=None, own_rss=0, rss=None, cpu=None, budgets=None):
        self.kinds, self.params, self.boot = dict(kinds), params, boot
        self.state = initial_state(
            params, {s: (k == "adaptive", k not in ("threads", "ray"))
                     for s, k in kinds.items()},
            cpu_budget, memory_bytes, 0.0, budgets)
        self.counts = {s: 0 if k == "adaptive" else 1 for s, k in kinds.items()}
        self.ready_at = dict.fromkeys(kinds, 0.0)
        self.profile = dict.fromkeys(kinds, (1e-3, 8.0))
        self.unable = dict.fromkeys(kinds, "")
        self.progress, self.own_rss, self.cpu = progress, own_rss, cpu
        self.rss = dict(rss or {})
        self.now = self.since = 0.0
        self.ticks = 0
        self.spent = dict.fromkeys(kinds, 0.0)
        self._reset()
        self.decisions: list[Decision] = []
        self.trials: list[tuple[str, int, bool]] = []
        self.released: list[int] = []
        self.last: Measures | None = None
        self.recording: list[dict] = [{"state": to_plain(self.state)}]

    def _reset(self):
        self.items, self.wait = 0, 0.0
        self.op = dict.fromkeys(self.kinds, 0.0)
        self.demand = dict.fromkeys(self.kinds)

    @property
    def held(self):
        return self.state.held

    def ready(self, s):
        return self.counts[s] > 0 and self.now >= self.ready_at[s]

    def runner(self, s):
        kind = self.kinds[s]
        if kind == "adaptive":
            return "process" if self.ready(s) else "inline"
        return kind

    def workers(self, s):
        return 1 if self.runner(s) == "inline" else self.counts[s]

    def tick(self, per_item, busy=1.0, demand=None):
        """One item handed on ``per_item`` seconds after the last; each stage's workers
        busy ``busy`` of the time; ``demand``: the share of its op time an inline stage's
        units ask of the CPU (None: not reported)."""
        self.now += per_item
        self.ticks += 1
        self.items += 1
        self.wait += per_item
        for s in self.kinds:
            op = per_item * self.workers(s) * busy
            self.op[s] += op
            self.spent[s] += op
            if demand is not None and self.runner(s) == "inline":
                self.demand[s] = (self.demand[s] or 0.0) + op * demand
        if self.now - self.since >= self.params.period_s:
            self.period()

    def signals(self):
        elapsed = self.now - self.since
        stages = []
        for s, kind in sorted(self.kinds.items()):
            cpu_s = None
            if kind not in ("threads", "ray"):  # (a Ray stage's CPU is read nowhere)
                share = self.cpu(self, s) if self.cpu else 1.0
                cpu_s = share * self.counts[s] * elapsed if self.runner(s) == "process" \
                    else 0.0
            rss = (self.rss[s],) * self.counts[s] \
                if self.rss.get(s) and kind not in ("threads", "ray") \
                else ()
            stages.append(StageSignals(
                s, self.runner(s), self.workers(s),
                int(self.counts[s] > 0 and not self.ready(s)), self.op[s], self.demand[s],
                cpu_s, rss, self.profile[s], self.unable[s], self.spent[s]))
        return Signals(self.now, self.since, self.items, self.wait, tuple(stages),
                       self.own_rss, self.progress(self) if self.progress else None)

    def period(self):
        sig = self.signals()
        self._reset()
        self.since = self.now
        step, state = decide(self.params, self.state, sig)
        for a in step.actions:
            if a.kind is ActionKind.RELEASE:
                self.released.append(a.stage)
                continue
            if a.kind is ActionKind.MOVE and a.after and not self.counts[a.stage]:
                self.ready_at[a.stage] = self.now + self.boot
            if a.change:
                self.counts[a.stage] = a.after
            self.decisions.append(Decision(round(self.now, 3), a.stage, a.before, a.after,
                                           a.reason))
        self.state = state
        if step.judged:
            self.trials.append((step.judged[0].value, *step.judged[1:]))
        if step.measures is not None:
            self.last = step.measures
        self.recording.append({"signals": to_plain(sig), "actions": to_plain(list(step.actions)),
                               "applied": True})

    def replayed(self):
        """Whether replaying this world's recording (through JSON) gives its actions."""
        recording = json.loads(json.dumps(self.recording))
        return replay(self.params, recording) == [e["actions"] for e in recording[1:]]


def drive(world, seconds, rate, busy=1.0, until=None, demand=None):
    """Items handed on at ``rate(world)`` per second for ``seconds`` (or until ``until``
    decisions), the consumer waiting all the time."""
    end = world.now + seconds
    while world.now < end and (until is None or len(world.decisions) < until):
        world.tick(1.0 / rate(world), busy, demand)


PER_PERIOD = P.trial_items / P.period_s  # items per second: TRIAL_ITEMS a period


def flat(world):
    return PER_PERIOD


# -- choose: the grow and the shrink over one period ------------------------------------------
def _m(busy, wait, cpu=None):
    return Measures(dict(enumerate(busy)), dict(cpu or {}), wait, 0.0, {})


def _choose(workers, busy, wait, caps, budget, idle=None, ok=True, cpu=None, waiting=None):
    def memory_ok(s, n=1):
        return ok(s, n) if callable(ok) else ok
    return choose(P, _m(busy, wait, cpu), dict(enumerate(workers)), caps, budget,
                  idle or {}, memory_ok, waiting)


def test_rule_grows_the_busiest_stage_while_the_consumer_waits():
    caps = {0: 3, 1: 3}
    assert _choose([1, 1], [0.95, 0.2], 0.5, caps, 4)[0][:2] == (0, 1)
    assert _choose([1, 1], [0.95, 0.2], P.wait_grow / 2, caps, 4)[0] is None
    assert _choose([1, 1], [P.busy_grow / 2, 0.1], 0.9, caps, 4)[0] is None
    assert _choose([1, 1], [0.95, 0.2], 0.5, caps, 4, ok=False)[0] is None  # no memory


def test_rule_never_exceeds_the_cpu_budget_and_moves_a_spare_worker():
    caps = {0: 2, 1: 2}
    assert _choose([2, 1], [0.99, 0.99], 0.9, caps, 3)[0] is None
    (stage, delta, reason), _ = _choose([1, 2], [0.99, 0.1], 0.9, caps, 3)
    assert (stage, delta) == (1, -1) and "gives a worker to stage 0" in reason
    assert _choose([2, 1], [0.99, 0.1], 0.9, {0: 2, 1: 2}, 8)[0] is None  # at its cap


def test_rule_shrinks_an_idle_stage_only_after_several_periods():
    idle: dict = {}
    for _ in range(P.shrink_periods - 1):
        choice, idle = _choose([3, 1], [0.1, 0.5], 0.0, {0: 3, 1: 3}, 4, idle)
        assert choice is None
    choice, idle = _choose([3, 1], [0.1, 0.5], 0.0, {0: 3, 1: 3}, 4, idle)
    assert choice[:2] == (0, -1) and idle[0] == 0
    # a busy period in between starts the count again
    _, idle = _choose([3, 1], [0.1, 0.5], 0.0, {0: 3, 1: 3}, 4, idle)
    _, idle = _choose([3, 1], [0.9, 0.5], 0.0, {0: 3, 1: 3}, 4, idle)
    assert idle[0] == 0


def test_rule_grows_a_waiting_process_stage_past_the_cpu_budget():
    waiting = {0: 8}

    def grow(workers, cpu, ok=True, cap=waiting):
        return _choose([workers], [0.99], 0.9, {0: 2}, 2, cpu={0: cpu}, ok=ok,
                       waiting=cap)[0]

    # budget 2 full, its two workers busy but asking 5 % of a core: it doubles
    stage, delta, reason = grow(2, 0.05)
    assert (stage, delta) == (0, 2) and "past the CPU budget" in reason
    assert grow(6, 0.05)[:2] == (0, 2)  # the doubling stops at the waiting cap (6 -> 8) ...
    # ... at what the measured CPU leaves (4 at 28 % use 1.12 of 2: room for 3 more;
    # 5 at 29 % use 1.45: room for 1) ...
    assert grow(4, 0.28)[:2] == (0, 3)
    assert grow(5, 0.29)[:2] == (0, 1)
    # ... and at what the memory budget holds (halved until it fits)
    assert grow(4, 0.01, ok=lambda s, n: n <= 2)[:2] == (0, 2)
    assert grow(4, 0.01, ok=False) is None
    assert grow(2, 0.05, cap=None) is None  # without a waiting cap the budget holds
    assert grow(2, 0.95) is None  # a CPU-bound stage: it holds
    assert grow(6, 0.29) is None  # the demand of all workers, plus one more, must fit
    assert grow(8, 0.01) is None  # and the waiting cap


def test_judge_keeps_only_a_grow_that_paid():
    assert judge(P, 100.0, 110.0)
    assert not judge(P, 100.0, 100.0) and not judge(P, 100.0, 90.0)
    assert judge_inline(P, 100.0, 100.0) and judge_inline(P, 100.0, 98.0)
    assert not judge_inline(P, 100.0, 90.0)


# -- grows on trial ---------------------------------------------------------------------------
def test_a_grow_that_does_not_pay_is_taken_back_and_held():
    """The stage looks like the bottleneck, but a worker more gives no more items per
    second: it is taken back, and not tried again for hold_s."""
    w = World({0: "threads"})
    drive(w, 10 * P.period_s, flat, until=1)
    assert w.counts[0] == 2
    drive(w, 10 * P.period_s, flat, until=2)
    assert w.counts[0] == 1 and "did not pay" in w.decisions[-1].reason, w.decisions
    undone = w.now
    drive(w, P.hold_s - 2 * P.period_s, flat)
    assert w.counts[0] == 1 and len(w.decisions) == 2  # held
    drive(w, 4 * P.period_s, flat, until=3)
    assert w.counts[0] == 2 and w.decisions[-1].at >= undone + P.hold_s - P.period_s
    assert w.replayed()


def test_grows_that_never_pay_are_held_longer_each_time():
    """An hour in which no worker more ever pays: each failed grow in a row doubles the
    hold (5, 10, 20, 40, 40 ... s), so the stage is tried about once per hold_max_s."""
    w = World({0: "threads"})
    drive(w, 3600.0, flat)
    undone = [d for d in w.decisions if "did not pay" in d.reason]
    holds = [float(d.reason.split("(held ")[1].split(" s")[0]) for d in undone]
    assert holds[:3] == [P.hold_s, 2 * P.hold_s, 4 * P.hold_s]
    assert holds[-3:] == [P.hold_max_s] * 3, w.decisions[-6:]
    grows = [d.at for d in w.decisions if d.after > d.before]
    assert all(b - a >= P.hold_max_s for a, b in itertools.pairwise(grows[3:])), grows
    assert len(w.decisions) <= 2 * (3 + 3600 / P.hold_max_s) + 2, len(w.decisions)


def test_a_waiting_stage_doubles_and_a_doubling_that_does_not_pay_is_taken_back_whole():
    """Items per second rise with the workers up to two, then not: the stage grows to 2
    (within the budget), doubles past it (2 -> 4: its workers ask 1 % of a core each) in
    one decision, and that grow is taken back whole (4 -> 2)."""
    w = World({0: "process"}, cpu_budget=2, cpu=lambda world, s: 0.01)
    drive(w, 20.0, lambda world: PER_PERIOD * min(world.counts[0], 2), until=3)
    assert [(x.before, x.after) for x in w.decisions] == [(1, 2), (2, 4), (4, 2)], w.decisions
    assert "past the CPU budget" in w.decisions[1].reason
    assert "did not pay" in w.decisions[2].reason and w.counts[0] == 2
    assert w.replayed()


def test_a_grow_that_pays_is_kept():
    w = World({0: "threads"}, cpu_budget=2)
    drive(w, 8 * P.period_s, lambda world: PER_PERIOD * world.counts[0])
    assert w.counts[0] == 2 and len(w.decisions) == 1, w.decisions
    assert w.trials == [("grow", 0, True)] and w.state.trial is None


def test_a_stage_with_a_budget_of_its_own_grows_within_it_and_not_the_hosts():
    """A Ray stage (budget: the cluster's 6 CPUs) is the bottleneck beside a process
    stage on a 2-CPU host: it grows one actor at a time past the host's budget up to its
    own; the host's stage is tried within the host's budget (its grows do not pay and
    are taken back); every grow is judged as any other."""
    w = World({0: "process", 1: "ray"}, cpu_budget=2, budgets={1: 6})
    assert w.state.of(1).cap == 6 and w.state.of(0).cap == 2
    drive(w, 40 * P.period_s, lambda world: PER_PERIOD * world.counts[1])
    assert w.counts == {0: 1, 1: 6}, w.decisions
    ray_steps = [(d.before, d.after) for d in w.decisions if d.stage == 1]
    assert ray_steps == [(k, k + 1) for k in range(1, 6)]
    assert max(d.after for d in w.decisions if d.stage == 0) <= 2
    assert w.replayed()


def test_a_stage_with_a_budget_of_its_own_shrinks_when_its_actors_idle():
    w = World({0: "threads", 1: "ray"}, cpu_budget=2, budgets={1: 6})
    w.counts[1] = 4
    drive(w, (P.shrink_periods + 1) * P.period_s, flat, busy=0.1)
    assert w.counts[1] == 3 and w.counts[0] == 1, w.decisions


# -- the moves of an adaptive stage ------------------------------------------------------------
def test_a_busy_inline_stage_is_moved_straight_to_two_workers_and_kept_when_it_pays():
    w = World({0: "adaptive"})
    rate = lambda world: PER_PERIOD * (2 if world.counts[0] else 1)  # noqa: E731
    drive(w, 10 * P.period_s, rate, until=1)
    first = w.decisions[0]
    assert (first.before, first.after) == (0, P.move_workers), first
    assert first.at < P.period_s * 1.5, first  # on the first period: it counts from the start
    drive(w, 4 * P.period_s, rate, busy=0.55)  # judged: kept
    assert w.counts[0] >= P.move_workers and w.state.trial is None, w.decisions
    assert w.trials == [("process", 0, True)]
    assert not [d for d in w.decisions if d.after == 0]


@pytest.mark.parametrize("room, want", [(0.5, 0), (1.5, 1), (None, P.move_workers)])
def test_a_move_starts_only_the_workers_the_memory_budget_has_room_for(room, want):
    """A worker not started yet counts as this process, at most new_worker_bytes: with
    room for none, the stage stays inline and the hold says why; with room for one, the
    move starts one."""
    size = 200 * MIB
    w = World({0: "adaptive"}, memory_bytes=int(room * size) if room else 1 << 40,
              own_rss=size)
    drive(w, 6 * P.period_s, flat, until=1)
    assert w.counts[0] == want, (w.decisions, w.held)
    if not want:
        assert w.held.startswith("memory budget"), w.held


def test_a_worker_not_started_yet_counts_as_the_largest_one_running():
    """With a process stage's worker running at 1 GiB, a move of another stage counts
    each new worker at 1 GiB too, not at this process's size: 2.5 GiB has room for one."""
    gib = 1 << 30
    state = initial_state(P, {0: (True, True), 1: (False, True)}, 4, int(2.5 * gib), 0.0)
    running = StageSignals(1, "process", 1, rss=(gib,))
    sig = Signals(1.0, 0.0, 0, 0.0, (StageSignals(0, "inline", 1), running),
                  own_rss=100 * MIB)
    assert fitting(P, state, sig, 0, 2)[0] == 1  # 1 GiB running + 1 GiB new < + 2 GiB
    alone = Signals(1.0, 0.0, 0, 0.0, (StageSignals(0, "inline", 1),), own_rss=100 * MIB)
    state1 = initial_state(P, {0: (True, True)}, 4, int(2.5 * gib), 0.0)
    assert fitting(P, state1, alone, 0, 2)[0] == 2
    # the size of this process counts at most new_worker_bytes
    big = Signals(1.0, 0.0, 0, 0.0, (StageSignals(0, "inline", 1),), own_rss=10 * gib)
    assert fitting(P, state1, big, 0, 2)[0] == 2


def test_a_budget_of_one_worker_moves_one_stage_to_one_worker():
    """A budget of 1 over two adaptive stages (inline, they hold no worker): the budget
    stays 1 and the move starts one worker."""
    w = World({0: "adaptive", 1: "adaptive"}, cpu_budget=1)
    assert w.state.cpu_budget == 1
    drive(w, 6 * P.period_s, flat, until=1)
    assert w.counts[0] + w.counts[1] == 1, w.decisions


def test_a_move_is_judged_after_its_settling_period():
    """The first period on processes (the switch) hands on a quarter of what inline did;
    the rate after it is 1.5 x inline's. The trial skips that period and judges on
    trial_min_s of what follows: the move is kept."""
    w = World({0: "adaptive"})
    moved_at: list[float] = []

    def rate(world):
        if not world.counts[0]:
            return PER_PERIOD
        if not moved_at:
            moved_at.append(world.now)
        return PER_PERIOD * (0.25 if world.now - moved_at[0] < P.period_s else 1.5)

    drive(w, 10 * P.period_s, rate, until=1)
    assert w.counts[0] == P.move_workers, w.decisions
    drive(w, 3 * P.period_s + P.trial_min_s, rate, busy=0.5)
    assert w.trials == [("process", 0, True)], w.decisions
    assert w.counts[0] == P.move_workers and len(w.decisions) == 1, w.decisions


@pytest.mark.parametrize("boot", [0.26, 0.49, 0.74])  # ready early, mid, late in a period
def test_the_settling_period_is_a_whole_period_after_the_workers_are_ready(boot):
    """Wherever in a period the workers become ready, the switch that follows (a quarter
    of inline's rate for a period, then 1.5 x) is not judged: the move is kept."""
    w = World({0: "adaptive"}, boot=boot)

    def rate(world):
        if not world.ready(0):
            return PER_PERIOD
        return PER_PERIOD * (0.25 if world.now - world.ready_at[0] < P.period_s else 1.5)

    drive(w, 10 * P.period_s, rate, until=1)
    drive(w, 3.0, rate, busy=0.5)
    assert w.trials[:1] == [("process", 0, True)], w.decisions
    assert w.counts[0] == P.move_workers, w.decisions
    assert w.replayed()


@pytest.mark.parametrize("inflated", [1, 10])  # a filter keeping 1 of 10: 10x per sample
@pytest.mark.parametrize("left, moved", [
    (None, True),  # a run that goes on for ever
    (2.0, True),  # 2 x the payback of work left, at what the stage spent per sample read
    (0.5, False),  # half of it: the boot would not pay
])
def test_an_inline_stage_is_moved_only_when_the_work_left_in_the_run_pays_the_boot(
        left, moved, inflated):
    """The work left is the source samples left at the op seconds the stage spent per
    source sample read (one per item here), whatever its per-output-sample profile."""
    per_item = 1 / PER_PERIOD
    samples = None if left is None else int(left * P.move_payback_s / per_item)
    w = World({0: "adaptive"},
              progress=lambda world: None if samples is None else (world.ticks, samples))
    w.profile[0] = (per_item * inflated, 8.0)
    drive(w, 10 * P.period_s, flat, until=1)
    assert bool(w.decisions) == moved and (w.counts[0] > 0) == moved, w.decisions


@pytest.mark.parametrize("demand, busy, memory, workers", [
    (1.0, 1.0, None, P.move_workers),  # CPU-bound: two workers
    (0.05, 1.0, None, P.waiting_factor * 2),  # waiting: its whole waiting cap at once
    (0.28, 1.0, None, 7),  # asking 28 % of a core: the 2 cores feed 7 workers
    (0.28, 0.7, None, 7),  # ... per second its op runs, not per elapsed second
    (0.05, 1.0, 4.5, 4),  # waiting, memory for 4.5 processes this size: halved once
    (0.05, 1.0, 1.5, 1),  # ... for fewer than two: one (every move keeps to the budget)
])
def test_a_waiting_inline_stage_is_moved_to_as_many_workers_as_its_demand_calls_for(
        demand, busy, memory, workers):
    size = 200 * MIB  # this process's size, as the controller reads it
    w = World({0: "adaptive"}, cpu_budget=2,
              memory_bytes=int(memory * size) if memory else 1 << 40, own_rss=size)
    drive(w, 10 * P.period_s, flat, busy=busy, until=1, demand=demand)
    first = w.decisions[0]
    assert (first.before, first.after) == (0, workers), first
    if workers > P.move_workers:
        assert f"{workers} workers" in first.reason
    # a waiting stage moves on wide_periods periods of evidence, a CPU-bound one on one
    periods = P.wide_periods if demand < P.waiting_cpu else 1
    assert periods * P.period_s <= first.at < (periods + 0.5) * P.period_s, first


def test_a_stage_waiting_in_only_one_of_its_periods_is_moved_as_a_cpu_bound_one():
    """Waiting in the first period (a shard being opened), CPU-bound in the second: no
    wide move on the first, two workers on the second, not the waiting cap."""
    w = World({0: "adaptive"}, cpu_budget=2, own_rss=100 * MIB)
    while w.state.of(0).ripe < 1 and w.now < 10:  # to the end of a waiting period
        w.tick(1 / PER_PERIOD, demand=0.05)
    assert not w.decisions and w.state.of(0).asked is not None  # no wide move on one
    drive(w, 4 * P.period_s, flat, until=1, demand=1.0)
    assert w.decisions[0].after == P.move_workers, w.decisions


def test_a_wide_move_whose_workers_turn_out_cpu_bound_is_cut_back_to_the_budget():
    w = World({0: "adaptive"}, cpu_budget=2, own_rss=100 * MIB)
    rate = lambda world: PER_PERIOD * (2 if world.counts[0] else 1)  # noqa: E731
    drive(w, 10 * P.period_s, rate, until=1, demand=0.05)
    assert w.counts[0] == P.waiting_factor * 2, w.decisions
    assert w.state.of(0).wide == 0  # past its cap: cut if it does not wait
    drive(w, 10 * P.period_s, rate, until=2)  # its workers ask a whole core each
    cut = w.decisions[1]
    assert (cut.before, cut.after) == (P.waiting_factor * 2, 2) and w.counts[0] == 2
    assert "back within the CPU budget" in cut.reason
    assert cut.at - w.decisions[0].at >= P.shrink_periods * P.period_s  # not on one period
    assert w.state.of(0).held_grow > w.now  # and not grown again at once
    assert w.replayed()


def test_a_wide_stage_whose_wait_comes_and_goes_is_not_cut():
    periods = iter(range(10**6))
    w = World({0: "adaptive"}, cpu_budget=2, own_rss=100 * MIB,
              cpu=lambda world, s: 1.0 if next(periods) % 2 else 0.01)
    rate = lambda world: PER_PERIOD * (2 if world.counts[0] else 1)  # noqa: E731
    drive(w, 10 * P.period_s, rate, until=1, demand=0.05)
    assert w.counts[0] == P.waiting_factor * 2, w.decisions
    drive(w, 40 * P.period_s, rate)
    assert w.counts[0] == P.waiting_factor * 2 and len(w.decisions) == 1, w.decisions


@pytest.mark.parametrize("profile", [
    None,  # nothing known yet
    (P.move_min_sample_s / 2, 8.0),  # too cheap a sample: messages would cost more
    (1e-3, 1e-3 / (P.move_min_byte_s / 2)),  # too cheap a byte: moving it costs as much
])
def test_a_busy_inline_stage_whose_samples_are_cheap_is_not_moved(profile):
    w = World({0: "adaptive"})
    w.profile[0] = profile
    drive(w, 20 * P.period_s, flat)
    assert w.counts[0] == 0 and not w.decisions


def test_a_stage_that_cannot_go_to_processes_is_not_moved():
    w = World({0: "adaptive"})
    w.unable[0] = "its op cannot be pickled"
    drive(w, 20 * P.period_s, flat)
    assert w.counts[0] == 0 and not w.decisions


def test_a_move_that_does_not_pay_is_undone_and_the_hold_doubles():
    w = World({0: "adaptive"})
    drive(w, 20 * P.period_s, flat, until=2)
    assert w.counts[0] == 0 and "did not pay" in w.decisions[1].reason, w.decisions
    assert w.released == [0]  # the pool is stopped
    undone = w.now
    drive(w, 40 * P.hold_s, flat, until=4)
    again, undone2 = w.decisions[2], w.decisions[3]
    assert again.after == P.move_workers and again.at >= undone + P.hold_s - P.period_s
    assert f"held {2 * P.hold_s:g} s" in undone2.reason, w.decisions
    drive(w, 2 * P.hold_s - 2 * P.period_s, flat)
    assert len(w.decisions) == 4  # held twice as long now
    assert w.replayed()


def test_a_moved_stage_whose_work_fits_inline_goes_back_and_returns_if_inline_is_slower():
    idle = P.busy_shrink / 4  # the workers are nearly idle: their work fits inline
    w = World({0: "adaptive"})
    w.counts[0] = 2
    drive(w, 20 * P.period_s, flat, busy=idle, until=1)
    back = w.decisions[0]
    assert (back.before, back.after) == (2, 0) and "trying inline" in back.reason
    drive(w, 4 * P.period_s, flat, busy=idle)  # inline is as fast: kept, the pool stopped
    assert w.counts[0] == 0 and w.released and len(w.decisions) == 1, w.decisions
    assert w.trials == [("inline", 0, True)]
    w2 = World({0: "adaptive"})  # inline turns out slower: back to the same workers
    w2.counts[0] = 2
    drive(w2, 20 * P.period_s, lambda world: PER_PERIOD if world.counts[0] else
          PER_PERIOD / 2, busy=idle, until=2)
    assert w2.counts[0] == 2 and "inline was slower" in w2.decisions[1].reason, w2.decisions
    assert w2.state.of(0).held_out > w2.now


def test_no_decision_while_workers_boot_nor_on_the_period_they_were_ready_in():
    w = World({0: "adaptive"}, boot=1.0)
    drive(w, 10 * P.period_s, flat, until=1)
    moved = w.now
    drive(w, 1.0 + P.period_s, flat)  # booting, then the period they were ready in
    assert len(w.decisions) == 1 and w.state.trial is not None
    assert w.state.run_since is not None and w.state.run_since >= moved + 1.0


# -- the memory budget --------------------------------------------------------------------------
def test_workers_past_the_memory_budget_are_taken_back_and_held():
    """A stage grown to 3 workers whose workers then keep memory: past the budget, it
    gives back the fewest that fit (3 -> 2); it is not grown again (no room); at its last
    worker, which alone passes the budget, nothing is decided and the reason is held."""
    w = World({0: "process"}, memory_bytes=100 * MIB, rss={0: 10 * MIB})
    grows = lambda world: PER_PERIOD * world.counts[0]  # noqa: E731 - a worker more pays
    while w.counts[0] < 3 and w.now < 30:
        drive(w, P.period_s, grows)
    assert w.counts[0] == 3, w.decisions
    w.rss[0] = 45 * MIB  # 135 MiB > 100 MiB: one goes
    drive(w, 2 * P.period_s, grows)
    last = w.decisions[-1]
    assert (last.before, last.after) == (3, 2) and "memory budget" in last.reason, last
    drive(w, P.period_s, grows)
    assert w.last.rss == {0: (45 * MIB,) * 2}
    decided = len(w.decisions)
    drive(w, 40 * P.period_s, grows)  # it would pay: no room
    assert w.counts[0] == 2 and len(w.decisions) == decided, w.decisions
    w.rss[0] = 80 * MIB  # 160 MiB: one more goes, down to the floor
    drive(w, 2 * P.period_s, grows)
    assert w.counts[0] == 1 and "memory budget" in w.decisions[-1].reason
    w.rss[0] = 120 * MIB  # one worker alone passes it: nothing left to take back
    decided = len(w.decisions)
    drive(w, 4 * P.period_s, grows)
    assert w.counts[0] == 1 and len(w.decisions) == decided
    assert "no worker left to take back" in w.held
    assert w.replayed()


def test_an_adaptive_stage_past_the_budget_at_one_worker_goes_back_inline_and_is_held():
    """Its last worker alone passing the budget, an adaptive stage goes back inline (its
    pool stopped) and is not moved to processes again for hold_s although it is the
    bottleneck inline."""
    w = World({0: "adaptive"}, memory_bytes=200 * MIB, rss={0: 150 * MIB},
              own_rss=50 * MIB)
    w.counts[0] = 2
    drive(w, 2 * P.period_s, flat)  # 300 MiB: one goes
    assert w.counts[0] == 1 and "memory budget" in w.decisions[-1].reason, w.decisions
    w.rss[0] = 250 * MIB  # the last one alone: back inline
    drive(w, 2 * P.period_s, flat)
    last = w.decisions[-1]
    assert w.counts[0] == 0 and w.released and (last.before, last.after) == (1, 0), last
    assert "memory budget" in last.reason and f"held {P.hold_s:g} s" in last.reason
    w.rss[0] = 50 * MIB  # (a new worker would fit now: the hold is what keeps it)
    drive(w, P.hold_s - 2 * P.period_s, flat)  # hot, but held
    assert w.counts[0] == 0 and w.decisions[-1] == last
    drive(w, 4 * P.period_s, flat, until=len(w.decisions) + 1)
    assert w.counts[0] == 2, w.decisions  # the hold over: tried again


# -- save and replay -------------------------------------------------------------------------
def test_a_recording_is_plain_json_and_replays_to_the_same_actions():
    w = World({0: "adaptive", 1: "threads"}, boot=0.3)
    rate = lambda world: PER_PERIOD * (1 + world.counts[0])  # noqa: E731
    drive(w, 30 * P.period_s, rate, demand=0.5)
    assert w.decisions and w.replayed()
    # a change the executor could not apply: the policy goes on as if not decided
    recording = json.loads(json.dumps(w.recording))
    changes = [i for i, e in enumerate(recording) if any(
        a["kind"] in ("resize", "move") for a in e.get("actions", ()))]
    recording[changes[0]]["applied"] = False
    replayed = replay(P, recording)
    assert replayed[:changes[0]] == [e["actions"] for e in recording[1:changes[0] + 1]]


def test_decide_changes_nothing_it_is_given():
    w = World({0: "adaptive"})
    drive(w, 2 * P.period_s, flat)
    state, sig = w.state, w.signals()
    first = decide(P, state, sig)
    assert decide(P, state, sig) == first and w.state is state
