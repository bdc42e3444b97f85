"""The autotune controller: per-stage worker counts adjusted while a run goes on.

``RuntimeOptions(worker_allocation="autotune")`` starts a parallel stage whose runner
the user did not pin (no ``runner``, no ``per_stage_runner`` entry: an *adaptive*
stage, :class:`~zephon.runners.executors.AdaptiveExecutor`) inline, nothing spawned,
and a pinned threads or process stage with one worker; the run's :class:`Controller`
moves adaptive stages to process workers and back (the moves, below) and grows and
shrinks the stages on workers one worker at a time. A pinned stage never runs inline:
the user chose its runner. What it owns:

**Where it runs.** It has no thread of its own: the engine calls :meth:`Controller.tick`
each time it hands an item on (from the thread that runs the engine, the one that
also submits to and reads from the executors), and a tick does something at most
once per sampling period (:data:`PERIOD_S`). So a grow or a shrink never races a
``submit()`` or a ``get()``, and stopping the controller is only forgetting it:
``close()`` (and the end of the stream, and an error) cannot hang on it. A run
that is blocked (the consumer does not take items, or a stage has nothing ready)
makes no decision until it moves again; the next period is measured from the last
decision point, however long ago that was.

**Signals**, over one period, per stage: its *busy fraction*, the op seconds its
workers reported (each executor's ``meter``; a process worker times its tasks
when autotune is on, tracking or not) over ``workers x elapsed`` (clamped to 1);
the *consumer's wait*: the seconds ``next()`` spent waiting for an item over the
elapsed time (the iterator reports them through :meth:`Controller.waited`; under
``mtp_mode`` nothing reports them, so the controller only shrinks there). The
counters are the controller's own (:class:`StageMeter`): it does not need
``execution_tracking`` and reads nothing of :mod:`zephon.pipeline.stats`.

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
  judged; :func:`take_back`, a pure function of the memory signal, the budget and the
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
- *grow*: the consumer waited at least :data:`WAIT_GROW` of the period: the stage
  with the highest busy fraction, if that is at least :data:`BUSY_GROW` and the
  stage is below its cap, gets one worker if the budgets allow; if the CPU budget
  is full, a stage that could lose one worker and stay below :data:`BUSY_GROW`
  gives one up instead (the grow follows at a later period), and a process stage
  whose workers' CPU fraction is below :data:`WAITING_CPU` times their busy fraction
  grows past the CPU budget (up to its waiting cap, :data:`WAITING_FACTOR` times the budget) as long
  as the CPU all workers are measured to use, plus one more of this stage's, stays
  within the budget; such a stage doubles (as many workers more as it has, bounded by
  its waiting cap, by the CPU the new ones are measured to need and by the memory
  budget), so reaching tens of workers takes a few trials, not one per worker;
- *trial*: a grow is kept only if it paid: once the new worker is ready, the new
  setting's first period is its settling (the parts in flight under the old setting
  come back, queues refill: not counted), then it must hand on at least
  :data:`TRIAL_GAIN` more items per second than the previous setting did (over the
  whole time that one ran); the judgement waits for :data:`TRIAL_ITEMS` items and
  :data:`TRIAL_MIN_S` seconds after the settling, or :data:`TRIAL_S` seconds, and makes
  no other decision meanwhile (a longer trial costs nothing when the change pays: it
  is in force meanwhile); with fewer than :data:`TRIAL_MIN_ITEMS` items on either side
  there is no evidence and the grow stays. A grow that did not pay is
  taken back (every worker it added) and the stage is not grown for :data:`HOLD_S`
  seconds, doubled with each such grow in a row, at most :data:`HOLD_MAX_S` (on a
  machine whose cores other processes use, or past the point where the stage is the
  bottleneck, a worker more costs more than it gives);
- *back within the budget*: a process stage that went past its cap because its
  workers waited (a waiting grow above, or a wide move below) and whose workers then
  read as busy (at least :data:`BUSY_SHRINK`) and not waiting for
  :data:`SHRINK_PERIODS` periods in a row (the op turned CPU-bound, or the move was
  made on a wait that passed) is cut to its cap and not grown for :data:`HOLD_S`
  seconds (so a stage whose wait comes and goes is not cut and doubled by turns);
- *shrink*: a stage with more than one worker that would stay below
  :data:`BUSY_SHRINK` busy with one worker fewer, for :data:`SHRINK_PERIODS`
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

- *to processes*: an inline stage that is busy at least :data:`BUSY_GROW` while the
  consumer waits at least :data:`WAIT_GROW`, for :data:`MOVE_PERIODS` period(s) in a row
  (counted from the start of the run), whose samples cost its ops at least
  :data:`MOVE_MIN_SAMPLE_S` each and :data:`MOVE_MIN_BYTE_S` per output byte (the
  executor's ``profile``, which the dispatch keeps from each unit's op time and
  output size; unknown: not yet), and whose work left in the run (the source samples
  the engine has yet to hand to the lanes, at the op seconds the stage spent so far per
  source sample read: ``progress``) would take at least :data:`MOVE_PAYBACK_S` inline (starting workers costs about half a second of
  two cores, which a shorter rest of the run cannot win back), is moved to
  :data:`MOVE_WORKERS` workers (fewer if the CPU budget, less the other stages'
  workers, leaves fewer): one process worker alone rarely beats inline. A stage whose
  units asked the CPU (the process's CPU time while they ran, every thread of it, plus
  the engine thread's waits for a core: the inline executor's ``demand_s``) for less
  than :data:`WAITING_CPU` of their time in every one of :data:`WIDE_PERIODS` periods
  in a row waits on storage or the network, and is moved at once to
  as many workers as the CPU budget, less what the other stages are measured to use,
  feeds at the most it asked per second of op time, up to its waiting cap (halved
  while that many workers (each as large as the largest running, else as this process
  up to :data:`NEW_WORKER_BYTES`) would not fit the memory
  budget, counting the other stages' workers; never fewer than a CPU-bound stage gets):
  one boot instead of a boot and a trial per doubling. Should its workers then not read
  as waiting, the rule's *back within the budget* cuts them to the stage's cap. Its workers boot while its units go on running inline (the
  controller measures nothing meanwhile); the move is then on trial as a grow is: kept
  if the throughput rose by :data:`TRIAL_GAIN` over the inline one, else the stage goes
  back inline, its pool stopped, and is not moved again for :data:`HOLD_S` seconds,
  doubled with each failed move in a row, at most :data:`HOLD_MAX_S` (so a workload
  that processes never pay for loses little to the trials);
- *back inline*: a moved stage whose workers' busy fractions add up to less than
  :data:`BUSY_SHRINK` of one core for :data:`SHRINK_PERIODS` periods (its work would fit
  in the engine's thread: the op turned cheap) is run inline again, on trial: its pool
  is parked (nothing new goes to it; its units in flight come back as any others) and
  stopped once the trial keeps inline (:func:`judge_inline`: at most TRIAL_GAIN slower:
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
waiting process stage: ``WAITING_FACTOR x budget``, at most 127); a new process worker only
while the resident memory of the process workers (the memory signal) plus one
more of the largest stays within the memory budget
(:func:`~zephon.options.resolve_autotune_memory_bytes`: ``autotune_memory_bytes``,
else half of what is available at start), and workers taken back whenever the measured
total passes it (the rule's first item). Thread workers count against the CPU
budget only.

**Lifecycle.** Made by the engine with its executors (none when no stage is
threads, process or adaptive), it sets each executor's ``meter`` and ``max_workers``,
and starts where the pipeline's previous run left its stages, if there was one
(``start``: that run's :meth:`Controller.resume_point`, kept by the pipeline's
:class:`~zephon.pipeline.progress.Progress`: the last setting judged, a change still
on trial counting as not made): adaptive stages moved, stages on workers grown to
those counts at once, recorded as decisions at 0 s, if the work left pays a boot
(MOVE_PAYBACK_S), so an epoch after the first (a new ``iter(pipe)``) does not
measure and boot its way there again;
``close()`` (the engine's) detaches the meters. A shrunk worker is not a crash
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
:attr:`Controller.decisions` (the latest :data:`KEEP_DECISIONS`; ``decided`` counts
them all); a move an adaptive stage undid by itself (its workers did not start, a
sample that cannot be pickled) is recorded too; ``stats()`` shows
them with the budgets, the counts now and the last period's signals, the workers'
resident bytes per stage among them (``snapshot()``), and ``explain()`` shows the
latest run's, with the workers' resident memory against the budget and the reason held.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable, NamedTuple

__all__ = ["BUSY_GROW", "BUSY_SHRINK", "HOLD_MAX_S", "HOLD_S", "KEEP_DECISIONS",
           "MOVE_MIN_BYTE_S", "MOVE_MIN_SAMPLE_S", "MOVE_PAYBACK_S", "MOVE_PERIODS",
           "MOVE_WORKERS", "NEW_WORKER_BYTES", "PERIOD_S", "SHRINK_PERIODS", "TRIAL_GAIN",
           "TRIAL_ITEMS", "TRIAL_MIN_ITEMS", "TRIAL_MIN_S", "TRIAL_S", "WAITING_CPU",
           "WAITING_FACTOR", "WAIT_GROW", "WIDE_PERIODS", "Controller", "Decision",
           "StageMeter", "choose", "judge", "judge_inline", "take_back"]

log = logging.getLogger("zephon.autotune")

#: Seconds between two decisions (a sampling period).
PERIOD_S = 0.25
#: The consumer's waiting fraction from which the pipeline is input bound (grow).
WAIT_GROW = 0.05
#: The busy fraction from which a stage may get one more worker.
BUSY_GROW = 0.6
#: A stage loses one worker when, with one fewer, it would stay below this busy fraction
#: (for SHRINK_PERIODS periods in a row).
BUSY_SHRINK = 0.45
SHRINK_PERIODS = 3
#: A process stage whose workers ask a core for less than this fraction of the time
#: they are busy waits on something else: it may grow past the CPU budget (the rule).
WAITING_CPU = 0.3
#: A waiting process stage's cap: this many times the CPU budget.
WAITING_FACTOR = 4
#: A grow is kept when the throughput after it is at least (1 + TRIAL_GAIN) x before.
TRIAL_GAIN = 0.03
#: The items a trial waits for (at most TRIAL_S seconds) before it is judged; with fewer
#: than TRIAL_MIN_ITEMS before or after the grow there is no evidence and the grow stays.
TRIAL_ITEMS = 24
TRIAL_S = 4.0
TRIAL_MIN_ITEMS = 4
#: ... and at least this many seconds after the new setting's settling period (a move
#: to processes judged on its first 0.2 s, the switch itself included, was taken back
#: as "not paying" although it doubled the rate)
TRIAL_MIN_S = 0.5
#: Seconds a stage whose grow did not pay is not grown again, doubled with each such
#: grow in a row (one that pays starts the count again), at most HOLD_MAX_S: a stage
#: whose grows never pay is tried less and less often, not every 5 s for ever.
HOLD_S = 5.0
#: Most workers of a process stage (a region token's owner field).
MAX_PROCESS_WORKERS = 127
#: An adaptive stage moved to processes gets this many workers at once (at most what the
#: CPU budget leaves it): one process worker alone rarely beats the inline run it replaces.
MOVE_WORKERS = 2
#: Periods in a row an inline adaptive stage must look like the bottleneck before it is
#: moved (its periods count from the start of the run) ...
MOVE_PERIODS = 1
#: ... and before it is moved past its cap because its units wait (a wide move starts
#: many processes at once: one period of evidence, start-up included, is not enough).
WIDE_PERIODS = 2
#: No move to processes unless the stage's work left in the run, at its inline cost per
#: sample, would take at least this long: starting two workers costs about half a second
#: of two cores (spawn, imports), which a shorter rest of the run cannot win back (a run
#: that goes on for ever always has enough left).
MOVE_PAYBACK_S = 1.0
#: An inline stage is moved only while its op costs at least this many seconds per
#: input sample (the dispatch's estimate, op time less the waits for a CPU): below it,
#: the messages and copies between processes cost more than a worker could take off
#: the engine's thread (100k ints with a map(+1) ran 5x slower on processes) ...
MOVE_MIN_SAMPLE_S = 1e-4
#: ... and at least this many seconds per output byte: an op as cheap per byte as moving
#: the byte between processes gains nothing from them (1 MiB arrays made and scaled at
#: under 1 ns a byte ran 2.5x slower on processes).
MOVE_MIN_BYTE_S = 2e-9
#: A move that did not pay holds that stage's next move of the same kind HOLD_S seconds,
#: doubled with each such failure in a row, at most HOLD_MAX_S.
HOLD_MAX_S = 40.0
#: A worker not started yet counts, against the memory budget, as large as the largest
#: running one, else as this process up to this many bytes.
NEW_WORKER_BYTES = 256 << 20
#: The decisions and judged trials a controller keeps (its latest ones; ``decided``
#: counts them all): a run of days makes many, and each is kept for stats and explain.
KEEP_DECISIONS = 1000


def _trim(kept: list) -> None:
    """Keep the latest KEEP_DECISIONS of ``kept`` (a decision comes at most once a
    period: moving a thousand references then costs nothing)."""
    if len(kept) > KEEP_DECISIONS:
        del kept[:len(kept) - KEEP_DECISIONS]


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


class StageMeter:
    """The op seconds a stage's workers reported since the last read (written by worker
    threads or the engine's thread, read by the engine's thread), and the CPU an inline
    stage's units asked for meanwhile (the inline executor's ``demand_s``; a process
    stage's CPU is read from its workers' ``/proc`` entries instead)."""

    __slots__ = ("_lock", "busy", "demand")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.busy = 0.0
        self.demand: float | None = None  # None: nothing reported it

    def ran(self, seconds: float, demand: float | None = None) -> None:
        with self._lock:
            self.busy += seconds
            if demand is not None:
                self.demand = (self.demand or 0.0) + demand

    def take(self) -> tuple[float, float | None]:
        """``(op seconds, CPU demand seconds or None)`` since the last take."""
        with self._lock:
            busy, demand, self.busy, self.demand = self.busy, self.demand, 0.0, None
        return busy, demand


class _Signals(NamedTuple):
    workers: dict[int, int]
    busy: dict[int, float]  # busy fraction, 0..1
    wait: float  # the consumer's waiting fraction, 0..1
    #: CPU fraction per worker, 0..1 (process stages; a stage absent: CPU-bound)
    cpu: Mapping[int, float] = MappingProxyType({})
    rate: float = 0.0  # items handed on per second
    #: resident bytes of each process worker (in service, booting or parked) per stage
    #: that has any, at the period's end (``/proc/<pid>/statm``)
    rss: Mapping[int, tuple[int, ...]] = MappingProxyType({})


def judge(before: float, after: float) -> bool:
    """Whether a grow paid: the throughput ``after`` it is at least TRIAL_GAIN above
    ``before``."""
    return after >= before * (1.0 + TRIAL_GAIN)


def judge_inline(before: float, after: float) -> bool:
    """Whether a move back inline is kept: the throughput ``after`` it is at most
    TRIAL_GAIN below ``before`` (inline costs no process and no memory: it may be a
    little slower and still win)."""
    return after * (1.0 + TRIAL_GAIN) >= before


def _worth_moving(ex: Any) -> bool:
    """Whether an inline stage's samples cost enough for processes to pay (see
    MOVE_MIN_SAMPLE_S, MOVE_MIN_BYTE_S); unknown costs (no profile yet): not yet."""
    profile = getattr(ex, "profile", None)
    if profile is None or profile[0] is None:
        return False
    per_sample_s, per_sample_bytes = profile
    if per_sample_s < MOVE_MIN_SAMPLE_S:
        return False
    return not per_sample_bytes or per_sample_s / per_sample_bytes >= MOVE_MIN_BYTE_S


def _pays(spent: float, progress: tuple[int, int] | None) -> bool:
    """Whether the stage's work left in the run (``progress``: the source samples read and
    left, None: for ever), at the op seconds it ``spent`` so far per source sample read
    (not per sample it made: a filter in or before it would inflate that), would take at
    least MOVE_PAYBACK_S, long enough for a move to processes to win its boot back."""
    if progress is None:
        return True
    read, left = progress
    return read > 0 and spent / read * left >= MOVE_PAYBACK_S


def _held(until: dict[int, float], stage: int, now: float) -> bool:
    return until.get(stage, 0.0) > now


def choose(sig: _Signals, caps: dict[int, int], budget: int, idle: dict[int, int],
           memory_ok: Callable[..., bool], waiting_caps: dict[int, int] | None = None
           ) -> tuple[int, int, str] | None:
    """The decision of one period: ``(stage, workers more (> 0) or -1, reason)`` or
    None; ``memory_ok(stage, n=1)``: whether ``n`` more workers fit. ``idle`` (the
    consecutive periods each stage could have lost a worker) is updated here;
    ``waiting_caps``: the caps of the stages that may grow past the budget while their
    workers wait (process stages; default: none)."""
    total = sum(sig.workers.values())
    for s, w in sig.workers.items():
        spare = w > 1 and sig.busy[s] * w / (w - 1) < BUSY_SHRINK
        idle[s] = idle.get(s, 0) + 1 if spare else 0
    if sig.wait >= WAIT_GROW:
        grow = _grow(sig, caps, budget, total, memory_ok, waiting_caps or {})
        if grow is not None:
            return grow
    for s in sorted(sig.workers, key=lambda x: sig.busy[x]):
        if idle[s] >= SHRINK_PERIODS:
            idle[s] = 0
            return s, -1, (f"busy {sig.busy[s]:.0%} with {sig.workers[s]} for "
                           f"{SHRINK_PERIODS} periods")
    return None


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def take_back(rss: Mapping[int, tuple[int, ...]], budget: int, counts: Mapping[int, int],
              floors: Mapping[int, int]) -> tuple[int, int, str] | None:
    """The memory budget's decision of one period: None while the process workers'
    resident bytes (``rss``: per stage, each worker's) add up to at most ``budget``; else
    ``(stage, workers after, reason)``: the stage holding the most that has workers above
    its floor (``counts``: its workers now; ``floors``: the fewest it may keep, 0 for an
    adaptive stage: inline) gives back the fewest after which the total is within the
    budget whichever of its workers go (its smallest ones are counted: the executor picks
    which), down to its floor at most. A stage running inline (count 0) that still has
    workers (a pool parked, or being stopped) comes first: ``(stage, 0, reason)``, its pool
    is to be stopped. ``workers after`` equals ``counts[stage]`` (> 0) when no stage has
    a worker left to give back (the reason says so: nothing to do)."""
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
    s = max(rss, key=lambda x: (sum(rss[x]), -x))  # (a stable text: held, logged once)
    return s, counts.get(s, 0), (f"memory budget {_mib(budget)} passed, stage {s} holding "
                                 f"the most: no worker left to take back (raise "
                                 f"autotune_memory_bytes, or keep less in the op's workers)")


def _waiting(sig: _Signals, s: int) -> bool:
    return s in sig.cpu and sig.cpu[s] < WAITING_CPU * sig.busy[s]


def _grow(sig: _Signals, caps: dict[int, int], budget: int, total: int,
          memory_ok: Callable[..., bool], waiting_caps: dict[int, int]
          ) -> tuple[int, int, str] | None:
    def cap(x: int) -> int:
        return max(caps[x], waiting_caps.get(x, 0)) if _waiting(sig, x) else caps[x]

    open_ = [s for s in sig.workers if sig.workers[s] < cap(s) and sig.busy[s] >= BUSY_GROW]
    if not open_:
        return None
    s = max(open_, key=lambda x: (sig.busy[x], -x))
    why = f"the consumer waited {sig.wait:.0%}, stage {s} busy {sig.busy[s]:.0%}"
    if total < budget and sig.workers[s] < caps[s]:
        if memory_ok(s):
            return s, +1, why
        return None
    if _waiting(sig, s):
        used = sum(sig.workers[x] * sig.cpu.get(x, 1.0) for x in sig.workers)
        if used + sig.cpu[s] <= budget:
            # doubling: a stage waiting on storage may want tens of workers, which one
            # at a time (a boot and a trial each) would take a minute to reach
            spare_cpu = budget - used
            room = int(spare_cpu / sig.cpu[s]) if sig.cpu[s] > 0 else sig.workers[s]
            k = max(1, min(sig.workers[s], cap(s) - sig.workers[s], room))
            while k > 1 and not memory_ok(s, k):
                k //= 2
            if k > 1 or memory_ok(s):
                return s, +k, (f"{why}, its workers use {sig.cpu[s]:.0%} of a core each "
                               f"(all: {used:.1f} of {budget}): past the CPU budget")
            return None
    donors = [d for d in sig.workers if d != s and sig.workers[d] > 1
              and sig.busy[d] * sig.workers[d] / (sig.workers[d] - 1) < BUSY_GROW]
    if donors:
        d = min(donors, key=lambda x: (sig.busy[x], x))
        return d, -1, f"CPU budget {budget} full: gives a worker to stage {s} ({why})"
    return None


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


class Controller:
    """The controller of one run (see the module docstring).

    Args:
        executors: stage index -> executor (only threads and process ones are tuned).
        cpu_budget: workers in all, over the tuned stages.
        memory_bytes: resident bytes the process workers may use together.
        period: seconds between decisions.
        clock: the time source (seconds).
    """

    def __init__(self, executors: dict[int, Any], cpu_budget: int, memory_bytes: int, *,
                 period: float = PERIOD_S, clock: Callable[[], float] = time.monotonic,
                 progress: Callable[[], tuple[int, int] | None] | None = None,
                 start: Mapping[int, tuple[int, float | None]] | None = None) -> None:
        #: ``(source samples read, source samples left)`` in the run, None: for ever (no
        #: call either); the engine counts them (see MOVE_PAYBACK_S)
        self.progress = progress
        #: op seconds each stage reported since the start (the payback's cost per sample)
        self.spent: dict[int, float] = {}
        #: the adaptive stages (inline until moved to processes, see the rule)
        self.adaptive = {s for s, ex in executors.items() if getattr(ex, "adaptive", False)}
        self.executors = {s: ex for s, ex in executors.items()
                          if ex.runner != "inline" or s in self.adaptive}
        #: (at least one worker per stage pinned to workers; an adaptive stage inline
        #: holds none)
        self.cpu_budget = max(cpu_budget, len(self.executors) - len(self.adaptive), 1)
        self.memory_bytes, self.period, self.clock = memory_bytes, period, clock
        self.meters = {s: StageMeter() for s in self.executors}
        procs = {s for s, ex in self.executors.items()
                 if ex.runner == "process" or s in self.adaptive}
        self._procs = procs
        #: each stage's cap when every other stage holds one worker (an inline stage
        #: holds none: the caps of the moment, _caps_now, are larger then)
        most = max(1, self.cpu_budget - (len(self.executors) - 1))
        self.caps = {s: min(most, MAX_PROCESS_WORKERS) if s in procs else most
                     for s in self.executors}
        #: a process stage's cap while its workers wait (see the rule)
        self.waiting_caps = {s: min(WAITING_FACTOR * self.cpu_budget, MAX_PROCESS_WORKERS)
                             for s in procs}
        pinned = len(self.executors) - len(self.adaptive)
        for s, ex in self.executors.items():
            ex.meter = self.meters[s]
            others = pinned - (s not in self.adaptive)  # adaptive ones may all be inline
            top = self.cpu_budget - others
            ex.max_workers = max(min(top, MAX_PROCESS_WORKERS) if s in procs else top,
                                 self.waiting_caps.get(s, 0))
        #: the latest KEEP_DECISIONS decisions, oldest first; ``decided``: all of them
        self.decisions: list[Decision] = []
        self.decided = 0
        self.held = ""  # why the last wanted grow did not happen (shown once per cause)
        self._idle: dict[int, int] = {}
        self._wait_lock = threading.Lock()
        self._waited = 0.0
        self.started = self.clock()
        self._since = self.started
        self.last: _Signals | None = None
        self._final: dict[int, int] | None = None
        self._items = 0  # ticks (items handed on) since the period started
        #: ticks since the current setting started (the last resize, a worker ready)
        self._run_items, self._run_since = 0, self.started
        self._cpu_seen: dict[int, float] = {}  # pid -> CPU seconds at the period start
        #: the change on trial: (kind, stage, throughput before it, the items that rate is
        #: of, the workers before it); kind "grow", "process" (a move to processes) or
        #: "inline" (a move back inline)
        self._trial: tuple[str, int, float, int, int] | None = None
        self._settled = True  # the setting on trial has had its settling period
        self._booted = False  # workers were booting at the last period's end
        self._held_until: dict[int, float] = {}  # stage -> no grow before this time
        #: adaptive stages: no move to processes (back inline) before this time, and the
        #: failed moves in a row of each kind (the hold doubles with each)
        self._held_in: dict[int, float] = {}
        self._held_out: dict[int, float] = {}
        self._fails_in: dict[int, int] = {}
        self._fails_out: dict[int, int] = {}
        self._fails_grow: dict[int, int] = {}  # grows in a row that did not pay
        #: the latest judged trials (KEEP_DECISIONS): (kind, stage, kept), kind "grow",
        #: "process" or "inline"
        self.trials: list[tuple[str, int, bool]] = []
        self._ripe: dict[int, int] = {}  # periods in a row an inline stage was the bottleneck
        #: over those periods, the most CPU its units asked per second of op time, while
        #: every one of them read as waiting (else None: a CPU-bound move)
        self._asked: dict[int, float | None] = {}
        #: process stages past their cap because their workers waited (a waiting grow or
        #: a wide move), and the periods in a row each one's workers did not read as
        #: waiting (the rule's *back within the budget*)
        self._wide: dict[int, int] = {}
        self._spare: dict[int, int] = {}  # periods in a row a moved stage's work fit inline
        #: a test sets it: no decision of its own (moves only by :meth:`force` and
        #: :attr:`script`)
        self.frozen = False
        #: a test's hook: tick (items handed on since the start) -> ``(stage, workers,
        #: wait)``, forced (:meth:`force`) in the engine's thread at that tick
        self.script: dict[int, tuple[int, int, bool]] = {}
        self.ticks = 0
        #: the stages the rule (or a test) decided about in this run: the others resume
        #: where ``start`` had them (see :meth:`resume_point`)
        self._decided: set[int] = set()
        self._carried = dict(start or {})
        self._resume: dict[int, tuple[int, float | None]] | None = None  # set by close()
        if start:
            self._warm(start)
            self._decided.clear()  # (a warm move is the carried setting, not a decision)

    def _warm(self, start: Mapping[int, tuple[int, float | None]]) -> None:
        """Start where the pipeline's previous run ended (``start``: stage -> (its workers
        then, 0: inline; the op seconds it spent per source sample read, None: unknown), from
        that run's :meth:`resume_point`): an adaptive stage is moved there at once (its
        workers boot while its units run inline), a stage on workers grown to it, each
        within the most its executor may have, and only while the work left in this run,
        at that cost, pays the boot (MOVE_PAYBACK_S: a short tail after a restore is not
        worth starting processes for). Not on trial (there is no setting before it to
        compare with: the previous run judged it; a change still on trial when it ended
        left the setting before it); the rule goes on from there, a stage past its cap
        included (it went there because its workers waited)."""
        now = self.clock()
        progress = self.progress() if self.progress is not None else None
        for s, (n, cost) in sorted(start.items()):
            ex = self.executors.get(s)
            if ex is None or n <= self._count(s):
                continue
            if cost is not None and progress is not None and cost * progress[1] < MOVE_PAYBACK_S:
                continue
            n = min(n, ex.max_workers)
            why = "where the previous run of this pipeline ended"
            if s in self.adaptive:
                n = self._fitting(s, n)
                done = n >= 1 and self._switch(now, s, n, why)
            else:
                done = self._resize(now, s, n - ex.workers, why)
            if done and n > self.caps[s]:
                self._wide[s] = 0

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
        trial = self._trial
        progress = self.progress() if self.progress is not None else None
        read = progress[0] if progress else 0
        out = {}
        for s, ex in self.executors.items():
            carried = self._carried.get(s)
            spent = self.spent.get(s, 0.0)
            cost = spent / read if read and spent else (carried[1] if carried else None)
            if s not in self._decided and carried is not None:
                out[s] = (min(carried[0], ex.max_workers), cost)
            elif trial is not None and trial[1] == s:
                out[s] = (trial[4], cost)
            else:
                target = getattr(ex, "moving_to", None)
                out[s] = (target if target else self._count(s), cost)
        return out

    # -- signals ---------------------------------------------------------------------------
    def waited(self, seconds: float) -> None:
        """The consumer waited ``seconds`` in one ``next()`` (any thread)."""
        with self._wait_lock:
            self._waited += seconds

    def _restart_period(self, now: float) -> None:
        for s, meter in self.meters.items():
            self.spent[s] = self.spent.get(s, 0.0) + meter.take()[0]
        with self._wait_lock:
            self._waited = 0.0
        self._since = now
        self._items = 0
        self._cpu_take()

    def _cpu_take(self) -> dict[int, float]:
        """CPU seconds each process stage's workers used since the last call (a worker
        new since then counts from now)."""
        out: dict[int, float] = {}
        seen: dict[int, float] = {}
        for s, ex in self.executors.items():
            if s not in self._procs:  # process stages, and adaptive ones (a pool or none)
                continue
            used = 0.0
            for pid in ex.pids():
                now = _cpu_demand(pid)
                seen[pid] = now
                used += max(0.0, now - self._cpu_seen.get(pid, now))
            out[s] = used
        self._cpu_seen = seen
        return out

    def _sample(self, elapsed: float) -> _Signals:
        workers = {s: ex.workers for s, ex in self.executors.items()}
        taken = {s: self.meters[s].take() for s in self.executors}
        for s, (seconds, _) in taken.items():
            self.spent[s] = self.spent.get(s, 0.0) + seconds
        busy = {s: min(1.0, taken[s][0] / (workers[s] * elapsed)) for s in self.executors}
        cpu = {s: min(1.0, used / (workers[s] * elapsed))
               for s, used in self._cpu_take().items()}
        for s in self.adaptive:  # inline: what its units asked of the CPU (one "worker")
            if self.executors[s].runner == "inline":
                demand = taken[s][1]
                if demand is None:  # not reported: CPU-bound, as a thread stage
                    cpu.pop(s, None)
                else:
                    cpu[s] = min(1.0, demand / elapsed)
        with self._wait_lock:
            wait, self._waited = self._waited, 0.0
        rate, self._items = self._items / elapsed, 0
        return _Signals(workers, busy, min(1.0, wait / elapsed), cpu, rate, self._resident())

    def _resident(self) -> dict[int, tuple[int, ...]]:
        """The memory signal, read now: per stage with process workers (in service,
        booting or parked), the resident bytes of each (``/proc/<pid>/statm``)."""
        out = {}
        for s in self._procs:
            pids = self.executors[s].pids()
            if pids:
                out[s] = tuple(_rss(pid) for pid in pids)
        return out

    def _memory_ok(self, stage: int, n: int = 1, size: int | None = None,
                   rss: Mapping[int, tuple[int, ...]] | None = None) -> bool:
        """Whether ``n`` more workers of ``stage`` (each as large as its largest, or
        ``size`` bytes: a stage with no worker yet to measure) fit in the memory budget
        beside the workers' resident bytes (``rss``: the period's signal; None: read now)."""
        ex = self.executors[stage]
        if ex.runner != "process" and size is None:
            return True
        rss = self._resident() if rss is None else rss
        if size is None:
            size = max(rss.get(stage, ()), default=0)
        need = sum(sum(sizes) for sizes in rss.values()) + n * size
        if need <= self.memory_bytes:
            return True
        self._hold(f"memory budget: {need >> 20} MiB with {n} more worker(s) of stage "
                   f"{stage} > {self.memory_bytes >> 20} MiB")
        return False

    def _new_worker_size(self) -> int:
        """The resident bytes a worker not started yet is counted at: the largest process
        worker running (any stage), else this process's, at most NEW_WORKER_BYTES (a
        spawned worker imports the ops' modules, not the training script's model and
        data). 0: unknown (no /proc)."""
        sizes = [size for each in self._resident().values() for size in each]
        return max(sizes, default=0) or min(_rss(os.getpid()), NEW_WORKER_BYTES)

    def _fitting(self, stage: int, n: int) -> int:
        """The most of ``n`` new workers of adaptive ``stage`` that fit in the memory
        budget (0: none; the reason held)."""
        size = self._new_worker_size()
        while n >= 1 and not self._memory_ok(stage, n, size):
            n = n - 1 if n <= MOVE_WORKERS else n // 2
        return n

    def _hold(self, why: str) -> None:
        if why != self.held:
            self.held = why
            log.info("autotune: not growing: %s", why)

    # -- the loop --------------------------------------------------------------------------
    def tick(self) -> None:
        """Called by the engine per item: decide when a period has passed."""
        self._items += 1
        self._run_items += 1
        self.ticks += 1
        if self.script and self.ticks in self.script:
            self.force(*self.script.pop(self.ticks))
        now = self.clock()
        elapsed = now - self._since
        if elapsed < self.period or not self.executors:
            return
        self._fallen(now)
        if any(ex.booting for ex in self.executors.values()):
            self._restart_period(now)  # judge the new setting on a full period of it
            self._run_items, self._run_since = 0, now
            self._booted = True
            return
        if self._booted:  # ready at some point of this period: from now on it counts
            self._booted = False
            self._restart_period(now)
            self._run_items, self._run_since = 0, now
            return
        sig = self._sample(elapsed)
        self.last = sig
        self._since = now
        if self.frozen:
            return
        if self._within_memory(sig, now):
            return
        if self._trial is not None:
            if not self._settled:  # the new setting's first period: not its evidence
                self._settled = True
                self._run_items, self._run_since = 0, now
                return
            run = now - self._run_since
            if (self._run_items < TRIAL_ITEMS or run < TRIAL_MIN_S) and run < TRIAL_S:
                return  # too little evidence yet to judge the change on trial
            if self._judge(now, run):
                return
        if not self._moves(sig, now):
            self._tune(sig, now)

    def _within_memory(self, sig: _Signals, now: float) -> bool:
        """The memory budget's decision (:func:`take_back` over the period's ``rss``), made
        before any other, a trial's judgement included: the workers it takes back are
        retired (all of an adaptive stage's: back inline, its pool stopped once its units
        are back; a pool parked by a move back inline is stopped), the change on trial, if
        any, is over (an inline one kept: its parked pool is stopped), and the stage is not
        grown (moved to processes) again for a hold, doubled as a failed grow (move)'s;
        True if a decision was made. With no worker left to take back, the reason is held
        (grows are refused meanwhile)."""
        verdict = take_back(sig.rss, self.memory_bytes,
                            {s: self._count(s) for s in sig.rss},
                            {s: 0 if s in self.adaptive else 1 for s in sig.rss})
        if verdict is None:
            return False
        stage, after, why = verdict
        before = self._count(stage)
        if after >= before > 0:
            self._hold(why)
            return False
        if before == 0:  # inline already: a parked pool, stopped now (not a decision)
            if self._trial is not None and self._trial[:2] == ("inline", stage):
                self._trial = None  # inline is kept
            self.executors[stage].release()
            return False
        trial, self._trial = self._trial, None
        if trial is not None and trial[0] == "inline":
            self.executors[trial[1]].release()  # kept inline: its parked pool is stopped
        if after == 0:
            hold = self._fail(self._fails_in, self._held_in, stage, now)
            done = self._switch(now, stage, 0, f"{why} (held {hold:g} s)")
            self.executors[stage].release()
            return done
        hold = self._fail(self._fails_grow, self._held_until, stage, now)
        return self._resize(now, stage, after - before, f"{why} (held {hold:g} s)")

    def _fallen(self, now: float) -> None:
        """Record the moves to processes an adaptive stage undid by itself (its workers
        did not start, or a sample of its input or output could not be pickled): it is
        inline for the rest of the run, and a trial of that move is over."""
        for s in self.adaptive:
            fallen = getattr(self.executors[s], "fallen", None)
            while fallen:
                workers, why = fallen.pop(0)
                if self._trial is not None and self._trial[1] == s:
                    self._trial = None
                self._record(now, s, workers, 0, f"inline for the rest of the run: {why}")

    def _tune(self, sig: _Signals, now: float) -> None:
        """The rule's decision of this period over the stages on workers (see the rule)."""
        inline = {s for s in self.adaptive if self.executors[s].runner == "inline"}
        tuned = [s for s in self.executors if s not in inline]
        if not tuned:
            return
        sub = _Signals({s: sig.workers[s] for s in tuned}, {s: sig.busy[s] for s in tuned},
                       sig.wait, {s: c for s, c in sig.cpu.items() if s in tuned}, sig.rate,
                       sig.rss)
        now_caps = self._caps_now(inline)
        if self._back_within(sub, now_caps, now):
            return
        caps = {s: (self.executors[s].workers if _held(self._held_until, s, now) else c)
                for s, c in now_caps.items() if s in sub.workers}
        waiting = {s: (self.executors[s].workers if _held(self._held_until, s, now) else c)
                   for s, c in self.waiting_caps.items() if s in sub.workers}
        def memory_ok(stage: int, n: int = 1) -> bool:  # over the period's signal
            return self._memory_ok(stage, n, rss=sig.rss)

        choice = choose(sub, caps, self.cpu_budget, self._idle, memory_ok, waiting)
        if choice is None:
            return
        stage, delta, reason = choice
        before = self._before(stage, now)
        if self._resize(now, stage, delta, reason) and delta > 0:
            self._trial = ("grow", *before)
            if self.executors[stage].workers > now_caps[stage]:
                self._wide.setdefault(stage, 0)  # past its cap: it waits (see _grow)

    def _back_within(self, sig: _Signals, caps: dict[int, int], now: float) -> bool:
        """A stage that went past its cap because its workers waited, whose workers have
        not read as waiting for SHRINK_PERIODS periods in a row (busy, asking a core), is
        cut to its cap and not grown for HOLD_S (the rule's *back within the budget*);
        True if one was."""
        for s in list(self._wide):
            if s not in sig.workers or sig.workers[s] <= caps[s]:
                del self._wide[s]
                continue
            cpu_bound = s in sig.cpu and sig.busy[s] >= BUSY_SHRINK and not _waiting(sig, s)
            self._wide[s] = self._wide[s] + 1 if cpu_bound else 0
            if self._wide[s] >= SHRINK_PERIODS:
                del self._wide[s]
                self._held_until[s] = now + HOLD_S
                return self._resize(now, s, caps[s] - sig.workers[s],
                                    f"its workers ask {sig.cpu[s]:.0%} of a core each, busy "
                                    f"{sig.busy[s]:.0%}, for {SHRINK_PERIODS} periods: not "
                                    f"waiting, back within the CPU budget (held {HOLD_S:g} s)")
        return False

    def _before(self, stage: int, now: float) -> tuple[int, float, int, int]:
        """``(stage, throughput of the setting now, the items that is of, its workers)``."""
        run = max(now - self._run_since, 1e-9)
        return stage, self._run_items / run, self._run_items, self._count(stage)

    def _count(self, stage: int) -> int:
        """The stage's workers now; 0 for an adaptive stage running inline."""
        ex = self.executors[stage]
        return 0 if stage in self.adaptive and ex.runner == "inline" else ex.workers

    def _caps_now(self, inline: set[int]) -> dict[int, int]:
        """Each stage's cap now: the budget less one worker per other stage that is not
        inline."""
        out = {}
        for s in self.executors:
            others = sum(1 for t in self.executors if t != s and t not in inline)
            most = max(1, self.cpu_budget - others)
            out[s] = min(most, MAX_PROCESS_WORKERS) if s in self._procs else most
        return out

    def _judge(self, now: float, run: float) -> bool:
        """Judge the change on trial; True if it was undone (nothing else this period)."""
        assert self._trial is not None
        kind, stage, before_rate, before_items, back = self._trial
        self._trial = None
        ex = self.executors[stage]
        after_rate = self._run_items / run
        evidence = min(before_items, self._run_items) >= TRIAL_MIN_ITEMS
        rates = f"{after_rate:.2f} items/s after it, {before_rate:.2f} before"
        kept = not evidence or (judge_inline if kind == "inline" else judge)(
            before_rate, after_rate)
        if kind != "process" or ex.runner != "inline":  # (a move that failed to start)
            self.trials.append((kind, stage, kept))
            _trim(self.trials)
        if kind == "grow":
            if evidence and not judge(before_rate, after_rate):
                hold = self._fail(self._fails_grow, self._held_until, stage, now)
                self._resize(now, stage, min(-1, back - ex.workers),
                             f"the grow did not pay: {rates} (held {hold:g} s)")
                return True
            self._fails_grow[stage] = 0
            return False
        if kind == "process":
            if ex.runner == "inline":  # the move failed (the pool did not start)
                return False
            if evidence and not judge(before_rate, after_rate):
                hold = self._fail(self._fails_in, self._held_in, stage, now)
                self._switch(now, stage, 0, f"the move to processes did not pay: {rates} "
                             f"(held {hold:g} s)")
                ex.release()  # its pool is stopped once its units are back
                return True
            self._fails_in[stage] = 0
            return False
        if evidence and not judge_inline(before_rate, after_rate):  # kind == "inline"
            hold = self._fail(self._fails_out, self._held_out, stage, now)
            self._switch(now, stage, back, f"inline was slower: {rates} (held {hold:g} s)")
            return True
        self._fails_out[stage] = 0
        ex.release()  # inline it stays: its pool is stopped
        return False

    @staticmethod
    def _fail(fails: dict[int, int], until: dict[int, float], stage: int, now: float) -> float:
        fails[stage] = fails.get(stage, 0) + 1
        hold = min(HOLD_S * 2 ** (fails[stage] - 1), HOLD_MAX_S)
        until[stage] = now + hold
        return hold

    def _moves(self, sig: _Signals, now: float) -> bool:
        """The moves of the adaptive stages (see the rule); True if one was made."""
        if not self.adaptive:
            return False
        inline = {s for s in self.adaptive if self.executors[s].runner == "inline"}
        progress = self.progress() if self.progress is not None else None
        for s in self.adaptive:
            ex = self.executors[s]
            if s in inline:
                hot = sig.wait >= WAIT_GROW and sig.busy[s] >= BUSY_GROW and not ex.unable \
                    and not _held(self._held_in, s, now) and _worth_moving(ex) \
                    and _pays(self.spent.get(s, 0.0), progress)
                self._ripe[s] = self._ripe.get(s, 0) + 1 if hot else 0
                self._streak(sig, s, hot)
                self._spare[s] = 0
            else:
                cool = sig.busy[s] * sig.workers[s] < BUSY_SHRINK and \
                    not _held(self._held_out, s, now)
                self._spare[s] = self._spare.get(s, 0) + 1 if cool else 0
                self._ripe[s] = 0
        # a streak that waited in every period so far moves wide, on more evidence
        ripe = [s for s in inline if self._ripe[s] >= MOVE_PERIODS and
                (self._asked.get(s) is None or self._ripe[s] >= WIDE_PERIODS)]
        if ripe:
            s = max(ripe, key=lambda x: (sig.busy[x], -x))
            taken = sum(sig.workers[t] for t in self.executors if t not in inline)
            n = min(MOVE_WORKERS, self.cpu_budget - taken, MAX_PROCESS_WORKERS)
            why = ""
            asked = self._asked.pop(s, None)
            if asked is not None:  # waiting in every period of its streak
                n, why = self._waiting_width(sig, s, inline, n, asked)
            cpu_room = n >= 1
            n = self._fitting(s, n)  # (none: the memory budget's hold says why)
            if n >= 1:
                self._ripe[s] = 0
                before = self._before(s, now)
                if self._switch(now, s, n, f"the consumer waited {sig.wait:.0%}, stage {s} "
                                f"busy {sig.busy[s]:.0%} inline{why}: trying processes"):
                    self._trial = ("process", *before)
                    if n > self._caps_now(inline - {s})[s]:
                        self._wide[s] = 0
                return True
            if not cpu_room:
                self._hold(f"CPU budget {self.cpu_budget} full: stage {s} stays inline")
        spare = [s for s in self.adaptive if s not in inline and
                 self._spare[s] >= SHRINK_PERIODS]
        if spare:
            s = min(spare, key=lambda x: (sig.busy[x] * sig.workers[x], x))
            cores = sig.busy[s] * sig.workers[s]
            self._spare[s] = 0
            before = self._before(s, now)
            if self._switch(now, s, 0, f"its workers used {cores:.2f} core(s) for "
                            f"{SHRINK_PERIODS} periods: trying inline"):
                self._trial = ("inline", *before)
            return True
        return False

    def _streak(self, sig: _Signals, s: int, hot: bool) -> None:
        """Keep, over the periods in a row inline stage ``s`` was hot, the most CPU its
        units asked per second of op time; None once one of them did not read as
        waiting (or had no reading)."""
        asked = sig.cpu[s] / sig.busy[s] if _waiting(sig, s) else None
        if not hot:
            self._asked.pop(s, None)
        elif self._ripe[s] == 1:
            self._asked[s] = asked
        else:
            before = self._asked.get(s)
            self._asked[s] = None if asked is None or before is None else max(before, asked)

    def _waiting_width(self, sig: _Signals, s: int, inline: set[int], n: int,
                       asked: float) -> tuple[int, str]:
        """The workers a move to processes starts for inline stage ``s`` whose units asked
        the CPU for ``asked`` (< WAITING_CPU) of each second they ran, the most of the
        periods that made it ripe (they wait on storage or the network): as many as the
        CPU the other stages are measured to use leaves can feed at that demand (a worker
        busy all the time asks ``asked`` of a core), at most its waiting cap and at least
        ``n`` (what a CPU-bound stage gets), halved while that many workers as large as
        this process would not fit in the memory budget (no worker exists yet to
        measure; no reading of its size: no more than ``n``). Starting them together costs
        one boot instead of one boot and one trial per doubling."""
        used = sum(sig.workers[t] * sig.cpu.get(t, 1.0) for t in self.executors
                   if t not in inline)
        spare_cpu = self.cpu_budget - used
        k = min(int(spare_cpu / max(asked, 1e-3)), self.waiting_caps.get(s, n))
        size = self._new_worker_size()
        if k <= max(n, 0) or size == 0:
            return n, ""
        while k > n and not self._memory_ok(s, k, size):
            k //= 2
        k = max(k, n)
        return k, f", its units asking {asked:.0%} of a core: {k} workers"

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
        if done and workers == 0:
            self.executors[stage].release()
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

    def _record(self, now: float, stage: int, before: int, after: int, reason: str) -> None:
        self._decided.add(stage)
        decision = Decision(round(now - self.started, 3), stage, before, after, reason)
        self.decisions.append(decision)
        self.decided += 1
        _trim(self.decisions)
        self._settled = False
        self.held = ""
        log.info("autotune: %s", decision.text())
        self._restart_period(self.clock())
        self._run_items, self._run_since = 0, self._since

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
        """Detach from the executors (they are closed with the engine); what was decided
        stays readable."""
        if self._final is None:
            self._fallen(self.clock())  # (one the run ended before a period did)
            self._resume = self.resume_point()
            self._final = self.counts()
        for ex in self.executors.values():
            ex.meter = None
        self.executors = {}
