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
- :func:`image_folder` — an ImageFolder tree ``root/<class>/<image>``; one dict
  ``{"image": bytes, "label": int, "path": str}`` per image.
- :func:`mds` — MosaicML Streaming's MDS shards (``index.json`` and its shards).
- :func:`litdata` — LitData's ``optimize()`` chunks (items, or tokens in blocks).
- :func:`lance` — a Lance dataset at a pinned version (``lance`` extra).
- :func:`array_record` — ArrayRecord files of bytes records (``array_record`` extra).
- :func:`mixture` — components sampled at their weights (sampling rates).

What a file source learns of its files (a tar's members, a jsonl's lines, a Parquet
footer, an ArrayRecord's record count) is kept in the shared index
(:mod:`zephon.io.index`) and read from there by later builds, on every rank.

Submodules import their format library (pyarrow, fsspec, datasets) only when a
source that needs it is built or read: unpickling a jsonl source in a worker does
not load pyarrow.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from zephon.pipeline.sources.array_record import array_record
from zephon.pipeline.sources.base import (
    CallableSource,
    SequenceSource,
    Source,
    SourceError,
    io_of,
)
from zephon.pipeline.sources.hf import HfDatasetSource
from zephon.pipeline.sources.images import ImageFolderSource
from zephon.pipeline.sources.jsonl import DEFAULT_MAX_DECOMPRESSED, JsonlSource
from zephon.pipeline.sources.lance import lance
from zephon.pipeline.sources.litdata import litdata
from zephon.pipeline.sources.mds import mds
from zephon.pipeline.sources.mixture import MixtureSource, Weights
from zephon.pipeline.sources.parquet import ParquetSource
from zephon.pipeline.sources.tokens import TokenWindows
from zephon.pipeline.sources.webdataset import WebDatasetSource

__all__ = [
    "Source",
    "SourceError",
    "array_record",
    "from_callable",
    "from_sequence",
    "hf_dataset",
    "image_folder",
    "jsonl",
    "lance",
    "litdata",
    "mds",
    "mixture",
    "parquet",
    "token_windows",
    "webdataset",
]



def from_sequence(items: Sequence[Any], *, name: str = "sequence") -> Source:
    """A source over an in-memory sequence: sample ``i`` is ``items[i]``.

    The sequence is pickled once into every worker process of a process stage, so keep
    it small (or use :func:`from_callable` to load samples where they are read).

    Args:
        items: a list, tuple, NumPy array or any sequence with ``len`` and indexing.
        name: the source's name, the first part of every sample identity
            ``(name, index, epoch)``.

    Returns:
        A :class:`Source` of ``len(items)`` samples.

    Raises:
        ZephonConfigError: ``items`` has no length or no indexing by position (a
            generator, an iterator, a set, a mapping, a pandas DataFrame or Series: they
            index by label; or an object whose ``items[0]`` or ``items[len - 1]``, read
            once to check, raises KeyError or IndexError), or a length past what
            ``len()`` holds: give ``list(items)``, or use :func:`from_callable`.

    Examples:
        >>> src = sources.from_sequence(["a", "b", "c"])
        >>> len(src), src.get(1), src.identity(1)
        (3, 'b', ('sequence', 1))
    """
    return SequenceSource(items, name)


def from_callable(n: int, fn: Callable[[int], Any], *, name: str = "callable") -> Source:
    """A map-style source: sample ``i`` is ``fn(i)`` for ``0 <= i < n``.

    Args:
        n: the number of samples (an int >= 0).
        fn: ``fn(i) -> sample``; it must be deterministic (a restore reads samples
            again), and picklable (module level) for the process runner.
        name: the source's name, the first part of every sample identity.

    Returns:
        A :class:`Source` of ``n`` samples.

    Raises:
        ZephonConfigError: ``n`` is not an int >= 0, or ``fn`` is not callable.

    Examples:
        >>> src = sources.from_callable(4, lambda i: {"x": np.full(2, i)})
        >>> len(src), src.get(3)["x"].tolist()
        (4, [3, 3])
    """
    return CallableSource(n, fn, name)


def token_windows(path: str, seq_len: int, dtype: str | None = "uint16", *,
                  name: str = "tokens", io_options=None,
                  storage_options: dict | None = None, vocab_size: int | None = None) -> Source:
    """Windows of ``seq_len`` tokens over one flat token file.

    Sample ``i`` is ``{"tokens": tokens[i * seq_len:(i + 1) * seq_len]}``; a trailing
    partial window is not a sample. Each reading process opens the file lazily and
    reads each window with one positional read (no memory mapping); a file truncated
    or rewritten after the source was built is a SourceError naming it, never a crash
    (a file replaced under its path is caught when a process opens it).

    Args:
        path: a ``.bin`` file of raw tokens or a ``.npy`` 1-D array (named ``*.npy`` in
            any case, or starting with the ``.npy`` magic bytes whatever its name); local,
            ``file://`` or an fsspec URL (``s3://bucket/train.bin``).
        seq_len: tokens per sample (a Python or NumPy int).
        dtype: ``"uint16"`` (default) or ``"uint32"`` (also int32/int64/uint8); for a
            ``.npy`` file None takes the file's dtype.
        name: the source's name, the first part of every sample identity.
        io_options: a :class:`~zephon.StoreOptions` (caching, retries, timeouts) for the
            reads made while building the source; while iterating, the pipeline's
            ``RuntimeOptions.io_options`` govern. None: the defaults.
        storage_options: fsspec options for remote paths (endpoint, credentials).
        vocab_size: the tokenizer's vocabulary size, to check the file against: a token
            outside ``[0, vocab_size)`` read as ``dtype`` (a ``uint16`` file read as
            ``uint32``) is refused, naming the dtype that fits. Checked when the source is
            built on a sample of the file (4 stretches of 64 KiB spread over it), not on
            every token. None: not checked.

    Returns:
        A :class:`Source` whose sample ``i`` is ``{"tokens": ndarray[seq_len]}``.

    Raises:
        SourceError: the file is missing, unreadable or not a regular file (a
            directory), the path matches several files, the data is not a whole number
            of ``dtype`` tokens, a ``.npy`` header does not parse, is not a 1-D C-order
            array, holds another dtype than ``dtype`` or another length than the file;
            when read, a file changed since the source was built.
        ZephonConfigError: ``seq_len`` is not an int >= 1, the file holds fewer than
            ``seq_len`` tokens (not one window), ``dtype`` is not a token dtype (a
            misspelled one included), ``vocab_size`` is not an int >= 1, or the sample of
            the file holds a token outside ``vocab_size``.

    Examples:
        >>> np.arange(10, dtype=np.uint16).tofile("train.bin")
        >>> src = sources.token_windows("train.bin", seq_len=4)
        >>> len(src), src.get(1)["tokens"].tolist()
        (2, [4, 5, 6, 7])
    """
    return TokenWindows(path, seq_len, dtype, name, io_of(io_options), storage_options,
                        vocab_size)


def jsonl(paths: str | Sequence[str], *, name: str = "jsonl", io_options=None,
          storage_options: dict | None = None,
          max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED,
          index: str | bool | None = None) -> Source:
    """One dict per non-blank JSON line over one or more files.

    The files are streamed once when the source is built, to index their lines (in
    bounded memory: the index holds 28 bytes per line): sample ``i`` is the ``i``-th
    non-blank line over all files, its identity the file and line. Compressed files
    (``.jsonl.gz``, ``.jsonl.zst``) are held decompressed in memory by each reading
    process, at most ``max_decompressed_bytes`` of them at a time.

    Args:
        paths: a path, glob (sorted), directory (its ``*.jsonl*`` files) or fsspec URL,
            or a list of them; a local path must be a file (or a directory to list).
        name: the source's name, the first part of every sample identity.
        io_options: a :class:`~zephon.StoreOptions` (caching, retries, timeouts) for the
            reads made while building the source; while iterating, the pipeline's
            ``RuntimeOptions.io_options`` govern. None: the defaults.
        storage_options: fsspec options for remote paths (endpoint, credentials).
        max_decompressed_bytes: the most bytes one compressed file may decompress to
            (default 1 GiB), and the most decompressed bytes a reading process holds.
        index: the shared index (see :mod:`zephon.io.index`): None reads
            ``_zephon_index/`` beside the first file (and writes it there when local); a
            path or URL names the index directory; False: none. With it, a build reads each
            file's line table from the index instead of scanning the file, and only when
            the file is first read.

    Returns:
        A :class:`Source` whose sample ``i`` is the parsed line.

    Raises:
        SourceError: no file matches, a local path is not a regular file, a file cannot
            be read or decompressed, or decompresses to more than
            ``max_decompressed_bytes``; a bad line (invalid JSON, not an object, nested
            too deeply) raises it when read, naming the file, the line and its byte
            offset.
        ZephonConfigError: ``max_decompressed_bytes`` is not an int >= 1.

    Examples:
        >>> with open("part-0.jsonl", "w") as f:
        ...     print('{"stars": 3}', file=f)
        ...     print('', file=f)
        ...     print('{"stars": 5}', file=f)
        >>> src = sources.jsonl("part-*.jsonl")
        >>> len(src), src.get(1)
        (2, {'stars': 5})
    """
    return JsonlSource(paths, name, io_of(io_options), storage_options, max_decompressed_bytes,
                       index)


def parquet(paths: str | Sequence[str], columns: Sequence[str] | None = None, *,
            name: str = "parquet", shuffle: bool = False, seed: int = 0,
            row_group_cache_bytes: int = 256 << 20, io_options=None,
            storage_options: dict | None = None, index: str | bool | None = None) -> Source:
    """One dict ``{column: value}`` per row over Parquet files (``parquet`` extra).

    Rows are read at random through the files' footers; each process keeps a budget
    of decoded row groups, so neighbouring rows cost one decode. Values: numeric and
    boolean columns give NumPy scalars, list-of-numeric columns NumPy arrays (views of
    the decoded row group), strings ``str``, binaries ``bytes``, other types their
    Python value (``to_pylist``); nulls give None. A ``read -> batch`` stage reads a
    whole micro-batch in one vectorised read.

    Args:
        paths: files, globs (sorted), directories (their ``*.parquet``) or fsspec URLs.
        columns: the columns to read (None: all).
        name: the source's name, the first part of every sample identity.
        shuffle: visit row groups in a seeded order and rows in a seeded order within
            each row group: a shuffled stream that still decodes each row group once
            (combine with ``Pipeline(..., shuffle=False)`` and a ``.shuffle(n)`` op).
        seed: the seed of that order.
        row_group_cache_bytes: per-process budget of decoded row groups (LRU).
        io_options: a :class:`~zephon.StoreOptions` (caching, retries, timeouts) for the
            reads made while building the source; while iterating, the pipeline's
            ``RuntimeOptions.io_options`` govern. None: the defaults.
        storage_options: fsspec options for remote paths (endpoint, credentials).

        index: the shared index (see :mod:`zephon.io.index`): None reads
            ``_zephon_index/`` beside the first file (and writes it there when local); a
            path or URL names the index directory; False: none. With it, a build reads each
            file's row groups from the index instead of its footer.

    Returns:
        A :class:`Source` of one sample per row.

    Raises:
        SourceError: pyarrow is missing (the message names ``python -m pip install -e
            ".[parquet]"``), no file matches, a footer is corrupt, or a column is missing; a
            corrupt row group raises it when read, naming the file and the row group.

    Examples:
        >>> src = sources.parquet("corpus/*.parquet", columns=["text", "score"])  # doctest: +SKIP
        >>> src.get(0)  # doctest: +SKIP
        {'text': 'first row', 'score': 0.5}
    """
    return ParquetSource(paths, columns, name, shuffle, seed, row_group_cache_bytes,
                         io_of(io_options), storage_options, index)


def webdataset(shards: str | Sequence[str], *, name: str = "webdataset", io_options=None,
               storage_options: dict | None = None, index: str | bool | None = None) -> Source:
    """Samples from WebDataset tar shards, with random access.

    The members sharing a key (``000123.jpg``, ``000123.json``) form one sample
    ``{"__key__": key, "jpg": bytes, "json": bytes}`` (the field is the extension after
    the first dot; decode with ``.map``). Each shard's headers are scanned once when
    the source is built (a remote shard streamed without the cache is read whole and
    checked against its ETag, recording a digest per member that each later read is
    compared with; with the cache enabled, the index is kept beside a cached
    remote shard), so reading any sample is one positional read. Sparse members
    (``tar --sparse``) read as ``tarfile`` extracts them, and a hard or symbolic link to
    a file stored earlier in the shard reads that file's bytes.

    Args:
        shards: a path, glob, brace pattern (``train-{000..009}.tar``), directory (its
            ``*.tar``) or fsspec URL, or a list of them. Shards are plain tar files.
        name: the source's name, the first part of every sample identity.
        io_options: a :class:`~zephon.StoreOptions` (caching, retries, timeouts) for the
            reads made while building the source; while iterating, the pipeline's
            ``RuntimeOptions.io_options`` govern. None: the defaults.
        storage_options: fsspec options for remote paths (endpoint, credentials).
        index: the shared index (see :mod:`zephon.io.index`): None reads
            ``_zephon_index/`` beside the first shard (and writes it there when local);
            a path or URL names the index directory; False: none. With it, a build reads
            each shard's member table from the index instead of scanning the shard, and
            only when the shard is first read (``python -m zephon index`` builds it ahead).

    Returns:
        A :class:`Source` of one sample per key.

    Raises:
        SourceError: no shard matches, a local shard is not a regular file, a shard is
            compressed (``.tar.gz``: decompress it first), a tar header is corrupt, a
            member is a link to nothing stored earlier in the shard, a fifo or a device,
            or a sample has two members with the same extension (naming the shard and
            the member); a shard truncated after building raises it when read.

    Examples:
        >>> import io, tarfile
        >>> with tarfile.open("shard-000.tar", "w") as tar:
        ...     for name, data in [("a.txt", b"hello"), ("a.cls", b"1"), ("b.txt", b"bye")]:
        ...         info = tarfile.TarInfo(name)
        ...         info.size = len(data)
        ...         tar.addfile(info, io.BytesIO(data))
        >>> src = sources.webdataset("shard-{000..000}.tar")
        >>> len(src), src.get(0)
        (2, {'__key__': 'a', 'txt': b'hello', 'cls': b'1'})
    """
    return WebDatasetSource(shards, name, io_of(io_options), storage_options, index)


def hf_dataset(ds, *, name: str = "hf", columns: Sequence[str] | None = None) -> Source:
    """A Hugging Face ``datasets.Dataset`` as a source (``hf`` extra; no network access).

    Given a loaded ``Dataset`` the source keeps it (one backed by Arrow cache files
    pickles as its paths). Given the directory of a dataset saved with
    ``save_to_disk``, each reading process opens it memory-mapped on first use. The
    Arrow files are checked before each row is read: one changed since the source was
    built is a SourceError naming it.

    Args:
        ds: a ``datasets.Dataset``, or the path of one saved with ``save_to_disk``
            (one split, not a ``DatasetDict``).
        name: the source's name, the first part of every sample identity.
        columns: the columns to keep (None: all).

    Returns:
        A :class:`Source` whose sample ``i`` is ``ds[i]`` with numeric values and lists
        as NumPy arrays, strings as ``str``.

    Raises:
        SourceError: ``datasets`` is missing (the message names ``python -m pip install -e
            ".[hf]"``), the path is missing or a file, the directory cannot be
            loaded, holds a ``DatasetDict``, or lacks a requested column; when read, an
            Arrow file changed since the source was built, or a row cannot be read
            (naming the row).

    Examples:
        >>> src = sources.hf_dataset("saved_dataset_dir", columns=["text"])  # doctest: +SKIP
    """
    return HfDatasetSource(ds, name, columns)


def image_folder(root, *, extensions: Sequence[str] | None = None, name: str = "image_folder",
                 io_options=None, storage_options: dict | None = None,
                 allow_empty: bool = False, fingerprint_mtimes: bool = True) -> Source:
    """An ImageFolder tree (``root/<class>/<image>``), read as torchvision's ``ImageFolder``
    reads it, one sample per image file: ``{"image": bytes, "label": int, "path": str}``.

    Classes are the sorted names of the directories under ``root`` (``.classes``,
    ``.class_to_idx``); a sample's label is its class's index. Images are the files found
    recursively under each class directory whose name ends, in any case, with one of
    ``extensions``, in torchvision's order, so sample ``i`` is ``ImageFolder(root).samples[i]``.
    ``"image"`` holds the file's encoded bytes: decode them with a ``map`` op. The tree is
    listed once, when the source is built (one ``os.scandir`` per directory, one ``stat``
    per image); reading a sample is one open and one read, checked against the size and
    mtime listed. Symbolic links are followed (a dangling one, or a directory link back to
    a directory above it, is refused). The pipeline fingerprint holds a digest of the
    listing, so a checkpoint does not resume over another tree.

    Args:
        root: the tree's directory (a path, ``~`` expanded), or an fsspec URL (``s3://...``,
            read through the io layer like the other file sources).
        extensions: the image suffixes to take, with their dot (``[".jpg", ".png"]``;
            compared in lower case); None: torchvision's ``IMG_EXTENSIONS`` (.jpg .jpeg
            .png .ppm .bmp .pgm .tif .tiff .webp).
        name: the source's name, the first part of every sample identity.
        io_options: a :class:`~zephon.StoreOptions` (retries of transient open errors, and
            for a remote root caching, retries and timeouts) for the reads made while
            building the source; while iterating, the pipeline's
            ``RuntimeOptions.io_options`` govern. None: the defaults.
        storage_options: fsspec options for a remote root (endpoint, credentials).
        allow_empty: keep a class directory that holds no image (its label is still
            reserved), as torchvision's ``allow_empty``; False: refuse it.
        fingerprint_mtimes: include each image's mtime in the fingerprint (with the names
            and sizes); False for copies of one tree whose mtimes differ (a copy per node
            made without keeping times) that must resume each other's checkpoints.

    Returns:
        A :class:`Source` of one sample per image, with ``.classes`` (list of names),
        ``.class_to_idx`` (name -> label) and ``.targets`` (every sample's label).

    Raises:
        SourceError: the root is missing or not a directory, holds no class directory, a
            class directory holds no image (naming it; unless ``allow_empty``), an image is
            a dangling link or not a regular file, or a directory link loops; when read, an
            image that vanished or changed since the listing (naming it).
        ZephonConfigError: ``root`` is not a path, ``extensions`` is not a list of
            suffixes starting with a dot, or a flag is not a bool.

    Examples:
        >>> import os
        >>> for path in ["pets/dog/b.png", "pets/cat/a.JPG", "pets/cat/notes.txt"]:
        ...     os.makedirs(os.path.dirname(path), exist_ok=True)
        ...     with open(path, "wb") as f:
        ...         _ = f.write(b"encoded image bytes")
        >>> src = sources.image_folder("pets")
        >>> src.classes, len(src)
        (['cat', 'dog'], 2)
        >>> sample = src.get(1)
        >>> sample["label"], sample["path"], sample["image"][:7]
        (1, 'pets/dog/b.png', b'encoded')
    """
    return ImageFolderSource(root, extensions, name, io_of(io_options), storage_options,
                             allow_empty, fingerprint_mtimes)


def mixture(components: Mapping[str, Source], weights: Weights = None, *,
            config=None, name: str = "mixture", exhausted: str | Mapping[str, str] = "repeat",
            max_repeats: float | Mapping[str, float] | None = None, by: str = "samples",
            tokens_per_sample: Mapping[str, float] | str | None = None,
            token_count: Callable[[Any], int] | None = None, schedule_unit: str = "epochs",
            interpolate: str = "step") -> Source:
    """Components sampled at their weights: each weight is the component's expected share
    of the output, under every shuffle setting, runner, worker count and world size.

    An epoch holds exactly its rounded share of each component (its length follows from
    the exhaustion policies: see :mod:`zephon.pipeline.sources.mixture`). A component
    that runs out repeats in a new seeded order (``"repeat"``, the default), ends the
    epoch (``"stop"``), or gives its unfilled share to the others
    (``"redistribute"``); a component read only in part continues in the next epoch.
    Everything is computed per position: nothing of the epoch's size is built. A
    sample's identity is its component's name and the component's own index (a
    repeat within one epoch is named ``"<component>#<r>"``).

    Args:
        components: component name -> source.
        weights: component name -> positive weight (every component, no other name);
            None: equal weights. Shares of samples, or of tokens with ``by="tokens"``.
            Or a schedule: a list of steps ``[(first_epoch, weights), ...]`` (the first
            at epoch 0) or a picklable callable ``epoch -> weights``, where a weight may
            be 0; every epoch has epoch 0's length and holds its own weights (see
            :mod:`zephon.pipeline.sources.mixture`); the schedule is part of the
            pipeline's fingerprint.
        config: a :class:`~zephon.MixtureReadConfig` (the interleave and the
            within-component order); None: the pipeline's
            ``RuntimeOptions.mixture_config`` if set, else the defaults.
        name: the mixture's name.
        exhausted: ``"repeat"``, ``"stop"`` or ``"redistribute"``, for every component
            or as a mapping per component name (unnamed ones repeat).
        max_repeats: at most this many passes over a ``repeat`` component per epoch
            (one number or a mapping per component); None: no cap.
        by: ``"samples"`` or ``"tokens"`` (weights are shares of tokens).
        tokens_per_sample: with ``by="tokens"``, the mean tokens per sample of every
            component; None: known to a token source (``token_windows``: ``seq_len``),
            else measured on a seeded probe of 64 samples of each component: an
            estimate (exact only for a component of at most 64 samples), for which a
            ``UserWarning`` gives the probe's size and the standard error of each token
            share; ``"count"``: known to the source, else counted over every sample
            (each read once when the mixture is built: exact, with ``token_count`` a
            tokenizer's count for text). Give it for exact token shares.
        token_count: with ``by="tokens"`` and no ``tokens_per_sample``, tokens of one
            sample (default: the size of its ``"tokens"`` field, else the words of its
            ``"text"`` field).
        schedule_unit: what a schedule's steps count: ``"epochs"`` (above), or
            ``"samples"`` / ``"tokens"``: the weights are a function of the position in
            the stream (``[(first_position, weights), ...]`` or a module-level callable
            ``position -> weights``), exact in every stretch of the stream, on every
            runner, world size and restore (see
            :mod:`zephon.pipeline.sources.stream_schedule`). The mixture then orders
            itself: the pipeline reads it in its own order, its ``shuffle`` flag
            shuffling each component's passes; every component repeats
            (``exhausted="repeat"``, no ``max_repeats``) and none is a mixture.
            ``"tokens"`` places the steps by each component's tokens per sample (given,
            known to the source, or measured as with ``by="tokens"``).
        interpolate: with a list of steps and ``schedule_unit`` samples or tokens,
            ``"step"`` (each step's weights hold until the next) or ``"linear"`` (the
            sample rates move linearly from one step to the next).

    Returns:
        A :class:`Source` whose length is one epoch of the mixture.

    Raises:
        ZephonConfigError: no component, an empty component, a component name that is
            not a non-empty string, names that would give two samples one identity (a
            nested mixture's component named as another component, or a name that is
            another's repeat name ``"<name>#<r>"``), weights that do not name exactly the
            components, a weight that is not a positive finite number, an unknown policy,
            or weights whose ratio (over ``tokens_per_sample`` with ``by="tokens"``) makes
            an epoch longer than 2**53 positions (a ``UserWarning`` above 2**32); in a
            schedule, steps out of order, ``exhausted="stop"``, or weights the policies
            cannot fit to the epoch's length. Reading an epoch past
            ``(2**63 - 1) // len(mixture) - 1`` (where its sample numbers would pass
            int64; epoch 1023 at 2**53 positions) raises it too.

    Examples:
        >>> a = sources.from_sequence(["a0", "a1", "a2", "a3"], name="a")
        >>> b = sources.from_sequence(["b0", "b1"], name="b")
        >>> warm = sources.mixture(  # all of a for 1024 samples, then all of b
        ...     {"a": sources.from_sequence(list(range(1000)), name="a"),
        ...      "b": sources.from_sequence(list(range(1000, 1500)), name="b")},
        ...     [(0, {"a": 1, "b": 0}), (1024, {"a": 0, "b": 1})], schedule_unit="samples")
        >>> stream = list(Pipeline(warm, num_epochs=3))
        >>> sum(x < 1000 for x in stream[:1024]), sum(x >= 1000 for x in stream[1024:])
        (1024, 3476)
        >>> mix = sources.mixture({"a": a, "b": b}, {"a": 0.5, "b": 0.5})
        >>> [mix.get(i) for i in range(len(mix))]
        ['a0', 'b0', 'a1', 'b1', 'a2', 'b1', 'a3', 'b0']
        >>> mix.identity(5)
        ('b#1', 1)
    """
    return MixtureSource(components, weights, config, name, exhausted=exhausted,
                         max_repeats=max_repeats, by=by, tokens_per_sample=tokens_per_sample,
                         token_count=token_count, schedule_unit=schedule_unit,
                         interpolate=interpolate)
