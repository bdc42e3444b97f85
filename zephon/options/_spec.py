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
:func:`option_class` finishes a class: its constructor refuses positional
arguments and unknown keywords as :class:`~zephon.errors.ZephonConfigError`
(with a did-you-mean), so every failure of a constructor, ``from_dict`` or
``replace`` is that one exception, whatever the input (huge ints, NaN, nested
garbage, values whose ``repr`` fails). Every numeric field states its upper
bound (:mod:`zephon.options.limits` says why each bound exists).

Standard library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import math
import multiprocessing
import multiprocessing.context
import numbers
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, TypeVar

from zephon.errors import ZephonConfigError

__all__ = [
    "Check",
    "FrozenMap",
    "OptionsBase",
    "check_int",
    "check_positive",
    "fail",
    "field_default",
    "option",
    "option_class",
]

_O = TypeVar("_O", bound="OptionsBase")


def _show(value: Any) -> str:
    """A short, never-failing description of ``value`` for error messages."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        try:
            bits = int(value).bit_length()
        except Exception:  # noqa: BLE001 - a broken Integral still gets a message
            bits = 0
        if bits > 64:
            return f"an int of {bits} bits ({type(value).__name__})"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that raises must not hide the real error
        text = f"<{type(value).__name__} object with a failing repr>"
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def fail(owner: str, name: str, value: Any, allowed: str) -> ZephonConfigError:
    """Build the standard error: field, value seen, what is allowed."""
    return ZephonConfigError(
        f"{owner}.{name}: got {_show(value)}; expected {allowed}", field=f"{owner}.{name}"
    )


def check_int(op: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (numpy integers too, never a bool), else a
    ZephonConfigError naming the op and ``name``: the one argument check of the ops'
    and sources' constructors, which are not option classes."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ZephonConfigError(f"{op}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_positive(op: str, what: str, value: Any) -> float:
    """``value`` as a positive finite float (not a bool), else a ZephonConfigError naming
    the op and ``what`` (mixture and ``ensure_mixture`` weights)."""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        v = float("nan")
    if isinstance(value, bool) or not math.isfinite(v) or v <= 0:
        raise ZephonConfigError(f"{op}: {what} must be a positive finite number, "
                                f"got {value!r:.40}")
    return v


class FrozenMap(Mapping):
    """A read-only, hashable, picklable mapping (the value of mapping options).

    Args:
        data: the items (None: empty); copied.

    Examples:
        >>> m = FrozenMap({0: "process"})
        >>> m[0], m == {0: "process"}, len({m: 1})
        ('process', True, 1)
    """

    __slots__ = ("_data",)
    _data: dict[Any, Any]

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


def _number(x: float) -> str:
    """``2592000`` rather than ``2.592e+06`` for whole bounds."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


class Float(Check):
    def __init__(self, *, min: float | None = None, exclusive_min: bool = False,
                 max: float | None = None, optional=False):
        super().__init__(optional=optional)
        self.min, self.exclusive_min, self.max = min, exclusive_min, max
        bounds = []
        if min is not None:
            bounds.append(f"{'>' if exclusive_min else '>='} {_number(min)}")
        if max is not None:
            bounds.append(f"<= {_number(max)}")
        self.allowed = "a finite number" + (" " + " and ".join(bounds) if bounds else "")

    def _validate(self, owner, name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise fail(owner, name, value, self.describe())
        try:
            value = float(value)
        except (OverflowError, ValueError, TypeError):  # 10**400, a broken Real
            raise fail(owner, name, value, self.describe()) from None
        if not math.isfinite(value):
            raise fail(owner, name, value, self.describe())
        if self.min is not None and (
            value < self.min or (self.exclusive_min and value == self.min)
        ):
            raise fail(owner, name, value, self.describe())
        if self.max is not None and value > self.max:
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
                 allowed: str | None = None, optional=False):
        super().__init__(optional=optional)
        self.choices = choices
        self.pattern = re.compile(pattern) if pattern else None
        if allowed:
            self.allowed = allowed
        elif choices:
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
    allowed = "a non-empty path (str or os.PathLike) without NUL characters"

    def _validate(self, owner, name, value):
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value or "\x00" in value:
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

    def __init__(self, cls: type[OptionsBase], *, optional=False):
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
    """A mapping from stage index (``0 <= int <= max_key``) to a value checked by
    ``value_check``."""

    def __init__(self, value_check: Check, *, max_key: int):
        super().__init__(optional=False)
        self.value_check, self.max_key = value_check, max_key
        self.key_allowed = f"a stage index (an int >= 0 and <= {max_key})"
        self.allowed = (f"a mapping of stage index (int in [0, {max_key}]) to "
                        f"{value_check.describe()}")

    def _validate(self, owner, name, value):
        if not isinstance(value, Mapping):
            raise fail(owner, name, value, self.describe())
        out = {}
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, numbers.Integral) \
                    or not 0 <= int(key) <= self.max_key:
                raise fail(owner, f"{name}[{_show(key).rsplit(' (', 1)[0]}]", key,
                           self.key_allowed)
            out[int(key)] = self.value_check.validate(owner, f"{name}[{int(key)}]", item)
        return FrozenMap(out)

    def dump(self, value):
        return {k: self.value_check.dump(v) for k, v in value.items()}

    def load(self, value):
        if not isinstance(value, Mapping):
            return value
        out = {}
        for key, item in value.items():
            if isinstance(key, str) and re.fullmatch(r"[0-9]{1,18}", key):
                key = int(key)  # longer digit strings stay strings and are refused
            out[key] = self.value_check.load(item)
        return out


class StrMap(Check):
    """A mapping of str to str; with patterns, keys and values must match them."""

    def __init__(self, *, key_pattern: str | None = None, value_pattern: str | None = None,
                 max_items: int | None = None):
        super().__init__(optional=False)
        self.key_pattern = re.compile(key_pattern) if key_pattern else None
        self.value_pattern = re.compile(value_pattern) if value_pattern else None
        self.max_items = max_items
        self.allowed = "a mapping of str to str"
        if key_pattern or value_pattern:
            self.allowed += (f" (keys matching {key_pattern or '.*'}, values matching "
                             f"{value_pattern or '.*'})")
        if max_items is not None:
            self.allowed += f" of at most {max_items} items"

    def _validate(self, owner, name, value):
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise fail(owner, name, value, self.describe())
        if self.max_items is not None and len(value) > self.max_items:
            raise fail(owner, name, value, self.describe())
        for k, v in value.items():
            if (self.key_pattern and not self.key_pattern.fullmatch(k)) or (
                    self.value_pattern and not self.value_pattern.fullmatch(v)):
                raise fail(owner, f"{name}[{k!r}]", value, self.describe())
        return FrozenMap(value)

    def dump(self, value):
        return dict(value)


class StrTuple(Check):
    allowed = "a list or tuple of non-empty strings (not a single string)"

    def __init__(self, choices: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.choices = choices
        if choices is not None:
            self.allowed = f"a list or tuple of {', '.join(map(repr, choices))} (not a string)"

    def _validate(self, owner, name, value):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise fail(owner, name, value, self.describe())
        if not all(isinstance(v, str) and v for v in value):
            raise fail(owner, name, value, self.describe())
        if self.choices is not None and not set(value) <= set(self.choices):
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


def field_default(f: dataclasses.Field) -> Any:
    """The default value of an option field (its ``default``, else a fresh value from its
    ``default_factory``)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    factory = f.default_factory
    if not callable(factory):
        raise TypeError(f"option field {f.name!r} has no default")
    return factory()


def document(cls: type[_O]) -> type[_O]:
    """Append an ``Attributes`` section built from the field docs to ``cls.__doc__``."""
    # cleandoc: a multi-line class docstring keeps its indentation otherwise, and the
    # appended section (indented from column 0) would leave it indented in help().
    lines = [inspect.cleandoc(cls.__doc__ or ""), "", "Attributes:"]
    for f in dataclasses.fields(cls):
        default = field_default(f)
        check = f.metadata["check"]
        shown = check.dump(default) if default is not None else None
        lines.append(f"    {f.name} (default {shown!r}; {check.describe()}):")
        lines.append(f"        {f.metadata['doc']}")
    cls.__doc__ = "\n".join(lines) + "\n"
    return cls


def option_class(cls: type[_O]) -> type[_O]:
    """Finish an option class (apply after ``@dataclass``): document its fields and make
    every constructor failure a :class:`~zephon.errors.ZephonConfigError`.

    The dataclass ``__init__`` raises ``TypeError`` for a positional argument or an
    unknown keyword; the wrapper installed here refuses both first, with the class
    name, a did-you-mean suggestion and how to list the valid names.
    """
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs):
        if args:
            first = cls.field_names()[0]
            raise ZephonConfigError(
                f"{cls.__name__}() takes keyword arguments only, got {len(args)} positional "
                f"argument(s) ({', '.join(_show(a) for a in args[:3])}); write e.g. "
                f"{cls.__name__}({first}=...)")
        cls._reject_unknown(kwargs.keys(), "__init__")
        generated(self, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]  # the wrapper is the point
    return document(cls)


_CHECKED_DEFAULTS: dict[tuple[type, str], Any] = {}


def _checked_default(cls: type, f: dataclasses.Field) -> Any:
    """Field ``f``'s default as its check returns it, checked on first use only (defaults
    are immutable values, checks pure functions of the value: an options object with
    fifty fields left at their defaults was checking all fifty on every construction)."""
    key = (cls, f.name)
    try:
        return _CHECKED_DEFAULTS[key]
    except KeyError:
        value = _CHECKED_DEFAULTS[key] = f.metadata["check"].validate(cls.__name__, f.name,
                                                                      f.default)
        return value


class OptionsBase:
    """Validation, dict round trip, ``replace`` and pickling for option classes."""

    __slots__ = ()
    if TYPE_CHECKING:  # set by @dataclass on every subclass
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        cls = type(self)
        owner = cls.__name__
        for f in dataclasses.fields(self):
            raw = getattr(self, f.name)
            if raw is f.default:  # a field left at its (immutable) default: checked once
                value = _checked_default(cls, f)
                object.__setattr__(self, f.name, value)
                continue
            try:
                value = f.metadata["check"].validate(owner, f.name, raw)
            except ZephonConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. a Mapping whose items() raises
                raise fail(owner, f.name, raw, f"{f.metadata['check'].describe()} "
                           f"(checking it raised {type(exc).__name__})") from None
            object.__setattr__(self, f.name, value)
        self._check_cross()

    def _check_cross(self) -> None:
        """Cross-field rules; subclasses override."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of every option of this class, in declaration order.

        Returns:
            A tuple of field names.

        Examples:
            >>> RuntimeOptions.field_names()[:2]
            ('runner', 'run_id')
        """
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def _reject_unknown(cls, keys, where: str) -> None:
        """Refuse unknown option names in one short message: each unknown name with its
        closest valid name(s), and how to list them all (not the list itself)."""
        valid = cls.field_names()
        unknown = [k for k in keys if not isinstance(k, str) or k not in valid]
        if not unknown:
            return
        parts = []
        for key in unknown[:5]:
            close = difflib.get_close_matches(key, valid, n=2) if isinstance(key, str) else []
            shown = _show(key).rsplit(" (", 1)[0] if isinstance(key, str) else _show(key)
            if len(close) == 1:
                shown += f" (did you mean {close[0]!r}?)"
            elif close:
                shown += f" (did you mean {close[0]!r} or {close[1]!r}?)"
            parts.append(shown)
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        label = f"{cls.__name__}()" if where == "__init__" else f"{cls.__name__}.{where}"
        raise ZephonConfigError(
            f"{label}: unknown option(s) {', '.join(parts)}{more}; "
            f"{cls.__name__}.field_names() lists the {len(valid)} valid names"
        )

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON/YAML-ready dict of every field (nested option objects included).

        Returns:
            A dict: field name -> a str, number, bool, None, list or dict.

        Examples:
            >>> StoreOptions(cache_enabled=True).to_dict()["cache_enabled"]
            True
        """
        return {
            f.name: (None if (v := getattr(self, f.name)) is None else f.metadata["check"].dump(v))
            for f in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Build an option object from a :meth:`to_dict`-style mapping.

        Missing keys take their defaults; every value is validated as in the constructor.

        Args:
            data: field name -> value (nested option objects as dicts).

        Returns:
            A new instance of this class.

        Raises:
            ZephonConfigError: not a mapping, an unknown key (with a did-you-mean), or an
                invalid value (naming the field, the value and what is allowed).

        Examples:
            >>> opts = RuntimeOptions.from_dict({"runner": "threads", "max_workers": 2})
            >>> RuntimeOptions.from_dict(opts.to_dict()) == opts
            True
        """
        if not isinstance(data, Mapping):
            raise ZephonConfigError(
                f"{cls.__name__}.from_dict: expected a mapping, got {_show(data)}"
            )
        cls._reject_unknown(data.keys(), "from_dict")
        checks = {f.name: f.metadata["check"] for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in data.items():
            try:
                kwargs[key] = None if value is None else checks[key].load(value)
            except ZephonConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - garbage nested in a mapping field
                raise fail(cls.__name__, key, value, f"{checks[key].describe()} (reading it "
                           f"raised {type(exc).__name__})") from None
        return cls(**kwargs)

    def replace(self, **changes):
        """A copy with ``changes`` applied, validated like a fresh object.

        Args:
            **changes: field name -> new value.

        Returns:
            A new instance (option objects are immutable).

        Raises:
            ZephonConfigError: an unknown field name or an invalid value.

        Examples:
            >>> RuntimeOptions(runner="threads").replace(max_workers=2).max_workers
            2
        """
        self._reject_unknown(changes.keys(), "replace")
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(changes)
        return type(self)(**values)

    def __reduce__(self):
        return (type(self).from_dict, (self.to_dict(),))
