"""The bit layout of slab ids and region tokens: the one place that packs and unpacks them.

A **region token** names one live allocation in a shared-memory slab. It travels in
message headers, keys the lease tables of both processes, comes back in FREE messages,
and is handed to the kernels as an ``int64`` region id, so it must stay a
non-negative signed 64-bit integer. Its 63 usable bits are, high to low::

    | owner (7) | slab index (16) | offset (40) |
      62..56      55..40            39..0

- **owner** (``1..MAX_OWNER``, 127): ``1 + worker index`` of the arena that made the
  slab (0 is never used, so no token is 0). Seven bits because the eighth would be
  the int64 sign bit: this bound is what limits a pool to 127 workers.
- **slab index** (``0..MAX_SLAB_INDEX``): which of the owner's slabs. A restarted
  worker takes a fresh index range, so tokens of a dead worker's slabs never
  collide with its successor's.
- **offset** (``0..MAX_OFFSET``, 1 TiB - 1): the region's byte offset in its slab.

A **slab id** is the top two fields alone, ``owner << 16 | index``; a token is
``slab_id << 40 | offset``. Packing validates every field and raises
:class:`~zephon.errors.ZephonConfigError` (a ``ValueError``) naming the field, the
value and the allowed range; unpacking is plain shifts and masks (the hot path).

Example::

    >>> sid = pack_slab_id(3, 2)
    >>> token = region_token(sid, 4096)
    >>> unpack_token(token)
    TokenFields(owner=3, slab_index=2, offset=4096)
"""

from __future__ import annotations

from typing import NamedTuple

from zephon.errors import ZephonConfigError

__all__ = [
    "INDEX_BITS",
    "MAX_OFFSET",
    "MAX_OWNER",
    "MAX_SLAB_INDEX",
    "OFFSET_BITS",
    "OWNER_BITS",
    "SLAB_INDICES",
    "TokenFields",
    "check_owner",
    "pack_slab_id",
    "region_token",
    "slab_index",
    "slab_owner",
    "token_offset",
    "token_slab",
    "unpack_token",
]

OWNER_BITS = 7
INDEX_BITS = 16
OFFSET_BITS = 40
assert OWNER_BITS + INDEX_BITS + OFFSET_BITS == 63  # one sign bit left: tokens fit int64

MAX_OWNER = (1 << OWNER_BITS) - 1
MAX_SLAB_INDEX = (1 << INDEX_BITS) - 1
MAX_OFFSET = (1 << OFFSET_BITS) - 1
SLAB_INDICES = 1 << INDEX_BITS  # slab indices per owner

_INDEX_MASK = MAX_SLAB_INDEX
_OFFSET_MASK = MAX_OFFSET


class TokenFields(NamedTuple):
    """The three fields of a region token (see the module docstring)."""

    owner: int
    slab_index: int
    offset: int


def _check(name: str, value: int, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:
        raise ZephonConfigError(
            f"region token field {name} must be an int in [{low}, {high}], got {value!r}",
            field=name)


def check_owner(owner: int) -> int:
    """``owner`` if it is a valid arena owner (``1..MAX_OWNER``), else
    :class:`~zephon.errors.ZephonConfigError`.

    Example: ``check_owner(128)`` raises (the owner field has 7 bits)."""
    _check("owner", owner, 1, MAX_OWNER)
    return owner


def pack_slab_id(owner: int, index: int) -> int:
    """The slab id of slab ``index`` of arena ``owner`` (both validated)."""
    _check("owner", owner, 1, MAX_OWNER)
    _check("slab index", index, 0, MAX_SLAB_INDEX)
    return owner << INDEX_BITS | index


def slab_owner(slab: int) -> int:
    """The owner (``1 + worker index``) of slab id ``slab``."""
    return slab >> INDEX_BITS


def slab_index(slab: int) -> int:
    """The index of slab id ``slab`` among its owner's slabs."""
    return slab & _INDEX_MASK


def region_token(slab: int, offset: int) -> int:
    """The token of the region at byte ``offset`` of slab id ``slab`` (both validated).

    Example: ``region_token(pack_slab_id(1, 0), 64) == 1 << 56 | 64``."""
    _check("slab id", slab, 1 << INDEX_BITS, (MAX_OWNER << INDEX_BITS) | MAX_SLAB_INDEX)
    _check("offset", offset, 0, MAX_OFFSET)
    return slab << OFFSET_BITS | offset


def token_slab(token: int) -> int:
    """The slab id of region ``token``."""
    return token >> OFFSET_BITS


def token_offset(token: int) -> int:
    """The byte offset of region ``token`` in its slab."""
    return token & _OFFSET_MASK


def unpack_token(token: int) -> TokenFields:
    """All three fields of region ``token``."""
    return TokenFields(token >> (OFFSET_BITS + INDEX_BITS),
                       (token >> OFFSET_BITS) & _INDEX_MASK, token & _OFFSET_MASK)
