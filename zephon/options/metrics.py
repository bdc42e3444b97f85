"""Observability options: what the engine tracks and where metrics go.

``ExecutionTrackingMode`` selects the granularity of per-stage/per-node
statistics (counts, latency percentiles, queue occupancy);
``MetricsSinkConfig`` says where they are emitted (the ``zephon.metrics``
logger, a statsd endpoint over UDP, or both).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zephon.options._spec import (
    Bool, FrozenMap, Float, Int, OptionsBase, Str, StrMap, document, option,
)

__all__ = ["ExecutionTrackingMode", "MetricsSinkConfig", "METRICS_SINK_MODES"]

METRICS_SINK_MODES = ("log", "statsd", "both")


class ExecutionTrackingMode(str, enum.Enum):
    """Granularity of execution statistics."""

    OFF = "off"
    STAGES = "stages"
    NODES = "nodes"

    def __str__(self) -> str:
        return self.value


@document
@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSinkConfig(OptionsBase):
    """Destination of pipeline metrics."""

    mode: str = option(
        "log", check=Str(choices=METRICS_SINK_MODES),
        doc="log: the zephon.metrics logger; statsd: UDP statsd; both: each of them.",
    )
    namespace: str = option(
        "zephon.pipeline", check=Str(pattern=r"[A-Za-z0-9_.\-]+"),
        doc="Prefix of every metric name.",
    )
    statsd_host: str = option(
        "127.0.0.1", check=Str(), doc="statsd host (mode statsd or both).",
    )
    statsd_port: int = option(
        8125, check=Int(min=1, max=65535), doc="statsd UDP port.",
    )
    default_tags: FrozenMap = option(
        FrozenMap(), check=StrMap(), doc="Tags added to every metric (str -> str).",
    )
    json_logs: bool = option(
        False, check=Bool(), doc="Log metrics as one JSON object per line instead of text.",
    )
    max_batch_size: int = option(
        32, check=Int(min=1), doc="Metrics buffered before a send.",
    )
    flush_interval_s: float = option(
        5.0, check=Float(min=0.0, exclusive_min=True),
        doc="Longest time a buffered metric waits before it is sent.",
    )
