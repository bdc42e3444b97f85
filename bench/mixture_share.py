"""Realized shares of a mixture under the pipeline's default shuffle, and its start-up cost.

    python bench/mixture_share.py

Rows: a 0.9/0.1 mixture of two equal components; a 0.5/0.5 mixture whose second
component is 100x smaller; a 0.7/0.3 mixture after a filter that drops half of the
first component, without and with ``ensure_mixture`` (default buffer, a buffer large
enough for the surplus of 10^5 samples, and ``leftover="drop"``), with the time per
10^5 samples of each (medians of 3, interleaved, as a ratio to no ensure_mixture;
the load average beside them; ``shuffle(1)`` is the cost of replay resume alone, which
any op that reorders brings: the pipeline without it resumes from the cursor); the
rows with ensure_mixture read more samples for the same output (the share of the
filtered component is higher); then building and reading the first batch of a mixture of
K = 1024 components of 10^6 samples each (10^9 in all): seconds and the process's peak
RSS. Run it on two checkouts (``PYTHONPATH=<checkout>``) to compare. Shares are exact
counts over the first 10^5 samples; times are one measurement on a shared machine.
"""

from __future__ import annotations

import collections
import os
import resource
import time

import numpy as np

from zephon import MixtureReadConfig, Pipeline, sources


def row(i):
    return {"i": np.int64(i)}


def share(weights: dict, sizes: dict, n: int = 100_000) -> dict:
    mix = sources.mixture({k: sources.from_callable(sizes[k], row, name=k) for k in weights},
                          weights)
    counts: collections.Counter = collections.Counter()
    for batch in Pipeline(mix, seed=0, chunk_size=256).batch(1000):
        counts.update(s[0].split("#")[0] for s in batch.meta["sample_ids"])
        if sum(counts.values()) >= n:
            break
    total = sum(counts.values())
    return {k: round(v / total, 4) for k, v in sorted(counts.items())}


def keep(sample) -> bool:
    """Every ``b`` and every other ``a`` (``a`` ids are below 10^6)."""
    i = int(sample["i"])
    return i >= 1_000_000 or i % 2 == 0


def row_b(i):
    return {"i": np.int64(1_000_000 + i)}


def filtered_share(ensure: dict | str | None, n: int = 100_000) -> tuple[dict, float]:
    """Shares of the first ``n`` samples of a 0.7/0.3 mixture after :func:`keep`, and the
    seconds they took."""
    mix = sources.mixture({"a": sources.from_callable(200_000, row, name="a"),
                           "b": sources.from_callable(200_000, row_b, name="b")},
                          {"a": 0.7, "b": 0.3})
    pipe = Pipeline(mix, seed=0, chunk_size=256).filter(keep)
    if ensure == "shuffle":  # replay resume and its boundaries, without a reorder
        pipe = pipe.shuffle(1)
    elif ensure is not None:
        pipe = pipe.ensure_mixture(**ensure)
    counts: collections.Counter = collections.Counter()
    start = time.perf_counter()
    it = iter(pipe.batch(1000))
    for batch in it:
        counts.update(s[0].split("#")[0] for s in batch.meta["sample_ids"])
        if sum(counts.values()) >= n:
            break
    it.close()
    seconds = time.perf_counter() - start
    total = sum(counts.values())
    return {k: round(v / total, 4) for k, v in sorted(counts.items())}, seconds


def ensure_rows() -> None:
    cases = {"filter, no ensure_mixture": None,
             "shuffle(1) (replay resume, no reorder)": "shuffle",
             "ensure_mixture()": {},
             "ensure_mixture(max_buffer=65536)": {"max_buffer": 65536},
             "ensure_mixture(leftover='drop')": {"leftover": "drop"}}
    times: dict = {name: [] for name in cases}
    shares: dict = {}
    for _ in range(3):  # interleaved: each round runs every case once
        for name, ensure in cases.items():
            shares[name], seconds = filtered_share(ensure)
            times[name].append(seconds)
    base = float(np.median(times["filter, no ensure_mixture"]))
    for name in cases:
        t = float(np.median(times[name]))
        print(f"asked 0.7/0.3, half of a filtered, {name}: {shares[name]}, "
              f"{t:.2f} s per 10^5 samples (x{t / base:.2f})")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    print("asked 0.9/0.1, equal sizes:", share({"a": 0.9, "b": 0.1},
                                                 {"a": 200_000, "b": 200_000}))
    print("asked 0.5/0.5, b 100x smaller:", share({"a": 0.5, "b": 0.5},
                                                    {"a": 200_000, "b": 2_000}))
    ensure_rows()
    start = time.perf_counter()
    comps = {f"c{k}": sources.from_callable(1_000_000, row, name=f"c{k}") for k in range(1024)}
    mix = sources.mixture(comps, config=MixtureReadConfig(mode="weighted_random"))
    it = iter(Pipeline(mix, seed=0, chunk_size=64).batch(64))
    next(it)
    it.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"K=1024 x 10^6 samples: first batch {1e3 * (time.perf_counter() - start):.1f} ms, "
          f"peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
