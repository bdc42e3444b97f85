"""Property tests: valid options survive dict/JSON/YAML round trips; invalid edits raise."""

from __future__ import annotations

import json
import multiprocessing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon import (
    ExecutionTrackingMode, MetricsSinkConfig, MixtureReadConfig, RunPolicy, RuntimeOptions,
    StoreOptions, ZephonConfigError,
)

from test_options_validation import BAD

sizes = st.integers(min_value=1, max_value=1 << 30)
maybe = lambda s: st.none() | s  # noqa: E731
finite = st.floats(min_value=0.001, max_value=1e6, allow_nan=False, allow_infinity=False)
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-.", min_size=1, max_size=12)
runner = st.sampled_from(["inline", "threads", "process"])

store_options = st.builds(
    StoreOptions, cache_enabled=st.booleans(), cache_root=maybe(st.just("/tmp/cache")),
    cache_limit_bytes=maybe(sizes), download_retry=st.integers(0, 50),
    download_timeout_s=finite, open_retry_attempts=st.integers(1, 9),
    retry_backoff_initial_s=st.floats(0, 1), retry_backoff_max_s=st.floats(1, 10),
)
mixture = st.builds(
    MixtureReadConfig, mode=st.sampled_from(["weighted_round_robin", "weighted_random"]),
    seed=st.integers(0, 2**63),
    within_component=st.sampled_from(["as_is", "shuffle"]),
)
metrics = st.builds(
    MetricsSinkConfig, mode=st.sampled_from(["log", "statsd", "both"]), namespace=names,
    statsd_port=st.integers(1, 65535), default_tags=st.dictionaries(names, names, max_size=3),
    json_logs=st.booleans(), max_batch_size=st.integers(1, 1000), flush_interval_s=finite,
)


@st.composite
def runtime_options(draw):
    world = draw(st.sampled_from([1, 2, 4, 6, 8]))
    dp = draw(maybe(st.sampled_from([d for d in range(1, world + 1) if world % d == 0])))
    rank = draw(st.integers(0, world - 1))
    dp_resolved = dp if dp is not None else world
    group = draw(maybe(st.integers(0, dp_resolved - 1)))
    lanes = draw(maybe(st.integers(dp_resolved, dp_resolved * 4)))
    mtp_buffer = draw(maybe(st.integers(4, 64)))
    agg_dir = draw(maybe(st.sampled_from(["/tmp/agg", "s3://bucket/agg"])))
    agg_store = None if agg_dir else draw(maybe(st.sampled_from(["torch://", "torch://h:1"])))
    mtp_mode = draw(st.booleans())
    # MTP auto-checkpoint on several ranks is a merged checkpoint: it needs aggregate_dir.
    auto_checkpoint = draw(st.booleans()) if world == 1 or agg_dir else False
    return RuntimeOptions(
        runner=draw(maybe(runner)), run_id=draw(names),
        per_stage_runner=draw(st.dictionaries(st.integers(0, 9), runner, max_size=3)),
        mp_context=draw(st.sampled_from(multiprocessing.get_all_start_methods())),
        worker_allocation=draw(st.sampled_from(["fit_to_ops", "per_stage_fixed", "global",
                                                "autotune"])),
        max_workers=draw(maybe(st.integers(1, 64))), deterministic=draw(st.booleans()),
        worker_compute_threads=draw(st.integers(0, 64)),
        prefetch_batches=draw(maybe(st.integers(1, 256))),
        default_stage_prefetch=draw(maybe(st.integers(1, 64))),
        per_stage_prefetch=draw(st.dictionaries(st.integers(0, 9), st.integers(1, 64),
                                                max_size=3)),
        op_queue_capacity=draw(maybe(st.integers(1, 256))),
        ipc_transport=draw(st.sampled_from(["socketpair", "pipe"])),
        ipc_buffer_bytes=draw(st.integers(4096, 1 << 26)),
        mixture_config=draw(maybe(mixture)), io_options=draw(store_options),
        allow_latency_flush_in_deterministic=draw(st.booleans()),
        flush_every_k_chunks=draw(maybe(st.integers(0, 64))),
        shutdown_mode=draw(st.sampled_from(["immediate", "graceful", "hard"])),
        auto_validation=draw(st.sampled_from(["strict", "warn", "off"])),
        mtp_mode=mtp_mode, mtp_buffer=mtp_buffer,
        mtp_buffer_bytes=draw(st.integers(4096, 1 << 26)),
        mtp_prefetch=draw(maybe(st.integers(0, mtp_buffer or 4))),
        mtp_auto_checkpoint=auto_checkpoint, world_size=world, global_rank=rank,
        dp_degree=dp, dp_group_id=group, canonical_replicas=lanes,
        mapping_strategy=draw(maybe(st.sampled_from(["contiguous", "interleaved"]))),
        shm_enabled=draw(st.booleans()), shm_coalesce=draw(st.booleans()),
        shm_min_item_bytes=draw(st.integers(0, 1 << 20)),
        shm_min_new_allocation_bytes=draw(st.integers(0, 1 << 24)),
        shm_min_forward_bytes=draw(st.integers(0, 1 << 24)),
        shm_compact_above_ratio=draw(maybe(st.floats(1.0, 100.0))),
        shm_compact_min_savings_bytes=draw(st.integers(0, 1 << 30)),
        shm_max_coalesced_bytes=draw(maybe(sizes)),
        max_worker_retries=draw(st.integers(0, 10)), aggregate_dir=agg_dir,
        aggregate_store=agg_store, aggregate_timeout_s=draw(finite),
        aggregate_serializer=draw(st.sampled_from(["json", "msgpack"])),
        aggregate_compressor=draw(st.sampled_from(["none", "zstd"])),
        execution_tracking=draw(st.sampled_from(list(ExecutionTrackingMode))),
        metrics_sink_config=draw(maybe(metrics)),
    )


run_policies = st.builds(
    RunPolicy, workers=st.integers(1, 64), backend=st.sampled_from(["serial", "process"]),
    subject_timeout_sec=maybe(finite), subject_spawn_timeout_sec=maybe(finite),
    graceful_shutdown_sec=finite, on_subject_failure=st.sampled_from(["continue", "fail_fast"]),
    oom_backoff=st.booleans(), oom_reduce_workers_by=st.integers(1, 8),
    cap_workers_to_gpu_pool=st.booleans(), resume=st.booleans(),
    checkpoint_dir=maybe(st.just("ckpt")),
    parallel_mode=st.sampled_from(["persistent", "isolated"]),
    auto_retry_rounds=st.integers(0, 5), retry_failed_subjects=st.booleans(),
    force_rerun_subjects=st.lists(names, max_size=4).map(tuple),
    clear_checkpoint_on_success=st.booleans(), strict_checkpoint_hash=st.booleans(),
    persistent_worker_max_consecutive_failures=st.integers(1, 5),
    persistent_worker_recycle_after_tasks=st.integers(0, 100),
)

any_options = st.one_of(runtime_options(), run_policies, store_options, mixture, metrics)


@settings(max_examples=200, deadline=None)
@given(any_options)
def test_json_round_trip_is_identity(opts):
    data = json.loads(json.dumps(opts.to_dict()))
    again = type(opts).from_dict(data)
    assert again == opts
    assert again.to_dict() == opts.to_dict()


@settings(max_examples=60, deadline=None)
@given(any_options)
def test_yaml_round_trip_is_identity(opts):
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load(yaml.safe_dump(opts.to_dict()))
    assert type(opts).from_dict(data) == opts


@settings(max_examples=300, deadline=None)
@given(any_options, st.data())
def test_any_invalid_edit_raises(opts, data):
    cls = type(opts)
    name = data.draw(st.sampled_from(sorted(BAD[cls])))
    value = data.draw(st.sampled_from(BAD[cls][name]))
    with pytest.raises(ZephonConfigError):
        opts.replace(**{name: value})


def test_to_dict_is_plain_data():
    o = RuntimeOptions(per_stage_runner={2: "process"}, execution_tracking="nodes",
                       metrics_sink_config=MetricsSinkConfig(default_tags={"a": "b"}))
    d = o.to_dict()
    assert d["mp_context"] == "spawn" and d["execution_tracking"] == "nodes"
    assert d["per_stage_runner"] == {2: "process"}  # int keys kept for YAML
    assert d["io_options"] == StoreOptions().to_dict()
    assert d["metrics_sink_config"]["default_tags"] == {"a": "b"}
    json.dumps(d)
    again = RuntimeOptions.from_dict(json.loads(json.dumps(d)))
    assert dict(again.per_stage_runner) == {2: "process"}  # "2" -> 2
