"""execution_tracking and metrics_sink_config change what a run records and emits."""

from __future__ import annotations

import json
import logging
import socket

import _pipeline_fns as F

from zephon import MetricsSinkConfig, Pipeline, RuntimeOptions, sources


def pipe(**opts):
    return Pipeline(sources.from_callable(40, F.make_sample), chunk_size=4) \
        .map(F.double).shuffle(4).batch(2).options(RuntimeOptions(runner="threads", **opts))


def test_off_records_nothing():
    p = pipe()
    list(p)
    assert p.stats() == {}


def test_stages_and_nodes():
    p = pipe(execution_tracking="stages")
    n = len(list(p))
    stage = p.stats()["stage0"]
    # units are dispatch parts: the first ones a sample at a time until a result tells the
    # stage how large its output is, then consecutive chunks of 4 samples merged into parts
    assert 2 <= stage["units"] <= 40 and stage["items_in"] == 40 and stage["items_out"] == 40
    assert stage["inflight"] == 0 and stage["inflight_peak"] >= 1
    assert stage["latency_p50_ms"] <= stage["latency_p99_ms"]
    assert set(p.stats()) == {"stage0"}
    q = pipe(execution_tracking="nodes")
    assert len(list(q)) == n
    stats = q.stats()
    assert stats["tail"]["delivered"] == n
    assert stats["serial1_shuffle"]["items_in"] == 40
    assert stats["serial2_batch"]["items_out"] == n


def test_log_sink_text_and_json(caplog):
    with caplog.at_level(logging.INFO, logger="zephon.metrics"):
        list(pipe(execution_tracking="stages",
                  metrics_sink_config=MetricsSinkConfig(namespace="job.data")))
    assert "job.data.stage0.items_out=40" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zephon.metrics"):
        list(pipe(execution_tracking="stages", metrics_sink_config=MetricsSinkConfig(
            json_logs=True, default_tags={"team": "data"})))
    records = [json.loads(r.getMessage()) for r in caplog.records]
    assert {"metric": "zephon.pipeline.stage0.items_in", "value": 40.0,
            "tags": {"team": "data"}} in records


def test_statsd_sink_sends_gauges_over_udp():
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(5)
    port = server.getsockname()[1]
    try:
        list(pipe(execution_tracking="stages", metrics_sink_config=MetricsSinkConfig(
            mode="statsd", statsd_port=port, max_batch_size=2, default_tags={"env": "ci"})))
        packets = []
        server.settimeout(0.5)
        while True:
            try:
                packets.append(server.recv(65536).decode())
            except socket.timeout:
                break
    finally:
        server.close()
    lines = [line for packet in packets for line in packet.splitlines()]
    assert "zephon.pipeline.stage0.items_out:40|g|#env:ci" in lines
    assert all(len(packet.splitlines()) <= 2 for packet in packets)
