"""The job worker process and its wire protocol.

A worker is a spawn-context child started by the supervisor
(:mod:`zephon.transport.supervisor`) that first, through
:func:`~zephon.transport.supervisor.lead_process_tree`, makes itself the leader of its
own process group (so the parent can signal the op's children with it) and, on
Linux, a child subreaper (so descendants that leave the group come back to it
when orphaned), exports ``ZEPHON_GPU_SLOT`` when it has one, unpickles the
callable (pickled once by the parent), limits its numerical libraries to one
compute thread as a pipeline's process workers do (``boot["compute_threads"]``,
1 unless the parent says otherwise; :mod:`zephon.transport.threads`: N workers
then run N threads, not N pools as large as the machine; a ``setup()`` that wants
more raises it, e.g. ``torch.set_num_threads``), runs its ``setup()`` if it has
one, then says READY. It runs one subject at a time; when a subject returns, the
processes it left running outside the worker's process group (a daemon in its own
session) are ended (SIGTERM, ``grace / 2``, SIGKILL) before its report is sent,
except what ``setup()`` started: a persistent worker killed outright by a later
subject cannot leave them behind. Processes in the group are the group's, ended
with the worker. It never decides to exit on
its own: the parent stops it (recycling, failure restarts, shutdown) after it
has read the last result, so a result is never lost to an exit. Told to stop,
or sent SIGTERM (a timeout), it ends every descendant it has (SIGTERM,
``grace / 2``, SIGKILL), those that left its process group included, and
exits (of SIGTERM, in the second case). A subject that installs its own
SIGTERM handler replaces that clean-up; the parent's SIGKILL to the group
after the grace still ends the group.

Whatever a subject raises is its failure, reported as itself: ``SystemExit``
(``sys.exit(5)``, its code kept) and ``KeyboardInterrupt`` raised by its own
code included (the worker ignores Ctrl-C: it is the parent's to handle), and the
worker goes on, its ``setup()`` kept, as after any other failure. One that a
signal handler raised (a subject's SIGTERM handler calling ``sys.exit``:
:func:`raised_by_signal`) ends the worker instead: it is being stopped.

Messages (headers on a :mod:`zephon.transport.channel` socketpair; subjects,
values and exceptions travel as pickle protocol 5 frames):

    parent -> worker   task {id} [subject]       stop
    worker -> parent   ready {pid}               fail {tb} [exception]   (setup failed)
                       started {id, t}           done {id, d} [value, buffers...]
                       error {id, d, tb, oom} [exception]

A value that cannot be pickled (a lock, an open file, a generator) is the
subject's failure: a :class:`~zephon.errors.SerializationError` naming the
subject, the part of the value that does not pickle (its ``path``, found by
:func:`~zephon.transport.codec.find_unpicklable`) and the way out, raised from
pickle's own error. A ``MemoryError`` while pickling stays itself (an OOM).

``t`` is the worker's ``time.monotonic()`` when the subject started, ``d`` the
time from then until the callable returned or raised: the parent judges the
subject's timeout on these. From the callable's return until its report is
sent the worker blocks SIGTERM (in every thread of its own), so a terminate
that races a finishing subject never cuts a report in half: the report is
sent, then the pending SIGTERM takes effect.

If the parent dies the worker notices (EOF on the channel, or its parent pid
changes while a subject runs) and kills its whole process group.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time

from zephon.errors import SerializationError, ZephonConfigError
from zephon.jobs.subjects import subject_id_of
from zephon.transport.channel import ChannelClosed
from zephon.transport.remote_errors import encode_exception
from zephon.transport.supervisor import MsgKind, lead_process_tree
from zephon.transport.threads import ComputeThreads
from zephon.transport.tree import descendants, end_descendants

__all__ = ["job_worker_main", "pickle_value", "raised_by_signal", "unpicklable_value_error",
           "unpickle_value"]

_TERM = {signal.SIGTERM}


def pickle_value(value) -> list:
    buffers: list = []
    head = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers)]


def unpickle_value(frames: list):
    return pickle.loads(frames[0], buffers=frames[1:])


def raised_by_signal(exc: BaseException) -> bool:
    """Whether ``exc`` (a ``SystemExit`` or ``KeyboardInterrupt`` out of a subject) came
    from a signal rather than from the subject's own code: a Python signal handler
    installed in this process raised it (its frame is in the traceback: a SIGTERM
    handler calling ``sys.exit``, the run's Ctrl-C guard), or it is a KeyboardInterrupt
    in the main thread under Python's own SIGINT handler (a C function: no frame; it
    cannot be told from a ``raise``, so it counts as a Ctrl-C). One raised by the
    subject's own code is the subject's failure, on every backend.

    Examples:
        >>> try:
        ...     raise SystemExit(5)
        ... except SystemExit as exc:
        ...     raised_by_signal(exc)
        False
    """
    handlers = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            handlers.add(code)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return isinstance(exc, KeyboardInterrupt) and \
        threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler


def unpicklable_value_error(subject, value, error: Exception) -> SerializationError:
    """The error of a subject whose ``value`` failed to pickle with ``error``: it names
    the subject, the part of the value that does not pickle and why, and the way out.

    Examples:
        >>> import threading
        >>> value = {"model": [1.0, threading.Lock()]}
        >>> try:
        ...     pickle.dumps(value)
        ... except TypeError as exc:
        ...     err = unpicklable_value_error("S1", value, exc)
        >>> err.path
        "value['model'][1]"
    """
    from zephon.transport.codec import find_unpicklable  # the codec pulls in NumPy: lazily

    try:
        name = repr(subject_id_of(subject, 0))
    except ZephonConfigError:
        name = f"of type {type(subject).__name__}"
    found = find_unpicklable(value, "value")
    path, why = found if found is not None else ("value", f"{type(error).__name__}: {error}")
    part = "the value itself" if path == "value" else path
    return SerializationError(
        f"subject {name} returned a {type(value).__name__} that cannot be pickled to travel "
        f"back from its job worker: {part} does not pickle ({why}). Return plain data "
        "(numbers, strings, bytes, NumPy arrays, lists and dicts of them), make the object "
        "picklable (its class importable, __getstate__/__reduce__ leaving out locks, files "
        "and connections), or keep it in the worker (build it in fn.setup()) and return "
        "only what the caller needs", path=path)


def _report(channel, task_id: int, start: float, value=None, exc=None,
            subject=None) -> None:
    """Send the subject's report with SIGTERM held back until it is on the wire."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _TERM)
    try:
        duration = time.monotonic() - start
        if exc is None:
            try:
                out = pickle_value(value)
            except MemoryError as pickling:  # an OOM, reported as one
                exc = pickling
            except Exception as pickling:  # noqa: BLE001 - reported as the subject's error
                exc = unpicklable_value_error(subject, value, pickling)
                exc.__cause__ = pickling
        if exc is not None:
            tb, blob = encode_exception(exc)
            channel.send({"k": MsgKind.ERROR, "id": task_id, "d": duration, "tb": tb,
                          "oom": isinstance(exc, MemoryError)}, [blob])
        else:
            channel.send({"k": MsgKind.DONE, "id": task_id, "d": duration}, out)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _TERM)


def _end_escaped(grace: float, kept: set) -> None:
    """End what the subject just run left outside this worker's process group (a daemon
    in its own session): nothing else would end it if a later subject killed the worker
    outright. Processes in the group are left alone (a pool or loader that an object
    made in ``setup()`` starts on first use lives there; the group is ended with the
    worker), and so is what ``setup()`` started (``kept``). Nothing is reaped: a
    ``Popen`` of the subject's may still wait for its child. Runs before the report, so
    the time it takes is the subject's own."""
    end_descendants(grace / 2, keep=kept, outside_group=os.getpgrp(), reap=False)


def job_worker_main(channel, boot: dict) -> None:
    """Process entry point of a job worker (module level so spawn can import it).

    Args:
        channel: the worker's end of its channel to the backend.
        boot: ``fn`` (the pickled callable), ``gpu_slot``, ``parent_pid``, ``grace``.
    """
    grace = float(boot.get("grace", 1.0))
    lead_process_tree(boot["parent_pid"], grace / 2)
    if boot.get("gpu_slot") is not None:
        os.environ["ZEPHON_GPU_SLOT"] = str(boot["gpu_slot"])
    try:
        try:
            fn = pickle.loads(boot["fn"])
            threads = ComputeThreads(boot.get("compute_threads", 1))
            setup = getattr(fn, "setup", None)
            if callable(setup):
                setup()
        except BaseException as exc:  # noqa: BLE001 - reported, then this worker exits
            tb, blob = encode_exception(exc)
            channel.send({"k": MsgKind.FAIL, "tb": tb}, [blob])
            return
        kept = set(descendants(os.getpid()))  # started by setup(): they serve every subject
        channel.send({"k": MsgKind.READY, "pid": os.getpid()})
        while True:
            header, frames, _ = channel.recv()
            if header["k"] == MsgKind.STOP:
                end_descendants(grace / 2)
                return
            task_id = header["id"]
            subject = pickle.loads(frames[0])
            threads.before_task()
            start = time.monotonic()
            channel.send({"k": MsgKind.STARTED, "id": task_id, "t": start})
            try:
                value = fn(subject)
            except (Exception, SystemExit, KeyboardInterrupt) as exc:
                if not isinstance(exc, Exception) and raised_by_signal(exc):
                    raise  # a signal handler's (a subject's SIGTERM one): the worker ends
                _end_escaped(grace, kept)  # the subject's failure, not ours
                _report(channel, task_id, start, exc=exc)
                continue
            _end_escaped(grace, kept)
            _report(channel, task_id, start, value=value, subject=subject)
    except ChannelClosed:
        pass
    finally:
        channel.close()
