"""The error hierarchy (zephon.errors), and that errors survive a process boundary."""

from __future__ import annotations

import pickle

import pytest

from zephon import errors as ze


@pytest.mark.parametrize("cls,bases", [
    (ze.ZephonConfigError, (ze.ZephonError, ValueError)),
    (ze.ValidationError, (ze.ZephonError,)),
    (ze.WorkerCrashedError, (ze.ZephonError,)),
    (ze.CheckpointError, (ze.ZephonError,)),
    (ze.ResumeMismatchError, (ze.CheckpointError,)),
    (ze.IteratorClosedError, (ze.ZephonError, RuntimeError)),
    (ze.AggregationTimeoutError, (ze.ZephonError, TimeoutError)),
    (ze.SubjectTimeoutError, (ze.ZephonError, TimeoutError)),
    (ze.AttemptTimeout, (ze.ZephonError, TimeoutError)),
    (ze.SerializationError, (ze.ZephonError, TypeError)),
    (ze.ChannelClosed, (ze.TransportError,)),
    (ze.ShmSpaceError, (ze.TransportError,)),
    (ze.ArenaFull, (ze.TransportError,)),
    (ze.ResultTimeoutError, (ze.TransportError, TimeoutError)),
    (ze.SourceError, (ze.ZephonError,)),
    (ze.OpError, (ze.ZephonError,)),
    (ze.JobSetupError, (ze.ZephonError,)),
    (ze.RecordedFailure, (ze.ZephonError,)),
])
def test_hierarchy(cls, bases):
    for base in bases:
        assert issubclass(cls, base)
    assert issubclass(ze.ZephonError, Exception)


@pytest.mark.parametrize("error", [
    ze.ZephonConfigError("bad", field="RuntimeOptions.max_workers"),
    ze.ValidationError([("Z001", "map(f)", "not picklable"), ("Z002", "map(g)", "mutates")]),
    ze.ValidationError("plain message"),
    ze.WorkerCrashedError("died", seq=12, signal=9, op="map(f)", worker=1),
    ze.CheckpointError("truncated"),
    ze.AggregationTimeoutError("rank 3 missing", missing=[3]),
    ze.SubjectTimeoutError("too slow", subject_id="S01", timeout_s=2.0),
])
def test_errors_pickle_with_their_attributes(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert {k: v for k, v in vars(copy).items()} == {k: v for k, v in vars(error).items()}


# One instance of every exception class zephon.errors exports, each field set to a value
# other than its default, so that a field the pickle drops shows up as a difference.
EVERY_ERROR = {
    ze.ZephonError: ze.ZephonError("base"),
    ze.ZephonConfigError: ze.ZephonConfigError("bad", field="RuntimeOptions.max_workers"),
    ze.ValidationError: ze.ValidationError([("Z001", "map(f)", "not picklable")]),
    ze.WorkerCrashedError: ze.WorkerCrashedError("died", seq=3, signal=9, op="map(f)",
                                                 worker=2),
    ze.CheckpointError: ze.CheckpointError("truncated"),
    ze.ResumeMismatchError: ze.ResumeMismatchError("other files", kinds=["files"],
                                                   diff={"files": ["changed: a.bin"]}),
    ze.IteratorClosedError: ze.IteratorClosedError("next() on a closed PipelineIterator"),
    ze.AggregationTimeoutError: ze.AggregationTimeoutError("late", missing=[1, 3]),
    ze.SubjectTimeoutError: ze.SubjectTimeoutError("slow", subject_id="S01", timeout_s=2.5),
    ze.TransportError: ze.TransportError("peer gone"),
    ze.SerializationError: ze.SerializationError("no", path="payload['x'][3]"),
    ze.ChannelClosed: ze.ChannelClosed("closed mid-message"),
    ze.ShmSpaceError: ze.ShmSpaceError("no space in /dev/shm"),
    ze.ArenaFull: ze.ArenaFull("full", 4096, 8192),
    ze.SourceError: ze.SourceError("bad line 3 of a.jsonl"),
    ze.AttemptTimeout: ze.AttemptTimeout("no answer", timeout_s=1.5),
    ze.OpError: ze.OpError("op raised", op="map(f)", sample_id=("src", 7, 0)),
    ze.JobSetupError: ze.JobSetupError("setup() failed"),
    ze.RecordedFailure: ze.RecordedFailure("KeyError: 'x'", error_type="KeyError",
                                           traceback="Traceback ..."),
    ze.ResultTimeoutError: ze.ResultTimeoutError("no result", timeout_s=0.5),
    ze.RemoteTraceback: ze.RemoteTraceback("Traceback (most recent call last): ..."),
}


def test_every_exported_exception_class_is_covered():
    exported = {getattr(ze, name) for name in ze.__all__}
    classes = {c for c in exported if isinstance(c, type) and issubclass(c, BaseException)}
    assert classes == set(EVERY_ERROR)


@pytest.mark.parametrize("cls", list(EVERY_ERROR), ids=lambda c: c.__name__)
def test_every_error_survives_pickle_with_its_message_and_fields(cls):
    error = EVERY_ERROR[cls]
    assert type(error) is cls
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls and str(copy) == str(error)
    assert vars(copy) == vars(error)


def test_errors_raised_by_a_spawned_process_keep_their_fields():
    """The real boundary: a spawn child raises each error, the parent receives it."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        for cls in (ze.ArenaFull, ze.OpError, ze.RecordedFailure, ze.AttemptTimeout):
            with pytest.raises(cls) as info:
                pool.apply(_raise, (cls.__name__,))
            assert vars(info.value) == vars(EVERY_ERROR[cls])


def _raise(name: str):
    raise EVERY_ERROR[getattr(ze, name)]


def test_old_import_paths_name_the_same_classes():
    from zephon.io.config import AttemptTimeout
    from zephon.io.errors import SourceError
    from zephon.jobs.process import JobSetupError
    from zephon.jobs.runner import RecordedFailure
    from zephon.pipeline.ops import OpError
    from zephon.pipeline.sources import SourceError as SourcesSourceError
    from zephon.transport.arena import ArenaFull, ShmSpaceError
    from zephon.transport.channel import ChannelClosed

    assert (AttemptTimeout, SourceError, JobSetupError, RecordedFailure, OpError,
            SourcesSourceError, ArenaFull, ShmSpaceError, ChannelClosed) == (
        ze.AttemptTimeout, ze.SourceError, ze.JobSetupError, ze.RecordedFailure, ze.OpError,
        ze.SourceError, ze.ArenaFull, ze.ShmSpaceError, ze.ChannelClosed)


def test_validation_error_lists_every_issue_with_codes():
    err = ze.ValidationError([("Z001", "map(f)", "not picklable"), ("Z003", "shuffle", "x")])
    text = str(err)
    assert "2 validation issue(s)" in text and "[Z001] map(f): not picklable" in text
    assert [i.code for i in err.issues] == ["Z001", "Z003"]
    assert pickle.loads(pickle.dumps(err)).issues == err.issues


class _MyCrash(ze.WorkerCrashedError):
    """A user's subclass of a zephon error."""


@pytest.mark.parametrize("cls", [c for c in EVERY_ERROR if c is not ze.RemoteTraceback],
                         ids=lambda c: c.__name__)
def test_a_subclass_its_extra_attributes_and_notes_survive_pickle(cls):
    base = EVERY_ERROR[cls]
    sub = type(f"My{cls.__name__}", (cls,), {"__module__": __name__})
    globals()[sub.__name__] = sub  # picklable by name
    try:
        error = sub.__new__(sub)
        error.__dict__.update(vars(base))
        error.args = base.args
        error.extra = {"attempt": 2}
        error.add_note("while loading shard 7")
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is sub and str(copy) == str(error)
        assert copy.extra == {"attempt": 2}
        assert copy.__notes__ == ["while loading shard 7"]
    finally:
        del globals()[sub.__name__]


def test_a_subclass_with_its_own_constructor_survives_pickle():
    error = _MyCrash("died", seq=3, signal=9, worker=1, pid=1234, tasks=[2])
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is _MyCrash and vars(copy) == vars(error)
