"""The worker process of a :class:`~zephon.transport.pool.WorkerPool`.

Entry point :func:`worker_entry` (module level: spawn imports it). The worker
ignores SIGINT (Ctrl-C to the process group is the parent's to handle; the
parent starts it with SIGINT blocked so that even its start-up cannot print a
traceback), leads a process group of its own (the processes its ops start are
in it: the pool stops them with the worker), marks inherited descriptors
close-on-exec, tunes malloc, unpickles the handler and limits its compute threads
to the handler's ``worker_compute_threads`` (a stage program's; none for other
handlers: :mod:`zephon.transport.threads`), then:

- a control thread receives TASK (queued), FREE (regions back to the arena)
  and STOP; if the parent dies (EOF, or the parent pid changes) it unlinks the
  segment names the worker owns and kills its process group (itself and what its
  ops started) at once;
- the main thread runs tasks in order and sends each result, or its failure as the
  ERROR kind (:class:`~zephon.transport.failure.UnitFailure`: one the handler returns,
  a stage program's, or whatever the handler raised: its ``SystemExit`` or
  ``KeyboardInterrupt`` too, which is the task's error, not the worker's exit; a real Ctrl-C never reaches the worker, which
  ignores SIGINT, so a ``KeyboardInterrupt`` here is the handler's own), a result
  with the seconds the handler took (header ``b``, always, as
  :class:`~zephon.transport.optime.OpClock` measures them: the pipeline's dispatch
  sizes its parts by the work they cost, not by their time in queues). A result
  the encoder refuses (it cannot be pickled) becomes the failure the handler's
  ``unencodable(result, error)`` makes of it, if it has that method (a pipeline
  stage: the op, the sample, the path, and the records before it). A send
  that fails before any byte left (an ``OSError`` of the socket) is reported to
  the parent as a :class:`~zephon.errors.TransportError` for that task, naming
  the worker; the worker goes on.
- After STOP (or EOF) it finishes the task it is running, closes a stateful
  handler (``handler.close()``, the MTP engine), its arena and its channel.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import selectors
import signal
import threading
import time
import traceback

from zephon.errors import SerializationError, TransportError
from zephon.transport.arena import LeaseTable, ShmArena, SlabRegistry
from zephon.transport.channel import ChannelClosed
from zephon.transport.codec import Decoder, Encoder, PeerState, ShmPolicy
from zephon.transport.failure import UnitFailure, Unwind
from zephon.transport.heap import WorkerHeap
from zephon.transport.optime import OpClock
from zephon.transport.remote_errors import encode_exception
from zephon.transport.stopping import STOPPING, TaskAbandoned
from zephon.transport.supervisor import PARENT_POLL_S, MsgKind, ignore_sigint, parent_changed
from zephon.transport.threads import ComputeThreads
from zephon.transport.tree import become_group_leader

__all__ = ["worker_entry"]

log = logging.getLogger("zephon.transport.worker")


def _close_on_exec_all() -> None:
    """Mark every descriptor above stderr close-on-exec: the channel rebuilt by
    multiprocessing and its own bootstrap pipes arrive inheritable, and a subprocess
    started by an op must not hold them (it would keep channels open after we die)."""
    for directory in ("/proc/self/fd", "/dev/fd"):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            fd = int(name)
            if fd > 2:
                try:
                    os.set_inheritable(fd, False)
                except OSError:
                    pass  # the listing's own descriptor, already closed
        return


#: Largest array a worker's heap serves and keeps for reuse (see :func:`_tune_malloc`).
HEAP_REUSE_BYTES = 256 << 20


def _tune_malloc() -> None:
    """Keep large buffers in the worker's heap instead of a fresh mmap each time.

    A worker allocates and frees multi-MiB arrays for every task. glibc serves
    those with mmap and gives them back with munmap, so each task page-faults its
    whole output again (measured here: a load + map of 4 MiB samples ran at 3.1 GiB/s
    through the pool, 8.1 GiB/s with the threshold raised). Raising the mmap threshold
    and the trim threshold keeps that memory mapped between tasks: arrays up to
    :data:`HEAP_REUSE_BYTES` come from the heap, and up to twice that stays mapped when
    freed (a worker holds on to its peak heap, as a caching allocator does). Older glibc
    versions cap the mmap threshold at 32 MiB; then that is used. A 64 MiB load + map +
    copy ran at 2.23 GiB/s with the 256 MiB threshold, 1.64 GiB/s with 32 MiB. glibc
    only; ``ZEPHON_WORKER_MALLOC_TUNING=0`` turns it off.
    """
    if os.environ.get("ZEPHON_WORKER_MALLOC_TUNING", "1") == "0":
        return
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return  # not glibc
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    if not mallopt(m_mmap_threshold, HEAP_REUSE_BYTES):
        mallopt(m_mmap_threshold, 32 << 20)  # older glibc caps it there
    mallopt(m_trim_threshold, 2 * HEAP_REUSE_BYTES)
    mallopt(m_top_pad, 16 << 20)


def worker_entry(channel, index: int, boot: dict) -> None:
    """Process entry point of worker ``index`` (module level so spawn can import it).

    Args:
        channel: the worker's end of its channel to the pool.
        index: the worker's slot index in the pool.
        boot: the pool's start-up settings (handler bytes, arena, policy).
    """
    ignore_sigint()
    become_group_leader()  # the processes its ops start are stopped with it (pool.close)
    _close_on_exec_all()
    _tune_malloc()
    if boot.get("log_level") is not None and not logging.getLogger().handlers:
        logging.basicConfig(level=boot["log_level"],
                            format=f"%(asctime)s zephon-worker-{index} %(levelname)s %(message)s")
    _Worker(index, channel, boot).run()


def _unencodable(handler, result, error: SerializationError) -> UnitFailure:
    """The failure to send for a ``result`` the encoder refused: what the handler's
    ``unencodable(result, error)`` makes of it (a pipeline stage names the op, the sample
    and the path, with the records before it, which travel with the error), else
    ``error`` itself."""
    explain = getattr(handler, "unencodable", None)
    if callable(explain):
        try:
            failure = explain(result, error)
        except Exception:  # the original error must still go
            log.exception("explaining an unencodable result failed")
        else:
            if failure is not None:
                return failure
    return UnitFailure(error)


def _failure(exc: BaseException) -> UnitFailure:
    """The failure of a handler that raised ``exc``."""
    return exc.failure if isinstance(exc, Unwind) else UnitFailure(exc)


class _Worker:
    def __init__(self, index: int, channel, boot: dict) -> None:
        self.index, self.channel, self.boot = index, channel, boot
        self.parent_pid = boot["parent_pid"]
        self.parent_gone = False
        self.tasks: collections.deque = collections.deque()
        self.task_ready = threading.Condition()
        self.stopping = False
        self.peer = PeerState(can_map_fds=boot["transport"] == "socketpair")
        self.arena = ShmArena(index + 1, boot["arena_kind"], boot["arena_max_bytes"],
                              parent_pid=self.parent_pid,
                              alive=lambda: not (self.parent_gone or self.stopping),
                              wait_timeout_s=boot["arena_wait_timeout_s"],
                              slab_base=boot.get("slab_base", 0),
                              on_release=self.peer.slabs.discard)
        self.leases, self.registry = LeaseTable(), SlabRegistry()
        policy = ShmPolicy(*boot["policy"])
        self.heap = WorkerHeap(self.arena) if policy.enabled else None
        self.encoder = Encoder(policy, self.leases, self.registry, self.arena, self.heap)
        self.decoder = Decoder(self.leases, self.registry, lambda owner: None,
                               borrow_forwarded=True)
        self.timing = bool(boot.get("timing"))  # time tasks (the parent tracks execution)

    def run(self) -> None:
        try:
            try:
                handler = pickle.loads(self.boot["handler"])
                threads = ComputeThreads(getattr(handler, "worker_compute_threads", 0))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
                tb, blob = encode_exception(exc)
                self.channel.send({"k": MsgKind.FAIL, "tb": tb}, [blob])
                return
            if self.heap is not None:
                self.heap.install()  # this thread runs the tasks
            self.channel.send({"k": MsgKind.READY, "pid": os.getpid()})
            threading.Thread(target=self._control, name="zephon-worker-control",
                             daemon=True).start()
            while True:
                with self.task_ready:
                    while not self.tasks and not self.stopping:
                        self.task_ready.wait()
                    if self.stopping:
                        return
                    task_id, header, frames, fds = self.tasks.popleft()
                threads.before_task()
                self._run_one(handler, task_id, header, frames, fds)
        except ChannelClosed:
            pass
        finally:
            closer = getattr(locals().get("handler"), "close", None)
            if callable(closer):  # a stateful handler (the MTP engine) shuts down its work
                try:
                    closer()
                except Exception:
                    log.exception("worker %d: closing the handler failed", self.index)
            if self.heap is not None:
                self.heap.close()
            self.arena.close()
            self.channel.close()

    def _run_one(self, handler, task_id: int, header, frames, fds) -> None:
        box: list = []
        try:
            payload = self.decoder.decode(header, frames, fds)
            clock = OpClock()
            box.append(handler(payload))  # held by nothing else: see Encoder.encode_owned
            ran, busy = time.perf_counter(), clock.seconds()
            del payload
            if type(box[0]) is UnitFailure:  # the handler's own account of its failure
                self._send_failure(task_id, box.pop())
                return
            out, out_frames, out_fds, _ = self.encoder.encode_owned(box, self.peer)
            box.clear()
            out["b"] = busy  # op seconds, always: the dispatch sizes parts by them
            if self.timing:  # op seconds, seconds placing the result, bytes in the arena
                out["t"] = (ran - clock.started, time.perf_counter() - ran,
                            sum(int(r[3]) for r in out.get("r", ())))
        except ChannelClosed:
            raise
        except TaskAbandoned:
            return  # STOP arrived mid-task: nobody waits for its result
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too
            if box and isinstance(exc, SerializationError):  # the result cannot travel
                failure = _unencodable(handler, box.pop(), exc)
            else:
                failure = _failure(exc)
            del exc
            self._send_failure(task_id, failure)
            return
        out["k"], out["id"] = MsgKind.RESULT, task_id
        try:
            self.channel.send(out, out_frames, out_fds)
        except ChannelClosed:
            raise
        except OSError as exc:  # nothing was sent (a broken stream is ChannelClosed)
            self.encoder.abort(out, self.peer)  # its regions back to the arena
            error = TransportError(
                f"worker {self.index} could not send the result of task {task_id}: "
                f"{type(exc).__name__}: {exc}")
            self._send_failure(task_id, UnitFailure(error))

    def _send_failure(self, task_id: int, failure: UnitFailure) -> None:
        """An ERROR for ``task_id`` (:class:`~zephon.transport.failure.UnitFailure`): its
        error in the wire form of :mod:`~zephon.transport.remote_errors`, whether the
        result could not be sent (the header's ``u``), and what the task made before it
        as a result would go (the header's ``done``, its frames after the error's)."""
        exc, box, unsendable = failure.error, [failure.done], failure.unsendable
        failure.done = []  # the box holds the records alone: see Encoder.encode_owned
        del failure
        tb, blob = encode_exception(exc)
        header: dict = {"k": MsgKind.ERROR, "id": task_id, "tb": tb}
        if unsendable:
            header["u"] = 1
        frames: list = [blob]
        fds: list[int] = []
        if box[0]:
            # the traceback's frames hold the records too: without them the records'
            # fresh arrays go by reference (the traceback text is made already)
            traceback.clear_frames(exc.__traceback__)
            try:
                done, done_frames, fds, _ = self.encoder.encode_owned(box, self.peer)
            except Exception as err:  # noqa: BLE001 - the error itself must still go
                log.warning("worker %d: the results made before the error of task %d "
                            "could not be sent (%s: %s)", self.index, task_id,
                            type(err).__name__, err)
            else:
                header["done"] = done
                frames += done_frames
        del box
        try:
            self.channel.send(header, frames, fds)
        except ChannelClosed:
            raise
        except OSError:  # nothing was sent: what the done part took goes back
            if "done" in header:
                self.encoder.abort(header["done"], self.peer)
            raise

    def _control(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.channel.fileno(), selectors.EVENT_READ)
        try:
            while True:
                if not selector.select(timeout=PARENT_POLL_S):
                    if parent_changed(self.parent_pid):
                        raise ChannelClosed("parent process changed")
                    continue
                header, frames, fds = self.channel.recv()
                kind = header.get("k")
                if kind == MsgKind.TASK:
                    with self.task_ready:
                        self.tasks.append((header["id"], header, frames, fds))
                        self.task_ready.notify()
                elif kind == MsgKind.FREE:
                    self.arena.free(header["t"])
                elif kind == MsgKind.STOP:
                    STOPPING.set()  # a task checking between samples gives up (stopping.py)
                    with self.task_ready:
                        self.stopping = True
                        self.task_ready.notify()
                    return
        except (ChannelClosed, OSError):
            # The parent is gone: nothing will read our results. Leave no names behind,
            # and take the processes our ops started (our process group) with us.
            self.parent_gone = True
            self.arena.close()
            if os.getpgid(0) == os.getpid():
                os.killpg(0, signal.SIGKILL)
            os._exit(0)
