"""Observability options: what the engine tracks and where metrics go.

``ExecutionTrackingMode`` selects the granularity of per-stage/per-node
statistics (counts, latency percentiles, queue occupancy);
``MetricsSinkConfig`` says where they are emitted (the ``zephon.metrics``
logger, a statsd endpoint over UDP, or both).

:data:`TRACKING_ENV` (``ZEPHON_EXECUTION_TRACKING``) turns tracking on for every run
of a process without touching its options (``python -m zephon profile`` sets it):
:func:`effective_tracking` gives the more detailed of the option and the variable.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from zephon.errors import ZephonConfigError
from zephon.options._spec import (
    Bool,
    Float,
    FrozenMap,
    Int,
    OptionsBase,
    Str,
    StrMap,
    option,
    option_class,
)
from zephon.options.limits import MAX_SECONDS

__all__ = ["METRICS_SINK_MODES", "TRACKING_ENV", "ExecutionTrackingMode", "MetricsSinkConfig",
           "effective_tracking"]

METRICS_SINK_MODES = ("log", "statsd", "both")
# An IPv4 address or a DNS name (labels of 1-63 letters, digits and hyphens): anything
# else fails inside sendto() with an encoding error rather than an OSError.
_HOSTNAME = (r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
             r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?)*\.?")


class ExecutionTrackingMode(str, enum.Enum):
    """Granularity of execution statistics (``RuntimeOptions.execution_tracking``).

    ``OFF``: nothing is recorded; ``STAGES``: per parallel stage, units and items
    in and out, units in flight and unit latency percentiles; ``NODES``: that, plus
    every serial op and the items delivered to the consumer. The option also accepts
    the plain strings ``"off"``, ``"stages"``, ``"nodes"``.

    Examples:
        >>> src = sources.from_sequence(list(range(4)))
        >>> opts = RuntimeOptions(execution_tracking="stages")
        >>> opts.execution_tracking is zephon.ExecutionTrackingMode.STAGES
        True
        >>> pipe = Pipeline(src).options(opts)
        >>> _ = list(pipe)
        >>> pipe.stats() != {}
        True
    """

    OFF = "off"
    STAGES = "stages"
    NODES = "nodes"

    def __str__(self) -> str:
        return self.value


#: Environment variable naming a tracking mode (off, stages, nodes) that applies to every
#: run of the process whose options ask for less.
TRACKING_ENV = "ZEPHON_EXECUTION_TRACKING"
_LEVELS = {mode.value: k for k, mode in enumerate(ExecutionTrackingMode)}


def effective_tracking(mode: "ExecutionTrackingMode | str") -> str:
    """The tracking mode a run uses: the more detailed of ``mode`` (the run's option)
    and :data:`TRACKING_ENV`; read once per run, never per item.

    Examples:
        >>> from zephon.options.metrics import effective_tracking
        >>> effective_tracking("stages") in ("stages", "nodes")
        True
    """
    wanted = os.environ.get(TRACKING_ENV, "").strip().lower() or "off"
    if wanted not in _LEVELS:
        raise ZephonConfigError(
            f"${TRACKING_ENV}={os.environ[TRACKING_ENV]!r}: expected one of "
            f"{', '.join(_LEVELS)}", field=TRACKING_ENV)
    mine = str(mode)
    return wanted if _LEVELS[wanted] > _LEVELS[mine] else mine


@option_class
@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSinkConfig(OptionsBase):
    """Destination of pipeline metrics (with ``RuntimeOptions.execution_tracking`` on).

    Examples:
        >>> sink = zephon.MetricsSinkConfig(mode="log", default_tags={"job": "pretrain"})
        >>> opts = RuntimeOptions(execution_tracking="stages", metrics_sink_config=sink)
        >>> opts.metrics_sink_config.default_tags["job"]
        'pretrain'
    """

    mode: str = option(
        "log", check=Str(choices=METRICS_SINK_MODES),
        doc="log: the zephon.metrics logger; statsd: UDP statsd; both: each of them.",
    )
    namespace: str = option(
        "zephon.pipeline", check=Str(pattern=r"[A-Za-z0-9_.\-]{1,200}"),
        doc="Prefix of every metric name.",
    )
    statsd_host: str = option(
        "127.0.0.1", check=Str(pattern=_HOSTNAME, allowed="an IPv4 address or a DNS name"),
        doc="statsd host (mode statsd or both): an IPv4 address or a DNS name.",
    )
    statsd_port: int = option(
        8125, check=Int(min=1, max=65535), doc="statsd UDP port.",
    )
    default_tags: FrozenMap = option(
        FrozenMap(), check=StrMap(key_pattern=r"[A-Za-z0-9_.\-/]{1,200}",
                                  value_pattern=r"[A-Za-z0-9_.\-/:@+]{0,200}", max_items=64),
        doc="Tags added to every metric (str -> str), sent as DogStatsD tags: ASCII "
            "without the separators , | # and spaces.",
    )
    json_logs: bool = option(
        False, check=Bool(), doc="Log metrics as one JSON object per line instead of text.",
    )
    max_batch_size: int = option(
        32, check=Int(min=1, max=1024),
        doc="Metric lines per statsd datagram; at most 1024 (a datagram holds 64 KiB).",
    )
    flush_interval_s: float = option(
        5.0, check=Float(min=0.0, exclusive_min=True, max=MAX_SECONDS),
        doc="Longest time a buffered metric waits before it is sent.",
    )
