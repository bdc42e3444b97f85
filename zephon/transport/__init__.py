"""Process transport: channels, shared-memory arena, payload codec, worker pool.

See :mod:`zephon.transport.pool` for the lifecycle (:mod:`zephon.transport.worker`
for the worker process), :mod:`zephon.transport.arena`
for the shared-memory design and :mod:`zephon.transport.codec` for the
per-message policy.

Names load on first use: a process that only needs a channel (a job worker) must
not pay for NumPy, the kernels and the pool.
"""

_LAZY = {
    "Channel": "channel", "ChannelClosed": "channel", "channel_pair": "channel",
    "memfd_available": "arena", "sweep_stale_segments": "arena",
    "Decoder": "codec", "Encoder": "codec", "PeerState": "codec", "ShmPolicy": "codec",
    "TaskResult": "pool", "WorkerPool": "pool", "PoolConfig": "config",
    "UnitFailure": "failure",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon.transport' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"zephon.transport.{module}"), name)
    globals()[name] = value
    return value
