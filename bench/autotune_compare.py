"""worker_allocation="autotune" against the default and a grid of fixed settings.

    python bench/autotune_compare.py --workload NAME [--reps 3] [--scale 1.0]
    python bench/autotune_compare.py --workload all          # every workload in turn
    python bench/autotune_compare.py --list                  # the workloads and grids

Workloads (each a pipeline of a different shape; module-level ops, so spawn workers
import them). Each is sized so that its best fixed setting runs for about 4-6 s on a
2-core machine: the controller is to converge "within a few seconds", and a run of 1 s
measures its start (half a second of evidence, then a boot) more than where it gets to
(``--scale 0.2`` gives the earlier 1-2 s runs, which show that start):

- ``cpu_map``: ``map(spin 20k)`` over 15k ints, ``batch(16)``: a CPU-heavy map;
- ``large_cheap``: 24k 1 MiB float32 arrays made by the source, ``map(x * 2 + 1)``,
  ``batch(4)``: a cheap map over large items (moving them costs more than the op);
- ``two_stage``: ``map(spin 20k) -> shuffle(16) -> map(spin 5k)`` over 10k ints,
  ``batch(16)``: two stages of unequal cost;
- ``read_bound``: 6000 samples from a source whose read blocks 4 ms each (storage
  latency, no CPU), ``map(cheap)``, ``batch(16)``: the read stage is the bottleneck
  and is not CPU-bound;
- ``small_batched``: 2M ints, ``map(+1)``, ``batch(256)``: small items batched;
- ``phase_change``: ``map`` that spins 40k for the first half of 12k samples and 1k
  for the second half: an op whose cost changes mid-run;
- ``epochs``: ``cpu_map``'s pipeline over 5000 ints, iterated three times (three
  ``iter(pipe)``, epochs 0 to 2, as a training loop does): every fixed row starts its
  workers again each epoch; autotune's later epochs start where the previous one ended.
  Its rates count the three runs together (the middle half, from 25 % to 75 % of their
  samples, spans the second run's start); autotune's end workers and decisions are the
  last run's.

Rows, each in a fresh interpreter (bench/_fresh.py), run interleaved (row 1, 2, ...,
then again; ``default`` and ``autotune`` first, one after the other, taking turns at
going first: a row's place in a repetition moved its rate by a few per cent, the
``inline`` row, which does the default's work, ran at 0.96 of it) ``--reps`` times; the
table gives the median items/s over the whole run
(worker start-up included) with every raw value, and the median items/s over the
middle half of the samples (a quarter to three quarters: where a tuned run has settled,
and before the queues read ahead drain at the end, which inflates the last items' rate
of a deep prefetch):

- ``default``: ``RuntimeOptions()`` (``fit_to_ops``; a map of parallelism 1 runs
  inline, in the consumer's thread);
- the grid: ``inline`` and ``process`` stages with the parallelism per stage, the
  pipeline's ``chunk_size`` and ``prefetch_batches`` of each point (``pN`` or
  ``pN,M`` for two stages, ``cC``, ``fF``);
- ``autotune``: ``RuntimeOptions(worker_allocation="autotune")`` (the runner not
  pinned: each stage starts inline and is moved to process workers when a trial shows
  it pays) at the workload's own chunk size (a chunk size is part of the stream's
  definition, so no controller may change it; the grid's other chunk sizes are other
  streams);
- ``autotune_process``: ``RuntimeOptions(runner="process", worker_allocation="autotune")``
  (pinned to processes: tuned from one worker, never inline), for comparison.

Printed per workload: each row's ratio to the default, the grid's best row and its
setting, and ``autotune / best`` and ``autotune / default`` over the whole run (the
bars: >= 0.9 and >= 1.0), and ``autotune / best`` over the middle half (the grid's best
there may be another setting); and the same two whole-run ratios taken within each
repetition (autotune over that repetition's default and best-setting rows), with their
median: rows that do the same work (a workload autotune keeps inline) differ by the
machine's drift between repetitions, which these cancel. The last line of each workload
is machine-readable ``key=value`` pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# -- ops (module level: picklable into spawn workers) ----------------------------------------

def spin(k: int) -> int:
    s = 0
    for i in range(k):
        s += i
    return s


def spin_20k(x):
    return x + (spin(20_000) & 0)


def spin_5k(x):
    return x + (spin(5_000) & 0)


def cheap(x):
    return x * 3 + 1


def add_one(x):
    return x + 1


def scale_array(a):
    return a * 2.0 + 1.0


def make_array(i):
    import numpy as np

    return np.full(262_144, float(i % 97), dtype=np.float32)  # 1 MiB


def read_slow(i):
    time.sleep(0.004)
    return i




def phased(x, at):
    spin(40_000 if x < at else 1_000)
    return x + 1


# -- workloads -------------------------------------------------------------------------------

#: name -> (samples at scale 1, the workload's chunk size, the grid: list of
#: (label, runner, parallelism per stage, chunk, prefetch_batches or None))
def _grid(stages: int, ps: list, chunks=(16, 64), prefetch_p=None) -> list:
    out = [("inline", "inline", (1,) * stages, 64, None)]
    for p in ps:
        p = p if isinstance(p, tuple) else (p,) * 1 + (1,) * (stages - 1)
        for c in chunks:
            label = "p" + ",".join(map(str, p)) + f" c{c}"
            out.append((label, "process", p, c, None))
    if prefetch_p is not None:
        p = prefetch_p if isinstance(prefetch_p, tuple) else (prefetch_p,) + (1,) * (stages - 1)
        out.append(("p" + ",".join(map(str, p)) + " c64 f32", "process", p, 64, 32))
    return out


WORKLOADS = {
    "cpu_map": (15_000, 64, _grid(1, [1, 2, 3], prefetch_p=2)),
    "large_cheap": (24_000, 64, _grid(1, [1, 2], prefetch_p=2)),
    "two_stage": (10_000, 64, _grid(2, [(1, 1), (2, 1), (2, 2), (3, 1)], chunks=(64,),
                                   prefetch_p=(2, 1))),
    "read_bound": (6000, 64, _grid(1, [1, 2, 4, 8], chunks=(64,), prefetch_p=8)),
    "small_batched": (2_000_000, 64, _grid(1, [1, 2], chunks=(64, 1024), prefetch_p=2)),
    "phase_change": (12_000, 64, _grid(1, [1, 2, 3], chunks=(64,), prefetch_p=2)),
    "epochs": (5000, 64, _grid(1, [1, 2, 3], chunks=(64,), prefetch_p=2)),
}
#: workloads iterated more than once (one run per epoch), and how many times
PASSES = {"epochs": 3}


def _options(spec: dict):
    from zephon import RuntimeOptions

    if spec["mode"] in ("autotune", "autotune_process"):
        pinned = {"runner": "process"} if spec["mode"] == "autotune_process" else {}
        return RuntimeOptions(worker_allocation="autotune", **pinned,
                              **({"max_workers": spec["max_workers"]}
                                 if spec.get("max_workers") else {}))
    if spec["mode"] == "default":
        return RuntimeOptions()
    kw = {"runner": spec["runner"]}
    if spec.get("prefetch"):
        kw["prefetch_batches"] = spec["prefetch"]
        kw["default_stage_prefetch"] = spec["prefetch"]
    return RuntimeOptions(**kw)


def build(spec: dict):
    import functools

    from zephon import Pipeline, sources

    name, n = spec["workload"], spec["samples"]
    chunk = spec["chunk"]
    ps = list(spec.get("p") or (1, 1))
    opts = _options(spec)
    if spec["mode"] == "fixed" and spec["runner"] == "inline":
        ps = [1, 1]
    if spec["mode"] != "fixed":
        ps = [1, 1]

    def src_seq():
        return sources.from_sequence(list(range(n)))

    if name in ("cpu_map", "epochs"):
        pipe = Pipeline(src_seq(), seed=0, chunk_size=chunk).map(spin_20k, parallelism=ps[0]) \
            .batch(16)
    elif name == "large_cheap":
        pipe = Pipeline(sources.from_callable(n, make_array), seed=0, chunk_size=chunk) \
            .map(scale_array, parallelism=ps[0]).batch(4)
    elif name == "two_stage":
        pipe = Pipeline(src_seq(), seed=0, chunk_size=chunk).map(spin_20k, parallelism=ps[0]) \
            .shuffle(16).map(spin_5k, parallelism=ps[1]).batch(16)
    elif name == "read_bound":
        pipe = Pipeline(sources.from_callable(n, read_slow), seed=0, chunk_size=chunk) \
            .map(cheap, parallelism=ps[0]).batch(16)
    elif name == "small_batched":
        pipe = Pipeline(src_seq(), seed=0, chunk_size=chunk).map(add_one, parallelism=ps[0]) \
            .batch(256)
    elif name == "phase_change":
        # shuffle=False: the cheap phase is the second half of the run, not spread over it
        pipe = Pipeline(src_seq(), seed=0, chunk_size=chunk, shuffle=False) \
            .map(functools.partial(phased, at=n // 2), parallelism=ps[0]).batch(16)
    else:
        raise SystemExit(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    return pipe.options(opts)


def _row(spec: dict) -> dict:
    pipe = build(spec)
    started = time.perf_counter()
    n, marks = 0, []  # (seconds, samples) at a quarter and at three quarters of the run
    total = spec["samples"] * PASSES.get(spec["workload"], 1)
    quarter = [total // 4, 3 * total // 4]
    for _ in range(PASSES.get(spec["workload"], 1)):
        for b in pipe:
            n += len(b)
            if len(marks) < 2 and n >= quarter[len(marks)]:
                marks.append((time.perf_counter(), n))
    ended = time.perf_counter()
    snap = pipe.stats().get("autotune", {})
    steady = (marks[1][1] - marks[0][1]) / (marks[1][0] - marks[0][0]) \
        if len(marks) == 2 and marks[1][0] > marks[0][0] else None
    return {"items_s": n / (ended - started), "steady_s": steady, "items": n,
            "workers": snap.get("workers"), "decisions": snap.get("decisions_total", 0)}


def rows_of(name: str, scale: float) -> dict[str, dict]:
    n, chunk, grid = WORKLOADS[name]
    base = {"workload": name, "samples": max(64, int(n * scale))}
    # default and autotune run one after the other in each repetition: their ratio per
    # repetition is the least disturbed by the machine's drift
    rows = {"default": {**base, "mode": "default", "chunk": chunk},
            "autotune": {**base, "mode": "autotune", "chunk": chunk}}
    for label, runner, p, c, f in grid:
        rows[label] = {**base, "mode": "fixed", "runner": runner, "p": list(p), "chunk": c,
                       "prefetch": f}
    rows["autotune_process"] = {**base, "mode": "autotune_process", "chunk": chunk}
    return rows


def _median(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def run_workload(name: str, reps: int, scale: float) -> dict:
    from _fresh import run_in_child

    rows = rows_of(name, scale)
    runs: dict[str, list[dict]] = {k: [] for k in rows}
    per_rep: list[dict[str, float]] = []  # each repetition's items/s per row
    for rep in range(reps):
        per_rep.append({})
        order = list(rows)
        if rep % 2:  # default and autotune take turns at going first
            order[0], order[1] = order[1], order[0]
        for label in order:
            spec = rows[label]
            out, _err = run_in_child(__file__, spec, 900, dict(os.environ), f"{name}: {label}")
            if out is not None:
                runs[label].append(out)
                per_rep[-1][label] = out["items_s"]
                print(f"  {name}: {label}: {out['items_s']:.0f}/s", file=sys.stderr, flush=True)
    whole = {k: _median([r["items_s"] for r in v]) for k, v in runs.items() if v}
    steady = {k: _median([r["steady_s"] for r in v]) for k, v in runs.items() if v}
    ref = whole.get("default")
    passes = f" x {PASSES[name]} runs" if name in PASSES else ""
    print(f"\n== {name}: {rows['default']['samples']} samples{passes}, {reps} rep(s), "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'row':18} {'whole items/s':>13} {'vs default':>10} {'mid half/s':>11}  raw (whole)")
    for label, got in runs.items():
        if not got:
            print(f"{label:18} failed")
            continue
        ratio = f"{whole[label] / ref:.2f}x" if ref else "-"
        half = f"{steady[label]:.0f}" if steady[label] else "-"
        raw = ", ".join(f"{r['items_s']:.0f}" for r in got)
        tail = "; end workers, decisions: " + str([(r["workers"], r["decisions"]) for r in got]) \
            if label.startswith("autotune") else ""
        print(f"{label:18} {whole[label]:13.0f} {ratio:>10} {half:>11}  [{raw}]{tail}")
    fixed = [k for k in whole if k not in ("default", "autotune", "autotune_process")]
    out: dict = {"workload": name}
    if not (fixed and "autotune" in whole and ref):
        return out
    best = max(fixed, key=whole.__getitem__)
    out.update(best=best, best_items_s=whole[best], autotune_items_s=whole["autotune"],
               vs_best=whole["autotune"] / whole[best], vs_default=whole["autotune"] / ref)
    print(f"grid best (whole run): {best} ({whole[best]:.0f}/s); autotune / best = "
          f"{out['vs_best']:.2f} (bar 0.9), autotune / default = {out['vs_default']:.2f} (bar 1.0)")
    paired = [(r["autotune"] / r["default"], r["autotune"] / r[best]) for r in per_rep
              if {"autotune", "default", best} <= set(r)]
    if paired:
        out.update(paired_vs_default=_median([d for d, _ in paired]),
                   paired_vs_best=_median([b for _, b in paired]))
        print(f"  per repetition (median of the ratios within each): autotune / default = "
              f"{out['paired_vs_default']:.2f} [{', '.join(f'{d:.2f}' for d, _ in paired)}], "
              f"autotune / {best} = {out['paired_vs_best']:.2f} "
              f"[{', '.join(f'{b:.2f}' for _, b in paired)}]")
    halves = [k for k in fixed if steady.get(k)]
    if halves and steady.get("autotune"):
        sbest = max(halves, key=steady.__getitem__)
        out.update(steady_best=sbest, steady_vs_best=steady["autotune"] / steady[sbest])
        print(f"grid best (mid half): {sbest} ({steady[sbest]:.0f}/s); autotune / best = "
              f"{out['steady_vs_best']:.2f}")
    pinned = ""
    if "autotune_process" in whole:
        out.update(pinned_vs_best=whole["autotune_process"] / whole[best],
                   pinned_vs_default=whole["autotune_process"] / ref)
        print(f"autotune_process / best = {out['pinned_vs_best']:.2f}, / default = "
              f"{out['pinned_vs_default']:.2f}")
        pinned = (f" pinned_vs_best={out['pinned_vs_best']:.3f} "
                  f"pinned_vs_default={out['pinned_vs_default']:.3f}")
    print(f"{name}: autotune_vs_best={out['vs_best']:.3f} "
          f"autotune_vs_default={out['vs_default']:.3f} best={best.replace(' ', '_')}"
          + (f" steady_vs_best={out['steady_vs_best']:.3f}" if "steady_vs_best" in out else "")
          + pinned)
    sys.stdout.flush()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="cpu_map", help=f"one of {', '.join(WORKLOADS)}, "
                    "or all")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="samples x this")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--row")
    args = ap.parse_args()
    if args.row:
        print(json.dumps(_row(json.loads(args.row))))
        return
    if args.list:
        for name in WORKLOADS:
            print(f"{name}: {', '.join(rows_of(name, 1.0))}")
        return
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    summary = [run_workload(name, args.reps, args.scale) for name in names]
    if len(summary) > 1:
        print("\nsummary (autotune / grid best, autotune / default):")
        for s in summary:
            if "vs_best" in s:
                print(f"  {s['workload']:14} {s['vs_best']:.2f}  {s['vs_default']:.2f}  "
                      f"(best {s['best']}; middle half: {s.get('steady_vs_best', 0):.2f}; "
                      f"per repetition: {s.get('paired_vs_best', 0):.2f}  "
                      f"{s.get('paired_vs_default', 0):.2f})")


if __name__ == "__main__":
    main()
