"""zephon: an elastically deterministic, fast, fault-tolerant data pipeline engine.

Two faces share one execution core: streaming pipelines (``Pipeline``, tuned by
``RuntimeOptions``) and per-subject jobs (``zephon.jobs.run``, governed by
``RunPolicy``). This package root re-exports the public names.
"""

from zephon.errors import (
    AggregationTimeoutError,
    CheckpointError,
    SerializationError,
    SubjectTimeoutError,
    TransportError,
    ValidationError,
    WorkerCrashedError,
    ZephonConfigError,
    ZephonError,
)
from zephon.options import (
    ExecutionTrackingMode,
    MetricsSinkConfig,
    MixtureReadConfig,
    RunPolicy,
    RuntimeOptions,
    StoreOptions,
)

__version__ = "0.1.0"

# The pipeline layer (numpy, the kernels, the runners) loads on first use: a spawned
# worker that only needs zephon.transport or zephon.options must not pay for it.
_LAZY = {"Pipeline": "zephon.pipeline", "Batch": "zephon.pipeline",
         "OpError": "zephon.pipeline", "sources": "zephon.pipeline"}


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
    "OpError",
    "Pipeline",
    "sources",
    "CheckpointError",
    "ExecutionTrackingMode",
    "MetricsSinkConfig",
    "MixtureReadConfig",
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
]
