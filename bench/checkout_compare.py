"""This checkout against another one, on the autotune workloads: a change's before/after.

    git worktree add /tmp/base <commit> && (cd /tmp/base && python setup.py build_ext --inplace)
    python bench/checkout_compare.py --base /tmp/base [--workload all] [--rows default,autotune]
                                     [--reps 3] [--scale 1.0]

Each row of ``bench/autotune_compare.py`` (the same pipelines, built by its ``--row``
entry point) runs in a fresh interpreter (``bench/_fresh.py``), once with the other
checkout first on ``PYTHONPATH`` (its ``zephon``, its compiled kernels, its copy of the
benchmark script) and once with this one, the two taking turns at going first in each
repetition, so the machine's drift falls on both sides alike. The table gives, per
workload and row, the median items/s of each side over the whole run, the ratio
(this / base) and every raw value; the ratio of each repetition's pair is printed too
(the least disturbed comparison on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fresh import run_in_child  # noqa: E402
from autotune_compare import WORKLOADS, rows_of  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(root: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def compare(name: str, base: str, labels: list[str], reps: int, scale: float) -> list[float]:
    rows = rows_of(name, scale)
    sides = {"this": HERE, "base": os.path.abspath(base)}
    got: dict[tuple[str, str], list[float]] = {}
    pairs: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(reps):
        for label in labels:
            order = ["this", "base"] if rep % 2 == 0 else ["base", "this"]
            rates = {}
            for side in order:
                root = sides[side]
                script = os.path.join(root, "bench", "autotune_compare.py")
                out, _ = run_in_child(script, rows[label], 900, _env(root),
                                      f"{name}: {label} ({side})")
                if out is not None:
                    rates[side] = out["items_s"]
                    got.setdefault((label, side), []).append(out["items_s"])
            if len(rates) == 2:
                pairs[label].append(rates["this"] / rates["base"])
    print(f"\n== {name} ({reps} rep(s), load average {os.getloadavg()[0]:.2f})")
    ratios = []
    for label in labels:
        this, before = got.get((label, "this"), []), got.get((label, "base"), [])
        if not this or not before:
            print(f"  {label:18} failed")
            continue
        a, b = statistics.median(this), statistics.median(before)
        ratios.append(a / b)
        print(f"  {label:18} this {a:9.0f}/s  base {b:9.0f}/s  ratio {a / b:.3f}  "
              f"pairs [{', '.join(f'{r:.2f}' for r in pairs[label])}]  "
              f"raw this [{', '.join(f'{v:.0f}' for v in this)}] "
              f"base [{', '.join(f'{v:.0f}' for v in before)}]")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout (kernels built)")
    ap.add_argument("--workload", default="all")
    ap.add_argument("--rows", default="default,autotune")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    labels = args.rows.split(",")
    every = []
    for name in names:
        every += compare(name, args.base, labels, args.reps, args.scale)
    if every:
        print(f"\ngeometric mean of the ratios (this / base): "
              f"{statistics.geometric_mean(every):.3f} over {len(every)} rows")


if __name__ == "__main__":
    main()
