"""Lance: zephon's ``sources.lance`` on 2 worker processes against Lance's own torch loader.

    python -m pytest bench/test_bench_format_lance.py --benchmark-only -q [--enforce-ratios]

The corpus (written by ``lance.write_dataset``): 1,200,000 rows in 8 fragments, with
the columns Lance's torch loader converts (its ``_to_tensor`` takes numbers and
fixed-size lists of numbers only): ``id`` int64, ``label`` int32, ``score`` float32,
``emb`` fixed_size_list<float32>[32]; 5% of the rows deleted (deletion files), so both
sides skip deleted rows.

- baseline: ``lance.torch.data.LanceDataset(ds, batch_size=B, columns=...)`` (an
  ``IterableDataset`` that yields whole batches: each worker scans the fragments
  ``rank::world`` with Lance's readahead, rank and world taken from
  ``get_worker_info``) in a ``torch.utils.data.DataLoader(batch_size=None,
  num_workers=2, multiprocessing_context="spawn", persistent_workers=True)``: spawn as
  Lance's own ``get_safe_loader`` sets it up (its Rust runtime is not fork-safe) and as
  zephon's workers start; batches are dicts of tensors;
- zephon: ``Pipeline(sources.lance(path, columns=...), shuffle=False,
  num_epochs=None, chunk_size=B).batch(B)`` with ``RuntimeOptions(runner="process",
  max_workers=2, worker_allocation="per_stage_fixed")``: each micro-batch is one
  columnar read (``get_batch``) in a worker; batches are dicts of NumPy arrays.

Both read the rows in fragment order, unshuffled, epoch after epoch (an epoch is ~4,450
batches). A round is 1,000 batches of 256 rows of a running loader (its start and 2
rounds are warm-up): long enough that what a loader had buffered ahead does not decide
a round (zephon's process runner reads well ahead: rounds of 200 batches gave it
medians of a few ms, bursts from its buffer). The ratio is Lance's time per round over
zephon's; the bar is 1.2x.
"""

from __future__ import annotations

import numpy as np
import pytest

lance_lib = pytest.importorskip("lance")
pa = pytest.importorskip("pyarrow")
torch = pytest.importorskip("torch")

from zephon import Pipeline, RuntimeOptions  # noqa: E402
from zephon.pipeline.sources.lance import lance  # noqa: E402

ROWS, FRAGMENT, DIM, BATCH = 1_200_000, 150_000, 32, 256
PER_ROUND, ROUNDS, WARMUP = 1000, 8, 2
COLUMNS = ["id", "label", "score", "emb"]
GROUP = "lance rows, 2 workers: time per 1,000 batches of 256"
NAME = "lance_process2_vs_lance_torch"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lance") / "bench.lance")
    rng = np.random.default_rng(0)
    ids = np.arange(ROWS, dtype=np.int64)
    table = pa.table({
        "id": ids,
        "label": pa.array((ids % 1000).astype(np.int32)),
        "score": pa.array(rng.random(ROWS, dtype=np.float32)),
        "emb": pa.FixedSizeListArray.from_arrays(
            pa.array(rng.random(ROWS * DIM, dtype=np.float32)), DIM),
    })
    lance_lib.write_dataset(table, path, max_rows_per_file=FRAGMENT)
    lance_lib.dataset(path).delete("id % 20 = 7")
    return path


def measure(benchmark, batches) -> None:
    it = iter(batches)
    next(it)  # the loader's start-up (spawning its workers) is not what is measured

    def rounds():
        for _ in range(PER_ROUND):
            batch = next(it)
        assert tuple(batch["emb"].shape) == (BATCH, DIM)

    benchmark.pedantic(rounds, rounds=ROUNDS, warmup_rounds=WARMUP)


def lance_batches(path):
    """Lance's torch loader with 2 spawn workers, epoch after epoch."""
    from lance.torch.data import LanceDataset

    dataset = LanceDataset(lance_lib.dataset(path), batch_size=BATCH, columns=COLUMNS)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         multiprocessing_context="spawn",
                                         persistent_workers=True)
    while True:
        yield from loader


def test_lance_torch_loader(benchmark, record_ratio, corpus):
    benchmark.group = GROUP
    measure(benchmark, lance_batches(corpus))
    record_ratio(NAME, "baseline")


def test_zephon_lance_process2(benchmark, record_ratio, corpus):
    benchmark.group = GROUP
    pipe = Pipeline(lance(corpus, columns=COLUMNS), shuffle=False, num_epochs=None,
                    chunk_size=BATCH).batch(BATCH).options(
        RuntimeOptions(runner="process", max_workers=2, worker_allocation="per_stage_fixed"))
    it = iter(pipe)
    try:
        measure(benchmark, it)
    finally:
        it.close()
    record_ratio(NAME, "subject", target=1.2)
