"""jsonl: one JSON object per line, over local or remote files, plain or compressed.

The files (paths, globs or fsspec URLs; each glob sorted) are read once when the
source is built to index the non-blank lines: sample ``i`` is the ``i``-th such
line over all files, its identity the file and line. A bad line raises a
:class:`SourceError` naming the file and the line when it is read.

``.jsonl.gz`` and ``.jsonl.zst`` files are indexed on their decompressed bytes.
A compressed file cannot be read at an offset, so each reading process keeps the
decompressed file in memory, decompressed once on first use (cheap for the shard
sizes jsonl is used with; split big corpora into shards).
"""

from __future__ import annotations

import gzip
import io as _io
import json
import os
import threading
from typing import Any, Sequence

import numpy as np

from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.remote import expand, is_remote
from zephon.pipeline.sources.base import FileSource, SourceError

__all__ = ["JsonlSource"]


def _codec(path: str) -> str | None:
    if path.endswith(".gz"):
        return "gzip"
    if path.endswith((".zst", ".zstd")):
        return "zstd"
    return None


def _decompress(data: bytes, codec: str, path: str) -> bytes:
    try:
        if codec == "gzip":
            return gzip.decompress(data)
        import zstandard

        out = _io.BytesIO()
        with zstandard.ZstdDecompressor().stream_reader(_io.BytesIO(data)) as reader:
            while True:
                block = reader.read(1 << 20)
                if not block:
                    break
                out.write(block)
        return out.getvalue()
    except Exception as exc:  # noqa: BLE001 - gzip/zstd raise many classes
        raise SourceError(f"jsonl: {path}: cannot decompress ({codec}): "
                          f"{type(exc).__name__}: {exc}") from None


class JsonlSource(FileSource):
    _per_process = ("_plain", "_plain_lock")

    def __init__(self, paths: str | Sequence[str], name: str, io: IoConfig = DEFAULT_IO,
                 storage_options: dict | None = None) -> None:
        self.name, self.io, self.storage_options = name, io, storage_options
        self._set_files(expand(paths, "jsonl", io, storage_options,
                               suffixes=(".jsonl", ".jsonl.gz", ".jsonl.zst")))
        self._fresh()
        offsets, ends, file_index, line_no = [], [], [], []
        for k in range(len(self.files)):
            data = self._data(k, "building the line index")
            pos = 0
            for n, line in enumerate(data.splitlines(keepends=True), 1):
                if line.strip():
                    offsets.append(pos)
                    ends.append(pos + len(line))
                    file_index.append(k)
                    line_no.append(n)
                pos += len(line)
            self._plain.pop(k, None)  # the builder does not keep the data around
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.ends = np.asarray(ends, dtype=np.int64)
        self.file_index = np.asarray(file_index, dtype=np.int32)
        self.line_no = np.asarray(line_no, dtype=np.int64)

    def _fresh(self) -> None:
        super()._fresh()
        self._plain: dict[int, bytes] = {}
        self._plain_lock = threading.Lock()

    def _data(self, k: int, context: str) -> bytes:
        """All (decompressed) bytes of file ``k``."""
        ref = self.refs[k]
        reader = self.reader(k)
        try:
            if reader.streamed:
                raw = reader.pread(0, ref.size, context)
            else:
                with open(reader.local_file(context), "rb") as fh:
                    raw = fh.read()
        except OSError as exc:
            raise SourceError(f"jsonl: cannot read {self.files[k]}: {exc}") from None
        codec = _codec(self.files[k])
        return _decompress(raw, codec, self.files[k]) if codec else raw

    def __len__(self) -> int:
        return len(self.offsets)

    def _line(self, i: int) -> bytes:
        k = int(self.file_index[i])
        start, end = int(self.offsets[i]), int(self.ends[i])
        context = f"line {int(self.line_no[i])}"
        if _codec(self.files[k]):
            data = self._plain.get(k)
            if data is None:
                with self._plain_lock:
                    data = self._plain.get(k)
                    if data is None:
                        data = self._plain[k] = self._data(k, context)
            return data[start:end]
        return self.reader(k).pread(start, end - start, context)

    def get(self, i: int) -> Any:
        path = self.files[self.file_index[i]]
        line = self._line(i)
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise SourceError(f"jsonl: {path}, line {int(self.line_no[i])}: invalid JSON "
                              f"({exc})") from None
        if not isinstance(value, dict):
            raise SourceError(f"jsonl: {path}, line {int(self.line_no[i])}: expected an "
                              f"object, got {type(value).__name__}")
        return value

    def describe(self) -> str:
        names = [f if is_remote(f) else os.path.basename(f) for f in self.files]
        return f"JsonlSource({self.name}, files={names}, n={len(self)})"
