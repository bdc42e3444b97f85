"""The autotune policy: a pure function from one period's signals to a decision.

:func:`decide` takes the policy's parameters (:class:`TuningParams`), the controller's
state (:class:`TuningState`: one frozen :class:`StageState` per stage, the change on
trial as a typed :class:`Trial`) and what was measured over one sampling period
(:class:`Signals`, time included), and returns a :class:`Step` (the actions to apply,
in order, the trial judged, the period's derived fractions) with the next state. It
reads no clock, no ``/proc`` and no executor, and changes nothing it is given: the
controller (:mod:`zephon.pipeline.autotune`, whose docstring states the rule) samples
the signals, applies the actions through the executors and keeps the state.

Because the policy is pure, a run can be recorded (the state it started from, then each
period's signals, the actions decided and whether they could be applied) as plain,
JSON-serialisable dicts, and :func:`replay` runs the policy again over them: it returns
the same actions period by period.

Stages are the engine's stage indexes. A stage's *count* is its workers, 0 for an
adaptive stage running inline (its ``workers`` signal is then 1: the engine's thread,
for the busy fraction).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, Callable, Iterable, Mapping

__all__ = ["Action", "ActionKind", "Measures", "Signals", "StageSignals", "StageState",
           "Step", "Trial", "TrialKind", "TuningParams", "TuningState", "changed",
           "choose", "decide", "fitting", "initial_state", "judge", "judge_inline",
           "measure", "most_workers", "replay", "take_back"]


@dataclass(frozen=True)
class TuningParams:
    """The policy's parameters (see the rule in :mod:`zephon.pipeline.autotune`)."""

    #: seconds between two decisions (a sampling period)
    period_s: float = 0.25
    #: the consumer's waiting fraction from which the pipeline is input bound (grow)
    wait_grow: float = 0.05
    #: the busy fraction from which a stage may get one more worker
    busy_grow: float = 0.6
    #: a stage loses one worker when, with one fewer, it would stay below this busy
    #: fraction for ``shrink_periods`` periods in a row
    busy_shrink: float = 0.45
    shrink_periods: int = 3
    #: a process stage whose workers ask a core for less than this fraction of the time
    #: they are busy waits on something else: it may grow past the CPU budget
    waiting_cpu: float = 0.3
    #: a waiting process stage's cap: this many times the CPU budget
    waiting_factor: int = 4
    #: a grow is kept when the throughput after it is at least (1 + gain) x before
    trial_gain: float = 0.03
    #: the items a trial waits for (at most ``trial_s`` seconds) before it is judged, and
    #: the fewest on either side that make evidence (fewer: the change stays)
    trial_items: int = 24
    trial_s: float = 4.0
    trial_min_items: int = 4
    #: the fewest seconds a trial runs after the new setting's settling period
    trial_min_s: float = 0.5
    #: seconds a change that did not pay is not tried again, doubled with each such
    #: change in a row (one that pays starts the count again), at most ``hold_max_s``
    hold_s: float = 5.0
    hold_max_s: float = 40.0
    #: most workers of a process stage (a region token's owner field)
    max_process_workers: int = 127
    #: the workers a CPU-bound adaptive stage is moved to at once
    move_workers: int = 2
    #: periods in a row an inline stage is the bottleneck before it is moved ...
    move_periods: int = 1
    #: ... and before it is moved past its cap because its units wait
    wide_periods: int = 2
    #: no move to processes unless the stage's work left in the run, at its inline cost
    #: per source sample, would take at least this long (a boot costs about this)
    move_payback_s: float = 1.0
    #: an inline stage is moved only while its op costs at least this many seconds per
    #: input sample ...
    move_min_sample_s: float = 1e-4
    #: ... and at least this many seconds per output byte
    move_min_byte_s: float = 2e-9
    #: a worker not started yet counts, against the memory budget, as large as the
    #: largest running one, else as this process up to this many bytes
    new_worker_bytes: int = 256 << 20
    #: the decisions, judged trials and recorded periods a controller keeps (its latest)
    keep_decisions: int = 1000


class TrialKind(str, Enum):
    """What the change on trial was."""

    GROW = "grow"  # workers added to a stage on workers
    PROCESS = "process"  # an adaptive stage moved to process workers
    INLINE = "inline"  # an adaptive stage moved back inline (its pool parked)


@dataclass(frozen=True)
class Trial:
    """The change on trial: of ``stage``, made when the setting before it had handed on
    ``rate`` items per second over ``items`` items, with ``back`` workers (0: inline)."""

    kind: TrialKind
    stage: int
    rate: float
    items: int
    back: int


@dataclass(frozen=True)
class StageState:
    """The policy's memory of one stage (times are the signals' clock)."""

    stage: int
    #: inline until moved to process workers (see the moves)
    adaptive: bool
    #: runs (or may run) on process workers: its CPU and memory are read
    process: bool
    #: its cap when every other stage holds one worker
    cap: int
    #: its cap while its workers wait (process stages; 0: none)
    waiting_cap: int = 0
    #: no grow before this time; no move to processes (back inline) before these
    held_grow: float = 0.0
    held_in: float = 0.0
    held_out: float = 0.0
    #: changes in a row that did not pay: grows, moves to processes, moves back inline
    fails_grow: int = 0
    fails_in: int = 0
    fails_out: int = 0
    #: periods in a row it could have lost a worker (the shrink)
    idle: int = 0
    #: periods in a row it was the bottleneck while inline (the move to processes)
    ripe: int = 0
    #: over those periods, the most CPU its units asked per second of op time while each
    #: of them read as waiting (None: a CPU-bound move)
    asked: float | None = None
    #: past its cap because its workers waited: the periods in a row they did not read
    #: as waiting (None: not past its cap that way)
    wide: int | None = None
    #: periods in a row its work on processes would have fit inline
    spare: int = 0
    #: the rule (or a test) changed it in this run
    decided: bool = False


@dataclass(frozen=True)
class TuningState:
    """Everything :func:`decide` carries from one period to the next."""

    cpu_budget: int
    memory_bytes: int
    #: the run's start (decisions are timed from it)
    started: float
    stages: tuple[StageState, ...]
    trial: Trial | None = None
    #: the setting on trial has had its settling period
    settled: bool = True
    #: workers were booting at the last period's end
    booted: bool = False
    #: when the setting now in force started (None: at the next period's start) and the
    #: items handed on since
    run_since: float | None = None
    run_items: int = 0
    #: why the last wanted change did not happen ("" once a change is made)
    held: str = ""

    def of(self, stage: int) -> StageState:
        for ss in self.stages:
            if ss.stage == stage:
                return ss
        raise KeyError(stage)

    def with_stage(self, ss: StageState) -> TuningState:
        return replace(self, stages=tuple(ss if x.stage == ss.stage else x
                                          for x in self.stages))

    def update(self, stage: int, **changes: Any) -> TuningState:
        return self.with_stage(replace(self.of(stage), **changes))


@dataclass(frozen=True)
class StageSignals:
    """One stage over one period."""

    stage: int
    #: where its units run at the period's end: "inline", "threads" or "process"
    runner: str
    #: workers in service (1 inline: the engine's thread)
    workers: int
    booting: int = 0
    #: op seconds its units reported in the period (a parked pool's not counted)
    op_s: float = 0.0
    #: CPU seconds its inline units asked for in the period (None: none reported it)
    demand_s: float | None = None
    #: CPU seconds its process workers ran or waited for a core in the period (None: a
    #: stage whose CPU is not read)
    cpu_s: float | None = None
    #: resident bytes of each of its process workers at the period's end
    rss: tuple[int, ...] = ()
    #: ``(op seconds, output bytes)`` per input sample (None or None seconds: unknown)
    profile: tuple[float | None, float | None] | None = None
    #: why it cannot move to processes ("" while it can)
    unable: str = ""
    #: op seconds it reported since the run started
    spent: float = 0.0
    #: moves it undid by itself since the last period: ``(workers, why)``
    fallen: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Signals:
    """What the controller measured over one period, ``start`` to ``now``."""

    now: float
    start: float
    #: items the engine handed on in the period
    items: int
    #: seconds the consumer waited for an item in the period
    wait_s: float
    stages: tuple[StageSignals, ...]
    #: resident bytes of the controller's own process
    own_rss: int = 0
    #: ``(source samples read, source samples left)`` in the run (None: for ever)
    progress: tuple[int, int] | None = None
    #: the run is ending: only the moves the stages undid are recorded
    closing: bool = False
    #: a test's hook: the rule decides nothing (the periods are still counted)
    frozen: bool = False

    def of(self, stage: int) -> StageSignals:
        for g in self.stages:
            if g.stage == stage:
                return g
        raise KeyError(stage)


@dataclass(frozen=True)
class Measures:
    """One period's fractions: busy (op time over workers x elapsed), CPU (process
    stages, and an inline stage whose units reported their demand), the consumer's wait,
    the items handed on per second, and the workers' resident bytes per stage."""

    busy: Mapping[int, float]
    cpu: Mapping[int, float]
    wait: float
    rate: float
    rss: Mapping[int, tuple[int, ...]]


class ActionKind(str, Enum):
    """What an :class:`Action` asks of the executor of its stage."""

    RESIZE = "resize"  # grow or shrink to ``after`` workers
    MOVE = "move"  # an adaptive stage to ``after`` process workers (0: inline)
    RELEASE = "release"  # stop a parked pool once its units are back
    FALLEN = "fallen"  # record a move the stage undid by itself (nothing to do)


@dataclass(frozen=True)
class Action:
    """One thing to do: ``stage`` from ``before`` to ``after`` workers, for ``reason``."""

    kind: ActionKind
    stage: int
    before: int = 0
    after: int = 0
    reason: str = ""

    @property
    def change(self) -> bool:
        """Whether it changes the stage's workers through the executor."""
        return self.kind in (ActionKind.RESIZE, ActionKind.MOVE)


@dataclass(frozen=True)
class Step:
    """What :func:`decide` decided for one period: the actions in order (at most one
    change, :attr:`Action.change`), the trial judged ``(kind, stage, kept)``, the period's
    fractions (None: not measured), and ``fallback``, the state to go on from if the
    change could not be applied."""

    actions: tuple[Action, ...] = ()
    judged: tuple[TrialKind, int, bool] | None = None
    measures: Measures | None = None
    fallback: TuningState | None = field(default=None, compare=False)


# -- the pure helpers ---------------------------------------------------------------------
def judge(params: TuningParams, before: float, after: float) -> bool:
    """Whether a grow (a move to processes) paid: ``after`` at least the gain above."""
    return after >= before * (1.0 + params.trial_gain)


def judge_inline(params: TuningParams, before: float, after: float) -> bool:
    """Whether a move back inline is kept: ``after`` at most the gain below ``before``
    (inline holds no process and no memory: it may be a little slower and still win)."""
    return after * (1.0 + params.trial_gain) >= before


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def _worth_moving(params: TuningParams, profile: tuple[float | None, float | None] | None
                  ) -> bool:
    """Whether an inline stage's samples cost enough for processes to pay; unknown
    costs: not yet."""
    if profile is None or profile[0] is None:
        return False
    per_sample_s, per_sample_bytes = profile[0], profile[1]
    if per_sample_s < params.move_min_sample_s:
        return False
    return not per_sample_bytes or per_sample_s / per_sample_bytes >= params.move_min_byte_s


def _pays(params: TuningParams, spent: float, progress: tuple[int, int] | None) -> bool:
    """Whether the work left in the run, at the op seconds ``spent`` so far per source
    sample read, would take at least ``move_payback_s`` (None progress: for ever)."""
    if progress is None:
        return True
    read, left = progress
    return read > 0 and spent / read * left >= params.move_payback_s


def take_back(rss: Mapping[int, tuple[int, ...]], budget: int, counts: Mapping[int, int],
              floors: Mapping[int, int]) -> tuple[int, int, str] | None:
    """The memory budget's decision: None while the process workers' resident bytes
    (``rss``: per stage, each worker's) add up to at most ``budget``; else ``(stage,
    workers after, reason)``: the stage holding the most that has workers above its floor
    (``counts``: its workers now; ``floors``: the fewest it may keep, 0 for an adaptive
    stage: inline) gives back the fewest after which the total fits whichever of its
    workers go (its smallest are counted), down to its floor. A stage running inline
    (count 0) that still has workers (a parked pool) comes first: ``(stage, 0, reason)``.
    ``workers after`` equals ``counts[stage]`` (> 0) when no stage has a worker left to
    give back (the reason says so)."""
    total = sum(sum(sizes) for sizes in rss.values())
    if total <= budget:
        return None
    over = f"memory budget: workers resident {_mib(total)} > {_mib(budget)}"
    for s in sorted(rss, key=lambda x: (counts.get(x, 0) > 0, -sum(rss[x]), x)):
        n, floor = counts.get(s, 0), floors.get(s, 1)
        if n == 0:
            return s, 0, f"{over}, stage {s}'s parked workers {_mib(sum(rss[s]))}: stopped"
        if n <= floor:
            continue
        left, k = total, 0
        for size in sorted(rss[s])[:n - floor]:
            if left <= budget:
                break
            left, k = left - size, k + 1
        return s, n - k, f"{over}, stage {s}'s {_mib(sum(rss[s]))}: takes {k} back"
    s = max(rss, key=lambda x: (sum(rss[x]), -x))
    return s, counts.get(s, 0), (f"memory budget {_mib(budget)} passed, stage {s} holding "
                                 f"the most: no worker left to take back (raise "
                                 f"autotune_memory_bytes, or keep less in the op's workers)")


def _waiting(params: TuningParams, m: Measures, s: int) -> bool:
    return s in m.cpu and m.cpu[s] < params.waiting_cpu * m.busy[s]


def choose(params: TuningParams, m: Measures, workers: Mapping[int, int],
           caps: Mapping[int, int], budget: int, idle: Mapping[int, int],
           memory_ok: Callable[[int, int], bool],
           waiting_caps: Mapping[int, int] | None = None
           ) -> tuple[tuple[int, int, str] | None, dict[int, int]]:
    """The rule's grow or shrink over the stages on workers (``workers``: their counts):
    ``((stage, workers more (> 0) or -1, reason) or None, the idle periods after it)``;
    ``idle``: the periods in a row each stage could have lost a worker;
    ``memory_ok(stage, n)``: whether ``n`` more workers fit; ``waiting_caps``: the caps
    of the stages that may grow past the budget while their workers wait."""
    busy = m.busy
    after = {s: idle.get(s, 0) + 1 if w > 1 and busy[s] * w / (w - 1) < params.busy_shrink
             else 0 for s, w in workers.items()}
    if m.wait >= params.wait_grow:
        grow = _grow(params, m, workers, caps, budget, memory_ok, waiting_caps or {})
        if grow is not None:
            return grow, after
    for s in sorted(workers, key=lambda x: busy[x]):
        if after[s] >= params.shrink_periods:
            after[s] = 0
            return (s, -1, f"busy {busy[s]:.0%} with {workers[s]} for "
                    f"{params.shrink_periods} periods"), after
    return None, after


def _grow(params: TuningParams, m: Measures, workers: Mapping[int, int],
          caps: Mapping[int, int], budget: int, memory_ok: Callable[[int, int], bool],
          waiting_caps: Mapping[int, int]) -> tuple[int, int, str] | None:
    def cap(x: int) -> int:
        return max(caps[x], waiting_caps.get(x, 0)) if _waiting(params, m, x) else caps[x]

    open_ = [s for s in workers if workers[s] < cap(s) and m.busy[s] >= params.busy_grow]
    if not open_:
        return None
    s = max(open_, key=lambda x: (m.busy[x], -x))
    why = f"the consumer waited {m.wait:.0%}, stage {s} busy {m.busy[s]:.0%}"
    if sum(workers.values()) < budget and workers[s] < caps[s]:
        return (s, +1, why) if memory_ok(s, 1) else None
    if _waiting(params, m, s):
        used = sum(workers[x] * m.cpu.get(x, 1.0) for x in workers)
        if used + m.cpu[s] <= budget:
            return _double(m, workers, s, cap(s), budget - used, used, budget, why,
                           memory_ok)
    donors = [d for d in workers if d != s and workers[d] > 1
              and m.busy[d] * workers[d] / (workers[d] - 1) < params.busy_grow]
    if donors:
        d = min(donors, key=lambda x: (m.busy[x], x))
        return d, -1, f"CPU budget {budget} full: gives a worker to stage {s} ({why})"
    return None


def _double(m: Measures, workers: Mapping[int, int], s: int, cap: int, spare_cpu: float,
            used: float, budget: int, why: str, memory_ok: Callable[[int, int], bool]
            ) -> tuple[int, int, str] | None:
    """A waiting stage's grow: as many workers more as it has, bounded by its waiting cap,
    the CPU the new ones are measured to need and the memory budget (a stage waiting on
    storage may want tens of workers: one at a time would take a minute)."""
    cpu = m.cpu[s]
    room = int(spare_cpu / cpu) if cpu > 0 else workers[s]
    k = max(1, min(workers[s], cap - workers[s], room))
    while k > 1 and not memory_ok(s, k):
        k //= 2
    if k > 1 or memory_ok(s, 1):
        return s, +k, (f"{why}, its workers use {cpu:.0%} of a core each "
                       f"(all: {used:.1f} of {budget}): past the CPU budget")
    return None


def measure(state: TuningState, sig: Signals) -> Measures:
    """The period's fractions (see :class:`Measures`)."""
    elapsed = max(sig.now - sig.start, 1e-9)
    busy: dict[int, float] = {}
    cpu: dict[int, float] = {}
    for g in sig.stages:
        busy[g.stage] = min(1.0, g.op_s / (g.workers * elapsed))
        if state.of(g.stage).adaptive and g.runner == "inline":
            if g.demand_s is not None:  # else not reported: CPU-bound, as a thread stage
                cpu[g.stage] = min(1.0, g.demand_s / elapsed)
        elif g.cpu_s is not None:
            cpu[g.stage] = min(1.0, g.cpu_s / (g.workers * elapsed))
    return Measures(busy, cpu, min(1.0, sig.wait_s / elapsed), sig.items / elapsed,
                    {g.stage: g.rss for g in sig.stages if g.rss})


def _count(state: TuningState, sig: Signals, stage: int) -> int:
    g = sig.of(stage)
    return 0 if state.of(stage).adaptive and g.runner == "inline" else g.workers


def _inline(state: TuningState, sig: Signals) -> set[int]:
    return {ss.stage for ss in state.stages
            if ss.adaptive and sig.of(ss.stage).runner == "inline"}


def _caps_now(params: TuningParams, state: TuningState, inline: set[int]) -> dict[int, int]:
    """Each stage's cap now: the budget less one worker per other stage not inline."""
    out = {}
    for ss in state.stages:
        others = sum(1 for t in state.stages if t.stage != ss.stage and t.stage not in inline)
        most = max(1, state.cpu_budget - others)
        out[ss.stage] = min(most, params.max_process_workers) if ss.process else most
    return out


def initial_state(params: TuningParams, stages: Mapping[int, tuple[bool, bool]],
                  cpu_budget: int, memory_bytes: int, started: float) -> TuningState:
    """The state a run starts from: ``stages``: stage -> ``(adaptive, process)``; the
    budget is at least one worker per stage pinned to workers."""
    pinned = sum(1 for adaptive, _ in stages.values() if not adaptive)
    budget = max(cpu_budget, pinned, 1)
    most = max(1, budget - (len(stages) - 1))
    records = []
    for s, (adaptive, process) in sorted(stages.items()):
        records.append(StageState(
            s, adaptive, process,
            cap=min(most, params.max_process_workers) if process else most,
            waiting_cap=(min(params.waiting_factor * budget, params.max_process_workers)
                         if process else 0)))
    return TuningState(budget, memory_bytes, started, tuple(records))


def most_workers(params: TuningParams, state: TuningState, stage: int) -> int:
    """The most workers ``stage``'s executor may ever have (its lane windows' size): the
    budget less one per other pinned stage (adaptive ones may all be inline), or its
    waiting cap."""
    ss = state.of(stage)
    others = sum(1 for t in state.stages if not t.adaptive) - (not ss.adaptive)
    top = state.cpu_budget - others
    return max(min(top, params.max_process_workers) if ss.process else top, ss.waiting_cap)


def _hold(state: TuningState, why: str) -> TuningState:
    return state if why == state.held else replace(state, held=why)


def _held(until: float, now: float) -> bool:
    return until > now


def changed(state: TuningState, stage: int | None = None) -> TuningState:
    """The state after a change of ``stage`` (None: a change carried in, not decided):
    the new setting settles, its run starts at the next period, nothing is held."""
    state = replace(state, settled=False, run_since=None, run_items=0, held="")
    return state if stage is None else state.update(stage, decided=True)


def _fail(params: TuningParams, state: TuningState, stage: int, what: str, now: float
          ) -> tuple[TuningState, float]:
    """One more change of kind ``what`` ("grow", "in", "out") that did not pay: held for
    ``hold_s`` doubled with each in a row, at most ``hold_max_s``."""
    fails = getattr(state.of(stage), f"fails_{what}") + 1
    hold = min(params.hold_s * 2 ** (fails - 1), params.hold_max_s)
    return state.update(stage, **{f"fails_{what}": fails, f"held_{what}": now + hold}), hold


def _memory_ok(state: TuningState, sig: Signals, rss: Mapping[int, tuple[int, ...]],
               stage: int, n: int, size: int | None = None) -> tuple[bool, str]:
    """Whether ``n`` more workers of ``stage`` (each as large as its largest, or ``size``
    bytes) fit in the memory budget beside the workers' resident bytes; else why not."""
    if sig.of(stage).runner != "process" and size is None:
        return True, ""
    if size is None:
        size = max(rss.get(stage, ()), default=0)
    need = sum(sum(sizes) for sizes in rss.values()) + n * size
    if need <= state.memory_bytes:
        return True, ""
    return False, (f"memory budget: {need >> 20} MiB with {n} more worker(s) of stage "
                   f"{stage} > {state.memory_bytes >> 20} MiB")


def _new_worker_size(params: TuningParams, sig: Signals) -> int:
    """The bytes a worker not started yet counts at: the largest process worker running,
    else this process's, at most ``new_worker_bytes`` (0: unknown)."""
    sizes = [size for g in sig.stages for size in g.rss]
    return max(sizes, default=0) or min(sig.own_rss, params.new_worker_bytes)


def fitting(params: TuningParams, state: TuningState, sig: Signals, stage: int, n: int
            ) -> tuple[int, TuningState]:
    """The most of ``n`` new workers of adaptive ``stage`` that fit in the memory budget
    (0: none; the reason held)."""
    size = _new_worker_size(params, sig)
    rss = {g.stage: g.rss for g in sig.stages if g.rss}
    while n >= 1:
        ok, why = _memory_ok(state, sig, rss, stage, n, size)
        if ok:
            break
        state = _hold(state, why)
        n = n - 1 if n <= params.move_workers else n // 2
    return n, state


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
               if g.stage not in inline)
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
    taken = sum(g.workers for g in sig.stages if g.stage not in inline)
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

    choice, idle = choose(params, sub, workers, caps, state.cpu_budget,
                          {s: state.of(s).idle for s in workers}, memory_ok, waiting)
    for s, n in idle.items():
        state = state.update(s, idle=n)
    for why in holds:
        state = _hold(state, why)
    return choice, state


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


# -- save and replay ------------------------------------------------------------------------
def to_plain(record: Any) -> Any:
    """A record as plain, JSON-serialisable values (enums as their values)."""
    if isinstance(record, Enum):
        return record.value
    if hasattr(record, "__dataclass_fields__"):
        return to_plain(asdict(record))
    if isinstance(record, Mapping):
        return {str(k) if not isinstance(k, (str, int)) else k: to_plain(v)
                for k, v in record.items()}
    if isinstance(record, (list, tuple)):
        return [to_plain(v) for v in record]
    return record


def _tuple(value: Any) -> Any:
    return None if value is None else tuple(value)


def state_from_plain(d: Mapping[str, Any]) -> TuningState:
    trial = d.get("trial")
    return TuningState(**{
        **d, "stages": tuple(StageState(**s) for s in d["stages"]),
        "trial": None if trial is None else Trial(**{**trial,
                                                     "kind": TrialKind(trial["kind"])})})


def signals_from_plain(d: Mapping[str, Any]) -> Signals:
    stages = tuple(StageSignals(**{
        **g, "rss": tuple(g["rss"]), "profile": _tuple(g["profile"]),
        "fallen": tuple((int(w), str(why)) for w, why in g["fallen"])})
        for g in d["stages"])
    return Signals(**{**d, "stages": stages, "progress": _tuple(d["progress"])})


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
