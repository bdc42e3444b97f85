"""Where the ranks' checkpoint records travel: a directory, an fsspec URL, a TCPStore.

A *medium* is a tiny key -> bytes space shared by the ranks of one run. What the
round protocol (:mod:`zephon.checkpoint.aggregate`) asks of it, each a constant
number of operations whatever the world size:

- ``put(key, data)``: publish ``data`` under ``key`` atomically (a reader sees
  the old value, nothing, or all of ``data``);
- ``get(key)``: the bytes under ``key`` or ``None`` when there are none yet;
- ``wait(key, until)``: the bytes under ``key`` once they are there, or
  ``None`` at the monotonic time ``until``. A store blocks server-side; a
  directory or an object store re-reads with a bounded exponential backoff
  (:func:`backoff`: 2 ms, x1.5, at most 0.5 s between reads on a directory;
  50 ms to 2 s on an object store), so a wait of ``t`` seconds costs about
  ``17 + 2 t`` reads on a directory, whatever the number of ranks;
- ``submit(prefix, rank, world, blob, until)`` / ``gather(prefix, world, until)``:
  each rank other than 0 hands in its state once; rank 0 gets all of them
  (``{rank: blob}``, the ranks there by ``until``) in a number of round trips
  that does not grow with the world size. A store appends every submission to
  one key. A directory or an object store gathers through a tree of fan-in
  :data:`FAN_IN` (32): every 32nd rank collects its 31 neighbours' records and
  publishes them as one group, every 1024th collects 31 groups, and so on, so no
  rank reads more than 31 records a level and ``ceil(log32 W)`` levels (2 up to
  1024 ranks, 3 up to 32768). A leader waits for its children only for its share of
  ``until``; rank 0 reads the own records of ranks still missing after that (a
  late rank, a dead leader's subtree), so a slow leader delays nobody's
  submission and the ranks that never came are still named exactly;
- ``tidy(base, tokens, rank, world, until)``: called by every rank once it has
  its result; the last one removes the round (everything under ``base``). A
  medium that cannot count its readers (an object store) leaves the round,
  and rank 0 removes it at the next round (``remove``);
- ``remove(prefix)``, ``address`` (for messages), ``close()``.

Directories count readers with hard links: each rank links the merged record
once and reads its link count; the rank that sees ``world + 1`` links removes
the round (two that see it both remove it, which is harmless). Where hard links
fail the round stays until rank 0 removes it at the next round.

Every ``get`` and listing sees the medium's current state, whatever this process
read before: an fsspec filesystem is opened with its listings cache off
(``use_listings_cache=False``, so it is an instance of its own, not the one the
user's code shares) and its cached listings of the path are dropped before each
read. (s3fs and gcsfs otherwise keep a folder's listing once read: the records
other processes write there later stay invisible, and reading one raises
FileNotFoundError, so a round of three or more ranks timed out.)

Any failure of the medium itself (a server gone, a permission error) is a
:class:`~zephon.errors.CheckpointError` naming the address, never a hang: a
remote call that does not return by the exchange deadline is abandoned.

Media: :class:`DirMedium` (a local or shared path, or ``file://``),
:class:`FsspecMedium` (``memory://``, ``s3://`` via s3fs, ``gs://`` via gcsfs,
any fsspec protocol) and the TCPStore medium of :mod:`zephon.checkpoint.store`.
:func:`open_medium` picks one from the options. Keys live under
``<aggregate_dir>/<run_id>/`` (or the ``zephon/<run_id>/`` prefix of a store).
"""

from __future__ import annotations

import abc
import logging
import os
import re
import shutil
import struct
import threading
import time
from typing import Iterator

from zephon.errors import AggregationTimeoutError, CheckpointError, ZephonConfigError

__all__ = ["DirMedium", "FsspecMedium", "backoff", "open_medium"]

log = logging.getLogger("zephon.checkpoint")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_EXTRA_OF = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def backoff(until: float, first_s: float, cap_s: float, factor: float = 1.5) -> Iterator[None]:
    """Yield at once, then after sleeps of ``first_s``, ``first_s * factor``, ... (at most
    ``cap_s`` each, never past the monotonic time ``until``); stops once ``until`` has
    passed. The caller checks its condition at every step and breaks when it holds."""
    delay = first_s
    while True:
        yield
        remaining = until - time.monotonic()
        if remaining <= 0:
            return
        time.sleep(min(delay, remaining))
        delay = min(delay * factor, cap_s)


_RANK_FILE = re.compile(r"rank-([0-9]{1,9})")


class _PollingMedium(abc.ABC):
    """The waits, submissions and gathering of a medium without server-side waits, from
    its ``put``/``get`` of whole records and ``_list`` of a prefix's names, with a
    backoff between reads (``first_s``, ``cap_s``)."""

    first_s, cap_s = 0.002, 0.5
    address: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def _list(self, prefix: str) -> list[str]: ...

    def wait(self, key: str, until: float) -> bytes | None:
        for _ in backoff(until, self.first_s, self.cap_s):
            blob = self.get(key)
            if blob is not None:
                return blob
        return None

    def submit(self, prefix: str, rank: int, world: int, blob: bytes,
               until: float | None = None) -> None:
        """Publish this rank's record where its parent in the gathering tree reads it; a
        rank that leads a subtree first gathers it (until its share of ``until``, the
        monotonic time by which rank 0 stops waiting) and publishes the group."""
        tree = _Tree(world)
        self.put(f"{prefix}/{tree.record_key(rank)}", blob)
        top = tree.top_level(rank)
        if top == 0:
            return
        now = time.monotonic()
        mine = now + max((until if until is not None else now) - now, 0.0) * top / tree.height
        got = self._gather_tree(prefix, tree, rank, top, mine)
        got[rank] = blob
        self.put(f"{prefix}/{tree.group_key(rank, top)}", pack_frames(got))

    def gather(self, prefix: str, world: int, until: float) -> dict[int, bytes]:
        tree = _Tree(world)
        got = self._gather_tree(prefix, tree, 0, tree.height, until)
        missing = [r for r in range(1, world) if r not in got]
        for _ in backoff(until, self.first_s, self.cap_s) if missing else ():
            # a subtree's leader gave up on (or never reached) some of its ranks: read
            # the late ones' own records (only on this failure path is it per rank)
            for r in missing:
                blob = self.get(f"{prefix}/{tree.record_key(r)}")
                if blob is not None:
                    got[r] = blob
            missing = [r for r in missing if r not in got]
            if not missing:
                break
        return got

    def _gather_tree(self, prefix: str, tree: _Tree, rank: int, top: int,
                     until: float) -> dict[int, bytes]:
        """The records of ``rank``'s subtree up to level ``top`` (not its own), there by
        ``until``: per backoff step one listing of each level's directory with children
        still to come, and one read per child (at most ``FAN_IN - 1`` a level)."""
        pending = {level: tree.children(rank, level) for level in range(1, top + 1)}
        pending = {level: kids for level, kids in pending.items() if kids}
        got: dict[int, bytes] = {}
        where = f"{self.address} ({prefix})"
        for _ in backoff(until, self.first_s, self.cap_s) if pending else ():
            for level, kids in list(pending.items()):
                folder = tree.folder(rank, level)
                for name in self._list(f"{prefix}/{folder}"):
                    child = tree.child_of(name, level)
                    if child not in kids:
                        continue
                    blob = self.get(f"{prefix}/{folder}/{name}")
                    if blob is None:
                        continue
                    kids.discard(child)
                    if level == 1:
                        got[child] = blob
                    else:
                        group = read_frames(blob, tree.world, where)
                        tree.check_group(child, level - 1, group, where)
                        _merge_new(got, group, where)
                if not kids:
                    del pending[level]
            if not pending:
                break
        return got


#: children of a node in the gathering tree of a polling medium: a rank reads at most
#: FAN_IN - 1 records per level, and a round of W ranks has ceil(log_FAN_IN(W)) levels
FAN_IN = 32


class _Tree:
    """The gathering tree of a round of ``world`` ranks over a medium without server-side
    aggregation. Rank ``r`` leads level ``l`` when ``r % FAN_IN**l == 0``; its children
    there are ``r + j * FAN_IN**(l-1)`` for ``j = 1 .. FAN_IN-1`` (those below ``world``).
    Each rank writes its own record under ``n1-<its level-1 leader>/rank-<r>``; a leader
    of levels ``1..L`` (L < height) writes the records of its whole subtree, its own
    included, as one group under ``n<L+1>-<its level-(L+1) leader>/group-<r>``. Rank 0
    leads every level up to ``height``, so it reads at most ``FAN_IN - 1`` records per
    level and one directory of at most ``FAN_IN`` names per level and backoff step."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.height = 1
        while FAN_IN ** self.height < world:
            self.height += 1

    def top_level(self, rank: int) -> int:
        """The highest level ``rank`` leads (0: a leaf); rank 0 leads them all."""
        if rank == 0:
            return self.height
        level = 0
        while level + 1 < self.height and rank % FAN_IN ** (level + 1) == 0:
            level += 1
        return level

    def leader(self, rank: int, level: int) -> int:
        return rank - rank % FAN_IN ** level

    def folder(self, rank: int, level: int) -> str:
        return f"n{level}-{self.leader(rank, level)}"

    def record_key(self, rank: int) -> str:
        return f"{self.folder(rank, 1)}/rank-{rank}"

    def group_key(self, rank: int, level: int) -> str:
        return f"{self.folder(rank, level + 1)}/group-{rank}"

    def children(self, rank: int, level: int) -> set[int]:
        step = FAN_IN ** (level - 1)
        return {rank + j * step for j in range(1, FAN_IN) if rank + j * step < self.world}

    def check_group(self, leader: int, level: int, group: dict, where: str) -> None:
        """A group a leader of ``level`` published holds only ranks of its own subtree."""
        outside = [r for r in group if not leader <= r < leader + FAN_IN ** level]
        if outside:
            raise CheckpointError(f"submissions at {where}: the group of rank {leader} "
                                  f"holds rank(s) {outside[:5]} outside its subtree")

    @staticmethod
    def child_of(name: str, level: int) -> int | None:
        match = (_RANK_FILE if level == 1 else _GROUP_FILE).fullmatch(name)
        return int(match.group(1)) if match else None


_GROUP_FILE = re.compile(r"group-([0-9]{1,9})")
_FRAME = struct.Struct("<II")  # rank, length of the record that follows


def pack_frames(records: dict[int, bytes]) -> bytes:
    """``{rank: record}`` as one value: frames of :data:`_FRAME` and the record."""
    return b"".join(_FRAME.pack(rank, len(blob)) + blob for rank, blob in records.items())


def read_frames(data: bytes, world: int, where: str) -> dict[int, bytes]:
    """The ``{rank: record}`` of a value of frames (:func:`pack_frames`): a torn frame, a
    rank outside ``1 .. world-1`` or a rank twice is a :class:`CheckpointError`."""
    out: dict[int, bytes] = {}
    view, at = memoryview(data), 0
    while at < len(view):
        if at + _FRAME.size > len(view):
            raise CheckpointError(f"submissions at {where}: a torn frame at byte {at}")
        rank, size = _FRAME.unpack_from(view, at)
        at += _FRAME.size
        if not 0 < rank < world or at + size > len(view):
            raise CheckpointError(f"submissions at {where}: a frame of rank {rank} and "
                                  f"{size} bytes at byte {at} does not fit a round of "
                                  f"{world} ranks")
        _merge_new(out, {rank: bytes(view[at:at + size])}, where)
        at += size
    return out


def _merge_new(into: dict[int, bytes], records: dict[int, bytes], where: str) -> None:
    for rank, blob in records.items():
        if rank in into:
            raise CheckpointError(
                f"submissions at {where}: rank {rank} submitted twice; another launch with "
                "the same run_id takes part in this round: give concurrent jobs distinct "
                "run_ids")
        into[rank] = blob


class DirMedium(_PollingMedium):
    """Records as files under a local (or network-mounted) directory; atomic by
    write-to-temp, fsync, rename."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.address = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoint record {path}: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint record {path}: {exc}") from exc

    def _list(self, prefix: str) -> list[str]:
        path = self._path(prefix)
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(f"cannot list checkpoint records in {path}: {exc}") from exc

    def _readers(self, key: str, rank: int) -> int:
        """Link the record ``key`` as read by ``rank``; its number of links after that."""
        path = self._path(key)
        os.link(path, f"{path}.read-{rank}")
        return os.stat(path).st_nlink

    def tidy(self, base: str, tokens: list[str], rank: int, world: int,
             until: float) -> None:
        try:
            links = self._readers(f"{base}/{tokens[0]}/merged", rank)
        except OSError:  # no hard links here: rank 0 removes the round at the next one
            log.debug("checkpoint exchange: cannot count the readers of %s/%s", self.root,
                      base, exc_info=True)
            return
        if links >= world + 1:  # the record and one link per rank: everyone has read
            self.remove(base)

    def remove(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def close(self) -> None:
        return None


class FsspecMedium(_PollingMedium):
    """Records as objects under an fsspec URL (``s3://bucket/path``, ``gs://...``,
    ``memory://...``). An object store's PUT is atomic. Reads never use a cached
    listing (:func:`_uncached_fs`, :meth:`_fresh`). Every call runs on a helper
    thread and is abandoned at the exchange deadline, so a server that stops
    answering is an error by then, not a hang. An object store cannot count a round's
    readers: rank 0 removes each round at the next one."""

    first_s, cap_s = 0.05, 2.0

    def __init__(self, url: str, run_id: str, deadline: float) -> None:
        try:
            import fsspec
        except ImportError:
            raise ZephonConfigError(
                f"aggregate_dir={url!r} is a URL: it needs fsspec "
                f"(python -m pip install -e \".[{_extra(url)}]\" in the zephon checkout)") from None
        try:
            fs, root = _uncached_fs(fsspec, url)
        except ImportError as exc:
            raise ZephonConfigError(
                f"aggregate_dir={url!r}: {exc} (python -m pip install -e \".[{_extra(url)}]\" in the zephon checkout)") from None
        except Exception as exc:  # noqa: BLE001 - a bad URL, bad credentials, ...
            raise ZephonConfigError(f"aggregate_dir={url!r} cannot be opened: "
                                    f"{type(exc).__name__}: {exc}") from None
        self.fs, self.url, self.deadline = fs, url, deadline
        self.root = root.rstrip("/") + "/" + run_id
        self.address = url.rstrip("/") + "/" + run_id
        if getattr(fs, "protocol", None) in ("memory",) or \
                (isinstance(fs.protocol, tuple) and "memory" in fs.protocol):
            self.first_s, self.cap_s = 0.002, 0.5

    def _call(self, what: str, key: str, fn, *args):
        # A daemon thread per call: one that never returns is abandoned at the deadline
        # and cannot keep the interpreter from exiting.
        box: list = []
        done = threading.Event()

        def run():
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()

        threading.Thread(target=run, name="zephon-agg-io", daemon=True).start()
        if not done.wait(max(self.deadline - time.monotonic(), 0.01)):
            raise AggregationTimeoutError(
                f"checkpoint exchange: {what} {self.address}/{key} did not return before the "
                "aggregate_timeout_s deadline (the storage server does not answer)")
        ok, value = box[0]
        if ok:
            return value
        if isinstance(value, FileNotFoundError) and what == "reading":
            raise value  # not there (yet): the caller polls
        raise CheckpointError(
            f"checkpoint exchange: {what} {self.address}/{key} failed: "
            f"{type(value).__name__}: {value}; nothing was merged") from value

    def put(self, key: str, data: bytes) -> None:
        path = f"{self.root}/{key}"
        self._call("writing", key, self.fs.pipe_file, path, data)

    def get(self, key: str) -> bytes | None:
        path = f"{self.root}/{key}"
        try:
            return self._call("reading", key, self._fresh, self.fs.cat_file, path)
        except FileNotFoundError:
            return None

    def _list(self, prefix: str) -> list[str]:
        path = f"{self.root}/{prefix}"
        try:
            names = self._call("reading", prefix, self._fresh, self.fs.ls, path, False)
        except FileNotFoundError:
            return []
        return [str(name).rstrip("/").rsplit("/", 1)[-1] for name in names]

    def _fresh(self, fn, path: str, *args):
        """``fn(path, *args)`` against the store's current state: whatever listing of
        ``path`` or of a folder above it the filesystem still holds is dropped first (an
        s3fs/gcsfs listing cached by an earlier read hides records that other ranks
        wrote since, and makes reading them a FileNotFoundError)."""
        self.fs.invalidate_cache(path)
        return fn(path, *args)

    def tidy(self, base: str, tokens: list[str], rank: int, world: int,
             until: float) -> None:
        return None  # rank 0 removes the round at the next one

    def remove(self, prefix: str) -> None:
        path = f"{self.root}/{prefix}"
        try:
            self._call("removing", prefix, self.fs.rm, path, True)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        return None


def _uncached_fs(fsspec, url: str):
    """The filesystem and root path of ``url``, opened so that it keeps no directory
    listings (``use_listings_cache=False``: s3fs, gcsfs and every filesystem built on
    fsspec's listings cache). Its options differ from a default instance's, so this is
    a filesystem instance of its own, not the one the user's code may share. A
    filesystem whose constructor takes no such option is opened as it is; the medium
    drops its listings before every read either way (:meth:`FsspecMedium._fresh`)."""
    try:
        return fsspec.core.url_to_fs(url, use_listings_cache=False)
    except TypeError:
        return fsspec.core.url_to_fs(url)


def _extra(url: str) -> str:
    match = _SCHEME.match(url)
    return _EXTRA_OF.get(match.group(1).lower(), "cloud") if match else "cloud"


def open_medium(opts, timeout_s: float):
    """The medium of ``opts`` (aggregate_dir or aggregate_store), its operations bounded
    by ``timeout_s`` from now."""
    deadline = time.monotonic() + timeout_s
    if opts.aggregate_store is not None:
        from zephon.checkpoint.store import StoreMedium

        return StoreMedium.open(opts.aggregate_store, run_id=opts.run_id,
                                rank=opts.global_rank, world=opts.world_size,
                                deadline=deadline)
    path = opts.aggregate_dir
    match = _SCHEME.match(path)
    if match is None:
        return DirMedium(os.path.join(path, opts.run_id))
    if match.group(1).lower() == "file":
        return DirMedium(os.path.join(path[len("file://"):], opts.run_id))
    return FsspecMedium(path, opts.run_id, deadline)
