"""Process transport: channels, shared-memory arena, payload codec, worker pool.

See :mod:`zephon.transport.pool` for the lifecycle (:mod:`zephon.transport.worker`
for the worker process), :mod:`zephon.transport.arena`
for the shared-memory design and :mod:`zephon.transport.codec` for the
per-message policy.
"""

from zephon.transport.arena import memfd_available, sweep_stale_segments
from zephon.transport.channel import Channel, ChannelClosed, channel_pair
from zephon.transport.codec import Decoder, Encoder, PeerState, ShmPolicy
from zephon.transport.pool import TaskResult, WorkerPool

__all__ = [
    "Channel", "ChannelClosed", "Decoder", "Encoder", "PeerState", "ShmPolicy", "TaskResult",
    "WorkerPool", "channel_pair", "memfd_available", "sweep_stale_segments",
]
