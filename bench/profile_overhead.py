"""What execution tracking costs: a cheap-op pipeline with tracking off and on.

    python bench/profile_overhead.py                       # threads, 7 rounds
    python bench/profile_overhead.py --runner process --rounds 5
    python bench/profile_overhead.py --baseline-tree /work/main   # off vs another tree

The workload is the case where tracking costs most: cheap samples (an int through
``map(add_one)``, ``batch(64)``), so the per-part and per-batch bookkeeping is the
largest share of the work it can be. Each measurement is a fresh process (one warm-up
pass, then a timed pass); rounds alternate the modes (off, on[, baseline off]) so that
the machine's load drifts over all of them alike. Prints every figure, the median of
each mode and the ratios of the medians (on / off: the tracking overhead; off /
baseline off: what the hooks cost with tracking off, when a baseline tree is given).
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


def measure(runner: str, n: int, tracking: str) -> float:
    """Samples per second of one timed pass (after a warm-up pass)."""
    from zephon import Pipeline, RuntimeOptions, sources

    pipe = Pipeline(sources.from_sequence(list(range(n))), chunk_size=256) \
        .map(add_one).batch(64) \
        .options(RuntimeOptions(runner=runner, execution_tracking=tracking))
    for _ in pipe:  # warm-up: workers started, code paths hot
        pass
    start = time.perf_counter()
    for _ in pipe:  # the next pass
        pass
    return n / (time.perf_counter() - start)


def run_one(tree: Path, runner: str, n: int, tracking: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("ZEPHON_EXECUTION_TRACKING", None)
    out = subprocess.run([sys.executable, __file__, "--child", runner, str(n), tracking],
                         env=env, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])["rate"]


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        print(json.dumps({"rate": measure(sys.argv[2], int(sys.argv[3]), sys.argv[4])}))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", default="threads", choices=("inline", "threads", "process"))
    ap.add_argument("--items", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="another zephon checkout to run with tracking off beside these")
    args = ap.parse_args()
    modes = [("off", ROOT, "off"), ("on", ROOT, "nodes")]
    if args.baseline_tree is not None:
        modes.append(("baseline off", args.baseline_tree.resolve(), "off"))
    rates: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    for r in range(args.rounds):
        for name, tree, tracking in (modes if r % 2 == 0 else modes[::-1]):
            rates[name].append(run_one(tree, args.runner, args.items, tracking))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items()),
              flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"runner={args.runner} items={args.items} rounds={args.rounds}")
    for k, v in med.items():
        print(f"  median {k:>12}: {v:,.0f} samples/s")
    print(f"  on / off: {med['on'] / med['off']:.3f} (tracking overhead "
          f"{100 * (1 - med['on'] / med['off']):+.1f} %)")
    if "baseline off" in med:
        print(f"  off / baseline off: {med['off'] / med['baseline off']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
