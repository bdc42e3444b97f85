"""Where files live: local paths, globs and fsspec URLs, listed and read by byte range.

A path is *remote* when it has a ``protocol://`` prefix other than ``file://``
(``s3://``, ``gs://``, ``http(s)://``, ``memory://``, ...); ``file://`` URLs are
plain local paths. Remote access goes through fsspec (the ``remote`` extra),
imported on first remote use only: local files never load it.

:func:`expand` turns the user's paths (strings or lists; globs allowed, sorted)
into :class:`FileRef` records with the size and a version tag (ETag or mtime)
observed when the source is built; readers check that a remote object still has
that size, so a changed object is an error instead of silently different data.

:func:`read_range` reads ``[start, end)`` of a remote object with the retry and
timeout policy of :class:`~zephon.io.config.IoConfig`; a failure after the
retries is a :class:`~zephon.io.errors.SourceError` naming the URL.

Filesystem objects are made once per process and protocol (fsspec's own instance
cache is bypassed so that a worker never inherits a parent's event loop).
zephon owns the retries: for ``s3://`` the client's own retries are turned down to
one attempt unless ``storage_options`` say otherwise, so ``download_retry`` means
what it says.
"""

from __future__ import annotations

import glob as globlib
import os
import threading
from typing import Sequence

from zephon.io.config import IoConfig, call_with_retry
from zephon.io.errors import SourceError

__all__ = [
    "FileRef",
    "expand",
    "filesystem",
    "is_remote",
    "read_range",
    "require",
    "strip_file_url",
]

_FS: dict = {}
_FS_LOCK = threading.Lock()


def require(module: str, extra: str, what: str):
    """Import ``module`` or raise a SourceError naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SourceError(f"{what} needs the {module!r} package: pip install "
                          f"\"zephon[{extra}]\" ({exc})") from None


class FileRef:
    """One input file: ``url`` (a local path or an fsspec URL), ``size`` in bytes and
    ``version`` (the ETag or mtime seen when the source was built; '' for local
    files)."""

    __slots__ = ("size", "url", "version")

    def __init__(self, url: str, size: int, version: str = "") -> None:
        self.url, self.size, self.version = url, int(size), version

    @property
    def remote(self) -> bool:
        return is_remote(self.url)

    @property
    def basename(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def __getstate__(self):
        return (self.url, self.size, self.version)

    def __setstate__(self, state) -> None:
        self.url, self.size, self.version = state

    def __eq__(self, other) -> bool:
        return isinstance(other, FileRef) and self.__getstate__() == other.__getstate__()

    def __hash__(self) -> int:
        return hash(self.__getstate__())

    def __repr__(self) -> str:
        return f"FileRef({self.url!r}, size={self.size})"


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def is_remote(url: str) -> bool:
    return protocol_of(os.fspath(url)) not in ("file", "local")


def strip_file_url(url: str) -> str:
    url = os.fspath(url)
    for prefix in ("file://", "local://"):
        if url.startswith(prefix):
            return url[len(prefix):]
    return url


def filesystem(url: str, storage_options: dict | None):
    """The fsspec filesystem for ``url``'s protocol (one per process and options)."""
    protocol = protocol_of(url)
    key = (protocol, repr(sorted((storage_options or {}).items())), os.getpid())
    fs = _FS.get(key)
    if fs is not None:
        return fs
    fsspec = require("fsspec", "remote", f"reading {url}")
    opts = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        require("s3fs", "remote", f"reading {url}")
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        opts["config_kwargs"] = config
    elif protocol in ("gs", "gcs"):
        require("gcsfs", "gcs", f"reading {url}")
    opts["skip_instance_cache"] = True
    with _FS_LOCK:
        fs = _FS.get(key)
        if fs is None:
            try:
                fs = fsspec.filesystem(protocol, **opts)
            except (ImportError, ValueError) as exc:
                raise SourceError(f"cannot open {url}: no usable fsspec filesystem for "
                                  f"{protocol!r} ({exc}); pip install \"zephon[remote]\" (s3), "
                                  f"\"zephon[gcs]\" (gs) or the fsspec package for it") from None
            if protocol in ("s3", "s3a") and "retries" not in (storage_options or {}):
                fs.retries = 1  # one attempt per call: zephon's download_retry applies
            _FS[key] = fs
    return fs


def _version(info: dict) -> str:
    for name in ("ETag", "etag", "md5Hash", "LastModified", "mtime", "updated", "last_modified"):
        if info.get(name) not in (None, ""):
            return str(info[name]).strip('"')
    return ""


def _with_protocol(url: str, path: str) -> str:
    protocol = protocol_of(url)
    if "://" in path:
        return path
    return f"{protocol}://{path}"


def expand(paths: str | os.PathLike | Sequence, what: str, cfg: IoConfig,
           storage_options: dict | None = None,
           suffixes: tuple[str, ...] | None = None) -> list[FileRef]:
    """The files named by ``paths`` (a path, URL or glob, or a list of them), each
    glob sorted, with sizes. ``what`` names the caller in errors. ``suffixes``:
    a directory argument expands to its files with these endings (sorted)."""
    patterns = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not patterns:
        raise SourceError(f"{what}: no paths given")
    out: list[FileRef] = []
    for pattern in patterns:
        pattern = os.fspath(pattern)
        if not isinstance(pattern, str):
            raise SourceError(f"{what}: paths must be strings, got {pattern!r}")
        if is_remote(pattern):
            out.extend(_expand_remote(pattern, what, cfg, storage_options, suffixes))
            continue
        local = strip_file_url(pattern)
        if globlib.has_magic(local):
            matched = sorted(globlib.glob(local))
        elif os.path.isdir(local) and suffixes:
            matched = sorted(os.path.join(local, f) for f in os.listdir(local)
                             if f.endswith(suffixes))
        else:
            matched = [local]
        if not matched:
            raise SourceError(f"{what}: no file matches {pattern!r}")
        for path in matched:
            try:
                out.append(FileRef(path, os.path.getsize(path)))
            except OSError as exc:
                raise SourceError(f"{what}: cannot read {path}: {exc}") from None
    return out


def _expand_remote(pattern: str, what: str, cfg: IoConfig, storage_options,
                   suffixes) -> list[FileRef]:
    fs = filesystem(pattern, storage_options)

    def listing():
        if globlib.has_magic(pattern.split("://", 1)[1]):
            found = fs.glob(pattern, detail=True)
            return sorted((p, i) for p, i in found.items() if i.get("type") != "directory")
        info = fs.info(pattern)
        if info.get("type") == "directory" and suffixes:
            found = fs.find(pattern, detail=True)
            return sorted((p, i) for p, i in found.items() if p.endswith(suffixes))
        return [(pattern, info)]

    try:
        found = call_with_retry(listing, cfg, pattern)
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - named for the user
        raise SourceError(f"{what}: cannot list {pattern} after {cfg.download_retry} "
                          f"retries: {type(exc).__name__}: {exc}") from None
    if not found:
        raise SourceError(f"{what}: no file matches {pattern!r}")
    return [FileRef(_with_protocol(pattern, p), int(info.get("size") or 0), _version(info))
            for p, info in found]


def read_range(ref: FileRef, start: int, end: int, cfg: IoConfig,
               storage_options: dict | None = None, context: str = "") -> bytes:
    """Bytes ``[start, end)`` of the remote object ``ref`` (retried; exactly
    ``end - start`` bytes or a SourceError naming the URL and ``context``)."""
    if end <= start:
        return b""
    fs = filesystem(ref.url, storage_options)

    def attempt() -> bytes:
        data = fs.cat_file(ref.url, start=start, end=end)
        if len(data) != end - start:
            raise OSError(f"short read: {len(data)} of {end - start} bytes at offset {start}")
        return data

    try:
        return call_with_retry(attempt, cfg, ref.url)
    except Exception as exc:  # noqa: BLE001 - named for the user
        where = f" ({context})" if context else ""
        raise SourceError(f"cannot read {ref.url}{where}, bytes {start}-{end}, after "
                          f"{cfg.download_retry} retries: {type(exc).__name__}: {exc}") from None
