"""Realized shares of a mixture under the pipeline's default shuffle, and its start-up cost.

    python bench/mixture_share.py

Rows: a 0.9/0.1 mixture of two equal components; a 0.5/0.5 mixture whose second
component is 100x smaller; then building and reading the first batch of a mixture of
K = 1024 components of 10^6 samples each (10^9 in all): seconds and the process's peak
RSS. Run it on two checkouts (``PYTHONPATH=<checkout>``) to compare. Shares are exact
counts over the first 10^5 samples; times are one measurement on a shared machine.
"""

from __future__ import annotations

import collections
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


def main() -> None:
    print("asked 0.9/0.1, equal sizes:", share({"a": 0.9, "b": 0.1},
                                                 {"a": 200_000, "b": 200_000}))
    print("asked 0.5/0.5, b 100x smaller:", share({"a": 0.5, "b": 0.5},
                                                    {"a": 200_000, "b": 2_000}))
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
