"""The exception hierarchy of zephon.

Every error zephon raises on purpose is a :class:`ZephonError`. Subclasses that
have a natural standard-library counterpart also inherit from it, so callers
can catch either (``except ValueError`` catches a bad option,
``except TimeoutError`` catches a subject that ran too long).

Invariants:
- Exceptions cross process boundaries (a worker raises, the consumer sees it),
  so every class here pickles and unpickles to an equal message and the same
  structured attributes.
- Messages name the thing that is wrong, the value seen and what is allowed;
  the structured attributes carry the same facts for programs.

This module imports the standard library only: it sits below every layer.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

__all__ = [
    "AggregationTimeoutError",
    "CheckpointError",
    "RemoteTraceback",
    "SerializationError",
    "SubjectTimeoutError",
    "TransportError",
    "ValidationError",
    "ValidationIssue",
    "WorkerCrashedError",
    "ZephonConfigError",
    "ZephonError",
]


class ZephonError(Exception):
    """Base class of every error zephon raises deliberately."""


class ZephonConfigError(ZephonError, ValueError):
    """An option or argument has a wrong type, value or combination.

    ``field`` is the offending field's qualified name (``"RuntimeOptions.max_workers"``)
    when one field is at fault, else ``None``.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return (_rebuild_config_error, (str(self), self.field))


def _rebuild_config_error(message: str, field: str | None) -> "ZephonConfigError":
    return ZephonConfigError(message, field=field)


class ValidationIssue(tuple):
    """One finding of pipeline auto-validation: ``(code, op, message)``."""

    __slots__ = ()

    def __new__(cls, code: str, op: str, message: str) -> "ValidationIssue":
        return tuple.__new__(cls, (code, op, message))

    code = property(lambda self: self[0])
    op = property(lambda self: self[1])
    message = property(lambda self: self[2])

    def __getnewargs__(self):
        return tuple(self)

    def __str__(self) -> str:
        return f"[{self.code}] {self.op}: {self.message}"


class ValidationError(ZephonError):
    """Auto-validation found problems with user ops; ``issues`` lists all of them."""

    def __init__(self, issues: Iterable[ValidationIssue] | str) -> None:
        if isinstance(issues, str):
            self.issues: tuple[ValidationIssue, ...] = ()
            text = issues
        else:
            self.issues = tuple(ValidationIssue(*i) for i in issues)
            lines = [f"{len(self.issues)} validation issue(s):"]
            lines += [f"  {issue}" for issue in self.issues]
            text = "\n".join(lines)
        super().__init__(text)

    def __reduce__(self):
        return (ValidationError, (self.issues if self.issues else str(self),))


class WorkerCrashedError(ZephonError):
    """A worker process died by a signal and its retries are exhausted.

    ``seq`` is the sequence number that was in flight, ``signal`` the signal
    number (positive), ``op`` the op (or stage) name, ``worker`` the worker id.
    """

    def __init__(
        self,
        message: str,
        *,
        seq: int | None = None,
        signal: int | None = None,
        op: str | None = None,
        worker: int | None = None,
    ) -> None:
        super().__init__(message)
        self.seq, self.signal, self.op, self.worker = seq, signal, op, worker

    def __reduce__(self):
        return (
            _rebuild_kw,
            (WorkerCrashedError, str(self),
             {"seq": self.seq, "signal": self.signal, "op": self.op, "worker": self.worker}),
        )


class CheckpointError(ZephonError):
    """A checkpoint cannot be written or restored; the message gives the reason."""


class AggregationTimeoutError(ZephonError, TimeoutError):
    """Ranks did not all arrive within ``aggregate_timeout_s``; ``missing`` lists them."""

    def __init__(self, message: str, *, missing: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)

    def __reduce__(self):
        return (_rebuild_kw, (AggregationTimeoutError, str(self), {"missing": self.missing}))


class SubjectTimeoutError(ZephonError, TimeoutError):
    """A subject ran past ``subject_timeout_sec`` (or its worker never became ready)."""

    def __init__(self, message: str, *, subject_id: str | None = None,
                 timeout_s: float | None = None) -> None:
        super().__init__(message)
        self.subject_id, self.timeout_s = subject_id, timeout_s

    def __reduce__(self):
        return (
            _rebuild_kw,
            (SubjectTimeoutError, str(self),
             {"subject_id": self.subject_id, "timeout_s": self.timeout_s}),
        )


class TransportError(ZephonError):
    """A channel or shared-memory arena failed (peer gone, corrupt frame, no space)."""


class SerializationError(ZephonError, TypeError):
    """A payload could not be encoded; ``path`` locates the offending leaf
    (``"payload['tokens'][3]"``) when it could be found."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self):
        return (_rebuild_kw, (SerializationError, str(self), {"path": self.path}))


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process; attached as
    the ``__cause__`` of the re-raised exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def _rebuild_kw(cls: type, message: str, kwargs: dict) -> ZephonError:
    return cls(message, **kwargs)
