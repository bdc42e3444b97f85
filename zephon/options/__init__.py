"""The pure-config core: option classes, resolvers and the config error.

Standard library only; every other layer of zephon may import it, it imports
none of them (:mod:`zephon.errors` aside).
"""

from zephon.errors import ZephonConfigError
from zephon.options._spec import FrozenMap
from zephon.options.metrics import ExecutionTrackingMode, MetricsSinkConfig
from zephon.options.mixture import MixtureReadConfig
from zephon.options.policy import RunPolicy
from zephon.options.resolve import (
    ResolvedValue,
    backend_reason,
    is_cloud_path,
    resolve_aggregate_timeout_s,
    resolve_all,
    resolve_autotune_cpu_budget,
    resolve_autotune_memory_bytes,
    resolve_backend,
    resolve_canonical_replicas,
    resolve_default_stage_prefetch,
    resolve_dp_degree,
    resolve_dp_group_id,
    resolve_flush_every_k_chunks,
    resolve_mapping_strategy,
    resolve_max_workers,
    resolve_mtp_buffer,
    resolve_mtp_prefetch,
    resolve_op_queue_capacity,
    resolve_prefetch_batches,
    resolve_stage_prefetch,
    resolve_stage_workers,
)
from zephon.options.runtime import RuntimeOptions
from zephon.options.store import StoreOptions

__all__ = [
    "ExecutionTrackingMode",
    "FrozenMap",
    "MetricsSinkConfig",
    "MixtureReadConfig",
    "ResolvedValue",
    "RunPolicy",
    "RuntimeOptions",
    "StoreOptions",
    "ZephonConfigError",
    "backend_reason",
    "is_cloud_path",
    "resolve_aggregate_timeout_s",
    "resolve_all",
    "resolve_autotune_cpu_budget",
    "resolve_autotune_memory_bytes",
    "resolve_backend",
    "resolve_canonical_replicas",
    "resolve_default_stage_prefetch",
    "resolve_dp_degree",
    "resolve_dp_group_id",
    "resolve_flush_every_k_chunks",
    "resolve_mapping_strategy",
    "resolve_max_workers",
    "resolve_mtp_buffer",
    "resolve_mtp_prefetch",
    "resolve_op_queue_capacity",
    "resolve_prefetch_batches",
    "resolve_stage_prefetch",
    "resolve_stage_workers",
]
