"""Execution statistics of a pipeline run (``execution_tracking``) and their sink
(``metrics_sink_config``).

- ``stages``: per parallel stage: units and items submitted, items out, units in
  flight (current and peak), and unit latency (submit to result) p50/p90/p99
  over the last 1024 units;
- ``nodes``: the above, plus every serial op (items in and out, seconds spent;
  ``pack_documents`` also ``rows``, ``tokens``, ``padding_tokens`` and
  ``padding_fraction``) and the tail (items delivered to the consumer);
- ``off``: nothing is recorded.

``Pipeline.stats()`` returns a snapshot. With a sink configured, gauges named
``<namespace>.<node>.<metric>`` are emitted every ``flush_interval_s`` (checked
as the run progresses, no extra thread) and when the run ends: to the
``zephon.metrics`` logger (``log``; one JSON object per line with
``json_logs``), as statsd gauges over UDP (``statsd``; datagrams of at most
``max_batch_size`` lines, ``default_tags`` as DogStatsD tags), or both.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time

import numpy as np

__all__ = ["RunStats"]

log = logging.getLogger("zephon.metrics")


class _Node:
    __slots__ = ("counters", "inflight", "latency")

    def __init__(self) -> None:
        self.counters: dict[str, float] = collections.defaultdict(int)  # "seconds" is a float
        self.latency: collections.deque[float] = collections.deque(maxlen=1024)
        self.inflight = 0


class RunStats:
    def __init__(self, mode: str, sink=None) -> None:
        self.mode, self.sink = mode, sink
        self.nodes: dict[str, _Node] = collections.defaultdict(_Node)
        self.lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._socket: socket.socket | None = None

    @property
    def nodes_enabled(self) -> bool:
        return self.mode == "nodes"

    # -- recording (engine side) -----------------------------------------------------------
    def submitted(self, node: str, items: int) -> None:
        with self.lock:
            n = self.nodes[node]
            n.counters["units"] += 1
            n.counters["items_in"] += items
            n.inflight += 1
            n.counters["inflight_peak"] = max(n.counters["inflight_peak"], n.inflight)
        self._maybe_flush()

    def completed(self, node: str, items: int, seconds: float) -> None:
        with self.lock:
            n = self.nodes[node]
            n.counters["items_out"] += items
            n.inflight -= 1
            n.latency.append(seconds)

    def serial(self, node: str, items_in: int, items_out: int, seconds: float) -> None:
        with self.lock:
            n = self.nodes[node]
            n.counters["items_in"] += items_in
            n.counters["items_out"] += items_out
            n.counters["seconds"] += seconds

    def add(self, node: str, **counts: int) -> None:
        """Add ``counts`` to ``node``'s counters (a packer's rows, tokens and padding)."""
        with self.lock:
            counters = self.nodes[node].counters
            for name, value in counts.items():
                counters[name] += value

    def delivered(self) -> None:
        with self.lock:
            self.nodes["tail"].counters["delivered"] += 1

    # -- reading ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        out = {}
        with self.lock:
            for name, n in self.nodes.items():
                row = dict(n.counters)
                row["inflight"] = n.inflight
                if row.get("rows"):  # a packer: the share of its row slots that is padding
                    row["padding_fraction"] = row["padding_tokens"] / (
                        row["tokens"] + row["padding_tokens"])
                if n.latency:
                    p50, p90, p99 = np.percentile(np.fromiter(n.latency, float), [50, 90, 99])
                    row.update(latency_p50_ms=p50 * 1e3, latency_p90_ms=p90 * 1e3,
                               latency_p99_ms=p99 * 1e3)
                out[name] = row
        return out

    # -- emitting --------------------------------------------------------------------------
    def _maybe_flush(self) -> None:
        if self.sink is not None and \
                time.monotonic() - self._last_flush >= self.sink.flush_interval_s:
            self.flush()

    def gauges(self) -> list[tuple[str, float]]:
        ns = self.sink.namespace
        return [(f"{ns}.{node}.{metric}", float(value))
                for node, row in sorted(self.snapshot().items())
                for metric, value in sorted(row.items())]

    def flush(self) -> None:
        if self.sink is None:
            return
        self._last_flush = time.monotonic()
        gauges = self.gauges()
        if self.sink.mode in ("log", "both"):
            if self.sink.json_logs:
                for name, value in gauges:
                    log.info(json.dumps({"metric": name, "value": value,
                                         "tags": dict(self.sink.default_tags)}))
            else:
                log.info("metrics: %s", " ".join(f"{k}={v:g}" for k, v in gauges))
        if self.sink.mode in ("statsd", "both"):
            tags = ",".join(f"{k}:{v}" for k, v in self.sink.default_tags.items())
            lines = [f"{k}:{v:g}|g" + (f"|#{tags}" if tags else "") for k, v in gauges]
            if self._socket is None:
                self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock = self._socket
            for i in range(0, len(lines), self.sink.max_batch_size):
                packet = "\n".join(lines[i:i + self.sink.max_batch_size]).encode()
                try:
                    sock.sendto(packet, (self.sink.statsd_host, self.sink.statsd_port))
                except OSError as exc:  # metrics must never break the pipeline
                    log.warning("statsd send to %s:%s failed: %s", self.sink.statsd_host,
                                self.sink.statsd_port, exc)
                    break

    def close(self) -> None:
        self.flush()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
