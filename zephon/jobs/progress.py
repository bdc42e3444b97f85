"""Progress of a job run: a bar on a TTY, periodic log lines otherwise, and a summary.

The bar is redrawn on stderr at most ten times a second; without a TTY a line
goes to the ``zephon.jobs`` logger every ``log_every_s`` seconds. The summary
(done, cached, failed, retried, timeouts, OOM back-offs) is logged at the end
and, on a TTY, printed under the bar.
"""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["Progress"]

log = logging.getLogger("zephon.jobs")


class Progress:
    def __init__(self, total: int, enabled: bool, label: str = "subjects",
                 log_every_s: float = 10.0, stream=None) -> None:
        self.total, self.enabled, self.label = total, enabled, label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.log_every_s = log_every_s
        self.finished = self.failed = self.cached = 0
        self._start = self._last_draw = time.monotonic()
        self._last_log = self._start

    def update(self, *, ok: bool, cached: bool) -> None:
        self.finished += 1
        if not ok:
            self.failed += 1
        if cached:
            self.cached += 1
        if self.enabled:
            self._tick()

    def _line(self) -> str:
        elapsed = time.monotonic() - self._start
        rate = self.finished / elapsed if elapsed > 0 else 0.0
        return (f"{self.finished}/{self.total} {self.label} ({self.cached} cached, "
                f"{self.failed} failed) {rate:.1f}/s")

    def _tick(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if force or now - self._last_draw >= 0.1 or self.finished == self.total:
                width = 30
                filled = int(width * self.finished / self.total) if self.total else width
                self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self._line()}")
                self.stream.flush()
                self._last_draw = now
        elif force or now - self._last_log >= self.log_every_s:
            log.info("progress: %s", self._line())
            self._last_log = now

    def close(self, summary: dict) -> None:
        text = ", ".join(f"{k} {v}" for k, v in summary.items())
        if self.enabled:
            self._tick(force=True)
            if self.tty:
                self.stream.write(f"\n{text}\n")
                self.stream.flush()
        log.info("job run summary: %s", text)
