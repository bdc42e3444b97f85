"""The transport's configuration: everything a :class:`~zephon.transport.pool.WorkerPool`
reads, resolved and frozen.

A :class:`PoolConfig` is made once per run by the layer that owns the options (the
pipeline's engine, :func:`zephon.pipeline.engine.pool_config`), or directly by a
caller of a bare pool; the transport never reads the user's options itself. Its
defaults are those of a default :class:`~zephon.RuntimeOptions` on this machine (the
prefetch a default run resolves from the CPU count, and worker timing on where
``$ZEPHON_EXECUTION_TRACKING`` asks for it), so ``WorkerPool(handler, n)`` behaves as a
pool made from default options.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass, field
from typing import Any

from zephon.options.metrics import effective_tracking
from zephon.options.resolve import default_prefetch_batches
from zephon.transport.budget import default_arena_bytes
from zephon.transport.codec import ShmPolicy

__all__ = ["PoolConfig"]


@dataclass(frozen=True)
class PoolConfig:
    """What a pool and its workers read (see the module docstring).

    - ``transport``: ``"socketpair"`` or ``"pipe"`` (the channels' kind);
    - ``buffer_bytes``: the kernel buffer asked for each socketpair channel;
    - ``mp_context``: the start method's context (spawn by default);
    - ``shutdown_mode``: ``"immediate"``, ``"hard"`` or ``"graceful"``
      (:meth:`WorkerPool.close <zephon.transport.pool.WorkerPool.close>`);
    - ``policy``: what goes through shared memory (:class:`~zephon.transport.codec.ShmPolicy`);
    - ``timing``: workers time their tasks and send the figures with each result
      (execution tracking, or the autotune controller, reads them);
    - ``inflight_per_worker``: tasks a worker may have in flight;
    - ``arena_bytes``: each worker's arena bound (None: :attr:`arena_bound`'s default);
    - ``prefetch_batches``: the consumer's prefetch, resolved (a bare pool's default
      arena bound keeps room for half of it);
    - ``spawn_timeout_s``, ``arena_wait_timeout_s``: how long a worker may take to
      start, and how long it waits for arena space before sending in-band.
    """

    transport: str = "socketpair"
    buffer_bytes: int = 512 << 10
    mp_context: Any = field(default_factory=lambda: multiprocessing.get_context("spawn"))
    shutdown_mode: str = "immediate"
    policy: ShmPolicy = field(default_factory=ShmPolicy)
    timing: bool = field(default_factory=lambda: effective_tracking("off") != "off")
    inflight_per_worker: int = 4
    arena_bytes: int | None = None
    prefetch_batches: int = field(default_factory=default_prefetch_batches)
    spawn_timeout_s: float = 60.0
    arena_wait_timeout_s: float = 1.0

    @property
    def arena_bound(self) -> int:
        """Each worker's arena bound: ``arena_bytes``, else a bare pool's default
        (:func:`~zephon.transport.budget.default_arena_bytes`)."""
        if self.arena_bytes:
            return self.arena_bytes
        return default_arena_bytes(self.policy.max_coalesced_bytes, self.prefetch_batches,
                                   self.inflight_per_worker)
