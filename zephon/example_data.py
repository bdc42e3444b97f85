"""The small data files the README's examples read (``python -m zephon example-data DIR``).

What it owns: one writer per example file or directory, and the table of them
(:data:`EXAMPLES`). :func:`write_examples` writes every example into a directory:

- ``corpus/part-000.parquet``, ``corpus/part-001.parquet``: 2 x 100 rows of ``text``
  (str) and ``score`` (float32), row groups of 25 rows (``parquet`` extra: pyarrow);
- ``shards/train-000.tar``, ``shards/train-001.tar``: WebDataset shards, 2 x 50
  samples, each a ``.txt`` caption and a ``.json`` ``{"label": k}``;
- ``train.bin``: 64 x 1024 raw uint16 token ids below 50257 (the layout of a
  nanoGPT ``train.bin``);
- ``notes.jsonl.zst``: 200 zstd-compressed JSON lines ``{"text", "stars"}``;
- ``hf_saved/``: a ``datasets.Dataset`` of 64 rows (``text``, ``label``) written by
  ``save_to_disk`` (``hf`` extra: datasets).

Invariants:
- Deterministic: the contents depend on nothing but this module (fixed seeds, tar
  members with fixed metadata), so two runs write the same bytes (given the same
  versions of pyarrow and datasets).
- Small: under a megabyte in all.
- A format whose library is missing is skipped, not an error: its entry comes back
  with ``written=False`` and the install line of its extra, and the other files are
  still written.
- Only the listed paths are written (a file of that name is replaced); nothing else
  in the directory is touched.

Nothing here prints: the CLI (:mod:`zephon.__main__`) reports the returned entries.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

TOKENS_VOCAB = 50257  # GPT-2's vocabulary: fits uint16, as in nanoGPT's train.bin
TOKENS_SEQ_LEN = 1024
TOKENS_WINDOWS = 64


@dataclass(frozen=True)
class ExampleFile:
    """One example file or directory, as :func:`write_examples` reports it.

    Attributes:
        path: relative to the target directory (a directory ends with ``/``).
        what: a one-line description of the contents.
        written: False when the library of its format is missing.
        install: the install line of the missing extra (empty when written).
    """

    path: str
    what: str
    written: bool
    install: str = ""


def _parquet_corpus(root: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = ["data", "loader", "token", "shard", "epoch", "batch", "lane", "seed"]
    rng = np.random.default_rng(1)
    os.makedirs(os.path.join(root, "corpus"), exist_ok=True)
    for f in range(2):
        texts = [" ".join(rng.choice(words, size=int(rng.integers(2, 12))))
                 for _ in range(100)]
        scores = rng.random(100).astype(np.float32)
        pq.write_table(pa.table({"text": texts, "score": scores}),
                       os.path.join(root, "corpus", f"part-{f:03d}.parquet"),
                       row_group_size=25)


def _tar_shards(root: str) -> None:
    os.makedirs(os.path.join(root, "shards"), exist_ok=True)
    for s in range(2):
        with tarfile.open(os.path.join(root, "shards", f"train-{s:03d}.tar"), "w",
                          format=tarfile.USTAR_FORMAT) as tar:
            for k in range(50):
                key = f"{s * 50 + k:06d}"
                members = (("txt", f"caption {s}-{k}".encode()),
                           ("json", json.dumps({"label": k % 10}).encode()))
                for ext, data in members:
                    info = tarfile.TarInfo(f"{key}.{ext}")  # mtime 0, uid 0, mode 0644
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def _token_file(root: str) -> None:
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, TOKENS_VOCAB, size=TOKENS_WINDOWS * TOKENS_SEQ_LEN,
                          dtype=np.uint16)
    tokens.tofile(os.path.join(root, "train.bin"))


def _jsonl_zst(root: str) -> None:
    import zstandard

    lines = "".join(json.dumps({"text": f"note {i}", "stars": i % 5}) + "\n"
                    for i in range(200))
    data = zstandard.ZstdCompressor(level=3).compress(lines.encode())
    with open(os.path.join(root, "notes.jsonl.zst"), "wb") as fh:
        fh.write(data)


def _hf_saved(root: str) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"text": [f"text {i}" for i in range(64)],
                                     "label": [i % 2 for i in range(64)]})
    quiet = not datasets.utils.are_progress_bars_disabled()
    if quiet:  # its progress bar would be the only output on stderr
        datasets.disable_progress_bars()
    try:
        ds.save_to_disk(os.path.join(root, "hf_saved"))
    finally:
        if quiet:
            datasets.enable_progress_bars()


@dataclass(frozen=True)
class _Example:
    path: str
    what: str
    write: Callable[[str], None]
    module: str = ""  # the third-party module the format needs ("" = none beyond core)
    extra: str = ""


# The README's examples read exactly these paths (tests/test_readme.py checks that each
# block reading one runs after `python -m zephon example-data .`).
EXAMPLES = (
    _Example("corpus/", "2 Parquet files, 200 rows of text and score", _parquet_corpus,
             "pyarrow", "parquet"),
    _Example("shards/", "2 WebDataset tar shards, 100 samples of txt and json", _tar_shards),
    _Example("train.bin", f"{TOKENS_WINDOWS * TOKENS_SEQ_LEN} uint16 token ids",
             _token_file),
    _Example("notes.jsonl.zst", "200 zstd-compressed JSON lines of text and stars",
             _jsonl_zst),
    _Example("hf_saved/", "a datasets.Dataset of 64 rows saved with save_to_disk",
             _hf_saved, "datasets", "hf"),
)


def install_line(extra: str) -> str:
    """The command installing ``extra`` from a zephon checkout (zephon is not on the index)."""
    return f'python -m pip install -e ".[{extra}]"'


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def write_examples(directory: str) -> list[ExampleFile]:
    """Write every example file into ``directory`` (created if missing).

    Args:
        directory: where to write; the README's examples run in it.

    Returns:
        One :class:`ExampleFile` per entry of :data:`EXAMPLES`, in that order: written,
        or skipped with the install line of its extra when its library is missing.

    Raises:
        OSError: the directory cannot be created or a file cannot be written.
    """
    os.makedirs(directory, exist_ok=True)
    out = []
    for ex in EXAMPLES:
        if ex.module and not _importable(ex.module):
            out.append(ExampleFile(ex.path, ex.what, False, install_line(ex.extra)))
            continue
        ex.write(directory)
        out.append(ExampleFile(ex.path, ex.what, True))
    return out
