"""Where files live: local paths, globs and fsspec URLs, listed and read by byte range.

A path is *remote* when it has a ``protocol://`` prefix other than ``file://``
(``s3://``, ``gs://``, ``http(s)://``, ``memory://``, ...); ``file://`` URLs are
plain local paths. Remote access goes through fsspec (the ``remote`` extra),
imported on first remote use only: local files never load it.

:func:`expand` turns the user's paths (strings or lists; globs allowed, sorted)
into :class:`FileRef` records with the size and the version observed when the
source is built (``etag:<ETag>``, else ``mtime:<last modified>``; plus the store's
version id or generation when it has one). The FileRef is part of a source's
pickled state, so every process reads the version the source was built on:

- ``s3://``: every request is a ranged ``GetObject`` with ``If-Match: <ETag>``; the
  ETag of each response is compared too. An object replaced since the source was
  built answers 412, which is :class:`ObjectChanged` (a SourceError naming the
  object), never retried. When the store reported a version id (a versioned
  bucket), requests also name that ``VersionId``: the recorded version is read
  even after the object was overwritten.
- ``http(s)://`` with a strong ETag: every ranged GET carries ``If-Match`` too (a
  412 is :class:`ObjectChanged`).
- other protocols (and weak or missing ETags): the version is looked up again when
  a process first reads an object (:func:`check_version`) and after every download
  into the cache; a difference is :class:`ObjectChanged`.

:func:`read_range` reads ``[start, end)`` of a remote object with the retry and
timeout policy of :class:`~zephon.io.config.IoConfig`; a failure after the
retries is a :class:`~zephon.io.errors.SourceError` naming the URL.

Integrity: a byte range carries no checksum of its own, and a range cannot be
checked against the whole object's. What can be checked is the whole object
(:class:`ObjectChecksum`): on S3, its ETag when that is computed from the bytes (their
MD5 for a single-part upload; the MD5 of the parts' MD5s for a multipart one, over the
part sizes the store reports, so parts of any sizes), else an additional checksum
the object carries (SHA-256, SHA-1, CRC32, and CRC32C / CRC64NVME where the ``awscrt``
package is installed; full-object or composite), else nothing. Two readers build on
that: the cache (:mod:`.cache`) checks every download, and a *verified scan*
(:meth:`~zephon.io.reader.FileReader.scan`) reads an object once, in order, checks it
the same way and records the :func:`range_digest` of the byte ranges its caller names
(a source's samples); each later streamed read of such a range is compared with its
digest (:meth:`~zephon.io.reader.FileReader.pread`) and a difference that persists
through ``download_retry`` re-reads is :class:`ObjectCorrupt`. An object with no
checksum zephon can check (SSE-KMS or SSE-C with no additional checksum, protocols
other than S3) follows ``IoConfig.unchecked_objects``: ``'read_twice'`` (the
default) reads it whole a second time and uses the bytes only when two reads agree
(twice the transfer; a transient alteration is caught, one that repeats identically
on every read is not), ``'refuse'`` refuses it (:func:`refuse_unchecked`). Sources
that stream without a scan (today all but WebDataset) read ranges as good as the
transport (use TLS).

An ETag that differs from the recorded one on a ranged read (another ``ETag`` header,
or a 412 answer to ``If-Match``) is looked up again (``HeadObject``) before it is
called a change: when the store still reports the recorded ETag the answer was altered
on its way and the read is retried; otherwise it is :class:`ObjectChanged`.

Filesystem objects are made once per process and protocol (fsspec's own instance
cache is bypassed so that a worker never inherits a parent's event loop).
zephon owns the retries: for ``s3://`` the client's own retries are turned down to
one attempt unless ``storage_options`` say otherwise, so ``download_retry`` means
what it says.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import logging
import os
import threading
from typing import Any, Sequence

from zephon.io.config import IoConfig, call_with_retry
from zephon.io.errors import SourceError

__all__ = [
    "BLOCK",
    "DIGEST_SIZE",
    "FileRef",
    "ObjectChanged",
    "ObjectChecksum",
    "ObjectCorrupt",
    "check_version",
    "current_version",
    "expand",
    "fetch_range",
    "filesystem",
    "is_remote",
    "range_digest",
    "read_range",
    "refuse_unchecked",
    "require",
    "strip_file_url",
]

BLOCK = 8 << 20  # one request of a whole-object read (a download, a scan) covers at most this
DIGEST_SIZE = 16  # bytes of a range digest (SHA-256, truncated)
_FS: dict = {}
log = logging.getLogger("zephon.io")
_FS_LOCK = threading.Lock()


def require(module: str, extra: str, what: str):
    """Import ``module`` or raise a SourceError naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SourceError(f"{what} needs the {module!r} package: python -m pip install -e "
                          f"\".[{extra}]\" in the zephon checkout ({exc})") from None


class FileRef:
    """One input file: ``url`` (a local path or an fsspec URL), ``size`` in bytes,
    ``version`` (``etag:<ETag>`` or ``mtime:<time>`` as seen when the source was
    built; '' for local files and refs made without one) and ``version_id`` (the
    store's object version id or generation, '' when it has none)."""

    __slots__ = ("size", "url", "version", "version_id")

    def __init__(self, url: str, size: int, version: str = "", version_id: str = "") -> None:
        self.url, self.size, self.version = url, int(size), version
        self.version_id = version_id

    @property
    def remote(self) -> bool:
        return is_remote(self.url)

    @property
    def basename(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def etag(self) -> str:
        """The strong ETag recorded when the source was built, unquoted ('' when there
        is none or it is weak)."""
        tag = self.version[5:] if self.version.startswith("etag:") else ""
        return "" if tag.startswith("W/") else tag

    @property
    def conditional(self) -> bool:
        """True when every ranged read of this object names its version (``If-Match``
        on S3 and HTTP(S) with a strong ETag), so no separate look-up is needed."""
        return bool(self.etag) and protocol_of(self.url) in ("s3", "s3a", "http", "https")

    def __getstate__(self):
        return (self.url, self.size, self.version, self.version_id)

    def __setstate__(self, state) -> None:
        self.url, self.size, self.version, self.version_id = state

    def __eq__(self, other) -> bool:
        return isinstance(other, FileRef) and self.__getstate__() == other.__getstate__()

    def __hash__(self) -> int:
        return hash(self.__getstate__())

    def __repr__(self) -> str:
        return f"FileRef({self.url!r}, size={self.size}, version={self.version!r})"


class ObjectChanged(SourceError):
    """A remote object is no longer the version its source was built on."""

    def __init__(self, ref: FileRef, now: str, context: str = "") -> None:
        where = f" ({context})" if context else ""
        super().__init__(f"{ref.url}{where} changed since the source was built: it was "
                         f"{ref.version or 'unversioned'} ({ref.size} bytes), the store now "
                         f"has {now}; rebuild the source to read the new version")
        self.url, self.now = ref.url, now


class ObjectCorrupt(SourceError):
    """Bytes read from a remote object do not match its checksum, or the digest recorded
    when the source was built, in every attempt: something between zephon and the store
    alters the data. Nothing built from them is delivered."""

    def __init__(self, ref: FileRef, what: str, attempts: int, context: str = "") -> None:
        where = f" ({context})" if context else ""
        super().__init__(f"{ref.url}{where}: {what}, in {attempts} read(s): something between "
                         f"zephon and the store alters the data (a proxy, a faulty network "
                         f"card: find it, or read over TLS), or the object was replaced since "
                         f"the source was built (rebuild the source); nothing read from them "
                         f"was delivered")
        self.url = ref.url


def range_digest(data) -> bytes:
    """The digest recorded for a byte range (the first :data:`DIGEST_SIZE` bytes of its
    SHA-256) and compared on each streamed read of it."""
    return hashlib.sha256(data).digest()[:DIGEST_SIZE]


def _sse_etag(meta: dict) -> bool:
    """True when a response said SSE-KMS or SSE-C: the ETag is then no MD5 of the data."""
    return str(meta.get("ServerSideEncryption") or "").startswith("aws:kms") or \
        bool(meta.get("SSECustomerAlgorithm"))


class _Crc:
    """A CRC with hashlib's ``update``/``digest`` (big-endian bytes, as S3 encodes it)."""

    def __init__(self, fn, width: int) -> None:
        self.fn, self.width, self.value = fn, width, 0

    def update(self, data) -> None:
        self.value = self.fn(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(self.width, "big")


def _hasher(algorithm: str):
    """A factory of hashers for one of S3's additional checksums, or None when this
    process cannot compute it (CRC32C and CRC64NVME need the ``awscrt`` package)."""
    import zlib

    if algorithm in ("SHA1", "SHA256"):
        return lambda: hashlib.new(algorithm.lower())
    if algorithm == "CRC32":
        return lambda: _Crc(zlib.crc32, 4)
    try:
        from awscrt import checksums  # type: ignore[import-not-found]
    except ImportError:
        return None
    if algorithm == "CRC32C":
        return lambda: _Crc(checksums.crc32c, 4)
    if algorithm == "CRC64NVME":
        return lambda: _Crc(checksums.crc64nvme, 8)
    return None


_ALGORITHMS = ("SHA256", "SHA1", "CRC64NVME", "CRC32C", "CRC32")


def _composite_parts(info: dict, algorithm: str, value: str, etag: str) -> int:
    """How many parts a composite checksum ``value`` (the checksum of its parts'
    checksums) covers; 0 for a full-object checksum; -1 when that cannot be told. A
    composite value ends in ``-N``; some stores leave that out, so a multipart object's
    checksum counts as composite over the ETag's N parts unless ``ChecksumType`` says
    ``FULL_OBJECT`` (a CRC with neither is compared both ways: see ObjectChecksum)."""
    count = value.partition("-")[2]
    if count:
        return int(count) if count.isdigit() else -1
    parts = etag.partition("-")[2]
    if not parts:
        return 0  # a single-part object
    if str(info.get("ChecksumType") or "").upper() == "FULL_OBJECT":
        return 0
    return int(parts) if parts.isdigit() else -1


class ObjectChecksum:
    """A checksum the store keeps of an object's bytes, computed as they are read in
    order, to compare with the store's (see the module docstring).

    Chosen on the first response (S3 only):

    - the ETag when it is an MD5 (not under SSE-KMS or SSE-C): a single-part ETag is the
      MD5 of the bytes; a multipart one (``<hex>-N``) is the MD5 of the N parts' MD5s,
      the part boundaries asked of the store (``HeadObject`` with ``PartNumber`` 1..N),
      so parts of any sizes are checked;
    - else an additional checksum (``HeadObject`` with ``ChecksumMode=ENABLED``:
      SHA-256, SHA-1, CRC64NVME, CRC32C or CRC32; full-object, or composite ``-N``: the
      checksum of the parts' checksums);
    - else none: :attr:`verifiable` is False and :meth:`mismatch` None; the callers
      then read the object twice and require the reads to agree (module docstring).
    """

    def __init__(self, ref: FileRef, cfg: IoConfig, storage_options: dict | None) -> None:
        self.ref, self.cfg, self.storage_options = ref, cfg, storage_options
        self.planned = False
        self.name = ""  # what is compared ('' when nothing is)
        self.want = ""  # the store's value, as value() formats it
        self.b64 = False  # values are base64 (additional checksums), else hex (ETags)
        self.factory: Any = None  # makes a hasher of one part
        self.sizes: list[int] = []  # the part boundaries
        self.composite = False  # the value is the checksum of the parts' checksums, "-N"
        self.done: list[bytes] = []  # the digest of each complete part
        self.current: Any = None
        self.full: Any = None  # a whole-object hasher too, when either kind may be meant
        self.full_want = ""
        self.filled = 0  # bytes of the current part seen

    def update(self, data: bytes, meta: dict) -> None:
        """The next bytes of the object (read in order) and the response that carried them."""
        if not self.planned:
            self.planned = True
            self._plan(meta)
        if self.factory is None:
            return
        if self.full is not None:
            self.full.update(data)
        view = memoryview(data)
        while view:
            if self.current is None:
                self.current = self.factory()
            room = self.sizes[len(self.done)] - self.filled if len(self.done) < \
                len(self.sizes) else len(view)
            take = view[:room]
            self.current.update(take)
            self.filled += len(take)
            view = view[len(take):]
            if len(self.done) < len(self.sizes) and self.filled == self.sizes[len(self.done)]:
                self._close_part()

    def _close_part(self) -> None:
        cur = self.current if self.current is not None else self.factory()
        self.done.append(cur.digest())
        self.current, self.filled = None, 0

    def _plan(self, meta: dict) -> None:
        """Choose what to compare (see the class docstring)."""
        if not _is_s3(self.ref.url) or not self.ref.size:
            return
        digest, _, count = self.ref.etag.lower().partition("-")
        md5 = len(digest) == 32 and all(c in "0123456789abcdef" for c in digest) and \
            (not count or count.isdigit())
        if md5 and not _sse_etag(meta):
            parts = int(count or 1)
            sizes = [self.ref.size] if not count else self._part_sizes(parts)
            if sizes:
                self.name = "MD5" if not count else \
                    "multipart ETag (the MD5 of the parts' MD5s)"
                self.want, self.sizes, self.composite = self.ref.etag.lower(), sizes, bool(count)
                self.factory = lambda: hashlib.md5(usedforsecurity=False)
            return
        self._plan_additional()

    def _plan_additional(self) -> None:
        """Use an additional checksum of the store, when the object has one we can compute."""
        info = self._head(ChecksumMode="ENABLED")
        for algorithm in _ALGORITHMS:
            value = str(info.get(f"Checksum{algorithm}") or "")
            factory = _hasher(algorithm) if value else None
            if factory is None:
                if value:
                    log.info("%s has a %s checksum, which needs the awscrt package to "
                             "check", self.ref.url, algorithm)
                continue
            count = _composite_parts(info, algorithm, value, self.ref.etag)
            sizes = [self.ref.size] if not count else self._part_sizes(count)
            if sizes and count >= 0:
                self.name = f"{'composite ' if count else ''}{algorithm} checksum"
                self.want = f"{value.partition('-')[0]}-{count}" if count else value
                self.b64, self.sizes, self.composite = True, sizes, bool(count)
                self.factory = factory
                if count and "-" not in value and not info.get("ChecksumType") and \
                        algorithm.startswith("CRC"):  # composite or full-object: either
                    self.full, self.full_want = factory(), value
                return

    def _format(self, raw: bytes) -> str:
        import base64

        return base64.b64encode(raw).decode() if self.b64 else raw.hex()

    @property
    def verifiable(self) -> bool:
        """True when the bytes are compared with a checksum of the store."""
        return self.factory is not None

    def value(self) -> str:
        """The checksum of the bytes seen (all of them, once the object was read)."""
        if self.filled or self.current is not None or not self.done:
            self._close_part()
        if not self.composite:
            return self._format(self.done[0]) if len(self.done) == 1 else "<more bytes>"
        joined = self.factory()
        joined.update(b"".join(self.done))
        return f"{self._format(joined.digest())}-{len(self.done)}"

    def mismatch(self) -> str | None:
        """Why the bytes seen are not the object's, or None when they are (or when they
        cannot be compared: :attr:`verifiable`)."""
        if not self.verifiable:
            return None
        got = self.value()
        if got == self.want or (self.full is not None and
                                self._format(self.full.digest()) == self.full_want):
            return None
        return (f"the {self.name} of the bytes received ({got}) is not the object's "
                f"({self.want})")

    def _part_sizes(self, parts: int) -> list[int]:
        """The size of each of ``parts`` parts ([] when they do not add up to the object)."""
        sizes = [int(self._head(PartNumber=n).get("ContentLength") or 0)
                 for n in range(1, parts + 1)]
        if sum(sizes) != self.ref.size or min(sizes) <= 0:
            log.info("%s: the sizes of its %d parts do not add up to its size: its checksum "
                     "cannot be checked", self.ref.url, parts)
            return []
        return sizes

    def _head(self, **kw) -> dict:
        """``HeadObject`` (with the recorded version id when there is one). No
        ``If-Match``: some stores compare it with a part's own ETag; the object's reads are
        pinned, so a size or checksum from another version can only make the bytes
        differ, never pass altered ones."""
        from fsspec.asyn import sync

        fs = filesystem(self.ref.url, self.storage_options)
        bucket, key, _ = fs.split_path(self.ref.url)
        if self.ref.version_id:
            kw["VersionId"] = self.ref.version_id

        async def head():
            return await fs._call_s3("head_object", Bucket=bucket, Key=key, **kw)

        try:
            return call_with_retry(lambda: sync(fs.loop, head), self.cfg, self.ref.url)
        except Exception as exc:  # noqa: BLE001 - named for the user
            raise SourceError(f"cannot look up {self.ref.url} ({kw}): "
                              f"{type(exc).__name__}: {exc}") from None


def refuse_unchecked(ref: FileRef, cfg: IoConfig, context: str = "") -> None:
    """Raise a SourceError when ``ref`` offers no checksum zephon can check and ``cfg``
    says to refuse such objects (``unchecked_objects='refuse'``); else return (they are
    then read twice and the reads must agree)."""
    if getattr(cfg, "unchecked_objects", "read_twice") != "refuse":
        return
    where = f" ({context})" if context else ""
    raise SourceError(f"{ref.url}{where} offers no checksum zephon can check (its ETag is no "
                      f"MD5 of the data, as under SSE-KMS or SSE-C, and it has no additional "
                      f"checksum zephon can compute, or it is not on S3), and the io option "
                      f"unchecked_objects is 'refuse': upload it with an additional checksum "
                      f"(boto3: ChecksumAlgorithm='SHA256' or 'CRC32'), or set "
                      f"unchecked_objects='read_twice' to accept two reads that agree")


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
                                  f"{protocol!r} ({exc}); python -m pip install -e "
                                  f"\".[remote]\" (s3) or \".[gcs]\" (gs) in the zephon "
                                  "checkout, or the fsspec package for it") from None
            if protocol in ("s3", "s3a") and "retries" not in (storage_options or {}):
                fs.retries = 1  # one attempt per call: zephon's download_retry applies
            _FS[key] = fs
    return fs


def _version(info: dict) -> tuple[str, str]:
    """``(version, version_id)`` of an fsspec ``info`` record (see :class:`FileRef`)."""
    version = ""
    for name in ("ETag", "etag"):
        if info.get(name) not in (None, ""):
            raw = str(info[name]).strip()
            weak = raw.startswith("W/")  # a weak ETag: no If-Match on it
            version = "etag:" + ("W/" if weak else "") + raw[2 * weak:].strip('"')
            break
    else:
        for name in ("md5Hash", "LastModified", "mtime", "updated", "last_modified"):
            if info.get(name) not in (None, ""):
                version = ("md5:" if name == "md5Hash" else "mtime:") + str(info[name])
                break
    vid = info.get("VersionId") or info.get("generation") or ""
    return version, str(vid)


def current_version(ref: FileRef, storage_options: dict | None) -> tuple[int, str, str]:
    """``(size, version, version_id)`` the store reports for ``ref.url`` now."""
    fs = filesystem(ref.url, storage_options)
    info = fs.info(ref.url, refresh=True) if _is_s3(ref.url) else fs.info(ref.url)
    return (int(info.get("size") or 0), *_version(info))


def check_version(ref: FileRef, cfg: IoConfig, storage_options: dict | None,
                  context: str = "") -> None:
    """Raise :class:`ObjectChanged` when ``ref``'s object is no longer the recorded
    version (size, version and version id; unversioned refs: size only)."""
    try:
        size, version, vid = call_with_retry(lambda: current_version(ref, storage_options),
                                             cfg, ref.url)
    except Exception as exc:  # noqa: BLE001 - named for the user
        raise SourceError(f"cannot look up {ref.url}: {type(exc).__name__}: {exc}") from None
    changed = size != ref.size or (ref.version and version != ref.version) or \
        (ref.version_id and vid != ref.version_id)
    if changed:
        raise ObjectChanged(ref, f"{version or 'unversioned'} ({size} bytes)", context)


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
    return [FileRef(_with_protocol(pattern, p), int(info.get("size") or 0), *_version(info))
            for p, info in found]


def _is_s3(url: str) -> bool:
    return protocol_of(url) in ("s3", "s3a")


def _precondition_failed(exc: BaseException) -> bool:
    """True for a 412 answer (s3fs raises it as an OSError caused by a ClientError)."""
    seen, cur = 0, exc  # type: int, BaseException | None
    while cur is not None and seen < 5:
        if getattr(cur, "status", None) == 412:  # aiohttp (http, https)
            return True
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if error.get("Code") == "PreconditionFailed" or status == 412:
                return True
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return False


def _s3_range(fs, ref: FileRef, start: int, end: int) -> tuple[bytes, dict]:
    """One conditional ranged GetObject: the bytes and the response's headers."""
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(ref.url)
    kw: dict = {"Range": f"bytes={start}-{end - 1}"}
    if ref.etag:
        kw["IfMatch"] = f'"{ref.etag}"'
    if ref.version_id:
        kw["VersionId"] = ref.version_id

    async def get():
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kw)
        try:
            got = str(resp.get("ETag") or "").strip('"')
            if ref.etag and got and got != ref.etag:
                raise ObjectChanged(ref, f"etag:{got}")
            return await resp["Body"].read(), {k: v for k, v in resp.items() if k != "Body"}
        finally:
            resp["Body"].close()

    try:
        return sync(fs.loop, get)
    except Exception as exc:
        if _precondition_failed(exc):
            raise ObjectChanged(ref, "another version (If-Match failed)") from None
        raise


def _confirm_changed(fs, ref: FileRef, exc: ObjectChanged) -> None:
    """Raise ``exc`` when the store confirms that ``ref``'s object is another version
    now (a ``HeadObject``, with the recorded version id when there is one); when it
    reports the recorded ETag, the answer was altered on its way (one response with
    another ETag header, a spurious 412): an OSError, which is retried."""
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(ref.url)
    kw: dict = {"VersionId": ref.version_id} if ref.version_id else {}

    async def head():
        return await fs._call_s3("head_object", Bucket=bucket, Key=key, **kw)

    try:
        now = str(sync(fs.loop, head).get("ETag") or "").strip('"')
    except Exception:  # noqa: BLE001 - gone, or unreachable: nothing says it is unchanged
        raise exc from None
    if now != ref.etag:
        raise exc
    log.warning("%s: a response named %s but the store still has the recorded etag:%s "
                "(the answer was altered on its way); reading it again", ref.url, exc.now,
                ref.etag)
    raise OSError(f"a response named {exc.now}, the store has the recorded etag:{ref.etag}")


def _http_range(fs, ref: FileRef, start: int, end: int) -> bytes:
    """One ranged GET with ``If-Match`` (the filesystem's own headers kept)."""
    headers = dict((getattr(fs, "kwargs", None) or {}).get("headers") or {})
    headers["If-Match"] = f'"{ref.etag}"'
    try:
        return fs.cat_file(ref.url, start=start, end=end, headers=headers)
    except Exception as exc:
        if _precondition_failed(exc):
            raise ObjectChanged(ref, "another version (If-Match failed)") from None
        raise


def fetch_range(ref: FileRef, start: int, end: int, cfg: IoConfig,
                storage_options: dict | None = None, context: str = "") -> tuple[bytes, dict]:
    """Like :func:`read_range`, with the response's headers (S3: ``ETag``,
    ``ServerSideEncryption``, ...; other protocols: ``{}``)."""
    if end <= start:
        return b"", {}
    fs = filesystem(ref.url, storage_options)
    s3 = _is_s3(ref.url)

    def attempt() -> tuple[bytes, dict]:
        if s3:
            try:
                data, meta = _s3_range(fs, ref, start, end)
            except ObjectChanged as exc:
                _confirm_changed(fs, ref, exc)
        elif ref.conditional:
            data, meta = _http_range(fs, ref, start, end), {}
        else:
            data, meta = fs.cat_file(ref.url, start=start, end=end), {}
        if len(data) != end - start:
            raise OSError(f"short read: {len(data)} of {end - start} bytes at offset {start}")
        return data, meta

    try:
        return call_with_retry(attempt, cfg, ref.url)
    except ObjectChanged as exc:
        raise ObjectChanged(ref, exc.now, context) from None
    except Exception as exc:  # noqa: BLE001 - named for the user
        where = f" ({context})" if context else ""
        raise SourceError(f"cannot read {ref.url}{where}, bytes {start}-{end}, after "
                          f"{cfg.download_retry} retries: {type(exc).__name__}: {exc}") from None


def read_range(ref: FileRef, start: int, end: int, cfg: IoConfig,
               storage_options: dict | None = None, context: str = "") -> bytes:
    """Bytes ``[start, end)`` of the remote object ``ref`` (retried; exactly
    ``end - start`` bytes or a SourceError naming the URL and ``context``; an object
    that changed since the source was built is :class:`ObjectChanged`)."""
    return fetch_range(ref, start, end, cfg, storage_options, context)[0]
