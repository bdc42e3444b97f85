"""litdata: the items of a dataset written by Lightning's ``litdata.optimize()``.

This module owns reading a litdata "optimized" directory without litdata's loader: the
index, the chunk layouts, the leaf encodings of the common leaf types and the rebuilding
of each item's pytree. What litdata writes (read from litdata 0.2.76's
``litdata/streaming/writer.py``, ``item_loader.py``, ``serializers.py``,
``framed_zstd.py``):

- ``index.json``: ``{"chunks": [{"filename", "chunk_size" (items), "chunk_bytes", "dim"},
  ...], "config": {"item_loader", "data_format" (one serializer name per leaf),
  "data_spec" (the item's pytree spec, litdata's JSON of a ``torch.utils._pytree``-style
  TreeSpec), "compression", "compression_level", "encryption", ...}}``. Building the
  source reads this file only: the chunks' item counts and sizes are in it.
- a chunk of ``PyTreeLoader`` items: ``uint32 n``, ``uint32 offsets[n + 1]`` (absolute,
  ``offsets[0] = 4 (n + 2)``), then the items back to back; an item is one ``uint32`` size
  per leaf, then the leaves' bytes. With ``compression="zstd"``:

  * ``compression_level="chunk"`` (``*.zstd.bin``): the whole file is one zstd frame of
    such a chunk (``chunk_bytes`` is its decompressed size, so the files' sizes come from
    one listing of the directory); it is decompressed whole into the per-process LRU.
    litdata's own reader decompresses such a chunk of a local corpus in place
    (``chunk-0-0.zstd.bin`` becomes ``chunk-0-0.bin``): a chunk found only in that form
    is read as the plain chunk it is;
  * ``"batch"`` (litdata's default for zstd; magic ``LDFZ01``): a header, the items'
    offsets in their concatenation, a table of frames (``first_item, n_items, offset,
    compressed, uncompressed``) and zstd frames of 256 items; a frame is decompressed
    whole into the LRU;
  * ``"sample"``: the classic layout with each item compressed on its own.

  A chunk may end with an Arrow IPC footer (``ipc, uint32 len, b"LDARW01\\0"``): litdata
  writes rows of JSON-like dicts (every field a str, int, float, bool, bytes, list or
  dict) there, with no item bytes at all, and reads the footer whenever it is present;
  so does this source (pyarrow, one record batch of 256 rows at a time, kept in the LRU).
- a chunk of ``TokensLoader`` items: the classic header, then all items' tokens back to
  back (their dtype from ``data_format``, ``no_header_numpy:K`` or ``no_header_tensor:K``);
  sample ``i`` is the window of ``block_size`` tokens that ``TokensLoader(block_size)``
  gives: chunk by chunk, ``dim // block_size`` windows each (a chunk's tail shorter than a
  window is no sample).

Sample ``i`` is litdata's item ``i`` (chunks in index order, items in order); a chunk is a
shard. Reads: each process reads a chunk's header (its offsets) once and keeps it in the
LRU; an item is then one positional read through the source's FileReader. ``get_batch``
reads each run of consecutive items of a chunk with one read and, when an item is a dict
of leaves, decodes the batch column by column (numbers and equal arrays gathered
straight from the bytes into one array each). Compressed chunks and frames are
decompressed whole into the LRU (``cache_bytes`` per process).

Values are as ``litdata.StreamingDataset`` returns them, with these differences: bytes
are ``bytes`` (litdata hands out memoryviews of its buffer); torch tensors are NumPy
arrays (see :func:`litdata`); a ``TokensLoader`` window is ``{"tokens": window}`` (litdata:
the bare array), so that batches carry their sample ids and ``mixture(by="tokens")`` knows
the window length. Leaves of other types (images, JSON lists, pickles, audio, ...) are
decoded by litdata's own serializers (the ``litdata`` extra).

Failures: a missing, unreadable or inconsistent ``index.json``, a layout this source does
not read (encryption, ``ParquetLoader``, MDS, an unknown serializer) or a missing optional
library is a :class:`SourceError` when the source is built; a corrupt or truncated chunk
(offsets that do not rise inside the file, leaf sizes that do not add up to the item, a
count that disagrees with the index, a zstd frame that does not decompress to its size,
bytes that do not decode) is a :class:`SourceError` naming the chunk file when it is read.
litdata stores no checksum: a flipped bit inside a number's bytes reads as another number.
"""

from __future__ import annotations

import bisect
import collections
import copy
import importlib
import importlib.util
import itertools
import json
import math
import os
import struct
import sys
from typing import Any, Callable, cast

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.reader import FileReader
from zephon.io.remote import FileRef, expand, is_remote, require
from zephon.pipeline.sources.base import FileSource, Source, SourceError

__all__ = ["LitDataSource", "litdata"]

INDEX = "index.json"
#: litdata's numpy dtypes by index (``litdata.constants._NUMPY_DTYPES_MAPPING``); object,
#: bytes, str and void arrays are not readable back by litdata either
_NUMPY_DTYPES = [np.dtype(t) for t in ("i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2",
                                       "f4", "f8", "c8", "c16", "?")]
#: litdata's torch dtypes by index (``_TORCH_DTYPES_MAPPING``) as NumPy dtypes; 10 is
#: bfloat16 (no NumPy dtype; litdata cannot write it either)
_TORCH_DTYPES = {0: "f4", 1: "f4", 2: "f8", 3: "f8", 4: "c8", 5: "c8", 6: "c16", 7: "c16",
                 8: "f2", 9: "f2", 11: "u1", 12: "i1", 13: "i2", 14: "i2", 15: "i4", 16: "i4",
                 17: "i8", 18: "i8", 19: "?", 20: "u2"}
_FOOTER_MAGIC = b"LDARW01\0"
_FOOTER_ROWS = 256  # rows per record batch of the Arrow footer (litdata's _DEFAULT_BATCH_ROWS)
_FRAMED_MAGIC = b"LDFZ01\0\0"
_FRAMED_PREFIX = struct.Struct("<8sHHIII")
_FRAME = struct.Struct("<IIQII")
_I64, _F64 = struct.Struct("<q"), struct.Struct("<d")
_LOADERS = ("PyTreeLoader", "TokensLoader")
#: entries of a chunk header in the LRU are charged this many bytes per offset
_OFFSET_COST = 8


def _raw_bytes(b) -> bytes:
    return bytes(b)


def _utf8(b) -> str:
    return bytes(b).decode("utf-8")


#: leaves this module decodes itself, by data format
_SIMPLE: dict[str, Callable[[Any], Any]] = {
    "int": lambda b: _I64.unpack(b)[0],
    "float": lambda b: _F64.unpack(b)[0],
    "bool": lambda b: b[0] != 0,
    "str": _utf8,
    "text": _utf8,
    "bytes": _raw_bytes,
}


def _numpy_leaf(b) -> np.ndarray:
    """litdata's ``numpy`` leaf: uint32 dtype index, uint32 rank, uint32 dims, the data."""
    code, rank = struct.unpack_from("<II", b, 0)
    shape = struct.unpack_from(f"<{rank}I", b, 8)
    return _shaped(b, 8 + 4 * rank, _NUMPY_DTYPES[code], shape)


def _tensor_leaf(b) -> np.ndarray:
    """litdata's ``tensor`` leaf: big-endian uint32 dtype index and rank, big-endian uint32
    dims, the data (native order), as a NumPy array."""
    code, rank = struct.unpack_from(">II", b, 0)
    shape = struct.unpack_from(f">{rank}I", b, 8)
    return _shaped(b, 8 + 4 * rank, np.dtype(_TORCH_DTYPES[code]), shape)


def _shaped(b, start: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
    count = math.prod(shape)
    if len(b) - start != count * dtype.itemsize:
        raise ValueError(f"an array of shape {shape} and dtype {dtype} in {len(b) - start} "
                         f"bytes")
    out = np.frombuffer(b, dtype, count, start).copy()
    out.shape = shape
    return out


def _flat(dtype: np.dtype) -> Callable[[Any], np.ndarray]:
    def leaf(b) -> np.ndarray:
        return np.frombuffer(b, dtype).copy()
    return leaf


def _dtype_of(fmt: str, root: str) -> np.dtype:
    """The dtype of a ``no_header_numpy:K`` / ``no_header_tensor:K`` data format."""
    kind, _, code = fmt.partition(":")
    try:
        k = int(code)
        if kind == "no_header_numpy":
            return _NUMPY_DTYPES[k]
        return np.dtype(_TORCH_DTYPES[k])
    except (ValueError, IndexError, KeyError):
        raise SourceError(f"litdata: {root}: data format {fmt!r}: a dtype litdata cannot "
                          f"read back (or an index.json from another litdata)") from None


def _missing(module: str) -> bool:
    """Whether ``module`` cannot be imported (found without importing it)."""
    if module in sys.modules:
        return sys.modules[module] is None
    return importlib.util.find_spec(module) is None


def _library(module: str, what: str) -> Any:
    """A module of the litdata package, which decodes what zephon does not decode itself;
    a SourceError naming the package when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SourceError(f"{what} is decoded by the litdata package, which cannot be "
                          f"imported: python -m pip install litdata (add --no-deps where "
                          f"its torchvision requirement would replace your torch) "
                          f"({exc})") from None


def _litdata_leaf(fmt: str, root: str) -> Callable[[Any], Any]:
    """The ``deserialize`` of litdata's own serializer for ``fmt`` (set up as litdata's
    item loader sets it up)."""
    mod = _library("litdata.streaming.serializers", f"litdata: {root}: the data format {fmt!r}")
    serializers = mod._get_serializers(None)
    name, _, sub = fmt.partition(":")
    key = sub if sub and sub in serializers else name
    if key not in serializers:
        raise SourceError(f"litdata: {root}: data format {fmt!r} has no litdata serializer "
                          f"(written with a custom one?): it cannot be read")
    serializer = copy.deepcopy(serializers[key])
    serializer.setup(fmt)
    deserialize = serializer.deserialize
    return lambda b: deserialize(bytes(b))


def leaf_decoder(fmt: str, root: str) -> Callable[[Any], Any]:
    """How a leaf of data format ``fmt`` is decoded (``root`` names the corpus in errors)."""
    simple = _SIMPLE.get(fmt)
    if simple is not None:
        return simple
    if fmt.startswith(("no_header_numpy:", "no_header_tensor:")):
        return _flat(_dtype_of(fmt, root))
    if fmt == "numpy":
        return _numpy_leaf
    if fmt == "tensor":
        return _tensor_leaf
    return _litdata_leaf(fmt, root)


# -- the item's pytree -------------------------------------------------------------------

class _Unknown(Exception):
    """A pytree node type this module does not rebuild itself."""


def _maker(kind: str, context) -> Callable[[list], Any]:
    if kind in ("builtins.dict", "collections.OrderedDict"):
        keys = json.loads(context)
        cls = dict if kind == "builtins.dict" else collections.OrderedDict
        return lambda values: cls(zip(keys, values, strict=True))
    if kind == "builtins.list":
        return list
    if kind == "builtins.tuple":
        return tuple
    raise _Unknown(kind)


def _compile(node: dict) -> tuple[Callable[[list], Any] | None, int]:
    """``(builder, leaves)`` of one spec node: the builder makes the subtree from its
    leaves (None for a leaf)."""
    kind, children = node.get("type"), node.get("children_spec") or []
    if kind is None and not children:
        return None, 1
    if not isinstance(kind, str):
        raise _Unknown(kind)
    make = _maker(kind, node.get("context"))
    parts, n = [], 0
    for child in children:
        build, count = _compile(child)
        parts.append((n, n + count, build))
        n += count
    if all(build is None for _, _, build in parts):
        return make, n

    def nested(leaves: list) -> Any:
        return make([leaves[a] if build is None else build(leaves[a:b])
                     for a, b, build in parts])
    return nested, n


def tree_builder(spec: str | None, leaves: int, root: str) -> Callable[[list], Any]:
    """The function that makes an item from its decoded leaves, from ``data_spec``: dicts,
    lists, tuples and OrderedDicts rebuilt here; other node types (a namedtuple, a
    defaultdict, a type registered with litdata's pytree) by litdata's ``tree_unflatten``."""
    if spec is None:
        return lambda values: values[0] if len(values) == 1 else list(values)
    try:
        protocol, schema = json.loads(spec)
        if protocol != 1:
            raise _Unknown(f"protocol {protocol}")
        build, count = _compile(schema)
    except _Unknown:
        pytree = _library("litdata.utilities._pytree",
                          f"litdata: {root}: its item structure (data_spec)")
        tree = pytree.treespec_loads(spec)
        build, count = (lambda values: pytree.tree_unflatten(values, tree)), tree.num_leaves
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise SourceError(f"litdata: {root}/{INDEX}: data_spec is not a pytree spec: "
                          f"{type(exc).__name__}: {exc}") from None
    if count != leaves:
        raise SourceError(f"litdata: {root}/{INDEX}: data_spec has {count} leaves, "
                          f"data_format {leaves}")
    return build if build is not None else (lambda values: values[0])


def _flat_keys(spec: str | None) -> list | None:
    """The keys of an item that is a dict of leaves (read column by column), else None."""
    try:
        protocol, node = json.loads(spec or "null") or (None, None)
        if not isinstance(node, dict):
            return None
        children = node["children_spec"]
        if protocol != 1 or node["type"] != "builtins.dict" or \
                any(c.get("type") is not None or c.get("children_spec") for c in children):
            return None
        keys = json.loads(node["context"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return keys if isinstance(keys, list) and len(keys) == len(children) else None


def _leaf_kind(fmt: str) -> str:
    """How a leaf's column is read in a batch (see :func:`_column`)."""
    if fmt in ("int", "float", "bool", "bytes"):
        return fmt
    if fmt in ("str", "text"):
        return "str"
    if fmt.startswith(("no_header_numpy:", "no_header_tensor:")):
        return "flat"
    return "header" if fmt in ("numpy", "tensor") else "item"


class _Plan:
    """How one process decodes items: the leaves' size header, their decoders, the pytree
    builder, and (an item that is a dict of leaves) the keys and column kinds of the
    columnar read."""

    __slots__ = ("build", "decoders", "keys", "kinds", "shift", "sizes")

    def __init__(self, formats: list[str], spec: str | None, root: str, tokens: bool) -> None:
        self.decoders = [leaf_decoder(f, root) for f in formats]
        self.build = None if tokens else tree_builder(spec, len(formats), root)
        self.sizes = struct.Struct("<" + "I" * len(formats))
        self.shift = self.sizes.size
        self.keys = None if tokens else _flat_keys(spec)
        self.kinds = [_leaf_kind(f) for f in formats]


_NUMBERS: dict[str, tuple[int, np.dtype]] = {
    "int": (8, np.dtype(np.int64)), "float": (8, np.dtype(np.float64)),
    "bool": (1, np.dtype(np.uint8))}


def _column(kind: str, decode, u8: np.ndarray, buf: bytes, at: np.ndarray,
            sizes: np.ndarray):
    """One column of a batch, as ``batch()`` collates the leaves ``buf[at:at + sizes]``:
    numbers one array, strings and bytes a list, arrays of one shape and dtype one stacked
    array (read straight from the bytes), anything else the decoded leaves collated."""
    from zephon.pipeline.collate import collate_column

    if kind in _NUMBERS:
        size, dtype = _NUMBERS[kind]
        if (sizes != size).any():
            raise ValueError(f"a {kind} leaf of another size")
        raw = u8[at[:, None] + np.arange(size)].view(dtype).reshape(len(at))
        return raw != 0 if kind == "bool" else raw
    if kind in ("str", "bytes"):
        spans = zip(at.tolist(), (at + sizes).tolist(), strict=True)
        if kind == "str":
            return collate_column([buf[a:b].decode("utf-8") for a, b in spans])
        return collate_column([buf[a:b] for a, b in spans])
    if kind in ("flat", "header") and len(at) and (sizes == sizes[0]).all():
        stacked = _stacked(decode, u8, buf, at, int(sizes[0]))
        if stacked is not None:
            return stacked
    return collate_column([decode(buf[a:a + s]) for a, s in
                           zip(at.tolist(), sizes.tolist(), strict=True)])


def _stacked(decode, u8: np.ndarray, buf: bytes, at: np.ndarray, size: int):
    """Array leaves of ``size`` bytes each with one header (dtype and shape), stacked
    straight from the bytes; None when they are empty or their headers differ."""
    first = decode(buf[int(at[0]):int(at[0]) + size])
    head = size - first.nbytes
    if not first.nbytes or head < 0:
        return None
    if head:
        heads = u8[at[:, None] + np.arange(head)]
        if (heads != heads[0]).any():
            return None
    data = u8[at[:, None] + (head + np.arange(first.nbytes))]
    return data.view(first.dtype).reshape((len(at), *first.shape))


def columns_of(plan: _Plan, buf: bytes, pos: np.ndarray) -> dict | None:
    """The batch of the items ``buf[pos[m]:pos[m + 1]]`` (a dict of leaves each), column by
    column; None when an item's leaf sizes do not add up or a leaf does not decode (the
    items are then read one by one, which names the item)."""
    keys = plan.keys
    if keys is None:
        return None
    u8 = np.frombuffer(buf, np.uint8)
    starts, n_leaves = pos[:-1], len(plan.decoders)
    try:
        sizes = u8[starts[:, None] + np.arange(4 * n_leaves)].view("<u4").astype(np.int64)
        if (plan.shift + sizes.sum(axis=1) != np.diff(pos)).any():
            return None
        at = starts[:, None] + plan.shift + np.cumsum(sizes, axis=1) - sizes
        return {key: _column(plan.kinds[c], plan.decoders[c], u8, buf, at[:, c], sizes[:, c])
                for c, key in enumerate(keys)}
    except Exception:  # noqa: BLE001 - read one by one: that names the failing item
        return None


def _joined(pieces: list) -> tuple[bytes, np.ndarray]:
    """One buffer and its item offsets from ``(buffer, offsets)`` pieces."""
    if len(pieces) == 1:
        return pieces[0]
    parts, offsets, total = [], [], 0
    for data, pos in pieces:
        a, b = int(pos[0]), int(pos[-1])
        parts.append(memoryview(data)[a:b])
        offsets.append(pos[:-1] - a + total)
        total += b - a
    offsets.append(np.asarray([total], dtype=np.int64))
    return b"".join(parts), np.concatenate(offsets)


# -- index.json ----------------------------------------------------------------------------

def _index_url(root) -> str:
    root = os.fspath(root)
    if root.rstrip("/").endswith("/" + INDEX) or root == INDEX:
        return root
    return root.rstrip("/") + "/" + INDEX


def read_index(root, io: IoConfig, storage_options: dict | None) -> tuple[FileRef, dict]:
    """``(ref of index.json, its content)``; a SourceError naming it when it is missing or
    not litdata's index."""
    url = _index_url(root)
    # a local path that exists is itself (brackets in a directory name are not a glob)
    ref = FileRef(url, os.path.getsize(url)) if not is_remote(url) and os.path.isfile(url) \
        else expand(url, "litdata", io, storage_options)[0]
    reader = FileReader(ref, io, storage_options)
    try:
        data = json.loads(reader.pread(0, ref.size, INDEX))
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceError(f"litdata: {ref.url}: not JSON: {exc}") from None
    finally:
        reader.close()
    if not isinstance(data, dict) or not isinstance(data.get("chunks"), list) or \
            not isinstance(data.get("config"), dict):
        raise SourceError(f"litdata: {ref.url}: not a litdata index (no 'chunks' list and "
                          f"'config' object)")
    return ref, data


def _refuse_config(config: dict, where: str) -> None:
    """A SourceError for a configuration this source does not read."""
    loader = config.get("item_loader")
    if config.get("encryption"):
        raise SourceError(f"litdata: {where}: the chunks are encrypted; this source reads "
                          f"unencrypted corpora only (read it with litdata)")
    if config.get("format") == "mds":
        raise SourceError(f"litdata: {where}: an MDS (MosaicML streaming) corpus indexed by "
                          f"litdata: read the MDS shards themselves")
    if loader == "ParquetLoader":
        raise SourceError(f"litdata: {where}: a Parquet corpus indexed by litdata: read its "
                          f"files with sources.parquet")
    if loader not in _LOADERS:
        raise SourceError(f"litdata: {where}: item_loader {loader!r}: this source reads "
                          f"{' and '.join(_LOADERS)} corpora")
    compression = config.get("compression")
    if compression and not str(compression).startswith("zstd"):
        raise SourceError(f"litdata: {where}: compression {compression!r} (zstd only)")
    if not isinstance(config.get("data_format"), list) or not config["data_format"]:
        raise SourceError(f"litdata: {where}: config has no data_format list")


def _wrap(config: dict) -> str:
    """How chunks are compressed: '' (not), 'chunk', 'batch' or 'sample'."""
    if not config.get("compression"):
        return ""
    level = config.get("compression_level") or "chunk"
    if level not in ("chunk", "batch", "sample"):
        raise ValueError(f"compression_level {level!r}")
    return level


def _chunk_counts(chunks: list, where: str) -> tuple[list[str], list[int], list[int], list]:
    """``(filenames, items, bytes, dims)`` of the index's chunks."""
    names, items, sizes, dims = [], [], [], []
    for c, chunk in enumerate(chunks):
        try:
            name, n, size = chunk["filename"], int(chunk["chunk_size"]), int(chunk["chunk_bytes"])
            dim = None if chunk.get("dim") is None else int(chunk["dim"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"litdata: {where}: chunk {c} has no usable filename, "
                              f"chunk_size, chunk_bytes ({type(exc).__name__}: {exc})") from None
        if not isinstance(name, str) or "/" in name or n < 0 or size < 0:
            raise SourceError(f"litdata: {where}: chunk {c} is not a chunk entry: {chunk}")
        names.append(name)
        items.append(n)
        sizes.append(size)
        dims.append(dim)
    return names, items, sizes, dims


def _folder(index_url: str) -> str:
    return index_url.rsplit("/", 1)[0] if "/" in index_url else "."


def _parent(url: str) -> str:
    """The folder of ``url``, without its protocol and slashes at either end."""
    path = url.split("://", 1)[1] if "://" in url else os.path.abspath(url)
    return path.rsplit("/", 1)[0].strip("/")


def _chunk_refs(folder: str, names: list[str], sizes: list[int], compression: str | None,
                io: IoConfig, storage_options: dict | None) -> tuple[list[FileRef], list[bool]]:
    """The chunk files and whether each is compressed whole. Their sizes are the index's,
    except for whole-file compression (the index holds the decompressed size): then one
    listing of the folder gives them. litdata's own reader decompresses such a chunk of a
    local corpus in place (``chunk-0-0.zstd.bin`` becomes ``chunk-0-0.bin``): a chunk found
    only in that form is read as it is."""
    urls = [f"{folder}/{name}" if is_remote(folder) else os.path.join(folder, name)
            for name in names]
    if compression is None:
        return [FileRef(url, size) for url, size in zip(urls, sizes, strict=True)], \
            [False] * len(names)
    # the folder's own files: a remote listing is recursive, and a sub-corpus in a
    # sub-folder may hold chunks of the same names
    listed = {ref.basename: ref for ref in expand(folder, "litdata", io, storage_options,
                                                  suffixes=(".bin",))
              if _parent(ref.url) == _parent(folder + "/x")}
    refs, packed = [], []
    for name in names:
        plain = name.replace(f".{compression}", "")
        found = listed.get(name) or listed.get(plain)
        if found is None:
            raise SourceError(f"litdata: {folder}: chunk file {name} listed in {INDEX} is "
                              f"missing")
        refs.append(found)
        packed.append(found.basename == name and name != plain)
    return refs, packed


# -- the source ----------------------------------------------------------------------------

class _Head:
    """What a process knows of one chunk once it read its header: the items' offsets
    (absolute in the (decompressed) chunk; for a framed chunk, in the concatenation of its
    items), the Arrow footer's span, and a framed chunk's frames."""

    __slots__ = ("footer", "frame_rows", "frames", "nbytes", "offsets")

    def __init__(self, offsets: np.ndarray, footer: tuple[int, int] | None = None,
                 frames: list | None = None, frame_rows: int = 0) -> None:
        self.offsets, self.footer, self.frames = offsets, footer, frames
        self.frame_rows = frame_rows
        self.nbytes = _OFFSET_COST * (len(offsets) + 3 * len(frames or ()))


class LitDataSource(FileSource):
    """The items of a litdata corpus (see the module docstring); build it with
    :func:`litdata`."""

    _per_process = ("_lru", "_lru_bytes", "_plan", "_last", "_starts_l", "_unzstd")

    def __init__(self, root, name: str, block_size: int | None, cache_bytes: int,
                 io: IoConfig = DEFAULT_IO, storage_options: dict | None = None) -> None:
        self.name, self.io, self.storage_options = name, io, storage_options
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, (int, np.integer)) or \
                cache_bytes < 0:
            raise ZephonConfigError(f"litdata: cache_bytes must be an int >= 0, got "
                                    f"{cache_bytes!r}")
        self.cache_bytes = int(cache_bytes)
        index_ref, data = read_index(root, io, storage_options)
        where = index_ref.url
        config = data["config"]
        _refuse_config(config, where)
        self.root = _folder(index_ref.url)
        self.loader = config["item_loader"]
        self.data_format = [str(f) for f in config["data_format"]]
        self.data_spec = config.get("data_spec")
        try:
            self.wrap = _wrap(config)
        except ValueError as exc:
            raise SourceError(f"litdata: {where}: {exc}") from None
        names, items, sizes, dims = _chunk_counts(data["chunks"], where)
        self.chunk_items = np.asarray(items, dtype=np.int64)
        self.chunk_bytes = np.asarray(sizes, dtype=np.int64)
        self.block_size = self._check_block(block_size, where)
        if self.block_size and self.wrap in ("batch", "sample"):
            raise SourceError(f"litdata: {where}: a TokensLoader corpus compressed by "
                              f"{self.wrap} (litdata compresses tokens by chunk only)")
        counts = self._tokens_setup(dims, self.block_size, where) if self.block_size \
            else self.chunk_items
        refs, packed = _chunk_refs(self.root, names, sizes, config["compression"]
                                   if self.wrap == "chunk" else None, io, storage_options)
        self.packed = np.asarray(packed, dtype=bool)  # compressed whole, chunk by chunk
        self._set_files([*refs, index_ref])  # index.json last: its stamp is checked too
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._fresh()
        self._decoding_plan()  # every leaf decodable (a missing library named now)
        if self.wrap:
            _zstd_decompressor(self.root)  # likewise the zstd library
        elif self.loader != "TokensLoader" and len(self.chunk_items) and \
                _missing("pyarrow") and self._head(0).footer:
            require("pyarrow", "litdata", f"litdata: {self.root}: its items (stored in the "
                                          f"chunks' Arrow footers)")

    def _check_block(self, block_size, where: str) -> int | None:
        if self.loader == "TokensLoader":
            if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
                    or block_size <= 0:
                raise ZephonConfigError(f"litdata: {where} was written with TokensLoader: give "
                                        f"block_size=N (an int > 0, the window length, as "
                                        f"TokensLoader(block_size)), got {block_size!r}")
            return int(block_size)
        if block_size is not None:
            raise ZephonConfigError(f"litdata: block_size applies to TokensLoader corpora; "
                                    f"{where} holds {self.loader} items")
        return None

    def _tokens_setup(self, dims: list, block_size: int, where: str) -> np.ndarray:
        """Windows per chunk of a TokensLoader corpus (and its token dtype)."""
        fmt = self.data_format[0]
        if len(self.data_format) != 1 or not fmt.startswith(("no_header_numpy:",
                                                             "no_header_tensor:")):
            raise SourceError(f"litdata: {where}: a TokensLoader corpus of data format "
                              f"{self.data_format} (one 1-D array of tokens per item expected)")
        if any(d is None for d in dims):
            raise SourceError(f"litdata: {where}: a TokensLoader corpus whose chunks have no "
                              f"token count (dim)")
        self.token_dtype = _dtype_of(fmt, where)
        self.chunk_tokens = np.asarray(dims, dtype=np.int64)
        return self.chunk_tokens // block_size

    def _fresh(self) -> None:
        super()._fresh()
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._lru_bytes = 0
        self._plan: _Plan | None = None
        self._last: tuple | None = None  # (first index, end index, chunk) of the last get
        self._starts_l: list | None = None
        self._unzstd: Callable | None = None

    # -- what the source says without reading -----------------------------------------

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard_bounds(self) -> np.ndarray:
        """One shard per chunk file."""
        return self.starts.copy()

    def sample_nbytes(self) -> float | None:
        """Bytes per item as the index gives them (a window's tokens for TokensLoader)."""
        if self.block_size:
            return float(self.block_size * self.token_dtype.itemsize)
        return float(self.chunk_bytes.sum()) / max(1, len(self))

    def known_tokens_per_sample(self) -> float | None:
        """``block_size`` for a TokensLoader corpus (each sample is one window)."""
        return float(self.block_size) if self.block_size else None

    def permute_note(self) -> str | None:
        """A shuffled pass over compressed chunks decompresses a chunk (or frame) per item."""
        if self.wrap not in ("chunk", "batch"):
            return None
        unit = "chunk" if self.wrap == "chunk" else "frame of 256 items"
        return (f"the corpus is zstd-compressed by {unit}: Pipeline(shuffle=True) draws items "
                f"from all over it and decompresses a whole {unit} for most of them; "
                f"Pipeline(shuffle=\"shards\") visits the chunks in a seeded order and "
                f"decompresses each once")

    def describe(self) -> str:
        """Class, name, root, length, chunks and how items are stored (the files' sizes and
        versions are in :meth:`stamps`)."""
        return (f"LitDataSource({self.name}, root={self.root}, items={len(self)}, "
                f"chunks={len(self.refs) - 1}, loader={self.loader}, "
                f"data_format={self.data_format}, compression={self.wrap or None}, "
                f"block_size={self.block_size})")

    # -- per-process state ------------------------------------------------------------

    def _decoding_plan(self) -> _Plan:
        """How this process decodes items (made once per process)."""
        plan = self._plan
        if plan is None:
            plan = self._plan = _Plan(self.data_format, self.data_spec, self.root,
                                      bool(self.block_size))
        return plan

    def _cached(self, key) -> Any:
        entry = self._lru.get(key)
        if entry is None:
            return None
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
        return entry[0]

    def _keep(self, key, value, nbytes: int) -> Any:
        with self._lock:
            if key not in self._lru:
                self._lru[key] = (value, nbytes)
                self._lru_bytes += nbytes
            while self._lru_bytes > self.cache_bytes and len(self._lru) > 1:
                _, (_, old) = self._lru.popitem(last=False)
                self._lru_bytes -= old
        return value

    def _fail(self, k: int, what: str) -> SourceError:
        return SourceError(f"litdata: {self.files[k]}: {what}")

    def _decompress(self, k: int, data, size: int | None, context: str) -> bytes:
        fn = self._unzstd
        if fn is None:
            fn = self._unzstd = _zstd_decompressor(self.root)
        try:
            out = fn(data, size)
        except Exception as exc:  # noqa: BLE001 - the zstd libraries raise several classes
            raise self._fail(k, f"{context}: not a zstd frame: {type(exc).__name__}: "
                                f"{exc}") from None
        if size is not None and len(out) != size:
            raise self._fail(k, f"{context}: decompressed to {len(out)} bytes, the index "
                                f"says {size}")
        return out

    # -- bytes of a chunk -------------------------------------------------------------

    def _whole(self, k: int) -> bytes:
        """A whole-file compressed chunk, decompressed (kept in the LRU)."""
        data = self._cached(("whole", k))
        if data is None:
            raw = self.reader(k).pread(0, self.refs[k].size, "compressed chunk")
            size = int(self.chunk_bytes[k])
            data = self._keep(("whole", k), self._decompress(k, raw, size, "the chunk"), size)
        return data

    def _size(self, k: int) -> int:
        """The bytes of chunk ``k`` as its layout reads them (decompressed when whole)."""
        return int(self.chunk_bytes[k]) if self.packed[k] else self.refs[k].size

    def _bytes(self, k: int, offset: int, size: int, context: str) -> bytes:
        if not self.packed[k]:
            return self.reader(k).pread(offset, size, context)
        data = self._whole(k)
        if offset < 0 or offset + size > len(data):
            raise self._fail(k, f"{context}: bytes {offset}-{offset + size} are past its "
                                f"{len(data)} decompressed bytes")
        return data[offset:offset + size]

    def _head(self, k: int) -> _Head:
        head = self._cached(("head", k))
        if head is None:
            head = self._framed_head(k) if self.wrap == "batch" else self._classic_head(k)
            self._keep(("head", k), head, head.nbytes)
        return head

    def _classic_head(self, k: int) -> _Head:
        """Count, offsets and footer of a classic chunk, checked against the index."""
        n, size = int(self.chunk_items[k]), self._size(k)
        raw = self._bytes(k, 0, 4 * (n + 2), "chunk header")
        if struct.unpack_from("<I", raw)[0] != n:
            raise self._fail(k, f"holds {struct.unpack_from('<I', raw)[0]} items, {INDEX} says "
                                f"{n} (corrupt, or not this index's chunk)")
        offsets = np.frombuffer(raw, "<u4", n + 1, 4).astype(np.int64)
        if offsets[0] != 4 * (n + 2) or (n and np.diff(offsets).min() < 0) or \
                offsets[-1] > size:
            raise self._fail(k, f"its item offsets do not rise from {4 * (n + 2)} inside its "
                                f"{size} bytes (corrupt)")
        footer: tuple[int, int] | None = None
        end = int(offsets[-1])
        if not self.block_size and size - end >= 12:
            tail = self._bytes(k, size - 12, 12, "chunk footer")
            if tail[4:] == _FOOTER_MAGIC:
                length = struct.unpack_from("<I", tail)[0]
                if not 0 < length <= size - 12 - end:
                    raise self._fail(k, f"its Arrow footer of {length} bytes does not fit")
                footer = (size - 12 - length, length)
        if self.block_size:
            want = 4 * (n + 2) + int(self.chunk_tokens[k]) * self.token_dtype.itemsize
            if end != want or size != want:
                raise self._fail(k, f"its tokens end at byte {end} of {size}; {INDEX} says "
                                    f"{int(self.chunk_tokens[k])} tokens ({want} bytes)")
        return _Head(offsets, footer)

    def _framed_head(self, k: int) -> _Head:
        """The directory of a chunk compressed by batches of items (``LDFZ01``)."""
        n, size = int(self.chunk_items[k]), self._size(k)
        prefix = self._bytes(k, 0, _FRAMED_PREFIX.size, "framed chunk header")
        magic, version, _, count, rows, nframes = _FRAMED_PREFIX.unpack(prefix)
        if magic != _FRAMED_MAGIC or version != 1 or count != n or rows <= 0 or \
                nframes != -(-n // rows):
            raise self._fail(k, f"not a framed zstd chunk of {n} items (magic {magic!r}, "
                                f"version {version}, {count} items, {nframes} frames)")
        table = self._bytes(k, _FRAMED_PREFIX.size, 4 * (n + 1) + _FRAME.size * nframes,
                            "framed chunk directory")
        offsets = np.frombuffer(table, "<u4", n + 1).astype(np.int64)
        frames = [_FRAME.unpack_from(table, 4 * (n + 1) + f * _FRAME.size)
                  for f in range(nframes)]
        for f, (first, items, offset, stored, plain) in enumerate(frames):
            lo, hi = f * rows, min(n, (f + 1) * rows)
            if (first, items) != (lo, hi - lo) or offset + stored > size or \
                    plain != offsets[hi] - offsets[lo]:
                raise self._fail(k, f"frame {f} of its directory is inconsistent (corrupt)")
        if offsets[0] != 0 or (n and np.diff(offsets).min() < 0):
            raise self._fail(k, "its item offsets do not rise from 0 (corrupt)")
        return _Head(offsets, None, frames, rows)

    def _frame(self, k: int, frames: list, f: int) -> bytes:
        data = self._cached(("frame", k, f))
        if data is None:
            _, _, offset, stored, plain = frames[f]
            raw = self._bytes(k, offset, stored, f"zstd frame {f}")
            data = self._keep(("frame", k, f),
                              self._decompress(k, raw, plain, f"zstd frame {f}"), plain)
        return data

    # -- items --------------------------------------------------------------------------

    def _locate(self, i: int) -> tuple[int, int]:
        """(chunk, item in chunk) of sample ``i``."""
        last = self._last
        if last is not None and last[0] <= i < last[1]:
            return last[2], i - last[0]
        if not 0 <= i < len(self):
            raise IndexError(f"litdata: index {i} out of range [0, {len(self)})")
        starts = self._starts_l
        if starts is None:
            starts = self._starts_l = self.starts.tolist()
        k = bisect.bisect_right(starts, i) - 1
        self._last = (starts[k], starts[k + 1], k)
        return k, i - starts[k]

    def get(self, i: int) -> Any:
        k, j = self._locate(int(i))
        block = self.block_size
        if block:
            return {"tokens": self._windows(k, j, 1, block)[0]}
        return self._items(k, j, 1)[0]

    def _windows(self, k: int, j: int, count: int, block: int) -> np.ndarray:
        """Windows ``j .. j + count - 1`` of chunk ``k``, an array ``(count, block)``
        (``block``: the corpus's ``block_size``)."""
        self._head(k)  # checks the header once per process
        dtype = self.token_dtype
        start = 4 * (int(self.chunk_items[k]) + 2) + j * block * dtype.itemsize
        raw = self._bytes(k, start, count * block * dtype.itemsize, f"windows {j}-{j + count}")
        return np.frombuffer(raw, dtype).reshape(count, block).copy()

    def _items(self, k: int, j: int, count: int) -> list:
        """Items ``j .. j + count - 1`` of chunk ``k``, decoded."""
        head = self._head(k)
        if head.footer is not None:
            return self._footer_rows(k, head.footer, j, count)
        raws = self._raw_items(k, head, j, count)
        if self.wrap == "sample":
            raws = [self._decompress(k, raw, None, f"item {j + n}") for n, raw in enumerate(raws)]
        return [self._decode(raw, k, j + n) for n, raw in enumerate(raws)]

    def _raw_items(self, k: int, head: _Head, j: int, count: int) -> list:
        """The stored bytes of items ``j .. j + count - 1`` of chunk ``k``."""
        return [memoryview(data)[int(pos[m]):int(pos[m + 1])]
                for data, pos in self._pieces(k, head, j, count) for m in range(len(pos) - 1)]

    def _pieces(self, k: int, head: _Head, j: int, count: int) -> list:
        """Items ``j .. j + count - 1`` of chunk ``k`` as ``(buffer, offsets)`` pieces: the
        items are ``buffer[offsets[m]:offsets[m + 1]]`` (one read for a classic chunk, one
        piece per frame of a framed one)."""
        offsets, frames = head.offsets, head.frames
        if frames is None:
            lo, hi = int(offsets[j]), int(offsets[j + count])
            what = f"item {j}" if count == 1 else f"items {j}-{j + count - 1}"
            return [(self._bytes(k, lo, hi - lo, what), offsets[j:j + count + 1] - lo)]
        pieces, rows, m = [], head.frame_rows, j
        while m < j + count:
            f = m // rows
            end = min(j + count, (f + 1) * rows)
            base = int(offsets[f * rows])
            pieces.append((self._frame(k, frames, f), offsets[m:end + 1] - base))
            m = end
        return pieces

    def _decode(self, raw, k: int, j: int) -> Any:
        plan = self._decoding_plan()
        decoders, shift, build = plan.decoders, plan.shift, plan.build
        try:
            sizes = plan.sizes.unpack_from(raw, 0)
            if shift + sum(sizes) != len(raw):
                raise ValueError(f"its leaf sizes {list(sizes)} do not add up to its "
                                 f"{len(raw)} bytes")
            leaves, at = [], shift
            for size, decode in zip(sizes, decoders, strict=True):
                leaves.append(decode(raw[at:at + size]))
                at += size
            if build is None:  # a TokensLoader plan: its items are windows (_windows)
                raise TypeError("a TokensLoader corpus has no item structure to build")
            return build(leaves)
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - struct, numpy, utf-8 and litdata errors
            raise self._fail(k, f"item {j}: cannot decode ({self.data_format}): "
                                f"{type(exc).__name__}: {exc}") from None

    def _footer_rows(self, k: int, footer: tuple[int, int], j: int, count: int) -> list:
        """Rows ``j .. j + count - 1`` of a chunk's Arrow footer, as litdata reads them
        (``to_pylist`` of its record batches of 256 rows)."""
        out: list = []
        while count:
            b, at = divmod(j, _FOOTER_ROWS)
            batch = self._footer_batch(k, footer, b)
            take = min(count, batch.num_rows - at)
            if take <= 0:
                raise self._fail(k, f"its Arrow footer has no row {j}")
            out.extend(batch.slice(at, take).to_pylist())
            j, count = j + take, count - take
        return out

    def _footer_batch(self, k: int, footer: tuple[int, int], b: int):
        batch = self._cached(("rows", k, b))
        if batch is not None:
            return batch
        reader = self._footer_reader(k, footer)
        n = int(self.chunk_items[k])
        want = min(_FOOTER_ROWS, n - b * _FOOTER_ROWS)
        try:
            batch = reader.get_batch(b)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several classes
            raise self._fail(k, f"Arrow footer, batch {b}: {type(exc).__name__}: "
                                f"{exc}") from None
        if batch.num_rows != want:
            raise self._fail(k, f"Arrow footer, batch {b}: {batch.num_rows} rows, not {want}")
        return self._keep(("rows", k, b), batch, int(batch.nbytes))

    def _footer_reader(self, k: int, footer: tuple[int, int]):
        reader = self._cached(("footer", k))
        if reader is not None:
            return reader
        pa = require("pyarrow", "litdata", "litdata: reading a chunk's Arrow footer")
        start, length = footer
        blob = self._bytes(k, start, length, "Arrow footer")
        try:
            if blob[:6] == b"ARROW1":
                reader = pa.ipc.open_file(pa.py_buffer(blob))
            else:  # an older writer's IPC stream: one table, cut as litdata cuts it
                reader = _StreamBatches(pa.ipc.open_stream(pa.py_buffer(blob)).read_all())
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several classes
            raise self._fail(k, f"Arrow footer: {type(exc).__name__}: {exc}") from None
        need = -(-int(self.chunk_items[k]) // _FOOTER_ROWS)
        if reader.num_record_batches != need:
            raise self._fail(k, f"its Arrow footer has {reader.num_record_batches} record "
                                f"batches, not {need}")
        return self._keep(("footer", k), reader, length)

    # -- batches ------------------------------------------------------------------------

    def get_batch(self, indices) -> dict | None:
        """Items ``indices`` collated as ``batch()`` collates them (see
        :meth:`Source.get_batch`): each run of consecutive items of one chunk is one read,
        and an item that is a dict of leaves is decoded column by column (a column of
        numbers or of equal arrays straight from the bytes into one array). Items that are
        not dicts: None (read one by one)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return None
        if idx.min() < 0 or idx.max() >= len(self):
            raise IndexError(f"litdata: indices out of range [0, {len(self)})")
        runs = _runs(idx, self.starts)
        block = self.block_size
        if block:
            parts = [self._windows(k, j, n, block) for k, j, n in runs]
            return {"tokens": parts[0] if len(parts) == 1 else np.concatenate(parts)}
        batch = self._columns(runs)
        if batch is not None:
            return batch
        values = [v for k, j, n in runs for v in self._items(k, j, n)]
        if type(values[0]) is not dict:
            return None
        from zephon.pipeline.collate import collate

        return cast(dict, collate(values))  # the values are dicts: collate gives a dict

    def _columns(self, runs: list) -> dict | None:
        """The batch of ``runs`` read column by column (:func:`columns_of`), or None where
        that read does not apply: items that are not dicts of leaves, items compressed one
        by one, rows of an Arrow footer, or bytes that do not decode as they should."""
        plan = self._decoding_plan()
        if plan.keys is None or self.wrap == "sample":
            return None
        heads = [self._head(k) for k, _, _ in runs]
        if any(head.footer is not None for head in heads):
            return None
        pieces = [piece for head, (k, j, n) in zip(heads, runs, strict=True)
                  for piece in self._pieces(k, head, j, n)]
        return columns_of(plan, *_joined(pieces))


class _StreamBatches:
    """An Arrow IPC stream's table with the record-batch access of an IPC file (batches of
    :data:`_FOOTER_ROWS` rows, as litdata slices a stream footer)."""

    def __init__(self, table) -> None:
        self.table = table
        self.num_record_batches = -(-table.num_rows // _FOOTER_ROWS)

    def get_batch(self, b: int):
        part = self.table.slice(b * _FOOTER_ROWS, _FOOTER_ROWS).combine_chunks()
        return part.to_batches()[0] if part.num_rows else part


def _runs(idx: np.ndarray, starts: np.ndarray) -> list[tuple[int, int, int]]:
    """``(chunk, first item, count)`` of each run of consecutive indices in one chunk."""
    chunks = np.searchsorted(starts, idx, side="right") - 1
    cuts = np.flatnonzero((np.diff(idx) != 1) | (np.diff(chunks) != 0)) + 1
    bounds = [0, *cuts.tolist(), len(idx)]
    return [(int(chunks[a]), int(idx[a] - starts[chunks[a]]), b - a)
            for a, b in itertools.pairwise(bounds)]


def _zstd_decompressor(root: str) -> Callable:
    """``fn(data, size)``: a zstd frame decompressed (``size``: its decompressed size, or
    None when not known): with ``zstandard``, else the ``zstd`` package litdata uses."""
    try:
        import zstandard
    except ImportError:
        pass
    else:
        def run(data, size):
            # a decompressor per call: one is not safe to share between threads
            if size is not None:
                return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        return run
    zstd = require("zstd", "litdata", f"litdata: {root}: reading zstd-compressed chunks "
                                      f"(the zstandard or zstd package)")
    return lambda data, size: zstd.decompress(bytes(data))


def litdata(root, *, name: str = "litdata", block_size: int | None = None,
            cache_bytes: int = 256 << 20, io_options=None,
            storage_options: dict | None = None) -> Source:
    """The items of a corpus written by Lightning's ``litdata.optimize()``, with random
    access (no litdata needed for the common leaf types).

    Building reads ``index.json`` only; each reading process then reads a chunk's header
    once and each item with one positional read (zstd-compressed chunks or frames are
    decompressed whole into a per-process LRU). Sample ``i`` is litdata's item ``i``, the
    same value ``litdata.StreamingDataset(root)[i]`` gives (dicts, lists, tuples as the
    item was written; ints, floats, str, bools, NumPy arrays), except that bytes are
    ``bytes``, and that torch tensors are NumPy arrays of the same dtype and shape: zephon
    batches NumPy arrays (``batch()`` stacks them; ``zephon.torch`` makes the tensors at the
    end), so a worker never imports torch (seconds and hundreds of MB per process) and
    torch stays an optional extra. Images, JSON-like lists, pickles and other leaves are
    decoded by litdata's own serializers (the ``litdata`` extra). A corpus written with
    ``item_loader=TokensLoader()`` gives ``{"tokens": window}`` per window of
    ``block_size`` tokens, the windows ``TokensLoader(block_size)`` reads.

    Args:
        root: the corpus directory (holding ``index.json``), a local path or an fsspec URL
            (``s3://bucket/corpus``), or its ``index.json``.
        name: the source's name, the first part of every sample identity.
        block_size: for a ``TokensLoader`` corpus (required there, refused elsewhere): the
            window length in tokens.
        cache_bytes: per-process budget of chunk headers and decompressed chunks, frames
            and Arrow record batches (an LRU).
        io_options: a :class:`~zephon.StoreOptions` (caching, retries, timeouts) for the
            reads made while building the source; while iterating, the pipeline's
            ``RuntimeOptions.io_options`` govern. None: the defaults.
        storage_options: fsspec options for remote paths (endpoint, credentials).

    Returns:
        A :class:`Source` of one sample per item (per window for ``TokensLoader``).

    Raises:
        SourceError: ``index.json`` is missing or not litdata's; the corpus is encrypted,
            compressed other than with zstd, written with another item loader or with a
            serializer litdata does not have; a library a leaf type needs is missing (the
            message names the ``litdata`` extra). A corrupt or truncated chunk raises it
            when read, naming the chunk file.
        ZephonConfigError: ``block_size`` missing for a ``TokensLoader`` corpus, or given
            for another; ``cache_bytes`` not an int >= 0.

    Examples:
        >>> import litdata as ld  # doctest: +SKIP
        >>> def item(i):
        ...     return {"i": i, "x": np.arange(i % 3)}
        >>> ld.optimize(fn=item, inputs=list(range(8)), output_dir="corpus", chunk_size=4,
        ...             num_workers=1, start_method="fork")  # doctest: +SKIP
        >>> src = sources.litdata("corpus")  # doctest: +SKIP
        >>> len(src), src.get(5)  # doctest: +SKIP
        (8, {'i': 5, 'x': array([0, 1])})
    """
    if io_options is None:
        io = DEFAULT_IO
    elif isinstance(io_options, IoConfig):
        io = io_options
    else:
        io = IoConfig.from_store_options(io_options)
    return LitDataSource(root, name, block_size, cache_bytes, io, storage_options)
