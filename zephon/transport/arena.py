"""Shared-memory slabs, the per-worker arena allocator, and leases.

Ownership and lifecycle
-----------------------
- A **slab** is one shared mapping. On Linux with socketpair channels it is a
  ``memfd`` (anonymous: no name anywhere, freed by the kernel when the last
  mapping and descriptor go, so a SIGKILL of any process leaks nothing); its
  descriptor travels once, with the first message that refers to it. Otherwise
  it is a POSIX segment named ``/zph_<parent pid>_<creator pid>_<nonce>_<n>``
  (hex pids); the receiving side unlinks the name as soon as it has mapped it,
  the creator unlinks its own names at exit, and :func:`sweep_stale_segments`
  removes names whose parent and creator are both dead (Linux lists them in
  /dev/shm; elsewhere names cannot be listed and the sweep does nothing).
- A **slab id** is ``owner << 16 | index``, owner being ``1 + worker index``; a
  **region** is one allocation in a slab, named by its **token**
  ``slab_id << 40 | offset`` (unique while the region is live).
- The :class:`ShmArena` lives in the worker that owns it: it creates slabs on
  demand (pre-faulted with ``MAP_POPULATE``; each at least ``min_slab_bytes``,
  growing geometrically) until ``max_bytes``, then waits for regions to come
  back. Waiting is bounded: a log line every ``wait_log_s`` seconds, and after
  ``wait_timeout_s`` :class:`ArenaFull` (the codec then sends the message
  in-band: never a drop). A message that cannot fit even in an empty arena
  gets a slab of its own beyond the bound (logged) instead of waiting forever.
- A **lease** is the object consumer views are built on: a ``ctypes`` array
  over the region's bytes (it exports the buffer and keeps the mapping open).
  NumPy keeps it as the ``base`` of every view, torch tensors from
  ``torch.from_numpy`` keep those views, so the lease dies exactly when the
  last view does; its finalizer removes it from the :class:`LeaseTable` and
  calls ``release(token)`` (for the parent: queue a FREE message to the owner).

Thread safety: ``ShmArena`` methods take its condition's lock (the worker's
control thread frees while its main thread allocates); ``LeaseTable`` and
``SlabRegistry`` take a lock around their dicts; finalizers only append to a
deque and call the release callback.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import re
import sys
import threading
import time
import weakref
from typing import Callable, Iterable

import numpy as np

from zephon.errors import TransportError

__all__ = [
    "Slab", "ShmArena", "ArenaFull", "SlabRegistry", "LeaseTable", "RegionInfo",
    "memfd_available", "sweep_stale_segments", "slab_owner", "token_of", "token_slab",
    "REGION_ALIGN",
]

log = logging.getLogger("zephon.transport.arena")

REGION_ALIGN = 64
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_NAME_RE = re.compile(r"^zph_([0-9a-f]+)_([0-9a-f]+)_[0-9a-f]+_[0-9a-f]+$")


def memfd_available() -> bool:
    return hasattr(os, "memfd_create") and sys.platform.startswith("linux")


def slab_owner(slab_id: int) -> int:
    return slab_id >> 16


def token_of(slab_id: int, offset: int) -> int:
    return (slab_id << 40) | offset


def token_slab(token: int) -> int:
    return token >> 40


def _align(n: int, a: int = REGION_ALIGN) -> int:
    return (n + a - 1) // a * a


def _address(mm: mmap.mmap) -> int:
    probe = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


class Slab:
    """One shared mapping; ``fd`` is kept (memfd) so it can be passed on to another peer."""

    __slots__ = ("slab_id", "size", "mapping", "fd", "name", "address", "__weakref__")

    def __init__(self, slab_id: int, size: int, mapping: mmap.mmap, fd: int | None,
                 name: str | None) -> None:
        self.slab_id, self.size, self.mapping, self.fd, self.name = slab_id, size, mapping, fd, name
        self.address = _address(mapping)

    @classmethod
    def create(cls, slab_id: int, size: int, kind: str, name: str) -> "Slab":
        if kind == "memfd":
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                mapping = _map(fd, size)
            except BaseException:
                os.close(fd)
                raise
            return cls(slab_id, size, mapping, fd, None)
        import _posixshmem

        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = _map(fd, size)
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        os.close(fd)
        return cls(slab_id, size, mapping, None, name)

    @classmethod
    def attach(cls, slab_id: int, size: int, fd: int | None = None,
               name: str | None = None) -> "Slab":
        """Map a peer's slab: by descriptor (kept) or by name (unlinked once mapped)."""
        if fd is not None:
            return cls(slab_id, size, _map(fd, size), fd, None)
        import _posixshmem

        try:
            named_fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
        except FileNotFoundError as exc:
            raise TransportError(f"shared segment {name} vanished before it was mapped") \
                from exc
        try:
            mapping = _map(named_fd, size)
        finally:
            os.close(named_fd)
        _unlink(name)  # both sides have it mapped now: the name has done its job
        return cls(slab_id, size, mapping, None, None)

    def close(self) -> None:
        """Drop the descriptor and, if no view still exports it, the mapping."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        try:
            self.mapping.close()
        except BufferError:
            pass  # live views keep it mapped; it goes when they do


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _unlink(name: str) -> None:
    import _posixshmem

    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def segment_name(parent_pid: int, creator_pid: int, nonce: str, index: int) -> str:
    return f"zph_{parent_pid:x}_{creator_pid:x}_{nonce}_{index:x}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink zephon segments whose parent and creator processes are both dead."""
    removed = []
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return removed
    for entry in entries:
        match = _NAME_RE.match(entry)
        if not match:
            continue
        parent, creator = (int(g, 16) for g in match.groups())
        if not _pid_alive(parent) and not _pid_alive(creator):
            _unlink(entry)
            removed.append(entry)
    if removed:
        log.info("removed %d stale shared-memory segment(s): %s", len(removed), removed)
    return removed


class ArenaFull(TransportError):
    """No arena space came back within the wait bound."""


class ShmArena:
    """The worker-side allocator over this worker's slabs (see the module docstring)."""

    def __init__(self, owner: int, kind: str, max_bytes: int, *, parent_pid: int,
                 min_slab_bytes: int = 8 << 20, wait_log_s: float = 2.0,
                 wait_timeout_s: float = 60.0, slab_base: int = 0,
                 alive: Callable[[], bool] = lambda: True) -> None:
        if kind not in ("memfd", "named"):
            raise ValueError(f"arena kind must be 'memfd' or 'named', got {kind!r}")
        if not 0 < owner < 256:
            raise ValueError(f"arena owner must be in [1, 255], got {owner}")
        self.owner, self.kind, self.max_bytes = owner, kind, max_bytes
        self.min_slab_bytes = min_slab_bytes
        self.wait_log_s, self.wait_timeout_s, self.alive = wait_log_s, wait_timeout_s, alive
        self.parent_pid = parent_pid
        self.slab_base = slab_base  # a restarted worker's slabs never reuse a dead one's ids
        self._nonce = os.urandom(2).hex()  # (secrets would import hashlib: +3 ms per worker)
        self.slabs: dict[int, Slab] = {}
        self._free: dict[int, list[list[int]]] = {}  # slab_id -> sorted [[offset, size], ...]
        self._live: dict[int, int] = {}  # token -> size
        self.cond = threading.Condition()
        self.total_bytes = 0
        self.waits = 0

    # -- allocation -------------------------------------------------------------------
    def alloc(self, nbytes: int) -> tuple[Slab, int, int]:
        """A region of ``nbytes``: ``(slab, offset, token)``; waits (bounded) when full."""
        need = _align(max(nbytes, 1))
        deadline = time.monotonic() + self.wait_timeout_s
        next_log = time.monotonic() + self.wait_log_s
        with self.cond:
            while True:
                found = self._first_fit(need)
                if found is not None:
                    return found
                if self.total_bytes + need <= self.max_bytes or not self._live:
                    if self.total_bytes + need > self.max_bytes:
                        log.warning("arena %d: a %d-byte message does not fit in the %d-byte "
                                    "bound even when empty; growing past it", self.owner,
                                    need, self.max_bytes)
                    self._grow(need)
                    continue
                now = time.monotonic()
                if now >= deadline:
                    raise ArenaFull(
                        f"arena {self.owner}: no space for {need} bytes after "
                        f"{self.wait_timeout_s:.0f} s ({self.live_regions} regions, "
                        f"{self.live_bytes} bytes held by the consumer)")
                if now >= next_log:
                    log.warning("arena %d: waiting for space (%d bytes needed; %d regions, "
                                "%d bytes held by the consumer)", self.owner, need,
                                self.live_regions, self.live_bytes)
                    next_log = now + self.wait_log_s
                if not self.alive():
                    raise TransportError("the consumer is gone or the worker is stopping")
                self.waits += 1
                self.cond.wait(min(0.25, max(0.0, deadline - now)))

    def _first_fit(self, need: int):
        for slab_id, holes in self._free.items():
            for k, (offset, size) in enumerate(holes):
                if size >= need:
                    if size == need:
                        del holes[k]
                    else:
                        holes[k] = [offset + need, size - need]
                    token = token_of(slab_id, offset)
                    self._live[token] = need
                    return self.slabs[slab_id], offset, token
        return None

    def _grow(self, need: int) -> None:
        index = self.slab_base + len(self.slabs)
        if len(self.slabs) >= 256 or index >= 1 << 16:
            raise TransportError("arena slab index space exhausted")
        size = max(self.min_slab_bytes, _align(need, 1 << 20), min(self.total_bytes,
                                                                   self.max_bytes - self.total_bytes))
        slab_id = (self.owner << 16) | index
        name = segment_name(self.parent_pid, os.getpid(), self._nonce, index)
        slab = Slab.create(slab_id, size, self.kind, name)
        self.slabs[slab_id] = slab
        self._free[slab_id] = [[0, size]]
        self.total_bytes += size
        log.debug("arena %d: new %s slab %d of %d bytes", self.owner, self.kind, index, size)

    def free(self, tokens: Iterable[int]) -> None:
        with self.cond:
            for token in tokens:
                size = self._live.pop(token, None)
                if size is None:
                    log.warning("arena %d: free of unknown region %#x ignored", self.owner, token)
                    continue
                holes = self._free[token_slab(token)]
                offset = token & ((1 << 40) - 1)
                k = bisect.bisect_left(holes, [offset, 0])
                holes.insert(k, [offset, size])
                # coalesce with the next and the previous hole
                if k + 1 < len(holes) and holes[k][0] + holes[k][1] == holes[k + 1][0]:
                    holes[k][1] += holes.pop(k + 1)[1]
                if k > 0 and holes[k - 1][0] + holes[k - 1][1] == holes[k][0]:
                    holes[k - 1][1] += holes.pop(k)[1]
            self.cond.notify_all()

    @property
    def live_regions(self) -> int:
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        return sum(self._live.values())

    def close(self) -> None:
        for slab in self.slabs.values():
            if slab.name:
                _unlink(slab.name)
            slab.close()


class RegionInfo:
    __slots__ = ("token", "slab", "offset", "nbytes")

    def __init__(self, token: int, slab: Slab, offset: int, nbytes: int) -> None:
        self.token, self.slab, self.offset, self.nbytes = token, slab, offset, nbytes


class SlabRegistry:
    """The slabs this process has mapped, its own and its peers'."""

    def __init__(self) -> None:
        self._slabs: dict[int, Slab] = {}
        self._lock = threading.Lock()

    def add(self, slab: Slab) -> None:
        with self._lock:
            self._slabs[slab.slab_id] = slab

    def get(self, slab_id: int) -> Slab | None:
        return self._slabs.get(slab_id)

    def __contains__(self, slab_id: int) -> bool:
        return slab_id in self._slabs

    def drop_owner(self, owner: int) -> int:
        """Forget (and close where no view remains) every slab of ``owner``."""
        with self._lock:
            gone = [s for sid, s in self._slabs.items() if slab_owner(sid) == owner]
            for slab in gone:
                del self._slabs[slab.slab_id]
        for slab in gone:
            slab.close()
        return len(gone)

    def close_all(self) -> None:
        with self._lock:
            slabs, self._slabs = list(self._slabs.values()), {}
        for slab in slabs:
            slab.close()


class LeaseTable:
    """Live leases of this process, by token and by lease object."""

    def __init__(self) -> None:
        self._by_token: dict[int, weakref.ref] = {}
        self._info: dict[int, RegionInfo] = {}  # id(lease) -> region
        self._lock = threading.Lock()

    def lease(self, info: RegionInfo, release: Callable[[int], None] | None):
        """The lease of a region: the existing one if alive, else a new one."""
        with self._lock:
            ref = self._by_token.get(info.token)
            lease = ref() if ref is not None else None
            if lease is not None:
                return lease
            lease = (ctypes.c_char * info.nbytes).from_buffer(info.slab.mapping, info.offset)
            self._by_token[info.token] = weakref.ref(lease)
            self._info[id(lease)] = info
        finalizer = weakref.finalize(lease, self._forget, info.token, id(lease), release)
        finalizer.atexit = False
        return lease

    def get(self, token: int):
        ref = self._by_token.get(token)
        return ref() if ref is not None else None

    def _forget(self, token: int, lease_id: int, release) -> None:
        with self._lock:
            self._info.pop(lease_id, None)
            ref = self._by_token.get(token)
            if ref is not None and ref() is None:
                del self._by_token[token]
        if release is not None:
            release(token)

    def locate(self, array: np.ndarray) -> tuple[RegionInfo, object] | None:
        """``(region, lease)`` when ``array`` is a view of a leased region, else None."""
        base = array.base
        while isinstance(base, np.ndarray):
            base = base.base
        if base is None:
            return None
        info = self._info.get(id(base))
        if info is None:
            return None
        return info, base

    def __len__(self) -> int:
        return len(self._info)
