"""Exceptions across a process boundary: one wire form for every zephon worker.

``encode_exception(exc)`` gives ``(traceback text, pickled exception)``; an
exception that does not survive a pickle round trip travels as a
``RuntimeError`` carrying its type name and message, so the receiver always
gets something it can raise. ``decode_exception(blob, tb, where)`` rebuilds it
and attaches the worker's traceback as a :class:`~zephon.errors.RemoteTraceback`
``__cause__``, prefixed with ``where`` (which task, which worker).
"""

from __future__ import annotations

import pickle
import traceback

from zephon.errors import RemoteTraceback, TransportError

__all__ = ["decode_exception", "encode_exception"]


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
