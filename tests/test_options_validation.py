"""Every per-field and cross-field rule of the option classes.

BAD lists, per class and field, values that must be refused. A completeness
test makes sure every field has an entry, so a new field cannot skip
validation; each case asserts the error names the field, so removing one rule
fails its case.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import pickle

import numpy as np
import pytest

from zephon import (
    ExecutionTrackingMode, MetricsSinkConfig, MixtureReadConfig, RunPolicy, RuntimeOptions,
    StoreOptions, ZephonConfigError,
)
from zephon.options import FrozenMap

NAN, INF = math.nan, math.inf

BAD = {
    RuntimeOptions: {
        "runner": ["proc", 1, ""],
        "run_id": ["", "has space", "a/b", 3, "x" * 65],
        "per_stage_runner": [{0: "gpu"}, {-1: "inline"}, {True: "inline"}, {"a": "inline"},
                             [("0", "inline")], "inline"],
        "mp_context": ["spork", 1, None],
        "worker_allocation": ["fit", None, 0],
        "max_workers": [0, -1, True, 2.0, "4", 128, 2**70, 10**400],
        "autotune_memory_bytes": [0, -1, True, 1.5, "1G", 2**51],
        "worker_compute_threads": [-1, True, None, 1.0, 4097],
        "deterministic": [1, "yes", None],
        "prefetch_batches": [0, False, 1.5, 65537, 2**64],
        "default_stage_prefetch": [0, True, 65537],
        "per_stage_prefetch": [{0: 0}, {0: True}, {-2: 3}, 5, {0: 65537}, {1025: 4},
                               {2**70: 1}, {0: [1]}, {0: {"a": 1}}, {1.0: 2}, {None: 2}],
        "op_queue_capacity": [0, -3, True, 65537],
        "ipc_transport": ["shm", None],
        "ipc_buffer_bytes": [1024, -1, True, None, 2.0**20, 2**30 + 1, 2**31],
        "mixture_config": [{"mode": "weighted_random"}, "weighted_random", 1],
        "io_options": [None, {"cache_enabled": True}, 1],
        "allow_latency_flush_in_deterministic": [0, None],
        "flush_every_k_chunks": [-1, True, 1.0, 65537],
        "shutdown_mode": ["soft", None],
        "persistent_workers": [1, "yes", None],
        "persistent_workers_idle_s": [0, -1.0, True, "60", float("nan"), float("inf"), 1e12],
        "seed_global_rngs": ["some", True, None],
        "auto_validation": ["on", True],
        "mtp_mode": [1, None],
        "mtp_buffer": [0, True, 4097, 2**70],
        "mtp_buffer_bytes": [0, 100, None, 2**30 + 1],
        "mtp_prefetch": [-1, True, 4097],
        "mtp_auto_checkpoint": ["true", None],
        "world_size": [0, True, None, 2**20 + 1],
        "global_rank": [-1, None, False, 2**20],
        "dp_degree": [0, True, 4097],
        "dp_group_id": [-1, True, 4096],
        "canonical_replicas": [0, True, 4097, 10**7],
        "mapping_strategy": ["round_robin", 0],
        "resume_accept": ["files", ["everything"], [""], ("files", 3)],
        "shm_enabled": [1, None],
        "shm_coalesce": [0, None],
        "shm_min_item_bytes": [-1, True, None, 1.0, 2**40 + 1],
        "shm_min_new_allocation_bytes": [-1, True, None, 2**40 + 1],
        "shm_min_forward_bytes": [-1, True, None, 2**40 + 1],
        "shm_compact_above_ratio": [0.5, NAN, INF, -INF, True, "8", 1e7, 10**400],
        "shm_compact_min_savings_bytes": [-1, True, None, 2**40 + 1],
        "shm_max_coalesced_bytes": [0, -5, True, 2**40 + 1],
        "max_worker_retries": [-1, True, None, 1001],
        "aggregate_dir": ["", 3, "a\x00b"],
        "aggregate_store": ["tcp://x:1", "torch:/", "torch://host", "", 5],
        "aggregate_timeout_s": [0, -1.0, NAN, INF, True, None, 10**400, 1e308, 2592001.0],
        "aggregate_serializer": ["pickle", None],
        "aggregate_compressor": ["gzip", None],
        "execution_tracking": ["all", 1, None],
        "metrics_sink_config": [{"mode": "log"}, "log"],
    },
    RunPolicy: {
        "workers": [0, -1, True, 2.0, None, 1025],
        "backend": ["thread", None],
        "subject_timeout_sec": [0, -1, NAN, INF, True, 1e308, 10**400],
        "subject_spawn_timeout_sec": [0, -1.5, NAN, False, 2592001],
        "graceful_shutdown_sec": [0, -1, INF, None, True, 1e308],
        "on_subject_failure": ["stop", None],
        "oom_backoff": [1, None],
        "oom_reduce_workers_by": [0, True, None, 1025],
        "cap_workers_to_gpu_pool": [0, None],
        "resume": ["no", None],
        "checkpoint_dir": ["", 7, "\x00"],
        "parallel_mode": ["pooled", None],
        "auto_retry_rounds": [-1, True, None, 1001],
        "retry_failed_subjects": [1, None],
        "force_rerun_subjects": ["S01", b"S01", ["S01", 2], [""], None, {"S01"}],
        "clear_checkpoint_on_success": [1, None],
        "strict_checkpoint_hash": [1, None],
        "persistent_worker_max_consecutive_failures": [0, True, None, 1001],
        "persistent_worker_recycle_after_tasks": [-1, True, None, 2**31],
    },
    StoreOptions: {
        "cache_enabled": [1, None],
        "cache_root": ["", 1, "x\x00"],
        "cache_limit_bytes": [0, True, 2**50 + 1],
        "download_retry": [-1, True, None, 1001],
        "download_timeout_s": [0, NAN, None, 1e9],
        "open_retry_attempts": [0, True, 1001],
        "retry_backoff_initial_s": [-0.1, NAN, None, 1e9],
        "retry_backoff_max_s": [-1, INF, None, 1e9, 10**400],
        "unchecked_objects": ["read_once", "", None, 1, "READ_TWICE"],
    },
    MixtureReadConfig: {
        "mode": ["random", None],
        "seed": [-1, True, 1.5, None, 2**64],
        "within_component": ["sorted", None],
    },
    MetricsSinkConfig: {
        "mode": ["udp", None],
        "namespace": ["", "has space", None, "x" * 201],
        "statsd_host": ["", None, "a" * 64, "a..b", "h\x00st", "\ud800", 5],
        "statsd_port": [0, 65536, True, None],
        "default_tags": [{"a": 1}, {1: "a"}, ["a"], None, {"a,b": "c"}, {"a": "\ud800"},
                         {f"k{i}": "v" for i in range(65)}],
        "json_logs": [1, None],
        "max_batch_size": [0, True, 1025],
        "flush_interval_s": [0, NAN, None, 1e300],
    },
}

CASES = [
    pytest.param(cls, name, value, id=f"{cls.__name__}.{name}={value!r}")
    for cls, table in BAD.items()
    for name, values in table.items()
    for value in values
]


@pytest.mark.parametrize("cls", list(BAD))
def test_every_field_has_bad_values(cls):
    assert set(BAD[cls]) == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls,name,value", CASES)
def test_bad_field_value_is_refused(cls, name, value):
    with pytest.raises(ZephonConfigError) as info:
        cls(**{name: value})
    message = str(info.value)
    assert f"{cls.__name__}.{name}" in message
    assert info.value.field.startswith(f"{cls.__name__}.{name}")
    assert "expected" in message or "must" in message


@pytest.mark.parametrize("cls,name,value", CASES)
def test_bad_value_refused_by_replace_and_from_dict(cls, name, value):
    with pytest.raises(ZephonConfigError):
        cls().replace(**{name: value})
    if not isinstance(value, (dict, set)) or name in ("per_stage_runner", "per_stage_prefetch",
                                                      "default_tags"):
        with pytest.raises(ZephonConfigError):
            cls.from_dict({name: value})


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        RuntimeOptions(max_workers=0)


CROSS = [
    (dict(world_size=2, global_rank=2), "global_rank"),
    (dict(world_size=4, global_rank=5), "global_rank"),
    (dict(world_size=4, dp_degree=3), "dp_degree"),
    (dict(world_size=2, dp_degree=4), "dp_degree"),
    (dict(world_size=4, dp_degree=2, dp_group_id=2), "dp_group_id"),
    (dict(world_size=2, dp_group_id=5), "dp_group_id"),
    (dict(world_size=4, canonical_replicas=3), "canonical_replicas"),
    (dict(world_size=4, dp_degree=2, canonical_replicas=1), "canonical_replicas"),
    (dict(aggregate_dir="/tmp/agg", aggregate_store="torch://"), "aggregate_store"),
    (dict(mtp_buffer=4, mtp_prefetch=5), "mtp_prefetch"),
    (dict(prefetch_batches=8, mtp_prefetch=5), "mtp_prefetch"),  # derived mtp_buffer = 4
    (dict(mtp_mode=True, world_size=2), "mtp_auto_checkpoint"),
    (dict(mtp_mode=True, world_size=2, aggregate_store="torch://"), "mtp_auto_checkpoint"),
]


@pytest.mark.parametrize("kwargs,field", CROSS, ids=[f for _, f in CROSS])
def test_cross_field_rule(kwargs, field):
    with pytest.raises(ZephonConfigError) as info:
        RuntimeOptions(**kwargs)
    assert f"RuntimeOptions.{field}" in str(info.value)


GOOD_CROSS = [
    dict(world_size=4, global_rank=3),
    dict(world_size=4, dp_degree=2, global_rank=3),  # dp_group_id derives to 1
    dict(world_size=4, dp_degree=2, canonical_replicas=8, mapping_strategy="interleaved"),
    dict(world_size=8, dp_degree=4, dp_group_id=3, global_rank=7),
    dict(aggregate_store="torch://"),
    dict(aggregate_store="torch://10.0.0.1:29500"),
    dict(aggregate_dir="s3://bucket/ckpt"),
    dict(mtp_buffer=4, mtp_prefetch=4),
    dict(mtp_buffer=2),  # derived mtp_prefetch is clamped to the buffer
    dict(mtp_mode=True, world_size=2, aggregate_dir="/tmp/agg"),
    dict(mtp_mode=True, world_size=2, mtp_auto_checkpoint=False),
]


@pytest.mark.parametrize("kwargs", GOOD_CROSS)
def test_cross_field_valid_combinations(kwargs):
    RuntimeOptions(**kwargs)


def test_store_backoff_order():
    with pytest.raises(ZephonConfigError, match="retry_backoff_initial_s"):
        StoreOptions(retry_backoff_initial_s=3.0, retry_backoff_max_s=2.0)


def test_unknown_keys_suggest_and_list():
    with pytest.raises(ZephonConfigError) as info:
        RuntimeOptions.from_dict({"max_worker": 4})
    text = str(info.value)
    assert "'max_worker'" in text and "did you mean 'max_workers'" in text
    # Short: the suggestion and how to list the names, not the ~50 names themselves.
    assert "RuntimeOptions.field_names()" in text and "shm_enabled" not in text
    assert len(text) < 200, text
    with pytest.raises(ZephonConfigError, match="did you mean 'workers'"):
        RunPolicy.from_dict({"worker": 2})
    with pytest.raises(ZephonConfigError, match="unknown option"):
        RuntimeOptions().replace(prefetch=3)
    with pytest.raises(ZephonConfigError, match="did you mean 'cache_enabled'"):
        RuntimeOptions.from_dict({"io_options": {"cache_enable": True}})
    with pytest.raises(ZephonConfigError, match="expected a mapping"):
        RuntimeOptions.from_dict([("max_workers", 4)])


def test_defaults_match_the_contract():
    o = RuntimeOptions()
    assert o.runner is None and o.run_id == "default_run_id"
    assert o.per_stage_runner == {} and o.per_stage_prefetch == {}
    assert o.mp_context is multiprocessing.get_context("spawn")
    assert o.worker_allocation == "fit_to_ops" and o.deterministic is True
    assert o.ipc_transport == "socketpair" and o.ipc_buffer_bytes == 512 * 1024
    assert o.mtp_buffer_bytes == 8 * 1024 * 1024 and o.mtp_auto_checkpoint is True
    assert o.shm_min_item_bytes == 4096 and o.shm_min_new_allocation_bytes == 2 << 20
    assert o.shm_min_forward_bytes == 128 << 10 and o.shm_compact_above_ratio == 8.0
    assert o.shm_compact_min_savings_bytes == 16 << 20 and o.shm_max_coalesced_bytes == 16 << 20
    assert o.max_worker_retries == 3 and o.aggregate_timeout_s == 180.0
    assert (o.aggregate_serializer, o.aggregate_compressor) == ("msgpack", "zstd")
    assert o.execution_tracking is ExecutionTrackingMode.OFF
    assert o.io_options == StoreOptions() and o.mixture_config is None
    p = RunPolicy()
    assert (p.workers, p.backend, p.subject_timeout_sec, p.subject_spawn_timeout_sec) == (
        1, "serial", 900.0, 120.0)
    assert (p.graceful_shutdown_sec, p.on_subject_failure, p.parallel_mode) == (
        15.0, "continue", "persistent")
    assert (p.auto_retry_rounds, p.force_rerun_subjects, p.resume) == (2, (), True)
    s = StoreOptions()
    assert (s.download_retry, s.download_timeout_s, s.open_retry_attempts) == (12, 180.0, 5)
    assert (s.retry_backoff_initial_s, s.retry_backoff_max_s) == (0.1, 2.0)
    m = MetricsSinkConfig()
    assert (m.mode, m.namespace, m.statsd_host, m.statsd_port) == (
        "log", "zephon.pipeline", "127.0.0.1", 8125)
    assert (m.max_batch_size, m.flush_interval_s) == (32, 5.0)
    x = MixtureReadConfig()
    assert (x.mode, x.within_component) == ("weighted_round_robin", "as_is")


def test_normalisation_is_not_a_silent_fix():
    # Numpy integers are ints; ints in float fields become floats; lists become tuples;
    # start-method names become contexts; enum values become members.
    o = RuntimeOptions(max_workers=np.int64(6), aggregate_timeout_s=30,
                       mp_context="spawn", execution_tracking="stages")
    assert type(o.max_workers) is int and o.max_workers == 6
    assert type(o.aggregate_timeout_s) is float
    assert o.mp_context is multiprocessing.get_context("spawn")
    assert o.execution_tracking is ExecutionTrackingMode.STAGES
    assert RunPolicy(force_rerun_subjects=["S01", "S02"]).force_rerun_subjects == ("S01", "S02")


def test_immutable_all_the_way_down():
    source = {0: "inline"}
    o = RuntimeOptions(per_stage_runner=source, metrics_sink_config=MetricsSinkConfig(
        default_tags={"team": "data"}))
    source[1] = "process"  # the caller's dict is copied, not kept
    assert dict(o.per_stage_runner) == {0: "inline"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.max_workers = 3
    with pytest.raises(TypeError):
        o.per_stage_runner[1] = "process"
    with pytest.raises(TypeError):
        o.metrics_sink_config.default_tags["x"] = "y"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.io_options.download_retry = 1
    with pytest.raises(AttributeError):
        o.per_stage_runner._data = {}
    assert isinstance(o.per_stage_runner, FrozenMap)
    hash(o)  # usable as a dict key


def test_replace_revalidates_cross_fields():
    o = RuntimeOptions(world_size=4, global_rank=3)
    assert o.replace(global_rank=1).global_rank == 1
    with pytest.raises(ZephonConfigError, match="global_rank"):
        o.replace(world_size=2)


def test_pickle_round_trip_rebuilds_equal_objects():
    o = RuntimeOptions(max_workers=3, per_stage_runner={1: "process"},
                       mixture_config=MixtureReadConfig(mode="weighted_random", seed=7))
    copy = pickle.loads(pickle.dumps(o))
    assert copy == o and copy.mp_context is o.mp_context
    p = RunPolicy(force_rerun_subjects=("a",), workers=3)
    assert pickle.loads(pickle.dumps(p)) == p


@pytest.mark.parametrize("cls", list(BAD))
def test_positional_arguments_are_a_config_error(cls):
    with pytest.raises(ZephonConfigError, match="keyword arguments only") as info:
        cls(4)
    assert f"{cls.__name__}({cls.field_names()[0]}=...)" in str(info.value)


@pytest.mark.parametrize("cls", list(BAD))
def test_unknown_keyword_to_the_constructor_is_a_config_error(cls):
    name = cls.field_names()[0]
    with pytest.raises(ZephonConfigError) as info:
        cls(**{name + "x": 1})
    assert f"did you mean {name!r}" in str(info.value)
    assert f"{cls.__name__}.field_names()" in str(info.value)


def test_docstrings_describe_every_field():
    for cls in BAD:
        for f in dataclasses.fields(cls):
            assert f"    {f.name} (default" in cls.__doc__, (cls, f.name)


def _numeric_checks(check):
    from zephon.options import _spec

    if isinstance(check, (_spec.Int, _spec.Float)):
        yield check
    if isinstance(check, _spec.IntKeyMap):
        yield from _numeric_checks(check.value_check)


@pytest.mark.parametrize("cls", list(BAD))
def test_every_numeric_field_has_a_stated_upper_bound(cls):
    """No number is accepted that the code downstream cannot honour: each numeric field
    (and each per-stage mapping's keys and values) has a maximum, stated in its docs."""
    from zephon.options import _spec

    for f in dataclasses.fields(cls):
        check = f.metadata["check"]
        for numeric in _numeric_checks(check):
            assert numeric.max is not None, f"{cls.__name__}.{f.name} has no upper bound"
            entry = cls.__doc__.split(f"    {f.name} (default", 1)[1].split("\n", 1)[0]
            assert "<= " in entry, entry
        if isinstance(check, _spec.IntKeyMap):
            assert check.max_key == 1024
            with pytest.raises(ZephonConfigError, match="<= 1024"):
                cls(**{f.name: {1025: None}})


def test_bounds_are_what_the_consumers_need():
    from zephon.options import limits

    # A region token is owner << 56 | slab << 40 | offset in a signed 64-bit value.
    assert (limits.MAX_WORKERS + 1) << 56 > 2**63 - 1 >= limits.MAX_WORKERS << 56
    # setsockopt takes a C int and Linux doubles the request.
    assert 2 * limits.MAX_SOCKET_BUFFER_BYTES - 1 <= 2**31 - 1
    import threading

    assert limits.MAX_SECONDS < threading.TIMEOUT_MAX
    o = RuntimeOptions(prefetch_batches=65536)
    from zephon.options import resolve_mtp_buffer

    assert resolve_mtp_buffer(o) == limits.MAX_MTP_BUFFER  # a derived value is capped too
    with pytest.raises(ZephonConfigError, match="dp_degree.*world_size=8192"):
        RuntimeOptions(world_size=8192)  # derived C = 8192 lanes
    RuntimeOptions(world_size=8192, dp_degree=4096)
