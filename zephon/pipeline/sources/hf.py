"""hf_dataset: a Hugging Face ``datasets.Dataset`` as a source (no network).

Given a loaded ``Dataset`` the source keeps it (pickling a dataset backed by its
Arrow cache files sends the file paths, not the data; an in-memory dataset is
sent whole). Given a directory saved with ``save_to_disk``, the source keeps the
path and each reading process opens it with ``load_from_disk`` (memory-mapped)
on first use; a path that is missing or is a file is a SourceError naming it at
construction. Sample ``i`` is ``ds[i]`` in numpy format: numeric values and lists
as numpy arrays, strings as ``str``.

Arrow files are memory-mapped, and a mapped file that shrinks faults the process
(SIGBUS). The source records the identity (device, inode, size, mtime) of the
dataset's Arrow files when it is built and checks every one of them (``os.stat``)
before each row is read: a file replaced, rewritten or resized before a read is a
SourceError naming it and the row, never a fault. (A file truncated *during* the
read of a row is a race this check cannot close.) Any other error while reading a
row is a SourceError naming the dataset and the row.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

from zephon.io.remote import require
from zephon.pipeline.sources.base import Source, SourceError
from zephon.pipeline.sources.files import changed, identity

__all__ = ["HfDatasetSource"]


def _load(path: str):
    datasets = require("datasets", "hf", "sources.hf_dataset")
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise SourceError(f"hf_dataset: {path} {what}; load_from_disk needs the directory "
                          f"written by Dataset.save_to_disk")
    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:  # noqa: BLE001 - datasets raises many classes
        raise SourceError(f"hf_dataset: cannot load {path} (load_from_disk): "
                          f"{type(exc).__name__}: {exc}") from None
    if not isinstance(ds, datasets.Dataset):
        raise SourceError(f"hf_dataset: {path} holds a {type(ds).__name__}; pass one split "
                          f"(e.g. load_from_disk(path)['train'])")
    return ds


def _arrow_files(ds) -> dict[str, tuple]:
    """The identity of each Arrow file backing ``ds`` (none for an in-memory dataset)."""
    out = {}
    for entry in getattr(ds, "cache_files", None) or ():
        name = entry.get("filename") if isinstance(entry, dict) else None
        if name:
            try:
                out[name] = identity(os.stat(name))
            except OSError as exc:
                raise SourceError(f"hf_dataset: cannot read {name}: {exc}") from None
    return out


class HfDatasetSource(Source):
    def __init__(self, ds, name: str, columns: Sequence[str] | None = None) -> None:
        self.name = name
        self.columns = None if columns is None else list(columns)
        if isinstance(ds, (str, os.PathLike)):
            self.path, self.ds = os.fspath(ds), None
            loaded = _load(self.path)
        else:
            datasets = require("datasets", "hf", "sources.hf_dataset")
            if not isinstance(ds, datasets.Dataset):
                raise SourceError(f"hf_dataset: expected a datasets.Dataset or a directory "
                                  f"saved with save_to_disk, got {type(ds).__name__}")
            self.path, self.ds = None, ds
            loaded = ds
        if self.columns is not None:
            missing = [c for c in self.columns if c not in loaded.column_names]
            if missing:
                raise SourceError(f"hf_dataset: no column(s) {missing}; the dataset has "
                                  f"{loaded.column_names}")
        self.n = len(loaded)
        self.fingerprint = getattr(loaded, "_fingerprint", "")
        self.arrow_files = _arrow_files(loaded)
        self._view = None
        self._lock = threading.Lock()

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_view", "_lock")}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._view, self._lock = None, threading.Lock()

    def _dataset(self):
        if self._view is None:
            with self._lock:
                if self._view is None:
                    ds = self.ds if self.ds is not None else _load(self.path)
                    self._view = ds.with_format("numpy", columns=self.columns,
                                                output_all_columns=False)
        return self._view

    def _check(self, i: int) -> None:
        for name, before in self.arrow_files.items():
            try:
                now = identity(os.stat(name))
            except OSError as exc:
                raise SourceError(f"hf_dataset: {name}, row {i}: the file is gone: "
                                  f"{exc}") from None
            what = changed(before, now)
            if what is not None:
                raise SourceError(f"hf_dataset: {name}, row {i}: the file changed after the "
                                  f"source was built: {what}")

    def __len__(self) -> int:
        return self.n

    def get(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(f"hf_dataset: row {i} out of range [0, {self.n})")
        self._check(i)
        try:
            row = self._dataset()[int(i)]
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - datasets and pyarrow raise many classes
            where = self.path or "the dataset"
            raise SourceError(f"hf_dataset: {where}, row {i}: cannot read: "
                              f"{type(exc).__name__}: {exc}") from None
        return {k: (v.item() if getattr(v, "shape", None) == () and v.dtype.kind in "US"
                    else v) for k, v in row.items()}

    def describe(self) -> str:
        where = os.path.basename(self.path.rstrip("/")) if self.path else "in-memory"
        return (f"HfDatasetSource({self.name}, {where}, n={self.n}, "
                f"fingerprint={self.fingerprint}, columns={self.columns})")
