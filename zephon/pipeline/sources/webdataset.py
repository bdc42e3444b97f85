"""webdataset: samples from WebDataset tar shards, with random access.

A sample is the run of consecutive tar members sharing a key (the member path up
to the first dot of its file name: ``a/000123.jpg`` and ``a/000123.json`` are the
sample ``a/000123``); it comes out as ``{"__key__": key, "jpg": bytes, "json":
bytes}`` (the extension after the first dot is the field; decoding is the user's
``map``). Directories, links and names without an extension are skipped.

Index: building the source scans every shard's tar headers once (seeking over the
member data) and records, per sample, its members' offsets and sizes; reading a
sample is then one positional read of the byte span holding its members. With the
cache enabled, a remote shard's index is stored beside the cached shard, so a new
run over the same shards neither re-downloads nor re-scans them.

Shard names may use brace ranges: ``train-{000..009}.tar``.
Failures name the shard and the member: a corrupt header when building, a shard
truncated after building when the member is read.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from typing import Any

import numpy as np

from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.remote import expand, is_remote
from zephon.pipeline.sources.base import FileSource, SourceError

__all__ = ["WebDatasetSource", "brace_expand"]

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_INDEX_TAG = "wdsidx"


def brace_expand(pattern: str) -> list[str]:
    """``a-{00..02}.tar`` -> ``[a-00.tar, a-01.tar, a-02.tar]`` (zero padding kept)."""
    match = _BRACE.search(pattern)
    if not match:
        return [pattern]
    lo, hi = match.group(1), match.group(2)
    width = len(lo) if lo.startswith("0") else 0
    out = []
    for n in range(int(lo), int(hi) + 1):
        out.extend(brace_expand(pattern[:match.start()] + str(n).zfill(width) +
                                pattern[match.end():]))
    return out


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name, None when it has no extension."""
    directory, _, base = name.rpartition("/")
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return (f"{directory}/{stem}" if directory else stem), ext


def index_tar(fileobj, shard: str, size: int) -> dict:
    """The sample index of one tar of ``size`` bytes: keys, per sample its members
    (ext, offset, size). tarfile stops quietly at a corrupt header after the first;
    this checks that the scan ended at the end-of-archive marker (or the end of the
    file) and that every member lies inside the file."""
    keys: list[str] = []
    members: list[list] = []
    last = "(start of the shard)"
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            for info in tar:
                if info.offset_data + info.size > size:
                    raise SourceError(f"webdataset: {shard}: truncated: member {info.name!r} "
                                      f"ends at byte {info.offset_data + info.size}, the shard "
                                      f"has {size}")
                last = info.name
                if not info.isfile():
                    continue
                parts = split_name(info.name)
                if parts is None:
                    continue
                key, ext = parts
                if not keys or keys[-1] != key:
                    keys.append(key)
                    members.append([])
                members[-1].append([ext, info.offset_data, info.size])
            stop = tar.offset
        fileobj.seek(stop)
        block = fileobj.read(512)
        if block.strip(b"\0"):
            raise SourceError(f"webdataset: {shard}: corrupt or truncated tar after member "
                              f"{last!r}: unreadable header at byte {stop}")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise SourceError(f"webdataset: {shard}: corrupt or truncated tar after member "
                          f"{last!r}: {type(exc).__name__}: {exc}") from None
    return {"keys": keys, "members": members}


class WebDatasetSource(FileSource):
    def __init__(self, shards, name: str, io: IoConfig = DEFAULT_IO,
                 storage_options: dict | None = None) -> None:
        patterns = [shards] if isinstance(shards, (str, os.PathLike)) else list(shards)
        expanded = [p for pattern in patterns for p in brace_expand(os.fspath(pattern))]
        self.name, self.io, self.storage_options = name, io, storage_options
        self._set_files(expand(expanded, "webdataset", io, storage_options, suffixes=(".tar",)))
        self._fresh()
        keys: list = []
        counts: list[int] = []
        first: list = []
        ext: list = []
        offset: list = []
        size: list = []
        for k in range(len(self.files)):
            index = self._shard_index(k)
            counts.append(len(index["keys"]))
            keys.extend(index["keys"])
            for group in index["members"]:
                first.append(len(ext))
                for e, o, s in group:
                    ext.append(e)
                    offset.append(o)
                    size.append(s)
            self._readers.pop(k, None)
        first.append(len(ext))
        self.keys = keys
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.first_member = np.asarray(first, dtype=np.int64)
        self.member_ext = ext
        self.member_offset = np.asarray(offset, dtype=np.int64)
        self.member_size = np.asarray(size, dtype=np.int64)

    def _shard_index(self, k: int) -> dict:
        ref, reader = self.refs[k], self.reader(k)
        cache = None
        if ref.remote and self.io.cache_enabled:
            from zephon.io.cache import FileCache

            cache = FileCache(self.io, self.storage_options)
            stored = cache.get_derived(ref, _INDEX_TAG)
            if stored is not None:
                return json.loads(stored)
        with reader.file_object("building the index") as fh:
            index = index_tar(fh, self.files[k], ref.size)
        if cache is not None:
            cache.put_derived(ref, _INDEX_TAG, json.dumps(index).encode())
        return index

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def get(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(f"webdataset: sample {i} out of range [0, {len(self)})")
        k = int(np.searchsorted(self.shard_starts, i, side="right")) - 1
        lo, hi = int(self.first_member[i]), int(self.first_member[i + 1])
        key = self.keys[i]
        sample: dict[str, Any] = {"__key__": key}
        if hi == lo:
            return sample
        start = int(self.member_offset[lo])
        end = int(self.member_offset[hi - 1] + self.member_size[hi - 1])
        context = f"member {key}.{self.member_ext[lo]}" if hi - lo == 1 else \
            f"members {key}.{{{','.join(self.member_ext[lo:hi])}}}"
        try:
            span = self.reader(k).pread(start, end - start, context)
        except SourceError as exc:
            raise SourceError(f"webdataset: {exc}") from None
        for m in range(lo, hi):
            a = int(self.member_offset[m]) - start
            sample[self.member_ext[m]] = span[a:a + int(self.member_size[m])]
        return sample

    def describe(self) -> str:
        names = [f if is_remote(f) else os.path.basename(f) for f in self.files]
        return f"WebDatasetSource({self.name}, shards={names}, n={len(self)})"
