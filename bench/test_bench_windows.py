"""nanoGPT windows with a per-sample map: zephon's worker path against ``get_batch``.

    python -m pytest bench/test_bench_windows.py [--enforce-ratios]

A uint16 token file (16 Mi tokens, uniform over 50,257 ids) read in windows of 1024+1
tokens; each sample is mapped to int64 ``x = tokens[:-1]``, ``y = tokens[1:]``
(:func:`train_windows.to_xy`, a Python function per sample) and batched by 16. The
baseline is nanoGPT's own ``get_batch`` as its ``train.py`` writes it (``np.memmap``
per batch, ``torch.randint`` offsets, ``torch.stack`` of int64 ``x`` and ``y``). zephon
runs ``Pipeline(token_windows(path, 1025), num_epochs=None).map(to_xy).batch(16)``:

- ``windows_map_process2_vs_get_batch``: on 2 spawn worker processes
  (``runner="process", max_workers=2, worker_allocation="per_stage_fixed"``);
- ``windows_map_defaults_vs_get_batch``: with no option given (no runner named).

A round is 64 batches (1,024 samples) of a running loader, so the ratio is get_batch's
time per 64 batches over zephon's. The bar is 2x for both. zephon's side is measured by
the ``zephon_benchmark`` fixture (``zephon.testing``): its first batch (worker start-up)
and 5 rounds' worth of warm-up batches stay out of the timed rounds, and its start-up,
first batch and peak memory are saved in the benchmark's ``extra_info``; get_batch's
side is timed as before, from its first batch on, 5 warm-up rounds.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_windows import to_xy

torch = pytest.importorskip("torch")

WINDOW, BATCH, TOKENS = 1025, 16, 1 << 24
PER_ROUND, ROUNDS, WARMUP = 64, 25, 5
GROUP = "nanoGPT windows + per-sample map to int64 x/y: time per 64 batches of 16"
NAMES = {"process2": "windows_map_process2_vs_get_batch",
         "defaults": "windows_map_defaults_vs_get_batch"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("windows") / "train.bin")
    np.random.default_rng(0).integers(0, 50257, TOKENS, dtype=np.uint16).tofile(path)
    return path


def get_batches(path):
    """nanoGPT's ``get_batch('train')`` on the CPU, forever."""
    block = WINDOW - 1
    while True:
        data = np.memmap(path, dtype=np.uint16, mode="r")  # nanoGPT: a memmap per batch
        ix = torch.randint(len(data) - block, (BATCH,))
        x = torch.stack([torch.from_numpy((data[i:i + block]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block]).astype(np.int64))
                         for i in ix])
        yield x, y


def measure(benchmark, batches) -> None:
    it = iter(batches)

    def rounds():
        for _ in range(PER_ROUND):
            x = next(it)[0]
        assert tuple(x.shape) == (BATCH, WINDOW - 1)

    benchmark.pedantic(rounds, rounds=ROUNDS, warmup_rounds=WARMUP)


@pytest.mark.parametrize("case", sorted(NAMES))
def test_get_batch(benchmark, record_ratio, tokens, case):
    benchmark.group = GROUP
    measure(benchmark, get_batches(tokens))
    record_ratio(NAMES[case], "baseline")


@pytest.mark.parametrize("case", sorted(NAMES))
def test_zephon_windows_map(zephon_benchmark, record_ratio, tokens, case):
    from zephon import Pipeline, RuntimeOptions, sources

    zephon_benchmark.benchmark.group = GROUP
    pipe = Pipeline(sources.token_windows(tokens, WINDOW), num_epochs=None) \
        .map(to_xy).batch(BATCH)
    if case == "process2":
        pipe = pipe.options(RuntimeOptions(runner="process", max_workers=2,
                                           worker_allocation="per_stage_fixed"))
    result = zephon_benchmark(pipe, batches=PER_ROUND * ROUNDS, rounds=ROUNDS,
                              warmup=PER_ROUND * WARMUP)
    assert result.rows_per_batch == BATCH
    record_ratio(NAMES[case], "subject", target=2.0)
