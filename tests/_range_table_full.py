"""Run as a script: fill the heap allocator's slab range table, then let the shared heap
serve an array from a new slab. Prints JSON: the arena's regions and held bytes after the
array died, and whether its data was right. (A process of its own: the table only grows.)"""

import gc
import json
import os
import sys
import warnings

import numpy as np

from zephon._kernels import heap as kernel
from zephon.transport.arena import ShmArena
from zephon.transport.heap import WorkerHeap

MIB = 1 << 20
FAKE = 0x1000_0000_0000  # far from anything this process maps


def main() -> None:
    n = 0
    while True:  # fill the table with ranges nothing will ever allocate in
        try:
            kernel.add_range(FAKE + n * 4096, 4096)
        except OverflowError:
            break
        n += 1
    arena = ShmArena(1, "memfd", 64 * MIB, parent_pid=os.getpid())
    heap = WorkerHeap(arena)
    assert heap.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = np.full(2 * MIB // 8, 7, dtype=np.int64)
        right = int(a.min()) == 7 == int(a.max())
        del a
    heap.close()
    gc.collect()
    with arena.cond:
        arena._drain_gives()
    print(json.dumps({"ranges_filled": n, "right": right, "live_regions": arena.live_regions,
                      "consumer_bytes": arena.consumer_bytes,
                      "held_bytes": arena.live_bytes - arena.consumer_bytes}))
    arena.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
