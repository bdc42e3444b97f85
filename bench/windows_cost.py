"""CPU time per sample of the nanoGPT-windows workload on 2 process workers.

    python bench/windows_cost.py

The workload of ``bench/test_bench_windows.py`` (windows of 1024+1 uint16 tokens mapped
per sample to int64 x/y by :func:`train_windows.to_xy`, batches of 16) on
``runner="process", max_workers=2, worker_allocation="per_stage_fixed"``. Two runs of
different lengths (300 and 5,300 batches after 50 of warm-up) each measure the CPU
seconds of this process (the consumer) and of its workers (``os.times``' children,
counted when they exit); their difference over the 5,000 batches between them is the
steady cost per sample, start-up left out. Reported in microseconds per sample.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_windows import to_xy

WINDOW, BATCH = 1025, 16


def cpu_seconds(path: str, batches: int) -> tuple[float, float]:
    """(consumer, workers) CPU seconds of one run of ``batches`` batches."""
    from zephon import Pipeline, RuntimeOptions, sources

    before = os.times()
    pipe = Pipeline(sources.token_windows(path, WINDOW), num_epochs=None).map(to_xy) \
        .batch(BATCH).options(RuntimeOptions(runner="process", max_workers=2,
                                             worker_allocation="per_stage_fixed"))
    it = iter(pipe)
    for _ in range(50 + batches):
        next(it)
    it.close()
    after = os.times()
    return (after.user - before.user + after.system - before.system,
            after.children_user - before.children_user
            + after.children_system - before.children_system)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.bin")
        np.random.default_rng(0).integers(0, 50257, 1 << 24, dtype=np.uint16).tofile(path)
        short, long = cpu_seconds(path, 300), cpu_seconds(path, 5_300)
    samples = 5_000 * BATCH
    print(f"consumer {1e6 * (long[0] - short[0]) / samples:.1f} us/sample, "
          f"workers {1e6 * (long[1] - short[1]) / samples:.1f} us/sample")


if __name__ == "__main__":
    main()
