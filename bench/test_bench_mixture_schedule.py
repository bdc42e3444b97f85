"""Position-keyed mixture schedules: positions per second far into the stream.

    python -m pytest bench/test_bench_mixture_schedule.py

A 16-component schedule of 64 linear steps (``schedule_unit="samples"``) locates runs
of 4,096 consecutive positions (a read unit's worth, as lanes read them) spread up to
10**9 into the stream: component and occurrence of each, everything the mixture
computes per position. The baseline is the epoch-keyed mixture with the same weights
(``weighted_random``: one seeded bijection per epoch), over the same positions.
``extra_info["positions_per_s"]`` is the position-keyed rate (one core).
"""

from __future__ import annotations

import numpy as np
import pytest

from zephon import MixtureReadConfig, sources

K, STEPS, RUN, RUNS = 16, 64, 4096, 16
NAME = "stream_schedule_locate_vs_epoch_mixture"


def _mixture(weights, **kw):
    comps = {f"c{k}": sources.from_callable(1_000_000 + 7919 * k, int, name=f"c{k}")
             for k in range(K)}
    return sources.mixture(comps, weights, config=MixtureReadConfig(mode="weighted_random"),
                           **kw)


def _steps():
    rng = np.random.default_rng(0)
    return [(i * 15_000_000, {f"c{k}": float(w) for k, w in enumerate(rng.random(K) + 0.05)})
            for i in range(STEPS)]


STARTS = np.random.default_rng(1).integers(0, 10**9, RUNS)


def test_position_keyed_schedule(benchmark, record_ratio):
    mix = _mixture(_steps(), schedule_unit="samples", interpolate="linear")

    def locate():
        for start in STARTS.tolist():
            mix.locate(np.arange(start, start + RUN), 0)

    benchmark.pedantic(locate, rounds=20, warmup_rounds=2)
    benchmark.extra_info["positions_per_s"] = RUNS * RUN / benchmark.stats.stats.median
    record_ratio(NAME, "subject")


def test_epoch_keyed_mixture(benchmark, record_ratio):
    mix = _mixture(_steps()[0][1])
    length = len(mix)

    def locate():
        for start in STARTS.tolist():
            epoch, at = divmod(int(start), length - RUN)
            mix.locate(np.arange(at, at + RUN), epoch)

    benchmark.pedantic(locate, rounds=20, warmup_rounds=2)
    record_ratio(NAME, "baseline")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
