"""The memory budget: the one owner of how a worker's shared-memory arena is shared out.

Every process worker owns an arena (:class:`~zephon.transport.arena.ShmArena`)
whose recycled slabs never exceed its **bound**. Whatever holds bytes of those
slabs has a part of the bound, and the parts add up to the bound exactly:

- **lanes** (a fifth): results a stage's lanes have in flight or waiting to be
  reordered, shared by the lanes the rank owns (each lane's ``budget_bytes``,
  enforced by :mod:`zephon.pipeline.dispatch`);
- **prefetch** (a fifth): items in the consumer-side prefetch queue
  (``Plan.prefetch_bytes``, enforced by the iterator's handoff);
- **heap** (a fifth): regions the worker's shared heap
  (:mod:`zephon.transport.heap`) holds and has not sent. The arena keeps this
  part free of messages: messages hold at most :attr:`MemoryBudget.message_bytes`
  (the bound less the heap's part), the heap at most its part, and the slabs
  never grow past the bound;
- **consumer** (the rest, two fifths): what the training loop and the serial
  ops (``batch``, ``pack_tokens``) hold.

So of what messages may hold, the lanes and the prefetch queue have a quarter
each and the consumer half, and the heap has a quarter of that room on top of
it (inside the bound).

One part is always allowed whatever its size (a lane's one part, a queue's one
item), so an item larger than a part still flows; a message larger than
:attr:`MemoryBudget.message_bytes` gets a dedicated slab of its own, outside the
bound, unmapped when it comes back (see :mod:`zephon.transport.arena`).

The bound itself: a pipeline's process stage uses :func:`pipeline_budget`
(at least :data:`PIPELINE_ARENA_BYTES`), a bare ``WorkerPool``
:func:`default_arena_bytes` (room for the messages a worker may have in flight
and the heap's part on top), or the ``arena_bytes`` of its
:class:`~zephon.transport.config.PoolConfig`. The caller passes every figure these
functions need, resolved (the consumer's prefetch, the message size): nothing here
reads the user's options. The worker's
arena splits whatever bound it gets with :func:`split_arena`. Slabs are created
only as regions need them, so a high bound costs memory only while it is used.

Slab indices are budgeted here too: a worker slot's arena uses the
:data:`SLABS_PER_GENERATION` indices from ``generation * SLABS_PER_GENERATION``,
so a restarted worker never reuses a dead one's slab ids.

A :class:`MemoryBudget` is immutable and made by the functions below; nothing
else divides an arena bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from zephon.errors import ZephonConfigError
from zephon.transport.tokens import SLAB_INDICES

__all__ = [
    "PIPELINE_ARENA_BYTES",
    "SLABS_PER_GENERATION",
    "MemoryBudget",
    "arena_bytes_for",
    "default_arena_bytes",
    "pipeline_budget",
    "split_arena",
]

#: The parts of the bound, as divisors: lanes, prefetch and heap a fifth each (the
#: consumer has the rest).
LANES_DIVISOR = 5
PREFETCH_DIVISOR = 5
HEAP_DIVISOR = 5
#: Arena bound per worker of a pipeline's process stage (at least what a bare pool would
#: choose): its lanes' part (256 MiB) lets large results wait in the pipeline's own queues
#: without ever filling the arena, and messages have 1 GiB of it.
PIPELINE_ARENA_BYTES = 5 * (256 << 20)
#: Slab indices of one worker generation (a restarted worker takes the next range).
SLABS_PER_GENERATION = 256
#: The least room for messages of a bare pool's arena, and a message's size when
#: ``shm_max_coalesced_bytes`` is not set.
MIN_POOL_ARENA_BYTES = 64 << 20
DEFAULT_MESSAGE_BYTES = 64 << 20

assert SLAB_INDICES % SLABS_PER_GENERATION == 0


@dataclass(frozen=True)
class MemoryBudget:
    """The split of one worker's arena bound ``arena_bytes`` (see the module docstring):
    ``lanes_bytes`` shared by ``lanes`` lanes, ``prefetch_bytes``, ``heap_bytes``; the
    consumer has the rest. The parts never add up to more than the bound."""

    arena_bytes: int
    lanes: int
    lanes_bytes: int
    prefetch_bytes: int
    heap_bytes: int

    def __post_init__(self) -> None:
        if self.lanes < 1:
            raise ZephonConfigError(f"a memory budget needs at least one lane, got {self.lanes}")
        parts = {"lanes_bytes": self.lanes_bytes, "prefetch_bytes": self.prefetch_bytes,
                 "heap_bytes": self.heap_bytes}
        negative = {k: v for k, v in parts.items() if v < 0}
        if negative or sum(parts.values()) > self.arena_bytes:
            raise ZephonConfigError(f"memory budget parts {parts} do not fit the arena bound "
                                    f"of {self.arena_bytes} bytes")

    @property
    def consumer_bytes(self) -> int:
        """What is left for the consumer to hold (the training loop, the serial ops)."""
        return self.arena_bytes - self.lanes_bytes - self.prefetch_bytes - self.heap_bytes

    @property
    def lane_bytes(self) -> int:
        """Output bytes one lane may have in flight or waiting to be reordered (at least
        one: a lane's first part is always allowed anyway)."""
        return max(1, self.lanes_bytes // self.lanes)

    @property
    def message_bytes(self) -> int:
        """What messages (regions sent, or being sent, to the consumer) may hold: the
        bound less the heap's part."""
        return self.arena_bytes - self.heap_bytes

    def describe(self) -> str:
        """One line for ``explain()``: the bound and its parts, in MiB."""
        def mib(n: int) -> str:
            return f"{n / (1 << 20):g} MiB"

        return (f"memory: arena bound {mib(self.arena_bytes)}/worker = lanes "
                f"{mib(self.lanes_bytes)} ({mib(self.lane_bytes)} x {self.lanes} lane(s) in "
                f"flight) + prefetch {mib(self.prefetch_bytes)} + heap "
                f"{mib(self.heap_bytes)} (worker arrays not sent) + consumer "
                f"{mib(self.consumer_bytes)} (what the loop and serial ops hold)")


def split_arena(arena_bytes: int, lanes: int = 1) -> MemoryBudget:
    """The budget of an arena bound of ``arena_bytes`` whose lanes' part ``lanes`` lanes
    share. Example: ``split_arena(PIPELINE_ARENA_BYTES).heap_bytes == 256 << 20``."""
    if arena_bytes < 1:
        raise ZephonConfigError(f"an arena bound must be at least one byte, got {arena_bytes}")
    return MemoryBudget(arena_bytes, max(1, lanes), arena_bytes // LANES_DIVISOR,
                        arena_bytes // PREFETCH_DIVISOR, arena_bytes // HEAP_DIVISOR)


def arena_bytes_for(message_bytes: int) -> int:
    """The least bound whose messages may hold ``message_bytes``: that room and the heap's
    part on top. Example: ``arena_bytes_for(64 << 20) == 80 << 20``."""
    # bound - bound // HEAP_DIVISOR >= message_bytes
    return message_bytes + message_bytes // (HEAP_DIVISOR - 1)


def default_arena_bytes(message_bytes: int | None, prefetch_batches: int,
                        inflight_per_worker: int) -> int:
    """A bare pool's arena bound per worker: messages' room for the tasks a worker may
    have in flight plus its share of the consumer's prefetch (``prefetch_batches``,
    resolved by the caller), each up to ``message_bytes`` (``shm_max_coalesced_bytes``;
    64 MiB when None), at least 64 MiB; and the heap's part on top of that room
    (:func:`arena_bytes_for`). Example: ``default_arena_bytes(16 << 20, 8, 4) == 160 << 20``."""
    per_message = message_bytes or DEFAULT_MESSAGE_BYTES
    slots = inflight_per_worker + max(2, prefetch_batches // 2)
    return arena_bytes_for(max(MIN_POOL_ARENA_BYTES, slots * per_message))


def pipeline_budget(lanes: int, inflight_per_worker: int, prefetch_batches: int,
                    message_bytes: int | None = None) -> MemoryBudget:
    """The budget of every process worker of a pipeline run on a rank owning ``lanes``
    lanes, ``inflight_per_worker`` tasks in flight per worker, the consumer's prefetch of
    ``prefetch_batches`` (resolved) and messages of up to ``message_bytes``
    (``shm_max_coalesced_bytes``): a bound of at least :data:`PIPELINE_ARENA_BYTES`."""
    bound = max(default_arena_bytes(message_bytes, prefetch_batches, inflight_per_worker),
                PIPELINE_ARENA_BYTES)
    return split_arena(bound, lanes)
