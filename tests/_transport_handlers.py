"""Worker-side handlers for the transport tests (module level: spawn workers import it)."""

from __future__ import annotations

import dataclasses
import os
import weakref
import signal
import threading
import time

import numpy as np

NUMERIC = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "float32", "float64", "complex64", "complex128"]


@dataclasses.dataclass
class Record:
    name: str
    values: np.ndarray
    extra: tuple


def nested_payload(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    arrays = {d: (rng.random(3000 + seed) * 100).astype(d) for d in NUMERIC}
    big = rng.integers(0, 1 << 40, size=(512, 1024), dtype=np.int64)  # 4 MiB
    return {
        "arrays": arrays,
        "strided": big[::3, ::-2],
        "transposed": big[:40].T,
        "zero_d": np.array(seed, dtype=np.int32),
        "empty": np.zeros((0, 7), dtype=np.float32),
        "big": big,
        "small": np.arange(5, dtype=np.uint16),
        "tuple": (np.ones(10_000, dtype=np.float32), "text", 3.5, None),
        "bytes": b"x" * 9000 + bytes([seed % 256]),
        "bytearray": bytearray(b"y" * 5000),
        "short_bytes": b"abc",
        "objects": np.array([{"k": 1}, "s", 2], dtype=object),
        "record": Record("r", np.linspace(0, 1, 4096), ("a", 1)),
        "scalar": np.float64(2.5),
        "seed": seed,
    }


def _touch(path: str) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(path + ".tmp", path)  # whole or absent


def _wait_for(ready, seconds: float = 60.0) -> None:
    """Poll ``ready()`` every 10 ms until true or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.01)


def handle(msg):
    op, arg = msg
    if op == "nested":
        return nested_payload(arg)
    if op == "echo":
        return arg
    if op == "slice":
        obj, index = arg
        return obj[index]
    if op == "full":
        nbytes, value = arg
        return {"data": np.full(nbytes // 8, value, dtype=np.int64), "value": value}
    if op == "sleep":
        time.sleep(arg)
        return arg
    if op == "raise":
        raise ValueError(f"op failed on purpose: {arg}")
    if op == "unpicklable":
        return {"a": [1, lambda: 0], "b": np.zeros(3)}
    if op == "pid":
        return os.getpid()
    if op == "fds":
        out = {}
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                out[fd] = (os.readlink(f"/proc/self/fd/{fd}"), os.get_inheritable(fd))
            except OSError:
                pass
        return out
    if op == "text":  # a large str: pickled into the skeleton, so it always travels in-band
        return "x" * arg
    if op == "fork_holder":  # a grandchild outside the worker's group keeps its channel open
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                time.sleep(arg)
            finally:
                os._exit(0)
        return pid
    if op == "mp_pool":  # an op that runs a multiprocessing pool of its own
        import multiprocessing

        with multiprocessing.Pool(2) as workers:
            pids = [p.pid for p in workers._pool]
            return {"squares": workers.map(_square, range(arg)), "pids": pids}
    if op == "kill_self":
        os.kill(os.getpid(), signal.SIGKILL)
    if op == "exit_when":  # os._exit(code) once the file `path` exists (the test's cue)
        path, code = arg
        _wait_for(lambda: os.path.exists(path))
        os._exit(code)
    if op == "hold":  # say so in `path`, run until the worker is told to stop, say so again
        from zephon.transport import stopping

        _touch(arg)
        stopping.STOPPING.wait(60.0)
        _touch(arg + ".stopped")
        return arg
    if op == "tensor":
        import torch

        return {"t": torch.arange(arg, dtype=torch.float32).reshape(-1, 4)[:, 1:],
                "n": np.arange(arg)}
    if op == "many":  # n distinct arrays in one message
        n, size = arg
        return [np.full(size, i, dtype=np.int64) for i in range(n)]
    if op == "arrays":  # count arrays of nbytes each, filled with their index
        count, nbytes = arg
        return [np.full(nbytes // 8, i, dtype=np.int64) for i in range(count)]
    if op == "ones":  # one array of nbytes, cheap to make
        return np.ones(arg, dtype=np.uint8)
    if op == "fail_next_send":  # fault injection: the result's send fails before any byte
        import errno

        from zephon.transport import channel as ch

        original = ch.SocketChannel._send_all

        def failing(self, buffers, fd_chunks, progress):
            ch.SocketChannel._send_all = original
            raise OSError(errno.EMSGSIZE, "Message too long (injected)")

        ch.SocketChannel._send_all = failing
        return arg
    if op == "leak_segment_and_die":  # a named segment of this worker, then SIGKILL
        from zephon.transport.arena import Slab, segment_name

        name = segment_name(os.getppid(), os.getpid(), "dead", 0)
        Slab.create(1 << 16, 1 << 20, "named", name)
        os.kill(os.getpid(), signal.SIGKILL)
    if op == "grad":
        import torch

        return {"w": torch.ones(arg, requires_grad=True), "x": torch.ones(arg),
                "i": torch.arange(arg)}
    raise KeyError(op)


def _square(x: int) -> int:
    return x * x


# -- pipeline functions (module level: spawn workers import them) ------------------------

def load_slow(i: int) -> np.ndarray:
    time.sleep(0.01)
    return np.full(1 << 18, i, dtype=np.int64)


def load_4mib(i: int) -> np.ndarray:
    """A 4 MiB sample whose every element is ``i``."""
    return np.full((4 << 20) // 8, i, dtype=np.int64)


def plus_one(x):
    return x + 1


def refault_count(mib: int) -> int:
    """Minor page faults of allocating ``mib`` MiB again right after freeing as much."""
    import resource

    a = np.ones((mib << 20) // 8)
    del a
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones((mib << 20) // 8)
    del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


MIB_ELEMENTS = (1 << 20) // 8 * 8  # 8 MiB of float64
KEPT_CONTAINERS: list = []
WEAK: dict = {}
RECYCLED: list = []


class Recycler:
    """Beside a result: when the result is torn down (after it was encoded) it takes the
    array back through a weak reference, as a buffer pool would."""

    def __init__(self, key) -> None:
        self.key = key

    def __reduce__(self):
        return (int, (self.key,))

    def __del__(self) -> None:
        ref = WEAK.pop(self.key, None)
        a = ref() if ref is not None else None
        if a is not None:
            RECYCLED.append(a)
KEPT_ARRAYS: dict = {}


class ArrayRef:
    """Pickles as the module-level array it names (its ``__reduce__`` reaches it)."""

    def __init__(self, key) -> None:
        self.key = key

    def __reduce__(self):
        return (_array_copy, (KEPT_ARRAYS[self.key],))


def _array_copy(a):
    return a


class HeapOps:
    """Ops that probe a worker's shared heap (zephon.transport.heap): fresh results, results
    the op keeps (and writes to later), views, zeros from recycled regions, reallocations and
    arrays made in an op's own thread."""

    def __init__(self) -> None:
        self.kept: np.ndarray | None = None

    def __call__(self, msg):
        from zephon.transport import heap

        op, arg = msg
        if op == "fresh":
            n, v = arg
            return {"data": np.full(n // 8, v, dtype=np.int64), "v": v}
        if op == "fresh_view":  # a strided view of an array nothing else holds
            n, v = arg
            return {"data": np.full(n // 4, v, dtype=np.int64)[::2].reshape(-1, 8), "v": v}
        if op == "keep":
            n, v = arg
            self.kept = np.full(n // 8, v, dtype=np.int64)
            return {"data": self.kept}
        if op == "keep_base":
            n, v = arg
            self.kept = np.full(n // 8 + 1, v, dtype=np.int64)
            return {"data": self.kept[1:]}
        if op == "scribble":
            if self.kept is not None:
                self.kept[:] = arg
            return "scribbled"
        if op == "small_view":  # a quarter of a fresh array: copied, not its whole region
            n, v = arg
            return {"data": np.full(n // 8, v, dtype=np.int64)[: n // 32]}
        if op == "twice":
            n, v = arg
            a = np.full(n // 8, v, dtype=np.int64)
            return {"a": a, "b": a}
        if op == "zeros":
            return {"data": np.zeros(arg // 8, dtype=np.int64)}
        if op == "resized":
            n, v = arg
            a = np.full(n // 8, v, dtype=np.int64)
            a.resize(n // 4, refcheck=False)  # realloc: the tail is zero-filled by NumPy
            return {"data": a}
        if op == "in_thread":
            import threading

            n, v = arg
            out = {}
            t = threading.Thread(target=lambda: out.update(data=np.full(n // 8, v,
                                                                        dtype=np.int64)))
            t.start()
            t.join()
            return out
        if op == "raise_over_temp":  # a heap temporary is freed while the error unwinds
            return np.ones(MIB_ELEMENTS // 4) + {}["missing"]
        if op == "weakly_tracked":  # a buffer pool that recycles on release (weakly)
            n, v = arg
            out = np.full(n // 8, v, dtype=np.int64)
            WEAK[v] = weakref.ref(out)
            return {"tag": Recycler(v), "data": out}
        if op == "scribble_weak":
            for a in RECYCLED:
                a[:] = arg
            return "scribbled"
        if op == "keep_container":  # the op keeps the dict it returns
            n, v = arg
            out = {"data": np.full(n // 8, v, dtype=np.int64)}
            KEPT_CONTAINERS.append(out)
            return out
        if op == "scribble_containers":
            for d in KEPT_CONTAINERS:
                d["data"][:] = arg
            return "scribbled"
        if op == "via_reduce":  # reached only through an object's __reduce__
            n, v = arg
            KEPT_ARRAYS[v] = np.full(n // 8, v, dtype=np.int64)
            return {"ref": ArrayRef(v)}
        if op == "scribble_arrays":
            for a in KEPT_ARRAYS.values():
                a[:] = arg
            return "scribbled"
        if op == "fork_writes":  # a forked child writes to an array the op made before
            n, v = arg
            a = np.full(n // 8, v, dtype=np.int64)
            pid = os.fork()
            if pid == 0:
                try:
                    a += 100
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
            return {"data": a}
        if op == "daemon_reader":  # a daemon thread reads a kept array until the end
            import threading

            n, v = arg
            a = np.full(n // 8, v, dtype=np.int64)
            KEPT_ARRAYS[-1] = a

            started = threading.Event()

            def read():
                started.set()
                while True:
                    assert int(a.sum()) == v * a.size

            threading.Thread(target=read, daemon=True).start()
            started.wait()  # the reader runs before the result goes
            return os.getpid()
        if op == "keep_table":  # a lookup table the op keeps for good
            self.table = np.full(arg // 8, 1, dtype=np.int64)
            return "kept"
        if op == "fork_and_scribble":  # a forked child makes (and fills) large arrays
            n, v = arg
            out = np.full(n // 8, v, dtype=np.int64)  # the result, made before the fork
            pid = os.fork()
            if pid == 0:
                try:
                    junk = [np.full(n // 8, -7, dtype=np.int64) for _ in range(8)]
                    del junk
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
            after = np.full(n // 8, v + 1, dtype=np.int64)  # made after the child's
            return {"before": out, "after": after}
        if op == "fork_background":  # a forked child keeps making large arrays for a while
            n, seconds = arg
            pid = os.fork()
            if pid == 0:
                try:
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        junk = np.full(n // 8, -7, dtype=np.int64)
                        del junk
                finally:
                    os._exit(0)
            self.child = pid
            return pid
        if op == "reap":
            os.waitpid(self.child, 0)
            return "reaped"
        if op == "fail_after":  # fails with what it made before (a stage program does)
            from zephon.transport.failure import UnitFailure

            n, count, unpicklable = arg
            made = [np.full(n // 8, v, dtype=np.int64) for v in range(count)]
            error = LockedError("lost") if unpicklable else ValueError("failed late")
            failure = UnitFailure(error, made)
            del made
            return failure
        if op == "stats":
            h = heap.installed()
            if h is None:
                return None
            return {"sent": h.sent, "slab_bytes": h.arena.total_bytes,
                    "held": h.arena._held_bytes, "heap_regions": len(h.arena._heap)}
        raise ValueError(op)


class LockedError(Exception):
    """An exception that does not pickle in any form (it holds a lock): it travels as a
    RuntimeError with its text."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def config(opts=None, **fields):
    """The pool configuration a pipeline makes of the options ``opts`` (None: the
    defaults), with ``fields`` of :class:`~zephon.transport.config.PoolConfig` replaced
    (``arena_bytes``, ``spawn_timeout_s``, ...). Imported lazily: workers that import
    this module for its handlers need none of it."""
    from zephon import RuntimeOptions
    from zephon.pipeline.engine import pool_config

    return dataclasses.replace(pool_config(opts if opts is not None else RuntimeOptions()),
                               **fields)
