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
  ``map(add_one, parallelism=2)`` with **default options** (auto runner: process,
  2 workers; chunk_size 64; shuffle on), against the DataLoader over a
  map-style dataset doing the same load and map; a row with a hand-tuned
  ``chunk_size=2`` beside it, and one with a single worker;
- sizes: the same e2e at 64 KiB, 1 MiB, 16 MiB and 64 MiB items, default options,
  against the DataLoader;
- batched: 4 KiB samples, ``map -> batch(256)`` (default options) against
  ``DataLoader(batch_size=256)`` collating the same samples;

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


class SizedSamples:
    """``load(i)``: a sample of ``elements`` int64 (picklable, module level)."""

    def __init__(self, elements: int) -> None:
        self.elements = elements

    def __call__(self, i: int) -> dict:
        return {"tokens": _base_array(self.elements) + i, "seq": i}


class SizedDataset:
    """The DataLoader's side of a sized e2e row: the same load and map per item."""

    def __init__(self, n: int, elements: int) -> None:
        self.n, self.load = n, SizedSamples(elements)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return add_one(self.load(i))


def check_sample(item) -> None:
    tokens = item["tokens"]
    assert int(tokens.reshape(-1)[1]) >= 1


def run_pipeline(n: int, warmup: int, elements: int = TOKENS, name: str | None = None,
                 chunk_size: int | None = None, workers: int = 2) -> Row:
    """A ``from_callable -> map`` pipeline with default options (only ``parallelism`` on
    the map, as a user writes it); ``chunk_size`` to compare with a hand-tuned one."""
    from zephon import Pipeline, sources

    extra = {} if chunk_size is None else {"chunk_size": chunk_size}
    pipe = (Pipeline(sources.from_callable(n, SizedSamples(elements)), **extra)
            .map(add_one, parallelism=workers))
    if workers == 1:  # one worker would run inline (in this process): ask for a process
        from zephon import RuntimeOptions

        pipe = pipe.options(RuntimeOptions(runner="process"))
    label = name or f"zephon e2e, {_size(elements * 8)}, defaults"
    t0 = time.perf_counter()
    return timed(Row(label), pipe, t0, warmup, elements * 8, check_sample)


def run_pipeline_batched(n_items: int, batch: int = 256) -> Row:
    from zephon import Pipeline, sources

    pipe = (Pipeline(sources.from_callable(n_items, SizedSamples(SMALL)))
            .map(add_one, parallelism=2).batch(batch))
    t0 = time.perf_counter()
    row = timed(Row(f"zephon 4 KiB, batch({batch}), defaults"), pipe, t0, 4,
                SMALL * 8 * batch, check_sample)
    row.items_per_s *= batch  # samples per second
    return row


def run_torch_batched(n_items: int, batch: int = 256) -> Row:
    import torch.utils.data as tud

    loader = tud.DataLoader(SizedDataset(n_items, SMALL), num_workers=2, batch_size=batch,
                            multiprocessing_context="spawn")
    t0 = time.perf_counter()
    row = timed(Row(f"torch 4 KiB, batch_size={batch}"), loader, t0, 4, SMALL * 8 * batch,
                check_sample)
    row.items_per_s *= batch
    return row


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


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
    e2e_tuned = run_pipeline(n, warmup, name="zephon e2e, 4 MiB, chunk_size=2", chunk_size=2)
    e2e_one = run_pipeline(n, warmup, name="zephon e2e, 4 MiB, 1 process worker",
                           workers=1)
    # (item bytes, items per row): about 1.5 GiB per row (less in --quick)
    sizes = [(64 << 10, 24_000), (1 << 20, 1_600), (16 << 20, 96), (64 << 20, 24)]
    if args.quick:
        sizes = [(nbytes, max(12, count // 8)) for nbytes, count in sizes]
    sized = [(nbytes, run_pipeline(count, max(2, count // 10), nbytes // 8))
             for nbytes, count in sizes]
    batched_items = 51_200 if not args.quick else 12_800
    batched = run_pipeline_batched(batched_items)
    have_torch = importlib.util.find_spec("torch") is not None
    torch_row = torch_small = torch_e2e = torch_batched = None
    torch_sized: list = []
    if have_torch:
        torch_row = run_torch(n, warmup, TOKENS, "torch DataLoader")
        torch_small = run_torch(n_small, max(50, n_small // 20), SMALL,
                                "torch DataLoader, 4 KiB items")
        torch_e2e = run_torch(n, warmup, TOKENS, "torch DataLoader e2e (load + map)",
                              dataset=E2EDataset(n))
        torch_sized = [run_torch(count, max(2, count // 10), nbytes // 8,
                                 f"torch e2e, {_size(nbytes)}",
                                 dataset=SizedDataset(count, nbytes // 8))
                       for nbytes, count in sizes]
        torch_batched = run_torch_batched(batched_items)
    peers = [name for name in ("grain", "spdl") if importlib.util.find_spec(name)]
    resume = {chain: run_resume(chain) for chain in ("cursor", "shuffle")}

    gib = float(1 << 30)
    print(f"{'row':<34} {'first batch':>12} {'GiB/s':>8} {'items/s':>10}")
    print(f"{'np.copyto 256 MiB (DRAM)':<34} {'':>12} {copy_bps / gib:>8.2f} {'':>10}")
    rows = [zephon, torch_row, zephon_small, torch_small, e2e, e2e_tuned, e2e_one, torch_e2e]
    for k, (_, row) in enumerate(sized):
        rows += [row, torch_sized[k] if torch_sized else None]
    rows += [batched, torch_batched]
    for row in rows:
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

    pairs = [("memcpy_fraction", zephon.bytes_per_s / copy_bps),
             ("default_vs_tuned_chunk_4mib", e2e.bytes_per_s / e2e_tuned.bytes_per_s),
             ("two_vs_one_worker_4mib", e2e.bytes_per_s / e2e_one.bytes_per_s)]
    if have_torch:
        pairs = [
            ("throughput_ratio", zephon.bytes_per_s / torch_row.bytes_per_s),
            pairs[0],
            ("first_batch_ratio", zephon.first_s / torch_row.first_s),
            ("small_batch_ratio", zephon_small.items_per_s / torch_small.items_per_s),
            ("e2e_throughput_ratio", e2e.bytes_per_s / torch_e2e.bytes_per_s),
            ("e2e_first_batch_ratio", e2e.first_s / torch_e2e.first_s),
        ] + pairs[1:]
        pairs += [(f"e2e_{_size(nbytes).replace(' ', '').lower()}_vs_torch",
                   row.bytes_per_s / torch_sized[k].bytes_per_s)
                  for k, (nbytes, row) in enumerate(sized)]
        pairs.append(("batch256_4kib_vs_torch", batched.items_per_s / torch_batched.items_per_s))
    pairs += [(f"resume_{chain}_vs_fresh_first_batch", restored / fresh)
              for chain, (restored, fresh) in resume.items()]
    print(" ".join(f"{k}={v:.3f}" for k, v in pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
