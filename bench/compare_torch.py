"""Side-by-side: zephon's process transport vs torch.utils.data.DataLoader, one run.

    python bench/compare_torch.py [--batches 400] [--quick]

Workload (the same for every row): 2 spawn workers; each batch is
``{"tokens": base + i, "seq": i}`` with ``base`` a 4 MiB int64 array, made by
one NumPy op in the worker and consumed in the main process (one element
touched). Rows:

- copyto: ``np.copyto`` of a 256 MiB array (pre-faulted, best of 5): the DRAM
  copy bandwidth every throughput is compared with;
- zephon: ``WorkerPool`` with 4 batches in flight per worker;
- torch: ``DataLoader(num_workers=2, multiprocessing_context="spawn",
  batch_size=None)`` over a map-style dataset (its default: arrays become
  tensors in the worker and travel through shared memory);
- small items: 4 KiB items; zephon sends 256 items per message, torch one
  item per ``__getitem__`` (its own unit of work);
- e2e: a ``Pipeline`` over ``from_callable`` producing the 4 MiB samples, then
  ``map(add_one)``, process runner with 2 workers, ``deterministic=True``,
  against the DataLoader over a map-style dataset doing the same load and map.

- resume: the first batch after restoring a state taken at 90 % of an epoch, vs a
  fresh start of the same pipeline (the 200,000-sample pipelines of
  ``bench/test_bench_resume.py``: cursor-preserving, and with a shuffle buffer).

Time to first batch counts from creating the pool / the DataLoader iterator to
holding the first batch (worker start-up included). grain and spdl rows are
added when those packages are importable. The last line is machine-readable.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import numpy as np

TOKENS = (4 << 20) // 8  # int64 elements in a 4 MiB batch
SMALL = 4096 // 8  # int64 elements in a 4 KiB item
ITEMS_PER_MESSAGE = 256

_base: np.ndarray | None = None


def _base_array(n: int) -> np.ndarray:
    global _base
    if _base is None or _base.size != n:
        _base = np.arange(n, dtype=np.int64)
    return _base


def make_batch(i: int) -> dict:
    return {"tokens": _base_array(TOKENS) + i, "seq": i}


def make_small_items(start: int) -> list:
    base = _base_array(SMALL)
    return [{"tokens": base + (start + k), "seq": start + k} for k in range(ITEMS_PER_MESSAGE)]


def add_one(sample: dict) -> dict:
    return {"tokens": sample["tokens"] + 1, "seq": sample["seq"]}


class E2EDataset:
    """The end-to-end case for torch: the same load and the same map, per item."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return add_one(make_batch(i))


class BatchDataset:
    """Map-style dataset for the DataLoader (no torch import needed to define it)."""

    def __init__(self, n: int, elements: int) -> None:
        self.n, self.elements = n, elements

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"tokens": _base_array(self.elements) + i, "seq": i}


def copy_bandwidth() -> float:
    src = np.ones((256 << 20) // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the destination in first
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return src.nbytes / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Row:
    def __init__(self, name: str) -> None:
        self.name = name
        self.first_s = float("nan")
        self.bytes_per_s = float("nan")
        self.items_per_s = float("nan")
        self.note = ""


def timed(row: Row, items, t0: float, warmup: int, nbytes: int, check) -> Row:
    """Consume ``items``: time to the first one (from ``t0``), then the steady rate after
    ``warmup`` items."""
    got = 0
    for item in items:
        check(item)
        got += 1
        if got == 1:
            row.first_s = time.perf_counter() - t0
        if got == warmup:
            t_steady = time.perf_counter()
        del item
    elapsed = time.perf_counter() - t_steady
    row.items_per_s = (got - warmup) / elapsed
    row.bytes_per_s = (got - warmup) * nbytes / elapsed
    return row


def pool_results(pool, n: int, arg_of, depth: int = 8):
    """Values of ``n`` tasks, keeping ``depth`` of them in flight."""
    submitted = 0
    for _ in range(min(depth, n)):
        pool.submit(arg_of(submitted))
        submitted += 1
    for _ in range(n):
        value = pool.get().value
        if submitted < n:
            pool.submit(arg_of(submitted))
            submitted += 1
        yield value


def check_batch(batch) -> None:
    assert int(batch["tokens"][1]) - int(batch["seq"]) in (1, 2)


def run_zephon(n: int, warmup: int) -> Row:
    from zephon.transport import WorkerPool

    t0 = time.perf_counter()
    with WorkerPool(make_batch, 2) as pool:
        return timed(Row("zephon WorkerPool"), pool_results(pool, n, lambda i: i), t0, warmup,
                     TOKENS * 8, check_batch)


def run_zephon_small(n_items: int, warmup_msgs: int) -> Row:
    from zephon.transport import WorkerPool

    messages = n_items // ITEMS_PER_MESSAGE
    t0 = time.perf_counter()
    with WorkerPool(make_small_items, 2) as pool:
        items = (item for message in pool_results(
            pool, messages, lambda k: k * ITEMS_PER_MESSAGE) for item in message)
        row = timed(Row("zephon WorkerPool, 4 KiB items"), items, t0,
                    warmup_msgs * ITEMS_PER_MESSAGE, SMALL * 8, check_batch)
    row.first_s = float("nan")  # a message of 256 items, not one item: not comparable
    return row


def run_pipeline(n: int, warmup: int) -> Row:
    from zephon import Pipeline, RuntimeOptions, sources

    pipe = (Pipeline(sources.from_callable(n, make_batch), shuffle=False, chunk_size=2)
            .map(add_one, parallelism=2)
            .options(RuntimeOptions(runner="process", max_workers=2, deterministic=True)))
    t0 = time.perf_counter()
    return timed(Row("zephon Pipeline e2e (process, 2)"), pipe, t0, warmup, TOKENS * 8,
                 check_batch)


def run_torch(n: int, warmup: int, elements: int, name: str, dataset=None) -> Row:
    import torch.utils.data as tud

    dataset = dataset if dataset is not None else BatchDataset(n, elements)
    loader = tud.DataLoader(dataset, num_workers=2, batch_size=None,
                            multiprocessing_context="spawn")
    t0 = time.perf_counter()
    return timed(Row(name), loader, t0, warmup, elements * 8, check_batch)


def run_resume(chain: str, rounds: int = 7) -> tuple[float, float]:
    """Median seconds to the first batch: (restored at 90 % of the epoch, fresh start)."""
    import statistics

    import test_bench_resume as R

    R._chain[0] = chain
    state = R.state_at(chain, 0.9)
    restored = statistics.median(_timed(lambda: R.first_batch(state)) for _ in range(rounds))
    fresh = statistics.median(_timed(lambda: R.first_batch(None)) for _ in range(rounds))
    return restored, fresh


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=400, help="4 MiB batches per row")
    parser.add_argument("--small-items", type=int, default=20480, help="4 KiB items per row")
    parser.add_argument("--quick", action="store_true", help="fewer batches (smoke run)")
    args = parser.parse_args(argv)
    n, n_small = (60, 4096) if args.quick else (args.batches, args.small_items)
    warmup = max(5, n // 10)

    copy_bps = copy_bandwidth()
    zephon = run_zephon(n, warmup)
    zephon_small = run_zephon_small(n_small, 2)
    e2e = run_pipeline(n, warmup)
    have_torch = importlib.util.find_spec("torch") is not None
    torch_row = torch_small = torch_e2e = None
    if have_torch:
        torch_row = run_torch(n, warmup, TOKENS, "torch DataLoader")
        torch_small = run_torch(n_small, max(50, n_small // 20), SMALL,
                                "torch DataLoader, 4 KiB items")
        torch_e2e = run_torch(n, warmup, TOKENS, "torch DataLoader e2e (load + map)",
                              dataset=E2EDataset(n))
    peers = [name for name in ("grain", "spdl") if importlib.util.find_spec(name)]
    resume = {chain: run_resume(chain) for chain in ("cursor", "shuffle")}

    gib = float(1 << 30)
    print(f"{'row':<34} {'first batch':>12} {'GiB/s':>8} {'items/s':>10}")
    print(f"{'np.copyto 256 MiB (DRAM)':<34} {'':>12} {copy_bps / gib:>8.2f} {'':>10}")
    for row in (zephon, torch_row, zephon_small, torch_small, e2e, torch_e2e):
        if row is None:
            continue
        first = f"{row.first_s:.3f} s" if row.first_s == row.first_s else ""
        print(f"{row.name:<34} {first:>12} {row.bytes_per_s / gib:>8.2f} "
              f"{row.items_per_s:>10.0f}")
    for chain, (restored, fresh) in resume.items():
        print(f"{'zephon resume at 90%, ' + chain:<34} {restored:>10.3f} s   "
              f"(fresh start {fresh:.3f} s)")
    if not have_torch:
        print("torch is not installed (pip install -e '.[torch]'): zephon rows only")
    for name in ("grain", "spdl"):
        if name not in peers:
            print(f"{name} is not installed: no {name} row")

    pairs = [("memcpy_fraction", zephon.bytes_per_s / copy_bps)]
    if have_torch:
        pairs = [
            ("throughput_ratio", zephon.bytes_per_s / torch_row.bytes_per_s),
            pairs[0],
            ("first_batch_ratio", zephon.first_s / torch_row.first_s),
            ("small_batch_ratio", zephon_small.items_per_s / torch_small.items_per_s),
            ("e2e_throughput_ratio", e2e.bytes_per_s / torch_e2e.bytes_per_s),
            ("e2e_first_batch_ratio", e2e.first_s / torch_e2e.first_s),
        ]
    pairs += [(f"resume_{chain}_vs_fresh_first_batch", restored / fresh)
              for chain, (restored, fresh) in resume.items()]
    print(" ".join(f"{k}={v:.3f}" for k, v in pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
