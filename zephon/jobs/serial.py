"""The serial backend: subjects run one after another in this process.

``setup()`` runs once, before the first subject. A subject's exception is its
failure, ``SystemExit`` and ``KeyboardInterrupt`` raised by its own code
included (as on the process backend, whose workers ignore Ctrl-C): recorded as
themselves, and the run goes on. A Ctrl-C (the run's guard raised it, or
Python's own SIGINT handler) or a ``SystemExit`` from a signal handler of this
process is not the subject's: it stops the run
(:func:`~zephon.jobs.worker.raised_by_signal` tells them apart). No timeout can be enforced here, which is why
:func:`~zephon.options.resolve_backend` never picks this backend when one is set.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Iterable, Iterator

from zephon.jobs.process import Outcome
from zephon.jobs.worker import raised_by_signal

__all__ = ["SerialBackend"]


class SerialBackend:
    name = "serial"

    def __init__(self, fn) -> None:
        self.fn = fn
        self._set_up = False
        self.concurrency = 1
        self.stats: collections.Counter[str] = collections.Counter()

    def run_round(self, items: Iterable[tuple[int, Any]]) -> Iterator[Outcome]:
        """Run ``(index, subject)`` items as they are drawn (a lazy iterable stays lazy:
        nothing per subject is held beyond the one running)."""
        if not self._set_up:
            setup = getattr(self.fn, "setup", None)
            if callable(setup):
                setup()
            self._set_up = True
        fn, clock = self.fn, time.perf_counter
        for index, subject in items:
            start = clock()
            try:
                value = fn(subject)
            except (Exception, SystemExit, KeyboardInterrupt) as exc:
                if not isinstance(exc, Exception) and raised_by_signal(exc):
                    raise  # a Ctrl-C (or a signal handler's exit): it stops the run
                kind = "oom" if isinstance(exc, MemoryError) else "error"
                yield Outcome(index, False, None, exc, clock() - start, kind)
                continue
            yield Outcome(index, True, value, None, clock() - start, "ok")

    def shutdown(self, grace: float) -> None:
        """Nothing to stop."""
