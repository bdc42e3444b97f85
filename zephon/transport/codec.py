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
   and the header's ``"w"`` entry says why (the pool warns once);
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

An unpicklable object is a :class:`~zephon.errors.SerializationError` naming
its path in the payload (``payload['a'][2].field``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
from typing import Any, Callable, NamedTuple

import numpy as np

from zephon.errors import SerializationError
from zephon.kernels import (
    COMPACT, FORWARD, INLINE, byte_extent, compaction_plan, pack_copy, pack_plan,
)
from zephon.kernels.types import dtype_from_token, dtype_token
from zephon.transport.arena import (
    ArenaFull, LeaseTable, RegionInfo, ShmArena, ShmSpaceError, SlabRegistry, Slab, slab_owner,
)

__all__ = ["ShmPolicy", "Encoder", "Decoder", "PeerState", "find_unpicklable"]

# leaf kinds
_ARRAY, _TENSOR, _BYTES, _BYTEARRAY = 0, 1, 2, 3
# where a leaf lives
_IN_REGION, _IN_FRAME = 0, 1
# region modes in a header
_NEW, _FWD = 0, 1
# leaf flags (an optional 8th descriptor field)
_REQUIRES_GRAD = 1


class ShmPolicy(NamedTuple):
    enabled: bool = True
    coalesce: bool = True
    min_item_bytes: int = 4096
    min_new_allocation_bytes: int = 2 << 20
    min_forward_bytes: int = 128 << 10
    compact_above_ratio: float | None = 8.0
    compact_min_savings_bytes: int = 16 << 20
    max_coalesced_bytes: int | None = 16 << 20

    @classmethod
    def from_options(cls, opts) -> "ShmPolicy":
        return cls(opts.shm_enabled, opts.shm_coalesce, opts.shm_min_item_bytes,
                   opts.shm_min_new_allocation_bytes, opts.shm_min_forward_bytes,
                   opts.shm_compact_above_ratio, opts.shm_compact_min_savings_bytes,
                   opts.shm_max_coalesced_bytes)


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
    if depth > 50:
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


class Encoder:
    """Encodes payloads for one sending process (owns no channel)."""

    def __init__(self, policy: ShmPolicy, leases: LeaseTable, registry: SlabRegistry,
                 arena: ShmArena | None = None) -> None:
        self.policy, self.leases, self.registry, self.arena = policy, leases, registry, arena

    def encode(self, payload: Any, peer: PeerState) -> tuple[dict, list, list[int], list]:
        """``(header, frames, fds, pins)``; ``pins`` are leases that must outlive the send
        until the peer is done with forwarded regions."""
        leaves: list = []
        kinds: list[int] = []
        buf = io.BytesIO()
        pickler = _LeafPickler(buf, leaves, kinds, self.policy.min_item_bytes)
        try:
            pickler.dump(payload)
        except Exception as exc:  # noqa: BLE001
            found = find_unpicklable(payload)
            where = f" at {found[0]}" if found else ""
            raise SerializationError(
                f"cannot serialize the payload{where}: {found[1] if found else exc}",
                path=found[0] if found else None) from exc
        frames: list = [buf.getbuffer()]
        warn: list = []  # why this message went in-band instead of into the arena
        descs: list = [None] * len(leaves)
        regions: list = []
        slab_entries: list = []
        fds: list[int] = []
        pins: list = []
        policy = self.policy

        if not policy.enabled:
            private = list(range(len(leaves)))
            forced_frames = True
        else:
            forced_frames = False
            private = []
            shared: list[tuple[int, RegionInfo, object, int, int]] = []
            for i, leaf in enumerate(leaves):
                found = self.leases.locate(leaf) if kinds[i] in (_ARRAY, _TENSOR) else None
                if found is None:
                    private.append(i)
                    continue
                info, lease = found
                start = leaf.__array_interface__["data"][0] - (info.slab.address + info.offset)
                lo, hi = byte_extent(start, leaf.shape, leaf.strides, leaf.itemsize)
                shared.append((i, info, lease, start, lo, hi))
            compact: list[int] = []
            if shared:
                plan = compaction_plan(
                    [s[1].token for s in shared], [s[1].nbytes for s in shared],
                    [s[4] for s in shared], [s[5] for s in shared],
                    policy.min_forward_bytes, policy.compact_above_ratio,
                    policy.compact_min_savings_bytes)
                decision = dict(zip(plan.region_id.tolist(), plan.decision.tolist()))
                region_index: dict[int, int] = {}
                for i, info, lease, start, lo, hi in shared:
                    d = decision[info.token]
                    if d == FORWARD and not self._peer_can_map(info.slab, peer):
                        d = INLINE
                    if d == INLINE:
                        private.append(i)
                    elif d == COMPACT:
                        compact.append(i)
                    else:
                        r = region_index.get(info.token)
                        if r is None:
                            r = region_index[info.token] = len(regions)
                            regions.append([info.token, info.slab.slab_id, info.offset,
                                            info.nbytes, _FWD])
                            pins.append(lease)
                            self._announce(info.slab, peer, slab_entries, fds)
                        leaf = leaves[i]
                        strides = None if leaf.flags.c_contiguous else list(leaf.strides)
                        descs[i] = [kinds[i], _IN_REGION, r, start, dtype_token(leaf.dtype),
                                    list(leaf.shape), strides]
            if self.arena is None:
                # No arena (the parent): compacted leaves travel in-band like private ones.
                private = sorted(private + compact)
            elif compact or private:
                private.sort()
                private = self._to_regions(leaves, compact, private, kinds, descs, regions,
                                           slab_entries, fds, peer, warn)
        if private:
            self._to_frames(leaves, private, kinds, descs, frames, forced_frames)
        missing = [i for i, d in enumerate(descs) if d is None]
        if missing:  # a bug, never a silent drop
            raise SerializationError(f"internal error: leaves {missing} were not placed")
        for i in pickler.requires_grad:
            descs[i].append(_REQUIRES_GRAD)
        header = {"l": descs, "r": regions, "s": slab_entries}
        if warn:
            header["w"] = warn
        return header, frames, fds, pins

    # -- helpers ---------------------------------------------------------------------
    def _peer_can_map(self, slab: Slab, peer: PeerState) -> bool:
        if slab.dedicated:  # one message's slab: its index is reused once it is unmapped
            return False
        return slab.slab_id in peer.slabs or (slab.fd is not None and peer.can_map_fds) \
            or slab.name is not None

    def _announce(self, slab: Slab, peer: PeerState, slab_entries: list, fds: list) -> None:
        if slab.slab_id in peer.slabs:
            return
        if slab.fd is not None and peer.can_map_fds:
            entry = [slab.slab_id, slab.size, None, len(fds)]
            fds.append(slab.fd)
        else:
            entry = [slab.slab_id, slab.size, slab.name, -1]
        if slab.dedicated:
            entry.append(1)
        slab_entries.append(entry)
        peer.slabs.add(slab.slab_id)

    def _to_regions(self, leaves, compact, private, kinds, descs, regions, slab_entries, fds,
                    peer, warn: list) -> list[int]:
        """Copy the leaves to compact (any size) and the private ones (planned by the
        policy) into new arena regions, all allocated at once (a message never waits for
        space it holds itself); returns the indices left in-band. Without space (the
        consumer holds the arena, or /dev/shm is full) every one of them goes in-band and
        ``warn`` says why: never a drop."""
        policy = self.policy
        plans = []  # (plan, indices)
        left = []
        if compact:
            plan = pack_plan([leaves[i] for i in compact], 0, policy.coalesce,
                             policy.max_coalesced_bytes, 0)
            left += [i for k, i in enumerate(compact) if plan.descriptors[k] is None]
            plans.append((plan, compact))
        if private:
            plan = pack_plan([leaves[i] for i in private], policy.min_item_bytes,
                             policy.coalesce, policy.max_coalesced_bytes,
                             policy.min_new_allocation_bytes)
            plans.append((plan, private))
        sizes = [int(n) for plan, _ in plans for n in plan.group_nbytes]
        if not sizes:
            return sorted(compact + private)
        try:
            allocated = self.arena.alloc_many(sizes)
        except ArenaFull as exc:
            warn[:] = ["starved", self.arena.owner, exc.held_bytes, exc.max_bytes,
                       self.arena.wait_timeout_s]
            return sorted(compact + private)
        except ShmSpaceError as exc:
            warn[:] = ["space", self.arena.owner, str(exc)]
            return sorted(compact + private)
        k = 0
        for plan, indices in plans:
            first_region = len(regions)
            buffers = []
            for g in range(plan.n_groups):
                slab, offset, token = allocated[k]
                nbytes = sizes[k]
                k += 1
                regions.append([token, slab.slab_id, offset, nbytes, _NEW])
                buffers.append(memoryview(slab.mapping)[offset:offset + nbytes])
                self._announce(slab, peer, slab_entries, fds)
            try:
                pack_copy([leaves[i] for i in indices], plan, buffers)
            finally:
                for buffer in buffers:
                    buffer.release()
            for j, i in enumerate(indices):
                desc = plan.descriptors[j]
                if desc is None:
                    if plan is not plans[0][0] or not compact:
                        left.append(i)
                    continue
                descs[i] = [kinds[i], _IN_REGION, first_region + desc.group, desc.offset,
                            desc.dtype, list(desc.shape), None]
        return sorted(left)

    def _to_frames(self, leaves, indices, kinds, descs, frames, one_per_leaf: bool) -> None:
        big, small = [], []
        for i in indices:
            leaf = leaves[i]
            if kinds[i] in (_BYTES, _BYTEARRAY):
                big.append(i)  # already contiguous bytes: its own frame, no copy
                continue
            if one_per_leaf or (leaf.flags.c_contiguous and leaf.nbytes >= self.policy.min_item_bytes):
                big.append(i)
            else:
                small.append(i)
        for i in big:
            leaf = leaves[i]
            if kinds[i] in (_BYTES, _BYTEARRAY):
                descs[i] = [kinds[i], _IN_FRAME, len(frames), 0, "|u1", [len(leaf)], None]
                frames.append(leaf)
                continue
            data = leaf if leaf.flags.c_contiguous else np.ascontiguousarray(leaf)
            descs[i] = [kinds[i], _IN_FRAME, len(frames), 0, dtype_token(leaf.dtype),
                        list(leaf.shape), None]
            frames.append(data.reshape(-1).view(np.uint8) if data.size else b"")
        if small:
            arrays = [leaves[i] for i in small]
            plan = pack_plan(arrays, 0, True, None, 0, 16)
            blobs = [bytearray(int(n)) for n in plan.group_nbytes]
            pack_copy(arrays, plan, blobs)
            base = len(frames)
            frames.extend(blobs)
            for k, i in enumerate(small):
                desc = plan.descriptors[k]
                if desc is None:  # only zero-itemsize dtypes: send the (empty) bytes
                    leaf = leaves[i]
                    descs[i] = [kinds[i], _IN_FRAME, len(frames), 0, dtype_token(leaf.dtype),
                                list(leaf.shape), None]
                    frames.append(b"")
                    continue
                descs[i] = [kinds[i], _IN_FRAME, base + desc.group, desc.offset, desc.dtype,
                            list(desc.shape), None]


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

    def map_slabs(self, header: dict, fds: list[int]) -> list[Slab]:
        """Map the slabs the message announces; returns the dedicated ones (mapped for this
        message only)."""
        used = set()
        dedicated = []
        for entry in header.get("s", ()):
            slab_id, size, name, fd_index = entry[:4]
            if slab_id in self.registry:
                continue
            if fd_index >= 0:
                slab = Slab.attach(slab_id, size, fd=fds[fd_index])
                used.add(fd_index)
            else:
                slab = Slab.attach(slab_id, size, name=name)
            if len(entry) > 4 and entry[4]:
                slab.dedicated = True
                dedicated.append(slab)
            self.registry.add(slab)
        for k, fd in enumerate(fds):
            if k not in used:
                os.close(fd)
        return dedicated

    def decode(self, header: dict, frames: list, fds: list[int]) -> Any:
        dedicated = self.map_slabs(header, fds)
        try:
            return self._decode(header, frames)
        finally:
            # A dedicated slab lives exactly as long as the leases built on it: forget it
            # here (its index is reused by its owner) and let the last view unmap it.
            for slab in dedicated:
                self.registry.discard(slab)
                slab.close()

    def _decode(self, header: dict, frames: list) -> Any:
        leases = []
        for token, slab_id, offset, nbytes, mode in header["r"]:
            lease = self.leases.get(token)
            if lease is None:
                if mode == _FWD and not self.borrow_forwarded:
                    raise SerializationError(
                        f"forwarded region {token:#x} is no longer leased here: a worker kept a "
                        "view of a task input beyond its task (copy it to keep it)")
                slab = self.registry.get(slab_id)
                if slab is None:
                    raise SerializationError(f"message refers to unknown slab {slab_id:#x}")
                release = self.release_for(slab_owner(slab_id)) if mode == _NEW else None
                lease = self.leases.lease(RegionInfo(token, slab, offset, nbytes), release)
            leases.append(lease)
        leaves = []
        for desc in header["l"]:
            if desc is None:
                leaves.append(None)
                continue
            kind, where, index, offset, dtype, shape, strides = desc[:7]
            dt = dtype_from_token(dtype)
            buffer = leases[index] if where == _IN_REGION else frames[index]
            if kind in (_BYTES, _BYTEARRAY):
                data = bytes(memoryview(buffer)[offset:offset + shape[0]])
                leaves.append(data if kind == _BYTES else bytearray(data))
                continue
            if strides is None:
                arr = np.ndarray(shape, dt, buffer=buffer, offset=offset) if len(buffer) or \
                    not dt.itemsize else np.empty(shape, dt)
            else:
                arr = np.ndarray(shape, dt, buffer=buffer, offset=offset, strides=strides)
            if kind == _TENSOR:
                import torch

                arr = torch.from_numpy(arr)
                if len(desc) > 7 and desc[7] & _REQUIRES_GRAD and arr.is_floating_point():
                    arr.requires_grad_(True)
            leaves.append(arr)
        return _LeafUnpickler(io.BytesIO(frames[0]), leaves).load()
