"""Tar shards written fast, by hand, for the tests and benches of the shared index."""

from __future__ import annotations

import tarfile

__all__ = ["tar_bytes", "write_many"]


def tar_bytes(members) -> bytes:
    """A plain ustar archive of ``(name, data)`` members (headers made by ``tarfile``, the
    rest joined here: much faster than ``TarFile.addfile`` for thousands of shards)."""
    out = bytearray()
    for name, data in members:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        out += info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
        out += data + b"\0" * (-len(data) % 512)
    return bytes(out + b"\0" * 1024)


def write_many(directory) -> str:
    """240 tar shards of 400 one-member samples in ``directory`` (a pathlib.Path): a build
    on 2 workers takes seconds, long enough to be stopped or killed on the way."""
    for k in range(240):
        members = [(f"m{k:03d}_{j:04d}.txt", b"%d.%d" % (k, j)) for j in range(400)]
        with open(directory / f"shard-{k:04d}.tar", "wb") as fh:
            fh.write(tar_bytes(members))
    return str(directory)
