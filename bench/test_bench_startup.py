"""Start-up over 10^4 shards with the shared index: time and objects read until the first batch.

    python -m pytest bench/test_bench_startup.py -p no:cacheprovider -s

The corpus: 10^4 small tar shards (one sample each: ``.txt`` + ``.cls``) in a local directory
and, on a moto S3 server on 127.0.0.1, ``ZEPHON_BENCH_S3_SHARDS`` shards (default 1,000: moto
takes about 6 ms per upload and 20 ms per indexed object here, so 10^4 costs minutes of
set-up alone; set it to 10000 for the full size) holding 10^4 samples in all. The shared
index is built once per corpus by ``python -m zephon index --workers W`` (its time is reported
as ``index_build_s``); every measured build afterwards is warm. ``W`` is
``ZEPHON_BENCH_INDEX_WORKERS`` (default 2).

What is measured (``extra_info`` holds the counts; no absolute time is asserted):

- ``test_first_batch_warm[local|s3]``: one process, ``Pipeline(sources.webdataset(...),
  shuffle=True).batch(8)``: time from building the source to the first batch, and the objects
  read by then: the index objects (``index_store.objects_read``), the shard files opened
  (local: ``sys.addaudithook`` "open" events under the corpus directory) or the requests the
  S3 server was sent (a recording TCP proxy in front of moto, tests/_s3_server.FaultProxy
  with no rule: LIST pages, GETs of the .zidx, of blobs, of shards). The first batch on a
  warm index should take <= 2 s: reported as ``first_batch_s``, not asserted.
- ``test_ranks_warm[...-R]``, R in 1, 16, 256, 1,024: simulated ranks, built one after the
  other in this process (``RuntimeOptions(world_size=R, global_rank=r,
  canonical_replicas=R)``, ``chunk_size=8`` so that each of 1,024 lanes owns a chunk of the
  10^4 samples): each rank builds its own source and reads its first batch; per rank, the
  objects it read. A rank is a process of its own in a real run, so between ranks the
  process's remote filesystem (``zephon.io.remote._FS``: s3fs's listing cache, connections)
  is dropped. ``ZEPHON_BENCH_RANKS`` ranks of each R are measured, spread over [0, R)
  (default 8; 0 = every rank: 1,297 builds, many minutes): per-rank counts do not depend on
  which rank it is, which is the claim shown (objects per rank constant as R grows).
- ``test_ranks_cold[...-R]``: the same with ``index=False`` for every rank of a small R: each
  rank opens every shard, so the objects read grow as R x shards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _tars import tar_bytes

from zephon import Pipeline, RuntimeOptions, sources

SHARDS = int(os.environ.get("ZEPHON_BENCH_SHARDS", "10000"))
SAMPLES = SHARDS  # in all, in each corpus
S3_SHARDS = int(os.environ.get("ZEPHON_BENCH_S3_SHARDS", "1000"))
RANKS_MEASURED = int(os.environ.get("ZEPHON_BENCH_RANKS", "8"))
INDEX_WORKERS = os.environ.get("ZEPHON_BENCH_INDEX_WORKERS", "2")
BATCH = 8
GROUP = "start-up: build + first batch of 8 over 10^4-sample tar shards"


# -- corpus ---------------------------------------------------------------------------------

def shard(k: int, per: int) -> bytes:
    members = []
    for j in range(per):
        i = k * per + j
        members += [(f"{i:06d}.txt", b"sample %d" % i), (f"{i:06d}.cls", b"%d" % (i % 10))]
    return tar_bytes(members)


def build_index(*args) -> float:
    """``python -m zephon index ARGS --workers INDEX_WORKERS``; its seconds. The process group
    is killed whatever happens."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "zephon", "index", *args,
                             "--workers", INDEX_WORKERS],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, err
    print(f"\n  {out.strip()} ({time.perf_counter() - t0:.1f} s)")
    return time.perf_counter() - t0


# -- counting what a rank reads -------------------------------------------------------------

class LocalOpens:
    """Files opened under ``root`` while active (audit event "open", every thread)."""

    _installed: "LocalOpens | None" = None

    def __init__(self, root: str) -> None:
        self.root, self.active, self.paths = root, False, []
        LocalOpens._installed = self
        if not getattr(LocalOpens, "_hooked", False):
            LocalOpens._hooked = True

            def hook(event, args):
                me = LocalOpens._installed
                if event == "open" and me is not None and me.active and args \
                        and isinstance(args[0], str) and args[0].startswith(me.root):
                    me.paths.append(args[0])

            sys.addaudithook(hook)

    def start(self) -> None:
        self.paths = []
        self.active = True

    def counts(self) -> dict:
        p = list(self.paths)
        return {"shards": sum(x.endswith(".tar") for x in p),
                "index_files": sum(x.endswith((".zidx", ".zblob")) for x in p),
                "other": sum(not x.endswith((".tar", ".zidx", ".zblob")) for x in p)}

    def stop(self) -> None:
        self.active = False


class S3Requests:
    """The requests the S3 server was sent through the recording proxy, since ``start``."""

    def __init__(self, proxy) -> None:
        self.proxy, self.mark = proxy, 0

    def start(self) -> None:
        with self.proxy.lock:
            self.mark = len(self.proxy.requests)
        import zephon.io.remote as remote

        remote._FS.clear()  # a new rank is a new process: no listing cache, no connections

    def counts(self) -> dict:
        with self.proxy.lock:
            reqs = self.proxy.requests[self.mark:]
        gets = [p for m, p in reqs if m == "GET"]
        return {"shards": sum(p.endswith(".tar") for p in gets),
                "index_files": sum(p.endswith((".zidx", ".zblob")) for p in gets),
                "list": sum(p.count("/") == 1 for p in gets),
                "other": sum(1 for m, p in reqs if m != "GET" or not (
                    p.endswith((".tar", ".zidx", ".zblob")) or p.count("/") == 1))}

    def stop(self) -> None:
        pass


# -- corpora --------------------------------------------------------------------------------

class Corpus:
    def __init__(self, where, url, so, counter, n, index_build_s) -> None:
        self.where, self.url, self.so, self.counter = where, url, so, counter
        self.n, self.index_build_s = n, index_build_s


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    d = tmp_path_factory.mktemp("startup")
    per = SAMPLES // SHARDS
    t0 = time.perf_counter()
    for k in range(SHARDS):
        with open(d / f"shard-{k:05d}.tar", "wb") as fh:
            fh.write(shard(k, per))
    print(f"\n  local: {SHARDS} shards written in {time.perf_counter() - t0:.1f} s")
    took = build_index(str(d))
    return Corpus("local", str(d) + "/", None, LocalOpens(str(d)), SHARDS, took)


@pytest.fixture(scope="module")
def s3():
    for mod in ("moto", "s3fs", "boto3"):
        pytest.importorskip(mod)
    from _s3_server import BUCKET, FaultProxy, MotoServer, storage_options

    server = MotoServer()
    proxy = None
    try:
        per = -(-SAMPLES // S3_SHARDS)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: server.client.put_object(
                Bucket=BUCKET, Key=f"startup/shard-{k:05d}.tar", Body=shard(k, per)),
                range(S3_SHARDS)))
        print(f"\n  s3: {S3_SHARDS} shards uploaded in {time.perf_counter() - t0:.1f} s")
        url = f"s3://{BUCKET}/startup/"
        took = build_index(url, "--kind", "webdataset", "--storage-options",
                           json.dumps(storage_options(server.endpoint)))
        proxy = FaultProxy(server.port)  # no rule: it only records the requests
        yield Corpus("s3", url, storage_options(proxy.endpoint), S3Requests(proxy),
                     S3_SHARDS, took)
    finally:
        if proxy is not None:
            proxy.close()
        server.stop()


@pytest.fixture(params=["local", "s3"])
def corpus(request):
    return request.getfixturevalue(request.param)


# -- one rank -------------------------------------------------------------------------------

def first_batch(c: Corpus, R: int | None = None, r: int = 0, index=None) -> dict:
    """Build the source and read the first batch as rank ``r`` of ``R`` (None: no options);
    the time and what was read, by the first batch and by the iterator's close."""
    c.counter.start()
    t0 = time.perf_counter()
    try:
        src = sources.webdataset(c.url, storage_options=c.so, index=index)
        built = time.perf_counter() - t0
        if R is None:
            pipe = Pipeline(src, shuffle=True).batch(BATCH)
        else:
            pipe = Pipeline(src, shuffle=True, chunk_size=BATCH).batch(BATCH).options(
                RuntimeOptions(world_size=R, global_rank=r, canonical_replicas=R))
        it = iter(pipe)
        try:
            batch = next(it)
            took = time.perf_counter() - t0
            by_batch = c.counter.counts()
        finally:
            it.close()
        by_close = c.counter.counts()
    finally:
        c.counter.stop()
    assert len(batch["__key__"]) == BATCH
    store = src.index_store
    return {"s": took, "build_s": built, "by_batch": by_batch, "by_close": by_close,
            "index_counts": src.index_counts,
            "index_objects": store.objects_read if store is not None else 0}


def summary(rows: list[dict]) -> dict:
    out: dict = {"ranks_measured": len(rows),
                 "first_batch_s_mean": float(np.mean([x["s"] for x in rows])),
                 "first_batch_s_max": float(np.max([x["s"] for x in rows])),
                 "build_s_mean": float(np.mean([x["build_s"] for x in rows])),
                 "index_objects_per_rank": sorted({x["index_objects"] for x in rows}),
                 "files_read_from_index_per_rank": sorted({x["index_counts"][0] for x in rows}),
                 "files_scanned_per_rank": sorted({x["index_counts"][1] for x in rows})}
    for when in ("by_batch", "by_close"):
        for what in rows[0][when]:
            vals = [x[when][what] for x in rows]
            out[f"{what}_{when}_per_rank"] = [min(vals), max(vals)]
    return out


def report(benchmark, c: Corpus, label: str, rows: list[dict]) -> None:
    info = summary(rows)
    info.update(where=c.where, shards=c.n, samples=SAMPLES, index_build_s=c.index_build_s)
    benchmark.extra_info.update(info)
    shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in info.items()
             if k not in ("where", "samples")}
    print(f"\n  [{c.where}] {label}: " + ", ".join(f"{k}={v}" for k, v in shown.items()))


# -- benchmarks -----------------------------------------------------------------------------

def test_first_batch_warm(benchmark, corpus):
    """One process, the pipeline as a user writes it, on a warm index."""
    benchmark.group = GROUP
    rows: list[dict] = []
    benchmark.pedantic(lambda: rows.append(first_batch(corpus)), rounds=5, iterations=1,
                       warmup_rounds=0)
    report(benchmark, corpus, "1 process, warm index", rows)
    assert all(x["index_counts"] == (corpus.n, 0) for x in rows)


def _spread(R: int, k: int) -> list[int]:
    if k <= 0 or k >= R:
        return list(range(R))
    return sorted({round(i * (R - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]


@pytest.mark.parametrize("R", [1, 16, 256, 1024])
def test_ranks_warm(benchmark, corpus, R):
    benchmark.group = GROUP + ": simulated ranks, warm index (per rank)"
    ranks = iter(_spread(R, RANKS_MEASURED))
    rows: list[dict] = []
    lock = threading.Lock()

    def setup():
        with lock:
            return (next(ranks),), {}

    n = len(_spread(R, RANKS_MEASURED))
    benchmark.pedantic(lambda r: rows.append(first_batch(corpus, R, r)), setup=setup,
                       rounds=n, iterations=1)
    report(benchmark, corpus, f"R={R}, warm index", rows)
    assert all(x["index_counts"] == (corpus.n, 0) for x in rows)


@pytest.mark.parametrize("R", [1, 2])
def test_ranks_cold(benchmark, corpus, R):
    benchmark.group = GROUP + ": simulated ranks, index=False (per rank)"
    ranks = iter(range(R))
    rows: list[dict] = []
    benchmark.pedantic(lambda r: rows.append(first_batch(corpus, R, r, index=False)),
                       setup=lambda: ((next(ranks),), {}), rounds=R, iterations=1)
    report(benchmark, corpus, f"R={R}, index=False", rows)
    total = sum(x["by_close"]["shards"] for x in rows)
    benchmark.extra_info["shards_read_all_ranks"] = total
    print(f"  [{corpus.where}] R={R}, index=False: shard objects read by all ranks: {total}")
    assert all(x["index_counts"] == (0, corpus.n) for x in rows)
