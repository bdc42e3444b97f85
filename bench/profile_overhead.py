"""What execution tracking costs: a cheap-op pipeline with tracking off and on.

    python bench/profile_overhead.py                       # threads, 15 rounds
    python bench/profile_overhead.py --runner process --rounds 9
    python bench/profile_overhead.py --baseline-tree ../other-checkout   # also: off in another tree
    python bench/profile_overhead.py --workload realistic --runner process --rounds 5
    python bench/profile_overhead.py --tree ../other-checkout   # the same figures, another tree

The workload is the case where tracking costs most: cheap samples (an int through
``map(add_one)``, ``batch(64)``), so the per-part and per-batch bookkeeping is the
largest share of the work it can be. ``--workload realistic`` is a training-shaped
one: a 3 KiB uint8 image-like sample decoded from bytes, normalised to float32 (about
20 us of NumPy per sample), ``batch(32)``. ``--tree`` imports zephon from another
checkout (to measure a baseline with this same script). Off and on run in one process, one pass each,
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


def load_image(i):
    import numpy as np

    return (np.arange(3072, dtype=np.uint8) + i % 251).tobytes()


def decode(raw):
    import numpy as np

    img = np.frombuffer(raw, dtype=np.uint8).reshape(32, 32, 3).astype(np.float32)
    return (img - img.mean()) / (img.std() + 1e-6)


def build(runner: str, n: int, tracking: str, workload: str = "tiny"):
    from zephon import Pipeline, RuntimeOptions, sources

    opts = RuntimeOptions(runner=runner, execution_tracking=tracking)
    if workload == "realistic":
        return Pipeline(sources.from_callable(n, load_image), chunk_size=64) \
            .map(decode).batch(32).options(opts)
    return Pipeline(sources.from_sequence(list(range(n))), chunk_size=256) \
        .map(add_one).batch(64).options(opts)


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
    ap.add_argument("--workload", default="tiny", choices=("tiny", "realistic"))
    ap.add_argument("--tree", type=Path, default=ROOT, help="the zephon checkout to import")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="another zephon checkout to run with tracking off beside these")
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    import zephon

    print(f"zephon from {Path(zephon.__file__).parent}", flush=True)
    pipes = {"off": build(args.runner, args.items, "off", args.workload),
             "on": build(args.runner, args.items, "nodes", args.workload)}
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
    print(f"runner={args.runner} workload={args.workload} items={args.items} "
          f"rounds={args.rounds}")
    for k in names:
        print(f"  median {k:>12}: {statistics.median(rates[k]):,.0f} samples/s, "
              f"{statistics.median(cpus[k]):.3f} s CPU per pass")

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b, strict=True))

    def spread(a: list[float], b: list[float]) -> str:
        got = [x / y for x, y in zip(a, b, strict=True)]
        return f"[{min(got):.3f}-{max(got):.3f}]"

    wall, cpu = ratio(rates["on"], rates["off"]), ratio(cpus["off"], cpus["on"])
    print(f"  on / off, throughput (median of the rounds' ratios): {wall:.3f} "
          f"{spread(rates['on'], rates['off'])}; by CPU per pass: {cpu:.3f} "
          f"{spread(cpus['off'], cpus['on'])}")
    if "baseline off" in names:
        print(f"  off / baseline off, throughput: {ratio(rates['off'], rates['baseline off']):.3f}"
              f"; by CPU per pass: {ratio(cpus['baseline off'], cpus['off']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
