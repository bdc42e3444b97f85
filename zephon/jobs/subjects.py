"""Subject identity and cache keys.

A subject's id is ``subject.subject_id``, ``subject["subject_id"]``, or the
subject itself when it is a string; anything else is a config error naming the
subject's position. The cache key of a subject is ``fn.cache_key(subject)``
when the callable defines it, else ``"<module>.<qualname>:<subject id>"`` (the
qualified name of the function, or of the callable object's class), so two
different functions never share entries.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from typing import Any

from zephon.errors import ZephonConfigError

__all__ = ["cache_key_of", "callable_name", "subject_id_of", "subject_label"]


def subject_id_of(subject: Any, position: int) -> str:
    if isinstance(subject, str):
        sid = subject
    elif isinstance(subject, Mapping) and "subject_id" in subject:
        sid = subject["subject_id"]
    elif hasattr(subject, "subject_id"):
        sid = subject.subject_id
    else:
        raise ZephonConfigError(
            f"subject {position} ({type(subject).__name__}) has no id: give it a "
            "'subject_id' attribute or key, or use a string subject")
    if not isinstance(sid, str) or not sid:
        raise ZephonConfigError(f"subject {position}: subject_id must be a non-empty string, "
                                f"got {sid!r}")
    return sid


def callable_name(fn: Any) -> str:
    """``module.qualname`` of a function or method, of the wrapped function of a
    ``functools.partial`` (its arguments are not part of it: give such callables a
    ``cache_key``), else of the callable object's class."""
    if isinstance(fn, functools.partial):
        return callable_name(fn.func) + "[partial]"
    target: Any = fn
    if not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        target = type(fn)
    return f"{getattr(target, '__module__', None) or '?'}.{target.__qualname__}"


def cache_key_of(fn: Any, subject: Any, subject_id: str) -> str:
    custom = getattr(fn, "cache_key", None)
    if callable(custom):
        key = custom(subject)
        if not isinstance(key, str) or not key:
            raise ZephonConfigError(f"{callable_name(fn)}.cache_key returned {key!r}; "
                                    "expected a non-empty string")
        return key
    return f"{callable_name(fn)}:{subject_id}"


def subject_label(names, index: int) -> str:
    """How an error made by a backend names a subject: by its id and its position
    (``subject 'shard-7' (#7)``); by position alone when the ids are not known.

    Example::

        >>> subject_label(["a", "b"], 1)
        "subject 'b' (#1)"
    """
    if names is None or not 0 <= index < len(names):
        return f"subject #{index}"
    return f"subject {names[index]!r} (#{index})"
