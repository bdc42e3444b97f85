"""Reference (pure Python/NumPy) buffer packing: the specification of ``kernels/pack.pyx``.

Callers: :class:`zephon.transport.codec.Encoder` (``pack_plan`` + ``pack_copy``
into arena regions, ``_to_regions``, and into in-band frames, ``_packed_frames``).
The receiving side needs no kernel: the codec's decoder builds one ``np.ndarray``
view per leaf from its descriptor (a compiled ``rebuild`` for that step is slower
than that, so there is none).

Two steps, each a function with the same signature in the compiled kernel:

``pack_plan(leaves, min_item_bytes, coalesce, max_coalesced_bytes,
min_new_allocation_bytes, alignment=64) -> PackPlan``
    Decide, for the leaves of one message, which travel in-band and how the
    others group into destination buffers:

    1. a leaf that is not an array (numpy array, bytes, bytearray, memoryview)
       (numpy scalars count as 0-d arrays) is a ``TypeError``; a leaf whose dtype holds Python objects, or whose
       itemsize is zero, or with fewer than ``min_item_bytes`` bytes, travels
       in-band;
    2. with ``coalesce``, eligible leaves are grouped by dtype (its exact
       :func:`~zephon.kernels.types.dtype_token`, fields included) in
       leaf order. A leaf is placed at the group's end rounded up to
       ``alignment``; when that placement would make the group larger than
       ``max_coalesced_bytes`` the group closes and a new one of that dtype
       opens. A leaf larger than ``max_coalesced_bytes`` stands alone in its own
       group (the open group stays open). Without ``coalesce`` every eligible
       leaf is its own group. Groups are numbered in the order they open;
    3. a group whose useful bytes (sum of its leaves' bytes) are fewer than
       ``min_new_allocation_bytes`` is dissolved: its leaves travel in-band,
       and the remaining groups are renumbered in order.

``pack_copy(leaves, plan, buffers) -> None``
    Write every buffer leaf into ``buffers[group]`` at its offset, as a
    C-contiguous copy (any source strides: negative, zero, 0-d, empty). A
    destination must be writable (``TypeError``) and hold ``group_nbytes`` bytes
    (``ValueError``).

"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from zephon.kernels.types import (
    Descriptor,
    PackPlan,
    align_up,
    check_pack_args,
    dtype_token,
)

__all__ = ["as_leaf_array", "pack_copy", "pack_plan"]


def as_leaf_array(leaf: Any, index: int) -> np.ndarray:
    """The ndarray a leaf stands for (bytes-likes become uint8 views, no copy)."""
    if isinstance(leaf, np.ndarray):
        return leaf
    if isinstance(leaf, (bytes, bytearray)):
        return np.frombuffer(leaf, dtype=np.uint8)
    if isinstance(leaf, (memoryview, np.generic)):
        return np.asarray(leaf)
    raise TypeError(
        f"pack_plan: leaf {index} is a {type(leaf).__name__}; expected a numpy array, bytes, "
        "bytearray or memoryview")


def _eligible(array: np.ndarray, min_item_bytes: int) -> bool:
    return (not array.dtype.hasobject and array.dtype.itemsize > 0
            and array.nbytes >= min_item_bytes)


def pack_plan(leaves: Sequence[Any], min_item_bytes: int, coalesce: bool,
              max_coalesced_bytes: int | None, min_new_allocation_bytes: int,
              alignment: int = 64) -> PackPlan:
    check_pack_args(min_item_bytes, coalesce, max_coalesced_bytes, min_new_allocation_bytes,
                    alignment)
    n = len(leaves)
    arrays = [as_leaf_array(leaf, i) for i, leaf in enumerate(leaves)]
    nbytes = [int(a.nbytes) for a in arrays]
    cap = max_coalesced_bytes

    groups: list[dict] = []  # {"dtype", "end", "useful", "members": [(leaf, offset)]}
    open_group: dict[str, int] = {}  # dtype str -> index of its open group

    def new_group(dtype: str) -> int:
        groups.append({"dtype": dtype, "end": 0, "useful": 0, "members": []})
        return len(groups) - 1

    def place(g: int, i: int) -> None:
        group = groups[g]
        offset = align_up(group["end"], alignment) if group["members"] else 0
        group["members"].append((i, offset))
        group["end"] = offset + nbytes[i]
        group["useful"] += nbytes[i]

    for i, array in enumerate(arrays):
        if not _eligible(array, min_item_bytes):
            continue
        dtype = dtype_token(array.dtype)
        if not coalesce or (cap is not None and nbytes[i] > cap):
            place(new_group(dtype), i)
            continue
        g = open_group.get(dtype)
        if g is not None and groups[g]["members"] and cap is not None:
            if align_up(groups[g]["end"], alignment) + nbytes[i] > cap:
                g = None
        if g is None:
            g = open_group[dtype] = new_group(dtype)
        place(g, i)

    leaf_group = [-1] * n
    leaf_offset = [0] * n
    group_nbytes: list[int] = []
    group_dtype: list[str] = []
    for group in groups:
        if group["useful"] < min_new_allocation_bytes:
            continue
        g = len(group_dtype)
        group_dtype.append(group["dtype"])
        group_nbytes.append(group["end"])
        for i, offset in group["members"]:
            leaf_group[i], leaf_offset[i] = g, offset

    descriptors = [
        None if leaf_group[i] < 0 else
        Descriptor(leaf_group[i], leaf_offset[i], dtype_token(arrays[i].dtype),
                   tuple(arrays[i].shape))
        for i in range(n)
    ]
    return PackPlan(leaf_group, leaf_offset, nbytes, group_nbytes, group_dtype, descriptors)


def _check_plan(leaves: Sequence[Any], plan: PackPlan, buffers: Sequence[Any]) -> list:
    if len(leaves) != len(plan):
        raise ValueError(f"pack_copy: {len(leaves)} leaves but the plan has {len(plan)}")
    if len(buffers) != plan.n_groups:
        raise ValueError(f"pack_copy: {len(buffers)} buffers but the plan has "
                         f"{plan.n_groups} groups")
    views = []
    for g, buffer in enumerate(buffers):
        view = memoryview(buffer)
        if view.readonly:
            raise TypeError(f"pack_copy: buffer {g} is read-only")
        if view.nbytes < plan.group_nbytes[g]:
            raise ValueError(f"pack_copy: buffer {g} holds {view.nbytes} bytes, the plan needs "
                             f"{int(plan.group_nbytes[g])}")
        views.append(np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B"
                                   else view, dtype=np.uint8))
    return views


def pack_copy(leaves: Sequence[Any], plan: PackPlan, buffers: Sequence[Any]) -> None:
    views = _check_plan(leaves, plan, buffers)
    for i, leaf in enumerate(leaves):
        g = int(plan.leaf_group[i])
        if g < 0:
            continue
        src = as_leaf_array(leaf, i)
        if int(src.nbytes) != int(plan.leaf_nbytes[i]):
            raise ValueError(f"pack_copy: leaf {i} has {src.nbytes} bytes, the plan says "
                             f"{int(plan.leaf_nbytes[i])}")
        offset = int(plan.leaf_offset[i])
        dest = views[g][offset:offset + src.nbytes].view(src.dtype).reshape(src.shape)
        np.copyto(dest, src, casting="no")

