"""worker_allocation="autotune" against fixed settings on one slow and one cheap map.

    python bench/autotune_compare.py [--samples N] [--reps 3] [--spin K]

Pipeline: ``map(slow) -> shuffle(16) -> map(cheap) -> batch(16)`` on the process
runner, ``slow`` a pure-Python loop of K iterations per sample, ``cheap`` a few
arithmetic operations. Rows, each in a fresh interpreter (bench/_fresh.py), run
interleaved (row 1, 2, 3, ..., then again) ``--reps`` times; the table gives the
median items/s (the whole run, worker start-up included), every raw value, and
each row's ratio to ``fit_to_ops`` (the default: one worker per stage here):

- ``fit_to_ops``: the defaults (parallelism 1 on both maps);
- ``hand pN``: ``map(slow, parallelism=N)``, cheap at 1 (the hand settings);
- ``autotune``: the CPU budget of this machine (its cores);
- ``autotune max_workers=M``: a budget of M workers in all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def spin_slow(x, k=20_000):
    s = 0
    for i in range(k):
        s += i
    return x + (s & 0)


def cheap(x):
    return x * 3 + 1


def _row(spec: dict) -> dict:
    import functools

    from zephon import Pipeline, RuntimeOptions, sources

    slow = functools.partial(spin_slow, k=spec["spin"])
    kw = dict(runner="process")
    if spec["mode"] == "autotune":
        kw["worker_allocation"] = "autotune"
        if spec.get("max_workers"):
            kw["max_workers"] = spec["max_workers"]
    pipe = (Pipeline(sources.from_sequence(list(range(spec["samples"]))), seed=0, chunk_size=16)
            .map(slow, parallelism=spec.get("p", 1)).shuffle(16).map(cheap).batch(16)
            .options(RuntimeOptions(**kw)))
    started = time.perf_counter()
    n = sum(len(b) for b in pipe)
    took = time.perf_counter() - started
    snap = pipe.stats().get("autotune", {})
    return {"items_s": n / took, "items": n, "workers": snap.get("workers"),
            "decisions": len(snap.get("decisions", []))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--spin", type=int, default=20_000)
    ap.add_argument("--row")
    args = ap.parse_args()
    if args.row:
        print(json.dumps(_row(json.loads(args.row))))
        return
    from _fresh import run_in_child

    base = {"samples": args.samples, "spin": args.spin}
    rows = {"fit_to_ops": {"mode": "fixed"},
            "hand p2": {"mode": "fixed", "p": 2},
            "hand p3": {"mode": "fixed", "p": 3},
            "autotune": {"mode": "autotune"},
            "autotune max_workers=3": {"mode": "autotune", "max_workers": 3}}
    results: dict[str, list] = {k: [] for k in rows}
    extra: dict[str, list] = {k: [] for k in rows}
    for rep in range(args.reps):
        for label, spec in rows.items():
            out, _ = run_in_child(__file__, {**base, **spec}, 600, dict(os.environ), label)
            if out is not None:
                results[label].append(out["items_s"])
                extra[label].append((out["workers"], out["decisions"]))
    ref = statistics.median(results["fit_to_ops"]) if results["fit_to_ops"] else None
    print(f"{'row':26} {'median items/s':>15} {'vs fit_to_ops':>14}  raw; autotune end counts")
    for label, vals in results.items():
        if not vals:
            print(f"{label:26} failed")
            continue
        med = statistics.median(vals)
        ratio = f"{med / ref:.2f}x" if ref else "-"
        raw = ", ".join(f"{v:.0f}" for v in vals)
        tail = f"; {extra[label]}" if label.startswith("autotune") else ""
        print(f"{label:26} {med:15.0f} {ratio:>14}  [{raw}]{tail}")


if __name__ == "__main__":
    main()
