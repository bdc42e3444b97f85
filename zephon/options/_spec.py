"""Declarative field checks shared by every option class.

Each option class is a frozen, slotted, keyword-only dataclass whose fields are
declared with :func:`option`, naming a :class:`Check`. One check object owns
everything about its field's value:

- ``validate``: type, range and enum checks; returns the normalised value
  (``int`` for numpy integers, ``float`` for ints in float fields, read-only
  :class:`FrozenMap` for mappings, ``tuple`` for sequences). Anything else is a
  :class:`~zephon.errors.ZephonConfigError` naming the field, the value and
  what is allowed. ``bool`` is never accepted as an ``int``; NaN and infinities
  are never accepted as floats; a ``str`` is never accepted as a sequence.
- ``dump``: the plain value for ``to_dict`` (JSON and YAML types only, except
  that int mapping keys stay ints so YAML keeps them).
- ``load``: the inverse of ``dump`` for ``from_dict`` (string keys back to
  ints, nested dicts back to option objects, names back to enums/contexts).

:class:`OptionsBase` runs the checks in ``__post_init__`` then the class's
cross-field rules (``_check_cross``), and provides ``to_dict``, ``from_dict``,
``replace`` and pickling through ``to_dict`` (so a pickled option object is
re-validated where it is unpickled, and mp contexts survive as names).

Standard library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import multiprocessing
import multiprocessing.context
import numbers
import os
import re
from collections.abc import Mapping
from typing import Any, Callable, Iterator

from zephon.errors import ZephonConfigError

__all__ = ["Check", "FrozenMap", "OptionsBase", "option", "fail"]


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def fail(owner: str, name: str, value: Any, allowed: str) -> ZephonConfigError:
    """Build the standard error: field, value seen, what is allowed."""
    return ZephonConfigError(
        f"{owner}.{name}: got {_show(value)}; expected {allowed}", field=f"{owner}.{name}"
    )


class FrozenMap(Mapping):
    """A read-only, hashable, picklable mapping (the value of mapping options)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping | None = None) -> None:
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __eq__(self, other) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __setattr__(self, name, value):
        raise AttributeError("FrozenMap is read-only")

    def __reduce__(self):
        return (FrozenMap, (self._data,))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


class Check:
    """Base check: subclasses set ``allowed`` and implement ``_validate``."""

    allowed = "a value"

    def __init__(self, *, optional: bool = False) -> None:
        self.optional = optional

    def describe(self) -> str:
        return f"{self.allowed} or None" if self.optional else self.allowed

    def validate(self, owner: str, name: str, value: Any) -> Any:
        if value is None:
            if self.optional:
                return None
            raise fail(owner, name, value, self.describe())
        return self._validate(owner, name, value)

    def _validate(self, owner: str, name: str, value: Any) -> Any:  # pragma: no cover
        raise NotImplementedError

    def dump(self, value: Any) -> Any:
        return value

    def load(self, value: Any) -> Any:
        return value


class Int(Check):
    def __init__(self, *, min: int | None = None, max: int | None = None, optional=False):
        super().__init__(optional=optional)
        self.min, self.max = min, max
        bounds = []
        if min is not None:
            bounds.append(f">= {min}")
        if max is not None:
            bounds.append(f"<= {max}")
        self.allowed = "an int" + (" " + " and ".join(bounds) if bounds else "")

    def _validate(self, owner, name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise fail(owner, name, value, self.describe())
        value = int(value)
        if (self.min is not None and value < self.min) or (
            self.max is not None and value > self.max
        ):
            raise fail(owner, name, value, self.describe())
        return value


class Float(Check):
    def __init__(self, *, min: float | None = None, exclusive_min: bool = False,
                 optional=False):
        super().__init__(optional=optional)
        self.min, self.exclusive_min = min, exclusive_min
        bound = ""
        if min is not None:
            bound = f" {'>' if exclusive_min else '>='} {min}"
        self.allowed = f"a finite number{bound}"

    def _validate(self, owner, name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise fail(owner, name, value, self.describe())
        value = float(value)
        if not math.isfinite(value):
            raise fail(owner, name, value, self.describe())
        if self.min is not None and (
            value < self.min or (self.exclusive_min and value == self.min)
        ):
            raise fail(owner, name, value, self.describe())
        return value


class Bool(Check):
    allowed = "True or False"

    def _validate(self, owner, name, value):
        if not isinstance(value, bool):
            raise fail(owner, name, value, self.describe())
        return value


class Str(Check):
    def __init__(self, *, choices: tuple[str, ...] | None = None, pattern: str | None = None,
                 optional=False):
        super().__init__(optional=optional)
        self.choices = choices
        self.pattern = re.compile(pattern) if pattern else None
        if choices:
            self.allowed = "one of " + ", ".join(repr(c) for c in choices)
        elif pattern:
            self.allowed = f"a string matching {pattern}"
        else:
            self.allowed = "a non-empty string"

    def _validate(self, owner, name, value):
        if not isinstance(value, str) or not value:
            raise fail(owner, name, value, self.describe())
        if self.choices and value not in self.choices:
            raise fail(owner, name, value, self.describe())
        if self.pattern and not self.pattern.fullmatch(value):
            raise fail(owner, name, value, self.describe())
        return value


class PathStr(Check):
    allowed = "a non-empty path (str or os.PathLike)"

    def _validate(self, owner, name, value):
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value:
            raise fail(owner, name, value, self.describe())
        return value


class EnumOf(Check):
    def __init__(self, enum_cls: type[enum.Enum], *, optional=False):
        super().__init__(optional=optional)
        self.enum_cls = enum_cls
        values = ", ".join(repr(m.value) for m in enum_cls)
        self.allowed = f"a {enum_cls.__name__} or one of {values}"

    def _validate(self, owner, name, value):
        if isinstance(value, self.enum_cls):
            return value
        if isinstance(value, str):
            for member in self.enum_cls:
                if member.value == value:
                    return member
        raise fail(owner, name, value, self.describe())

    def dump(self, value):
        return None if value is None else value.value


class Nested(Check):
    """A nested option object; ``from_dict`` accepts its dict form."""

    def __init__(self, cls: type, *, optional=False):
        super().__init__(optional=optional)
        self.cls = cls
        self.allowed = f"a {cls.__name__} (or its dict form in from_dict)"

    def _validate(self, owner, name, value):
        if not isinstance(value, self.cls):
            raise fail(owner, name, value, self.describe())
        return value

    def dump(self, value):
        return None if value is None else value.to_dict()

    def load(self, value):
        if isinstance(value, Mapping):
            return self.cls.from_dict(value)
        return value


class IntKeyMap(Check):
    """A mapping from stage index (int >= 0) to a value checked by ``value_check``."""

    def __init__(self, value_check: Check):
        super().__init__(optional=False)
        self.value_check = value_check
        self.allowed = f"a mapping of stage index (int >= 0) to {value_check.describe()}"

    def _validate(self, owner, name, value):
        if not isinstance(value, Mapping):
            raise fail(owner, name, value, self.describe())
        out = {}
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
                raise fail(owner, f"{name}[{key!r}]", key, "a stage index (int >= 0)")
            out[int(key)] = self.value_check.validate(owner, f"{name}[{key}]", item)
        return FrozenMap(out)

    def dump(self, value):
        return {k: self.value_check.dump(v) for k, v in value.items()}

    def load(self, value):
        if not isinstance(value, Mapping):
            return value
        out = {}
        for key, item in value.items():
            if isinstance(key, str) and re.fullmatch(r"[0-9]+", key):
                key = int(key)
            out[key] = self.value_check.load(item)
        return out


class StrMap(Check):
    allowed = "a mapping of str to str"

    def _validate(self, owner, name, value):
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise fail(owner, name, value, self.describe())
        return FrozenMap(value)

    def dump(self, value):
        return dict(value)


class StrTuple(Check):
    allowed = "a list or tuple of non-empty strings (not a single string)"

    def _validate(self, owner, name, value):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise fail(owner, name, value, self.describe())
        if not all(isinstance(v, str) and v for v in value):
            raise fail(owner, name, value, self.describe())
        return tuple(value)

    def dump(self, value):
        return list(value)


class MpContext(Check):
    """A multiprocessing context, or the name of a start method."""

    def __init__(self):
        super().__init__(optional=False)
        methods = ", ".join(repr(m) for m in multiprocessing.get_all_start_methods())
        self.allowed = f"a multiprocessing context or a start method name ({methods})"

    def _validate(self, owner, name, value):
        if isinstance(value, str):
            if value not in multiprocessing.get_all_start_methods():
                raise fail(owner, name, value, self.describe())
            return multiprocessing.get_context(value)
        if isinstance(value, multiprocessing.context.BaseContext):
            # Normalise to the concrete singleton so equality and hashing are stable.
            return multiprocessing.get_context(value.get_start_method())
        raise fail(owner, name, value, self.describe())

    def dump(self, value):
        return value.get_start_method()


def option(default: Any = dataclasses.MISSING, *, check: Check, doc: str,
           default_factory: Callable[[], Any] | Any = dataclasses.MISSING) -> Any:
    """Declare an option field with its check and its one-paragraph doc."""
    return dataclasses.field(
        default=default, default_factory=default_factory,
        metadata={"check": check, "doc": doc},
    )


def document(cls: type) -> type:
    """Append an ``Attributes`` section built from the field docs to ``cls.__doc__``."""
    lines = [(cls.__doc__ or "").rstrip(), "", "Attributes:"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        check = f.metadata["check"]
        shown = check.dump(default) if default is not None else None
        lines.append(f"    {f.name} (default {shown!r}; {check.describe()}):")
        lines.append(f"        {f.metadata['doc']}")
    cls.__doc__ = "\n".join(lines) + "\n"
    return cls


class OptionsBase:
    """Validation, dict round trip, ``replace`` and pickling for option classes."""

    __slots__ = ()

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for f in dataclasses.fields(self):
            value = f.metadata["check"].validate(owner, f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        self._check_cross()

    def _check_cross(self) -> None:
        """Cross-field rules; subclasses override."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def _reject_unknown(cls, keys, where: str) -> None:
        valid = cls.field_names()
        unknown = [k for k in keys if k not in valid]
        if not unknown:
            return
        parts = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            parts.append(f"{key!r}{hint}")
        raise ZephonConfigError(
            f"{cls.__name__}.{where}: unknown key(s) {', '.join(parts)}; "
            f"valid keys: {', '.join(valid)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-ready dict of every field (nested objects included)."""
        return {
            f.name: (None if (v := getattr(self, f.name)) is None else f.metadata["check"].dump(v))
            for f in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Inverse of :meth:`to_dict`; missing keys take defaults, unknown keys are refused."""
        if not isinstance(data, Mapping):
            raise ZephonConfigError(
                f"{cls.__name__}.from_dict: expected a mapping, got {_show(data)}"
            )
        cls._reject_unknown(data.keys(), "from_dict")
        checks = {f.name: f.metadata["check"] for f in dataclasses.fields(cls)}
        kwargs = {k: (None if v is None else checks[k].load(v)) for k, v in data.items()}
        return cls(**kwargs)

    def replace(self, **changes):
        """A copy with ``changes`` applied (validated like a fresh object)."""
        self._reject_unknown(changes.keys(), "replace")
        return dataclasses.replace(self, **changes)

    def __reduce__(self):
        return (type(self).from_dict, (self.to_dict(),))
