"""What the epoch order costs at scale: first batch, epoch boundary, 4096 lanes (Linux).

    PYTHONPATH=$PWD python bench/scale.py       # every row, n = 10^3, 10^6 ... 10^10, 3 runs
    python bench/scale.py --max-n 1e8 --runs 1  # a quick subset
    python bench/scale.py --rows lanes,boundary,mixture

Each row runs in a fresh process (``--row``, internal) ``--runs`` times, the runs of all
rows interleaved (run 1 of every row, then run 2 of every row in reverse order, ...: load
that drifts falls on every row alike); the table shows medians. Every row but ``mixture`` builds
``Pipeline(sources.from_callable(n, sample), seed=0)`` with the default shuffle and
``.batch(8)``:

- ``first``: time from ``iter(pipe)`` to the first batch and the main process's peak RSS
  (``ru_maxrss``: the interpreter and NumPy included), inline and on processes
  (``RuntimeOptions(runner="process", max_workers=2)``: the time then includes
  starting the workers, a cost that does not grow with n), with the largest peak RSS
  of a worker (``RUSAGE_CHILDREN`` once the pool has reaped them). ``order`` is the part
  of that time spent in :func:`zephon.pipeline.lanes.epoch_slice` (the epoch order),
  measured by wrapping it. n = 10^3 is the baseline: below the table, the process row's
  first batch at each n minus its first batch at 10^3 (medians) is the part of the time
  that depends on n.
- ``boundary``: the epoch boundary at n = 10^9 without reading 10^9 samples: with
  ``chunk_size = n - 10`` and two canonical lanes, lane 1 holds one chunk of 10 samples
  per epoch; rank 1 of a world of 2 owns only lane 1 and runs ``num_epochs=None``, so
  it crosses an epoch boundary every 10 samples (a batch of 8 and one of 2), and each
  new epoch's order is computed where the lane reaches it (the stage reads one unit
  ahead, so that may fall before the epoch's last batch). ``gap`` is the longest time
  between two consecutive batches at the consumer after the first, over three
  boundaries: the stall a boundary causes; ``order`` the longest single
  ``epoch_slice`` call of a new epoch.
- ``lanes``: ``canonical_replicas=4096`` on one rank (it owns all 4096 lanes), n = 2^18,
  ``chunk_size`` 64 (one chunk per lane): time to the first batch, time until every
  lane delivered its first batch (4096 batches), and the peak RSS.
- ``mixture``: ``sources.mixture`` of K = 1024 ``from_callable`` components of 10^6
  samples each (10^9 in all), ``MixtureReadConfig(mode="weighted_random")``,
  ``chunk_size`` 64, ``.batch(64)``, inline and on processes (2 workers): start-up is the
  time from building the components to the first batch; the main process's peak RSS and
  a worker's.

Rows whose n exceeds ``--max-n`` are skipped (the order before the index shuffle needed
about 16 bytes per sample). A row that fails or exceeds ``--timeout`` shows its error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np


def sample(i):  # module level: spawn workers import it
    return {"x": i}


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class _OrderTimer:
    """Wraps ``lanes.epoch_slice`` (looked up as a module global by ``lane_units``) and
    records the duration of every call with the epoch it was for."""

    def __init__(self) -> None:
        from zephon.pipeline import lanes

        self.calls: list[tuple[int, float]] = []
        self._orig = lanes.epoch_slice

        def timed(n, seed, epoch, shuffle, start, stop):
            t = time.perf_counter()
            try:
                return self._orig(n, seed, epoch, shuffle, start, stop)
            finally:
                self.calls.append((epoch, time.perf_counter() - t))

        lanes.epoch_slice = timed

    def total(self) -> float:
        return sum(d for _, d in self.calls)


def row_first(n: int, runner: str) -> dict:
    from zephon import Pipeline, RuntimeOptions, sources

    timer = _OrderTimer()
    opts = RuntimeOptions(runner=runner, max_workers=2) if runner == "process" else \
        RuntimeOptions(runner="inline")
    pipe = Pipeline(sources.from_callable(n, sample), seed=0).batch(8).options(opts)
    base = _peak_mib()
    t0 = time.perf_counter()
    it = iter(pipe)
    first = next(it)
    t1 = time.perf_counter()
    order = timer.total()
    peak = _peak_mib()
    it.close()
    assert len(first["x"]) == 8
    return {"first_s": t1 - t0, "order_s": order, "peak_mib": peak, "base_mib": base,
            "worker_mib": _children_peak_mib()}


def _children_peak_mib() -> float:
    """The largest peak RSS of a reaped child (a pool's workers, once it is closed)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def row_mixture(k: int, n_each: int, runner: str) -> dict:
    from zephon import MixtureReadConfig, Pipeline, RuntimeOptions, sources

    timer = _OrderTimer()
    opts = RuntimeOptions(runner=runner, max_workers=2) if runner == "process" else \
        RuntimeOptions(runner="inline")
    t0 = time.perf_counter()
    comps = {f"c{i}": sources.from_callable(n_each, sample, name=f"c{i}") for i in range(k)}
    mix = sources.mixture(comps, config=MixtureReadConfig(mode="weighted_random"))
    it = iter(Pipeline(mix, seed=0, chunk_size=64).batch(64).options(opts))
    first = next(it)
    t1 = time.perf_counter()
    it.close()
    assert len(first["x"]) == 64
    return {"first_s": t1 - t0, "order_s": timer.total(), "peak_mib": _peak_mib(),
            "worker_mib": _children_peak_mib()}


def row_boundary(n: int) -> dict:
    from zephon import Pipeline, RuntimeOptions, sources

    timer = _OrderTimer()
    opts = RuntimeOptions(runner="inline", world_size=2, global_rank=1, canonical_replicas=2)
    pipe = Pipeline(sources.from_callable(n, sample), seed=0, chunk_size=n - 10,
                    num_epochs=None).batch(8).options(opts)
    stamps = []
    it = iter(pipe)
    for batch in it:
        stamps.append((time.perf_counter(), batch.meta["sample_ids"][0][2]))
        if stamps[-1][1] >= 3:
            break
    it.close()
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(stamps)]
    new_epoch = [d for e, d in timer.calls if e >= 1]
    return {"gap_s": max(gaps), "order_s": max(new_epoch),
            "peak_mib": _peak_mib(), "epochs": stamps[-1][1]}


def row_lanes(n: int, lanes: int) -> dict:
    from zephon import Pipeline, RuntimeOptions, sources

    timer = _OrderTimer()
    opts = RuntimeOptions(runner="inline", canonical_replicas=lanes)
    pipe = Pipeline(sources.from_callable(n, sample), seed=0, chunk_size=64).batch(8) \
        .options(opts)
    t0 = time.perf_counter()
    it = iter(pipe)
    seen: set[int] = set()
    first_s = None
    for batch in it:
        if first_s is None:
            first_s = time.perf_counter() - t0
        seen.add(batch.meta["lane"])
        if len(seen) == lanes:
            break
    every_s = time.perf_counter() - t0
    it.close()
    return {"first_s": first_s, "every_lane_s": every_s, "order_s": timer.total(),
            "peak_mib": _peak_mib()}


def run_row(spec: dict) -> dict:
    kind = spec["kind"]
    if kind == "first":
        return row_first(spec["n"], spec["runner"])
    if kind == "boundary":
        return row_boundary(spec["n"])
    if kind == "mixture":
        return row_mixture(spec["k"], spec["n_each"], spec["runner"])
    return row_lanes(spec["n"], spec["lanes"])


def _child(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--row", json.dumps(spec)]
    # The child imports the zephon this process imports (its sys.path, not only bench/).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              check=False, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _medians(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return {"error": results[0]["error"]}
    return {k: statistics.median(r[k] for r in ok) for k in ok[0]}


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:9.2f} ms" if value < 1 else f"{value:9.2f} s "
    return f"{value:9.1f} MiB"


def specs(rows: set[str], max_n: float) -> list[dict]:
    out: list[dict] = []
    if "first" in rows:
        for runner in ("inline", "process"):
            out += [{"kind": "first", "n": 10 ** e, "runner": runner}
                    for e in (3, 6, 7, 8, 9, 10) if 10 ** e <= max_n]
    if "boundary" in rows:
        n = 10 ** 9 if max_n >= 10 ** 9 else int(max_n)
        out.append({"kind": "boundary", "n": n})
    if "lanes" in rows:
        out.append({"kind": "lanes", "n": 1 << 18, "lanes": 4096})
    if "mixture" in rows:
        out += [{"kind": "mixture", "k": 1024, "n_each": 10 ** 6, "runner": runner}
                for runner in ("inline", "process")]
    return out


def _label(spec: dict) -> str:
    if spec["kind"] == "first":
        return f"first batch, {spec['runner']:<7} n=10^{int(np.log10(spec['n']))}"
    if spec["kind"] == "boundary":
        return f"epoch boundary, n={spec['n']:.0e}"
    if spec["kind"] == "mixture":
        return f"mixture K={spec['k']} x 10^{int(np.log10(spec['n_each']))}, {spec['runner']}"
    return f"{spec['lanes']} lanes, n=2^{spec['n'].bit_length() - 1}"


def _n_dependent(todo: list[dict], runs: list[list[dict]]) -> None:
    """Per runner, the first batch at each n minus the first batch at n = 10^3: the
    median of the per-run differences (run r of both rows ran side by side)."""
    for runner in ("inline", "process"):
        rows = {s["n"]: got for s, got in zip(todo, runs, strict=True)
                if s["kind"] == "first" and s["runner"] == runner}
        base = rows.get(10 ** 3)
        if base is None:
            continue
        parts = []
        for n, got in sorted(rows.items()):
            diffs = [b["first_s"] - a["first_s"] for a, b in zip(base, got, strict=True)
                     if "error" not in a and "error" not in b]
            if n != 10 ** 3 and diffs:
                parts.append(f"10^{int(np.log10(n))} {statistics.median(diffs) * 1e3:+.1f} ms")
        if parts:
            print(f"first batch minus n=10^3, {runner}: " + ", ".join(parts))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="first,boundary,lanes,mixture")
    parser.add_argument("--max-n", type=float, default=1e10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row, print JSON
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(json.loads(args.row))))
        return 0
    import zephon

    print(f"zephon from {os.path.dirname(zephon.__file__)}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    todo = specs(set(args.rows.split(",")), args.max_n)
    runs: list[list[dict]] = [[] for _ in todo]
    for r in range(args.runs):  # interleaved: run r of every row, then run r + 1 ...
        order = list(zip(todo, runs, strict=True))
        for spec, got in order if r % 2 == 0 else order[::-1]:  # ... in reverse order
            got.append(_child(spec, args.timeout))
    print(f"{'row':<34} {'time':>12} {'order part':>12} {'peak RSS':>13}  extra")
    medians = [_medians(got) for got in runs]
    for spec, got in zip(todo, medians, strict=True):
        if "error" in got:
            print(f"{_label(spec):<34} {got['error']}", flush=True)
            continue
        main_time = got.get("first_s", got.get("gap_s"))
        extra = ""
        if "every_lane_s" in got:
            extra = f"every lane's first batch {_fmt(got['every_lane_s'], 's').strip()}"
        elif "base_mib" in got:
            extra = f"RSS before iter {got['base_mib']:.0f} MiB"
        if got.get("worker_mib"):
            extra += f"{'; ' if extra else ''}worker peak {got['worker_mib']:.0f} MiB"
        print(f"{_label(spec):<34} {_fmt(main_time, 's')} {_fmt(got['order_s'], 's')} "
              f"{_fmt(got['peak_mib'], 'MiB')}  {extra}", flush=True)
    _n_dependent(todo, runs)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
