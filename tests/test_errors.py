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
    (ze.AggregationTimeoutError, (ze.ZephonError, TimeoutError)),
    (ze.SubjectTimeoutError, (ze.ZephonError, TimeoutError)),
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


def test_validation_error_lists_every_issue_with_codes():
    err = ze.ValidationError([("Z001", "map(f)", "not picklable"), ("Z003", "shuffle", "x")])
    text = str(err)
    assert "2 validation issue(s)" in text and "[Z001] map(f): not picklable" in text
    assert [i.code for i in err.issues] == ["Z001", "Z003"]
    assert pickle.loads(pickle.dumps(err)).issues == err.issues
