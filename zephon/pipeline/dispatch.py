"""Dispatch: how a lane's units go to a parallel stage's executor and come back in order.

:func:`ordered_map` owns one lane of one stage. It pulls units (and Boundary
markers) from upstream, cuts each unit into **dispatch parts**, submits parts
to the executor ahead of need, and yields results in sequence order (the
``ReorderBuffer`` kernel), markers in their place.

Dispatch parts are sized for the transport, not for determinism: ``chunk_size``
decides which samples form a lane (and so the stream); how many of them travel
in one message decides only speed and memory. Cutting a unit never changes
what comes out, because every stateless op works sample by sample and the
serial accumulators downstream see the records in the same order either way.
A part aims at :data:`DISPATCH_TARGET_BYTES` of output, estimated from the
results seen so far (until the first result arrives, parts hold one sample);
with several workers a large unit is cut into at least as many parts as there
are workers, so that all of them get work. Units are not cut where the stage
must see them whole: a batch-shape sensitive op (``map_batch``), a stage that
collates batches itself (a fused ``batch``), or when latency flush is not
allowed (``allow_latency_flush_in_deterministic=False``).

Bounds (per lane and stage): at most ``depth`` parts and ``op_queue_capacity``
items in flight (always at least one part), and sequence numbers never further
ahead of the oldest unfinished part than the reorder window, so a slow
head-of-line part stalls the lookahead instead of letting finished results
pile up behind it.

``deterministic=False``: results are released in completion order (markers
still keep their place).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Iterator

import numpy as np

from zephon.kernels import ReorderBuffer
from zephon.pipeline.lanes import BatchGroup
from zephon.pipeline.ops import Boundary

__all__ = ["ordered_map", "DISPATCH_TARGET_BYTES", "approx_nbytes"]

#: Output bytes one dispatch part aims at: large enough that per-message costs vanish,
#: small enough that a part fits the worker's shared-memory arena many times over and the
#: first result arrives early.
DISPATCH_TARGET_BYTES = 4 << 20


def approx_nbytes(value: Any, depth: int = 0) -> int:
    """Payload bytes of a sample: arrays, tensors and bytes, a few levels into dicts,
    lists and tuples (a cheap estimate: it never walks large containers element by
    element beyond the first 64 entries)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    nbytes = getattr(value, "nbytes", None)  # torch tensors and other array types
    if isinstance(nbytes, int):
        return nbytes
    if depth >= 3:
        return 0
    if isinstance(value, dict):
        return sum(approx_nbytes(v, depth + 1) for v in list(value.values())[:64])
    if isinstance(value, (list, tuple)):
        head = value[:64]
        total = sum(approx_nbytes(v, depth + 1) for v in head)
        return total * len(value) // max(1, len(head))
    return 0


def _items_in(part, stage) -> int:
    """Items a part puts in flight: its samples, or its batches for a stage that collates
    (one per micro-batch unit, one per member of a :class:`BatchGroup`)."""
    if stage.collates:
        return len(part.units) if isinstance(part, BatchGroup) else 1
    return len(part)


def ordered_map(executor, stage, upstream: Iterator, lane: int, deterministic: bool,
                stats=None) -> Iterator:
    """The results of ``stage`` over one lane's units, in sequence order (see the module
    docstring)."""
    depth, item_cap, workers = stage.depth, stage.item_cap, max(1, stage.workers)
    window = 2 * depth * workers + 8
    buffer = ReorderBuffer(window)
    seq = inflight = items = 0
    sizes: dict[int, int] = {}
    sent: dict[int, float] = {}
    parts: collections.deque = collections.deque()  # the current unit's parts not yet sent
    node = f"stage{stage.index}"
    exhausted = False
    per_item: float | None = None  # output bytes per input sample, from results seen
    # An inline executor runs a part when it is submitted: hand over what is ready first,
    # so that nothing is read before it is needed.
    eager = stage.runner != "inline"
    cut = stage.split

    def part_size(n: int) -> int:
        if not cut or n <= 1:
            return n
        if per_item is None:
            return 1  # until a result says how large this stage's output is
        size = max(1, int(DISPATCH_TARGET_BYTES // max(per_item, 1.0)))
        if workers > 1:
            size = min(size, math.ceil(n / workers))
        return min(size, n)

    while True:
        if not eager:
            for out in buffer.pop_ready():
                yield out
        while inflight < depth and (inflight == 0 or items < item_cap) \
                and seq + 2 - buffer.cursor <= window:
            if not parts:
                if exhausted:
                    break
                try:
                    unit = next(upstream)
                except StopIteration:
                    exhausted = True
                    break
                if unit is None:  # a placeholder of an earlier non-deterministic stage
                    continue
                if isinstance(unit, Boundary):
                    buffer.push(seq, unit)
                    seq += 1
                    continue
                size = part_size(len(unit))
                if size >= len(unit):
                    parts.append(unit)
                else:
                    parts.extend(unit[i:i + size] for i in range(0, len(unit), size))
            part = parts.popleft()
            if stats is not None:
                stats.submitted(node, len(part))
                sent[seq] = time.perf_counter()
            executor.submit(lane, seq, (stage.index, part))
            sizes[seq] = _items_in(part, stage)
            items += sizes[seq]
            seq += 1
            inflight += 1
        for out in buffer.pop_ready():
            yield out
        if inflight == 0:
            if exhausted and not parts:
                return
            continue
        done_seq, result = executor.get(lane)
        inflight -= 1
        consumed = sizes.pop(done_seq)
        items -= consumed
        if result and consumed:
            per_item = approx_nbytes(result[0].value) * len(result) / consumed
        if stats is not None:
            stats.completed(node, len(result), time.perf_counter() - sent.pop(done_seq))
        if deterministic:
            buffer.push(done_seq, result)
        else:
            yield result
            buffer.push(done_seq, None)  # keeps markers in place; None is skipped below
