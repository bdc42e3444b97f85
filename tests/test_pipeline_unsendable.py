"""A result a process worker cannot send is an error that names the op, the sample and
the offending object's path, raised after every item before it (the stream-order error
rule); the inline and threads runners never pickle, so there the same op just works."""

from __future__ import annotations

import pytest

import _exit_fns as X
import _pipeline_fns as F
from zephon import Pipeline, RuntimeOptions, sources
from zephon.errors import OpError, ValidationError


def pipe(runner: str, chunk_size: int) -> Pipeline:
    return (Pipeline(sources.from_callable(100, F.make_sample), shuffle=False,
                     chunk_size=chunk_size)
            .map(X.lock_at_57)
            .options(RuntimeOptions(runner=runner, max_workers=2)))


@pytest.mark.parametrize("chunk_size", [64, 10])
def test_an_unpicklable_result_names_op_sample_and_path_after_the_items_before_it(
        chunk_size):
    got = []
    with pytest.raises(OpError) as info:
        for item in pipe("process", chunk_size):
            got.append(item["id"])
    assert got == list(range(57))  # every item before the failing sample, in order
    error = info.value
    assert error.op == "map(lock_at_57)"
    assert error.sample_id[1:] == (57, 0)
    message = str(error)
    assert "value['meta']['lock'] cannot be pickled" in message and "_thread.lock" in message
    assert "runner='threads'" in message


@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_the_same_op_just_works_where_nothing_is_pickled(runner):
    out = list(pipe(runner, 64))
    assert [o["id"] for o in out] == list(range(100))
    assert "lock" in out[57]["meta"]


def _validated(fn, runner: str, mode: str = "strict"):
    p = (Pipeline(sources.from_callable(10, F.make_sample), shuffle=False).map(fn)
         .options(RuntimeOptions(runner=runner, max_workers=1, auto_validation=mode)))
    it = iter(p)
    it.close()


@pytest.mark.parametrize("fn, what", [(X.lock_always, "output['lock']"),
                                      (X.generator_out, "output ")])
def test_validation_reports_an_unpicklable_output_for_process_runners(fn, what):
    with pytest.raises(ValidationError) as info:
        _validated(fn, "process")
    codes = [i.code for i in info.value.issues]
    assert codes == ["Z004"], info.value
    assert what in str(info.value) and "cannot be pickled" in str(info.value)


@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_validation_does_not_call_an_unpicklable_output_nondeterministic(runner):
    _validated(X.lock_always, runner)  # nothing to report: never pickled there


def test_validation_warns_about_outputs_that_share_a_buffer_but_never_raises():
    with pytest.warns(RuntimeWarning, match=r"Z005.*share memory between outputs"):
        _validated(X.into_buffer, "inline", "strict")
