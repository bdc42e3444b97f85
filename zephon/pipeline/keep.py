"""``WorkerKeep``: a pipeline's process workers kept between its runs (persistent workers).

Training iterates a pipeline once per epoch, and every ``iter(pipe)`` is a new run
with its own engine. Without a keep each run would spawn its process workers again (a
second or more per epoch when the ops import torch). With
``RuntimeOptions.persistent_workers`` (the default), a run that reaches the end of its
pass hands its idle process pools here instead of stopping them, and the pipeline's
next run takes them back: its first batch needs no spawn.

What it owns: the parked pools of one pipeline (anything with ``keepable()`` and
``close()``) (its :class:`~zephon.pipeline.progress.
Progress` holds the keep), each under a key that names what its workers run:

- a stage's :class:`~zephon.runners.ProcessExecutor`, under ``("stage", index)``;
- the MTP subprocess's end (:class:`~zephon.runners.mtp.MtpSource`), under ``("mtp",)``.

Each entry also records what it was made for (the options and the global generators
seeded per op); :meth:`take` gives it back only to a run made for an equal one, and the
run then checks that the pool's workers run its very program (``runs(program)``: the
program pickles to the bytes they were started with; an op or a source whose state the
user changed between epochs does not, and gets new workers), so a worker never runs a
program other than the run's. The keep holds no reference to the spec, the ops or the
program (a pool keeps only their bytes): a pipeline whose ops reference its owner (a
bound method of a trainer holding the pipeline) is still garbage collected.

Invariants:

- a parked pool is idle: nothing in flight, no result waiting (the run ended its pass);
  one that is not is stopped instead of parked;
- an entry is held by the keep or by a run, never both: :meth:`take` removes it;
- nothing outlives its pipeline: :meth:`close` stops every parked pool; it runs at
  ``pipe.close()``, when a run of the pipeline ends early (a break, an error: the
  workers of every run are stopped then), when the pipeline (its Progress) is garbage
  collected (a ``weakref.finalize``), after ``idle_s`` seconds with nothing taken (a
  daemon timer, holding the keep weakly), and, as for every pool, at interpreter exit
  (the transport closes live pools then);
- a pool parked by a run that began before the last :meth:`close` (``generation``) is
  stopped, not kept: a ``pipe.close()`` racing a run that is finishing its pass wins;
- a pool whose worker died while parked is stopped, not handed out.

Lifecycle: ``park`` (run end) -> ``take`` (next run's start) or timer/close -> stopped.
Thread-safe: the idle timer stops pools from its own thread, under the keep's lock.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Hashable

__all__ = ["WorkerKeep"]

log = logging.getLogger(__name__)


def _stop(pool: Any) -> None:
    try:
        pool.close()
    except Exception:  # stopping the rest matters more
        log.debug("closing a kept pool failed", exc_info=True)


def _close_if_alive(ref: "weakref.ref[WorkerKeep]") -> None:
    keep = ref()
    if keep is not None:
        keep.close()


class WorkerKeep:
    """The parked pools of one pipeline (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, tuple[Any, Any]] = {}  # key -> (pool, made_for)
        self._timer: threading.Timer | None = None
        #: counts the closes: a run parks only into the generation it began in
        self.generation = 0
        #: pools parked and taken back so far (what a test or a report can count)
        self.parked = self.reused = 0

    def bind(self, owner: Any) -> "WorkerKeep":
        """Stop every parked pool when ``owner`` (the pipeline's Progress) is garbage
        collected. Returns the keep."""
        weakref.finalize(owner, self.close)
        return self

    def __len__(self) -> int:
        return len(self._entries)

    def park(self, key: Hashable, pool: Any, made_for: Any, idle_s: float | None,
             generation: int) -> None:
        """Keep ``pool`` (idle) for the next run made for ``made_for``; every parked pool
        is stopped after ``idle_s`` seconds unless a run takes it (None: never). A pool
        of a run that began before the last :meth:`close` (``generation``) is stopped."""
        with self._lock:
            if generation != self.generation:
                old: tuple | None = (pool, made_for)
            else:
                old = self._entries.pop(key, None)
                self._entries[key] = (pool, made_for)
                self.parked += 1
                self._arm(idle_s)
        if old is not None:
            _stop(old[0])

    def take(self, key: Hashable, made_for: Any) -> Any | None:
        """The pool parked under ``key`` for ``made_for`` (None: none, or one made for
        something else, or with a dead worker, which is stopped)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if not self._entries and self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if entry is None:
            return None
        pool, kept_for = entry
        if kept_for != made_for or not pool.keepable():
            _stop(pool)
            return None
        self.reused += 1
        return pool

    def close(self) -> None:
        """Stop every parked pool (idempotent)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
            self.generation += 1
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        for pool, _ in entries:
            _stop(pool)

    def _arm(self, idle_s: float | None) -> None:
        """(Re)start the idle timer (under the lock)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if idle_s is None:
            return
        timer = threading.Timer(idle_s, _close_if_alive, (weakref.ref(self),))
        timer.name, timer.daemon = "zephon-keep-idle", True
        timer.start()
        self._timer = timer
