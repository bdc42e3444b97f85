"""litdata corpora: zephon's ``sources.litdata`` on 2 workers against litdata's own
``StreamingDataLoader`` on 2 workers.

    python -m pytest bench/test_bench_format_litdata.py --benchmark-only [--enforce-ratios]

Two corpora written by ``litdata.optimize`` (in a subprocess: optimize sets the start
method of its whole process, here ``fork``, whose semaphores are never named in
/dev/shm), read in order by both loaders, batches of fixed-size fields so that litdata's
default collation (torch's) takes every batch:

- ``items``: 10^5 dicts ``{"id", "label": int, "score": float, "text": str,
  "tokens": int32 (128,), "emb": float32 (4, 16)}`` in chunks of 4 MB, batches of 64;
  litdata: ``StreamingDataLoader(StreamingDataset(dir), batch_size=64, num_workers=2)``;
  zephon: ``Pipeline(litdata(dir), shuffle=False, num_epochs=None).batch(64)`` on 2
  process workers (``worker_allocation="per_stage_fixed"``);
- ``tokens``: a ``TokensLoader`` corpus (uint16 documents), windows of 1024 tokens in
  batches of 16; litdata: ``StreamingDataset(dir, item_loader=TokensLoader(1024))``.

A round is 640 batches of items (41k items) or 1,024 batches of windows of a running
loader (its start is warm-up; litdata's workers are persistent, so an epoch's end costs it
no new workers), about two of the messages zephon's workers send (up to 16 MB of batches
each): the ratio is litdata's time per round over zephon's. The bar is 1.2x.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

ld = pytest.importorskip("litdata")
torch = pytest.importorskip("torch")

ITEMS, PER_INPUT, BATCH = 100_000, 10_000, 64
DOCS, DOCS_PER_INPUT, BLOCK, TOKEN_BATCH = 14_000, 1_000, 1024, 16
#: batches per round: about two of zephon's messages (a fused read -> batch stage sends up
#: to 16 MB of batches a message: ~300 batches of items, 512 of windows), so that a round
#: measures the steady flow and not the slicing of a message that already arrived
PER_ROUND = {"items": 640, "tokens": 1024}
ROUNDS, WARMUP = 6, 2
GROUP = "litdata corpus read in order: time per round (640 or 1024 batches), 2 workers each"
NAMES = {"items": "litdata_items_process2_vs_loader", "tokens": "litdata_tokens_process2_vs_loader"}


def records(k: int):
    """optimize's ``fn``: input ``k`` yields items ``k * PER_INPUT ...``."""
    emb = np.arange(64, dtype=np.float32).reshape(4, 16)
    for i in range(k * PER_INPUT, (k + 1) * PER_INPUT):
        yield {"id": i, "label": i % 10, "score": i / 3, "text": f"item number {i}",
               "tokens": (np.arange(128, dtype=np.int32) + i) % 50_000, "emb": emb + i}


def documents(k: int):
    for d in range(k * DOCS_PER_INPUT, (k + 1) * DOCS_PER_INPUT):
        yield ((np.arange(d % 1500 + 500) * 7 + d) % 50_000).astype(np.uint16)


WRITER = """
import sys
sys.path.insert(0, {here!r})
import litdata
from litdata.streaming.item_loader import TokensLoader
import test_bench_format_litdata as B

litdata.optimize(fn=B.records, inputs=list(range(B.ITEMS // B.PER_INPUT)), output_dir={items!r},
                 chunk_bytes="4MB", num_workers=1, start_method="fork", verbose=False)
litdata.optimize(fn=B.documents, inputs=list(range(B.DOCS // B.DOCS_PER_INPUT)),
                 output_dir={tokens!r}, chunk_size=1 << 20, item_loader=TokensLoader(),
                 num_workers=1, start_method="fork", verbose=False)
"""


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("litdata")
    paths = {"items": str(root / "items"), "tokens": str(root / "tokens")}
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", WRITER.format(here=here, **paths)],
                          capture_output=True, text=True, timeout=500, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return paths


def litdata_batches(path: str, case: str):
    """litdata's own loader on 2 workers, epoch after epoch."""
    from litdata.streaming.item_loader import TokensLoader

    if case == "tokens":
        ds = ld.StreamingDataset(input_dir=path, item_loader=TokensLoader(BLOCK))
        loader = ld.StreamingDataLoader(ds, batch_size=TOKEN_BATCH, num_workers=2,
                                        persistent_workers=True)
    else:
        ds = ld.StreamingDataset(input_dir=path)
        loader = ld.StreamingDataLoader(ds, batch_size=BATCH, num_workers=2,
                                        persistent_workers=True)
    while True:
        it = iter(loader)
        try:
            yield from it
        finally:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()


def zephon_pipe(path: str, case: str):
    from zephon import Pipeline, RuntimeOptions
    from zephon.pipeline.sources.litdata import litdata

    src = litdata(path, block_size=BLOCK) if case == "tokens" else litdata(path)
    pipe = Pipeline(src, shuffle=False, num_epochs=None)
    pipe = pipe.batch(TOKEN_BATCH if case == "tokens" else BATCH)
    return pipe.options(RuntimeOptions(runner="process", max_workers=2,
                                       worker_allocation="per_stage_fixed"))


def measure(benchmark, batches, case: str) -> None:
    it = iter(batches)
    want = (TOKEN_BATCH, BLOCK) if case == "tokens" else (BATCH, 128)

    def rounds():
        for _ in range(PER_ROUND[case]):
            batch = next(it)
        assert tuple(batch["tokens"].shape) == want

    benchmark.pedantic(rounds, rounds=ROUNDS, warmup_rounds=WARMUP)


@pytest.mark.parametrize("case", sorted(NAMES))
def test_litdata_loader(benchmark, record_ratio, corpora, case):
    benchmark.group = GROUP
    batches = litdata_batches(corpora[case], case)
    try:
        measure(benchmark, batches if case != "tokens" else ({"tokens": b} for b in batches),
                case)
    finally:
        batches.close()
    record_ratio(NAMES[case], "baseline")


@pytest.mark.parametrize("case", sorted(NAMES))
def test_zephon_litdata(benchmark, record_ratio, corpora, case):
    benchmark.group = GROUP
    it = iter(zephon_pipe(corpora[case], case))
    try:
        measure(benchmark, it, case)
    finally:
        it.close()
    record_ratio(NAMES[case], "subject", target=1.2)
