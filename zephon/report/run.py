"""Profiling runs: :func:`profile` runs a pipeline with tracking on and returns a
:class:`Profile`; :func:`profile_script` runs a user's script with tracking on for every
pipeline it runs (``python -m zephon profile``).

Both turn tracking on without changing what the pipeline produces: :func:`profile`
runs a copy of the pipeline whose options ask for ``execution_tracking="nodes"``
(so the user's pipeline and its position are untouched), :func:`profile_script` sets
:data:`~zephon.options.metrics.TRACKING_ENV` for the script's runs and collects their
statistics with :func:`~zephon.pipeline.stats.recording`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import runpy
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from zephon.errors import ZephonConfigError
from zephon.options.metrics import TRACKING_ENV
from zephon.pipeline.stats import RunStats, recording
from zephon.report.diagnose import Diagnosis, diagnose, stage_title
from zephon.report.html import render_html

__all__ = ["Profile", "profile", "profile_script"]


@dataclass(frozen=True)
class Profile:
    """The outcome of a profiled run: ``runs`` as ``(title, report snapshot)``, the
    diagnosis of the main run (the one that delivered most batches)."""

    runs: tuple[tuple[str, dict], ...]

    @property
    def snapshot(self) -> dict:
        """The main run's report snapshot (``stats(report=True)``)."""
        return max(self.runs, key=lambda r: r[1]["consumer"]["batches"])[1]

    @property
    def diagnosis(self) -> Diagnosis:
        return diagnose(self.snapshot)

    def html(self) -> str:
        """The self-contained HTML report (:mod:`zephon.report.html`)."""
        return render_html(list(self.runs))

    def write(self, path: str | os.PathLike) -> str:
        """Write :meth:`html` to ``path``; returns the path.

        The report is written to a new file beside ``path`` (mode 0666 less the
        umask) and renamed over it, so a reader never sees half a report and a
        symbolic link is never written through: a link at ``path`` is refused
        (``OSError`` with ``errno.ELOOP``), whatever it points to.
        """
        return write_new_file(path, self.html().encode("utf-8"))


def write_new_file(path: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to ``path`` through a fresh file renamed over it: never through a
    symbolic link (one at ``path`` is refused), created with the umask's mode."""
    target = os.fspath(path)
    if os.path.islink(target):
        raise OSError(errno.ELOOP, f"{target} is a symbolic link: the report is not "
                      "written through a link (remove it or choose another path)")
    folder = os.path.dirname(target) or "."
    tmp = os.path.join(folder, f".zephon-report-{secrets.token_hex(8)}.tmp")
    # O_EXCL: a fresh file (never a planted one); mode 0666, which the kernel masks
    # with the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)  # replaces a directory entry: a link there is not followed
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def _title(k: int, snap: dict) -> str:
    stages = ", ".join(stage_title(n, s) for n, s in sorted(snap["stages"].items()))
    return f"Run {k}" + (f": {stages}" if stages else "")


def _positive(name: str, value, kind: type) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) \
            or value <= 0:
        raise ZephonConfigError(f"profile(): {name} must be a positive {kind.__name__}, got "
                                f"{value!r}", field=name)


def _step(step_time) -> Callable[[Any], None]:
    """The emulated training step: a callable taking the batch, or seconds to wait."""
    if callable(step_time):
        return step_time
    if isinstance(step_time, bool) or not isinstance(step_time, (int, float)) or \
            step_time < 0:
        raise ZephonConfigError("profile(): step_time must be seconds >= 0 or a callable "
                                f"taking the batch, got {step_time!r}", field="step_time")
    if step_time == 0:
        return lambda batch: None
    return lambda batch: time.sleep(step_time)


def profile(pipe, *, steps: int | None = None, seconds: float | None = None,
            step_time: float | Callable[[Any], None] = 0.0) -> Profile:
    """Run ``pipe`` with tracking on and report where its time goes.

    A copy of ``pipe`` with ``execution_tracking="nodes"`` runs from the copy's start
    (``pipe`` itself is not advanced) for ``steps`` batches, or ``seconds`` of wall
    time, whichever ends first (neither: one pass); after each batch the training step
    is emulated: ``step_time`` seconds of waiting (a GPU step leaves the CPU free), or
    ``step_time(batch)`` when it is a callable (your own step).

    Args:
        pipe: a :class:`~zephon.Pipeline`.
        steps: batches to take (a positive int), or None.
        seconds: wall time to run for (positive), or None.
        step_time: seconds per emulated step (>= 0) or a callable taking the batch.

    Returns:
        A :class:`Profile`: ``.diagnosis.text``, ``.snapshot``, ``.write(path)``.

    Raises:
        ZephonConfigError: a value above out of range (named in the message).

    Examples:
        >>> pipe = Pipeline(sources.from_sequence(list(range(64)))).batch(8)
        >>> report = zephon.profile(pipe, steps=4)
        >>> report.snapshot["consumer"]["batches"]
        4
    """
    _positive("steps", steps, int)
    _positive("seconds", seconds, float)
    step = _step(step_time)
    traced = pipe.options(pipe.runtime.replace(execution_tracking="nodes"))
    deadline = None if seconds is None else time.perf_counter() + seconds
    it = iter(traced)
    taken = 0
    try:
        for batch in it:
            taken += 1
            step(batch)
            if (steps is not None and taken >= steps) or \
                    (deadline is not None and time.perf_counter() >= deadline):
                break
        snap = it.stats(report=True)
    finally:
        it.close()
    snap = traced.stats(report=True) or snap  # after close: the clock has stopped
    return Profile(((_title(1, snap), snap),))


def profile_script(path: str, argv: list[str]) -> tuple[Profile, BaseException | None]:
    """Run the script at ``path`` as ``python path *argv`` would (as ``__main__``, with
    ``sys.argv = [path, *argv]``, its absolute ``__file__`` and its directory first on
    ``sys.path``) with tracking on for every pipeline it runs; returns the profile of its
    runs that delivered a batch, and what the script raised (None if it ended normally
    or by ``sys.exit(0)``)."""
    script = os.path.abspath(path)
    saved_argv, saved_path, saved_env = sys.argv, list(sys.path), os.environ.get(TRACKING_ENV)
    os.environ[TRACKING_ENV] = "nodes"
    sys.argv = [path, *argv]
    sys.path[:1] = [os.path.dirname(script)]  # python SCRIPT puts its directory first
    raised: BaseException | None = None
    runs: list[RunStats]
    try:
        with recording() as runs:
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exc:
                raised = None if exc.code in (None, 0) else exc
            except Exception as exc:  # noqa: BLE001 - the report is still written
                raised = exc
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop(TRACKING_ENV, None)
        else:
            os.environ[TRACKING_ENV] = saved_env
    snaps = [s for s in (r.snapshot(report=True) for r in runs) if s["consumer"]["batches"]]
    return Profile(tuple((_title(k, s), s) for k, s in enumerate(snaps, 1))), raised
