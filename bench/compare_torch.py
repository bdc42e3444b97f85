"""Side-by-side: zephon with its default options vs torch, torchdata, Grain and SPDL.

    python bench/compare_torch.py            # every row, 3 repetitions (10-15 minutes)
    python bench/compare_torch.py --quick    # 4 KiB / 4 MiB / 64 MiB, one repetition
    python bench/compare_torch.py --only 4mib --reps 5   # rows whose name matches

Every row runs in a **fresh process** (``python compare_torch.py --row JSON``), so
no loader inherits another's warm pages, imports or leftover workers; each row is
repeated (``--reps``, 3 by default) and the table shows medians. Ratios are taken
between rows of the same run only: absolute numbers on a shared machine are noise.

Workload (the same for every loader): 2 spawn workers; sample ``i`` is
``{"tokens": base + i, "seq": i}`` (``base`` an int64 array of the row's item size,
one NumPy op in the worker), then ``add_one`` (another NumPy op) as the map;
the main process touches one element of each item and drops it.

- ``zephon``: ``Pipeline(from_callable(n, load)).map(add_one, parallelism=2)``,
  **default options** (what a user writes); ``chunk=K`` rows set ``chunk_size=K``
  (to find the best hand-tuned one), ``1 worker`` rows a single process worker,
  ``copy (no heap)`` rows run with ``ZEPHON_WORKER_SHARED_HEAP=0`` (results copied
  into the arena, as before the shared heap);
- ``pool``: zephon's bare ``WorkerPool`` (no pipeline), 4 tasks in flight per worker;
- ``torch``: ``DataLoader(dataset, num_workers=2, batch_size=None,
  multiprocessing_context="spawn")`` over a map-style dataset doing load + map;
- ``torchdata``: ``StatefulDataLoader`` with the same arguments;
- ``grain``: ``MapDataset.range(n).map(...).to_iter_dataset().mp_prefetch(2 workers)``;
- ``spdl``: ``iterate_in_subprocess`` of an SPDL pipeline (2 threads) with a
  ``SharedMemorySegmentPool`` arena (its zero-copy shared-memory path);
- ``batch256``: 4 KiB samples ``.batch(256)`` (zephon, default options) against
  ``DataLoader(batch_size=256)`` collating the same samples; rate in samples/s.

Each row moves about 3 GiB (1 GiB with ``--quick``; at least 48 items, at most
20,000 for a peer and 200,000 for zephon, whose 20,000 small items took 0.4 s:
too short a window on a shared machine): every loader's rate still climbs over
its first few hundred MiB (fresh pages in its heaps and shared memory), and the
bars are about the steady state of an epoch, not its start.

The table gives time to the first item (from building the loader: worker
start-up included), steady GiB/s and items/s from a 10 % warm-up to the last
item, the time from the last item until the loader is exhausted and closed
(``end``: worker shutdown), and the ratios the performance bars are stated in. The last line is machine-readable
``key=value`` pairs. Optional peers (``python -m pip install -e ".[bench]"``) get rows when
importable; a missing one is named in the output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared row runner
from _fresh import run_in_child  # noqa: E402

TOKENS = (4 << 20) // 8  # int64 elements in a 4 MiB batch
SMALL = 4096 // 8  # int64 elements in a 4 KiB item
ITEMS_PER_MESSAGE = 256
KIB, MIB = 1 << 10, 1 << 20

_base: np.ndarray | None = None


def _base_array(n: int) -> np.ndarray:
    global _base
    if _base is None or _base.size != n:
        _base = np.arange(n, dtype=np.int64)
    return _base


# -- the workload (module level: picklable into spawn workers) ------------------------------

def make_batch(i: int) -> dict:
    """A 4 MiB sample (the WorkerPool rows and bench/test_bench_transport.py)."""
    return {"tokens": _base_array(TOKENS) + i, "seq": i}


def make_small_items(start: int) -> list:
    """``ITEMS_PER_MESSAGE`` 4 KiB samples in one message (bench/test_bench_transport.py)."""
    base = _base_array(SMALL)
    return [{"tokens": base + (start + k), "seq": start + k} for k in range(ITEMS_PER_MESSAGE)]


def add_one(sample: dict) -> dict:
    return {"tokens": sample["tokens"] + 1, "seq": sample["seq"]}


class SizedSamples:
    """``load(i)``: a sample of ``elements`` int64."""

    def __init__(self, elements: int) -> None:
        self.elements = elements

    def __call__(self, i: int) -> dict:
        return {"tokens": _base_array(self.elements) + i, "seq": i}


class LoadAndMap:
    """``add_one(load(i))``: what every peer runs per sample."""

    def __init__(self, elements: int) -> None:
        self.load = SizedSamples(elements)

    def __call__(self, i: int) -> dict:
        return add_one(self.load(i))


class SizedDataset:
    """Map-style dataset for the DataLoaders: the same load and map per item."""

    def __init__(self, n: int, elements: int) -> None:
        self.n, self.fn = n, LoadAndMap(elements)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.fn(int(i))


class BatchDataset:
    """Map-style dataset of bare samples (bench/test_bench_transport.py)."""

    def __init__(self, n: int, elements: int) -> None:
        self.n, self.elements = n, elements

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"tokens": _base_array(self.elements) + i, "seq": i}


def _spdl_source(n: int, elements: int):
    """What SPDL's subprocess iterates: its own pipeline, two threads running the map."""
    from spdl.pipeline import PipelineBuilder

    fn = LoadAndMap(elements)
    return (PipelineBuilder().add_source(range(n)).pipe(fn, concurrency=2)
            .add_sink(4).build(num_threads=2))


class _SpdlIterable:
    def __init__(self, n: int, elements: int) -> None:
        self.n, self.elements = n, elements

    def __iter__(self):
        pipeline = _spdl_source(self.n, self.elements)
        with pipeline.auto_stop():
            yield from pipeline


def _spdl_factory(n: int, elements: int):
    return _SpdlIterable(n, elements)


# -- loaders: each returns (iterable, close) --------------------------------------------------

def loader_zephon(n: int, elements: int, chunk_size: int | None = None, workers: int = 2,
                  batch: int | None = None):
    from zephon import Pipeline, RuntimeOptions, sources

    extra = {} if chunk_size is None else {"chunk_size": chunk_size}
    pipe = Pipeline(sources.from_callable(n, SizedSamples(elements)), **extra) \
        .map(add_one, parallelism=workers)
    if workers == 1:  # one worker would run inline (in this process): ask for a process
        pipe = pipe.options(RuntimeOptions(runner="process"))
    if batch:
        pipe = pipe.batch(batch)
    it = iter(pipe)
    return it, it.close


def loader_pool(n: int, elements: int, depth: int = 8):
    from zephon.transport import WorkerPool

    pool = WorkerPool(SizedSamples(elements), 2).start(wait=False)

    def results():
        submitted = 0
        for _ in range(min(depth, n)):
            pool.submit(submitted)
            submitted += 1
        for _ in range(n):
            value = pool.get().value
            if submitted < n:
                pool.submit(submitted)
                submitted += 1
            yield value

    return results(), pool.close


def _dataloader(cls, n: int, elements: int, batch: int | None = None):
    loader = cls(SizedDataset(n, elements), num_workers=2, batch_size=batch,
                 multiprocessing_context="spawn")
    return iter(loader), lambda: None


def loader_torch(n: int, elements: int, batch: int | None = None):
    import torch.utils.data as tud

    return _dataloader(tud.DataLoader, n, elements, batch)


def loader_torchdata(n: int, elements: int, batch: int | None = None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return _dataloader(StatefulDataLoader, n, elements, batch)


def loader_grain(n: int, elements: int):
    import grain

    ds = grain.MapDataset.range(n).map(LoadAndMap(elements)).to_iter_dataset() \
        .mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    it = iter(ds)
    return it, getattr(it, "close", lambda: None)


def loader_spdl(n: int, elements: int):
    import functools
    import multiprocessing

    from spdl.pipeline import SharedMemorySegmentPool, iterate_in_subprocess

    # The arena's condition must come from the same (spawn) context as the subprocess.
    multiprocessing.set_start_method("spawn", force=True)
    arena = SharedMemorySegmentPool(elements * 8 + (1 << 16), 8)
    iterable = iterate_in_subprocess(functools.partial(_spdl_factory, n, elements),
                                     buffer_size=3, mp_context="spawn", arena=arena)
    it = iter(iterable)
    return it, getattr(it, "close", lambda: None)


LOADERS = {"zephon": loader_zephon, "pool": loader_pool, "torch": loader_torch,
           "torchdata": loader_torchdata, "grain": loader_grain, "spdl": loader_spdl}
PEER_MODULES = {"torch": "torch", "torchdata": "torchdata", "grain": "grain", "spdl": "spdl"}


def check_item(item) -> None:
    tokens = item["tokens"]
    assert int(tokens.reshape(-1)[1]) >= 1


def run_row(spec: dict) -> dict:
    """Run one row in this process: ``{"first_s", "bytes_per_s", "items_per_s", "end_s"}``.

    The steady rate runs from the end of the warm-up to the **last item**: what a loader
    does after it (shutting its workers down when the iterator is exhausted, then
    ``close()``) is not part of an epoch's steady state, and loaders differ in whether
    they do it before or after their ``StopIteration`` (zephon, torch and SPDL before it;
    the bare pool loop not at all). That time is reported as ``end_s`` instead.
    """
    n, elements = spec["n"], spec["elements"]
    batch = spec.get("kw", {}).get("batch") or 1
    t0 = time.perf_counter()
    items, close = LOADERS[spec["loader"]](n, elements, **spec.get("kw", {}))
    warmup = max(1, (n // batch) // 10)
    got, first, t_steady, t_last = 0, float("nan"), t0, t0
    try:
        for item in items:
            check_item(item)
            got += 1
            t_last = time.perf_counter()
            if got == 1:
                first = t_last - t0
            if got == warmup:
                t_steady = t_last
            del item
    finally:
        close()
    end = time.perf_counter() - t_last
    elapsed = t_last - t_steady
    steady = (got - warmup) * batch
    return {"first_s": first, "items_per_s": steady / elapsed,
            "bytes_per_s": steady * elements * 8 / elapsed, "items": got * batch,
            "end_s": end}


def copy_bandwidth() -> float:
    """``np.copyto`` of 256 MiB (pre-faulted, best of 5): the DRAM copy bandwidth."""
    src = np.ones((256 << 20) // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best


# -- the plan of rows -------------------------------------------------------------------------

def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def _key(nbytes: int) -> str:
    return _size(nbytes).replace(" ", "").lower()


def _count(nbytes: int, budget: int, cap: int = 20_000) -> int:
    """Items per row: about ``budget`` bytes, at least 48 items (the steady rate is taken
    after a 10 % warm-up: with a dozen items, what two workers computed while the first
    item was on its way would pass for the steady rate), at most ``cap``: 20,000 for the
    peers (about 1,000 small items per second: 20 s a row), :data:`ZEPHON_CAP` for
    zephon's own rows (20,000 4 KiB items took it 0.4 s, too short a window to tell its
    rows apart on a shared machine)."""
    return int(min(cap, max(48, budget // nbytes)))


#: the most items one of zephon's rows (or the bare pool's) moves
ZEPHON_CAP = 200_000


def plan(quick: bool, peers: list[str]) -> list[dict]:
    """Every row to run: ``{"name", "loader", "n", "elements", "kw"}``."""
    budget = (1024 if quick else 3072) * MIB
    sizes = [4 * KIB, 4 * MIB, 64 * MIB] if quick else \
        [4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
    chunk_rows = {4 * KIB: (16, 256, 1024), 4 * MIB: (2, 8, 256), 64 * MIB: (1, 2, 8)}
    rows = []
    for nbytes in sizes:
        n, elements, key = _count(nbytes, budget, ZEPHON_CAP), nbytes // 8, _key(nbytes)
        n_peer = _count(nbytes, budget)
        if nbytes == 256 * MIB:
            n = 8 if not quick else 4  # no stall check, zephon only (2 GiB per repetition)
            rows.append({"name": f"zephon {key} defaults", "loader": "zephon", "n": n,
                         "elements": elements})
            continue
        rows.append({"name": f"zephon {key} defaults", "loader": "zephon", "n": n,
                     "elements": elements})
        for chunk in chunk_rows.get(nbytes, ()):
            rows.append({"name": f"zephon {key} chunk={chunk}", "loader": "zephon", "n": n,
                         "elements": elements, "kw": {"chunk_size": chunk}})
        if nbytes in (4 * MIB, 64 * MIB):  # before/after the shared heap, same run
            rows.append({"name": f"zephon {key} copy (no heap)", "loader": "zephon", "n": n,
                         "elements": elements, "env": {"ZEPHON_WORKER_SHARED_HEAP": "0"}})
        if nbytes == 4 * MIB:
            rows.append({"name": f"zephon {key} 1 worker", "loader": "zephon", "n": n,
                         "elements": elements, "kw": {"workers": 1}})
            rows.append({"name": f"pool {key}", "loader": "pool", "n": n,
                         "elements": elements})
        for peer in peers:
            rows.append({"name": f"{peer} {key}", "loader": peer, "n": n_peer,
                         "elements": elements})
    n_batched = 12_800 if quick else 51_200
    rows.append({"name": "zephon 4kib batch256 defaults", "loader": "zephon", "n": n_batched,
                 "elements": SMALL, "kw": {"batch": 256}})
    for peer in ("torch", "torchdata"):
        if peer in peers:
            rows.append({"name": f"{peer} 4kib batch256", "loader": peer, "n": n_batched,
                         "elements": SMALL, "kw": {"batch": 256}})
    return rows


def run_fresh(spec: dict, timeout: float) -> dict | None:
    """One row in a fresh interpreter; None (and the reason on stderr) if it failed."""
    env = {**os.environ, **spec.get("env", {})}
    result, stderr = run_in_child(str(Path(__file__).resolve()), spec, timeout, env,
                                  spec["name"], tail=5)
    if result is not None and "RuntimeWarning: zephon" in stderr:
        print(f"  {spec['name']}: {stderr.strip().splitlines()[-1]}", file=sys.stderr)
    return result


def median_row(results: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in results)
            for k in ("first_s", "bytes_per_s", "items_per_s", "end_s")}


def ratios(table: dict[str, dict], peers: list[str]) -> list[tuple[str, float]]:
    """The bars' ratios from the medians (only those whose rows all ran)."""
    out: list[tuple[str, float]] = []

    def rate(name: str) -> float | None:
        row = table.get(name)
        return None if row is None else row["items_per_s"]

    def add(key: str, num: str, den: str) -> None:
        a, b = rate(num), rate(den)
        if a is not None and b:
            out.append((key, a / b))

    for key in ("4kib", "64kib", "1mib", "4mib", "16mib", "64mib"):
        for peer in peers:
            add(f"{key}_vs_{peer}", f"zephon {key} defaults", f"{peer} {key}")
    for key in ("4kib", "4mib", "64mib"):
        chunks = [name for name in table if name.startswith(f"zephon {key} chunk=")]
        best = max((rate(c) or 0.0 for c in chunks), default=0.0)
        if best and rate(f"zephon {key} defaults"):
            out.append((f"{key}_default_vs_best_chunk",
                        (rate(f"zephon {key} defaults") or 0.0) / best))
    add("4mib_two_vs_one_worker", "zephon 4mib defaults", "zephon 4mib 1 worker")
    add("4mib_heap_vs_copy", "zephon 4mib defaults", "zephon 4mib copy (no heap)")
    add("64mib_heap_vs_copy", "zephon 64mib defaults", "zephon 64mib copy (no heap)")
    add("4mib_defaults_vs_pool", "zephon 4mib defaults", "pool 4mib")
    for peer in ("torch", "torchdata"):
        add(f"batch256_vs_{peer}", "zephon 4kib batch256 defaults", f"{peer} 4kib batch256")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 KiB, 4 MiB and 64 MiB only, fewer items, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per row (3)")
    parser.add_argument("--only", default="", help="run rows whose name contains this")
    parser.add_argument("--no-peers", action="store_true", help="zephon rows only")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per row run")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row, print JSON
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(json.loads(args.row))), flush=True)
        return 0
    reps = args.reps or (1 if args.quick else 3)
    available = [p for p, mod in PEER_MODULES.items() if importlib.util.find_spec(mod)]
    peers = [] if args.no_peers else available
    if args.quick:
        peers = [p for p in peers if p in ("torch", "spdl")]
    rows = [r for r in plan(args.quick, peers) if args.only in r["name"]]
    copy_bps = copy_bandwidth()
    results: dict[str, list[dict]] = {r["name"]: [] for r in rows}
    for rep in range(reps):  # interleaved: a slow phase of the machine hits every row
        for spec in rows:
            got = run_fresh(spec, args.timeout)
            if got is not None:
                results[spec["name"]].append(got)
        print(f"repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    table = {name: median_row(rs) for name, rs in results.items() if rs}

    gib = float(1 << 30)
    print(f"medians of {reps} run(s), each in a fresh process")
    print(f"{'row':<34} {'first item':>11} {'GiB/s':>8} {'items/s':>11} {'end':>9}")
    print(f"{'np.copyto 256 MiB (DRAM)':<34} {'':>11} {copy_bps / gib:>8.2f}")
    for spec in rows:
        row = table.get(spec["name"])
        if row is None:
            print(f"{spec['name']:<34} {'failed':>11}")
            continue
        print(f"{spec['name']:<34} {row['first_s']:>9.3f} s {row['bytes_per_s'] / gib:>8.2f} "
              f"{row['items_per_s']:>11.0f} {row['end_s']:>7.3f} s")
    for peer in PEER_MODULES:
        if peer not in available:
            print(f"{peer} is not installed (python -m pip install -e '.[bench]'): no {peer} rows")
    pairs = ratios(table, peers)
    if "pool 4mib" in table:
        pairs.append(("pool_4mib_memcpy_fraction", table["pool 4mib"]["bytes_per_s"] / copy_bps))
    print(" ".join(f"{k}={v:.3f}" for k, v in pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
