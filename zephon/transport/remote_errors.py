"""Exceptions across a process boundary: one wire form for every zephon worker.

``encode_exception(exc)`` gives ``(traceback text, pickled cause chain)``: ``exc``
and the exceptions it was raised ``from`` (``__cause__``, outermost first, at most
:data:`MAX_CHAIN` of them). Each link that does not survive a pickle round trip
travels as a ``RuntimeError`` carrying its type name and message, so the receiver
always gets something it can raise. ``decode_exception(blob, tb, where)`` rebuilds
the chain as it was, an exception linked to its cause, and attaches the worker's
traceback, prefixed with ``where`` (which task, which worker), as a
:class:`~zephon.errors.RemoteTraceback` ``__cause__`` of the innermost link. So an
op's ``KeyError`` wrapped in an :class:`~zephon.errors.OpError` reaches the loop as
the inline runner raises it, ``OpError`` with the ``KeyError`` as its ``__cause__``,
and the worker's traceback one link further (:func:`remote_traceback` finds it).
Implicit chaining (``__context__``) is not rebuilt: the traceback text shows it.

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

from zephon.errors import RemoteTraceback, TransportError, remote_traceback

__all__ = ["DONE_ATTR", "MAX_CHAIN", "decode_exception", "encode_exception", "put_done",
           "remote_traceback", "take_done"]

#: the most links of a ``raise ... from`` chain that travel (the outermost ones)
MAX_CHAIN = 16

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


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc, protocol=5))
    except Exception:  # noqa: BLE001 - an unpicklable exception travels as text
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def encode_exception(exc: BaseException) -> tuple[str, bytes]:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    links: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(links) < MAX_CHAIN:
        seen.add(id(cur))
        links.append(_sendable(cur))
        cur = cur.__cause__
    # Each link pickles on its own: its __cause__ is not part of its pickle.
    return tb, pickle.dumps(links, protocol=5)


def decode_exception(blob: bytes, tb: str, where: str) -> BaseException:
    try:
        links = pickle.loads(blob)
    except Exception as err:  # noqa: BLE001
        links = [TransportError(f"{where} failed and its exception could not be rebuilt: {err}")]
    for outer, inner in zip(links, links[1:]):
        outer.__cause__ = inner
    links[-1].__cause__ = RemoteTraceback(f"\n(in {where})\n{tb}")
    return links[0]
