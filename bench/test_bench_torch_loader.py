"""Data wait per training step: zephon's torch loader vs torch's DataLoader.

    python -m pytest bench/test_bench_torch_loader.py [--enforce-ratios]

The same windows of a token file (bench/train_windows.py) feed the same tiny LM
training step. Each round is one step: the step itself runs untimed (pedantic
setup) and the timed part is the wait for the next batch, so the median is the
data wait per training step. Both sides use 2 spawn worker processes:
zephon ``RuntimeOptions(runner="process", max_workers=2)`` with
``zephon.torch.loader``; ``DataLoader(batch_size=32, num_workers=2,
persistent_workers=True)``. The ratio is DataLoader wait / zephon wait; the
bar is zephon's wait <= 0.5x the DataLoader's, i.e. ratio >= 2.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_windows as W  # noqa: E402

torch = pytest.importorskip("torch")

STEPS, WARMUP = 150, 20
NAME = "data_wait_per_step_vs_dataloader"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    return W.write_tokens(str(tmp_path_factory.mktemp("tokens") / "tokens.u16"))


def measure(benchmark, batches):
    model, optim = W.make_model()
    it = iter(batches)
    state = {"batch": next(it)}  # the first batch (start-up) is not a step's wait

    def step():
        W.train_step(model, optim, state["batch"])

    def wait():
        state["batch"] = next(it)

    benchmark.pedantic(wait, setup=step, rounds=STEPS, warmup_rounds=WARMUP)


def test_zephon_loader_data_wait(benchmark, record_ratio, token_file):
    import zephon.torch as zt
    from zephon import Pipeline, RuntimeOptions, sources

    benchmark.group = "data wait per training step (tiny LM, 32 x 256 tokens)"
    pipe = Pipeline(sources.token_windows(token_file, W.SEQ), seed=0, chunk_size=W.BATCH) \
        .map(W.to_xy).batch(W.BATCH) \
        .options(RuntimeOptions(runner="process", max_workers=2))
    loader = zt.loader(pipe)
    try:
        measure(benchmark, loader)
    finally:
        loader.close()
    record_ratio(NAME, "subject", target=2.0)


def test_torch_dataloader_data_wait(benchmark, record_ratio, token_file):
    tud = pytest.importorskip("torch.utils.data")
    benchmark.group = "data wait per training step (tiny LM, 32 x 256 tokens)"
    loader = tud.DataLoader(W.WindowDataset(token_file), batch_size=W.BATCH, shuffle=True,
                            num_workers=2, multiprocessing_context="spawn",
                            persistent_workers=True,
                            generator=torch.Generator().manual_seed(0))
    measure(benchmark, loader)
    del loader
    record_ratio(NAME, "baseline")
