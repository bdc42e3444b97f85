"""Image decode per batch: zephon's default options vs torch's DataLoader.

    python -m pytest bench/test_bench_workloads.py [--enforce-ratios]

The image workload of ``bench/compare_workloads.py`` on a small generated ImageFolder
(320 JPEGs of 500x375 or 375x500): PIL decode, RandomResizedCrop(224), flip, normalise
to float32 CHW, batches of 64, 2 spawn worker processes. zephon:
``Pipeline(from_sequence(files), num_epochs=None).map(decode_file, parallelism=2)
.batch(64)`` (default options: the process runner); torch: ``DataLoader(batch_size=64,
shuffle=True, num_workers=2, persistent_workers=True, spawn)``, its epochs chained. Each
round is the wait for the next batch of a running loader (start-up is warm-up), so the
median is the time per batch of 64 images. The ratio is DataLoader time / zephon time;
the bar (issue 29) is 1.2x.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_workloads as cw  # the workload itself

pytest.importorskip("PIL")

IMAGES, ROUNDS, WARMUP = 320, 30, 8
NAME = "image_decode_batch_vs_dataloader"
GROUP = "image decode: time per batch of 64 (PIL, RandomResizedCrop, 2 workers)"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("images")
    cw._make_images(IMAGES, out)
    return str(out / "folder")


def measure(benchmark, batches) -> None:
    it = iter(batches)

    def wait():
        assert tuple(next(it).shape) == (cw.IMAGE_BATCH, 3, cw.CROP, cw.CROP)

    benchmark.pedantic(wait, rounds=ROUNDS, warmup_rounds=WARMUP)


def _epochs(loader):
    while True:
        for images, _ in loader:
            yield images


def test_zephon_image_decode(benchmark, record_ratio, folder):
    from zephon import Pipeline, sources

    benchmark.group = GROUP
    pipe = Pipeline(sources.from_sequence(cw.image_files(folder)), num_epochs=None) \
        .map(cw.decode_file, parallelism=2).batch(cw.IMAGE_BATCH)
    it = iter(pipe)
    try:
        measure(benchmark, (b["image"] for b in it))
    finally:
        it.close()
    record_ratio(NAME, "subject", target=1.2)


def test_torch_dataloader_image_decode(benchmark, record_ratio, folder):
    torch = pytest.importorskip("torch")
    tud = pytest.importorskip("torch.utils.data")
    benchmark.group = GROUP
    loader = tud.DataLoader(cw.ImageFolderDataset(folder),
                            batch_size=cw.IMAGE_BATCH, shuffle=True, num_workers=2,
                            multiprocessing_context="spawn", persistent_workers=True,
                            generator=torch.Generator().manual_seed(0))

    measure(benchmark, _epochs(loader))
    del loader
    record_ratio(NAME, "baseline")
