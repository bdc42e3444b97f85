"""Why a stage runs one sample at a time: two NumPy adds into memory that is in
the CPU cache vs out of it.

    python bench/hot_vs_cold_writes.py            # 4 MiB arrays, 1 and 2 processes
    python bench/hot_vs_cold_writes.py --mib 16

Each process does what the 4 MiB row of ``bench/compare_torch.py`` does per sample,
``tmp = base + i`` then ``out = tmp + 1``, with ``tmp`` and ``out`` taken in turn
from rings of shared-memory buffers (``/dev/shm``, as the arena's slabs). A ring of 1
reuses the same buffer every sample (what a worker's heap does now that a sample's
temporary is freed just before the next sample's is made: first fit puts it where
the last one was); a ring of 16 goes round 64 MiB (what running each op over a whole
part did: a temporary per sample of the part, each written out of the cache).
``out`` always comes from a ring of 16, as a result does (the consumer holds it for a
while). Prints the microseconds per sample, for one process alone and for two at once
(two workers on a two-core machine share the cache and the memory bus).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import time

import numpy as np


def _shm_buffer(nbytes: int) -> np.ndarray:
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        buf = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    arr = np.frombuffer(buf, np.int64)
    arr[:] = 0  # faulted in: only the cache differs between the rings
    return arr


def per_sample_us(nbytes: int, tmp_ring: int, out_ring: int = 16, samples: int = 400) -> float:
    base = np.arange(nbytes // 8, dtype=np.int64)
    tmps = [_shm_buffer(nbytes) for _ in range(tmp_ring)]
    outs = [_shm_buffer(nbytes) for _ in range(out_ring)]
    for i in range(32):  # warm-up: every buffer written once
        np.add(base, i, out=tmps[i % tmp_ring])
        np.add(tmps[i % tmp_ring], 1, out=outs[i % out_ring])
    t0 = time.perf_counter()
    for i in range(samples):
        tmp = tmps[i % tmp_ring]
        np.add(base, i, out=tmp)
        np.add(tmp, 1, out=outs[i % out_ring])
    return (time.perf_counter() - t0) / samples * 1e6


def _child(args, queue) -> None:
    queue.put(per_sample_us(*args))


def together(nbytes: int, tmp_ring: int, procs: int) -> list[float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    children = [ctx.Process(target=_child, args=((nbytes, tmp_ring), queue))
                for _ in range(procs)]
    for c in children:
        c.start()
    try:
        return sorted(queue.get(timeout=300) for _ in children)
    finally:
        for c in children:
            c.join(timeout=30)
            if c.is_alive():
                c.kill()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=4, help="array size in MiB (4)")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    print(f"{args.mib} MiB arrays: microseconds per sample (two NumPy adds)")
    for ring, label in ((1, "temporary hot (ring of 1)"), (16, "temporary cold (ring of 16)")):
        one = together(nbytes, ring, 1)[0]
        two = together(nbytes, ring, 2)
        print(f"  {label:<30} 1 process: {one:7.0f}   2 processes: "
              + " / ".join(f"{t:.0f}" for t in two))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
