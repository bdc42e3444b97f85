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

Each entry also records the spec and what else it was made for (the options, the
global generators seeded per op: what the stage program depends on besides the spec);
:meth:`take` gives it back only to a run of the very same spec (``is``) made for an
equal rest, so a worker never runs a program other than the one it was started with. A
pipeline's spec and options never change (a builder method makes a new pipeline with a
new keep), so in practice every run of one pipeline reuses the previous run's workers.

Invariants:

- a parked pool is idle: nothing in flight, no result waiting (the run ended its pass);
  one that is not is stopped instead of parked;
- an entry is held by the keep or by a run, never both: :meth:`take` removes it;
- nothing outlives its pipeline: :meth:`close` stops every parked pool; it runs at
  ``pipe.close()``, when the pipeline (its Progress) is garbage collected (a
  ``weakref.finalize``), after ``idle_s`` seconds with nothing taken (a daemon timer),
  and, as for every pool, at interpreter exit (the transport closes live pools then);
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


class WorkerKeep:
    """The parked pools of one pipeline (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, tuple[Any, Any, Any]] = {}  # key -> (pool, spec, made_for)
        self._timer: threading.Timer | None = None
        #: pools parked and taken back so far (what a test or a report can count)
        self.parked = self.reused = 0

    def bind(self, owner: Any) -> "WorkerKeep":
        """Stop every parked pool when ``owner`` (the pipeline's Progress) is garbage
        collected. Returns the keep."""
        weakref.finalize(owner, self.close)
        return self

    def __len__(self) -> int:
        return len(self._entries)

    def park(self, key: Hashable, pool: Any, spec: Any, made_for: Any,
             idle_s: float | None) -> None:
        """Keep ``pool`` (idle) for the next run of ``spec`` made for ``made_for``; every
        parked pool is stopped after ``idle_s`` seconds unless a run takes it (None:
        never)."""
        with self._lock:
            old = self._entries.pop(key, None)
            self._entries[key] = (pool, spec, made_for)
            self.parked += 1
            self._arm(idle_s)
        if old is not None:
            _stop(old[0])

    def take(self, key: Hashable, spec: Any, made_for: Any) -> Any | None:
        """The pool parked under ``key`` for ``spec`` and ``made_for`` (None: none, or one
        made for something else, which is stopped)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if not self._entries and self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if entry is None:
            return None
        pool, kept_spec, kept_for = entry
        if kept_spec is not spec or kept_for != made_for or not pool.keepable():
            _stop(pool)
            return None
        self.reused += 1
        return pool

    def close(self) -> None:
        """Stop every parked pool (idempotent)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        for pool, _, _ in entries:
            _stop(pool)

    def _arm(self, idle_s: float | None) -> None:
        """(Re)start the idle timer (under the lock)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if idle_s is None:
            return
        timer = threading.Timer(idle_s, self.close)
        timer.name, timer.daemon = "zephon-keep-idle", True
        timer.start()
        self._timer = timer
