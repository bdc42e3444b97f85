"""The serial backend: subjects run one after another in this process.

``setup()`` runs once, before the first subject. A subject's exception
(``Exception``) is its failure; ``KeyboardInterrupt`` and ``SystemExit`` are
not failures: they stop the run. No timeout can be enforced here, which is why
:func:`~zephon.options.resolve_backend` never picks this backend when one is set.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Iterable, Iterator

from zephon.jobs.process import Outcome

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
            except Exception as exc:  # noqa: BLE001 - the subject's failure; Ctrl-C is not one
                kind = "oom" if isinstance(exc, MemoryError) else "error"
                yield Outcome(index, False, None, exc, clock() - start, kind)
                continue
            yield Outcome(index, True, value, None, clock() - start, "ok")

    def shutdown(self, grace: float) -> None:
        """Nothing to stop."""
