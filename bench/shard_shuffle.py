"""The global shuffle against the shard-window order, on Parquet and tar shards on disk.

    python bench/shard_shuffle.py [--rows-per-group 2000] [--groups 160] [--window 8]

Writes a Parquet corpus (``--groups`` row groups of ``--rows-per-group`` rows, 8 per
file, a 256-byte payload per row) and WebDataset tar shards (the same count, 200
samples of 1 KiB each) under a temporary directory, then reads one epoch of each
through ``Pipeline(src, shuffle=True)`` and ``Pipeline(src, shuffle="shards",
shuffle_window=W)`` (inline, one lane, batches of 256), with a row-group cache of 2 W
row groups for both modes (a batch that straddles a window edge reads two windows). Per mode and source it prints:

- ``shards/1000``: distinct shards among 1000 consecutive samples (mean over the epoch);
- ``opens/shard``: times a reader keeping the W shards it used last opens a shard
  (least recently used out), per shard: 1.0 is one sequential pass per shard;
- Parquet only: row-group decodes and the compressed bytes they read (from the footers);
- samples/s over the epoch (one measurement on a shared machine: compare the ratio).
"""

from __future__ import annotations

import argparse
import io
import tarfile
import tempfile
import time

import numpy as np

from zephon import Pipeline, RuntimeOptions, sources


def write_parquet(directory: str, groups: int, rows: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths, per_file = [], 8
    for f in range(-(-groups // per_file)):
        count = min(per_file, groups - f * per_file) * rows
        ids = np.arange(f * per_file * rows, f * per_file * rows + count, dtype=np.int64)
        payload = [bytes([int(i) % 251]) * 256 for i in ids]
        path = f"{directory}/part-{f:04d}.parquet"
        pq.write_table(pa.table({"id": ids, "payload": payload}), path, row_group_size=rows)
        paths.append(path)
    return paths


def write_tars(directory: str, shards: int, per_shard: int = 200) -> list[str]:
    paths = []
    for s in range(shards):
        path = f"{directory}/shard-{s:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for k in range(per_shard):
                data = bytes([k % 251]) * 1024
                info = tarfile.TarInfo(f"{s * per_shard + k:08d}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def lru_opens(shards: np.ndarray, capacity: int) -> int:
    held: dict[int, None] = {}
    count = 0
    for s in shards.tolist():
        if s in held:
            held.pop(s)
        else:
            count += 1
            if len(held) >= capacity:
                held.pop(next(iter(held)))
        held[s] = None
    return count


def counted_decodes(src):
    """Wrap the Parquet source's row-group decode to count decodes and their bytes."""
    meta = [(int(src.group_file[g]), int(src.group_index[g])) for g in range(len(src.group_rows))]
    import pyarrow.parquet as pq

    footers = [pq.ParquetFile(path).metadata for path in src.files]
    sizes = [sum(footers[k].row_group(rg).column(c).total_compressed_size
                 for c in range(footers[k].num_columns)) for k, rg in meta]
    tally = {"decodes": 0, "bytes": 0}
    decode = src._decode

    def wrapped(g):
        tally["decodes"] += 1
        tally["bytes"] += sizes[g]
        return decode(g)

    src._decode = wrapped
    return tally


def epoch(src, mode, window: int):
    extra = {"shuffle_window": window} if mode == "shards" else {}
    pipe = Pipeline(src, shuffle=mode, chunk_size=256, **extra).batch(256).options(
        RuntimeOptions(canonical_replicas=1))
    start = time.perf_counter()
    ids = []
    for batch in pipe:
        ids.append(batch.meta["sample_ids"])
    seconds = time.perf_counter() - start
    index = np.array([i for part in ids for _, i, _ in part], dtype=np.int64)
    return index, seconds


def report(name: str, src, mode, window: int, tally=None) -> None:
    bounds = src.shard_bounds()
    index, seconds = epoch(src, mode, window)
    shards = np.searchsorted(bounds, index, side="right") - 1
    per_1000 = np.mean([len(np.unique(shards[a:a + 1000])) for a in range(0, len(shards), 1000)])
    opens = lru_opens(shards, window) / (len(bounds) - 1)
    line = (f"{name:8s} shuffle={mode!s:7s} shards/1000={per_1000:7.1f} "
            f"opens/shard={opens:7.1f} samples/s={len(index) / seconds:10.0f}")
    if tally is not None:
        line += f" decodes={tally['decodes']:6d} read={tally['bytes'] / 2**20:8.1f} MiB"
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows-per-group", type=int, default=2000)
    ap.add_argument("--groups", type=int, default=160)
    ap.add_argument("--window", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_parquet(tmp, args.groups, args.rows_per_group)
        group_bytes = args.rows_per_group * 300  # decoded bytes of one group, about
        for mode in (True, "shards"):
            # 2 W groups: a batch that straddles a window edge reads from two windows
            src = sources.parquet(paths, row_group_cache_bytes=2 * args.window * group_bytes)
            tally = counted_decodes(src)
            report("parquet", src, mode, args.window, tally)
        tars = write_tars(tmp, args.groups)
        for mode in (True, "shards"):
            report("tar", sources.webdataset(tars), mode, args.window)


if __name__ == "__main__":
    main()
