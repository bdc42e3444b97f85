"""What execution tracking costs: a cheap-op pipeline with tracking off and on.

    python bench/profile_overhead.py                       # threads, 15 rounds
    python bench/profile_overhead.py --runner process --rounds 9
    python bench/profile_overhead.py --baseline-tree ../other-checkout   # also: off in another tree

The workload is the case where tracking costs most: cheap samples (an int through
``map(add_one)``, ``batch(64)``), so the per-part and per-batch bookkeeping is the
largest share of the work it can be. Off and on run in one process, one pass each,
alternating (off, on, on, off, ...) after a warm-up pass of each, so that the machine's
load drifts over both alike; with ``--baseline-tree`` a third figure per round is a
fresh process of that tree with tracking off (process start-up excluded: it times
its own second pass). Prints every figure (samples/s and the CPU seconds of the
pass), the median of each mode, and the median of the per-round ratios on / off
(the tracking overhead; a ratio per round cancels the load drift between rounds),
by throughput and by CPU per pass.
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

ROOT = Path(__file__).resolve().parent.parent


def add_one(x):
    return x + 1


def build(runner: str, n: int, tracking: str):
    from zephon import Pipeline, RuntimeOptions, sources

    return Pipeline(sources.from_sequence(list(range(n))), chunk_size=256) \
        .map(add_one).batch(64) \
        .options(RuntimeOptions(runner=runner, execution_tracking=tracking))


def timed_pass(pipe, n: int) -> tuple[float, float]:
    """Samples per second of the pipeline's next pass, and the CPU seconds this process
    (every thread) spent on it (for the threads runner, all of the work: the CPU figure
    is less sensitive than the wall clock to what else the machine runs)."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in pipe:
        pass
    return n / (time.perf_counter() - start), time.process_time() - cpu


def measure(runner: str, n: int, tracking: str) -> tuple[float, float]:
    """:func:`timed_pass` of one pass after a warm-up pass (a fresh process)."""
    pipe = build(runner, n, tracking)
    timed_pass(pipe, n)
    return timed_pass(pipe, n)


def run_one(tree: Path, runner: str, n: int, tracking: str) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("ZEPHON_EXECUTION_TRACKING", None)
    out = subprocess.run([sys.executable, __file__, "--child", runner, str(n), tracking],
                         env=env, capture_output=True, text=True, check=True, timeout=900)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["rate"], got["cpu"]


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        rate, cpu = measure(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        print(json.dumps({"rate": rate, "cpu": cpu}))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", default="threads", choices=("inline", "threads", "process"))
    ap.add_argument("--items", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="another zephon checkout to run with tracking off beside these")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    pipes = {"off": build(args.runner, args.items, "off"),
             "on": build(args.runner, args.items, "nodes")}
    for pipe in pipes.values():  # warm-up
        timed_pass(pipe, args.items)
    names = ["off", "on"] + (["baseline off"] if args.baseline_tree is not None else [])
    rates: dict[str, list[float]] = {k: [] for k in names}
    cpus: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
            rate, cpu = timed_pass(pipes[name], args.items)
            rates[name].append(rate)
            cpus[name].append(cpu)
        if args.baseline_tree is not None:
            rate, cpu = run_one(args.baseline_tree.resolve(), args.runner, args.items, "off")
            rates["baseline off"].append(rate)
            cpus["baseline off"].append(cpu)
        print(f"round {r + 1}: " + ", ".join(f"{k} {rates[k][-1]:,.0f}/s "
                                             f"({cpus[k][-1]:.3f} s CPU)" for k in names),
              flush=True)
    print(f"runner={args.runner} items={args.items} rounds={args.rounds}")
    for k in names:
        print(f"  median {k:>12}: {statistics.median(rates[k]):,.0f} samples/s, "
              f"{statistics.median(cpus[k]):.3f} s CPU per pass")

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b, strict=True))

    wall, cpu = ratio(rates["on"], rates["off"]), ratio(cpus["off"], cpus["on"])
    print(f"  on / off, throughput (median of the rounds' ratios): {wall:.3f}; "
          f"by CPU per pass: {cpu:.3f}")
    if "baseline off" in names:
        print(f"  off / baseline off, throughput: {ratio(rates['off'], rates['baseline off']):.3f}"
              f"; by CPU per pass: {ratio(cpus['baseline off'], cpus['off']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
