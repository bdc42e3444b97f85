"""MTP mode: the whole engine in a non-daemon spawn subprocess.

The consumer process keeps only a one-worker :class:`~zephon.transport.WorkerPool`
whose handler owns the engine (built by a picklable ``factory(start)`` that
returns an iterator of ``(item, position)``; ``start``: the run's lane states and first
epoch). The parent asks for items one
request per item, with up to ``mtp_buffer`` requests in flight on a channel of
``mtp_buffer_bytes``; batches come back through the subprocess's shared-memory
arena as zero-copy views. The subprocess may start worker pools of its own
(that is why it is not a daemon). Positions travel with the items, so the
consumer side alone decides what was delivered: prefetched items are replayed
after a restore. ``close()`` stops the subprocess: under ``shutdown_mode=
"immediate"`` (the default) it has requests in flight, so it is killed at once with
every descendant (its stage workers and what their ops started); under ``"hard"`` and
``"graceful"`` it gets STOP and closes its engine, whose pools stop their workers.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from zephon.transport import WorkerPool
from zephon.transport.config import PoolConfig

__all__ = ["MtpHandler", "MtpSource"]


class MtpHandler:
    """Runs in the MTP subprocess: ``("start", states)``, ``("next", None)``."""

    def __init__(self, factory: Callable[[Any], Iterator]) -> None:
        self.factory = factory
        self.iterator: Iterator | None = None
        self.ended = False  # the run's stream ended: every later 'next' answers None

    def __call__(self, message):
        op, arg = message
        if op == "start":
            self._stop_run()
            self.iterator, self.ended = self.factory(arg), False
            return True
        if op == "next":
            if self.ended:
                return None
            if self.iterator is None:
                raise ValueError("MTP request 'next' before 'start'")
            try:
                return next(self.iterator)
            except StopIteration:
                self._stop_run(park=True)  # a complete pass: its pools serve the next run
                self.ended = True
                return None
        raise ValueError(f"unknown MTP request {op!r}")

    def _stop_run(self, park: bool = False) -> None:
        iterator, self.iterator = self.iterator, None
        if iterator is None:
            return
        if park:
            iterator.close(park=True)  # type: ignore[attr-defined]
        else:
            getattr(iterator, "close", lambda: None)()

    def close(self) -> None:
        """The subprocess stops: its run, then what the factory keeps (its pools)."""
        try:
            self._stop_run()
        finally:
            closer = getattr(self.factory, "close", None)
            if closer is not None:
                closer()


class MtpSource:
    """The consumer-side end: ``items()`` yields what the subprocess produces, in order.
    ``config``: the subprocess's pool (its channel sized for ``mtp_buffer_bytes``),
    ``depth``: the requests in flight (``mtp_buffer``), both resolved by the pipeline
    (:func:`zephon.pipeline.engine.mtp_pool`)."""

    def __init__(self, factory: Callable[[Any], Iterator], start: Any,
                 config: PoolConfig, depth: int) -> None:
        self.depth = depth
        self.pool = WorkerPool(MtpHandler(factory), 1, config=config, name="mtp",
                               daemon=False)
        self.pool.start()
        self.start(start)

    def start(self, start: Any) -> None:
        """Start a run in the subprocess: ``factory(start)`` there (the subprocess is
        reused across runs when the pipeline keeps it: persistent workers)."""
        self.pool.submit(("start", start))
        self.pool.get()

    def runs(self, factory: Callable[[Any], Iterator]) -> bool:
        """Whether the subprocess runs ``factory`` (it pickles to the bytes it started
        with)."""
        return self.pool.runs(MtpHandler(factory))

    def keepable(self) -> bool:
        """Whether the subprocess can serve another run (it is running)."""
        return self.pool.all_running()

    def items(self) -> Iterator[Any]:
        inflight = 0
        ended = False
        while True:
            while not ended and inflight < self.depth:
                self.pool.submit(("next", None))
                inflight += 1
            result = self.pool.get().value
            inflight -= 1
            if result is None:
                ended = True
                if inflight == 0:
                    return
                continue
            yield result

    def close(self) -> None:
        self.pool.close()
