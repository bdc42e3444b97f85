"""Pool handlers that fork inside a task (module level: spawn workers import them)."""

from __future__ import annotations

import os
import time

import numpy as np

KEPT: list = []


def _heap_slabs() -> list[tuple[int, int]]:
    """``(address, size)`` of every slab the worker's shared heap serves arrays from."""
    from zephon.transport import heap

    h = heap.installed()
    return [(s.address, s.size) for sid, s in h.arena.slabs.items() if sid in h._ranges]


def _resident_kib(ranges: list[tuple[int, int]]) -> int:
    """Resident KiB of this process's memory inside ``ranges`` (page by page: mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for address, size in ranges:
        vec = ctypes.create_string_buffer((size + page - 1) // page)
        if libc.mincore(address, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        total += sum(b & 1 for b in vec.raw) * page
    return total // 1024


class ForkOps:
    """``(op, arg)`` tasks of a pool worker."""

    def __call__(self, task):
        op, arg = task
        if op == "fill":  # grow the worker's heap: arrays made, kept, dropped
            n, count = arg
            KEPT[:] = [np.full(n // 8, k, dtype=np.int64) for k in range(count)]
            KEPT[:] = KEPT[:1]
            return len(KEPT)
        if op == "fork":  # a child reads a live heap array and reports what fork cost
            n, v = arg
            live = np.full(n // 8, v, dtype=np.int64)
            slabs = _heap_slabs()
            r, w = os.pipe()
            t0 = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                try:
                    ok = int(live.min()) == v == int(live.max())
                    live += 100  # stays in the child
                    os.write(w, f"{int(ok)} {_resident_kib(slabs)}".encode())
                finally:
                    os._exit(0)
            os.close(w)
            got = os.read(r, 64).decode().split()
            fork_s = time.perf_counter() - t0
            os.close(r)
            os.waitpid(pid, 0)
            return {"ok": got[0] == "1", "child_slab_kib": int(got[1]),
                    "slab_kib": sum(n for _, n in slabs) // 1024, "fork_s": fork_s,
                    "live": live}
        raise ValueError(op)
