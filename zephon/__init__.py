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

from zephon.pipeline import Batch, OpError, Pipeline, sources

__version__ = "0.1.0"

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
