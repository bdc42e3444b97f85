"""Real files for the source tests: Parquet written with pyarrow, tar shards with tarfile."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np


def write_parquet(directory, files: int = 3, rows: int = 250, row_group: int = 64,
                  prefix: str = "part") -> list[str]:
    """``files`` Parquet files of ``rows`` rows each: id (int64), score (float32),
    text (string), vec (list<int32>, length id % 5)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for f in range(files):
        ids = np.arange(f * rows, (f + 1) * rows, dtype=np.int64)
        table = pa.table({
            "id": ids,
            "score": (ids * 0.5).astype(np.float32),
            "text": [f"row {i}" for i in ids],
            "vec": [list(range(int(i) % 5)) for i in ids],
        }, schema=pa.schema([("id", pa.int64()), ("score", pa.float32()),
                             ("text", pa.string()), ("vec", pa.list_(pa.int32()))]))
        path = f"{directory}/{prefix}-{f:03d}.parquet"
        pq.write_table(table, path, row_group_size=row_group)
        paths.append(path)
    return paths


def write_shards(directory, shards: int = 3, per_shard: int = 40, prefix: str = "shard",
                 start: int = 0) -> list[str]:
    """Tar shards of samples ``{key}.txt`` (b"sample N") and ``{key}.json``."""
    paths = []
    n = start
    for s in range(shards):
        path = f"{directory}/{prefix}-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(per_shard):
                key = f"{n:06d}"
                for ext, data in (("txt", f"sample {n}".encode()),
                                  ("json", json.dumps({"n": n, "pad": "x" * (n % 300)}).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                n += 1
        paths.append(path)
    return paths
