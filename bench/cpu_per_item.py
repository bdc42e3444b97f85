"""Where the CPU goes: the consumer's process and the workers, per item (Linux).

    python bench/cpu_per_item.py                  # 4 MiB samples, defaults, 3 runs
    python bench/cpu_per_item.py --size 64M --items 400 --runs 5

Runs the workload of ``bench/compare_torch.py`` (``load`` then ``add_one``, 2 spawn
workers, zephon's default options) in a fresh process per run and reads the CPU time
(user + system, from ``/proc``) of the consumer's process (every thread: the pump, the
hand-off, the loop) and of the worker processes over the steady part of the run (from
20 % of the items to 10 items before the end). Prints the median per item of each and
the steady rate. On two cores the throughput is what the sum of both allows; the
consumer's share is also what a training step in that process competes with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_torch as ct  # the workload shared with the comparison script

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of ``pid`` (all its threads), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(entry))
    return out


def one_run(size: int, n: int) -> dict:
    items, close = ct.loader_zephon(n, size // 8)
    me = os.getpid()
    start, stop = n // 5, n - 10
    got = 0
    try:
        for item in items:
            ct.check_item(item)
            got += 1
            if got == start:
                workers = _children(me)
                t0, m0 = time.perf_counter(), _cpu_seconds(me)
                w0 = {pid: _cpu_seconds(pid) for pid in workers}
            elif got == stop:
                t1, m1 = time.perf_counter(), _cpu_seconds(me)
                w1 = {pid: _cpu_seconds(pid) for pid in workers}
            del item
    finally:
        close()
    k = stop - start
    spent = sum((w1[p] or 0.0) - (w0[p] or 0.0) for p in workers if w0[p] is not None)
    return {"main_us": (m1 - m0) / k * 1e6, "workers_us": spent / k * 1e6,
            "gib_s": k * size / (t1 - t0) / (1 << 30), "workers": len(workers)}


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="4M", help="bytes per sample (4M, 64K, ...)")
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not os.path.exists("/proc/self/stat"):
        print("needs Linux (/proc)", file=sys.stderr)
        return 2
    size = _size(args.size)
    if args.one:
        print(json.dumps(one_run(size, args.items)), flush=True)
        return 0
    runs = []
    for _ in range(args.runs):
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one",
                               "--size", str(size), "--items", str(args.items)],
                              capture_output=True, text=True, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        runs.append(json.loads(lines[-1]))
    med = {k: statistics.median(r[k] for r in runs) for k in ("main_us", "workers_us", "gib_s")}
    print(f"{args.size} samples, {args.items} items, median of {len(runs)} runs: consumer's "
          f"process {med['main_us']:.0f} us/item, workers {med['workers_us']:.0f} us/item "
          f"(all of them), {med['gib_s']:.2f} GiB/s; runs: "
          + " ".join(f"{r['gib_s']:.2f}" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
