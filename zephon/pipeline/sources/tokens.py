"""token_windows: fixed-length windows over a flat token file (nanoGPT style).

The file is a raw array of ``uint16`` or ``uint32`` tokens (``.bin``), or a
``.npy`` array (its header gives the dtype, which must then agree with ``dtype``
if one is given). Sample ``i`` is ``{"tokens": tokens[i*seq_len:(i+1)*seq_len]}``;
the tail shorter than ``seq_len`` is not a sample.

Local files (and remote ones with the cache enabled, once downloaded) are
memory-mapped; a remote file with the cache disabled is read window by window
with ranged requests.
"""

from __future__ import annotations

import ast
import os
from typing import Any

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.remote import expand, is_remote
from zephon.pipeline.sources.base import FileSource, SourceError

__all__ = ["TokenWindows"]

_DTYPES = ("uint16", "uint32", "int32", "int64", "uint8")


def _npy_header(head: bytes, path: str) -> tuple[np.dtype, int]:
    """(dtype, data offset) of a .npy file from its first bytes."""
    if head[:6] != b"\x93NUMPY":
        raise SourceError(f"token_windows: {path} is not a .npy file (bad magic)")
    major = head[6]
    if major == 1:
        hlen, start = int.from_bytes(head[8:10], "little"), 10
    else:
        hlen, start = int.from_bytes(head[8:12], "little"), 12
    header = ast.literal_eval(head[start:start + hlen].decode("latin1"))
    if header.get("fortran_order") or len(header.get("shape", ())) != 1:
        raise SourceError(f"token_windows: {path} must hold a 1-D C-order array, got "
                          f"{header}")
    return np.dtype(header["descr"]), start + hlen


class TokenWindows(FileSource):
    _per_process = ("_tokens",)

    def __init__(self, path: str, seq_len: int, dtype: str | None, name: str,
                 io: IoConfig = DEFAULT_IO, storage_options: dict | None = None) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ZephonConfigError(f"token_windows: seq_len must be an int >= 1, got {seq_len!r}")
        if dtype is not None and str(np.dtype(dtype)) not in _DTYPES:
            raise ZephonConfigError(f"token_windows: dtype must be one of {_DTYPES}, got "
                                    f"{dtype!r}")
        path = os.fspath(path)
        self.path, self.seq_len, self.name = path, seq_len, name
        self.io, self.storage_options = io, storage_options
        refs = expand(path, "token_windows", io, storage_options)
        if len(refs) != 1:
            raise SourceError(f"token_windows: {path!r} must name one file, matches {len(refs)}")
        self._set_files(refs)
        self._fresh()
        self.offset = 0
        if path.endswith(".npy"):
            head = self.reader(0).pread(0, min(refs[0].size, 4096), "header")
            found, self.offset = _npy_header(head, path)
            if dtype is not None and np.dtype(dtype) != found:
                raise SourceError(f"token_windows: {path} holds {found}, dtype={dtype!r} given")
            self.dtype = found
        else:
            self.dtype = np.dtype(dtype or "uint16")
        self.n_tokens = (refs[0].size - self.offset) // self.dtype.itemsize

    def _fresh(self) -> None:
        super()._fresh()
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return self.n_tokens // self.seq_len

    def get(self, i: int) -> Any:
        start = i * self.seq_len
        reader = self.reader(0)
        if reader.streamed:
            size = self.dtype.itemsize
            data = reader.pread(self.offset + start * size, self.seq_len * size,
                                f"window {i}")
            return {"tokens": np.frombuffer(data, dtype=self.dtype).copy()}
        if self._tokens is None:
            path = reader.local_file(f"window {i}")
            try:
                tokens = np.memmap(path, dtype=self.dtype, mode="r", offset=self.offset,
                                   shape=(self.n_tokens,))
            except (OSError, ValueError) as exc:
                raise SourceError(f"token_windows: cannot map {self.path}: {exc}") from None
            self._tokens = tokens
        return {"tokens": np.array(self._tokens[start:start + self.seq_len])}

    def describe(self) -> str:
        where = self.path if is_remote(self.path) else os.path.basename(self.path)
        return (f"TokenWindows({self.name}, {where}, "
                f"tokens={self.n_tokens}, seq_len={self.seq_len}, {self.dtype.str})")
