"""The autotune policy's rule over one period: :func:`decide`, a pure function of the
parameters, the state and one period's signals, made of the steps below, and
:func:`replay` of a recording (see :mod:`zephon.pipeline.tuning`)."""


from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from zephon.pipeline.tuning.records import (
    Action,
    ActionKind,
    Measures,
    Signals,
    StageState,
    Step,
    Trial,
    TrialKind,
    TuningParams,
    TuningState,
    signals_from_plain,
    state_from_plain,
    to_plain,
)
from zephon.pipeline.tuning.rules import (
    _caps_now,
    _count,
    _fail,
    _held,
    _hold,
    _inline,
    _memory_ok,
    _new_worker_size,
    _pays,
    _waiting,
    _worth_moving,
    changed,
    choose,
    fitting,
    judge,
    judge_inline,
    measure,
    take_back,
)

__all__ = ["decide", "replay"]


# -- one period -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Go:
    """A part of the rule's outcome: actions, the state after them, whether the period is
    over (``done``), the state if the change could not be applied, the trial judged."""

    actions: tuple[Action, ...]
    state: TuningState
    done: bool = False
    fallback: TuningState | None = None
    judged: tuple[TrialKind, int, bool] | None = None


def _change(state: TuningState, action: Action, pre: tuple[Action, ...] = (),
            post: tuple[Action, ...] = (), **effects: Any) -> _Go:
    """The period's change: ``state`` is what holds if it cannot be applied; applied, the
    stage is changed and ``effects`` (``trial``; ``wide``: 0 to mark it past its cap)
    hold too."""
    after = changed(state, action.stage)
    if "trial" in effects:
        after = replace(after, trial=effects["trial"])
    if effects.get("wide") is not None:
        after = after.update(action.stage, wide=effects["wide"])
    return _Go((*pre, action, *post), after, True, state)


def _before(state: TuningState, stage: int, now: float, count: int
            ) -> tuple[int, float, int, int]:
    run = max(now - (state.run_since if state.run_since is not None else now), 1e-9)
    return stage, state.run_items / run, state.run_items, count


def _within_memory(params: TuningParams, state: TuningState, sig: Signals,
                   m: Measures) -> _Go:
    """The memory budget's decision, made before any other (see the rule)."""
    counts = {s: _count(state, sig, s) for s in m.rss}
    floors = {s: 0 if state.of(s).adaptive else 1 for s in m.rss}
    verdict = take_back(m.rss, state.memory_bytes, counts, floors)
    if verdict is None:
        return _Go((), state)
    stage, after, why = verdict
    before = counts[stage]
    if after >= before > 0:
        return _Go((), _hold(state, why))
    trial = state.trial
    inline_trial = trial is not None and trial.kind is TrialKind.INLINE
    if before == 0:  # inline already: a parked pool, stopped now (not a decision)
        if inline_trial and trial is not None and trial.stage == stage:
            state = replace(state, trial=None)  # inline is kept
        return _Go((Action(ActionKind.RELEASE, stage),), state)
    state = replace(state, trial=None)
    pre = (Action(ActionKind.RELEASE, trial.stage),) if inline_trial and trial else ()
    if after == 0:
        state, hold = _fail(params, state, stage, "in", sig.now)
        return _change(state, Action(ActionKind.MOVE, stage, before, 0,
                                     f"{why} (held {hold:g} s)"),
                       pre, (Action(ActionKind.RELEASE, stage),))
    state, hold = _fail(params, state, stage, "grow", sig.now)
    return _change(state, Action(ActionKind.RESIZE, stage, before, after,
                                 f"{why} (held {hold:g} s)"), pre)


def _judge(params: TuningParams, state: TuningState, sig: Signals, run: float) -> _Go:
    """Judge the change on trial (see the rule)."""
    trial = state.trial
    assert trial is not None
    state = replace(state, trial=None)
    kind, stage = trial.kind, trial.stage
    g = sig.of(stage)
    after_rate = state.run_items / run
    evidence = min(trial.items, state.run_items) >= params.trial_min_items
    rates = f"{after_rate:.2f} items/s after it, {trial.rate:.2f} before"
    ok = judge_inline if kind is TrialKind.INLINE else judge
    kept = not evidence or ok(params, trial.rate, after_rate)
    judged = None if kind is TrialKind.PROCESS and g.runner == "inline" else (kind, stage, kept)
    if kind is TrialKind.PROCESS and g.runner == "inline":  # the move failed to start
        go = _Go((), state)
    elif kept:
        go = _kept(state, trial)
    else:
        what = {TrialKind.GROW: "grow", TrialKind.PROCESS: "in", TrialKind.INLINE: "out"}
        state, hold = _fail(params, state, stage, what[kind], sig.now)
        go = _undo(state, trial, _count(state, sig, stage), g.workers, rates, hold)
    return replace(go, judged=judged)


def _kept(state: TuningState, trial: Trial) -> _Go:
    what = {TrialKind.GROW: "fails_grow", TrialKind.PROCESS: "fails_in",
            TrialKind.INLINE: "fails_out"}[trial.kind]
    state = state.update(trial.stage, **{what: 0})
    if trial.kind is TrialKind.INLINE:  # inline it stays: its pool is stopped
        return _Go((Action(ActionKind.RELEASE, trial.stage),), state)
    return _Go((), state)


def _undo(state: TuningState, trial: Trial, count: int, workers: int, rates: str,
          hold: float) -> _Go:
    """Take back a change that did not pay."""
    stage = trial.stage
    if trial.kind is TrialKind.GROW:
        return _change(state, Action(ActionKind.RESIZE, stage, workers,
                                     min(workers - 1, trial.back),
                                     f"the grow did not pay: {rates} (held {hold:g} s)"))
    if trial.kind is TrialKind.PROCESS:
        return _change(state, Action(ActionKind.MOVE, stage, count, 0,
                                     f"the move to processes did not pay: {rates} "
                                     f"(held {hold:g} s)"),
                       post=(Action(ActionKind.RELEASE, stage),))
    return _change(state, Action(ActionKind.MOVE, stage, count, trial.back,
                                 f"inline was slower: {rates} (held {hold:g} s)"))


def _asked(params: TuningParams, ss: StageState, m: Measures, hot: bool, ripe: int
           ) -> float | None:
    """Over the periods in a row the inline stage was hot, the most CPU its units asked
    per second of op time; None once one of them did not read as waiting."""
    s = ss.stage
    asked = m.cpu[s] / m.busy[s] if _waiting(params, m, s) else None
    if not hot:
        return None
    if ripe == 1:
        return asked
    return None if asked is None or ss.asked is None else max(ss.asked, asked)


def _streaks(params: TuningParams, state: TuningState, sig: Signals, m: Measures,
             inline: set[int]) -> TuningState:
    """Count each adaptive stage's periods in a row as the bottleneck inline (ripe) and as
    work that would fit inline (spare)."""
    now = sig.now
    for ss in state.stages:
        if not ss.adaptive:
            continue
        s, g = ss.stage, sig.of(ss.stage)
        if s in inline:
            hot = (m.wait >= params.wait_grow and m.busy[s] >= params.busy_grow
                   and not g.unable and not _held(ss.held_in, now)
                   and _worth_moving(params, g.profile)
                   and _pays(params, g.spent, sig.progress))
            ripe = ss.ripe + 1 if hot else 0
            ss = replace(ss, ripe=ripe, asked=_asked(params, ss, m, hot, ripe), spare=0)
        else:
            cool = (m.busy[s] * g.workers < params.busy_shrink
                    and not _held(ss.held_out, now))
            ss = replace(ss, spare=ss.spare + 1 if cool else 0, ripe=0)
        state = state.with_stage(ss)
    return state


def _waiting_width(params: TuningParams, state: TuningState, sig: Signals, m: Measures,
                   s: int, inline: set[int], n: int, asked: float
                   ) -> tuple[int, str, TuningState]:
    """The workers a move starts for inline stage ``s`` whose units asked ``asked`` of a
    core per second they ran (they wait): as many as the CPU the other stages are
    measured to use leaves can feed, at most its waiting cap and at least ``n``, halved
    while that many would not fit in the memory budget."""
    used = sum(g.workers * m.cpu.get(g.stage, 1.0) for g in sig.stages
               if g.stage not in inline and state.of(g.stage).budget is None)
    k = min(int((state.cpu_budget - used) / max(asked, 1e-3)),
            state.of(s).waiting_cap or n)
    size = _new_worker_size(params, sig)
    if k <= max(n, 0) or size == 0:
        return n, "", state
    while k > n:
        ok, why = _memory_ok(state, sig, m.rss, s, k, size)
        if ok:
            break
        state = _hold(state, why)
        k //= 2
    k = max(k, n)
    return k, f", its units asking {asked:.0%} of a core: {k} workers", state


def _to_process(params: TuningParams, state: TuningState, sig: Signals, m: Measures,
                inline: set[int], ripe: list[int]) -> _Go:
    """Move the ripe inline stage that is busiest to processes (see the moves)."""
    s = max(ripe, key=lambda x: (m.busy[x], -x))
    taken = sum(g.workers for g in sig.stages
                if g.stage not in inline and state.of(g.stage).budget is None)
    n = min(params.move_workers, state.cpu_budget - taken, params.max_process_workers)
    why = ""
    asked = state.of(s).asked
    state = state.update(s, asked=None)
    if asked is not None:  # waiting in every period of its streak
        n, why, state = _waiting_width(params, state, sig, m, s, inline, n, asked)
    cpu_room = n >= 1
    n, state = fitting(params, state, sig, s, n)  # (none: the memory budget's hold says why)
    if n < 1:
        if not cpu_room:
            state = _hold(state, f"CPU budget {state.cpu_budget} full: stage {s} stays inline")
        return _Go((), state)
    state = state.update(s, ripe=0)
    trial = Trial(TrialKind.PROCESS, *_before(state, s, sig.now, 0))
    wide = 0 if n > _caps_now(params, state, inline - {s})[s] else None
    return _change(state, Action(ActionKind.MOVE, s, 0, n,
                                 f"the consumer waited {m.wait:.0%}, stage {s} busy "
                                 f"{m.busy[s]:.0%} inline{why}: trying processes"),
                   trial=trial, wide=wide)


def _moves(params: TuningParams, state: TuningState, sig: Signals, m: Measures) -> _Go:
    """The moves of the adaptive stages (see the rule)."""
    inline = _inline(state, sig)
    state = _streaks(params, state, sig, m, inline)
    ripe = [ss.stage for ss in state.stages
            if ss.stage in inline and ss.ripe >= params.move_periods
            and (ss.asked is None or ss.ripe >= params.wide_periods)]
    if ripe:
        go = _to_process(params, state, sig, m, inline, ripe)
        if go.done:
            return go
        state = go.state
    spare = [ss.stage for ss in state.stages if ss.adaptive and ss.stage not in inline
             and ss.spare >= params.shrink_periods]
    if not spare:
        return _Go((), state)
    s = min(spare, key=lambda x: (m.busy[x] * sig.of(x).workers, x))
    workers = sig.of(s).workers
    state = state.update(s, spare=0)
    trial = Trial(TrialKind.INLINE, *_before(state, s, sig.now, workers))
    return _change(state, Action(ActionKind.MOVE, s, workers, 0,
                                 f"its workers used {m.busy[s] * workers:.2f} core(s) for "
                                 f"{params.shrink_periods} periods: trying inline"),
                   trial=trial)


def _back_within(params: TuningParams, state: TuningState, sig: Signals, m: Measures,
                 tuned: list[int], caps: Mapping[int, int]) -> _Go:
    """A stage past its cap because its workers waited, whose workers have not read as
    waiting for ``shrink_periods`` periods in a row, is cut to its cap and not grown for
    ``hold_s`` (the rule's *back within the budget*)."""
    for ss in state.stages:
        if ss.wide is None:
            continue
        s = ss.stage
        if s not in tuned or sig.of(s).workers <= caps[s]:
            state = state.update(s, wide=None)
            continue
        cpu_bound = (s in m.cpu and m.busy[s] >= params.busy_shrink
                     and not _waiting(params, m, s))
        wide = ss.wide + 1 if cpu_bound else 0
        if wide < params.shrink_periods:
            state = state.update(s, wide=wide)
            continue
        state = state.update(s, wide=None, held_grow=sig.now + params.hold_s)
        workers = sig.of(s).workers
        return _change(state, Action(
            ActionKind.RESIZE, s, workers, caps[s],
            f"its workers ask {m.cpu[s]:.0%} of a core each, busy {m.busy[s]:.0%}, for "
            f"{params.shrink_periods} periods: not waiting, back within the CPU budget "
            f"(held {params.hold_s:g} s)"))
    return _Go((), state)


def _choose(params: TuningParams, state: TuningState, sig: Signals, m: Measures,
            workers: Mapping[int, int], now_caps: Mapping[int, int]
            ) -> tuple[tuple[int, int, str] | None, TuningState]:
    """:func:`choose` over the stages on workers (``workers``), a stage held after a
    grow that did not pay capped at its workers now; the idle counts and the memory
    budget's holds kept in the state."""
    held = {s for s in workers if _held(state.of(s).held_grow, sig.now)}
    caps = {s: workers[s] if s in held else now_caps[s] for s in workers}
    waiting = {s: workers[s] if s in held else state.of(s).waiting_cap for s in workers
               if state.of(s).process}
    sub = Measures({s: m.busy[s] for s in workers},
                   {s: c for s, c in m.cpu.items() if s in workers}, m.wait, m.rate, m.rss)
    holds: list[str] = []

    def memory_ok(stage: int, n: int = 1) -> bool:
        ok, why = _memory_ok(state, sig, m.rss, stage, n)
        if not ok:
            holds.append(why)
        return ok

    choice, idle = None, {}
    for pool, budget in _pools(state, workers):
        if not pool:
            continue
        pick, after = choose(params, sub, pool, caps, budget,
                             {s: state.of(s).idle for s in pool}, memory_ok, waiting)
        idle.update(after)
        choice = choice or pick
    for s, n in idle.items():
        state = state.update(s, idle=n)
    for why in holds:
        state = _hold(state, why)
    return choice, state


def _pools(state: TuningState, workers: Mapping[int, int]
           ) -> list[tuple[dict[int, int], int]]:
    """The stages on workers by the CPU budget they draw on: the host's stages share its
    budget (first); a stage with a budget of its own (a Ray stage) is a pool alone."""
    pools = [({s: w for s, w in workers.items() if state.of(s).budget is None},
              state.cpu_budget)]
    for s, w in workers.items():
        own = state.of(s).budget
        if own is not None:
            pools.append(({s: w}, own))
    return pools


def _tune(params: TuningParams, state: TuningState, sig: Signals, m: Measures) -> _Go:
    """The rule's grow or shrink over the stages on workers (see the rule)."""
    inline = _inline(state, sig)
    tuned = [ss.stage for ss in state.stages if ss.stage not in inline]
    if not tuned:
        return _Go((), state)
    now_caps = _caps_now(params, state, inline)
    go = _back_within(params, state, sig, m, tuned, now_caps)
    if go.done:
        return go
    state = go.state
    workers = {s: sig.of(s).workers for s in tuned}
    choice, state = _choose(params, state, sig, m, workers, now_caps)
    if choice is None:
        return _Go((), state)
    stage, delta, reason = choice
    before = workers[stage]
    if delta < 0:
        return _change(state, Action(ActionKind.RESIZE, stage, before, before + delta, reason))
    trial = Trial(TrialKind.GROW, *_before(state, stage, sig.now, before))
    wide = state.of(stage).wide
    if before + delta > now_caps[stage] and wide is None:
        wide = 0  # past its cap: it waits (see _grow)
    return _change(state, Action(ActionKind.RESIZE, stage, before, before + delta, reason),
                   trial=trial, wide=wide)


def _fallen(state: TuningState, sig: Signals) -> _Go:
    """Record the moves the stages undid by themselves (they stay inline); a trial of
    such a move is over."""
    actions = []
    for g in sig.stages:
        for workers, why in g.fallen:
            if state.trial is not None and state.trial.stage == g.stage:
                state = replace(state, trial=None)
            actions.append(Action(ActionKind.FALLEN, g.stage, workers, 0,
                                  f"inline for the rest of the run: {why}"))
            state = changed(state, g.stage)
    return _Go(tuple(actions), state, bool(actions))


def _counted(state: TuningState, sig: Signals) -> TuningState:
    """The run's items, with this period's."""
    if state.run_since is None:
        return replace(state, run_since=sig.start, run_items=sig.items)
    return replace(state, run_items=state.run_items + sig.items)


def _rule(params: TuningParams, state: TuningState, sig: Signals, m: Measures) -> _Go:
    """The decision of a measured period: the memory budget, the trial, the moves, the
    grows and shrinks, in that order."""
    go = _within_memory(params, state, sig, m)
    if go.done:
        return go
    pre, state = go.actions, go.state
    judged = None
    if state.trial is not None:
        now, since = sig.now, state.run_since if state.run_since is not None else sig.now
        if not state.settled:  # the new setting's first period: not its evidence
            return _Go(pre, replace(state, settled=True, run_since=now, run_items=0))
        run = now - since
        if ((state.run_items < params.trial_items or run < params.trial_min_s)
                and run < params.trial_s):
            return _Go(pre, state)  # too little evidence yet
        go = _judge(params, state, sig, run)
        if go.done:
            return replace(go, actions=pre + go.actions)
        pre, state, judged = pre + go.actions, go.state, go.judged
    go = _moves(params, state, sig, m) if any(ss.adaptive for ss in state.stages) \
        else _Go((), state)
    if not go.done:
        go = _tune(params, go.state, sig, m)
    return replace(go, actions=pre + go.actions, judged=judged)


def decide(params: TuningParams, state: TuningState, sig: Signals
           ) -> tuple[Step, TuningState]:
    """One period's decision and the state after it (see the module docstring)."""
    state = _counted(state, sig)
    go = _fallen(state, sig)
    if go.done or sig.closing:
        return Step(go.actions), go.state
    if any(g.booting for g in sig.stages):  # judged on full periods of the new setting
        return Step(), replace(state, run_since=sig.now, run_items=0, booted=True)
    if state.booted:  # ready at some point of this period: from its end it counts
        return Step(), replace(state, booted=False, run_since=sig.now, run_items=0)
    m = measure(state, sig)
    if sig.frozen:
        return Step(measures=m), state
    go = _rule(params, state, sig, m)
    fallback = go.fallback if any(a.change for a in go.actions) else None
    return Step(go.actions, go.judged, m, fallback), go.state


def replay(params: TuningParams, recording: Iterable[Mapping[str, Any]]
           ) -> list[list[dict[str, Any]]]:
    """Run the policy again over a recording (``Controller.recording()``: a ``state``
    entry, then ``signals`` entries, each with the ``actions`` decided and whether the
    change was ``applied``, and ``forced`` entries, a test's moves): the actions of each
    ``signals`` entry, as plain dicts (equal to the recorded ones)."""
    state: TuningState | None = None
    out = []
    for entry in recording:
        if "state" in entry:
            state = state_from_plain(entry["state"])
        elif "forced" in entry:
            assert state is not None
            state = changed(state, int(entry["forced"]))
        else:
            assert state is not None
            step, after = decide(params, state, signals_from_plain(entry["signals"]))
            out.append(to_plain(list(step.actions)))
            applied = entry.get("applied", True)
            state = after if applied or step.fallback is None else step.fallback
    return out
