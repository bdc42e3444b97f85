"""The work source: epochs, chunks, canonical lanes and which rank owns which lane.

Epoch ``e`` visits the source in a seeded permutation (``shuffle=True``) or in
order. Its positions are cut into chunks of ``chunk_size``; chunk ``j`` goes to
canonical lane ``j mod C``. A lane's input is therefore a pure function of
(seed, epoch, lane, C, source length): that is what makes every lane
replayable on its own, on any rank.

A lane's unit stream is ``Boundary(e, k)`` markers and read units (lists of
``(index, epoch)``): a Boundary opens every ``K``-th lane chunk of an epoch
(``K = flush_every_k_chunks``; ``K = 0``: only at the start of each epoch).
:func:`lane_units` can start at any boundary, which is how restore replays.

Ownership: the dp group ``g`` of ``G`` owns the lanes ``g``'s contiguous block
(``mapping_strategy="contiguous"``, blocks as equal as possible) or the lanes
``l`` with ``l % G == g`` (``"interleaved"``). Ranks of one dp group read the
same lanes.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from zephon.pipeline.ops import Boundary

__all__ = ["epoch_order", "lane_units", "owned_lanes", "lane_chunk_count"]


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, 0xE9, epoch]).permutation(n).astype(np.int64)


def lane_chunk_count(n: int, chunk_size: int, lanes: int, lane: int) -> int:
    chunks = -(-n // chunk_size)
    return 0 if lane >= chunks else -(-(chunks - lane) // lanes)


def lane_units(n: int, seed: int, shuffle: bool, chunk_size: int, lanes: int, lane: int,
               flush_every: int, num_epochs: int | None,
               start: Boundary = Boundary(0, 0)) -> Iterator:
    epoch, k0 = start
    while num_epochs is None or epoch < num_epochs:
        count = lane_chunk_count(n, chunk_size, lanes, lane)
        if count == 0 and num_epochs is None:
            return  # an empty lane stays empty: never spin through endless epochs
        order = epoch_order(n, seed, epoch, shuffle) if count else None
        for k in range(k0, count):
            if k == k0 or (flush_every and k % flush_every == 0) or k == 0:
                yield Boundary(epoch, k)
            j = lane + k * lanes
            indices = order[j * chunk_size:(j + 1) * chunk_size]
            yield [(int(i), epoch) for i in indices]
        epoch, k0 = epoch + 1, 0


def owned_lanes(lanes: int, groups: int, group: int, strategy: str) -> list[int]:
    if strategy == "interleaved":
        return [lane for lane in range(lanes) if lane % groups == group]
    base, extra = divmod(lanes, groups)
    start = group * base + min(group, extra)
    return list(range(start, start + base + (1 if group < extra else 0)))
