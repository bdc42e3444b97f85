"""What the file sources check about their local inputs before trusting them.

Owned here: the checks shared by the file sources (``token_windows``, ``jsonl``,
``webdataset``, ``hf_dataset``), never the reading itself.

- :func:`require_regular_files`: every *local* path a source is built on is an
  existing regular file (a directory, a fifo or a device is a SourceError naming
  the path and its kind, raised at construction: such errors are deterministic,
  so nothing retries them). Remote paths are left to the io layer.
- :func:`identity` / :func:`changed`: a local file's identity ``(device, inode,
  size, mtime_ns)`` as ``os.stat`` reports it; a source records it when it is
  built and compares it where it reads, so a file replaced, rewritten, grown or
  shrunk after building is a SourceError naming the file instead of other data
  (or, for a memory mapping, a SIGBUS).
- :func:`sniff_codec`: the compression of a file from its first bytes (gzip,
  bzip2, xz, zstd), whatever its name says.
"""

from __future__ import annotations

import os
import stat

from zephon.io.errors import SourceError

__all__ = ["changed", "describe_kind", "identity", "require_regular_files", "sniff_codec"]

_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
          (b"\x28\xb5\x2f\xfd", "zstd"))


def describe_kind(mode: int) -> str:
    """A word for the kind of file ``mode`` (from ``os.stat``) names."""
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a fifo"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return word
    return "not a regular file"


def require_regular_files(refs, what: str) -> None:
    """A SourceError naming the first local path of ``refs`` (FileRefs) that is missing
    or not a regular file; remote refs are skipped."""
    for ref in refs:
        if ref.remote:
            continue
        try:
            mode = os.stat(ref.url).st_mode
        except OSError as exc:
            raise SourceError(f"{what}: cannot read {ref.url}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(mode):
            raise SourceError(f"{what}: {ref.url} is {describe_kind(mode)}; a file is needed")


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """``(device, inode, size, mtime_ns)`` of a stat result."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def changed(before: tuple, after: tuple) -> str | None:
    """What differs between two identities (a phrase), or None when they agree."""
    if before[:2] != after[:2]:
        return "it was replaced by another file (device and inode differ)"
    if before[2] != after[2]:
        return f"its size changed from {before[2]} to {after[2]} bytes"
    if before[3] != after[3]:
        return "it was modified (its mtime changed)"
    return None


def sniff_codec(head: bytes) -> str | None:
    """The compression whose magic number starts ``head``, or None."""
    for magic, codec in _MAGIC:
        if head.startswith(magic):
            return codec
    return None
