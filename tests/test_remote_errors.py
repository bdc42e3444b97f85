"""The wire form of an exception raised in a worker process (zephon.transport.remote_errors):
its ``raise ... from`` chain arrives linked as it was raised, with the worker's traceback
at the end of it, whatever a link holds."""

from __future__ import annotations

import threading

from zephon.errors import OpError, RemoteTraceback
from zephon.transport.remote_errors import (
    MAX_CHAIN,
    decode_exception,
    encode_exception,
    remote_traceback,
)


def raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback, as a worker catches it."""
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - the test's own exception
        return caught


def across(exc: BaseException, where: str = "task 3 on worker 1") -> BaseException:
    tb, blob = encode_exception(exc)
    return decode_exception(blob, tb, where)


def chain(exc: BaseException | None) -> list[BaseException]:
    links = []
    while exc is not None:
        links.append(exc)
        exc = exc.__cause__
    return links


def test_an_op_error_arrives_with_the_ops_own_exception_as_its_cause():
    try:
        try:
            {}["missing"]
        except KeyError as err:
            raise OpError("op map(f) failed on sample 7", op="map(f)", sample_id=7) from err
    except OpError as caught:
        got = across(caught)
    links = chain(got)
    assert [type(e) for e in links] == [OpError, KeyError, RemoteTraceback]
    assert (got.op, got.sample_id) == ("map(f)", 7)
    assert links[1].args == ("missing",)
    text = str(links[2])
    assert "task 3 on worker 1" in text and "KeyError: 'missing'" in text
    assert remote_traceback(got) == text


def test_an_exception_without_a_cause_gets_the_traceback_as_its_cause():
    got = across(raised(ValueError("boom")))
    assert type(got) is ValueError and got.args == ("boom",)
    assert isinstance(got.__cause__, RemoteTraceback)
    assert "ValueError: boom" in str(got.__cause__)


class HoldsALock(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def test_a_link_that_does_not_pickle_travels_as_text_and_the_chain_goes_on():
    inner = raised(OSError(5, "disk"))
    try:
        try:
            raise inner
        except OSError as err:
            raise HoldsALock("held") from err
    except HoldsALock as middle_caught:
        try:
            raise ValueError("outer") from middle_caught
        except ValueError as caught:
            got = across(caught)
    links = chain(got)
    assert [type(e) for e in links] == [ValueError, RuntimeError, OSError, RemoteTraceback]
    assert str(links[1]) == "HoldsALock: held"
    assert (links[2].errno, links[2].strerror) == (5, "disk")


def test_a_cause_cycle_ends_and_a_long_chain_is_cut():
    a, b = ValueError("a"), KeyError("b")
    a.__cause__, b.__cause__ = b, a
    links = chain(across(a))
    assert [type(e) for e in links] == [ValueError, KeyError, RemoteTraceback]

    deep = ValueError(0)
    top = deep
    for i in range(1, 3 * MAX_CHAIN):
        top, top.__cause__ = ValueError(i), top
    links = chain(across(top))
    assert len(links) == MAX_CHAIN + 1 and isinstance(links[-1], RemoteTraceback)
    assert [e.args[0] for e in links[:-1]] == list(range(3 * MAX_CHAIN - 1, 2 * MAX_CHAIN - 1, -1))


def test_a_local_exception_has_no_remote_traceback():
    assert remote_traceback(raised(ValueError("here"))) is None
    try:
        raise ValueError("outer") from KeyError("inner")
    except ValueError as caught:
        assert remote_traceback(caught) is None


class KeywordOnly(Exception):
    def __init__(self, message, *, status):
        super().__init__(message)
        self.status = status


class RebuildsAsText(Exception):
    def __reduce__(self):
        return str, ("not an exception",)


def test_a_link_whose_constructor_takes_other_arguments_keeps_its_type_and_fields():
    got = across(raised(KeywordOnly("not found", status=404)))
    assert type(got) is KeywordOnly and got.args == ("not found",) and got.status == 404


def test_a_link_whose_pickle_rebuilds_something_else_still_arrives_as_an_exception():
    try:
        try:
            raise RebuildsAsText("odd")
        except RebuildsAsText as err:
            raise ValueError("outer") from err
    except ValueError as caught:
        got = across(caught)
    assert type(got) is ValueError and type(got.__cause__) is RebuildsAsText
    assert got.__cause__.args == ("odd",)


def test_the_traceback_found_is_the_one_of_the_nearest_process():
    inner = across(raised(KeyError("far")), where="task 1 on a far worker")
    try:
        raise ValueError("near") from inner
    except ValueError as caught:
        got = across(caught, where="task 2 on a near worker")
    links = chain(got)
    assert [type(e) for e in links] == [ValueError, KeyError, RemoteTraceback, RemoteTraceback]
    text = remote_traceback(got)
    assert "near worker" in text and "far worker" in text and "ValueError: near" in text
