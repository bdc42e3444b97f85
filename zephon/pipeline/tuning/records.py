"""The autotune policy's records: its parameters, state, signals, actions and steps, all
frozen, and their plain (JSON-serialisable) form for a recording (see
:mod:`zephon.pipeline.tuning`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, Mapping

__all__ = ["Action", "ActionKind", "Measures", "Signals", "StageSignals", "StageState",
           "Step", "Trial", "TrialKind", "TuningParams", "TuningState", "signals_from_plain",
           "state_from_plain", "to_plain"]


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
    #: the CPUs of a pool of its own its workers draw from, apart from the host's budget
    #: (a Ray stage: the cluster's CPUs); None: the host's budget, shared
    budget: int | None = None
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
