"""Reading a checkpoint store of the first format (one file per subject), to migrate it.

That format kept ``ok/<hash>`` (a success) and ``failed/<hash>`` (the last failure)
files, each holding one record (:mod:`zephon.jobs.store_codec`'s bytes, zstd-compressed,
without the checksum frame of the current format). Opening such a directory with
:class:`~zephon.jobs.store.CheckpointStore` migrates it: every entry the old trust
rules accept is copied into the database, its record's bytes unchanged inside the
current frame (:func:`~zephon.jobs.store_codec.frame`: a checksum from then on), and
the two directories are removed once the copy is committed. The old rules still apply while
reading: ``ok``/``failed`` must be real directories of ours, not writable by group or
others (else opening the store raises and nothing is touched); an entry that is a
symbolic link, not a regular file, owned by another user or not a record is skipped
(counted, never followed or read), so its subject is simply recomputed.
"""

from __future__ import annotations

import os
from typing import Iterator

from zephon.errors import CheckpointError
from zephon.jobs.store_codec import KIND_FAILED, KIND_OK, RecordCodec
from zephon.jobs.store_files import open_dir, read_vetted

__all__ = ["LEGACY_DIRS", "has_legacy_layout", "legacy_entries", "remove_legacy"]

#: The subdirectories of the first format, and the kind of entry each holds.
LEGACY_DIRS = {"ok": KIND_OK, "failed": KIND_FAILED}
_TMP_PREFIX = ".tmp-"


def _dir_entries(root: str, sub_fd: int, sub: str, kind: int, codec: RecordCodec,
                 skipped: list[str]) -> Iterator[tuple[str, int, bytes]]:
    for name in sorted(os.listdir(sub_fd)):
        if name.startswith(_TMP_PREFIX):
            continue
        path = os.path.join(root, sub, name)
        try:
            blob = read_vetted(sub_fd, name, path, "old checkpoint entry")
            if blob is None:
                continue
            key = codec.unpack_body(blob, f"old checkpoint entry {path}").get("key")
            if not isinstance(key, str):
                raise CheckpointError(f"old checkpoint entry {path} names no key")
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        yield key, kind, blob


def legacy_entries(root: str, root_fd: int, codec: RecordCodec,
                   skipped: list[str]) -> Iterator[tuple[str, int, bytes]]:
    """``(key, kind, record bytes)`` (unframed, as the old format stored them) of every
    acceptable entry of the old format under ``root`` (a refused one is described in
    ``skipped``); raises CheckpointError when ``ok``/``failed`` exists but is not a
    directory the store can trust."""
    fds = {}
    try:
        for sub in LEGACY_DIRS:
            try:
                os.lstat(sub, dir_fd=root_fd)
            except FileNotFoundError:
                continue
            fds[sub] = open_dir(os.path.join(root, sub), dir_fd=root_fd, create=False)
        for sub, fd in fds.items():
            yield from _dir_entries(root, fd, sub, LEGACY_DIRS[sub], codec, skipped)
    finally:
        for fd in fds.values():
            os.close(fd)


def has_legacy_layout(root_fd: int) -> bool:
    """True when the directory holds an ``ok`` or ``failed`` entry of the old format."""
    names = set(os.listdir(root_fd))
    return any(sub in names for sub in LEGACY_DIRS)


def remove_legacy(root: str, root_fd: int) -> None:
    """Remove the ``ok``/``failed`` directories (files only, as the old format wrote
    them), through descriptors: a symlink in them is unlinked, never followed."""
    for sub in LEGACY_DIRS:
        try:
            fd = open_dir(os.path.join(root, sub), dir_fd=root_fd, create=False)
        except CheckpointError:
            if sub in os.listdir(root_fd):
                raise
            continue
        try:
            for name in os.listdir(fd):
                os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(sub, dir_fd=root_fd)
