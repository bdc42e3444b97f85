"""The autotune controller: per-stage worker counts adjusted while a run goes on.

``RuntimeOptions(worker_allocation="autotune")`` starts a parallel stage whose runner
the user did not pin (no ``runner``, no ``per_stage_runner`` entry: an *adaptive*
stage, :class:`~zephon.runners.executors.AdaptiveExecutor`) inline, nothing spawned,
and a pinned threads or process stage with one worker; the run's :class:`Controller`
moves adaptive stages to process workers and back (the moves, below) and grows and
shrinks the stages on workers one worker at a time. A pinned stage never runs inline:
the user chose its runner.

**Signals -> policy -> actuator.** The rule below is the pure function
:func:`~zephon.pipeline.tuning.decide` over one period's
:class:`~zephon.pipeline.tuning.Signals`, the parameters named below
(:class:`~zephon.pipeline.tuning.TuningParams`, the defaults in :data:`PARAMS`) and the
policy's state (:class:`~zephon.pipeline.tuning.TuningState`); the controller samples
the signals, applies the actions the policy returns through the executor contract
(:class:`~zephon.runners.contract.StageExecutor`, :class:`~zephon.runners.contract.MovableExecutor`)
and records them. What it owns:

**Where it runs.** It has no thread of its own: the engine calls :meth:`Controller.tick`
each time it hands an item on (from the thread that runs the engine, the one that
also submits to and reads from the executors), and a tick does something at most
once per sampling period (``period_s``). So a grow or a shrink never races a
``submit()`` or a ``get()``, and stopping the controller is only forgetting it:
``close()`` (and the end of the stream, and an error) cannot hang on it. A run
that is blocked (the consumer does not take items, or a stage has nothing ready)
makes no decision until it moves again; the next period is measured from the last
decision point, however long ago that was.

**Signals**, over one period, per stage: its *busy fraction*, the op seconds its
units reported (each executor's one ``meter``, a
:class:`~zephon.runners.contract.StageMeter`: the controller keeps its own last reading
and takes differences; the op seconds of a pool parked by a move back inline do not
count) over ``workers x elapsed`` (clamped to 1);
the *consumer's wait*: the seconds ``next()`` spent waiting for an item over the
elapsed time (the iterator reports them through :meth:`Controller.waited`; under
``mtp_mode`` nothing reports them, so the controller only shrinks there). The
meter records whether ``execution_tracking`` is on or not: the controller reads nothing
of :mod:`zephon.pipeline.stats`.

For a process stage the controller also reads its workers' *CPU fraction*: the
seconds their threads ran on a core or waited in a run queue for one
(``/proc/<pid>/task/*/schedstat``: what they asked of the CPUs, so a CPU-bound worker
on a machine other processes load still counts as CPU-bound) over ``workers x
elapsed``; a stage whose workers are busy but ask little CPU waits on something
else (storage, the network, a sleep). An adaptive stage running inline has the same
reading, from its units: the process's CPU time while they ran plus the engine
thread's waits for a core, over the elapsed time. Thread stages have no such reading
(their CPU is the consumer's process's, shared with the consumer) and count as
CPU-bound. The *throughput* is the
items the engine handed on (its ticks) per second of the period. The *memory* signal is
the resident bytes of each process worker (in service, booting, or parked by a move back
inline; ``/proc/<pid>/statm``, shared pages it touched included) read at the period's end:
what the memory budget is held to, after a move or a grow as much as before one.

**The rule** (one decision per period at most, hill-climbing):

- *within the memory budget* (first, before the moves below and before a trial is
  judged; :func:`~zephon.pipeline.tuning.take_back`, a pure function of the memory signal, the budget and the
  counts): while the workers' resident bytes add up to more than the memory budget (an op
  that keeps memory in its workers: a cache, a leak), the stage holding the most gives
  back the fewest workers after which the total fits, counting its smallest ones (the
  executor picks which worker goes), down to one worker (an adaptive stage: to none, back
  inline, its pool stopped once its units are back; a pool parked by a move back inline
  is stopped first). The change on trial, if any, is over (kept), and the stage is not
  grown (an adaptive stage inline: not moved to processes) for a hold, doubled as a failed
  grow's (move's); each period measures again, so a stage whose workers keep growing
  gives back one more at each period it passes the budget. With no worker left to take
  back (a pinned stage at one worker that alone passes it) nothing is decided: the reason
  is held (``stats()["autotune"]["held"]``, ``explain()``) and no grow fits meanwhile.
  The budget is held at the periods (a period in which workers boot is not measured):
  between two, the workers may pass it by what they keep meanwhile, and a worker taken
  back frees its memory once the tasks it has in flight are back (it counts no more);
- *grow*: the consumer waited at least ``wait_grow`` of the period: the stage
  with the highest busy fraction, if that is at least ``busy_grow`` and the
  stage is below its cap, gets one worker if the budgets allow; if the CPU budget
  is full, a stage that could lose one worker and stay below ``busy_grow``
  gives one up instead (the grow follows at a later period), and a process stage
  whose workers' CPU fraction is below ``waiting_cpu`` times their busy fraction
  grows past the CPU budget (up to its waiting cap, ``waiting_factor`` times the budget) as long
  as the CPU all workers are measured to use, plus one more of this stage's, stays
  within the budget; such a stage doubles (as many workers more as it has, bounded by
  its waiting cap, by the CPU the new ones are measured to need and by the memory
  budget), so reaching tens of workers takes a few trials, not one per worker;
- *trial*: a grow is kept only if it paid: once the new worker is ready, the new
  setting's first period is its settling (the parts in flight under the old setting
  come back, queues refill: not counted), then it must hand on at least
  ``trial_gain`` more items per second than the previous setting did (over the
  whole time that one ran); the judgement waits for ``trial_items`` items and
  ``trial_min_s`` seconds after the settling, or ``trial_s`` seconds, and makes
  no other decision meanwhile (a longer trial costs nothing when the change pays: it
  is in force meanwhile); with fewer than ``trial_min_items`` items on either side
  there is no evidence and the grow stays. A grow that did not pay is
  taken back (every worker it added) and the stage is not grown for ``hold_s``
  seconds, doubled with each such grow in a row, at most ``hold_max_s`` (on a
  machine whose cores other processes use, or past the point where the stage is the
  bottleneck, a worker more costs more than it gives);
- *back within the budget*: a process stage that went past its cap because its
  workers waited (a waiting grow above, or a wide move below) and whose workers then
  read as busy (at least ``busy_shrink``) and not waiting for
  ``shrink_periods`` periods in a row (the op turned CPU-bound, or the move was
  made on a wait that passed) is cut to its cap and not grown for ``hold_s``
  seconds (so a stage whose wait comes and goes is not cut and doubled by turns);
- *shrink*: a stage with more than one worker that would stay below
  ``busy_shrink`` busy with one worker fewer, for ``shrink_periods``
  periods in a row, loses one (the busiest-first grow and the lower shrink
  threshold are the hysteresis: a stage is not grown and shrunk on alternate
  periods);
- after any change, and while a grown process worker is still booting, the
  controller measures nothing (the period in which the last worker became ready is not
  measured either: the next one starts at its end, whenever in it they were ready), so
  each decision is judged on full periods of the new setting.

**The moves** (adaptive stages; they come before the rule above, which sees only the
stages on workers). An inline stage counts as one worker for its busy fraction (its op
seconds over the elapsed time: the engine's thread) and as none against the CPU budget
(the engine's thread is not a worker).

- *to processes*: an inline stage that is busy at least ``busy_grow`` while the
  consumer waits at least ``wait_grow``, for ``move_periods`` period(s) in a row
  (counted from the start of the run), whose samples cost its ops at least
  ``move_min_sample_s`` each and ``move_min_byte_s`` per output byte (the
  executor's ``profile``, which the dispatch keeps from each unit's op time and
  output size; unknown: not yet), and whose work left in the run (the source samples
  the engine has yet to hand to the lanes, at the op seconds the stage spent so far per
  source sample read: ``progress``) would take at least ``move_payback_s`` inline (starting workers costs about half a second of
  two cores, which a shorter rest of the run cannot win back), is moved to
  ``move_workers`` workers (fewer if the CPU budget, less the other stages'
  workers, leaves fewer): one process worker alone rarely beats inline. A stage whose
  units asked the CPU (the process's CPU time while they ran, every thread of it, plus
  the engine thread's waits for a core: the inline executor's ``demand_s``) for less
  than ``waiting_cpu`` of their time in every one of ``wide_periods`` periods
  in a row waits on storage or the network, and is moved at once to
  as many workers as the CPU budget, less what the other stages are measured to use,
  feeds at the most it asked per second of op time, up to its waiting cap (halved
  while that many workers (each as large as the largest running, else as this process
  up to ``new_worker_bytes``) would not fit the memory
  budget, counting the other stages' workers; never fewer than a CPU-bound stage gets):
  one boot instead of a boot and a trial per doubling. Should its workers then not read
  as waiting, the rule's *back within the budget* cuts them to the stage's cap. Its workers boot while its units go on running inline (the
  controller measures nothing meanwhile); the move is then on trial as a grow is: kept
  if the throughput rose by ``trial_gain`` over the inline one, else the stage goes
  back inline, its pool stopped, and is not moved again for ``hold_s`` seconds,
  doubled with each failed move in a row, at most ``hold_max_s`` (so a workload
  that processes never pay for loses little to the trials);
- *back inline*: a moved stage whose workers' busy fractions add up to less than
  ``busy_shrink`` of one core for ``shrink_periods`` periods (its work would fit
  in the engine's thread: the op turned cheap) is run inline again, on trial: its pool
  is parked (nothing new goes to it; its units in flight come back as any others) and
  stopped once the trial keeps inline (:func:`~zephon.pipeline.tuning.judge_inline`: at most trial_gain slower:
  inline holds no process and no memory), else the stage takes the parked pool back at
  once with the workers it had, and moves back inline are held as failed moves to
  processes are;
- a move to processes starts only the workers the memory budget has room for (as
  above; none: the stage stays inline and the hold says so); once they run, the memory
  signal is what counts (the rule's *within the memory budget*);
- a stage whose pool cannot start (an op that does not pickle, a worker that fails to
  start or is not ready within the spawn timeout), or whose samples do not pickle or
  whose units fail in a worker and pass inline (the executor's ``unable``), stays
  inline for the rest of the run (logged once, a recorded decision);
- under ``mtp_mode`` the consumer's wait is not reported: adaptive stages stay inline.

**Bounds.** At least one worker per stage on workers (an adaptive stage running
inline holds none: the caps of the others are that much larger); at most the CPU budget in all, over the
stages (:func:`~zephon.options.resolve_autotune_cpu_budget`: an explicit
``max_workers``, else the cores the process may use, affinity and cgroup
``cpu.max``), except for the waiting process stages above, whose measured CPU is
what counts against the budget; a stage at most ``budget - (stages - 1)`` (a
waiting process stage: ``waiting_factor x budget``, at most 127); a new process worker only
while the resident memory of the process workers (the memory signal) plus one
more of the largest stays within the memory budget
(:func:`~zephon.options.resolve_autotune_memory_bytes`: ``autotune_memory_bytes``,
else half of what is available at start), and workers taken back whenever the measured
total passes it (the rule's first item). Thread workers count against the CPU
budget only. A stage whose workers run elsewhere (a Ray stage: its executor's
``cpu_pool``, the cluster's CPUs) is a budget of its own: it grows within that pool,
one actor at a time while the consumer waits on it, shrinks by the same rule, and its
actors count against nothing of the host's.

**Lifecycle.** Made by the engine with its executors (none when no stage is
threads, process or adaptive), it sets each executor's ``max_workers``,
and starts where the pipeline's previous run left its stages, if there was one
(``start``: that run's :meth:`Controller.resume_point`, kept by the pipeline's
:class:`~zephon.pipeline.progress.Progress`: the last setting judged, a change still
on trial counting as not made): adaptive stages moved, stages on workers grown to
those counts at once, recorded as decisions at 0 s, if the work left pays a boot
(move_payback_s), so an epoch after the first (a new ``iter(pipe)``) does not
measure and boot its way there again;
``close()`` (the engine's) records the moves the stages undid last and forgets the
executors (the meters are theirs). A shrunk worker is not a crash
and loses nothing: a thread ends after the units queued before its stop, a
process worker finishes the tasks it has in flight and is then stopped
(:meth:`~zephon.transport.WorkerPool.retire_worker`).

**The stream** never depends on this: the engine's output depends on the seed,
the source and the ops, never on runners, worker counts or timing (dispatch reads the
current worker count and mode only to bound what is in flight; results of inline and
process units are re-ordered by sequence alike). Decisions themselves are not
deterministic; a test forces moves through :attr:`Controller.script` (made in the
engine's thread at a given item) with :attr:`Controller.frozen` set.

**Record.** Every decision (grows, shrinks and moves: 0 workers is inline) is one
``logging`` line (logger ``zephon.autotune``, INFO) and a :class:`Decision` in
:attr:`Controller.decisions` (the latest ``keep_decisions``; ``decided`` counts
them all); a move an adaptive stage undid by itself (its workers did not start, a
sample that cannot be pickled) is recorded too; ``stats()`` shows
them with the budgets, the counts now and the last period's signals, the workers'
resident bytes per stage among them (``snapshot()``), and ``explain()`` shows the
latest run's, with the workers' resident memory against the budget and the reason held.

**Save and replay.** The controller keeps its latest ``keep_decisions`` periods, each
with the state before it, the signals, the actions decided and whether the change could
be applied; :meth:`Controller.recording` returns them as plain, JSON-serialisable dicts
and :func:`~zephon.pipeline.tuning.replay` runs the policy over them again, to the same
actions.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Callable, NamedTuple

from zephon.pipeline.tuning import (
    Action,
    ActionKind,
    Measures,
    Signals,
    StageSignals,
    TuningParams,
    TuningState,
    changed,
    decide,
    fitting,
    initial_state,
    most_workers,
    to_plain,
)

__all__ = ["PARAMS", "Controller", "Decision"]

log = logging.getLogger("zephon.autotune")

#: the policy's parameters a controller uses unless given its own
PARAMS = TuningParams()


class Decision(NamedTuple):
    """One change: ``stage`` went from ``before`` to ``after`` workers ``at`` seconds
    into the run, for ``reason`` (0 workers: an adaptive stage running inline)."""

    at: float
    stage: int
    before: int
    after: int
    reason: str

    def text(self) -> str:
        def count(n: int) -> str:
            return "inline" if n == 0 else f"{n} worker(s)"
        return (f"{self.at:6.2f} s: stage {self.stage} {count(self.before)} -> "
                f"{count(self.after)}: {self.reason}")


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def _cpu_demand(pid: int) -> float:
    """The seconds ``pid``'s threads ran on a core or waited in a run queue for one so far
    (``/proc/<pid>/task/*/schedstat``; where the kernel has none, the CPU seconds of
    ``/proc/<pid>/stat``; 0 when unknown)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    total, found = 0, False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as fh:
                ran, queued = fh.read().split()[:2]
            total += int(ran) + int(queued)
            found = True
        except (OSError, ValueError):
            continue
    return total / 1e9 if found else _cpu_seconds(pid)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 when unknown)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _rss(pid: int) -> int:
    """Resident bytes of ``pid`` (0 when unknown)."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _busy(reading: tuple[int, float, float, int, float]) -> float:
    """A meter reading's op seconds, less a parked pool's."""
    return reading[1] - reading[4]


def _own_budgets(executors: Mapping[int, Any]) -> dict[int, int]:
    """The stages whose workers draw on CPUs of their own (an executor's ``cpu_pool``: a
    Ray stage's cluster) and those budgets."""
    return {s: ex.cpu_pool for s, ex in executors.items() if ex.cpu_pool is not None}


class Controller:
    """The controller of one run (see the module docstring).

    Args:
        executors: stage index -> executor (threads, process and adaptive ones are
            tuned; the others are left alone).
        cpu_budget: workers in all, over the tuned stages.
        memory_bytes: resident bytes the process workers may use together.
        period: seconds between decisions (default: the parameters').
        clock: the time source (seconds).
        progress: ``() -> (source samples read, source samples left)`` in the run, None
            for ever (or no call: for ever); the engine counts them.
        start: where the pipeline's previous run left its stages (its
            :meth:`resume_point`).
        params: the policy's parameters (default: :data:`PARAMS`).
    """

    def __init__(self, executors: Mapping[int, Any], cpu_budget: int, memory_bytes: int, *,
                 period: float | None = None, clock: Callable[[], float] = time.monotonic,
                 progress: Callable[[], tuple[int, int] | None] | None = None,
                 start: Mapping[int, tuple[int, float | None]] | None = None,
                 params: TuningParams | None = None) -> None:
        self.params = params = PARAMS if params is None else params
        self.period = params.period_s if period is None else period
        self.progress, self.clock = progress, clock
        self.executors = {s: ex for s, ex in executors.items()
                          if ex.runner != "inline" or ex.adaptive}
        #: the adaptive stages (inline until moved to processes, see the rule)
        self.adaptive = {s for s, ex in self.executors.items() if ex.adaptive}
        #: the stages whose workers' CPU and memory are read (process and adaptive)
        self._procs = {s for s, ex in self.executors.items()
                       if ex.runner == "process" or s in self.adaptive}
        self.started = clock()
        self.state: TuningState = initial_state(
            params, {s: (s in self.adaptive, s in self._procs) for s in self.executors},
            cpu_budget, memory_bytes, self.started, _own_budgets(self.executors))
        self.cpu_budget, self.memory_bytes = self.state.cpu_budget, memory_bytes
        self.caps = {ss.stage: ss.cap for ss in self.state.stages}
        self.waiting_caps = {ss.stage: ss.waiting_cap for ss in self.state.stages
                             if ss.process}
        for s, ex in self.executors.items():
            ex.max_workers = most_workers(params, self.state, s)
        #: the latest keep_decisions decisions, oldest first; ``decided``: all of them
        self.decisions: list[Decision] = []
        self.decided = 0
        #: the latest judged trials: (kind, stage, kept), kind "grow", "process" (a move
        #: to processes) or "inline" (a move back inline)
        self.trials: list[tuple[str, int, bool]] = []
        self.last: Measures | None = None  # the last measured period's fractions
        #: a test sets it: no decision of the rule's (moves only by :meth:`force` and
        #: :attr:`script`)
        self.frozen = False
        #: a test's hook: tick (items handed on since the start) -> ``(stage, workers,
        #: wait)``, forced (:meth:`force`) in the engine's thread at that tick
        self.script: dict[int, tuple[int, int, bool]] = {}
        self.ticks = 0
        self._wait_lock = threading.Lock()
        self._waited = 0.0
        self._since, self._tick0 = self.started, 0
        self._readings = {s: ex.meter.reading() for s, ex in self.executors.items()}
        self._base = {s: _busy(r) for s, r in self._readings.items()}  # (spent from here)
        self._cpu_seen: dict[int, float] = {}  # pid -> CPU seconds at the period start
        #: the periods kept for :meth:`recording`: (state before, signals or None for a
        #: forced move, the actions decided or the stage forced, applied)
        self._log: deque[tuple[TuningState, Signals | None, Any, bool]] = deque(
            maxlen=params.keep_decisions)
        self._carried = dict(start or {})
        self._resume: dict[int, tuple[int, float | None]] | None = None  # set by close()
        self._final: dict[int, int] | None = None
        if start:
            self._warm(start)

    @property
    def held(self) -> str:
        """Why the last wanted change did not happen ("" once one is made)."""
        return self.state.held

    # -- signals ---------------------------------------------------------------------------
    def waited(self, seconds: float) -> None:
        """The consumer waited ``seconds`` in one ``next()`` (any thread)."""
        with self._wait_lock:
            self._waited += seconds

    def _stage(self, s: int, ex: Any, seen: dict[int, float], peek: bool) -> StageSignals:
        """Stage ``s``'s signals since the last reading (which this one replaces, unless
        ``peek``: then nothing is taken, the executor's fallen moves included)."""
        reading = ex.meter.reading()
        last = self._readings[s]
        if not peek:
            self._readings[s] = reading
        demand = reading[2] - last[2] if reading[3] != last[3] else None
        cpu_s: float | None = None
        rss: tuple[int, ...] = ()
        if s in self._procs:
            cpu_s = 0.0
            pids = ex.pids()
            for pid in pids:
                now = seen[pid] = _cpu_demand(pid)
                cpu_s += max(0.0, now - self._cpu_seen.get(pid, now))
            rss = tuple(_rss(pid) for pid in pids)
        unable, fallen = "", []
        if s in self.adaptive:
            unable = ex.unable
            if peek:
                fallen = list(ex.fallen)
            while ex.fallen and not peek:
                fallen.append(ex.fallen.pop(0))
        return StageSignals(s, ex.runner, ex.workers, ex.booting,
                            _busy(reading) - _busy(last), demand, cpu_s, rss,
                            ex.meter.profile, unable, _busy(reading) - self._base[s],
                            tuple(fallen))

    def _sample(self, now: float, closing: bool = False, peek: bool = False) -> Signals:
        """The signals of the period from the last one's end to ``now`` (``peek``: read
        without taking them: the period goes on)."""
        seen: dict[int, float] = {}
        stages = tuple(self._stage(s, ex, seen, peek)
                       for s, ex in sorted(self.executors.items()))
        with self._wait_lock:
            wait = self._waited
            if not peek:
                self._cpu_seen, self._waited = seen, 0.0
        moving = bool(self.adaptive)
        progress = self.progress() if moving and self.progress is not None else None
        return Signals(now, self._since, self.ticks - self._tick0, wait, stages,
                       _rss(os.getpid()) if moving else 0, progress, closing, self.frozen)

    def _restart(self, now: float) -> None:
        """Start a new period at ``now``: what happened since the last reading is not
        its evidence."""
        seen: dict[int, float] = {}
        for s, ex in self.executors.items():
            self._readings[s] = ex.meter.reading()
            if s in self._procs:
                for pid in ex.pids():
                    seen[pid] = _cpu_demand(pid)
        self._cpu_seen = seen
        with self._wait_lock:
            self._waited = 0.0
        self._since, self._tick0 = now, self.ticks

    # -- the loop --------------------------------------------------------------------------
    def tick(self) -> None:
        """Called by the engine per item: decide when a period has passed."""
        self.ticks += 1
        if self.script and self.ticks in self.script:
            self.force(*self.script.pop(self.ticks))
        now = self.clock()
        if now - self._since < self.period or not self.executors:
            return
        sig = self._sample(now)
        self._since, self._tick0 = now, self.ticks
        self._step(sig)

    def _step(self, sig: Signals) -> None:
        """Decide over ``sig``, apply and record it."""
        before = self.state
        step, state = decide(self.params, before, sig)
        applied, recorded = self._apply(sig.now, step.actions)
        if not applied and step.fallback is not None:
            state = step.fallback
        self.state = state
        self._log.append((before, sig, step.actions, applied))
        if step.judged is not None:
            kind, stage, kept = step.judged
            self.trials.append((kind.value, stage, kept))
            self._trim(self.trials)
        if step.measures is not None:
            self.last = step.measures
        if state.held and state.held != before.held:
            log.info("autotune: not growing: %s", state.held)
        if recorded:  # judge the new setting on full periods of it
            self._restart(self.clock())

    def _apply(self, now: float, actions: tuple[Action, ...]) -> tuple[bool, bool]:
        """Apply ``actions`` in order: ``(the change applied (or none asked), something
        recorded)``."""
        applied, recorded = True, False
        for a in actions:
            ex = self.executors[a.stage]
            if a.kind is ActionKind.RELEASE:
                ex.release()
            elif a.kind is ActionKind.FALLEN:
                self._record(now, a.stage, a.before, a.after, a.reason)
                recorded = True
            elif a.kind is ActionKind.MOVE:
                applied = self._switch(now, a.stage, a.after, a.reason)
            else:
                applied = self._resize(now, a.stage, a.after - a.before, a.reason)
            recorded = recorded or (a.change and applied)
        return applied, recorded

    def _warm(self, start: Mapping[int, tuple[int, float | None]]) -> None:
        """Start where the pipeline's previous run ended (``start``: stage -> (its workers
        then, 0: inline; the op seconds it spent per source sample read, None: unknown), from
        that run's :meth:`resume_point`): an adaptive stage is moved there at once (its
        workers boot while its units run inline), a stage on workers grown to it, each
        within the most its executor may have, and only while the work left in this run,
        at that cost, pays the boot (``move_payback_s``: a short tail after a restore is not
        worth starting processes for). Not on trial (the previous run judged it; a change
        still on trial when it ended left the setting before it) and not a decision of
        this run; the rule goes on from there, a stage past its cap included (it went
        there because its workers waited)."""
        now = self.clock()
        progress = self.progress() if self.progress is not None else None
        moved = False
        for s, (n, cost) in sorted(start.items()):
            ex = self.executors.get(s)
            if ex is None or n <= self._count(s):
                continue
            if (cost is not None and progress is not None
                    and cost * progress[1] < self.params.move_payback_s):
                continue
            n = min(n, ex.max_workers)
            why = "where the previous run of this pipeline ended"
            if s in self.adaptive:
                held = self.state.held
                n, self.state = fitting(self.params, self.state,
                                        self._sample(now, peek=True), s, n)
                if self.state.held and self.state.held != held:
                    log.info("autotune: not growing: %s", self.state.held)
                done = n >= 1 and self._switch(now, s, n, why)
            else:
                done = self._resize(now, s, n - ex.workers, why)
            if done:  # a recorded change: what was held before it is over
                self.state = replace(self.state, held="")
                if n > self.caps[s]:
                    self.state = self.state.update(s, wide=0)
            moved = moved or done
        if moved:  # a refusal after the last change stays held (and shown)
            self.state = replace(changed(self.state), held=self.state.held)
            self._restart(self.clock())

    def resume_point(self) -> dict[int, tuple[int, float | None]]:
        """Where the pipeline's next run starts (its ``start``): per stage, the workers of
        the last setting this run judged or carried (a change still on trial counts as not
        made; a move to processes still booting, as made), and the op seconds the stage
        spent per source sample read (this run's, else the carried one; None: unknown).
        A stage this run never decided about keeps what it carried: a run closed before it
        measured anything (a peek, a short tail) does not erase the setting. Once closed,
        what it was at :meth:`close`."""
        if self._resume is not None:
            return dict(self._resume)
        trial = self.state.trial
        progress = self.progress() if self.progress is not None else None
        read = progress[0] if progress else 0
        out = {}
        for s, ex in self.executors.items():
            carried = self._carried.get(s)
            # the op seconds of the periods measured: a run closed before its first
            # period (a peek) measured nothing, and keeps the carried cost
            spent = _busy(self._readings[s]) - self._base[s]
            cost = spent / read if read and spent else (carried[1] if carried else None)
            if not self.state.of(s).decided and carried is not None:
                out[s] = (min(carried[0], ex.max_workers), cost)
            elif trial is not None and trial.stage == s:
                out[s] = (trial.back, cost)
            else:
                target = ex.moving_to if s in self.adaptive else None
                out[s] = (target if target else self._count(s), cost)
        return out

    def _count(self, stage: int) -> int:
        """The stage's workers now; 0 for an adaptive stage running inline."""
        ex = self.executors[stage]
        return 0 if stage in self.adaptive and ex.runner == "inline" else ex.workers

    # -- the actuator ----------------------------------------------------------------------
    def _switch(self, now: float, stage: int, workers: int, reason: str,
                wait: bool = False) -> bool:
        """Move adaptive ``stage`` to ``workers`` process workers (0: inline), recorded;
        False if it failed."""
        ex = self.executors[stage]
        before = self._count(stage)
        try:
            if workers == 0:
                ex.to_inline()
            else:
                ex.to_process(workers, wait=wait)
        except Exception as exc:  # noqa: BLE001 - a failed move leaves the stage inline
            log.warning("autotune: stage %d: moving failed: %s", stage, exc)
            return False
        self._record(now, stage, before, workers, reason)
        return True

    def force(self, stage: int, workers: int, wait: bool = False) -> bool:
        """Move adaptive ``stage`` to ``workers`` process workers, or inline (0), now, in
        the engine's thread (a test's hook, see :attr:`script`; with :attr:`frozen` set,
        the only moves made; ``wait``: a move to processes waits for the workers; a forced
        move back inline also stops the pool once its units are back)."""
        done = self._switch(self.clock(), stage, workers, "forced", wait)
        if done:
            if workers == 0:
                self.executors[stage].release()
            self._log.append((self.state, None, stage, True))
            self.state = changed(self.state, stage)
            self._restart(self.clock())
        return done

    def _resize(self, now: float, stage: int, delta: int, reason: str) -> bool:
        """``delta`` workers more (> 0) or fewer (< 0) for ``stage``, recorded; False if
        the first failed (a later failure keeps what was done)."""
        ex = self.executors[stage]
        before = ex.workers
        for i in range(abs(delta)):
            try:
                ex.grow() if delta > 0 else ex.shrink()
            except Exception as exc:  # noqa: BLE001 - a failed resize leaves the stage as it was
                log.warning("autotune: stage %d: resizing failed: %s", stage, exc)
                if i == 0:
                    return False
                break
        if ex.workers == before:  # (a pool that keeps its last live worker: no change)
            return False
        self._record(now, stage, before, ex.workers, reason)
        return True

    def _trim(self, kept: list) -> None:
        """Keep the latest keep_decisions of ``kept``."""
        most = self.params.keep_decisions
        if len(kept) > most:
            del kept[:len(kept) - most]

    def _record(self, now: float, stage: int, before: int, after: int, reason: str) -> None:
        decision = Decision(round(now - self.started, 3), stage, before, after, reason)
        self.decisions.append(decision)
        self.decided += 1
        self._trim(self.decisions)
        log.info("autotune: %s", decision.text())

    # -- what it shows ---------------------------------------------------------------------
    def recording(self) -> list[dict[str, Any]]:
        """The kept periods as plain, JSON-serialisable dicts, for
        :func:`~zephon.pipeline.tuning.replay`: ``{"state": ...}`` (the policy's state
        before the first), then per period ``{"signals", "actions", "applied"}`` and per
        forced move ``{"forced": stage}``."""
        entries = list(self._log)
        out: list[dict[str, Any]] = [
            {"state": to_plain(entries[0][0] if entries else self.state)}]
        for _, sig, what, applied in entries:
            if sig is None:
                out.append({"forced": what})
            else:
                out.append({"signals": to_plain(sig), "actions": to_plain(list(what)),
                            "applied": applied})
        return out

    def snapshot(self) -> dict:
        """The budgets, the worker counts now, the last period's signals (the workers'
        resident bytes per stage among them) and every decision, as plain values
        (``stats()["autotune"]``)."""
        last = self.last
        return {
            "cpu_budget": self.cpu_budget,
            "memory_bytes": self.memory_bytes,
            "period_s": self.period,
            "workers": self.counts(),
            "busy": dict(last.busy) if last else {},
            "cpu": dict(last.cpu) if last else {},
            "items_per_s": last.rate if last else None,
            "consumer_wait": last.wait if last else None,
            "resident_bytes": {s: sum(r) for s, r in last.rss.items()} if last else {},
            "held": self.held,
            "decisions": [d._asdict() for d in self.decisions],
            "decisions_total": self.decided,
        }

    def explain(self) -> list[str]:
        """Lines for ``explain()``: the counts now, the workers' resident memory and the
        budget, each decision, and why the last wanted change did not happen."""
        counts = ", ".join(f"stage {s}: {n if n else 'inline'}"
                           for s, n in self.counts().items())
        lines = [f"autotune (latest run): {counts}; {self.decided} decision(s)"]
        if self.last is not None:
            resident = sum(sum(r) for r in self.last.rss.values())
            lines.append(f"  memory: workers resident {_mib(resident)} of the "
                         f"{_mib(self.memory_bytes)} budget (the last period)")
        lines += [f"  {d.text()}" for d in self.decisions[-20:]]
        if self.held:
            lines.append(f"  held: {self.held}")
        return lines

    def counts(self) -> dict[int, int]:
        """Workers per tuned stage now (at the end, once closed); 0 for an adaptive stage
        running inline."""
        if self._final is not None:
            return dict(self._final)
        return {s: self._count(s) for s in self.executors}

    def close(self) -> None:
        """Record the moves the stages undid since the last period, keep where the next
        run starts, and forget the executors (they are closed with the engine); what was
        decided stays readable."""
        if self._final is None:
            if self.executors:
                measured = dict(self._readings)
                self._step(self._sample(self.clock(), closing=True))
                # the tail after the last period is no period: the cost handed on is
                # the periods' (a run that measured none keeps the carried one)
                self._readings = measured
            self._resume = self.resume_point()
            self._final = self.counts()
        self.executors = {}
