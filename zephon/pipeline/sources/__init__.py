"""Sources: random-access sample collections with a stable identity per sample.

Every source has a ``name``, a length and ``get(i)``; the identity of sample
``i`` in epoch ``e`` is ``(name, i, e)`` (for a mixture: the component's name
and the component's own index). ``get(i)`` is deterministic, so checkpoints,
restores and re-sharding work the same for every source. Sources are pickled
once per worker process and hold no open handle across pickling: files are
(re)opened lazily in whichever process reads.

File sources accept local paths, globs (sorted) and fsspec URLs (``s3://``,
``gs://``, ``http(s)://``, ``file://``); remote files go through the local cache
and retry policy of ``RuntimeOptions.io_options`` (:class:`~zephon.StoreOptions`;
``io_options=`` at construction governs the reads made while building).

- :func:`from_sequence` — an in-memory list/array; sample = item.
- :func:`from_callable` — ``fn(i)`` for ``i < n`` (a map-style dataset).
- :func:`token_windows` — a flat token file (``.bin`` of uint16/uint32, or ``.npy``);
  sample ``i`` is ``{"tokens": tokens[i*seq_len:(i+1)*seq_len]}``.
- :func:`jsonl` — one dict per line over files (also ``.jsonl.gz``/``.jsonl.zst``).
- :func:`parquet` — one dict of column values per row, random access through the
  footers and a per-process cache of decoded row groups (``parquet`` extra).
- :func:`webdataset` — tar shards; one dict ``{extension: bytes}`` per key.
- :func:`hf_dataset` — a Hugging Face ``datasets.Dataset`` (loaded or saved to disk).
- :func:`mixture` — components interleaved by a deterministic schedule.

Submodules import their format library (pyarrow, fsspec, datasets) only when a
source that needs it is built or read: unpickling a jsonl source in a worker does
not load pyarrow.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.pipeline.sources.base import (
    CallableSource,
    FileSource,
    SequenceSource,
    Source,
    SourceError,
)
from zephon.pipeline.sources.hf import HfDatasetSource
from zephon.pipeline.sources.jsonl import JsonlSource
from zephon.pipeline.sources.mixture import MixtureSource
from zephon.pipeline.sources.parquet import ParquetSource
from zephon.pipeline.sources.tokens import TokenWindows
from zephon.pipeline.sources.webdataset import WebDatasetSource

__all__ = [
    "FileSource",
    "Source",
    "SourceError",
    "from_callable",
    "from_sequence",
    "hf_dataset",
    "jsonl",
    "mixture",
    "parquet",
    "token_windows",
    "webdataset",
]


def _io(io_options) -> IoConfig:
    if io_options is None:
        return DEFAULT_IO
    if isinstance(io_options, IoConfig):
        return io_options
    return IoConfig.from_store_options(io_options)


def from_sequence(items: Sequence[Any], *, name: str = "sequence") -> Source:
    """A source over an in-memory sequence; sample ``i`` is ``items[i]``."""
    return SequenceSource(items, name)


def from_callable(n: int, fn: Callable[[int], Any], *, name: str = "callable") -> Source:
    """A map-style source: sample ``i`` is ``fn(i)`` for ``0 <= i < n`` (``fn`` must be
    deterministic and, for the process runner, picklable)."""
    return CallableSource(n, fn, name)


def token_windows(path: str, seq_len: int, dtype: str | None = "uint16", *,
                  name: str = "tokens", io_options=None,
                  storage_options: dict | None = None) -> Source:
    """Windows of ``seq_len`` tokens over one flat token file.

    Args:
        path: a ``.bin`` file of raw tokens or a ``.npy`` 1-D array; local, ``file://``
            or an fsspec URL (``s3://bucket/train.bin``).
        seq_len: tokens per sample.
        dtype: ``"uint16"`` (default) or ``"uint32"`` (also int32/int64/uint8); for a
            ``.npy`` file None takes the file's dtype.
        io_options: a :class:`~zephon.StoreOptions` for the reads made while building
            (the pipeline's ``io_options`` govern the reads while iterating).
        storage_options: fsspec options for remote paths (endpoint, credentials).

    Returns: a source whose sample ``i`` is ``{"tokens": ndarray[seq_len]}``.

    Example::

        src = sources.token_windows("train.bin", seq_len=1024, dtype="uint32")
    """
    return TokenWindows(path, seq_len, dtype, name, _io(io_options), storage_options)


def jsonl(paths: str | Sequence[str], *, name: str = "jsonl", io_options=None,
          storage_options: dict | None = None) -> Source:
    """One dict per non-blank line over files, globs, directories or fsspec URLs
    (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``); see :mod:`.jsonl`.

    Example::

        src = sources.jsonl("data/*.jsonl.zst")
    """
    return JsonlSource(paths, name, _io(io_options), storage_options)


def parquet(paths: str | Sequence[str], columns: Sequence[str] | None = None, *,
            name: str = "parquet", shuffle: bool = False, seed: int = 0,
            row_group_cache_bytes: int = 256 << 20, io_options=None,
            storage_options: dict | None = None) -> Source:
    """One dict ``{column: value}`` per row over Parquet files (``parquet`` extra).

    Args:
        paths: files, globs (sorted), directories (their ``*.parquet``) or fsspec URLs.
        columns: the columns to read (None: all).
        shuffle: visit row groups in a seeded order and rows in a seeded order within
            each row group: a shuffled stream that still reads each row group once
            (combine with ``Pipeline(..., shuffle=False)`` and a ``.shuffle(n)`` op).
        seed: the seed of that order.
        row_group_cache_bytes: per-process budget of decoded row groups (LRU).

    Values: numeric and boolean columns give numpy scalars, list-of-numeric columns
    numpy arrays (views of the decoded row group), strings ``str``, binaries
    ``bytes``, other types their Python value (``to_pylist``). Nulls give None.

    Example::

        src = sources.parquet("corpus/*.parquet", columns=["text", "score"])
    """
    return ParquetSource(paths, columns, name, shuffle, seed, row_group_cache_bytes,
                         _io(io_options), storage_options)


def webdataset(shards: str | Sequence[str], *, name: str = "webdataset", io_options=None,
               storage_options: dict | None = None) -> Source:
    """WebDataset tar shards: the members sharing a key (``000123.jpg``,
    ``000123.json``) form one sample ``{"__key__": key, "jpg": bytes, "json": bytes}``
    (decode with ``.map``). Each shard is indexed once when the source is built
    (cached beside the shard in the cache when it is enabled), so any sample is one
    positional read.

    Example::

        src = sources.webdataset("shards/train-{000..009}.tar")  # or a glob / list
    """
    return WebDatasetSource(shards, name, _io(io_options), storage_options)


def hf_dataset(ds, *, name: str = "hf", columns: Sequence[str] | None = None) -> Source:
    """A Hugging Face ``datasets.Dataset``: a loaded one, or the directory of one saved
    with ``save_to_disk`` (``hf`` extra). No network access. Sample ``i`` is
    ``ds[i]`` with numeric lists as numpy arrays.

    Example::

        src = sources.hf_dataset("saved_dataset_dir")
    """
    return HfDatasetSource(ds, name, columns)


def mixture(components: Mapping[str, Source], weights: Mapping[str, float] | None = None, *,
            config=None, name: str = "mixture") -> Source:
    """``config``: a :class:`~zephon.options.MixtureReadConfig` (None: the pipeline's
    ``mixture_config`` if set, else the defaults)."""
    return MixtureSource(components, weights, config, name)
