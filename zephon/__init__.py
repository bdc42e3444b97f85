"""zephon: an elastically deterministic, fast, fault-tolerant data pipeline engine.

Two faces share one execution core: streaming pipelines (``Pipeline``, tuned by
``RuntimeOptions``) and per-subject jobs (``zephon.jobs.run``, governed by
``RunPolicy``). This package root re-exports the public names.
"""

from zephon.errors import (
    AggregationTimeoutError,
    CheckpointError,
    IteratorClosedError,
    SerializationError,
    SubjectTimeoutError,
    TransportError,
    ValidationError,
    WorkerCrashedError,
    ZephonConfigError,
    ZephonError,
)

__version__ = "0.1.0"

# Everything but the errors loads on first use: a spawned worker that only needs
# zephon.transport must not pay for the options (dataclasses) or the pipeline layer.
_LAZY = {"Pipeline": "zephon.pipeline", "Batch": "zephon.pipeline",
         "BatchList": "zephon.pipeline",
         "OpError": "zephon.pipeline", "sources": "zephon.pipeline",
         "ExecutionTrackingMode": "zephon.options", "MetricsSinkConfig": "zephon.options",
         "MixtureReadConfig": "zephon.options", "RunPolicy": "zephon.options",
         "RuntimeOptions": "zephon.options", "StoreOptions": "zephon.options",
         "profile": "zephon.report", "forkserver_context": "zephon.transport.preload"}


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "AggregationTimeoutError",
    "Batch",
    "BatchList",
    "CheckpointError",
    "ExecutionTrackingMode",
    "IteratorClosedError",
    "MetricsSinkConfig",
    "MixtureReadConfig",
    "OpError",
    "Pipeline",
    "RunPolicy",
    "RuntimeOptions",
    "SerializationError",
    "StoreOptions",
    "SubjectTimeoutError",
    "TransportError",
    "ValidationError",
    "WorkerCrashedError",
    "ZephonConfigError",
    "ZephonError",
    "__version__",
    "forkserver_context",
    "profile",
    "sources",
]
