"""mds: samples of MosaicML Streaming (MDS) datasets, read from their shards directly.

Owned here: :func:`mds` and :class:`MdsSource`, which read the shards that
``streaming.MDSWriter`` writes, without ``StreamingDataset`` (no shared memory, no
local copy of remote shards beyond zephon's own cache).

On-disk layout (``streaming/base/format/mds``, index version 2). A dataset directory
(``root``, or ``root/split``) holds ``index.json``::

    {"version": 2, "shards": [{"format": "mds", "version": 2, "samples": n,
      "column_names": [...], "column_encodings": [...], "column_sizes": [int|null, ...],
      "compression": null | "zstd:7" | "gz" | "bz2" | "br" | "snappy" ...,
      "raw_data": {"basename", "bytes", "hashes"}, "zip_data": null | {...},
      "hashes": [...], "size_limit": ...}, ...]}

and one file per shard: its raw form (``raw_data``) or, when ``compression`` is set,
its compressed form (``zip_data``; a shard compressed whole). A raw shard is::

    uint32 n | uint32 offsets[n + 1] | the writer's config (JSON) | samples

``offsets`` are file offsets (``offsets[n]`` is the file's size); sample ``j`` is
bytes ``[offsets[j], offsets[j + 1])``: one little-endian uint32 size per column of
variable size (``column_sizes`` null), then each column's bytes in column order.

Building reads ``index.json`` only, never a shard: the sample counts and file sizes
are in it (a local shard is ``stat``-ed and must have the size it gives; a remote
root is listed once for its objects' sizes and versions). Sample ``i`` is a global
index over the shards in index order (roots in the order given), rows in order within
a shard; ``shard_bounds`` are the shards. Each process reads a raw shard's header
(``4 * (n + 2)`` bytes) once and then one ``pread`` per sample; a compressed shard is
read and decompressed whole (checked against a hash ``index.json`` lists for it, when
it lists one this process can compute) and kept in a per-process LRU bounded by
``shard_cache_bytes``, as are the headers. The file read is always the one
``index.json`` names (a raw copy ``StreamingDataset`` decompressed beside it is not
used: the library evicts such copies, and a checkpoint's proof names the listed file).

Decoding: zephon decodes the numeric, ``int``, ``str``, ``bytes``, ``json``,
``pkl``, ``str_int``, ``str_float``, ``str_decimal`` and ``ndarray[:dtype[:shape]]``
encodings itself, to the values the library gives (``int``: a Python int; the sized
numeric types: NumPy scalars of that dtype; ``ndarray``: a read-only array over the
sample's bytes). Any other encoding (``pil``, ``jpeg``, ``png``, ``list[...]``,
``jpeg_array``) goes to mosaicml-streaming's ``mds_decode`` (the ``mds`` extra;
``streaming.base.format.mds.encodings``, or that file loaded on its own where the
package's ``__init__`` cannot be imported: it imports torchvision). ``pkl`` runs
code from the shard when read and is refused unless ``allow_unsafe_types=True``
(as ``StreamingDataset`` does).

Failures are :class:`SourceError` naming the file: when the source is built, an
``index.json`` that is missing, not JSON or not version 2, a shard of another format
(``json``, ``csv``), a missing or mis-sized shard, an unknown column or encoding, a
missing library (``require``: the ``mds`` extra); when a sample is read, a header
that disagrees with ``index.json``, a shard that does not decompress to its size or
hash, a sample whose sizes do not add up, or a value that does not decode. MDS
keeps no checksum per sample: a raw shard altered inside a value that still decodes
reads as the altered value (write with ``hashes=[...]`` and compression to have
whole shards checked).
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import importlib
import importlib.util
import json
import math
import os
import pickle
import stat
import struct
import threading
from decimal import Decimal
from typing import Any, Callable, Sequence

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.reader import FileReader
from zephon.io.remote import FileRef, expand, filesystem, is_remote, require, strip_file_url
from zephon.pipeline.sources.base import FileSource, Source, SourceError, io_of
from zephon.pipeline.sources.files import describe_kind

__all__ = ["MdsSource", "mds"]

EXTRA = "mds"
INDEX = "index.json"
#: the sized numeric encodings: NumPy scalars of this dtype
_SCALARS = {name: np.dtype(name) for name in (
    "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64")}
#: ``ndarray`` with a dynamic dtype: its first byte names it
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16",
                 32: "uint32", 33: "int32", 34: "float32", 64: "uint64", 65: "int64",
                 66: "float64"}
#: ``ndarray`` with a dynamic shape: the low 2 bits of its shape byte name the shape's dtype
_SHAPE_DTYPES = (np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))
#: the compressions (family, as index.json names them before ``:level``) and their modules
_CODECS = {"zstd": "zstandard", "gz": "zlib", "bz2": "bz2", "br": "brotli",
           "snappy": "snappy"}
#: hashes index.json may list that hashlib computes, cheapest first (xxh* need xxhash)
_HASHES = ("xxh3_64", "xxh64", "xxh128", "xxh3_128", "xxh32", "md5", "sha1", "blake2b",
           "sha256", "sha512")
Decoder = Callable[[bytes, int, int], Any]


def mds(root: str | os.PathLike | Sequence[str | os.PathLike], *, split: str | None = None,
        columns: Sequence[str] | None = None, name: str = "mds",
        allow_unsafe_types: bool = False, shard_cache_bytes: int = 256 << 20,
        io_options=None, storage_options: dict | None = None) -> Source:
    """One dict ``{column: value}`` per sample of a MosaicML Streaming (MDS) dataset.

    Building reads each ``index.json`` (sample counts and shard sizes; no shard is
    opened); a sample then costs one positional read of its bytes (a compressed shard:
    one read and decompression of the whole shard per process, kept in an LRU).
    Values are what ``StreamingDataset`` gives: ``int`` a Python int, sized numerics
    NumPy scalars, ``str``/``bytes``/``json``/``pkl`` their Python values, ``ndarray``
    a read-only NumPy array, image encodings PIL images (through mosaicml-streaming).

    Args:
        root: the dataset directory (holding ``index.json``; a local path, ``file://``
            URL, glob of directories, or fsspec URL such as ``s3://bucket/ds``), or a
            list of them (streams, read one after another in the order given).
        split: a sub-directory of each root to read (``root/split/index.json``), as
            ``StreamingDataset(split=...)``; None: the root itself.
        columns: the columns to decode (None: all).
        name: the source's name, the first part of every sample identity.
        allow_unsafe_types: decode ``pkl`` columns (unpickling runs code from the
            shard: only for data you trust); False refuses them when building.
        shard_cache_bytes: per-process budget of decompressed shards and shard headers
            (LRU; one shard larger than it is still kept).
        io_options: a :class:`~zephon.StoreOptions` (caching, retries, timeouts) for the
            reads made while building the source; while iterating, the pipeline's
            ``RuntimeOptions.io_options`` govern. None: the defaults.
        storage_options: fsspec options for remote roots (endpoint, credentials).

    Returns:
        A :class:`Source` of one sample per MDS sample, one shard per MDS shard.

    Raises:
        ZephonConfigError: an argument of the wrong type or range.
        SourceError: no ``index.json``, an index that is not MDS version 2, a missing or
            mis-sized shard, an unknown column, a ``pkl`` column without
            ``allow_unsafe_types``, or a missing library (``zstandard``, ``brotli``,
            ``snappy``, or mosaicml-streaming for image encodings: ``python -m pip
            install -e ".[mds]"``); a corrupt shard raises it when read, naming the file.

    Examples:
        >>> from streaming.base import MDSWriter  # doctest: +SKIP
        >>> with MDSWriter(out="ds", columns={"x": "int", "t": "str"}) as w:  # doctest: +SKIP
        ...     w.write({"x": 1, "t": "one"})
        >>> sources.mds("ds").get(0)  # doctest: +SKIP
        {'t': 'one', 'x': 1}
    """
    return MdsSource(root, split, columns, name, allow_unsafe_types, shard_cache_bytes,
                     io_of(io_options), storage_options)


def _check_arguments(split, columns, allow_unsafe_types, shard_cache_bytes) -> list | None:
    """The arguments' types and ranges (a ZephonConfigError); ``columns`` as a list."""
    if split is not None and (not isinstance(split, str) or not split):
        raise ZephonConfigError(f"mds: split must be a non-empty str or None, got {split!r}")
    if not isinstance(allow_unsafe_types, bool):
        raise ZephonConfigError(f"mds: allow_unsafe_types must be a bool, got "
                                f"{allow_unsafe_types!r}")
    if isinstance(shard_cache_bytes, bool) or not isinstance(shard_cache_bytes, int) or \
            shard_cache_bytes < 0:
        raise ZephonConfigError(f"mds: shard_cache_bytes must be an int >= 0, got "
                                f"{shard_cache_bytes!r}")
    if columns is None:
        return None
    columns = [columns] if isinstance(columns, str) else list(columns)
    if not columns or not all(isinstance(c, str) for c in columns):
        raise ZephonConfigError(f"mds: columns must be column names (None: all), got "
                                f"{columns!r}")
    return columns



# ---------------------------------------------------------------------------------------
# index.json


class _Shard:
    """One shard as ``index.json`` describes it (build time only)."""

    __slots__ = ("basename", "bytes", "codec", "hashes", "index", "raw_basename",
                 "raw_bytes", "samples", "schema")

    def __init__(self, entry: Any, index: str, where: str) -> None:
        self.index = index
        if not isinstance(entry, dict):
            raise SourceError(f"{where}: a shard entry is a {type(entry).__name__}, not an "
                              f"object")
        fmt = entry.get("format")
        if fmt != "mds":
            raise SourceError(f"{where}: format {fmt!r}; sources.mds reads 'mds' shards only")
        if entry.get("version") != 2:
            raise SourceError(f"{where}: shard version {entry.get('version')!r}; sources.mds "
                              f"reads version 2 (as mosaicml-streaming's MDSReader does)")
        self.samples = _count(entry.get("samples"), "samples", where)
        self.schema = _schema(entry, where)
        raw = _file_info(entry.get("raw_data"), "raw_data", where)
        self.raw_basename, self.raw_bytes = raw[0], raw[1]
        codec = entry.get("compression")
        if codec:
            if not isinstance(codec, str) or codec.split(":", 1)[0] not in _CODECS:
                raise SourceError(f"{where}: unknown compression {codec!r} (known: "
                                  f"{sorted(_CODECS)})")
            self.basename, self.bytes, self.hashes = _file_info(entry.get("zip_data"),
                                                                "zip_data", where)
            self.codec: str | None = codec
        else:
            self.basename, self.bytes, self.hashes = raw
            self.codec = None
        if self.raw_bytes < 4 * (self.samples + 2):
            raise SourceError(f"{where}: raw_data of {self.raw_bytes} bytes cannot hold "
                              f"{self.samples} samples")


def _count(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SourceError(f"{where}: {what} is {value!r}, not a count")
    return value


def _file_info(info: Any, what: str, where: str) -> tuple[str, int, dict]:
    """``(basename, bytes, hashes)`` of a ``raw_data``/``zip_data`` entry."""
    if not isinstance(info, dict) or not isinstance(info.get("basename"), str):
        raise SourceError(f"{where}: {what} is {info!r}, not {{basename, bytes}}")
    base = info["basename"]
    parts = base.replace("\\", "/").split("/")
    if not base or base.startswith("/") or ".." in parts or "://" in base:
        raise SourceError(f"{where}: {what} basename {base!r} leaves the dataset directory")
    hashes = info.get("hashes") or {}
    return base, _count(info.get("bytes"), f"{what} bytes", where), \
        hashes if isinstance(hashes, dict) else {}


def _schema(entry: dict, where: str) -> tuple:
    """``(names, encodings, sizes)`` of a shard entry, as tuples."""
    names, encodings = entry.get("column_names"), entry.get("column_encodings")
    sizes = entry.get("column_sizes")
    if not (isinstance(names, list) and isinstance(encodings, list)
            and isinstance(sizes, list) and len(names) == len(encodings) == len(sizes)
            and all(isinstance(n, str) for n in names)
            and all(isinstance(e, str) for e in encodings)
            and all(s is None or (isinstance(s, int) and s >= 0) for s in sizes)
            and len(set(names)) == len(names)):
        raise SourceError(f"{where}: column_names, column_encodings and column_sizes do not "
                          f"describe one list of columns")
    return tuple(names), tuple(encodings), tuple(sizes)


def _join(base: str, *parts: str) -> str:
    if is_remote(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(strip_file_url(base), *parts)


def _dirname(url: str) -> str:
    return url.rsplit("/", 1)[0] if is_remote(url) else os.path.dirname(url)


def _read_index(ref: FileRef, io: IoConfig, storage_options: dict | None) -> list[_Shard]:
    """The shards one ``index.json`` lists."""
    reader = FileReader(ref, io, storage_options)
    try:
        raw = reader.pread(0, ref.size, INDEX)
    finally:
        reader.close()
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise SourceError(f"mds: {ref.url}: not JSON: {exc}") from None
    if not isinstance(obj, dict) or obj.get("version") != 2 or \
            not isinstance(obj.get("shards"), list):
        version = obj.get("version") if isinstance(obj, dict) else None
        raise SourceError(f"mds: {ref.url}: not an MDS index of version 2 (version "
                          f"{version!r}, a 'shards' list)")
    return [_Shard(entry, ref.url, f"mds: {ref.url}, shard {k}") for k, entry in
            enumerate(obj["shards"])]


# ---------------------------------------------------------------------------------------
# the shard files


def _local_refs(directory: str, shards: list[_Shard]) -> list[FileRef]:
    """The FileRefs of one local directory's shards, each ``stat``-ed once: a regular
    file with the size index.json gives."""
    refs = []
    for shard in shards:
        path = _join(directory, shard.basename)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise SourceError(f"mds: shard {path} (listed in {INDEX}): cannot read it: "
                              f"{exc.strerror or exc}") from None
        if not stat.S_ISREG(st.st_mode):
            raise SourceError(f"mds: shard {path} is {describe_kind(st.st_mode)}")
        if st.st_size != shard.bytes:
            raise SourceError(f"mds: shard {path} has {st.st_size} bytes, {INDEX} says "
                              f"{shard.bytes} (truncated or rewritten)")
        refs.append(FileRef(path, shard.bytes))
    return refs


def _remote_refs(directory: str, shards: list[_Shard], io: IoConfig,
                 storage_options: dict | None) -> list[FileRef]:
    """The FileRefs (sizes and versions) of one remote directory's shards: one listing
    of the directory; a shard it does not show is looked up on its own."""
    fs = filesystem(directory, storage_options)
    suffixes = tuple({"." + s.basename.rsplit(".", 1)[-1] for s in shards}) or (".mds",)
    try:
        listed = expand(directory, "mds", io, storage_options, suffixes=suffixes)
    except SourceError:
        listed = []
    found = {fs._strip_protocol(r.url): r for r in listed}
    refs = []
    for shard in shards:
        url = _join(directory, shard.basename)
        ref = found.get(fs._strip_protocol(url))
        if ref is None:
            ref = expand(url, "mds", io, storage_options)[0]
        if ref.size != shard.bytes:
            raise SourceError(f"mds: shard {url} has {ref.size} bytes, {INDEX} says "
                              f"{shard.bytes} (truncated or rewritten)")
        refs.append(ref)
    return refs


def _decompress(codec: str, data: bytes, size: int) -> bytes:
    """``data`` decompressed (at most ``size`` bytes are produced)."""
    family = codec.split(":", 1)[0]
    what = f"sources.mds ({family} shards)"
    if family == "zstd":
        zstd = require("zstandard", EXTRA, what)
        declared = zstd.frame_content_size(data)
        if declared not in (-1, size):
            raise ValueError(f"its zstd frame declares {declared} bytes")
        return zstd.ZstdDecompressor().decompress(data, max_output_size=size)
    if family == "gz":
        import zlib

        return zlib.decompressobj(wbits=31).decompress(data, size + 1)
    if family == "bz2":
        import bz2

        return bz2.BZ2Decompressor().decompress(data, size + 1)
    module = require(_CODECS[family], EXTRA, what)
    return module.decompress(data)


def _hash_check(hashes: dict) -> tuple[str, str] | None:
    """``(algorithm, hex digest)`` of the cheapest hash in ``hashes`` this process can
    compute, or None."""
    # the cheap ones first, then any other the writer listed that hashlib or xxhash has
    for algo in (*_HASHES, *sorted(hashes)):
        want = hashes.get(algo)
        if isinstance(want, str) and _hasher(algo) is not None:
            return algo, want
    return None


def _hasher(algo: str):
    if algo.startswith("xxh"):
        try:
            # imported by name: xxhash is optional (typed where installed, absent elsewhere)
            xxhash = importlib.import_module("xxhash")
        except ImportError:
            return None
        return getattr(xxhash, algo, None)
    return getattr(hashlib, algo, None) if algo in hashlib.algorithms_guaranteed else None


# ---------------------------------------------------------------------------------------
# decoding


def _library(encoding: str):
    """mosaicml-streaming's encodings module (see the module docstring), or a
    SourceError naming the extra."""
    module = _LIBRARY.get("module")
    if module is not None:
        return module
    try:
        module = importlib.import_module("streaming.base.format.mds.encodings")
    except Exception as first:  # noqa: BLE001 - its __init__ may fail for other reasons
        error: Exception = first
    else:
        _LIBRARY["module"] = module
        return module
    spec = importlib.util.find_spec("streaming")
    if spec is not None and spec.origin is not None:
        path = os.path.join(os.path.dirname(spec.origin), "base", "format", "mds",
                            "encodings.py")
        try:
            loaded = importlib.util.spec_from_file_location("_zephon_mds_encodings", path)
            module = importlib.util.module_from_spec(loaded)  # type: ignore[arg-type]
            loaded.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - named for the user
            error = exc
        else:
            _LIBRARY["module"] = module
            return module
    raise SourceError(f"sources.mds: encoding {encoding!r} is decoded by mosaicml-streaming "
                      f"(mds_decode), which cannot be imported: python -m pip install "
                      f"mosaicml-streaming (add --no-deps where its transformers<5 pin "
                      f"clashes with yours) ({type(error).__name__}: {error})")


_LIBRARY: dict = {}


def _decode_bytes(data: bytes, lo: int, hi: int) -> bytes:
    return data[lo:hi]


def _decode_str(data: bytes, lo: int, hi: int) -> str:
    return data[lo:hi].decode("utf-8")


def _decode_int(data: bytes, lo: int, hi: int) -> int:
    return int.from_bytes(data[lo:hi], "little", signed=True)


def _decode_json(data: bytes, lo: int, hi: int) -> Any:
    return json.loads(data[lo:hi].decode("utf-8"))


def _decode_pkl(data: bytes, lo: int, hi: int) -> Any:
    return pickle.loads(data[lo:hi])  # refused unless allow_unsafe_types


def _text(parse: Callable[[str], Any]) -> Decoder:
    return lambda data, lo, hi: parse(data[lo:hi].decode("utf-8"))


def _scalar(dtype: np.dtype) -> Decoder:
    return lambda data, lo, hi: np.frombuffer(data, dtype, 1, lo)[0]


_SIMPLE: dict[str, tuple[Decoder, int | None]] = {
    "bytes": (_decode_bytes, None), "str": (_decode_str, None), "int": (_decode_int, 8),
    "json": (_decode_json, None), "pkl": (_decode_pkl, None),
    "str_int": (_text(int), None), "str_float": (_text(float), None),
    "str_decimal": (_text(Decimal), None),
    **{name: (_scalar(dt), dt.itemsize) for name, dt in _SCALARS.items()},
}


def _ndarray_spec(config: str, where: str) -> tuple[np.dtype | None, tuple | None]:
    """The dtype and shape an ``ndarray:<dtype>:<d0,d1,...>`` encoding fixes."""
    args = config.split(":") if config else []
    try:
        if len(args) > 2 or (args and args[0] not in _VALUE_DTYPES.values()):
            raise ValueError(config)
        dtype = np.dtype(args[0]) if args else None
        shape = tuple(int(d) for d in args[1].split(",")) if len(args) == 2 else None
        if shape is not None and min(shape, default=0) < 1:
            raise ValueError(config)
    except ValueError:
        raise SourceError(f"{where}: encoding 'ndarray:{config}' is not ndarray[:dtype"
                          f"[:shape]]") from None
    return dtype, shape


def _ndarray_decoder(dtype: np.dtype | None, shape: tuple | None) -> Decoder:
    if dtype is not None and shape is not None:
        count = math.prod(shape)
        return lambda data, lo, hi: np.frombuffer(data, dtype, count, lo).reshape(shape)
    return lambda data, lo, hi: _dynamic_ndarray(data, lo, hi, dtype, shape)


def _dynamic_ndarray(data: bytes, lo: int, hi: int, dtype: np.dtype | None,
                     shape: tuple | None) -> np.ndarray:
    """An ``ndarray`` value whose dtype or shape the value itself carries."""
    pos = lo
    if dtype is None:
        name = _VALUE_DTYPES.get(data[pos]) if pos < hi else None
        if name is None:
            raise ValueError("ndarray: unknown dtype code")
        dtype, pos = np.dtype(name), pos + 1
    if shape is None:
        if pos >= hi:
            raise ValueError("ndarray: no shape")
        ndim, kind = data[pos] >> 2, data[pos] & 3
        shape_dtype = _SHAPE_DTYPES[kind]
        end = pos + 1 + ndim * shape_dtype.itemsize
        if end > hi:
            raise ValueError("ndarray: shape past the value")
        shape = tuple(np.frombuffer(data, shape_dtype, ndim, pos + 1).tolist())
        pos = end
    count = math.prod(shape)
    if hi - pos != count * dtype.itemsize:
        raise ValueError(f"ndarray: {hi - pos} bytes of values for shape {shape} of {dtype}")
    return np.frombuffer(data, dtype, count, pos).reshape(shape)


def _column_decoder(encoding: str, size: int | None, where: str) -> Decoder:
    """The decoder of one column; a SourceError when the encoding is unknown or its
    size in index.json is not the one the encoding has."""
    fixed: int | None
    if encoding in _SIMPLE:
        fn, fixed = _SIMPLE[encoding]
    elif encoding == "ndarray" or encoding.startswith("ndarray:"):
        dtype, shape = _ndarray_spec(encoding[len("ndarray:"):], where)
        fn = _ndarray_decoder(dtype, shape)
        fixed = None if dtype is None or shape is None else math.prod(shape) * dtype.itemsize
    else:
        return _library_decoder(encoding, size, where)
    if size != fixed:
        raise SourceError(f"{where}: encoding {encoding!r} has size {fixed}, {INDEX} says "
                          f"{size}")
    return fn


def _library_decoder(encoding: str, size: int | None, where: str) -> Decoder:
    library = _library(encoding)
    if not library.is_mds_encoding(encoding):
        raise SourceError(f"{where}: unknown encoding {encoding!r} (neither zephon nor "
                          f"mosaicml-streaming knows it)")
    if library.get_mds_encoded_size(encoding) != size:
        raise SourceError(f"{where}: encoding {encoding!r} has size "
                          f"{library.get_mds_encoded_size(encoding)}, {INDEX} says {size}")
    decode = library.mds_decode
    return lambda data, lo, hi: decode(encoding, data[lo:hi])


class _Plan:
    """Decodes the samples of one schema: the chosen columns, in column order."""

    __slots__ = ("fixed_total", "head", "nvar", "steps")

    def __init__(self, schema: tuple, columns: Sequence[str] | None, where: str) -> None:
        names, encodings, sizes = schema
        self.nvar = sum(size is None for size in sizes)
        self.head = struct.Struct(f"<{self.nvar}I")
        self.fixed_total = 4 * self.nvar + sum(size or 0 for size in sizes)
        chosen = set(names if columns is None else columns)
        self.steps = [(name, size, _column_decoder(enc, size, f"{where}, column {name!r}")
                       if name in chosen else None)
                      for name, enc, size in zip(names, encodings, sizes, strict=True)]

    def __call__(self, data: bytes) -> dict:
        sizes: tuple = self.head.unpack_from(data, 0) if self.nvar else ()
        total = self.fixed_total + sum(sizes)
        if total != len(data):
            raise ValueError(f"its column sizes add up to {total} bytes, the sample has "
                             f"{len(data)}")
        out = {}
        pos, var = 4 * self.nvar, 0
        for name, fixed, fn in self.steps:
            if fixed is None:
                fixed, var = sizes[var], var + 1
            end = pos + fixed
            if fn is not None:
                out[name] = fn(data, pos, end)
            pos = end
        return out


# ---------------------------------------------------------------------------------------
# the source


class _Loaded:
    """A shard as one process holds it: its offsets and, compressed, its bytes."""

    __slots__ = ("data", "nbytes", "offsets")

    def __init__(self, offsets: np.ndarray, data: bytes | None) -> None:
        self.offsets, self.data = offsets, data
        self.nbytes = offsets.nbytes + (len(data) if data is not None else 0)


class MdsSource(FileSource):
    """Samples of MDS shards (see :func:`mds` and the module docstring)."""

    _per_process = ("_loaded", "_cache_bytes", "_last", "_starts", "_plans", "_load_locks")

    def __init__(self, root, split: str | None, columns: Sequence[str] | None, name: str,
                 allow_unsafe_types: bool, shard_cache_bytes: int, io: IoConfig = DEFAULT_IO,
                 storage_options: dict | None = None) -> None:
        columns = _check_arguments(split, columns, allow_unsafe_types, shard_cache_bytes)
        self.columns, self.name, self.split = columns, name, split
        self.allow_unsafe_types = bool(allow_unsafe_types)
        self.shard_cache_bytes = int(shard_cache_bytes)
        self.io, self.storage_options = io, storage_options
        roots = [root] if isinstance(root, (str, os.PathLike)) else list(root)
        self.roots = [os.fspath(r) for r in roots]
        indexes = self._index_refs()
        self.index_files = [ref.url for ref in indexes]
        refs: list[FileRef] = []
        shards: list[_Shard] = []
        for ref in indexes:
            listed = _read_index(ref, io, storage_options)
            directory = _dirname(ref.url)
            refs += _remote_refs(directory, listed, io, storage_options) if ref.remote \
                else _local_refs(directory, listed)
            shards += listed
        self._set_files(refs)
        self._describe_shards(shards)
        self._fresh()
        for k in sorted(set(self.shard_schema.tolist())):  # refuse bad columns when built
            self._plan_of(k)

    def _index_refs(self) -> list[FileRef]:
        """The ``index.json`` of each root (globs expanded, sorted)."""
        patterns = [_join(r, *([self.split] if self.split else []), INDEX)
                    for r in self.roots]
        if not patterns:
            raise SourceError("mds: no root given")
        try:
            return expand(patterns, "mds", self.io, self.storage_options)
        except SourceError as exc:
            raise SourceError(f"{exc} (mds reads the {INDEX} of each root"
                              f"{', in its split sub-directory' if self.split else ''}: "
                              f"the directory MDSWriter wrote)") from None

    def _describe_shards(self, shards: list[_Shard]) -> None:
        """The per-shard facts kept (pickled with the source): a few numbers each."""
        schemas: dict[tuple, int] = {}
        self.shard_schema = np.asarray([schemas.setdefault(s.schema, len(schemas))
                                        for s in shards], dtype=np.int32)
        self.schemas = list(schemas)
        where = {s.schema: s.index for s in reversed(shards)}
        self.schema_index = [where[schema] for schema in self.schemas]  # where each is from
        self.shard_rows = np.asarray([s.samples for s in shards], dtype=np.int64)
        self.shard_raw_bytes = np.asarray([s.raw_bytes for s in shards], dtype=np.int64)
        self.shard_codec = [s.codec for s in shards]
        self.shard_check = [_hash_check(s.hashes) if s.codec else None for s in shards]
        self.starts = np.concatenate([[0], np.cumsum(self.shard_rows)]).astype(np.int64)
        header = 4 * (2 + self.shard_rows)
        self.row_nbytes = float((self.shard_raw_bytes - header).sum()) / max(1, len(self))
        for family in {c.split(":", 1)[0] for c in self.shard_codec if c}:
            if family not in ("gz", "bz2"):
                require(_CODECS[family], EXTRA, f"sources.mds ({family} shards)")

    def _fresh(self) -> None:
        super()._fresh()
        self._loaded: collections.OrderedDict = collections.OrderedDict()
        self._cache_bytes = 0
        self._last: tuple | None = None  # (first index, end index, shard, loaded, plan)
        self._starts: list | None = None
        self._plans: dict[int, _Plan] = {}
        self._load_locks: dict[int, threading.Lock] = collections.defaultdict(threading.Lock)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _plan_of(self, k: int) -> _Plan:
        """The decoder of schema ``k`` in this process; refuses a missing column, and a
        ``pkl`` one without ``allow_unsafe_types``."""
        plan = self._plans.get(k)
        if plan is None:
            names, encodings, _ = self.schemas[k]
            where = f"mds: {self.schema_index[k]}"
            missing = [c for c in self.columns or () if c not in names]
            if missing:
                raise SourceError(f"{where}: no column(s) {missing}; the shards have "
                                  f"{list(names)}")
            unsafe = [n for n, e in zip(names, encodings, strict=True) if e == "pkl"
                      and (self.columns is None or n in self.columns)]
            if unsafe and not self.allow_unsafe_types:
                raise SourceError(f"{where}: column(s) {unsafe} are pkl (pickle: reading runs "
                                  f"code from the shard); pass allow_unsafe_types=True for "
                                  f"data you trust, or columns=[...] without them")
            plan = self._plans[k] = _Plan(self.schemas[k], self.columns, where)
        return plan

    def get(self, i: int) -> Any:
        """Sample ``i``: one ``pread`` of its bytes (a raw shard) or a slice of its
        decompressed shard, decoded column by column (see :func:`mds`)."""
        last = self._last
        if last is None or not last[0] <= i < last[1]:
            last = self._enter(i)
        lo, _, s, loaded, plan = last
        j = i - lo
        a, b = loaded.offsets[j:j + 2].tolist()
        data = loaded.data
        if data is None:
            data = self.reader(s).pread(a, b - a, f"sample {j}")
        else:
            data = data[a:b]
        try:
            return plan(data)
        except Exception as exc:  # noqa: BLE001 - any decoding error names the file
            raise SourceError(f"mds: {self.files[s]}: sample {j} cannot be decoded: "
                              f"{type(exc).__name__}: {exc}") from None

    def _enter(self, i: int) -> tuple:
        """The fast-path record of the shard holding sample ``i`` (loading it)."""
        if not 0 <= i < len(self):
            raise IndexError(f"mds: sample {i} out of range [0, {len(self)})")
        starts = self._starts
        if starts is None:
            starts = self._starts = self.starts.tolist()
        s = bisect.bisect_right(starts, i) - 1
        last = (starts[s], starts[s + 1], s, self._shard(s),
                self._plan_of(int(self.shard_schema[s])))
        self._last = last
        return last

    def _shard(self, s: int) -> _Loaded:
        """Shard ``s`` as this process holds it (read on first use; LRU)."""
        loaded = self._loaded.get(s)
        if loaded is not None:
            with self._lock:
                if s in self._loaded:
                    self._loaded.move_to_end(s)
            return loaded
        with self._load_locks[s]:  # one read per shard even with many threads
            loaded = self._loaded.get(s)
            if loaded is not None:
                return loaded
            loaded = self._load(s)
            with self._lock:
                self._loaded[s] = loaded
                self._cache_bytes += loaded.nbytes
                while self._cache_bytes > self.shard_cache_bytes and len(self._loaded) > 1:
                    _, old = self._loaded.popitem(last=False)
                    self._cache_bytes -= old.nbytes
        return loaded

    def _load(self, s: int) -> _Loaded:
        """Read shard ``s``: a raw shard's header; a compressed shard whole, checked
        against its hash, decompressed."""
        n, codec = int(self.shard_rows[s]), self.shard_codec[s]
        if codec is None:
            head = self.reader(s).pread(0, 4 * (n + 2), "header")
            return _Loaded(self._offsets(s, head, int(self.refs[s].size)), None)
        data = self.reader(s).pread(0, int(self.refs[s].size), "whole shard")
        check = self.shard_check[s]
        if check is not None and _hasher(check[0])(data).hexdigest() != check[1]:
            raise SourceError(f"mds: {self.files[s]}: its {check[0]} is not the one {INDEX} "
                              f"lists (corrupt, or rewritten since)")
        size = int(self.shard_raw_bytes[s])
        try:
            data = _decompress(codec, data, size)
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - each codec raises its own classes
            raise SourceError(f"mds: {self.files[s]}: cannot decompress ({codec}): "
                              f"{type(exc).__name__}: {exc}") from None
        if len(data) != size:
            raise SourceError(f"mds: {self.files[s]}: decompresses to {len(data)} bytes or "
                              f"more, {INDEX} says {size}")
        return _Loaded(self._offsets(s, data, size), data)

    def _offsets(self, s: int, head: bytes, size: int) -> np.ndarray:
        """The checked sample offsets in a shard's header."""
        n = int(self.shard_rows[s])
        words = np.frombuffer(head, np.dtype("<u4"), n + 2).astype(np.int64)
        offsets = words[1:]
        bad = ""
        if int(words[0]) != n:
            bad = f"its header counts {int(words[0])} samples, {INDEX} says {n}"
        elif offsets[0] < 4 * (n + 2) or offsets[-1] != size or (np.diff(offsets) < 0).any():
            bad = "its sample offsets are not rising from the header to the end of the shard"
        if bad:
            raise SourceError(f"mds: {self.files[s]}: corrupt header: {bad}")
        return offsets

    def shard_bounds(self) -> np.ndarray:
        """The MDS shards, in index order."""
        return self.starts.astype(np.int64)

    def sample_nbytes(self) -> float | None:
        """Encoded bytes per sample (all columns), from ``index.json``."""
        return self.row_nbytes

    def describe(self) -> str:
        names = [f if is_remote(f) else os.path.abspath(f) for f in self.index_files]
        return (f"MdsSource({self.name}, index={names}, shards={len(self.refs)}, "
                f"samples={len(self)}, columns={self.columns}, "
                f"unsafe={self.allow_unsafe_types})")
