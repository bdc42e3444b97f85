"""The codec's message header: named fields in memory, compact msgpack arrays on the wire.

A header describes where every leaf of one message lives; the pickled skeleton
and the in-band bytes travel as frames beside it. In memory each part is a
``NamedTuple`` with named fields; on the wire it is the same tuple, which msgpack
packs as a plain array (no field names, no conversion). :meth:`WireHeader.to_wire`
gives the dict the channel sends and :meth:`WireHeader.from_wire` reads one back::

    {"l": [LeafDesc, ...],      one per leaf, in the skeleton's persistent-id order
     "r": [RegionEntry, ...],   the arena regions the leaves refer to
     "s": [SlabEntry, ...],     slabs the receiver has not mapped yet (announced once)
     "w": StarvedFallback | SpaceFallback}   only when leaves went in-band for want of
                                             arena space, saying why

The transport adds its own keys (``"k"``, ``"id"``, ...) to the same dict; the
codec's keys are the one-letter ones above. Both ends run the same zephon, so the
layout carries no version. A message can hold thousands of leaves, so the
encoder builds each leaf descriptor as a plain tuple in :class:`LeafDesc`'s field
order (:data:`RawLeafDesc`, written out by :func:`header_to_wire`), and the receiver
names them with :func:`leaf_desc` (``tuple.__new__``, no Python-level constructor).

Example::

    >>> leaf = LeafDesc(LeafKind.ARRAY, Placement.FRAME, 1, 0, "<f4", [3], None, 0)
    >>> h = WireHeader([leaf], [], [])
    >>> WireHeader.from_wire(h.to_wire()).leaves[0].dtype
    '<f4'
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Callable, NamedTuple, Sequence, Union

__all__ = [
    "NO_SPACE",
    "STARVED",
    "Fallback",
    "LeafDesc",
    "LeafFlag",
    "LeafKind",
    "Placement",
    "RawLeafDesc",
    "RegionEntry",
    "RegionMode",
    "SlabEntry",
    "SpaceFallback",
    "StarvedFallback",
    "WireHeader",
    "header_to_wire",
    "leaf_desc",
]


class LeafKind(enum.IntEnum):
    """What a leaf was in the payload (and is rebuilt as)."""

    ARRAY = 0
    TENSOR = 1  # a CPU torch tensor, sent as its NumPy view
    BYTES = 2
    BYTEARRAY = 3


class Placement(enum.IntEnum):
    """Where a leaf's bytes travel."""

    REGION = 0  # in an arena region (``LeafDesc.buffer`` is a ``WireHeader.regions`` index)
    FRAME = 1  # in-band, in a frame (``LeafDesc.buffer`` is a frame index)


class RegionMode(enum.IntEnum):
    """How a region reached this message."""

    NEW = 0  # allocated for it: the receiver's lease releases it to its owner
    FORWARDED = 1  # a region the sender holds a lease on, sent by reference


class LeafFlag(enum.IntFlag):
    """Bits of ``LeafDesc.flags``."""

    NONE = 0
    REQUIRES_GRAD = 1  # a floating tensor that had requires_grad


class LeafDesc(NamedTuple):
    """One leaf: ``kind`` (:class:`LeafKind`), ``placement`` (:class:`Placement`),
    ``buffer``, the index of its region or frame, byte ``offset`` in it, ``dtype`` token
    (:func:`zephon.kernels.types.dtype_token`), ``shape``, ``strides`` (``None``:
    C-contiguous) and ``flags`` (:class:`LeafFlag`)."""

    kind: int
    placement: int
    buffer: int
    offset: int
    dtype: str
    shape: list
    strides: list | None
    flags: int


#: ``leaf_desc((kind, placement, buffer, offset, dtype, shape, strides, flags))``: a
#: :class:`LeafDesc` from a tuple of all eight fields (no per-field argument handling).
leaf_desc: Callable[[tuple], LeafDesc] = functools.partial(tuple.__new__, LeafDesc)

#: A leaf descriptor as the encoder builds it: :class:`LeafDesc`'s eight fields, in that
#: order, as a plain tuple. The encoder makes one per leaf of every message, and a plain
#: tuple costs a third of a named one (62 vs 185 ns); it is exactly what travels, and
#: :meth:`WireHeader.from_wire` names it on the receiving side.
RawLeafDesc = tuple[int, int, int, int, str, list, "list | None", int]


def header_to_wire(leaves: Sequence[tuple], regions: Sequence[tuple],
                   slabs: Sequence[tuple], fallback: tuple | None) -> dict[str, Any]:
    """The msgpack-able dict of a header (one-letter keys, arrays inside): what
    :meth:`WireHeader.to_wire` returns, also for leaves the encoder built as
    :data:`RawLeafDesc` tuples."""
    wire: dict[str, Any] = {"l": leaves, "r": regions, "s": slabs}
    if fallback is not None:
        wire["w"] = fallback
    return wire


class RegionEntry(NamedTuple):
    """One arena region: its ``token`` (:mod:`zephon.transport.tokens`), ``slab_id``,
    byte ``offset`` in the slab, ``nbytes`` and ``mode`` (:class:`RegionMode`)."""

    token: int
    slab_id: int
    offset: int
    nbytes: int
    mode: int


class SlabEntry(NamedTuple):
    """A slab the receiver must map: ``slab_id``, ``size``, and either its segment
    ``name`` or ``fd_index`` (an index into the message's descriptors, -1 when sent by
    name); ``dedicated`` slabs hold one message and are mapped for it only."""

    slab_id: int
    size: int
    name: str | None
    fd_index: int
    dedicated: bool = False


STARVED = "starved"
NO_SPACE = "space"


class StarvedFallback(NamedTuple):
    """Leaves went in-band because the consumer holds the sender's arena: arena
    ``owner``, ``held_bytes`` of its ``max_bytes`` bound, after waiting ``waited_s``."""

    reason: str
    owner: int
    held_bytes: int
    max_bytes: int
    waited_s: float


class SpaceFallback(NamedTuple):
    """Leaves went in-band because arena ``owner`` could not create shared memory
    (``error`` says why: a full /dev/shm, no memory for memfd)."""

    reason: str
    owner: int
    error: str


Fallback = Union[StarvedFallback, SpaceFallback]


class WireHeader(NamedTuple):
    """The codec's part of a message header (see the module docstring)."""

    leaves: list[LeafDesc]
    regions: list[RegionEntry]
    slabs: list[SlabEntry]
    fallback: Fallback | None = None

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able dict the channel sends (one-letter keys, arrays inside)."""
        return header_to_wire(self.leaves, self.regions, self.slabs, self.fallback)

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> "WireHeader":
        """Read a received header dict back into named fields (extra keys are ignored)."""
        fallback = wire.get("w")
        if fallback is not None:
            fallback = (StarvedFallback if fallback[0] == STARVED else SpaceFallback)(*fallback)
        return cls(list(map(leaf_desc, wire["l"])),
                   [RegionEntry(*r) for r in wire["r"]],
                   [SlabEntry(*s) for s in wire.get("s", ())], fallback)
