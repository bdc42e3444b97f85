"""zephon.io: reading input files wherever they live (local disk or fsspec URLs).

Owns: :class:`IoConfig` (the ``StoreOptions`` knobs as plain values) and the retry
loop (:mod:`.config`); path expansion and ranged remote reads pinned to the
version a source was built on (:mod:`.remote`); the verified, trusted, shared,
atomic, LRU-bounded local cache of remote files (:mod:`.cache`); per-process
positional readers and verified whole-file scans (:mod:`.reader`); :class:`SourceError`
and its :class:`ObjectChanged` and :class:`ObjectCorrupt`.

Layering: imports the standard library, ``zephon.errors`` and, lazily and only
for remote paths, fsspec and its protocol packages. The pipeline's sources use it;
it knows nothing about pipelines.
"""

from zephon.io.config import DEFAULT_IO, AttemptTimeout, IoConfig, call_with_retry
from zephon.io.errors import SourceError
from zephon.io.reader import FileReader, RangeFile, ScanFile, open_with_retry
from zephon.io.remote import (
    FileRef,
    ObjectChanged,
    ObjectCorrupt,
    expand,
    filesystem,
    is_remote,
    read_range,
    require,
)

__all__ = [
    "DEFAULT_IO",
    "AttemptTimeout",
    "FileCache",
    "FileReader",
    "FileRef",
    "IoConfig",
    "ObjectChanged",
    "ObjectCorrupt",
    "RangeFile",
    "ScanFile",
    "SourceError",
    "call_with_retry",
    "expand",
    "filesystem",
    "is_remote",
    "open_with_retry",
    "read_range",
    "require",
]


def __getattr__(name: str):
    if name == "FileCache":
        from zephon.io.cache import FileCache

        return FileCache
    raise AttributeError(f"module 'zephon.io' has no attribute {name!r}")
