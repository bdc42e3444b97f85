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
    "ArenaFull",
    "AttemptTimeout",
    "ChannelClosed",
    "CheckpointError",
    "IteratorClosedError",
    "JobSetupError",
    "OpError",
    "RecordedFailure",
    "RemoteTraceback",
    "ResultTimeoutError",
    "ResumeMismatchError",
    "SerializationError",
    "ShmSpaceError",
    "SourceError",
    "SubjectTimeoutError",
    "TransportError",
    "ValidationError",
    "ValidationIssue",
    "WorkerCrashedError",
    "ZephonConfigError",
    "ZephonError",
    "remote_traceback",
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
        return _with_state(self, (_rebuild_kw, (type(self), str(self), {"field": self.field})))


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
        return _with_state(self, (type(self), (self.issues if self.issues else str(self),)))


class WorkerCrashedError(ZephonError):
    """A worker process died by a signal and its retries are exhausted.

    ``seq`` is the sequence number that was in flight, ``signal`` the signal
    number (positive), ``op`` the op (or stage, or pool) name, ``worker`` the
    worker's slot index in its pool or job backend (the same slot keeps its index
    across restarts), ``pid`` the process id of the process that died, ``tasks``
    the ids of the tasks it had in flight (a list; empty when unknown). Every
    field is a constructor argument and survives pickling.
    """

    def __init__(
        self,
        message: str,
        *,
        seq: int | None = None,
        signal: int | None = None,
        op: str | None = None,
        worker: int | None = None,
        pid: int | None = None,
        tasks: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.seq, self.signal, self.op, self.worker = seq, signal, op, worker
        self.pid = pid
        self.tasks: list[int] = list(tasks)

    def __reduce__(self):
        return _with_state(self, (
            _rebuild_kw,
            (type(self), str(self),
             {"seq": self.seq, "signal": self.signal, "op": self.op, "worker": self.worker,
              "pid": self.pid, "tasks": self.tasks}),
        ))


class CheckpointError(ZephonError):
    """A checkpoint cannot be written or restored; the message gives the reason."""


class ResumeMismatchError(CheckpointError):
    """A checkpoint does not continue this pipeline's stream: its source files, the
    samples its lanes read next, or its lane mapping differ (``kinds`` names them,
    ``diff`` maps each kind to its lines). ``RuntimeOptions(resume_accept=kinds)``
    restores anyway."""

    def __init__(self, message: str, *, kinds: Sequence[str] = (),
                 diff: dict | None = None) -> None:
        super().__init__(message)
        self.kinds = tuple(kinds)
        self.diff = dict(diff or {})

    def __reduce__(self):
        return _with_state(self, (_rebuild_kw, (type(self), str(self),
                                                {"kinds": self.kinds, "diff": self.diff})))


class IteratorClosedError(ZephonError, RuntimeError):
    """``next()`` on a pipeline iterator whose run was closed before its end (by
    ``close()``, or by an error of the run); the message names what closed it."""


class AggregationTimeoutError(ZephonError, TimeoutError):
    """Ranks did not all arrive within ``aggregate_timeout_s``; ``missing`` lists them."""

    def __init__(self, message: str, *, missing: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)

    def __reduce__(self):
        return _with_state(self, (_rebuild_kw, (type(self), str(self), {"missing": self.missing})))


class SubjectTimeoutError(ZephonError, TimeoutError):
    """A subject ran past ``subject_timeout_sec`` (or its worker never became ready)."""

    def __init__(self, message: str, *, subject_id: str | None = None,
                 timeout_s: float | None = None) -> None:
        super().__init__(message)
        self.subject_id, self.timeout_s = subject_id, timeout_s

    def __reduce__(self):
        return _with_state(self, (
            _rebuild_kw,
            (type(self), str(self),
             {"subject_id": self.subject_id, "timeout_s": self.timeout_s}),
        ))


class TransportError(ZephonError):
    """A channel or shared-memory arena failed (peer gone, corrupt frame, no space)."""


class ResultTimeoutError(TransportError, TimeoutError):
    """No result came from a worker pool within the ``timeout`` the caller gave
    (``timeout_s``); the pool and its workers are still usable."""

    def __init__(self, message: str, *, timeout_s: float | None = None) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s

    def __reduce__(self):
        kwargs = {"timeout_s": self.timeout_s}
        return _with_state(self, (_rebuild_kw, (type(self), str(self), kwargs)))


class SerializationError(ZephonError, TypeError):
    """A payload could not be encoded; ``path`` locates the offending leaf
    (``"payload['tokens'][3]"``) when it could be found."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self):
        return _with_state(self, (_rebuild_kw, (type(self), str(self), {"path": self.path})))


class ChannelClosed(TransportError):
    """The other end closed the channel or its process died (maybe mid-message)."""


class ShmSpaceError(TransportError):
    """No space left for a new shared segment (a small /dev/shm, or no memory for memfd)."""


class ArenaFull(TransportError):
    """The arena has no space and none came back within the wait bound (or it is starved).

    ``held_bytes``/``max_bytes``: what the consumer holds and the arena's bound.
    """

    def __init__(self, message: str, held_bytes: int = 0, max_bytes: int = 0) -> None:
        super().__init__(message)
        self.held_bytes, self.max_bytes = held_bytes, max_bytes

    def __reduce__(self):
        return _with_state(self, (_rebuild_kw, (type(self), str(self),
                              {"held_bytes": self.held_bytes, "max_bytes": self.max_bytes})))


class SourceError(ZephonError):
    """A file or a sample could not be read. The message names the file (or URL) and
    the position inside it (line, row group, tar member) when there is one."""


class AttemptTimeout(ZephonError, TimeoutError):
    """One download attempt took longer than ``download_timeout_s`` (``timeout_s``)."""

    def __init__(self, message: str, *, timeout_s: float | None = None) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s

    def __reduce__(self):
        kwargs = {"timeout_s": self.timeout_s}
        return _with_state(self, (_rebuild_kw, (type(self), str(self), kwargs)))


class OpError(ZephonError):
    """A user op raised; ``op`` and ``sample_id`` say where, ``__cause__`` is the error."""

    def __init__(self, message: str, *, op: str = "", sample_id: Any = None) -> None:
        super().__init__(message)
        self.op, self.sample_id = op, sample_id

    def __reduce__(self):
        kwargs = {"op": self.op, "sample_id": self.sample_id}
        return _with_state(self, (_rebuild_kw, (type(self), str(self), kwargs)))


class JobSetupError(ZephonError):
    """A job worker could not start: the callable did not unpickle, ``setup()`` failed, the
    main script has no ``if __name__ == "__main__":`` guard, or the worker did not become
    ready within ``subject_spawn_timeout_sec``."""


class RecordedFailure(ZephonError):
    """A failure an earlier run recorded in the store, replayed without re-running.

    A resumed run serves a stored failure as this error (``retry_failed_subjects=True``
    re-runs the subject instead). Pickle-safe: it keeps its data when a worker sends it.

    Args:
        message: the original error's message.
        error_type: the original exception's class name.
        traceback: the original traceback text, when one was recorded.

    Examples:
        >>> err = RecordedFailure("boom", error_type="ValueError")
        >>> str(err), err.error_type
        ('boom', 'ValueError')
    """

    def __init__(self, message: str, *, error_type: str = "", traceback: str = "") -> None:
        super().__init__(message)
        self.error_type, self.traceback = error_type, traceback

    def __reduce__(self):
        return _with_state(self, (_rebuild_kw, (type(self), str(self),
                              {"error_type": self.error_type, "traceback": self.traceback})))


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process; attached as
    the ``__cause__`` of the re-raised exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def remote_traceback(exc: BaseException) -> str | None:
    """The traceback text of the worker process that raised ``exc`` (the last
    :class:`RemoteTraceback` of its ``__cause__`` chain: the one attached where it
    crossed into this process, whose text holds any from processes further off), or
    None when no link of the chain crossed a process boundary.

    Examples:
        >>> try:
        ...     raise ValueError("here")
        ... except ValueError as err:
        ...     print(remote_traceback(err))
        None
    """
    seen: set[int] = set()
    found = None
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, RemoteTraceback):
            found = cur.tb
        seen.add(id(cur))
        cur = cur.__cause__
    return found


def _rebuild_kw(cls: type, message: str, kwargs: dict) -> ZephonError:
    return cls(message, **kwargs)


def _with_state(error: BaseException, reduced: tuple) -> tuple:
    """``reduced`` (a rebuild callable and its arguments, with the error's own class) plus
    the error's ``__dict__`` as pickle state, so a subclass's extra attributes and the
    notes of ``add_note()`` survive the trip between processes."""
    return (*reduced, dict(error.__dict__))
