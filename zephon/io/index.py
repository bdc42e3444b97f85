"""The shared index: what a source learns about its files, learnt once and read by all.

Building a source over shards reads something of every shard (a tar's member headers, a
Parquet footer, an ArrayRecord's record count). Without help every process of every rank
does it again at every launch. The shared index writes each file's facts once to a small
index directory and every later build reads them from there instead of opening the file.

Where it lives (the ``index`` argument of the file sources, and ``python -m zephon index``):

- ``None`` (the default): ``_zephon_index/`` in the directory of the source's first file
  (for remote data ``_zephon_index/<directory>`` beside that directory: object stores
  list a directory recursively, and the index's blobs must not cost every rank's
  listing). A local one is read, and written when something was learnt; beside remote
  data it is read only (a thousand ranks writing one object at once is a stampede: build it ahead with
  ``python -m zephon index``, or name a location);
- a path or fsspec URL: that directory, read and written;
- ``False``: no index (every build scans).

Layout, for each kind of source (``webdataset``, ``jsonl``, ``parquet``, ``array_record``):

- ``<kind>.zidx``: a first line ``zephon-index <FORMAT> <sha256 of the rest>``, then one
  JSON object ``{"kind", "layout", "files": {name: [size, stamp, facts, detail]}}``. A file
  is named by its path relative to the directory holding the index directory when it lies
  there, else by its full path or URL; ``stamp`` is the version the facts were learnt from
  (``mtime:<ns>`` for a local file; the object's ETag or version id for a remote one);
  ``facts`` are small (counts), ``detail`` is None or the SHA-256 of the file's detail blob;
- ``<kind>/<sha256>.zblob``: a file's detail (a tar shard's member table, a jsonl file's
  line offsets: as large as its samples are many), zlib-compressed JSON or bytes, named by the SHA-256 of its bytes: it is read
  only when a process first reads that file, so building a source over 10^4 shards reads
  one object (the ``.zidx``) besides the listing, whatever the number of ranks.

Invariants (nothing read back is assumed):

- an entry is used only for the file of that name whose size and version are the ones it
  names: a changed file (another mtime, ETag or size) is scanned again and only it (a
  local file rewritten to the same size with its mtime set back, as ``rsync --times``
  can, keeps its entry: its facts are then checked where they are used, below);
- the ``.zidx`` checksum covers every byte after its first line: an index that does not
  match it, or is not the zephon index format, is refused with a :class:`SourceError`
  naming it (delete it or rebuild it); a blob whose bytes do not hash to its name is
  refused the same way;
- an entry's facts are checked against the file where the file is read (a row group's
  row count, a member's tar header): an index forged with a recomputed checksum cannot
  make a source deliver other bytes than the file holds; it fails naming the index.

Writes are atomic (a temporary file renamed over the old one; a local index is updated
under a lock, merging what others wrote in between) and merge entries: two builds over
different files of one directory both end up in the index. A build that is killed keeps
what it had saved (:func:`build` saves every few seconds), so it resumes where it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
import zlib
from typing import Any, Callable, Iterator, Sequence

from zephon.io.errors import SourceError
from zephon.io.remote import filesystem, is_remote, strip_file_url

__all__ = ["DIRNAME", "FORMAT", "IndexStore", "Learnt", "building", "learn", "load_detail",
           "store_for"]

log = logging.getLogger("zephon.index")

FORMAT = 1
DIRNAME = "_zephon_index"
_MAGIC = b"zephon-index"


class Learnt(list):
    """The facts of a source's files (a list: ``facts[k]`` of file ``k``), and how they
    were had: ``read`` files from the index, ``scanned`` files scanned, ``store`` the
    index (None: no index)."""

    read: int = 0
    scanned: int = 0
    store: "IndexStore | None" = None


class IndexStore:
    """One index directory (local or remote) for one kind of source."""

    def __init__(self, location: str, kind: str, layout: int, writable: bool,
                 storage_options: dict | None = None) -> None:
        self.location = location.rstrip("/") if is_remote(location) else \
            os.path.abspath(strip_file_url(location))
        self.kind, self.layout, self.writable = kind, int(layout), writable
        self.storage_options = storage_options
        self.remote = is_remote(self.location)
        #: what this process counted: objects read from the index (the .zidx and blobs)
        self.objects_read = 0

    @property
    def base(self) -> str:
        """The directory the index's file names are relative to (its parent)."""
        return self.location.rsplit("/", 1)[0] if self.remote else \
            os.path.dirname(self.location)

    def path(self, *parts: str) -> str:
        return "/".join((self.location, *parts)) if self.remote else \
            os.path.join(self.location, *parts)

    @property
    def top(self) -> str:
        return self.path(f"{self.kind}.zidx")

    def name_of(self, url: str) -> str:
        """The name the index gives the file at ``url``."""
        if not is_remote(url):  # one name for a file however the source was given it
            url = os.path.abspath(strip_file_url(url))
        base = self.base + ("/" if self.remote else os.sep)
        if url.startswith(base):
            return url[len(base):]
        return url if self.remote else os.path.abspath(url)

    # -- raw bytes ----------------------------------------------------------------------

    def _get(self, path: str) -> bytes | None:
        self.objects_read += 1
        try:
            if self.remote:
                return filesystem(path, self.storage_options).cat_file(path)
            with open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SourceError(f"index: cannot read {path}: {exc}") from None

    def _put(self, path: str, data: bytes) -> None:
        if self.remote:
            filesystem(path, self.storage_options).pipe_file(path, data)
            return
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".part-")
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # readable by whoever may read the data
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self.remote:
            yield
            return
        import fcntl

        os.makedirs(self.location, exist_ok=True)
        fd = os.open(self.top + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- the top file -------------------------------------------------------------------

    def load(self) -> dict:
        """``{name: [size, stamp, facts, detail]}`` of the index (empty: none yet, or one
        of another layout). Raises SourceError for an index that is not intact."""
        data = self._get(self.top)
        if data is None:
            return {}
        head, _, body = data.partition(b"\n")
        words = head.split(b" ")
        if len(words) != 3 or words[0] != _MAGIC:
            raise self._refused("it is not a zephon index")
        if words[1] != str(FORMAT).encode():
            raise self._refused(f"it is index format {words[1]!r}, this zephon reads {FORMAT}")
        if hashlib.sha256(body).hexdigest().encode() != words[2]:
            raise self._refused("its checksum does not match its contents (altered or torn)")
        try:
            doc = json.loads(body)
            files = doc["files"]
            kind, layout = doc["kind"], doc["layout"]
        except (ValueError, KeyError, TypeError) as exc:
            raise self._refused(f"its body does not parse ({exc})") from None
        if kind != self.kind or not isinstance(files, dict):
            raise self._refused(f"it indexes {kind!r} sources, not {self.kind!r}")
        return files if layout == self.layout else {}

    def _refused(self, why: str) -> SourceError:
        return SourceError(f"index: {self.top} is refused: {why}; delete it, or rebuild it "
                           f"with `python -m zephon index`")

    def save(self, entries: dict) -> None:
        """Merge ``entries`` (``{name: [size, stamp, facts, detail]}``) into the index."""
        with self._locked():
            try:
                files = self.load()
            except SourceError as exc:  # a broken index is replaced by what was learnt
                log.warning("%s; writing a new one", exc)
                files = {}
            files.update(entries)
            body = json.dumps({"kind": self.kind, "layout": self.layout, "files": files},
                              separators=(",", ":"), sort_keys=True).encode()
            head = b"%s %d %s\n" % (_MAGIC, FORMAT, hashlib.sha256(body).hexdigest().encode())
            self._put(self.top, head + body)

    # -- detail blobs -------------------------------------------------------------------

    def put_blob(self, value: Any) -> str:
        """Store a detail (bytes as they are, anything else as JSON); its name: its digest."""
        raw = b"B" + value if isinstance(value, bytes) else \
            b"J" + json.dumps(value, separators=(",", ":")).encode()
        data = zlib.compress(raw, 1)
        digest = hashlib.sha256(data).hexdigest()
        self._put(self.path(self.kind, f"{digest}.zblob"), data)
        return digest

    def get_blob(self, digest: str, file: str) -> Any:
        path = self.path(self.kind, f"{digest}.zblob")
        data = self._get(path)
        if data is None:
            raise SourceError(f"index: {path} (the detail of {file}) is missing; rebuild the "
                              f"index with `python -m zephon index`, or delete {self.top}")
        if hashlib.sha256(data).hexdigest() != digest:
            raise SourceError(f"index: {path} (the detail of {file}) is refused: its bytes "
                              f"do not hash to its name (altered or torn); rebuild the index")
        try:
            raw = zlib.decompress(data)
            return raw[1:] if raw[:1] == b"B" else json.loads(raw[1:] if raw[:1] == b"J"
                                                              else b"!")
        except (zlib.error, ValueError) as exc:
            raise SourceError(f"index: {path} (the detail of {file}) is refused: it does not "
                              f"decode ({exc}); rebuild the index") from None


    def prune(self, older_than_s: float = 3600.0) -> int:
        """Remove the blobs no entry names (left by files that changed) and older than
        ``older_than_s`` (a build running beside this one writes its blobs before the
        entries naming them); returns how many."""
        with self._locked():
            named = {entry[3] for entry in self.load().values() if isinstance(entry[3], str)}
            directory = self.path(self.kind)
            fs = filesystem(directory, self.storage_options) if self.remote else None
            try:
                listed = fs.ls(directory, detail=True) if fs is not None else \
                    [{"name": e.path, "mtime": e.stat().st_mtime} for e in os.scandir(directory)]
            except FileNotFoundError:
                return 0
            now, gone = time.time(), 0
            for info in listed:
                path = str(info["name"])
                name = path.rsplit("/", 1)[-1]
                if not name.endswith(".zblob") or name[:-6] in named or \
                        now - _mtime(info) < older_than_s:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(path) if fs is not None else os.unlink(path)
                gone += 1
            return gone


def _mtime(info: dict) -> float:
    """A listing entry's modification time (s since the epoch; now when it has none)."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    stamp = getattr(value, "timestamp", None)
    if stamp is not None:
        return float(stamp())
    return float(value) if isinstance(value, (int, float)) else time.time()


def _umask() -> int:
    """The process's umask, read without changing it (threads may be creating files)."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _default_location(url: str) -> str:
    """``_zephon_index/`` in a local file's directory; for a remote object, beside its
    directory (``s3://b/data/train/x.tar`` -> ``s3://b/data/_zephon_index/train``), so that
    listing the data (recursive on object stores) never lists the index's blobs."""
    if is_remote(url):
        directory = url.rsplit("/", 1)[0]
        parent, _, leaf = directory.rpartition("/")
        if parent.endswith(":/") or "/" not in directory.split("://", 1)[1]:
            return f"{directory}/{DIRNAME}"  # a bucket's root: nothing beside it
        return f"{parent}/{DIRNAME}/{leaf}"
    return os.path.join(os.path.dirname(os.path.abspath(url)), DIRNAME)


def store_for(source: Any, kind: str, layout: int, index: Any) -> IndexStore | None:
    """The index a source with the ``index`` argument reads (None: no index)."""
    if index is False or not source.refs:
        return None
    if index is None:
        first = source.refs[0].url
        return IndexStore(_default_location(first), kind, layout,
                          not is_remote(first) or _BUILD["building"], source.storage_options)
    if not isinstance(index, (str, os.PathLike)):
        raise SourceError(f"index must be None, False or a path/URL, got {index!r}")
    return IndexStore(os.fspath(index), kind, layout, True, source.storage_options)


def stamp_of(source: Any, k: int) -> str | None:
    """The version of file ``k`` the index keys it by (None: it has none to key by)."""
    ref = source.refs[k]
    if ref.remote:
        version = ref.version or ref.version_id
        return f"v:{version}" if version else None
    mtime = int(source.built_mtimes[k])
    return f"mtime:{mtime}" if mtime >= 0 else None


def learn(source: Any, kind: str, layout: int, scan: Callable[[int], Any], *,
          index: Any = None, detail: bool = False,
          indices: Sequence[int] | None = None) -> Learnt:
    """The facts of each file of ``source`` (a FileSource): from the index where it holds
    that file at its current version, else ``scan(k)`` (then written to the index when it
    is writable).

    Args:
        source: the FileSource being built (its ``refs``, ``built_mtimes`` and
            ``storage_options``).
        kind: the kind of source (names the index file).
        layout: the shape of the facts: an index of another layout is not used.
        scan: ``scan(k)`` learns file ``k``: its facts (JSON values), or with ``detail`` a
            ``(facts, detail)`` pair whose detail is stored apart and read lazily.
        index: the source's ``index`` argument (see the module docstring).
        detail: whether ``scan`` returns a detail.
        indices: the files to learn (default: all).

    Returns:
        A :class:`Learnt`: per file, its facts (with ``detail``: ``[facts, blob digest]``).
    """
    store = store_for(source, kind, layout, index)
    ks = range(len(source.refs)) if indices is None else indices
    out = Learnt()
    out.store = store
    got, todo = _from_index(store, source, ks, detail)
    out.read = len(got)
    writer = _Writer(store)
    for k, result in _scanned(source, scan, todo):
        out.scanned += 1
        facts, blob = result if detail else (result, None)
        blob = writer.blob(blob)
        got[k] = [facts, blob] if detail else facts
        writer.entry(source, k, facts, blob)  # after the scan: it may have found a newer version
    writer.finish()
    out.extend(got[k] for k in ks)
    return out


def _from_index(store: IndexStore | None, source: Any, ks: Sequence[int],
                detail: bool) -> tuple[dict[int, Any], list[int]]:
    """What the index holds of files ``ks`` at their current versions (``{k: facts}``),
    and the files it does not (to scan)."""
    known = _known(store)
    got: dict[int, Any] = {}
    todo = []
    for k in ks:
        stamp = stamp_of(source, k)
        entry = known.get(store.name_of(source.refs[k].url)) if store is not None else None
        if entry is not None and stamp is not None and entry[0] == source.refs[k].size \
                and entry[1] == stamp and _sound(store, entry):
            got[k] = [entry[2], entry[3]] if detail else entry[2]
        else:
            todo.append(k)
    return got, todo


class _Writer:
    """What a build learnt, written to a writable index: blobs as they come, entries every
    ``save_every_s`` and at the end; a location that refuses writes is given up (logged:
    the next build scans again)."""

    def __init__(self, store: IndexStore | None) -> None:
        self.store = store if store is not None and store.writable else None
        self.save = timed_saves(self.store, _BUILD["save_every_s"]) \
            if self.store is not None else None

    def _give_up(self, exc: OSError) -> None:
        log.warning("index: could not write to %s (%s): the next build scans again",
                    self.store.location if self.store is not None else "?", exc)
        self.store = self.save = None

    def blob(self, blob: Any) -> Any:
        """The blob's digest once written (the blob itself when it is not)."""
        if self.store is None or blob is None:
            return blob
        try:
            return self.store.put_blob(blob)
        except OSError as exc:
            self._give_up(exc)
            return blob

    def entry(self, source: Any, k: int, facts: Any, blob: Any) -> None:
        stamp = stamp_of(source, k)
        if self.store is None or self.save is None or stamp is None:
            return
        ref = source.refs[k]
        try:
            self.save({self.store.name_of(ref.url): [ref.size, stamp, facts, blob]}, False)
        except OSError as exc:
            self._give_up(exc)

    def finish(self) -> None:
        if self.save is not None:
            try:
                self.save({}, True)
            except OSError as exc:
                self._give_up(exc)


#: how :func:`learn` works inside :func:`building` (``python -m zephon index``): the
#: processes scanning, how often what was learnt is saved (a killed build resumes from
#: there), and whether every entry is re-learnt
_BUILD: dict[str, Any] = {"building": False, "workers": 1, "save_every_s": 3600.0,
                          "rebuild": False}


@contextlib.contextmanager
def building(workers: int, save_every_s: float = 5.0, rebuild: bool = False) -> Iterator[None]:
    """Sources built inside build their index: they scan files on ``workers`` processes,
    save what they learnt every ``save_every_s`` seconds, write the default index beside
    remote data too, replace an index that is refused, check every blob an entry names
    (a missing or altered one is learnt again) and, with ``rebuild``, learn every file
    again (``python -m zephon index``)."""
    before = dict(_BUILD)
    _BUILD.update(building=True, workers=max(1, int(workers)),
                  save_every_s=float(save_every_s), rebuild=bool(rebuild))
    try:
        yield
    finally:
        _BUILD.update(before)


def _known(store: IndexStore | None) -> dict:
    """The entries of ``store``; a build replaces a refused index (and says so) instead of
    failing on it; a rebuild learns everything again."""
    if store is None or (_BUILD["building"] and _BUILD["rebuild"]):
        return {}
    try:
        return store.load()
    except SourceError as exc:
        if not _BUILD["building"]:
            raise
        log.warning("%s: rebuilding it", exc)
        return {}


def _sound(store: IndexStore | None, entry: list) -> bool:
    """Whether an entry may be used: always, except in a build, which reads its blob (and
    learns the file again when the blob is missing or altered)."""
    if not _BUILD["building"] or store is None or not isinstance(entry[3], str):
        return True
    try:
        store.get_blob(entry[3], "(checked by the build)")
    except SourceError as exc:
        log.warning("%s: learning the file again", exc)
        return False
    return True


def _scanned(source: Any, scan: Callable[[int], Any], todo: list) -> Iterator[tuple[int, Any]]:
    """``(k, scan(k))`` for the files to scan: in this process, or on ``_BUILD["workers"]``
    spawned processes (the source pickles without its handles), in order of completion."""
    workers = min(_BUILD["workers"], len(todo))
    if workers <= 1:
        for k in todo:
            yield k, scan(k)
        return
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    # the source travels once per worker (not once per file: that grows with files squared)
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx,
                                                  initializer=_scan_worker, initargs=(scan,))
    try:
        futures = {pool.submit(_scan_one, k): k for k in todo}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()
    except BaseException:  # Ctrl-C, a failed scan: stop the workers now, not after the queue
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


_WORKER: dict[str, Any] = {}


def _scan_worker(scan: Callable[[int], Any]) -> None:
    """A build's scanning process: it holds the source's scan, and dies with its parent
    (a killed build leaves no worker behind)."""
    _WORKER["scan"] = scan
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pool's own shutdown applies
        pass
    if os.getppid() == 1:  # the parent died before the signal was asked for
        os._exit(1)


def _scan_one(k: int) -> Any:
    return _WORKER["scan"](k)


def load_detail(store: IndexStore | None, entry: list, file: str) -> Any:
    """The detail of one learnt file (``[facts, digest]`` from :func:`learn`), or the
    detail itself when it was scanned without an index to keep it."""
    _facts, blob = entry
    if isinstance(blob, str):
        if store is None:
            raise SourceError(f"index: the detail of {file} is in an index this source "
                              f"no longer names")
        return store.get_blob(blob, file)
    return blob


def timed_saves(store: IndexStore, every_s: float = 5.0) -> Callable[[dict, bool], None]:
    """A saver for long builds: ``save(entries, final)`` writes what accumulated when
    ``every_s`` passed since the last write, and always when ``final``."""
    pending: dict = {}
    last = [time.monotonic()]

    def save(entries: dict, final: bool = False) -> None:
        pending.update(entries)
        if pending and (final or time.monotonic() - last[0] >= every_s):
            store.save(dict(pending))
            pending.clear()
            last[0] = time.monotonic()
    return save
