"""The stage-executor contract: what the engine, the dispatch, the run statistics and
the autotune controller may assume of the object that runs a parallel stage's units.

Every executor (:mod:`zephon.runners.executors`) implements :class:`StageExecutor`;
the adaptive one (inline until the autotune controller moves it to process workers,
and back) implements :class:`MovableExecutor` as well. Callers use these attributes
and methods and nothing else: no ``getattr`` probing, no ``isinstance`` on a
concrete class to find out what an executor can do (``tests/test_layers.py``
forbids ``getattr`` on an executor in the pipeline).

**Lifecycle.** An executor is made by the engine for one pass over the stream,
with its :class:`StageMeter`; ``submit`` and ``get`` are called from the engine's
thread only (so a resize never races a submit); ``close`` may come from any thread,
more than once, and never waits for an op (a unit in flight is abandoned; a ``get``
blocked meanwhile raises :class:`~zephon.errors.TransportError`).

**Units.** ``submit(lane, seq, payload)`` starts ``program(payload)``;
``get(lane)`` blocks for *some* finished unit of that lane and returns
``(seq, result, busy_s)``: ``busy_s`` the op seconds the unit took where it ran,
less any wait for a CPU (None when unknown: a unit lost to a crash). A unit whose
program failed comes back as a :class:`~zephon.transport.failure.UnitFailure` in its
place; ordering is the engine's job (by ``seq``).

**One meter per stage.** The executor writes what its units cost to its
:class:`StageMeter` (in the engine's thread, as it takes each result) and nowhere
else; the statistics, the dispatch's sizing and the autotune controller all read
that one meter.
"""

from __future__ import annotations

import threading
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = ["MovableExecutor", "Runner", "StageExecutor", "StageMeter"]

#: where a stage's units run now
Runner = Literal["inline", "threads", "process", "ray"]


class StageMeter:
    """What one stage's units cost, recorded once as each result is taken and read by
    every observer: cumulative counters (readers keep their own last reading and take
    differences, so two readers never steal each other's counts), the dispatch's
    per-sample profile, and the worker events.

    - ``units``, ``op_s``: units recorded and their op seconds (wall, in the worker);
    - ``demand_s``: CPU seconds the units asked for (the process's CPU time while an
      inline unit ran plus the waits for a core meanwhile); ``demand_units`` counts the
      units that reported it (an executor that cannot measure it reports nothing);
    - ``parked_op_s``: op seconds of units that came back from a pool parked by a move
      back inline (counted in ``op_s`` too; the controller subtracts them: the stage's
      busy fraction is its inline units' from the move on);
    - ``profile``: ``(op seconds per input sample, output bytes per input sample)``, the
      dispatch's running estimate (None until known);
    - ``observer``: None, or the run statistics' recorder for this stage, called with
      each recording (``ran(op_s, blocked_s, nbytes)``: a process worker's seconds
      placing and sending the result and the bytes it placed, which only the
      statistics read, so the meter passes them on without keeping them) and each worker event
      (``event(kind, worker)``, kind ``"start"``, ``"stop"`` or ``"restart"``).
    """

    __slots__ = ("_lock", "demand_s", "demand_units", "observer", "op_s", "parked_op_s",
                 "profile", "units")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.units = self.demand_units = 0
        self.op_s = self.demand_s = self.parked_op_s = 0.0
        self.profile: tuple[float | None, float | None] | None = None
        self.observer: Any = None

    def ran(self, op_s: float, *, demand_s: float | None = None, blocked_s: float = 0.0,
            nbytes: int = 0, parked: bool = False) -> None:
        """Record one unit's cost."""
        with self._lock:
            self.units += 1
            self.op_s += op_s
            if demand_s is not None:
                self.demand_s += demand_s
                self.demand_units += 1
            if parked:
                self.parked_op_s += op_s
        observer = self.observer
        if observer is not None:
            observer.ran(op_s, blocked_s, nbytes)

    def event(self, kind: str, worker: int) -> None:
        """A worker of the stage started, stopped or was restarted after a crash."""
        observer = self.observer
        if observer is not None:
            observer.event(kind, worker)

    def reading(self) -> tuple[int, float, float, int, float]:
        """``(units, op_s, demand_s, demand_units, parked_op_s)`` now, consistently."""
        with self._lock:
            return (self.units, self.op_s, self.demand_s, self.demand_units,
                    self.parked_op_s)


@runtime_checkable
class StageExecutor(Protocol):
    """Runs one parallel stage's units (see the module docstring)."""

    #: the stage's name (its node in the statistics)
    name: str
    #: the stage's one meter
    meter: StageMeter

    @property
    def runner(self) -> Runner:
        """Where units run now (an adaptive stage: ``"inline"`` until moved)."""

    @property
    def adaptive(self) -> bool:
        """Whether this is a :class:`MovableExecutor`."""

    @property
    def workers(self) -> int:
        """Workers in service now (1 inline: the engine's thread)."""

    #: the CPUs of the pool its workers draw from when that is not this host's (a Ray
    #: stage: the cluster's CPUs when it started): the autotune controller gives such a
    #: stage a budget of its own; None: this host's CPUs, shared by the stages
    cpu_pool: int | None

    #: the most workers the executor may be grown to: the dispatch sizes its lane windows
    #: by it; the autotune controller lowers it to the stage's cap once it knows the
    #: budgets (an attribute the controller may set, nothing else)
    max_workers: int

    @property
    def booting(self) -> int:
        """Workers started and not ready yet."""

    def pids(self) -> list[int]:
        """Process ids of its worker processes (in service, booting or parked); empty
        where units run in this process."""

    def submit(self, lane: Any, seq: int, payload: Any) -> None:
        """Start ``program(payload)`` as unit ``seq`` of ``lane``."""

    def get(self, lane: Any) -> tuple[int, Any, float | None]:
        """Block for some finished unit of ``lane``: ``(seq, result, busy_s)``."""

    def grow(self) -> None:
        """One worker more (no-op where the count is fixed: inline)."""

    def shrink(self) -> None:
        """One worker fewer, never below one (no-op inline)."""

    def close(self) -> None:
        """Stop the workers; never waits for an op; idempotent."""


@runtime_checkable
class MovableExecutor(StageExecutor, Protocol):
    """An adaptive stage: inline until moved to process workers, and back."""

    #: why the stage cannot move to processes ("" while it can)
    unable: str
    #: moves undone by the stage itself: ``(workers it had or was booting, why)``; the
    #: controller takes (empties) and records them
    fallen: list[tuple[int, str]]

    @property
    def moving_to(self) -> int | None:
        """Workers of a move to processes still booting (None: no such move)."""

    def to_process(self, workers: int, wait: bool = False) -> None:
        """Move to ``workers`` process workers (see the implementation)."""

    def to_inline(self) -> None:
        """Run units inline from now on; the pool is parked."""

    def release(self) -> None:
        """Stop a parked pool once its units in flight are back."""
