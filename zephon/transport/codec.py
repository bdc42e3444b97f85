"""Payload codec: any picklable payload <-> (msgpack header, frames, descriptors).

Encoding walks the payload once, with pickle protocol 5 and a
``persistent_id`` hook: NumPy arrays (any strides, 0-d, empty; not object
dtypes), ``bytes``/``bytearray`` of at least ``shm_min_item_bytes``, and CPU
torch tensors become *leaves*; everything else (dicts, lists, tuples,
dataclasses, scalars, strings, object arrays) stays in the small pickled
*skeleton*. Leaves then go through the kernels:

1. leaves that are views of a region this process holds a lease on are grouped
   by region (:func:`~zephon.kernels.compaction_plan`): INLINE (too few useful
   bytes: treated as private), COMPACT (copied into a fresh region of this
   process's arena) or FORWARD (sent by reference: the receiver builds its
   views on its own mapping of the same slab; the descriptor of a slab the
   receiver has not mapped yet travels once with the message);
2. private leaves are planned by :func:`~zephon.kernels.pack_plan` (in-band if
   small, coalesced by dtype into regions of at most ``shm_max_coalesced_bytes``,
   small groups in-band) and copied into arena regions by ``pack_copy``. The
   regions of the whole message (compacted and private groups together) are
   allocated in one request, all or none, so a message never waits for space
   it holds itself; when the arena has none to give (the consumer holds it:
   :class:`~zephon.transport.arena.ArenaFull`, or /dev/shm is full:
   :class:`~zephon.transport.arena.ShmSpaceError`) those leaves travel in-band
   and the header's fallback entry says why (the pool warns once);
3. in-band leaves are packed by dtype into a few byte frames; without an arena
   (the parent side) large contiguous leaves are sent as frames straight from
   their memory; ``shm_enabled=False`` sends every leaf as its own frame
   (plain pickle protocol 5 out-of-band buffers).

Decoding maps any new slabs, takes a lease per region (a new region's lease
releases it to its owner when the last view dies) and rebuilds every leaf as
a zero-copy view (``torch.from_numpy`` for tensors, with ``requires_grad``
restored for floating tensors that had it: they arrive as leaves of a new graph;
``bytes``/``bytearray`` leaves are rebuilt as their own type, which copies). A
dedicated slab (one message's, see :mod:`zephon.transport.arena`) is mapped
for that message only: forgotten once its leases exist, unmapped with the last
view, and never forwarded.

The header's layout (named fields in memory, compact msgpack arrays on the
wire) is :mod:`zephon.transport.wire`; region tokens are
:mod:`zephon.transport.tokens`. :class:`Encoder` does one step per method:
pickle the skeleton, forward or compact views of leased regions, copy private
leaves into arena regions, put the rest in frames.

An unpicklable object is a :class:`~zephon.errors.SerializationError` naming
its path in the payload (``payload['a'][2].field``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
from typing import Any, Callable, NamedTuple, cast

import numpy as np

from zephon.errors import SerializationError
from zephon.kernels import (
    COMPACT,
    FORWARD,
    INLINE,
    PackPlan,
    byte_extent,
    compaction_plan,
    pack_copy,
    pack_plan,
)
from zephon.kernels.types import dtype_from_token, dtype_token
from zephon.transport.arena import (
    ArenaFull,
    LeaseTable,
    RegionInfo,
    ShmArena,
    ShmSpaceError,
    Slab,
    SlabRegistry,
)
from zephon.transport.heap import exclusive_arrays
from zephon.transport.tokens import slab_owner
from zephon.transport.wire import (
    NO_SPACE,
    STARVED,
    Fallback,
    LeafDesc,
    LeafFlag,
    LeafKind,
    Placement,
    RawLeafDesc,
    RegionEntry,
    RegionMode,
    SlabEntry,
    SpaceFallback,
    StarvedFallback,
    WireHeader,
    header_to_wire,
)

__all__ = ["Decoder", "Encoder", "PeerState", "ShmPolicy", "find_unpicklable"]

# Plain ints on the hot paths (an enum attribute look-up per leaf costs more than the
# comparison it feeds, and msgpack packs exact ints fastest).
_ARRAY, _TENSOR = int(LeafKind.ARRAY), int(LeafKind.TENSOR)
_BYTES, _BYTEARRAY = int(LeafKind.BYTES), int(LeafKind.BYTEARRAY)
_REGION, _FRAME = int(Placement.REGION), int(Placement.FRAME)
_NO_FLAGS = int(LeafFlag.NONE)
_NEW, _FORWARDED = int(RegionMode.NEW), int(RegionMode.FORWARDED)
_VIEW_KINDS = (_ARRAY, _TENSOR)  # leaves that can be views of a leased region
_BYTES_KINDS = (_BYTES, _BYTEARRAY)
_BYTE_DTYPE = "|u1"  # the dtype token of a bytes-like leaf
_NO_FD = -1  # SlabEntry.fd_index of a slab announced by name
_FRAME_ALIGN = 16  # alignment of small leaves packed together into in-band frames
_MAX_SEARCH_DEPTH = 50  # find_unpicklable gives up below this nesting


class ShmPolicy(NamedTuple):
    enabled: bool = True
    coalesce: bool = True
    min_item_bytes: int = 4096
    min_new_allocation_bytes: int = 2 << 20
    min_forward_bytes: int = 128 << 10
    compact_above_ratio: float | None = 8.0
    compact_min_savings_bytes: int = 16 << 20
    max_coalesced_bytes: int | None = 16 << 20


class PeerState:
    """What the peer at the other end of one channel has mapped already."""

    def __init__(self, can_map_fds: bool) -> None:
        self.slabs: set[int] = set()
        self.can_map_fds = can_map_fds


def _torch_tensor_type():
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


class _LeafPickler(pickle.Pickler):
    def __init__(self, file, leaves: list, kinds: list, min_bytes: int) -> None:
        super().__init__(file, protocol=5)
        self.leaves, self.kinds, self.min_bytes = leaves, kinds, min_bytes
        self.tensor_type = _torch_tensor_type()
        self.requires_grad: list[int] = []  # leaf indices of tensors with requires_grad

    def persistent_id(self, obj):
        t = type(obj)
        if t is np.ndarray or t is np.memmap:
            if obj.dtype.hasobject:
                return None
            kind = _ARRAY
        elif t is bytes or t is bytearray:
            if len(obj) < self.min_bytes:
                return None
            kind = _BYTES if t is bytes else _BYTEARRAY
        elif self.tensor_type is not None and isinstance(obj, self.tensor_type):
            if obj.device.type != "cpu" or obj.is_sparse:
                return None
            grad = bool(obj.requires_grad)
            try:
                obj = obj.detach().numpy()
            except (RuntimeError, TypeError):
                return None  # e.g. bfloat16: torch's own reducer handles it
            kind = _TENSOR
            if grad:
                self.requires_grad.append(len(self.leaves))
        else:
            return None
        self.leaves.append(obj)
        self.kinds.append(kind)
        return len(self.leaves) - 1


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, file, leaves: list) -> None:
        super().__init__(file)
        self.leaves = leaves

    def persistent_load(self, pid):
        return self.leaves[pid]


def find_unpicklable(payload: Any, path: str = "payload", depth: int = 0) -> tuple[str, str] | None:
    """``(path, error)`` of the first object in ``payload`` that cannot be pickled."""
    if depth > _MAX_SEARCH_DEPTH:
        return None
    children: list[tuple[str, Any]] = []
    if isinstance(payload, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in payload.items()]
    elif isinstance(payload, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(payload)]
    elif dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        children = [(f"{path}.{f.name}", getattr(payload, f.name))
                    for f in dataclasses.fields(payload)]
    for child_path, child in children:
        found = find_unpicklable(child, child_path, depth + 1)
        if found:
            return found
    try:
        pickle.dumps(payload, protocol=5)
    except Exception as exc:  # noqa: BLE001 - any failure is what we are looking for
        return path, f"{type(exc).__name__}: {exc}"
    return None


class _Message:
    """The working state of one ``encode``: the leaves found while pickling and, as they
    are placed, their descriptors, the regions and slabs they need, the frames, the
    descriptors to pass and the leases to pin."""

    __slots__ = (
        "descs",
        "fallback",
        "fds",
        "frames",
        "kinds",
        "leaves",
        "pins",
        "regions",
        "requires_grad",
        "slabs",
    )

    def __init__(self, leaves: list, kinds: list[int], skeleton: memoryview,
                 requires_grad: list[int]) -> None:
        self.leaves, self.kinds, self.requires_grad = leaves, kinds, requires_grad
        self.descs: list[RawLeafDesc | None] = [None] * len(leaves)
        self.regions: list[RegionEntry] = []
        self.slabs: list[SlabEntry] = []
        self.frames: list[Any] = [skeleton]
        self.fds: list[int] = []
        self.pins: list[Any] = []
        self.fallback: Fallback | None = None

    def wire_header(self) -> dict[str, Any]:
        """The wire form of the placed message's :class:`~zephon.transport.wire.WireHeader`
        (every leaf must have a descriptor)."""
        descs = self.descs
        if None in descs:  # a bug, never a silent drop
            missing = [i for i, d in enumerate(descs) if d is None]
            raise SerializationError(f"internal error: leaves {missing} were not placed")
        for i in self.requires_grad:
            d = cast("RawLeafDesc", descs[i])
            descs[i] = (*d[:7], int(LeafFlag.REQUIRES_GRAD))
        return header_to_wire(cast("list[RawLeafDesc]", descs), self.regions, self.slabs,
                              self.fallback)


class _SharedLeaf(NamedTuple):
    """A leaf that is a view of a region this process holds a lease on."""

    leaf: int  # its index among the message's leaves
    region: RegionInfo
    lease: Any
    start: int  # byte offset of its first element in the region
    lo: int  # the byte extent it touches in the region
    hi: int


class Encoder:
    """Encodes payloads for one sending process (owns no channel)."""

    def __init__(self, policy: ShmPolicy, leases: LeaseTable, registry: SlabRegistry,
                 arena: ShmArena | None = None, heap: Any = None) -> None:
        self.policy, self.leases, self.registry, self.arena = policy, leases, registry, arena
        self.heap = heap  # a worker's WorkerHeap (zephon.transport.heap), or None

    def encode(self, payload: Any, peer: PeerState) -> tuple[dict[str, Any], list, list[int],
                                                             list]:
        """Encode ``payload`` for the process behind ``peer``.

        Returns ``(header, frames, fds, pins)``: the header dict to send (the wire form of a
        :class:`~zephon.transport.wire.WireHeader`), the frames (the pickled skeleton
        first), descriptors to pass with the message, and ``pins``, leases that must
        outlive the send until the peer is done with forwarded regions. An unpicklable
        payload is a :class:`~zephon.errors.SerializationError` naming its path.
        """
        return self._place(self._pickle(payload), peer, None)

    def encode_owned(self, box: list, peer: PeerState) -> tuple[dict[str, Any], list,
                                                                list[int], list]:
        """:meth:`encode` of ``box[0]`` for a caller that holds the payload only through
        ``box`` (a one-item list): arrays of the worker's shared heap that nothing but the
        payload reaches go by reference (:func:`~zephon.transport.heap.exclusive_arrays`),
        once the heap passed its self-test through this encoder
        (:meth:`~zephon.transport.heap.WorkerHeap.verify`, at the first call that finds a
        heap array alive)."""
        msg = self._pickle(box[0])
        exclusive = None
        heap = self.heap
        if heap is not None and heap.has_live() and self.policy.enabled and \
                heap.verify(self, peer):  # (its self-test, at first use)
            exclusive = exclusive_arrays(box)
        return self._place(msg, peer, exclusive)

    def abort(self, header: dict[str, Any], peer: PeerState) -> None:
        """Undo what encoding ``header`` (as :meth:`encode` returned it) took, for a
        message that will not be sent: its new regions go back to the arena
        (:meth:`~zephon.transport.arena.ShmArena.abort`: its accounting is restored, a
        heap array sent by reference is the worker's again) and the slabs it announced
        count as unknown to ``peer`` again, so the next message announces them."""
        wire = WireHeader.from_wire(header)
        self._abort(wire.regions, wire.slabs, peer)

    def _abort(self, regions: list, slabs: list, peer: PeerState) -> None:
        arena = self.arena
        if arena is not None:
            mine = [r.token for r in regions
                    if r.mode == _NEW and slab_owner(r.slab_id) == arena.owner]
            if mine:
                arena.abort(mine)
        for entry in slabs:
            peer.slabs.discard(entry.slab_id)

    def _place(self, msg: _Message, peer: PeerState,
               exclusive: set[int] | None) -> tuple[dict[str, Any], list, list[int], list]:
        try:
            return self._place_all(msg, peer, exclusive)
        except BaseException:
            self._abort(msg.regions, msg.slabs, peer)  # nothing of it is sent
            raise

    def _place_all(self, msg: _Message, peer: PeerState,
                   exclusive: set[int] | None) -> tuple[dict[str, Any], list, list[int], list]:
        if not self.policy.enabled:
            self._to_frames(msg, list(range(len(msg.leaves))), one_per_leaf=True)
        else:
            private, compact = self._place_shared(msg, peer)
            if exclusive and private:
                private = self._by_reference(msg, private, peer, exclusive)
            if self.arena is None:
                # No arena (the parent): compacted leaves travel in-band like private ones.
                private = sorted(private + compact)
            elif compact or private:
                private = self._to_regions(msg, compact, sorted(private), peer)
            if private:
                self._to_frames(msg, private, one_per_leaf=False)
        return msg.wire_header(), msg.frames, msg.fds, msg.pins

    # -- steps -----------------------------------------------------------------------
    def _pickle(self, payload: Any) -> _Message:
        """Pickle the skeleton, collecting the leaves (a named error if it cannot be)."""
        leaves: list = []
        kinds: list[int] = []
        buf = io.BytesIO()
        pickler = _LeafPickler(buf, leaves, kinds, self.policy.min_item_bytes)
        try:
            pickler.dump(payload)
        except Exception as exc:  # any pickling failure: reported with its path
            found = find_unpicklable(payload)
            where = f" at {found[0]}" if found else ""
            raise SerializationError(
                f"cannot serialize the payload{where}: {found[1] if found else exc}",
                path=found[0] if found else None) from exc
        return _Message(leaves, kinds, buf.getbuffer(), pickler.requires_grad)

    def _shared_leaves(self, msg: _Message) -> tuple[list[_SharedLeaf], list[int]]:
        """Split the leaves into views of leased regions and private ones."""
        shared: list[_SharedLeaf] = []
        private: list[int] = []
        for i, leaf in enumerate(msg.leaves):
            found = self.leases.locate(leaf) if msg.kinds[i] in _VIEW_KINDS else None
            if found is None:
                private.append(i)
                continue
            info, lease = found
            start = leaf.__array_interface__["data"][0] - (info.slab.address + info.offset)
            lo, hi = byte_extent(start, leaf.shape, leaf.strides, leaf.itemsize)
            shared.append(_SharedLeaf(i, info, lease, start, lo, hi))
        return shared, private

    def _place_shared(self, msg: _Message, peer: PeerState) -> tuple[list[int], list[int]]:
        """Forward the views of leased regions that are worth it (their descriptors are
        written here); returns ``(private, compact)``: the leaf indices still to place, as
        private leaves and as views to copy into a fresh region."""
        shared, private = self._shared_leaves(msg)
        compact: list[int] = []
        if not shared:
            return private, compact
        policy = self.policy
        plan = compaction_plan(
            [s.region.token for s in shared], [s.region.nbytes for s in shared],
            [s.lo for s in shared], [s.hi for s in shared],
            policy.min_forward_bytes, policy.compact_above_ratio,
            policy.compact_min_savings_bytes)
        decision = dict(zip(plan.region_id.tolist(), plan.decision.tolist(), strict=True))
        region_index: dict[int, int] = {}
        for s in shared:
            d = decision[s.region.token]
            if d == FORWARD and not self._peer_can_map(s.region.slab, peer):
                d = INLINE
            if d == INLINE:
                private.append(s.leaf)
            elif d == COMPACT:
                compact.append(s.leaf)
            else:
                self._forward(msg, s, region_index, peer)
        return private, compact

    def _forward(self, msg: _Message, s: _SharedLeaf, region_index: dict[int, int],
                 peer: PeerState) -> None:
        """Describe leaf ``s`` as a view of its region, sent by reference."""
        info = s.region
        r = region_index.get(info.token)
        if r is None:
            r = region_index[info.token] = len(msg.regions)
            msg.regions.append(RegionEntry(info.token, info.slab.slab_id, info.offset,
                                           info.nbytes, RegionMode.FORWARDED))
            msg.pins.append(s.lease)
            self._announce(info.slab, peer, msg)
        leaf = msg.leaves[s.leaf]
        strides = None if leaf.flags.c_contiguous else list(leaf.strides)
        msg.descs[s.leaf] = (msg.kinds[s.leaf], _REGION, r, s.start,
                                       dtype_token(leaf.dtype), list(leaf.shape), strides,
                                       _NO_FLAGS)

    def _by_reference(self, msg: _Message, private: list[int], peer: PeerState,
                      exclusive: set[int]) -> list[int]:
        """Send the private arrays that already live in a region of this worker's shared
        heap as that region, without a copy (only arrays nothing else in the worker can
        reach: in ``exclusive``, and :meth:`~zephon.transport.heap.WorkerHeap.claim`);
        returns the others."""
        heap = self.heap
        threshold = heap.threshold
        leaves, kinds = msg.leaves, msg.kinds
        left: list[int] = []
        for i in private:
            # no local name for the leaf before claim(): it counts references
            if kinds[i] != _ARRAY or id(leaves[i]) not in exclusive or \
                    2 * leaves[i].nbytes < threshold:
                left.append(i)
                continue
            claimed = heap.claim(leaves, i)
            if claimed is None:
                left.append(i)
                continue
            leaf = leaves[i]
            token, slab, offset, nbytes, start = claimed
            r = len(msg.regions)
            msg.regions.append(RegionEntry(token, slab.slab_id, offset, nbytes, RegionMode.NEW))
            self._announce(slab, peer, msg)
            strides = None if leaf.flags.c_contiguous else list(leaf.strides)
            msg.descs[i] = (_ARRAY, _REGION, r, start, dtype_token(leaf.dtype),
                            list(leaf.shape), strides, _NO_FLAGS)
        return left

    # -- helpers ---------------------------------------------------------------------
    def _peer_can_map(self, slab: Slab, peer: PeerState) -> bool:
        if slab.dedicated:  # one message's slab: its index is reused once it is unmapped
            return False
        return slab.slab_id in peer.slabs or (slab.fd is not None and peer.can_map_fds) \
            or slab.name is not None

    def _announce(self, slab: Slab, peer: PeerState, msg: _Message) -> None:
        if slab.slab_id in peer.slabs:
            return
        if slab.fd is not None and peer.can_map_fds:
            entry = SlabEntry(slab.slab_id, slab.size, None, len(msg.fds), slab.dedicated)
            msg.fds.append(slab.fd)
        else:
            entry = SlabEntry(slab.slab_id, slab.size, slab.name, _NO_FD, slab.dedicated)
        msg.slabs.append(entry)
        peer.slabs.add(slab.slab_id)

    def _region_plans(self, msg: _Message, compact: list[int],
                      private: list[int]) -> list[tuple[PackPlan, list[int]]]:
        """The pack plans of the leaves to compact (any size) and of the private ones
        (planned by the policy)."""
        policy = self.policy
        plans = []
        if compact:
            plans.append((pack_plan([msg.leaves[i] for i in compact], 0, policy.coalesce,
                                    policy.max_coalesced_bytes, 0), compact))
        if private:
            plans.append((pack_plan([msg.leaves[i] for i in private], policy.min_item_bytes,
                                    policy.coalesce, policy.max_coalesced_bytes,
                                    policy.min_new_allocation_bytes), private))
        return plans

    def _allocate(self, msg: _Message, sizes: list[int]) -> list[tuple[Slab, int, int]] | None:
        """All the regions at once, or None with ``msg.fallback`` saying why."""
        arena = self.arena
        assert arena is not None
        try:
            return arena.alloc_many(sizes)
        except ArenaFull as exc:
            msg.fallback = StarvedFallback(STARVED, arena.owner, exc.held_bytes, exc.max_bytes,
                                           arena.wait_timeout_s)
        except ShmSpaceError as exc:
            msg.fallback = SpaceFallback(NO_SPACE, arena.owner, str(exc))
        return None

    def _to_regions(self, msg: _Message, compact: list[int], private: list[int],
                    peer: PeerState) -> list[int]:
        """Copy the leaves to compact (any size) and the private ones (planned by the
        policy) into new arena regions, all allocated at once (a message never waits for
        space it holds itself); returns the indices left in-band. Without space (the
        consumer holds the arena, or /dev/shm is full) every one of them goes in-band and
        the header's fallback says why: never a drop."""
        plans = self._region_plans(msg, compact, private)
        sizes = [int(n) for plan, _ in plans for n in plan.group_nbytes]
        allocated = self._allocate(msg, sizes) if sizes else None
        if allocated is None:
            return sorted(compact + private)
        left: list[int] = []
        k = 0
        for plan, indices in plans:
            first_region = len(msg.regions)
            buffers = []
            for _ in range(plan.n_groups):
                slab, offset, token = allocated[k]
                nbytes = sizes[k]
                k += 1
                msg.regions.append(RegionEntry(token, slab.slab_id, offset, nbytes,
                                               RegionMode.NEW))
                buffers.append(memoryview(slab.mapping)[offset:offset + nbytes])
                self._announce(slab, peer, msg)
            try:
                pack_copy([msg.leaves[i] for i in indices], plan, buffers)
            finally:
                for buffer in buffers:
                    buffer.release()
            for j, i in enumerate(indices):
                desc = plan.descriptors[j]
                if desc is None:
                    left.append(i)  # too small for a region (compacted views never are)
                    continue
                msg.descs[i] = (msg.kinds[i], _REGION, first_region + desc.group,
                                          desc.offset, desc.dtype, list(desc.shape), None,
                                          _NO_FLAGS)
        return sorted(left)

    def _to_frames(self, msg: _Message, indices: list[int], one_per_leaf: bool) -> None:
        """Send the leaves ``indices`` in-band: bytes and large contiguous arrays (every
        leaf with ``one_per_leaf``) as their own frames, the others packed by dtype."""
        big, small = [], []
        for i in indices:
            leaf = msg.leaves[i]
            if msg.kinds[i] in _BYTES_KINDS or one_per_leaf or (
                    leaf.flags.c_contiguous and leaf.nbytes >= self.policy.min_item_bytes):
                big.append(i)  # already contiguous bytes, or worth a frame of its own
            else:
                small.append(i)
        if big:
            self._own_frames(msg, big)
        if small:
            self._packed_frames(msg, small)

    @staticmethod
    def _own_frames(msg: _Message, big: list[int]) -> None:
        """Each leaf of ``big`` as a frame of its own (one loop with local names: this runs
        once per leaf of every message sent without shared memory)."""
        leaves, kinds, descs, frames = msg.leaves, msg.kinds, msg.descs, msg.frames
        for i in big:
            leaf, kind = leaves[i], kinds[i]
            if kind in _BYTES_KINDS:
                descs[i] = (kind, _FRAME, len(frames), 0, _BYTE_DTYPE, [len(leaf)], None, _NO_FLAGS)
                frames.append(leaf)
                continue
            data = leaf if leaf.flags.c_contiguous else np.ascontiguousarray(leaf)
            descs[i] = (kind, _FRAME, len(frames), 0, dtype_token(leaf.dtype),
                        list(leaf.shape), None, _NO_FLAGS)
            frames.append(data.reshape(-1).view(np.uint8) if data.size else b"")

    @staticmethod
    def _packed_frames(msg: _Message, small: list[int]) -> None:
        arrays = [msg.leaves[i] for i in small]
        plan = pack_plan(arrays, 0, True, None, 0, _FRAME_ALIGN)
        blobs = [bytearray(int(n)) for n in plan.group_nbytes]
        pack_copy(arrays, plan, blobs)
        base = len(msg.frames)
        msg.frames.extend(blobs)
        for k, i in enumerate(small):
            desc = plan.descriptors[k]
            if desc is None:  # only zero-itemsize dtypes: send the (empty) bytes
                leaf = msg.leaves[i]
                msg.descs[i] = (msg.kinds[i], _FRAME, len(msg.frames), 0,
                                          dtype_token(leaf.dtype), list(leaf.shape), None,
                                          _NO_FLAGS)
                msg.frames.append(b"")
                continue
            msg.descs[i] = (msg.kinds[i], _FRAME, base + desc.group, desc.offset,
                                      desc.dtype, list(desc.shape), None, _NO_FLAGS)


class Decoder:
    """Decodes messages received by one process."""

    def __init__(self, leases: LeaseTable, registry: SlabRegistry,
                 release_for: Callable[[int], Callable[[int], None] | None], *,
                 borrow_forwarded: bool) -> None:
        """``borrow_forwarded``: a forwarded region without a live lease here may be borrowed
        (a worker, whose parent pins it for the task); the parent refuses instead, because
        the region could already have been recycled."""
        self.leases, self.registry, self.release_for = leases, registry, release_for
        self.borrow_forwarded = borrow_forwarded

    def map_slabs(self, header: WireHeader, fds: list[int]) -> list[Slab]:
        """Map the slabs the message announces; returns the dedicated ones (mapped for this
        message only). Descriptors the message carried but did not use are closed."""
        used = set()
        dedicated = []
        for entry in header.slabs:
            if entry.slab_id in self.registry:
                continue
            if entry.fd_index != _NO_FD:
                slab = Slab.attach(entry.slab_id, entry.size, fd=fds[entry.fd_index])
                used.add(entry.fd_index)
            else:
                slab = Slab.attach(entry.slab_id, entry.size, name=entry.name)
            if entry.dedicated:
                slab.dedicated = True
                dedicated.append(slab)
            self.registry.add(slab)
        for k, fd in enumerate(fds):
            if k not in used:
                os.close(fd)
        return dedicated

    def decode(self, header: dict[str, Any], frames: list, fds: list[int]) -> Any:
        """The payload of a received message (``header`` as received: its wire form)."""
        wire = WireHeader.from_wire(header)
        dedicated = self.map_slabs(wire, fds)
        try:
            return self._decode(wire, frames)
        finally:
            # A dedicated slab lives exactly as long as the leases built on it: forget it
            # here (its index is reused by its owner) and let the last view unmap it.
            for slab in dedicated:
                self.registry.discard(slab)
                slab.close()

    def _region_lease(self, region: RegionEntry) -> Any:
        """The lease of one region of the message (existing, borrowed or new)."""
        lease = self.leases.get(region.token)
        if lease is not None:
            return lease
        if region.mode == _FORWARDED and not self.borrow_forwarded:
            raise SerializationError(
                f"forwarded region {region.token:#x} is no longer leased here: a worker kept "
                "a view of a task input beyond its task (copy it to keep it)")
        slab = self.registry.get(region.slab_id)
        if slab is None:
            raise SerializationError(f"message refers to unknown slab {region.slab_id:#x}")
        release = self.release_for(slab_owner(region.slab_id)) \
            if region.mode == _NEW else None
        return self.leases.lease(RegionInfo(region.token, slab, region.offset, region.nbytes),
                                 release)

    def _decode(self, header: WireHeader, frames: list) -> Any:
        leases = [self._region_lease(region) for region in header.regions]
        dtypes: dict[str, np.dtype] = {}  # dtype token -> dtype, once per message
        leaves = []
        for desc in header.leaves:
            buffer = leases[desc.buffer] if desc.placement == _REGION else frames[desc.buffer]
            dt = dtypes.get(desc.dtype)
            if dt is None:
                dt = dtypes[desc.dtype] = dtype_from_token(desc.dtype)
            leaves.append(_rebuild_leaf(desc, buffer, dt))
        return _LeafUnpickler(io.BytesIO(frames[0]), leaves).load()


def _rebuild_leaf(desc: LeafDesc, buffer: Any, dt: np.dtype) -> Any:
    """One leaf as a zero-copy view of ``buffer`` (bytes-likes are copies)."""
    kind, offset, shape = desc.kind, desc.offset, desc.shape
    if kind == _ARRAY and desc.strides is None and (len(buffer) or not dt.itemsize):
        return np.ndarray(shape, dt, buffer=buffer, offset=offset)  # the common case
    if kind in _BYTES_KINDS:
        data = bytes(memoryview(buffer)[offset:offset + shape[0]])
        return data if kind == _BYTES else bytearray(data)
    arr: np.ndarray
    if desc.strides is not None:
        arr = np.ndarray(shape, dt, buffer=buffer, offset=offset, strides=desc.strides)
    elif len(buffer) or not dt.itemsize:
        arr = np.ndarray(shape, dt, buffer=buffer, offset=offset)
    else:
        arr = np.empty(shape, dt)
    if kind != _TENSOR:
        return arr
    import torch

    tensor = torch.from_numpy(arr)
    if desc.flags & LeafFlag.REQUIRES_GRAD and tensor.is_floating_point():
        tensor.requires_grad_(True)
    return tensor
