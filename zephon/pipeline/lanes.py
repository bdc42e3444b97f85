"""The work source: epochs, chunks, canonical lanes and which rank owns which lane.

Epoch ``e`` visits the source in a seeded permutation (``shuffle=True``, the
default of ``Pipeline``), in order, or shard by shard (``shuffle="shards"``: shards
in a seeded order, samples shuffled within windows of W shards,
:mod:`zephon.pipeline.shards`); every order below is used through
:func:`epoch_slice` alone. The permutation is an index bijection
(:func:`zephon.kernels.permute_range`, keyed by ``(seed, e)``) evaluated only at
the positions a chunk reads: nothing of the source's size is ever allocated, so
the first batch, an epoch boundary and a lane's start cost the same for 10^3 or
10^10 samples. Its positions are cut into chunks of
``chunk_size``; chunk ``j`` goes to canonical lane ``j mod C``. A lane's input
is therefore a pure function of (seed, epoch, lane, C, source length): that is
what makes every lane replayable on its own, on any rank.

Within an epoch a lane's samples are numbered by their **lane position**
``p = k * chunk_size + offset`` (``k``: the lane chunk, ``offset``: the place in
it). A lane's unit stream is ``Boundary(e, k)`` markers and :class:`ReadUnit`
s (source indices of one epoch with the lane position of the first one). A
Boundary opens every ``K``-th lane chunk of an epoch (``K =
flush_every_k_chunks``; ``K = 0``: only at the start of each epoch) and
wherever the stream starts. A boundary is a resume point, not a cut: nothing
downstream forms a short batch there.

:func:`lane_units` runs the epochs ``[start epoch, end_epoch)`` of one run (a
*pass*, see :class:`~zephon.pipeline.Pipeline`); it starts at a boundary
(replay: every op sees a segment from its start) or at any lane position
(cursor resume: for lanes whose ops all preserve cursor order, reading resumes
right after the last delivered sample; nothing before it is read again).

:func:`batched_units` (the fused ``read -> map* -> batch``) cuts the lane into
units of exactly one micro-batch, across boundaries and epoch starts: a batch
of two epochs is a :class:`ReadParts`. At a boundary it holds fewer than
``size`` samples, always the lane positions just before the boundary, so its
carry is their count (:func:`positions_before` reads them back on a restore).

Ownership: the dp group ``g`` of ``G`` owns the lanes of ``g``'s contiguous block
(``mapping_strategy="contiguous"``, blocks as equal as possible) or the lanes
``l`` with ``l % G == g`` (``"interleaved"``). Ranks of one dp group read the
same lanes.
"""

from __future__ import annotations

import functools
from typing import Iterator

import numpy as np

from zephon.kernels import order_key, permute_positions, permute_range
from zephon.pipeline.records import Boundary
from zephon.pipeline.shards import ShardShuffle

#: an epoch order: False (source order), True (the global shuffle) or shard windows
Order = bool | ShardShuffle

__all__ = [
    "BatchGroup",
    "Order",
    "ReadParts",
    "ReadUnit",
    "batched_units",
    "epoch_order",
    "epoch_slice",
    "grouped_units",
    "lane_chunk_count",
    "lane_length",
    "lane_source_index",
    "lane_units",
    "owned_lanes",
    "positions_before",
]


class ReadUnit:
    """Source indices to read, all of ``epoch``; ``indices[i]`` sits at lane position
    ``start + i``. Slicing gives a unit of the same epoch with its own start."""

    __slots__ = ("epoch", "indices", "start")

    def __init__(self, epoch: int, start: int, indices: np.ndarray) -> None:
        self.epoch, self.start, self.indices = epoch, start, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, part: slice) -> "ReadUnit":
        first, _, step = part.indices(len(self.indices))
        if step != 1:
            raise ValueError("a read unit is sliced contiguously")
        return ReadUnit(self.epoch, self.start + first, self.indices[part])

    def __reduce__(self):
        indices = self.indices
        if indices.nbytes <= _INLINE_INDEX_BYTES:  # in the pickle: not an array leaf
            return (_unit_from_bytes, (self.epoch, self.start, str(indices.dtype),
                                       indices.tobytes()))
        return (ReadUnit, (self.epoch, self.start, indices))

    def __repr__(self) -> str:
        return f"ReadUnit(epoch={self.epoch}, start={self.start}, n={len(self.indices)})"


class ReadParts:
    """One micro-batch whose samples belong to several epochs (it straddles an epoch
    start): its :class:`ReadUnit` parts, in lane order, read one after the other."""

    __slots__ = ("parts",)

    def __init__(self, parts: list) -> None:
        self.parts = parts

    @property
    def epoch(self) -> int:
        return self.parts[0].epoch

    @property
    def start(self) -> int:
        return self.parts[0].start

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __reduce__(self):
        return (ReadParts, (self.parts,))

    def __repr__(self) -> str:
        return f"ReadParts({self.parts!r})"


class BatchGroup:
    """Consecutive micro-batch read units of one segment that travel to a worker as one
    message; the stage reads and collates each member as its own batch, so the batches
    are exactly those of the members sent one by one."""

    __slots__ = ("units",)

    def __init__(self, units: list) -> None:
        self.units = units

    def __len__(self) -> int:
        return sum(len(u) for u in self.units)

    def __reduce__(self):
        # One array of indices and three lists of ints, not one pickled unit (and one
        # array leaf) per member: a group of hundreds of batches is one small message.
        units = self.units
        indices = np.concatenate([u.indices for u in units]) if units else \
            np.empty(0, dtype=np.int64)
        return (_unpack_group, ([u.epoch for u in units], [u.start for u in units],
                                [len(u.indices) for u in units], indices))

    def __repr__(self) -> str:
        return f"BatchGroup({len(self.units)} units, n={len(self)})"


#: A unit's indices up to this size travel inside the pickled task, not as an array the
#: codec packs into a frame of its own (which cost the consumer's process about 15 us
#: per task of one sample).
_INLINE_INDEX_BYTES = 4096


def _unit_from_bytes(epoch: int, start: int, dtype: str, raw: bytes) -> ReadUnit:
    # A writable array, as the indices of a unit that travelled as an array leaf are: a
    # source's get_batch may work on them in place.
    return ReadUnit(epoch, start, np.frombuffer(bytearray(raw), dtype=dtype))


def _unpack_group(epochs: list, starts: list, lengths: list,
                  indices: np.ndarray) -> BatchGroup:
    """The :class:`BatchGroup` a pickled group stands for (members are views of
    ``indices``)."""
    bounds = np.cumsum([0, *lengths]).tolist()
    return BatchGroup([ReadUnit(e, s, indices[a:b]) for e, s, a, b in
                       zip(epochs, starts, bounds[:-1], bounds[1:], strict=True)])


def epoch_order(n: int, seed: int, epoch: int, shuffle: Order) -> np.ndarray:
    """The whole visiting order of epoch ``epoch`` (``n`` int64 source indices): for
    tests and tools only; the pipeline reads it chunk by chunk with :func:`epoch_slice`
    and never holds it."""
    return epoch_slice(n, seed, epoch, shuffle, 0, n)


def epoch_slice(n: int, seed: int, epoch: int, shuffle: Order, start: int,
                stop: int) -> np.ndarray:
    """Positions ``[start, stop)`` of epoch ``epoch``'s visiting order of ``n`` samples,
    as int64 source indices (``epoch_order(...)[start:stop]``).

    ``shuffle`` is the pipeline's order: False (source order), True (the seeded
    bijection of :func:`zephon.kernels.permute_range` keyed by ``(seed, epoch)``) or a
    :class:`~zephon.pipeline.shards.ShardShuffle` (shards in a seeded order, samples
    shuffled within windows of shards). Only the requested positions are computed, in
    O(stop - start) time and memory whatever ``n`` (plus O(W) per window of shards)."""
    stop = min(stop, n)
    if isinstance(shuffle, ShardShuffle):
        return shuffle.slice(seed, epoch, start, stop)
    if not shuffle:
        return np.arange(start, max(start, stop), dtype=np.int64)
    return permute_range(n, _epoch_key(seed, epoch), start, max(start, stop))


def epoch_positions(n: int, seed: int, epoch: int, shuffle: Order,
                    positions: np.ndarray) -> np.ndarray:
    """The source indices at arbitrary ``positions`` (an int64 array within ``[0, n)``) of
    epoch ``epoch``'s visiting order: ``epoch_order(...)[positions]`` in one call, without
    the order."""
    positions = np.asarray(positions, dtype=np.int64)
    if isinstance(shuffle, ShardShuffle):  # one slice per run of consecutive positions
        if not len(positions):
            return positions.copy()
        cuts = np.flatnonzero(np.diff(positions) != 1) + 1
        runs = np.split(positions, cuts)
        return np.concatenate([shuffle.slice(seed, epoch, int(r[0]), int(r[-1]) + 1)
                               for r in runs]).astype(np.int64, copy=False)
    if not shuffle or n <= 1:
        return positions.copy()
    return permute_positions(n, _epoch_key(seed, epoch), positions)


def lane_lengths(n: int, chunk_size: int, lanes: int) -> np.ndarray:
    """:func:`lane_length` of every lane ``0 .. lanes - 1`` (an int64 array)."""
    lane = np.arange(lanes, dtype=np.int64)
    chunks = -(-n // chunk_size)
    count = np.where(lane >= chunks, 0, -(-(chunks - lane) // lanes))
    last = lane + (count - 1) * lanes
    tail = np.minimum(chunk_size, n - last * chunk_size)
    return np.where(count == 0, 0, (count - 1) * chunk_size + tail)


@functools.lru_cache(maxsize=64)
def _epoch_key(seed: int, epoch: int) -> int:
    return order_key(seed, _ORDER_TAG, epoch)


#: tags the epoch order's key, so that it differs from other orders keyed by the seed
_ORDER_TAG = 0xE9


def lane_chunk_count(n: int, chunk_size: int, lanes: int, lane: int) -> int:
    chunks = -(-n // chunk_size)
    return 0 if lane >= chunks else -(-(chunks - lane) // lanes)


def lane_length(n: int, chunk_size: int, lanes: int, lane: int) -> int:
    """Samples of one epoch that fall to ``lane`` (only the globally last chunk is short)."""
    count = lane_chunk_count(n, chunk_size, lanes, lane)
    if count == 0:
        return 0
    last = lane + (count - 1) * lanes
    return (count - 1) * chunk_size + min(chunk_size, n - last * chunk_size)


def lane_source_index(n: int, seed: int, shuffle: Order, chunk_size: int, lanes: int,
                      lane: int, epoch: int, pos: int) -> int:
    """The source index at lane position ``pos`` of ``epoch`` on ``lane``."""
    k, offset = divmod(pos, chunk_size)
    first = (lane + k * lanes) * chunk_size + offset
    return int(epoch_slice(n, seed, epoch, shuffle, first, first + 1)[0])


def _lane_reads(n: int, seed: int, shuffle: Order, chunk_size: int, lanes: int, lane: int,
                epoch: int, start: int, stop: int) -> list:
    """Read units of lane positions ``[start, stop)`` of ``epoch`` (one per lane chunk)."""
    out = []
    while start < stop:
        k, offset = divmod(start, chunk_size)
        take = min(stop - start, chunk_size - offset)
        first = (lane + k * lanes) * chunk_size + offset
        out.append(ReadUnit(epoch, start, epoch_slice(n, seed, epoch, shuffle, first,
                                                      first + take)))
        start += take
    return out


def positions_before(n: int, seed: int, shuffle: Order, chunk_size: int, lanes: int,
                     lane: int, epoch: int, pos: int, count: int) -> list:
    """Read units of the ``count`` lane positions just before position ``pos`` of
    ``epoch``, in lane order (back across epoch starts when needed); fewer when the lane
    has fewer before epoch 0."""
    length = lane_length(n, chunk_size, lanes, lane)
    out: list = []
    while count > 0 and epoch >= 0 and length:
        take = min(count, pos)
        out[:0] = _lane_reads(n, seed, shuffle, chunk_size, lanes, lane, epoch, pos - take,
                              pos)
        count -= take
        epoch, pos = epoch - 1, length
    return out


_START = Boundary(0, 0)  # the stream of a lane from its very beginning


def lane_units(n: int, seed: int, shuffle: Order, chunk_size: int, lanes: int, lane: int,
               flush_every: int, end_epoch: int | None,
               start: Boundary = _START, start_pos: int | None = None) -> Iterator:
    """The lane's units from ``start`` (a boundary) up to the end of epoch
    ``end_epoch - 1`` (None: for ever), or from lane position ``start_pos`` of epoch
    ``start.epoch`` when it is given (positions past the epoch's end move on to the next
    epoch)."""
    epoch, k0 = start.epoch, start.k
    offset = 0
    if start_pos is not None:
        k0, offset = divmod(start_pos, chunk_size)
        if start_pos >= lane_length(n, chunk_size, lanes, lane):
            epoch, k0, offset = epoch + 1, 0, 0
    while end_epoch is None or epoch < end_epoch:
        count = lane_chunk_count(n, chunk_size, lanes, lane)
        if count == 0 and end_epoch is None:
            return  # an empty lane stays empty: never spin through endless epochs
        for k in range(k0, count):
            if k == k0 or (flush_every and k % flush_every == 0):
                yield Boundary(epoch, k)
            j = lane + k * lanes
            indices = epoch_slice(n, seed, epoch, shuffle, j * chunk_size + offset,
                                  (j + 1) * chunk_size)
            yield ReadUnit(epoch, k * chunk_size + offset, indices)
            offset = 0
        epoch, k0, offset = epoch + 1, 0, 0


def _joined(parts: list):
    """One unit of consecutive read parts: a ReadUnit when they are of one epoch."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if all(p.epoch == first.epoch for p in parts):
        return ReadUnit(first.epoch, first.start, np.concatenate([p.indices for p in parts]))
    runs: list = []
    for p in parts:
        if runs and runs[-1][-1].epoch == p.epoch:
            runs[-1].append(p)
        else:
            runs.append([p])
    return ReadParts([_joined(run) for run in runs])


def batched_units(units: Iterator, size: int, drop_last: bool, held: list | None = None,
                  track: bool = False) -> Iterator:
    """Regroup a lane's read units into units of exactly ``size`` samples, each one
    micro-batch: consecutive samples fill batches in lane order, across Boundary markers
    and epoch starts; only the remainder at the end of the stream is a partial batch
    (dropped with ``drop_last``). Exactly the batches a ``batch(size, drop_last)``
    accumulator forms from a 1:1 stream, cut before the samples are read, so that a
    worker can read, map and collate a whole batch.

    A marker passes on before the batch it falls in; with ``track`` it records the count
    of samples held there in its carry. ``held`` (read units) is what a restore puts
    back: the samples the boundary it starts at held."""
    parts: list = list(held or [])
    count = sum(len(p) for p in parts)
    for unit in units:
        if isinstance(unit, Boundary):
            yield unit._replace(carry=(*unit.carry, count)) if track else unit
            continue
        offset = 0
        while offset < len(unit):
            take = min(size - count, len(unit) - offset)
            parts.append(unit[offset:offset + take])
            count += take
            offset += take
            if count == size:
                yield _joined(parts)
                parts, count = [], 0
    if parts and not (drop_last and count < size):
        yield _joined(parts)


def grouped_units(units: Iterator, per_group: int, first: int = 4) -> Iterator:
    """Pack the micro-batch units of :func:`batched_units` into :class:`BatchGroup` s of
    ``per_group`` units, never across a Boundary marker (what is held is sent before the
    marker). The lane's first groups ramp up from ``first`` units, doubling, so that
    the first batches arrive early while the steady state sends full groups. A
    transport choice only: the batches, their order and the markers' places are
    unchanged. ``per_group <= 1`` passes the units through."""
    if per_group <= 1:
        yield from units
        return
    size = max(1, min(first, per_group))
    held: list = []
    for unit in units:
        if isinstance(unit, ReadUnit):  # a ReadParts (two epochs) travels on its own
            held.append(unit)
            if len(held) >= size:
                yield held[0] if len(held) == 1 else BatchGroup(held)
                held = []
                size = min(per_group, 2 * size)
            continue
        if held:
            yield held[0] if len(held) == 1 else BatchGroup(held)
            held = []
        yield unit
    if held:
        yield held[0] if len(held) == 1 else BatchGroup(held)


def owned_lanes(lanes: int, groups: int, group: int, strategy: str) -> list[int]:
    if strategy == "interleaved":
        return [lane for lane in range(lanes) if lane % groups == group]
    base, extra = divmod(lanes, groups)
    start = group * base + min(group, extra)
    return list(range(start, start + base + (1 if group < extra else 0)))
