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
  /dev/shm; elsewhere names cannot be listed and the sweep does nothing);
  :func:`sweep_segments_of` removes the names of given workers of this run (a
  pool's ``close()`` for all of its workers, ``get()`` for a worker killed by a
  signal, which could not unlink its own).
- A **slab id** names one slab of one owner (``1 + worker index``; indices of
  unmapped dedicated slabs are reused); a **region** is one allocation in a
  slab, named by its **token** (unique while the region is live). Their bit
  layout belongs to :mod:`zephon.transport.tokens` alone.
- Every slab's space is reserved when it is created (``posix_fallocate`` after
  ``ftruncate``, memfd included), so a full ``/dev/shm`` (Docker's 64 MB
  default) is an error at creation, :class:`ShmSpaceError` naming the
  directory and its size, never a SIGBUS on a later write. The codec answers
  it by sending that message in-band (and the pool warns once).
- The :class:`ShmArena` lives in the worker that owns it: it creates slabs on
  demand (pre-faulted with ``MAP_POPULATE``; each at least ``min_slab_bytes``,
  doubling the arena while it is small, then adding at most 32 MiB a slab, or room
  for four regions of a request larger than 8 MiB; a request of 8 MiB or more, where
  the bound holds eight of them, gets a slab of its own size class instead, at most an
  eighth over it, so that the arena holds as many such regions as were live at once;
  large regions take the smallest hole that fits)
  until ``max_bytes``, the bound,
  which the recycled slabs never pass (:mod:`zephon.transport.budget` splits it
  into parts). All the regions of one message
  are allocated at once or not at all (:meth:`ShmArena.alloc_many`), so a
  message never waits for space it holds itself.
- Messages hold at most ``message_bytes`` (the bound less the shared heap's
  part). A message larger than that (or one that does not fit an arena with no
  live region) gets a **dedicated slab**, outside the bound, sized for it;
  when its regions come back the slab is unmapped and its memory returned
  (the receiver maps it for that message only and never forwards it).
- When the bound is reached and the regions are held by the consumer, the
  arena waits once, at most ``wait_timeout_s`` (1 s by default), for a region
  to come back, then enters the **starved** state: :class:`ArenaFull` at once
  for every message (the codec sends it in-band: never a drop, never a long
  stall) until some region comes back. The pool turns that into one warning.
- The worker's shared heap (:mod:`zephon.transport.heap`) **takes** regions for
  NumPy arrays its ops make (:meth:`ShmArena.take`: never waits, never grows
  past the bound, holds at most its part of it in regions not sent) and
  gives them back when NumPy frees them (:meth:`ShmArena.give`, from any
  deallocation: only queued, drained under the lock). Such a region sent by
  reference (:meth:`ShmArena.mark_sent`) is reused once both the worker has
  given it and the consumer has freed it, in either order.
- A message that is never sent (its encoding or its send failed) gives its
  regions back with :meth:`ShmArena.abort` (the encoder's
  :meth:`~zephon.transport.codec.Encoder.abort`): recycled, or a heap region
  the worker's again, and the arena's accounting is what it was before the
  message; only the consumer's frees end starvation.
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
import collections
import ctypes
import errno
import importlib
import logging
import mmap
import os
import re
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import numpy as np

from zephon.errors import ArenaFull, ShmSpaceError, TransportError, ZephonConfigError
from zephon.transport.budget import SLABS_PER_GENERATION, split_arena
from zephon.transport.tokens import (
    SLAB_INDICES,
    check_owner,
    pack_slab_id,
    region_token,
    slab_index,
    slab_owner,
    token_offset,
    token_slab,
)

__all__ = [
    "ARENA_KINDS",
    "DEFAULT_WAIT_TIMEOUT_S",
    "MEMFD",
    "NAMED",
    "REGION_ALIGN",
    "SEGMENT_PREFIX",
    "ArenaFull",
    "LeaseTable",
    "RegionInfo",
    "ShmArena",
    "ShmSpaceError",
    "Slab",
    "SlabRegistry",
    "memfd_available",
    "sweep_segments_of",
    "sweep_stale_segments",
]

log = logging.getLogger("zephon.transport.arena")

REGION_ALIGN = 64
# Arena kinds: anonymous memfd slabs (descriptors travel over socketpairs) or named POSIX
# segments (any channel).
MEMFD = "memfd"
NAMED = "named"
ARENA_KINDS = (MEMFD, NAMED)
DEFAULT_WAIT_TIMEOUT_S = 1.0  # the one wait for a region to come back before starving
_WAIT_SLICE_S = 0.25  # re-check the consumer's liveness at least this often while waiting
DEFAULT_MIN_SLAB_BYTES = 8 << 20
_GROW_GRANULE_BYTES = 1 << 20  # a recycled slab's size is rounded up to this
_GROW_STEP_BYTES = 32 << 20  # the most a recycled slab grows the arena by (unless needed)
_LARGE_NEED_BYTES = 8 << 20  # from here a new slab is sized for the need alone (_size_class)
_LARGE_NEEDS_IN_BOUND = 8  # ... where the bound holds at least this many such needs
# posix_fallocate errors that mean "no space" (an answer: in-band) and those that mean
# "this filesystem cannot preallocate" (space is then reserved by the first write).
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)
_NO_FALLOCATE_ERRNOS = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENODEV)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: How every name zephon gives a shared-memory segment (and a memfd) starts.
SEGMENT_PREFIX = "zph_"
_NAME_RE = re.compile(rf"^{SEGMENT_PREFIX}([0-9a-f]+)_([0-9a-f]+)_[0-9a-f]+_[0-9a-f]+$")


def memfd_available() -> bool:
    return hasattr(os, "memfd_create") and sys.platform.startswith("linux")


def _size_class(need: int) -> int:
    """``need`` rounded up to its size class: eight classes per power of two, on a
    1 MiB grain (so at most an eighth over, and 1 MiB while that is more)."""
    step = 1 << max(need.bit_length() - 4, 20)
    return -(-need // step) * step


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

    __slots__ = (
        "__weakref__",
        "address",
        "dedicated",
        "fd",
        "keep_mapped",
        "mapping",
        "name",
        "size",
        "slab_id",
    )

    def __init__(self, slab_id: int, size: int, mapping: mmap.mmap, fd: int | None,
                 name: str | None, dedicated: bool = False) -> None:
        self.slab_id, self.size, self.mapping, self.fd, self.name = slab_id, size, mapping, fd, name
        self.address = _address(mapping)
        self.dedicated = dedicated  # one message's slab: never forwarded, unmapped after use
        # NumPy arrays of the worker's shared heap point into it without holding the
        # mapping: it stays mapped until the process exits (close() only drops the fd)
        self.keep_mapped = False

    @classmethod
    def create(cls, slab_id: int, size: int, kind: str, name: str,
               dedicated: bool = False) -> "Slab":
        """A new slab; its space is reserved first (:class:`ShmSpaceError` when there is
        none), so writing to it can never fault."""
        if kind == MEMFD:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                _reserve(fd, size, kind)
                mapping = _map(fd, size)
            except BaseException:
                os.close(fd)
                raise
            return cls(slab_id, size, mapping, fd, None, dedicated)
        fd = _posix_shm().shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size, kind)
            mapping = _map(fd, size)
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        os.close(fd)
        return cls(slab_id, size, mapping, None, name, dedicated)

    @classmethod
    def attach(cls, slab_id: int, size: int, fd: int | None = None,
               name: str | None = None) -> "Slab":
        """Map a peer's slab: by descriptor (kept) or by name (unlinked once mapped)."""
        if fd is not None:
            return cls(slab_id, size, _map(fd, size), fd, None)
        if name is None:
            raise ZephonConfigError(f"slab {slab_id:#x}: attach needs a descriptor or a name, "
                                    "got neither", field="name")
        try:
            named_fd = _posix_shm().shm_open("/" + name, os.O_RDWR, 0o600)
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
        """Drop the descriptor and, if no view still exports it (and no heap array may
        still point into it: ``keep_mapped``), the mapping."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        if self.keep_mapped:
            return
        try:
            self.mapping.close()
        except BufferError:
            pass  # live views keep it mapped; it goes when they do


SHM_DIR = "/dev/shm"


def shm_space_message(size: int, kind: str, shm_dir: str = SHM_DIR) -> str:
    """Why a ``size``-byte segment of ``kind`` could not be created, with the fix."""
    if kind == MEMFD:
        return (f"no memory for a {size}-byte memfd shared segment (anonymous shared memory "
                "is charged to RAM and to the cgroup's memory limit)")
    try:
        st = os.statvfs(shm_dir)
        where = (f"{shm_dir} is {st.f_blocks * st.f_frsize} bytes with "
                 f"{st.f_bavail * st.f_frsize} free")
    except OSError:
        where = f"{shm_dir} cannot be inspected"
    return (f"no space in {shm_dir} for a {size}-byte shared segment: {where} (Docker's "
            "default is 64 MB: run the container with a larger --shm-size, or use "
            "ipc_transport='socketpair', whose memfd segments do not live in /dev/shm)")


def _reserve(fd: int, size: int, kind: str) -> None:
    """Allocate the segment's pages now: ENOSPC here instead of SIGBUS on a write."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in _NO_SPACE_ERRNOS:
            raise ShmSpaceError(shm_space_message(size, kind)) from exc
        if exc.errno not in _NO_FALLOCATE_ERRNOS:
            raise
    except AttributeError:  # no posix_fallocate on this platform
        pass


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _posix_shm() -> Any:
    """CPython's ``_posixshmem`` (shm_open/shm_unlink; it ships no type stubs), imported
    on first use: memfd arenas never need it."""
    return importlib.import_module("_posixshmem")


def _unlink(name: str) -> None:
    try:
        _posix_shm().shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def segment_name(parent_pid: int, creator_pid: int, nonce: str, index: int) -> str:
    return f"{SEGMENT_PREFIX}{parent_pid:x}_{creator_pid:x}_{nonce}_{index:x}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(shm_dir: str, doomed) -> list[str]:
    """Unlink every zephon segment name in ``shm_dir`` for which ``doomed(parent pid,
    creator pid)`` is true; returns the names removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return removed
    for entry in entries:
        match = _NAME_RE.match(entry)
        if match and doomed(*(int(g, 16) for g in match.groups())):
            _unlink(entry)
            removed.append(entry)
    return removed


def sweep_segments_of(parent_pid: int, creator_pids: Iterable[int],
                      shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segment names of run ``parent_pid`` created by any of ``creator_pids``:
    a pool's ``close()`` sweeps those of its workers, and the parent sweeps the names of
    a worker that died by a signal (it could not unlink them). Processes that mapped a
    segment keep their mapping; only the name goes."""
    creators = set(creator_pids)
    removed = _sweep(shm_dir, lambda parent, creator: parent == parent_pid
                     and creator in creators)
    if removed:
        log.debug("removed %d shared-memory segment name(s): %s", len(removed), removed)
    return removed


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink zephon segments whose parent and creator processes are both dead."""
    removed = _sweep(shm_dir, lambda parent, creator: not _pid_alive(parent)
                     and not _pid_alive(creator))
    if removed:
        log.info("removed %d stale shared-memory segment(s): %s", len(removed), removed)
    return removed


_HELD, _SENT = 1, 2  # a shared-heap region's holders: the worker's NumPy, the consumer


class ShmArena:
    """The worker-side allocator over this worker's slabs (see the module docstring).

    Args:
        owner: 1 + worker index, in ``[1, MAX_OWNER]`` (the owner field of every slab id
            and region token, see :mod:`zephon.transport.tokens`).
        kind: ``"memfd"`` or ``"named"``.
        max_bytes: the bound of the recycled slabs (dedicated slabs are outside it);
            messages hold at most ``message_bytes`` of it, the rest is the shared heap's
            (``heap_bytes``, see :mod:`zephon.transport.budget`).
        wait_timeout_s: the one wait for a region to come back before starving.
        on_release: called with the slab id of a dedicated slab once it is unmapped (the
            encoder forgets that its peer has it mapped).
    """

    def __init__(self, owner: int, kind: str, max_bytes: int, *, parent_pid: int,
                 min_slab_bytes: int = DEFAULT_MIN_SLAB_BYTES,
                 wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
                 slab_base: int = 0, alive: Callable[[], bool] = lambda: True,
                 on_release: Callable[[int], None] | None = None) -> None:
        if kind not in ARENA_KINDS:
            raise ZephonConfigError(f"arena kind must be one of {ARENA_KINDS}, got {kind!r}",
                                    field="kind")
        check_owner(owner)
        self.owner, self.kind, self.max_bytes = owner, kind, max_bytes
        budget = split_arena(max_bytes)
        self.heap_bytes, self.message_bytes = budget.heap_bytes, budget.message_bytes
        self.min_slab_bytes = min_slab_bytes
        self.wait_timeout_s, self.alive = wait_timeout_s, alive
        self.on_release = on_release
        self.parent_pid = parent_pid
        self.slab_base = slab_base  # a restarted worker's slabs never reuse a dead one's ids
        self._nonce = os.urandom(2).hex()  # (secrets would import hashlib: +3 ms per worker)
        self.slabs: dict[int, Slab] = {}
        self._free: dict[int, list[list[int]]] = {}  # slab_id -> sorted [[offset, size], ...]
        self._large: set[int] = set()  # recycled slabs grown for one large need each
        self._live: dict[int, int] = {}  # token -> size (regions of recycled slabs)
        self._dedicated: dict[int, set[int]] = {}  # dedicated slab id -> its live tokens
        self.cond = threading.Condition()
        # The shared heap's regions: token -> _HELD | _SENT (see take/give/mark_sent).
        self._heap: dict[int, int] = {}
        self._held_bytes = 0  # heap regions held by the worker and not sent
        self._gives: collections.deque[int] = collections.deque()
        self.total_bytes = 0  # recycled slabs only
        self.dedicated_bytes = 0
        self.waits = 0
        self.starved = False

    # -- allocation -------------------------------------------------------------------
    def alloc(self, nbytes: int) -> tuple[Slab, int, int]:
        """One region of ``nbytes``: ``(slab, offset, token)`` (see :meth:`alloc_many`)."""
        return self.alloc_many([nbytes])[0]

    def alloc_many(self, sizes: list[int]) -> list[tuple[Slab, int, int]]:
        """Regions for every size in ``sizes``, all at once or none: ``[(slab, offset,
        token)]``. Grows within the bound; a request larger than ``message_bytes`` (or
        that does not fit an arena holding no live region) gets a dedicated slab. Otherwise waits once, at
        most ``wait_timeout_s``, for regions to come back, then raises :class:`ArenaFull`
        and stays starved (raising at once) until one does."""
        needs = [_align(max(int(n), 1)) for n in sizes]
        total = sum(needs)
        deadline: float | None = None
        with self.cond:
            if total > self.message_bytes:
                return self._alloc_dedicated(needs)
            while True:
                self._drain_gives()
                # Messages hold at most message_bytes (the heap's unsent arrays have the
                # rest of the bound: see take), whatever the slabs' free space.
                if self.consumer_bytes + total <= self.message_bytes:
                    got, missing = self._fit_all(needs)
                    if got is not None:
                        return got
                    if self.total_bytes + missing <= self.max_bytes:
                        self._grow(missing)
                        continue
                if len(self._live) == self._held_only():
                    # nothing the consumer holds will come back: the bound is fragmented
                    # (or taken by arrays the worker keeps)
                    return self._alloc_dedicated(needs)
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.wait_timeout_s
                if self.starved or now >= deadline:
                    self.starved = True
                    raise ArenaFull(
                        f"arena {self.owner}: no space for {total} bytes; {self.live_regions} "
                        f"region(s), {self.consumer_bytes} bytes held by the consumer (bound "
                        f"{self.max_bytes} bytes, {self.message_bytes} for messages)",
                        self.consumer_bytes, self.max_bytes)
                if not self.alive():
                    raise TransportError("the consumer is gone or the worker is stopping")
                self.waits += 1
                self.cond.wait(min(_WAIT_SLICE_S, max(0.0, deadline - now)))

    # -- the shared heap (zephon.transport.heap) ------------------------------------------
    def take(self, nbytes: int, held_limit: int) -> tuple[Slab, int, int] | None:
        """A region for a NumPy array of the worker, or None (use malloc) when it would
        mean waiting, growing past the bound, or holding more than ``held_limit`` bytes
        in regions not sent."""
        need = _align(max(int(nbytes), 1))
        if self.cond._is_owned():  # type: ignore[attr-defined]
            # A deallocation (garbage collection) inside one of this arena's own methods
            # on this thread allocated: the free lists are mid-update. NumPy gets malloc.
            return None
        with self.cond:
            self._drain_gives()
            if self._held_bytes + need > held_limit:
                return None
            found = self._fit(need)
            if found is None:
                # the heap's part is inside the bound: the slabs never exceed it
                if self.total_bytes + need > self.max_bytes:
                    return None
                try:
                    self._grow(need)
                except (ArenaFull, ShmSpaceError):
                    return None
                found = self._fit(need)
                if found is None:
                    return None
            self._heap[found[2]] = _HELD
            self._held_bytes += need
            return found

    def give(self, token: int) -> None:
        """The worker's NumPy freed the array of heap region ``token`` (queued only: this
        runs inside deallocations; drained under the lock)."""
        self._gives.append(token)

    def mark_sent(self, token: int) -> bool:
        """Heap region ``token`` goes to the consumer by reference; False if it is not a
        heap region held by the worker, was sent already, or would take what messages
        hold past ``message_bytes``."""
        with self.cond:
            state = self._heap.get(token)
            if state != _HELD:
                return False
            if self.consumer_bytes + self._live[token] > self.message_bytes:
                return False  # messages hold their room already: copied (or in-band)
            self._heap[token] = _HELD | _SENT
            self._held_bytes -= self._live[token]
            return True

    def _drain_gives(self) -> None:
        gives = self._gives
        recycle = []
        while gives:
            token = gives.popleft()
            state = self._heap.get(token)
            if state is None:
                continue
            if state == _HELD:
                self._held_bytes -= self._live[token]
            if state & _SENT:
                self._heap[token] = _SENT  # the consumer's until it frees it
            else:
                del self._heap[token]
                recycle.append(token)
        if recycle:
            # (starvation is about what the consumer holds: only its frees end it; the
            # worker's own temporaries come and go with every task)
            self._release(recycle)
            self.cond.notify_all()

    def _held_only(self) -> int:
        """Live regions that only the worker holds (heap regions not sent)."""
        return sum(1 for state in self._heap.values() if state == _HELD)

    def _fit_all(self, needs: list[int]):
        """``(regions, 0)`` if every need fits the free holes, else ``(None, bytes that did
        not fit)`` with nothing taken."""
        got, missing = [], 0
        for need in needs:
            found = self._fit(need)
            if found is None:
                missing += need
            else:
                got.append(found)
        if missing:
            self._release([token for _, _, token in got])
            return None, missing
        return got, 0

    def _fit(self, need: int):
        """A free hole that holds ``need``, looking first in the slabs grown for needs of
        its kind (large: :data:`_LARGE_NEED_BYTES` or more, or small), then in the
        others: a small region does not take the room a large one's slab was made for
        while a small slab has a hole for it. A small need takes the first hole (a
        sample's temporary freed before the next one is made gets the same, cache-warm,
        region back); a large one the smallest (best fit: it leaves the larger holes to
        larger regions)."""
        large = need >= _LARGE_NEED_BYTES
        for same_kind in (True, False):
            best = None
            for slab_id, holes in self._free.items():
                if (slab_id in self._large) != (large if same_kind else not large):
                    continue
                for k, (_, size) in enumerate(holes):
                    if size >= need and (best is None or size < best[3]):
                        best = (slab_id, holes, k, size)
                        if not large or size == need:
                            break  # small: the first hole; large: an exact one ends it
                if best is not None and (not large or best[3] == need):
                    break
            if best is not None:
                slab_id, holes, k, size = best
                offset = holes[k][0]
                if size == need:
                    del holes[k]
                else:
                    holes[k] = [offset + need, size - need]
                token = region_token(slab_id, offset)
                self._live[token] = need
                return self.slabs[slab_id], offset, token
        return None

    def _new_slab(self, size: int, dedicated: bool) -> Slab:
        used = {slab_index(sid) for sid in self.slabs}
        index = next((i for i in range(self.slab_base, self.slab_base + SLABS_PER_GENERATION)
                      if i not in used), None)
        if index is None or index >= SLAB_INDICES:
            raise ArenaFull(  # the codec sends in-band until the consumer drops some
                f"arena {self.owner}: all {SLABS_PER_GENERATION} slab indices are in use (the "
                "consumer holds results of too many distinct large messages)",
                self.live_bytes + self.dedicated_bytes, self.max_bytes)
        sid = pack_slab_id(self.owner, index)
        name = segment_name(self.parent_pid, os.getpid(), self._nonce, index)
        slab = Slab.create(sid, size, self.kind, name, dedicated=dedicated)
        self.slabs[sid] = slab
        log.debug("arena %d: new %s%s slab %d of %d bytes", self.owner, self.kind,
                  " dedicated" if dedicated else "", index, size)
        return slab

    def _grow(self, need: int) -> None:
        room = self.max_bytes - self.total_bytes
        large = _LARGE_NEED_BYTES <= need and need * _LARGE_NEEDS_IN_BOUND <= self.max_bytes
        if large:
            # A large need gets a slab of its size class alone. Doubling (even bounded to
            # room for four such regions) paid for regions never live at once: two image
            # workers with at most three 37 MiB batches out each grew to 244 MiB apiece,
            # room for five, under doubling. A new slab's pages are zeroed and resident
            # from its creation (MAP_POPULATE), so every byte of room costs memory. The
            # class (8 per power of two) lets a slightly larger region of the same kind
            # reuse the slab; large regions take the smallest hole that fits, small ones
            # look in the small slabs first. Only where the bound holds eight such needs:
            # under a tight bound, slabs of exactly their size left a later, larger region
            # no hole to take and no room to grow (a review's 30/24/16/30 MiB sequence
            # under an 80 MiB bound starved), where doubling's larger slabs had room.
            size = max(need, min(_size_class(need), room))
        else:
            # doubling, but by at most _GROW_STEP_BYTES (or room for 4 regions of this
            # size) at a time: a new slab's pages are zeroed when it is created (about 1
            # ms per MiB here, all of it a stall of the op that needed the space), so a
            # 128 MiB step for a working set of 130 MiB would pay for 126 MiB never used,
            # at start-up and again when they are freed.
            step = max(_GROW_STEP_BYTES, 4 * need)
            size = max(self.min_slab_bytes, _align(need, _GROW_GRANULE_BYTES),
                       min(self.total_bytes, room, step))
            size = max(need, min(size, room))
        slab = self._new_slab(size, dedicated=False)
        self._free[slab.slab_id] = [[0, size]]
        if large:
            self._large.add(slab.slab_id)
        self.total_bytes += size

    def _alloc_dedicated(self, needs: list[int]) -> list[tuple[Slab, int, int]]:
        total = sum(needs)
        slab = self._new_slab(total, dedicated=True)
        self.dedicated_bytes += total
        out, offset = [], 0
        for need in needs:
            out.append((slab, offset, region_token(slab.slab_id, offset)))
            offset += need
        self._dedicated[slab.slab_id] = {token for _, _, token in out}
        return out

    def free(self, tokens: Iterable[int]) -> None:
        """Regions back from the consumer: recycled, or (dedicated) unmapped with their
        slab once all of its regions are back. Any recycled region ends starvation."""
        self._give_back(tokens, from_consumer=True)

    def abort(self, tokens: Iterable[int]) -> None:
        """Regions of a message that was never sent (its encoding or its send failed):
        back as if the consumer had freed them (recycled; a dedicated slab unmapped; a
        shared-heap region the worker's NumPy still holds is the worker's alone again),
        except that starvation stays as it was: the consumer gave nothing back."""
        self._give_back(tokens, from_consumer=False)

    def _give_back(self, tokens: Iterable[int], from_consumer: bool) -> None:
        with self.cond:
            self._drain_gives()
            recycled, released = [], []
            for token in tokens:
                slab_id = token_slab(token)
                live = self._dedicated.get(slab_id)
                if live is None:
                    if self._unsend(token):
                        recycled.append(token)
                    continue
                live.discard(token)
                if not live:
                    self._drop_dedicated(slab_id)
                    released.append(slab_id)
            if recycled:
                self._release(recycled)
                if from_consumer:
                    self.starved = False
            if self.on_release is not None:  # before the index can be reused
                for slab_id in released:
                    self.on_release(slab_id)
            self.cond.notify_all()

    def _unsend(self, token: int) -> bool:
        """The consumer's hold on region ``token`` ends: True when nobody holds it any
        more (recycle it), False when the worker's NumPy still has its array (it gives it)."""
        heap = self._heap
        state = heap.get(token) if heap else None
        if state is None:
            return True
        if state & _HELD:
            if state & _SENT:
                heap[token] = _HELD
                self._held_bytes += self._live[token]
            return False
        del heap[token]
        return True

    def _drop_dedicated(self, slab_id: int) -> None:
        del self._dedicated[slab_id]
        slab = self.slabs.pop(slab_id)
        self.dedicated_bytes -= slab.size
        if slab.name:
            _unlink(slab.name)
        slab.close()

    def _release(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            size = self._live.pop(token, None)
            if size is None:
                log.warning("arena %d: free of unknown region %#x ignored", self.owner, token)
                continue
            holes = self._free[token_slab(token)]
            offset = token_offset(token)
            k = bisect.bisect_left(holes, [offset, 0])
            holes.insert(k, [offset, size])
            # coalesce with the next and the previous hole
            if k + 1 < len(holes) and holes[k][0] + holes[k][1] == holes[k + 1][0]:
                holes[k][1] += holes.pop(k + 1)[1]
            if k > 0 and holes[k - 1][0] + holes[k - 1][1] == holes[k][0]:
                holes[k - 1][1] += holes.pop(k)[1]

    @property
    def live_regions(self) -> int:
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        return sum(self._live.values())

    @property
    def consumer_bytes(self) -> int:
        """Bytes of live regions the consumer holds (not the heap's unsent arrays)."""
        return self.live_bytes - self._held_bytes

    def close(self) -> None:
        for slab in list(self.slabs.values()):
            if slab.name:
                _unlink(slab.name)
            slab.close()


class RegionInfo:
    __slots__ = ("nbytes", "offset", "slab", "token")

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

    def discard(self, slab: Slab) -> None:
        """Forget ``slab`` (if it is the one registered under its id)."""
        with self._lock:
            if self._slabs.get(slab.slab_id) is slab:
                del self._slabs[slab.slab_id]

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
