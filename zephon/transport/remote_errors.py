"""Exceptions across a process boundary: one wire form for every zephon worker.

``encode_exception(exc)`` gives ``(traceback text, pickled exception)``; an
exception that does not survive a pickle round trip travels as a
``RuntimeError`` carrying its type name and message, so the receiver always
gets something it can raise. ``decode_exception(blob, tb, where)`` rebuilds it
and attaches the worker's traceback as a :class:`~zephon.errors.RemoteTraceback`
``__cause__``, prefixed with ``where`` (which task, which worker).

An exception may carry results its task made before it failed, under
:data:`DONE_ATTR`. Those do not go inside the pickled exception: a pool worker
takes them off it (:func:`take_done`) and sends them with the ERROR message as
it sends a result (through its arena, by reference where it can), and the pool
puts them back on the rebuilt exception. So they survive an exception that does
not pickle, and large ones cost no pickle round trip.
"""

from __future__ import annotations

import pickle
import traceback

from zephon.errors import RemoteTraceback, TransportError

__all__ = ["DONE_ATTR", "decode_exception", "encode_exception", "put_done", "take_done"]

#: the attribute of an exception that holds what its task made before it failed
DONE_ATTR = "zephon_done"


def take_done(exc: BaseException):
    """The results ``exc`` carries (:data:`DONE_ATTR`), taken off it, or None."""
    try:
        return vars(exc).pop(DONE_ATTR, None)
    except TypeError:  # an exception without a __dict__
        return None


def put_done(exc: BaseException, done) -> None:
    """Put results back on ``exc`` (:data:`DONE_ATTR`); dropped if it takes no
    attributes."""
    try:
        setattr(exc, DONE_ATTR, done)
    except (AttributeError, TypeError):
        pass


def encode_exception(exc: BaseException) -> tuple[str, bytes]:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc, protocol=5)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - an unpicklable exception travels as text
        blob = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"), protocol=5)
    return tb, blob


def decode_exception(blob: bytes, tb: str, where: str) -> BaseException:
    try:
        exc = pickle.loads(blob)
    except Exception as err:  # noqa: BLE001
        exc = TransportError(f"{where} failed and its exception could not be rebuilt: {err}")
    exc.__cause__ = RemoteTraceback(f"\n(in {where})\n{tb}")
    return exc
