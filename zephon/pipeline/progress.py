"""``Progress``: what a pipeline remembers of its runs, the one mutable part of a Pipeline.

A :class:`~zephon.pipeline.Pipeline` is an immutable definition and a
:class:`~zephon.pipeline.iterator.PipelineIterator` owns one run. Five things
outlive a run and belong to no single iterator, so they live here, and only here:

- **where the next run starts** (the rule of :mod:`zephon.pipeline.pipeline`: a
  new ``iter(pipe)`` continues after the last item the previous run delivered):
  ``latest``, the :class:`RunRecord` of the latest run, which that run's iterator
  writes as it delivers, or a record without a run that ``restore``/``set_epoch``
  placed while no run was going;
- **the live-run registry**: weak references to the pipeline's iterators, for
  ``pipe.close()`` and for the shortcuts that act on the latest run;
- **the multi-rank checkpoint round counter**: round ``n`` of the exchange is
  the ``n``-th ``checkpoint()`` of the pipeline, counted across its runs, so every
  rank numbers it alike (:mod:`zephon.checkpoint.aggregate`);
- **where autotune starts**: ``tuned``, per stage the workers (0: an adaptive stage
  inline) and the op seconds per source sample the latest run's autotune controller
  left it with (its resume point: a change still on trial counts as not made),
  written when that run closes; the next run's controller starts there
  (:mod:`zephon.pipeline.autotune`). Performance only: the stream never depends on it;
- **the kept workers**: ``keep``, the :class:`~zephon.pipeline.keep.WorkerKeep` where a
  run that completed its pass leaves its process workers for the next run
  (``RuntimeOptions.persistent_workers``); stopped by :meth:`Progress.close_runs`
  (``pipe.close()``), when the Progress is garbage collected, after the idle timeout,
  and at exit. Performance only, like ``tuned``.

A :class:`RunRecord` is a run's own state (delivered lane states, the epoch it
started at, whether it reached the end of its pass, its statistics, its MTP final
state): its iterator creates and writes it; Progress keeps a reference to the
latest one so that ``pipe.checkpoint()``, ``pipe.stats()`` and
``pipe.final_state`` still answer after the iterator is gone.

Progress knows a run only as a :class:`LiveRun` (its record, whether it is closed,
``close()``) and the callback the run handed it that restarts it at a start; it
imports nothing of the iterator, and the iterator registers itself
(:meth:`Progress.begin`) once its ops have passed their checks.

Invariants: a Pipeline holds exactly one Progress and nothing else that changes
after construction (its spec never changes, its plan is a derived value made once);
every builder method gives the new pipeline a fresh Progress (a new definition
starts at epoch 0); the registry holds runs and their restart callbacks weakly, so
dropping an iterator (a ``break`` out of a ``for`` loop) closes its run at once. A
Progress pickles as a fresh one: a definition can travel to another process, its
runs cannot.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol

from zephon.pipeline.keep import WorkerKeep
from zephon.pipeline.state import RunStart, local_state, settle

__all__ = ["LiveRun", "Progress", "RunRecord"]


class RunRecord:
    """One run's own state: the delivered lane states, the epoch the run started at,
    whether it reached the end of its pass, its statistics and its MTP final state.

    Its iterator creates and writes it; :class:`Progress` refers to the latest one.
    """

    __slots__ = ("autotune", "final_state", "finished", "mixture", "ray", "start_epoch",
                 "states", "stats")

    def __init__(self, start: RunStart | None = None) -> None:
        start = start if start is not None else RunStart({}, 0)
        self.states: dict[int, tuple] = dict(start.states)
        self.start_epoch = start.start_epoch
        #: the mixture weights a trainer set (``RunStart.mixture``): they hold on
        self.mixture: tuple = start.mixture
        self.finished = False  # the run reached the end of its pass
        self.final_state: bytes | None = None
        self.stats: Any = None  # the run's RunStats while it runs with tracking on
        self.autotune: Any = None  # the run's autotune Controller (zephon.pipeline.autotune)
        #: the run's Ray stages (zephon.runners.ray.RayExecutor): what explain() and the
        #: report say of their actors, nodes, units in flight and re-runs
        self.ray: list = []

    def start(self) -> RunStart:
        """Where the record's states say a run goes on."""
        return RunStart(dict(self.states), self.start_epoch, self.mixture)

    def stats_snapshot(self, report: bool = False) -> dict:
        """The run's counters as a dict (empty without tracking, or without a run);
        ``report``: the report-grade snapshot (:mod:`zephon.pipeline.stats`). Under
        ``worker_allocation="autotune"`` it has an ``"autotune"`` entry, tracking or not:
        the controller's budgets, worker counts and decisions; a report of a run with Ray
        stages a ``"ray"`` entry (stage -> its actors, nodes, units in flight, re-runs)."""
        snap = {} if self.stats is None else self.stats.snapshot(report)
        if self.ray and report:
            snap = {**snap, "ray": {ex.name: ex.describe() for ex in self.ray}}
        if self.autotune is not None:
            snap = {**snap, "autotune": self.autotune.snapshot()}
        return snap


class LiveRun(Protocol):
    """What :class:`Progress` reads of a run (a
    :class:`~zephon.pipeline.iterator.PipelineIterator`): its record, whether it is
    closed, and ``close()``."""

    record: RunRecord
    closed: bool

    def close(self) -> None: ...


class Progress:
    """Where a pipeline's next run starts, its live runs, and its checkpoint rounds (see
    the module docstring).

    Attributes:
        latest: the :class:`RunRecord` the next run continues from.
        rounds: the multi-rank checkpoint rounds taken so far.
        tuned: where the latest autotune run left its stages, or None.
        keep: the process workers kept for the next run (:mod:`zephon.pipeline.keep`).
    """

    __slots__ = ("__weakref__", "_latest_run", "_restart", "_runs", "keep", "latest",
                 "rounds", "tuned")

    def __init__(self) -> None:
        self.latest = RunRecord()
        self.rounds = 0
        #: stage -> (workers, op seconds per source sample) where the latest autotune run
        #: left it (None: no such run yet)
        self.tuned: dict[int, tuple[int, float | None]] | None = None
        self._runs: list[weakref.ref] = []  # the pipeline's runs, oldest first
        self._latest_run: weakref.ref | None = None  # the run writing ``latest``
        #: the callback that restarts the latest run (a bound method of it, held weakly)
        self._restart: weakref.WeakMethod | None = None
        #: the process workers a completed run left for the next one
        self.keep = WorkerKeep().bind(self)

    def __reduce__(self):
        return (Progress, ())

    def next_start(self, plan) -> RunStart:
        """Where a new run starts: the next pass after a complete pass (``plan`` says
        where a pass ends), else after the last item the latest run delivered (the next
        pass too when its states say every lane has ended: :func:`settle`)."""
        latest = self.latest
        if latest.finished:
            end = plan.pass_end(latest.start_epoch)
            return RunStart({}, latest.start_epoch if end is None else end, latest.mixture)
        return settle(latest.start(), plan)

    def begin(self, run: LiveRun, restart: Callable[[RunStart], None]) -> None:
        """Record ``run`` as the latest run: the next run continues from its record, and
        :meth:`move_to` restarts it with ``restart`` (a bound method of ``run``) while it
        is going. Both are held weakly."""
        self.latest = run.record
        self._latest_run = ref = weakref.ref(run)
        self._restart = weakref.WeakMethod(restart)
        self._runs = [r for r in self._runs if r() is not None] + [ref]

    def current(self) -> LiveRun | None:
        """The latest run, if it is still going."""
        run = self._latest_run() if self._latest_run is not None else None
        return run if run is not None and not run.closed else None

    def move_to(self, start: RunStart) -> None:
        """Restart the latest run at ``start`` if it is still going; else make the next
        run start there."""
        restart = self._restart() if self._restart is not None else None
        if self.current() is not None and restart is not None:
            restart(start)
            return
        self.latest, self._latest_run, self._restart = RunRecord(start), None, None

    def close_runs(self) -> None:
        """Close every run still going, and stop the workers kept for the next one."""
        runs, self._runs = self._runs, []
        try:
            for ref in runs:
                it = ref()
                if it is not None:
                    it.close()
        finally:
            self.keep.close()

    def exchange(self, plan, record: RunRecord,
                 states: dict[int, tuple] | None = None) -> bytes:
        """Checkpoint bytes of ``record`` (or of ``states`` in its run) under ``plan`` (its
        fingerprint and lanes): one round of the multi-rank exchange (a plain encoding
        with one rank)."""
        from zephon.checkpoint import exchange_state

        plan = plan.with_mixture(record.mixture)  # (the proof reads what the run reads)
        local = local_state(plan, record.states if states is None else states,
                            record.start_epoch, mixture=record.mixture)
        self.rounds += 1
        return exchange_state(local, plan.opts, self.rounds)
