"""A worker process's stop request, as the tasks it runs can see it.

When a :class:`~zephon.transport.pool.WorkerPool` closes, each worker's control thread
receives STOP while its main thread may be in the middle of a task. A task that works
sample by sample (a pipeline stage's dispatch part) calls :func:`check` between samples:
once STOP has arrived it raises :class:`TaskAbandoned`, the worker sends nothing for that
task and exits, so closing waits for the op running now, not for the rest of the part.
The parent drops whatever a stopping worker would have sent anyway.

The flag is per process and only a pool worker's control thread sets it: in any other
process (the consumer, thread and inline runners) :func:`check` never raises.
"""

from __future__ import annotations

import threading

__all__ = ["STOPPING", "TaskAbandoned", "check"]

#: Set once this process is a pool worker that was told to stop.
STOPPING = threading.Event()


class TaskAbandoned(Exception):
    """The worker is stopping: the task gives up between two samples."""


def check() -> None:
    """Raise :class:`TaskAbandoned` if this worker was told to stop."""
    if STOPPING.is_set():
        raise TaskAbandoned("the worker is stopping")
