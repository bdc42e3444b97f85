"""The resolver cascade (zephon.options.resolve), worker allocation, backend choice, provenance."""

from __future__ import annotations

import os

import pytest

from zephon import RunPolicy, RuntimeOptions, ZephonConfigError
from zephon import options as zo
from zephon.options.resolve import available_cpus


def cascade(opts: RuntimeOptions, cpu_count: int) -> dict:
    return {
        "max_workers": zo.resolve_max_workers(opts, cpu_count),
        "prefetch": zo.resolve_prefetch_batches(opts, cpu_count=cpu_count),
        "op_queue": zo.resolve_op_queue_capacity(opts, cpu_count=cpu_count),
        "mtp_buffer": zo.resolve_mtp_buffer(opts, cpu_count=cpu_count),
        "mtp_prefetch": zo.resolve_mtp_prefetch(opts, cpu_count=cpu_count),
        "stage_process": zo.resolve_default_stage_prefetch(opts, "process", cpu_count=cpu_count),
        "stage_threads": zo.resolve_default_stage_prefetch(opts, "threads", cpu_count=cpu_count),
        "stage_inline": zo.resolve_default_stage_prefetch(opts, "inline", cpu_count=cpu_count),
    }


TABLE = [
    # (options, cpu_count, expected)
    (dict(max_workers=24), 2, dict(max_workers=24, prefetch=48, op_queue=48, mtp_buffer=24,
                                   mtp_prefetch=4, stage_process=12, stage_threads=24,
                                   stage_inline=24)),
    (dict(prefetch_batches=64), 2, dict(max_workers=4, prefetch=64, op_queue=64, mtp_buffer=32,
                                        mtp_prefetch=4, stage_process=16, stage_threads=32,
                                        stage_inline=32)),
    ({}, 2, dict(max_workers=4, prefetch=8, op_queue=8, mtp_buffer=4, mtp_prefetch=4,
                 stage_process=4, stage_threads=8, stage_inline=8)),
    ({}, 8, dict(max_workers=8, prefetch=16, op_queue=16, mtp_buffer=8, mtp_prefetch=4,
                 stage_process=4, stage_threads=8, stage_inline=8)),
    ({}, 64, dict(max_workers=16, prefetch=32, op_queue=32, mtp_buffer=16, mtp_prefetch=4,
                  stage_process=8, stage_threads=16, stage_inline=16)),
    (dict(max_workers=100), 2, dict(max_workers=100, prefetch=200, op_queue=200, mtp_buffer=100,
                                    mtp_prefetch=10, stage_process=50, stage_threads=100,
                                    stage_inline=100)),
    (dict(max_workers=24, op_queue_capacity=5, mtp_buffer=40, default_stage_prefetch=3), 2,
     dict(max_workers=24, prefetch=48, op_queue=5, mtp_buffer=40, mtp_prefetch=4,
          stage_process=3, stage_threads=3, stage_inline=3)),
    (dict(mtp_buffer=2), 2, dict(max_workers=4, prefetch=8, op_queue=8, mtp_buffer=2,
                                 mtp_prefetch=2, stage_process=4, stage_threads=8,
                                 stage_inline=8)),
    (dict(mtp_prefetch=0), 2, dict(max_workers=4, prefetch=8, op_queue=8, mtp_buffer=4,
                                   mtp_prefetch=0, stage_process=4, stage_threads=8,
                                   stage_inline=8)),
]


@pytest.mark.parametrize("kwargs,cpus,expected", TABLE)
def test_cascade_table(kwargs, cpus, expected):
    assert cascade(RuntimeOptions(**kwargs), cpus) == expected


def test_max_workers_reads_the_machine(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    assert zo.resolve_max_workers(RuntimeOptions()) == 12
    monkeypatch.setattr("os.cpu_count", lambda: None)  # unknown -> 1 -> clamped to 4
    assert zo.resolve_max_workers(RuntimeOptions()) == 4


def test_stage_prefetch_override_and_bad_runner():
    o = RuntimeOptions(max_workers=24, per_stage_prefetch={1: 3})
    assert zo.resolve_stage_prefetch(o, 1, "process") == 3
    assert zo.resolve_stage_prefetch(o, 0, "process") == 12
    with pytest.raises(ZephonConfigError, match="runner"):
        zo.resolve_default_stage_prefetch(o, "gpu")


def test_flush_every_k_chunks():
    auto = RuntimeOptions()
    assert zo.resolve_flush_every_k_chunks(auto, preserves_cursor_order=True) == 0
    assert zo.resolve_flush_every_k_chunks(auto, preserves_cursor_order=False) == 8
    assert zo.resolve_flush_every_k_chunks(RuntimeOptions(flush_every_k_chunks=3), False) == 3
    assert zo.resolve_flush_every_k_chunks(RuntimeOptions(flush_every_k_chunks=0), True) == 0
    with pytest.raises(ZephonConfigError, match="flush_every_k_chunks"):
        zo.resolve_flush_every_k_chunks(RuntimeOptions(flush_every_k_chunks=0), False)


@pytest.mark.parametrize("kwargs,dp,group,lanes,mapping", [
    ({}, 1, 0, 1, "contiguous"),
    (dict(world_size=4, global_rank=3), 4, 3, 4, "contiguous"),
    (dict(world_size=8, global_rank=5, dp_degree=2), 2, 1, 2, "contiguous"),
    (dict(world_size=8, global_rank=3, dp_degree=2), 2, 0, 2, "contiguous"),
    (dict(world_size=8, global_rank=3, dp_degree=4, dp_group_id=2, canonical_replicas=16,
          mapping_strategy="interleaved"), 4, 2, 16, "interleaved"),
])
def test_topology_defaults(kwargs, dp, group, lanes, mapping):
    o = RuntimeOptions(**kwargs)
    assert zo.resolve_dp_degree(o) == dp
    assert zo.resolve_dp_group_id(o) == group
    assert zo.resolve_canonical_replicas(o) == lanes
    assert zo.resolve_mapping_strategy(o) == mapping


@pytest.mark.parametrize("path,cloud,timeout", [
    (None, False, 30.0), ("/mnt/shared/agg", False, 30.0), ("file:///tmp/x", False, 30.0),
    ("s3://bucket/x", True, 90.0), ("gs://b/x", True, 90.0), ("az://c/x", True, 90.0),
])
def test_cloud_aggregate_dir_raises_timeout(path, cloud, timeout):
    o = RuntimeOptions(aggregate_dir=path, aggregate_timeout_s=30)
    assert zo.is_cloud_path(path) is cloud
    assert zo.resolve_aggregate_timeout_s(o) == timeout
    assert zo.resolve_aggregate_timeout_s(o.replace(aggregate_timeout_s=300)) == 300.0
    assert o.aggregate_timeout_s == 30.0  # the field itself is never rewritten


@pytest.mark.parametrize("mode,max_workers,parallelism,expected", [
    ("fit_to_ops", None, [4, 1, 2], [4, 1, 2]),
    ("per_stage_fixed", 6, [4, 1, 2], [6, 6, 6]),
    ("global", 10, [1, 1, 1], [4, 3, 3]),
    ("global", 8, [4, 1, 2], [5, 1, 2]),
    ("global", 7, [3, 3, 1], [3, 3, 1]),
    ("global", 2, [1, 1, 1, 1], [1, 1, 1, 1]),  # a stage never gets zero workers
    ("global", 16, [8], [16]),
])
def test_worker_allocation(mode, max_workers, parallelism, expected):
    o = RuntimeOptions(worker_allocation=mode, max_workers=max_workers)
    assert zo.resolve_stage_workers(o, parallelism) == expected


def test_global_allocation_sums_to_max_workers_when_possible():
    o = RuntimeOptions(worker_allocation="global", max_workers=13)
    for weights in ([1], [1, 2], [3, 5, 7], [1, 1, 1, 1, 1, 8]):
        assert sum(zo.resolve_stage_workers(o, weights)) == 13


def test_autotune_starts_every_stage_at_one_worker():
    o = RuntimeOptions(worker_allocation="autotune", max_workers=8)
    assert zo.resolve_stage_workers(o, [1, 8, 3]) == [1, 1, 1]
    with pytest.raises(ZephonConfigError):
        zo.resolve_stage_workers(RuntimeOptions(), [0])


def test_autotune_cpu_budget_is_max_workers_else_the_cores_available(tmp_path):
    assert zo.resolve_autotune_cpu_budget(RuntimeOptions(max_workers=5), cpu_count=2) == 5
    assert zo.resolve_autotune_cpu_budget(RuntimeOptions(), cpu_count=6) == 6
    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # 1.5 cores of quota: 2
    assert available_cpus(str(cpu_max)) == min(affinity, 2)
    cpu_max.write_text("max 100000\n")
    assert available_cpus(str(cpu_max)) == affinity
    assert available_cpus(str(tmp_path / "absent")) == affinity


def test_autotune_memory_budget_is_the_option_else_half_the_available():
    o = RuntimeOptions(autotune_memory_bytes=3 << 30)
    assert zo.resolve_autotune_memory_bytes(o, memory_bytes=1 << 40) == 3 << 30
    assert zo.resolve_autotune_memory_bytes(RuntimeOptions(), memory_bytes=8 << 30) == 4 << 30


@pytest.mark.parametrize("kwargs,backend,why", [
    (dict(), "process", "subject_timeout_sec"),  # the default timeout forces process
    (dict(subject_timeout_sec=None), "serial", "no subject timeout"),
    (dict(backend="process", subject_timeout_sec=None), "process", "requested"),
    (dict(backend="serial", subject_timeout_sec=5.0), "process", "cannot be enforced"),
])
def test_resolve_backend(kwargs, backend, why):
    p = RunPolicy(**kwargs)
    assert zo.resolve_backend(p) == backend
    assert why in zo.backend_reason(p)


def test_resolved_view_reports_provenance():
    view = RuntimeOptions(max_workers=24, shm_enabled=False).resolved(cpu_count=2)
    assert view["max_workers"] == (24, "explicit")
    assert view["prefetch_batches"] == (48, "derived")
    assert view["mtp_prefetch"] == (4, "derived")
    assert view["default_stage_prefetch"].value == {"inline": 24, "threads": 24, "process": 12,
                                                    "ray": 12}
    assert view["shm_enabled"] == (False, "explicit")
    assert view["deterministic"] == (True, "default")
    assert view["canonical_replicas"] == (1, "derived")
    assert view["flush_every_k_chunks"].source == "derived"
    assert list(view) == list(RuntimeOptions.field_names())
    cloud = RuntimeOptions(aggregate_dir="gs://b/agg", aggregate_timeout_s=10).resolved()
    assert cloud["aggregate_timeout_s"] == (90.0, "derived")
