"""Exceptions across a process boundary: one wire form for every zephon worker.

``encode_exception(exc)`` gives ``(traceback text, pickled cause chain)``: ``exc``
and the exceptions it was raised ``from`` (``__cause__``, outermost first, at most
:data:`MAX_CHAIN` of them), each link pickled on its own (its ``__cause__`` is not
part of its pickle) and once. A link travels as itself when its pickle rebuilds an
exception; else as its class, ``args`` and attributes, rebuilt without calling its
``__init__`` (an exception whose constructor takes other arguments than its
``args``: keyword-only ones, say); else as text, a ``RuntimeError`` naming its type
and message. ``decode_exception(blob, tb, where)`` rebuilds the links one by one (a
link that cannot be rebuilt here, a class this process cannot import say, becomes
a :class:`~zephon.errors.TransportError` naming it; the others are kept), links each
to its cause as it was raised, and attaches the worker's traceback text, prefixed
with ``where`` (which task, which worker), as a :class:`~zephon.errors.RemoteTraceback`
``__cause__`` of the innermost link. So an op's ``KeyError`` wrapped in an
:class:`~zephon.errors.OpError` reaches the loop as the inline runner raises it,
``OpError`` with the ``KeyError`` as its ``__cause__``, and the worker's traceback
(the whole chain as the worker would have printed it) one link further;
:func:`remote_traceback` finds the text. Encoding never raises: a link whose
``str()`` raises is named by its type alone.
Implicit chaining (``__context__``) is not rebuilt: the traceback text shows it.

This is the error part of a failed unit's envelope
(:class:`~zephon.transport.failure.UnitFailure`): what the unit made before it
fails does not go inside the pickled exception but travels next to it, as a result
would (a pool worker sends it through its arena, by reference where it can), so it
survives an exception that does not pickle, and large results cost no pickle round
trip.
"""

from __future__ import annotations

import itertools
import pickle
import traceback

from zephon.errors import RemoteTraceback, TransportError, remote_traceback

__all__ = ["MAX_CHAIN", "decode_exception", "encode_exception", "remote_traceback"]

#: the most links of a ``raise ... from`` chain that travel (the outermost ones)
MAX_CHAIN = 16


def _text(exc: BaseException) -> str:
    """``"Type: message"`` for ``exc``, whatever its ``__str__`` does."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - as traceback prints it
        message = "<exception str() failed>"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _rebuild_bare(cls: type, args: tuple, state: dict | None) -> BaseException:
    """``cls`` with ``args`` and ``state``, its ``__init__`` not called."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    if state:
        exc.__dict__.update(state)
    return exc


def _rebuilds(blob: bytes) -> bool:
    try:
        return isinstance(pickle.loads(blob), BaseException)
    except Exception:  # noqa: BLE001 - it does not: the next form is tried
        return False


class _Bare:
    """Pickles as an exception of ``cls`` rebuilt from ``args`` and ``state`` without
    its ``__init__`` (:func:`_rebuild_bare`)."""

    __slots__ = ("args", "cls", "state")

    def __init__(self, cls: type, args: tuple, state: dict | None) -> None:
        self.cls, self.args, self.state = cls, args, state

    def __reduce__(self):
        return _rebuild_bare, (self.cls, self.args, self.state)


def _link(exc: BaseException) -> tuple[str, bytes]:
    """One link's wire form, ``(text, pickle)``: the pickle rebuilds an exception here
    (the text names the link should it not rebuild in the receiver)."""
    text = _text(exc)
    for form in (lambda: exc,
                 lambda: _Bare(type(exc), tuple(exc.args), getattr(exc, "__dict__", None))):
        try:
            blob = pickle.dumps(form(), protocol=5)
        except Exception:  # noqa: BLE001 - this form does not pickle: the next one
            continue
        if _rebuilds(blob):
            return text, blob
    return text, pickle.dumps(RuntimeError(text), protocol=5)


def encode_exception(exc: BaseException) -> tuple[str, bytes]:
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:  # noqa: BLE001 - a link whose str() raises inside traceback itself
        tb = f"{_text(exc)}\n(its traceback could not be formatted)\n"
    links: list[tuple[str, bytes]] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(links) < MAX_CHAIN:
        seen.add(id(cur))
        links.append(_link(cur))
        cause = cur.__cause__
        cur = cause if isinstance(cause, BaseException) else None
    return tb, pickle.dumps(links, protocol=5)


def _unlink(text: str, blob: bytes, where: str) -> BaseException:
    try:
        exc = pickle.loads(blob)
    except Exception as err:  # noqa: BLE001 - this link only: the others are kept
        return TransportError(f"{where} raised {text}, which could not be rebuilt here: "
                              f"{type(err).__name__}: {err}")
    if isinstance(exc, BaseException):
        return exc
    return TransportError(f"{where} raised {text}, which rebuilt here as a "
                          f"{type(exc).__name__}")


def decode_exception(blob: bytes, tb: str, where: str) -> BaseException:
    try:
        links = [_unlink(text, part, where) for text, part in pickle.loads(blob)]
    except Exception as err:  # noqa: BLE001 - the chain itself did not arrive whole
        links = [TransportError(f"{where} failed and its exception could not be rebuilt: "
                                f"{type(err).__name__}: {err}")]
    if not links:
        links = [TransportError(f"{where} failed and sent no exception")]
    for outer, inner in itertools.pairwise(links):
        outer.__cause__ = inner
    links[-1].__cause__ = RemoteTraceback(f"\n(in {where}: the chain as the worker printed it)"
                                          f"\n{tb}")
    return links[0]
