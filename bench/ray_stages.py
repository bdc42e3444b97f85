"""The Ray runner (``runner="ray"``) on a real three-node Ray cluster on this machine:
scaling of an I/O-bound stage with actors, the cost of a unit against the process
runner, and what one driver spends per unit and per byte.

    python bench/ray_stages.py                 # every table (about 3 minutes)
    python bench/ray_stages.py --quick         # fewer samples (smoke)
    python bench/ray_stages.py --json out.json

The cluster is ``ray.cluster_utils.Cluster``: a head (2 logical CPUs) and two worker
nodes (3 each), each a raylet of its own with its own object store; 8 actors fit.
Everything is measured in this one run, and only ratios between its rows are reported
next to the raw figures.

Tables:

1. **I/O-bound scaling**: ``map(wait_10ms)`` (a 10 ms wait per sample, as a remote read
   does; no CPU) over 16-element int64 samples, batches of 16, with 1, 2, 4 and 8
   actors. Efficiency = throughput(k) / (k x throughput(1)); the bar is 0.7 up to 8.
2. **Cost of a unit**: a cheap op (``plus_one`` on a 4-float sample) over the same
   stream, ``runner="ray"`` with 2 actors against ``runner="process"`` with 2 workers:
   samples/s, units (dispatch parts) and wall time per unit.
3. **The driver's work**: driver CPU seconds (this process, all threads, from
   ``time.process_time``) per unit and per MiB of results, for small results and for
   1 MiB arrays; from them, the units/s and GB/s one driver core can feed before it
   is the bottleneck (1 / CPU per unit, 1 / CPU per byte).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)

import _ray_fns as R  # noqa: E402

from zephon import Pipeline, RuntimeOptions, sources  # noqa: E402


def big(i: int) -> dict:
    return {"id": i, "x": np.full(1 << 17, i, dtype=np.float64)}  # 1 MiB


def run(pipe) -> dict:
    """Iterate ``pipe`` once: wall seconds, driver CPU seconds, batches, units."""
    it = iter(pipe)
    cpu, t0 = time.process_time(), time.perf_counter()
    first = next(it)
    start_s = time.perf_counter() - t0
    batches, nbytes = 1, sum(v.nbytes for v in first.values() if hasattr(v, "nbytes"))
    t1, cpu1 = time.perf_counter(), time.process_time()
    for batch in it:
        batches += 1
        nbytes += sum(v.nbytes for v in batch.values() if hasattr(v, "nbytes"))
    wall, cpu_s = time.perf_counter() - t1, time.process_time() - cpu1
    units = it.stats().get("stage0", {}).get("units", 0)
    it.close()
    return {"wall_s": wall, "first_s": start_s, "cpu_s": cpu_s, "batches": batches,
            "units": units, "bytes": nbytes, "total_cpu_s": time.process_time() - cpu}


def pipeline(n: int, op, runner: str, workers: int, make=R.item, batch: int = 16):
    return (Pipeline(sources.from_callable(n, make), seed=1, chunk_size=64)
            .map(op).batch(batch)
            .options(RuntimeOptions(runner=runner, max_workers=workers,
                                    worker_allocation="per_stage_fixed",
                                    execution_tracking="stages")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=3)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    out: dict = {"machine": f"{os.cpu_count()} cores", "cluster_cpus":
                 ray.cluster_resources().get("CPU")}
    try:
        # 1. I/O-bound scaling (the first pass of each row is its measurement; a row's
        # actors start before its first batch, timed apart as first_s)
        per_actor = 60 if args.quick else 200  # samples per actor: ~2 s per row
        rows = {}
        for k in (1, 2, 4, 8):
            rows[k] = run(pipeline(per_actor * k, R.wait_10ms, "ray", k))
            rows[k]["samples_s"] = per_actor * k / rows[k]["wall_s"]
        base = rows[1]["samples_s"]
        print("1. I/O-bound stage (10 ms wait per sample), actors over 3 nodes")
        print(f"{'actors':>7} {'samples/s':>10} {'x 1 actor':>10} {'efficiency':>11} "
              f"{'first batch s':>14}")
        for k, r in rows.items():
            r["efficiency"] = r["samples_s"] / (k * base)
            print(f"{k:>7} {r['samples_s']:>10.1f} {r['samples_s'] / base:>10.2f} "
                  f"{r['efficiency']:>11.2f} {r['first_s']:>14.2f}")
        out["io_scaling"] = rows

        # 2. the cost of a unit: ray (2 actors) vs process (2 workers), same host
        n = 20_000 if args.quick else 100_000
        cheap = {}
        for runner in ("process", "ray", "process", "ray"):
            r = run(pipeline(n, R.plus_one, runner, 2, make=R.value_sample))
            cheap.setdefault(runner, []).append(r)
        print(f"\n2. cheap op (plus_one on a 4-float sample), {n} samples, 2 workers each "
              "(medians of 2 alternating runs)")
        print(f"{'runner':>8} {'samples/s':>10} {'units':>7} {'ms/unit':>8} "
              f"{'driver cpu s':>13}")
        summary = {}
        for runner, rs in cheap.items():
            wall = float(np.median([r["wall_s"] for r in rs]))
            units = int(np.median([r["units"] for r in rs]))
            cpu = float(np.median([r["cpu_s"] for r in rs]))
            summary[runner] = {"samples_s": n / wall, "units": units,
                               "ms_per_unit": 1e3 * wall / max(1, units), "driver_cpu_s": cpu,
                               "runs": rs}
            print(f"{runner:>8} {n / wall:>10.0f} {units:>7} "
                  f"{1e3 * wall / max(1, units):>8.2f} {cpu:>13.2f}")
        ratio = summary["process"]["samples_s"] / summary["ray"]["samples_s"]
        print(f"process / ray throughput: {ratio:.2f}x")
        out["unit_cost"] = {**summary, "process_over_ray": ratio}

        # 3. the driver's work per unit and per byte
        small = run(pipeline(n, R.plus_one, "ray", 4, make=R.value_sample))
        m = 300 if args.quick else 1200
        large = run(pipeline(m, R.plus_id, "ray", 4, make=big, batch=4))
        per_unit = small["cpu_s"] / max(1, small["units"])
        per_byte = large["cpu_s"] / max(1, large["bytes"])
        print("\n3. the driver's CPU (this process, all threads), 4 actors")
        print(f"  small results: {small['units']} units, {small['cpu_s']:.2f} s CPU: "
              f"{1e3 * per_unit:.3f} ms per unit -> one driver core feeds at most "
              f"{1 / per_unit:,.0f} units/s")
        print(f"  1 MiB samples: {large['units']} units, {large['bytes'] / 2**30:.2f} GiB, "
              f"{large['cpu_s']:.2f} s CPU, {large['wall_s']:.2f} s wall: "
              f"{per_byte * 2**30:.3f} s per GiB -> at most {1 / per_byte / 1e9:.2f} GB/s "
              f"(measured {large['bytes'] / large['wall_s'] / 1e9:.2f} GB/s)")
        out["driver"] = {"small": small, "large": large, "cpu_s_per_unit": per_unit,
                         "cpu_s_per_byte": per_byte}
    finally:
        ray.shutdown()
        cluster.shutdown()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
