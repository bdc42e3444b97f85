"""The failure envelope: what a unit whose program failed hands back in its result's
place, on every runner and across the process boundary.

A :class:`UnitFailure` holds the error the unit raised (whatever it was:
``SystemExit`` and ``KeyboardInterrupt`` raised by an op included), the records the
unit made before its failing sample (``done``: handed on before the error is raised,
so what comes before an error does not depend on how the dispatch cut the stream into
parts), whether the error is that the unit's result could not be sent from a process
worker (``unsendable``: the adaptive stage runs such a unit again inline), the pool's
task id (``task_id``, where a pool's worker ran it) and the unit's payload (where an
adaptive stage may run it again inline). It is empty as a result (no records of its
own), so a consumer counting a result's records counts none.

Lifecycle. The producer of a unit's result makes it: the stage program
(:mod:`zephon.pipeline.program`) returns one for a unit that failed, and a pool
worker (:mod:`zephon.transport.worker`) makes one for a handler that raised. A worker
sends it as the ERROR message kind: the error as its link-by-link wire form
(:mod:`zephon.transport.remote_errors`), ``done`` as a result would go (through the
arena, by reference where it can) and ``unsendable`` in the header; the pool rebuilds
it on the other side with the task id (:meth:`WorkerPool.get
<zephon.transport.pool.WorkerPool.get>` with ``failures=True``). Code inside a unit
that must give up with the records it made so far (a batched op) raises
:class:`Unwind` carrying the envelope; the program's top catches it and returns the
envelope.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UnitFailure", "Unwind"]


class UnitFailure:
    """A failed unit's result (see the module docstring)."""

    __slots__ = ("done", "error", "payload", "task_id", "unsendable")

    def __init__(self, error: BaseException, done: list | None = None, *,
                 unsendable: bool = False, task_id: int | None = None,
                 payload: Any = None) -> None:
        self.error = error
        #: the records the unit made before its failing sample (handed on first)
        self.done: list = done if done else []
        #: the error is that the unit's result cannot be sent from a process worker
        self.unsendable = unsendable
        #: the pool task that ran the unit (None: not run by a pool's worker)
        self.task_id = task_id
        #: the unit's payload, where an adaptive stage may run it again inline
        self.payload = payload

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter(())

    def __repr__(self) -> str:
        return (f"UnitFailure({type(self.error).__name__}: {self.error}, "
                f"{len(self.done)} record(s) before it)")


class Unwind(BaseException):
    """Raised inside a unit's code to carry ``failure`` (the error and the records made
    so far) up to the program's top, which hands the envelope back as the unit's result.
    A ``BaseException``, so that no ``except Exception`` of an op swallows it."""

    def __init__(self, failure: UnitFailure) -> None:
        super().__init__(failure.error)
        self.failure = failure
