"""The shape of what an epoch delivers: batch sizes and the share of tokens delivered.

    python bench/stream_shape.py

Prints, for the README's first pipeline, ``.shuffle(256).batch(7)`` and
``pack_tokens(1024).batch(8)`` (with and without ``drop_last``), the histogram of batch
sizes, the short batches before the last one and the tokens delivered out of the
source's. Run it on two checkouts (``PYTHONPATH=<checkout> python bench/stream_shape.py``)
to compare stream definitions. Not a timing: the figures are exact counts.
"""

from __future__ import annotations

import collections

import numpy as np

from zephon import Pipeline, RuntimeOptions, sources


def load(i):
    return {"tokens": np.arange(64, dtype=np.int64) + i, "label": i % 10}


def augment(sample, ctx):
    noise = ctx.rng.integers(0, 2, size=sample["tokens"].shape)
    return {"tokens": sample["tokens"] + noise, "label": sample["label"]}


def keep(sample):
    return sample["label"] != 3


def ragged(i):
    return {"tokens": np.arange(64 + (i * 37) % 200, dtype=np.int64)}


def main() -> None:
    readme = (Pipeline(sources.from_callable(2_000, load), seed=42, chunk_size=64)
              .map(augment, parallelism=2).filter(keep).shuffle(256).batch(8)
              .options(RuntimeOptions(runner="process", max_workers=2)))
    sizes = [len(b["label"]) for b in readme]
    print("README pipeline: batch sizes", dict(collections.Counter(sizes)),
          "| short before the last:", sum(s != 8 for s in sizes[:-1]))
    shuffled = Pipeline(sources.from_callable(2_000, load), seed=42, chunk_size=64)
    sizes = [len(b["label"]) for b in shuffled.shuffle(256).batch(7)]
    print(".shuffle(256).batch(7): batch sizes", dict(collections.Counter(sizes)),
          "| short before the last:", sum(s != 7 for s in sizes[:-1]))
    src = sources.from_callable(2_000, ragged)
    total = sum(64 + (i * 37) % 200 for i in range(2_000))
    for drop in (False, True):
        batches = list(Pipeline(src, seed=0, chunk_size=64).pack_tokens(1024)
                       .batch(8, drop_last=drop))
        rows = [np.asarray(r).size for b in batches for r in b["tokens"]]
        print(f"pack_tokens(1024).batch(8, drop_last={drop}): batch sizes",
              dict(collections.Counter(len(b["tokens"]) for b in batches)),
              f"| tokens delivered {sum(rows)}/{total} = {100 * sum(rows) / total:.2f} %",
              "| short rows:", sum(r != 1024 for r in rows))


if __name__ == "__main__":
    main()
