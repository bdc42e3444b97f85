"""Crash retries, MTP, bad input and shutdown for pipelines (real processes, real signals)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import _pipeline_fns as F
from zephon import (
    CheckpointError, OpError, Pipeline, RuntimeOptions, SerializationError, ValidationError,
    WorkerCrashedError, ZephonConfigError, sources,
)
from zephon.checkpoint import encode_state
from zephon.transport.remote_errors import remote_traceback


def ids(pipe):
    return [b["id"].tolist() for b in pipe]


def base(n=30):
    return Pipeline(sources.from_callable(n, F.make_sample), seed=5, chunk_size=3) \
        .shuffle(4).batch(2)


def test_a_worker_killed_mid_stream_gives_the_same_stream(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_TEST_DIR", str(tmp_path))
    pipe = Pipeline(sources.from_callable(30, F.make_sample), seed=5, chunk_size=3) \
        .map(F.kill_once, parallelism=2).shuffle(4).batch(2)
    marker = tmp_path / "killed-7"
    marker.touch()  # inline runs in this very process: the reference must not kill it
    reference = ids(pipe.options(RuntimeOptions(runner="inline")))
    marker.unlink()
    got = ids(pipe.options(RuntimeOptions(runner="process", max_workers=2)))
    assert os.path.exists(tmp_path / "killed-7")  # the crash really happened
    assert got == reference


def test_exhausted_retries_name_the_sequence():
    pipe = Pipeline(sources.from_callable(30, F.make_sample), seed=5, chunk_size=3) \
        .map(F.kill_always, parallelism=2).batch(2) \
        .options(RuntimeOptions(runner="process", max_worker_retries=1))
    with pytest.raises(WorkerCrashedError, match=r"sequence \d+ of lane 0 killed its worker 2 "
                                                 r"times \(signal 9\)") as info:
        list(pipe)
    assert info.value.seq is not None and info.value.signal == 9


def test_mtp_mode_same_stream_and_checkpoints_count_only_consumed():
    pipe = base(40)
    reference = ids(pipe.options(RuntimeOptions(runner="inline")))
    mtp = pipe.options(RuntimeOptions(mtp_mode=True, runner="threads", mtp_buffer=6,
                                      mtp_prefetch=4))
    it = iter(mtp)
    head = [next(it)["id"].tolist() for _ in range(3)]
    state = mtp.checkpoint()  # the subprocess ran ahead; only 3 were handed over
    mtp.close()
    again = pipe.options(RuntimeOptions(runner="inline"))
    again.restore(state)
    assert head + ids(again) == reference
    whole = pipe.options(RuntimeOptions(mtp_mode=True, mtp_prefetch=0))
    assert ids(whole) == reference and whole.final_state is not None


def test_op_error_names_op_and_sample():
    pipe = Pipeline(sources.from_callable(20, F.make_sample), shuffle=False).map(F.boom)
    for runner in ("inline", "process"):
        with pytest.raises(OpError, match=r"map\(boom\) failed on sample \('callable', 13, 0\): "
                                          r"ValueError: thirteen is unlucky") as info:
            list(pipe.options(RuntimeOptions(runner=runner)))
        assert info.value.op == "map(boom)" and tuple(info.value.sample_id) == ("callable", 13, 0)


def test_unpicklable_op_under_the_process_runner_fails_before_any_worker():
    pipe = Pipeline(sources.from_callable(5, F.make_sample)).map(lambda s: s) \
        .options(RuntimeOptions(runner="process"))
    with pytest.raises(ValidationError, match="Z001"):
        iter(pipe)
    off = pipe.options(RuntimeOptions(runner="process", auto_validation="off"))
    with pytest.raises(SerializationError, match="cannot be pickled"):
        iter(off)


def test_validation_finds_nondeterminism_and_mutation():
    src = sources.from_callable(5, F.make_sample)
    with pytest.raises(ValidationError) as info:
        iter(Pipeline(src).map(F.nondeterministic).map(F.mutate))
    codes = [i.code for i in info.value.issues]
    assert "Z002" in codes
    with pytest.raises(ValidationError, match="Z003"):
        iter(Pipeline(src).map(F.mutate))
    with pytest.warns(RuntimeWarning, match="Z003"):
        run = iter(Pipeline(src).map(F.mutate).options(RuntimeOptions(auto_validation="warn")))
    run.close()
    list(Pipeline(src).map(F.mutate).options(RuntimeOptions(auto_validation="off")))


@pytest.mark.parametrize("bad,reason", [
    (b"", "bad magic"),
    (b"not a checkpoint at all", "bad magic"),
    (b"ZEPHONCK\x09\x00\x01...", "version 9"),
])
def test_malformed_checkpoint_bytes(bad, reason):
    with pytest.raises(CheckpointError, match=reason):
        base().restore(bad)


def test_truncated_foreign_and_mismatched_checkpoints():
    pipe = base()
    it = iter(pipe)
    next(it)
    state = pipe.checkpoint()
    pipe.close()
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        base().restore(state[:-5])
    with pytest.raises(CheckpointError, match="different pipeline"):
        base().batch(3).restore(state)
    with pytest.raises(CheckpointError, match="canonical_replicas=1.*2"):
        base().options(RuntimeOptions(canonical_replicas=2)).restore(state)
    with pytest.raises(CheckpointError, match="lacks"):
        base().restore(encode_state({"hello": 1}))
    with pytest.raises(CheckpointError, match="bytes"):
        base().restore("a string")


def test_json_and_uncompressed_checkpoints_restore_too():
    pipe = base().options(RuntimeOptions(aggregate_serializer="json",
                                         aggregate_compressor="none"))
    reference = ids(base())
    it = iter(pipe)
    head = [next(it)["id"].tolist() for _ in range(4)]
    state = pipe.checkpoint()
    pipe.close()
    assert b'"fingerprint"' in state  # readable JSON, no compression
    again = base()
    again.restore(state)
    assert head + ids(again) == reference


def _worker_processes(it):
    return [h.process for ex in it.engine.executors.values() for h in ex.pool.workers]


def test_break_releases_the_workers_without_the_cycle_collector():
    pipe = base(60).options(RuntimeOptions(runner="process", max_workers=2))
    gc.disable()  # reference counting alone must release the run
    try:
        procs = []
        for i, _ in enumerate(pipe):
            if i == 0:
                procs = _worker_processes(pipe._progress.current())
            if i == 2:
                break
        assert procs and pipe._progress.current() is None  # the loop's iterator is gone...
        for p in procs:
            p.join(15)
            assert not p.is_alive()  # ...and with it every worker
    finally:
        gc.enable()


def test_iterator_owns_the_run_and_the_pipeline_stays_a_definition():
    pipe = base(30)
    reference = ids(base(30))
    it = iter(pipe)
    head = [next(it)["id"].tolist() for _ in range(3)]
    state = it.checkpoint()
    assert pipe.checkpoint() == state  # the shortcut reads the live run
    it.close()
    assert pipe.checkpoint() == state  # and still answers once the run is over
    second = iter(pipe)  # a new run continues after the last item delivered...
    assert [next(second)["id"].tolist() for _ in range(2)] == reference[3:5]
    second.restore(state)  # ...and restarts from a restored state
    assert head + [b["id"].tolist() for b in second] == reference


def test_consumer_exception_closes_the_run():
    pipe = base(60).options(RuntimeOptions(runner="process", max_workers=2))
    procs = []
    with pytest.raises(RuntimeError):
        for i, _ in enumerate(pipe):
            if i == 0:
                procs = _worker_processes(pipe._progress.current())
            if i == 1:
                raise RuntimeError("consumer failed")
    pipe.close()
    for p in procs:
        p.join(15)
    assert procs and all(not p.is_alive() for p in procs)


def test_pipeline_config_errors():
    src = sources.from_callable(5, F.make_sample)
    with pytest.raises(ZephonConfigError, match="chunk_size"):
        Pipeline(src, chunk_size=0)
    with pytest.raises(ZephonConfigError, match="flush_every_k_chunks"):
        Pipeline(src).shuffle(3).options(RuntimeOptions(flush_every_k_chunks=0)).explain()
    with pytest.raises(ZephonConfigError, match="batch"):
        Pipeline(src).batch(0)


def test_mtp_prefetch_thread_runs_at_low_priority():
    if not hasattr(os, "getpriority"):
        pytest.skip("no per-thread priorities here")
    pipe = base(40).options(RuntimeOptions(mtp_mode=True, mtp_prefetch=2))
    it = iter(pipe)
    next(it)
    tid = it.thread.native_id
    try:
        expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)  # nice tops out at 19
        assert os.getpriority(os.PRIO_PROCESS, tid) >= expected
    finally:
        pipe.close()


def test_pipelines_dropped_mid_stream_release_their_workers_at_once():
    import multiprocessing

    gc.disable()  # reference counting alone, as in a loop that rebuilds its pipeline
    try:
        for _ in range(6):
            pipe = base(60).options(RuntimeOptions(runner="process", max_workers=2))
            it = iter(pipe)
            next(it)
            # every earlier pipeline's workers are gone already: at most this one's two
            assert len(multiprocessing.active_children()) <= 2
            del pipe, it
    finally:
        gc.enable()


@pytest.mark.parametrize("runner", ["threads", "process"])
def test_closing_a_half_consumed_run_stops_its_pump(runner):
    pipe = Pipeline(sources.from_callable(10_000, F.make_sample), chunk_size=8) \
        .map(F.double, parallelism=2).batch(4).options(RuntimeOptions(runner=runner,
                                                                       max_workers=2))
    it = iter(pipe)
    for _ in range(5):
        next(it)
    pump = it.thread
    it.close()
    assert not pump.is_alive()  # not left blocked on work the close cancelled


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_an_op_error_is_raised_in_stream_order_on_every_runner(runner):
    # Sample 3 fails last in time; the error raised is still sample 3's, after samples
    # 0-2, as the inline runner has it (not whichever worker reported first).
    pipe = Pipeline(sources.from_sequence(list(range(12))), shuffle=False, chunk_size=1) \
        .map(F.fail_from_3_late_first, parallelism=2) \
        .options(RuntimeOptions(runner=runner, max_workers=2, shutdown_mode="hard"))
    got = []
    with pytest.raises(OpError, match="sample 3 fails"):
        for x in pipe:
            got.append(x)
    assert got == [0, 1, 2]


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_an_op_exception_and_its_cause_reach_the_loop_as_the_inline_runner_raises_them(runner):
    # The op's own exception is the OpError's __cause__, and what it was raised from is
    # that one's, on every runner; a process worker's traceback comes one link further.
    pipe = Pipeline(sources.from_sequence(list(range(12))), shuffle=False, chunk_size=2) \
        .map(F.lookup_7).options(RuntimeOptions(runner=runner, max_workers=2))
    with pytest.raises(OpError, match="no entry for 7") as info:
        list(pipe)
    err = info.value
    assert err.sample_id == ("sequence", 7, 0)
    assert type(err.__cause__) is F.LookupFailed and err.__cause__.args == ("no entry for 7",)
    assert type(err.__cause__.__cause__) is KeyError and err.__cause__.__cause__.args == (7,)
    remote = remote_traceback(err)
    if runner == "process":
        assert "in lookup_7" in remote and "raise LookupFailed" in remote
    else:
        assert remote is None and err.__cause__.__cause__.__cause__ is None


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
@pytest.mark.parametrize("op,cause", [
    (F.cause_pid_bound_at_3, "_PidBound"),  # rebuilds only in the process that made it
    (F.cause_str_raises_at_3, "_StrRaises"),  # does not pickle, and str() raises
])
def test_a_cause_a_worker_cannot_send_whole_costs_that_link_only(runner, op, cause):
    # The items before the failure and the OpError with the op's ValueError arrive as
    # inline; only the odd link is replaced (by an error naming it) on the process runner.
    pipe = Pipeline(sources.from_sequence(list(range(8))), shuffle=False, chunk_size=1) \
        .map(op).options(RuntimeOptions(runner=runner, max_workers=2))
    got = []
    with pytest.raises(OpError, match="sample 3") as info:
        for x in pipe:
            got.append(x)
    assert got == [0, 1, 2]
    err = info.value
    assert err.sample_id == ("sequence", 3, 0) and type(err.__cause__) is ValueError
    odd = err.__cause__.__cause__
    if runner == "process":
        assert type(odd) is not getattr(F, cause) and cause in str(odd)
        assert remote_traceback(err) is not None
    else:
        assert type(odd) is getattr(F, cause)


@pytest.mark.parametrize("runner", ["inline", "process"])
@pytest.mark.parametrize("chunk_size", [1, 3, 8])
def test_the_first_failure_in_sample_order_is_raised_whatever_the_unit_size(runner,
                                                                            chunk_size):
    # Sample 4 fails in the map and sample 5 cannot be read. A stage runs each sample
    # through its ops before it reads the next, so the map's failure on sample 4 is the
    # error whatever the chunk and the parts the dispatch cuts. (Reading a whole unit
    # first raised sample 5's read error whenever 4 and 5 shared a unit or a part.)
    # What comes before the error does not depend on the parts either: the samples of a
    # failing part before its failing sample go on first.
    pipe = Pipeline(sources.from_callable(12, F.unreadable_from_5), shuffle=False,
                    chunk_size=chunk_size) \
        .map(F.map_fails_at_4, parallelism=2) \
        .options(RuntimeOptions(runner=runner, max_workers=2))
    got = []
    with pytest.raises(OpError, match="sample 4 fails in the map"):
        for x in pipe:
            got.append(x)
    assert got == [0, 1, 2, 3]


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_a_stop_iteration_from_the_source_is_an_error_not_the_end_of_a_unit(runner):
    # Read one sample at a time, a StopIteration escaping the source's identity() must
    # not read as "no more samples in this unit" (samples 5-7 silently dropped). The
    # samples before it go on first, whatever the part.
    pipe = Pipeline(F.Sharded(), shuffle=False, chunk_size=4).map(abs, parallelism=2) \
        .options(RuntimeOptions(runner=runner, max_workers=2))
    got = []
    with pytest.raises(OpError, match=r"identity\(\) raised StopIteration"):
        for x in pipe:
            got.append(x)
    assert got == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_an_earlier_stage_error_never_overtakes_a_later_stages_results(runner, chunk_size):
    # Stage 0 cannot read sample 9; stage 1 (after batch(2)) fails on the batch [4, 5].
    # Stage 0 runs ahead of stage 1, but its error waits for its place in the stream:
    # the batches before [4, 5] arrive, then stage 1's error, on every runner and chunk.
    # (Raised as soon as stage 1 read it, it dropped the batches stage 1 still had in
    # flight and hid stage 1's earlier error.)
    pipe = Pipeline(sources.from_callable(12, F.unreadable_from_9), shuffle=False,
                    chunk_size=chunk_size) \
        .map(F.identity, parallelism=2).batch(2).map_batch(F.batch_fails_at_4) \
        .options(RuntimeOptions(runner=runner, max_workers=2,
                                worker_allocation="per_stage_fixed"))
    got = []
    with pytest.raises(OpError, match="the batch with sample 4 fails"):
        for b in pipe:
            got.append(np.asarray(b["id"]).tolist())
    assert got == [[0, 1], [2, 3]]


def test_a_crash_past_its_retries_is_raised_after_the_results_before_it():
    # Sample 1 kills its worker on every try while sample 0 is still running on the
    # other worker. The crash error waits for its place: sample 0 arrives first. (Raised
    # from the executor at once, it dropped sample 0.)
    pipe = Pipeline(sources.from_sequence(list(range(6))), shuffle=False, chunk_size=1) \
        .map(F.slow_0_kill_1, parallelism=2) \
        .options(RuntimeOptions(runner="process", max_workers=2, max_worker_retries=1))
    got = []
    with pytest.raises(WorkerCrashedError,
                       match=r"sequence \d+ of lane 0 killed its worker 2 times"):
        for x in pipe:
            got.append(x)
    assert got == [0]


@pytest.mark.parametrize("runner", ["inline", "process", "autotune"])
def test_a_batch_that_fails_to_collate_hands_on_the_batches_before_it_in_its_message(runner):
    """A fused read -> batch stage over a columnar source sends several micro-batches
    per message on process workers (and plans so under autotune): one that fails to
    collate (outside the per-sample ops) fails its message, and the whole batches made
    before it in that message are handed on first, as every runner hands them on."""
    import warnings

    import _group_fns as G

    def run(**opts):
        pipe = Pipeline(G.RefusingColumns(), seed=3, chunk_size=64).batch(
            4, collate_fn=G.refusing_collate).options(RuntimeOptions(**opts))
        got = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the columnar read's fall-back warning
            with iter(pipe) as it, pytest.raises(OpError, match="collate refuses") as raised:
                for batch in it:
                    got.append(batch["x"][:, 0].tolist())
        return got, str(raised.value)

    want = run(runner="inline")
    opts = dict(worker_allocation="autotune", max_workers=2) if runner == "autotune" \
        else dict(runner=runner, max_workers=2)
    assert run(**opts) == want
    assert len(want[0]) > 16  # batches of several messages came before it
