"""A pipeline's fingerprint, and what names a user callable or a plain value in it.

:func:`pipeline_fingerprint` hashes a spec (:mod:`zephon.pipeline.spec`: the
source's description, the seed, the epoch order, the chunking, the epochs and
every op's ``describe()``) with its flush cadence; the plan computes it once and
``Pipeline.fingerprint()`` returns it. Ops name their functions with
:func:`fn_identity` and their plain arguments with :func:`stable_repr`.

Invariant: what these functions return is the same in every process and every
run of the same code (no memory address, no hash randomisation), so a checkpoint
taken in one process restores in another, and it changes when the code or the
arguments that define the stream change. The main script's module is one name,
:data:`MAIN_SCRIPT`, whether it runs as ``__main__``, as a spawn child's
``__mp_main__`` or under ``python -m``.

Changing what these functions return changes every fingerprint, and with it
which checkpoints restore: the values are pinned by tests.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import types
import zlib
from typing import Any, Protocol, Sequence

import numpy as np

__all__ = ["MAIN_SCRIPT", "fingerprint_parts", "fn_identity", "fn_name", "pipeline_fingerprint",
           "stable_repr"]


class _Described(Protocol):
    def describe(self) -> str: ...


class _Spec(Protocol):
    """What :func:`pipeline_fingerprint` reads of a :class:`~zephon.pipeline.spec.PipelineSpec`."""

    @property
    def source(self) -> _Described: ...
    @property
    def ops(self) -> Sequence[_Described]: ...
    @property
    def seed(self) -> int: ...
    @property
    def permute(self) -> object: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def num_epochs(self) -> int | None: ...


def pipeline_fingerprint(spec: _Spec, flush_every: int) -> str:
    """The fingerprint of ``spec`` flushed every ``flush_every`` lane chunks: a SHA-256
    hex digest of one line per part (the source's description, the seed, the epoch
    order, the chunk size, the epochs, each op's ``describe()``, the flush cadence). A
    checkpoint restores only into a pipeline with the same one."""
    return hashlib.sha256("\n".join(fingerprint_parts(spec, flush_every)).encode()).hexdigest()


def fingerprint_parts(spec: _Spec, flush_every: int) -> list[str]:
    """The lines :func:`pipeline_fingerprint` hashes, in order: the source's description,
    the seed, the epoch order, the chunk size, the epochs, each op's ``describe()``, the
    flush cadence (a checkpoint records them to say what differs)."""
    parts = [spec.source.describe(), f"seed={spec.seed}", f"shuffle={spec.permute}",
             f"chunk={spec.chunk_size}", f"epochs={spec.num_epochs}"]
    parts += [op.describe() for op in spec.ops]
    parts.append(f"flush={flush_every}")
    return parts


def fn_name(fn: Any) -> str:
    """A short name of a callable for messages and ``explain()`` (its qualified name, or
    its type's); not part of the fingerprint (see :func:`fn_identity`)."""
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def stable_repr(value: Any, depth: int = 0) -> str:
    """A description of a plain value that is the same in every process and run: numbers,
    strings, bytes, None, and lists/tuples/dicts/sets of them; anything else is named by
    its type (never by a memory address)."""
    if depth > 4:
        return "..."
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return repr(value)
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value[:64])) + (f"+{len(value) - 64}" if len(value) > 64 else "")
    if isinstance(value, (list, tuple)):
        inner = ", ".join(stable_repr(v, depth + 1) for v in value[:32])
        return f"{type(value).__name__}[{inner}{', ...' if len(value) > 32 else ''}]"
    if isinstance(value, (set, frozenset)):
        return "set[" + ", ".join(sorted(stable_repr(v, depth + 1) for v in value)) + "]"
    if isinstance(value, dict):
        items = sorted((stable_repr(k, depth + 1), stable_repr(v, depth + 1))
                       for k, v in list(value.items())[:64])
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, np.ndarray):
        return f"ndarray({value.dtype.str}, {value.shape}, {zlib.crc32(value.tobytes()):08x})"
    if callable(value):
        return fn_identity(value, depth + 1)
    return type(value).__qualname__


#: How the main script's module is named in a fingerprint: ``__main__`` in the script (run
#: as a file or with ``python -m pkg.mod``), ``__mp_main__`` in its spawn children.
MAIN_SCRIPT = "<main>"


def _module_identity(module: str) -> str:
    """``module`` as a fingerprint names it: the main script's module (``__main__``, its
    spawn children's ``__mp_main__``, or the name ``python -m`` ran it under, should it
    also be imported by that name) is :data:`MAIN_SCRIPT`, whatever the process."""
    if module in ("__main__", "__mp_main__"):
        return MAIN_SCRIPT
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and module == getattr(spec, "name", None):
        return MAIN_SCRIPT
    return module


def _code_hash(code: types.CodeType) -> str:
    blob = code.co_code + stable_repr(code.co_consts).encode() + \
        stable_repr(code.co_names).encode()
    return f"#{zlib.crc32(blob):08x}"


def fn_identity(fn: Any, depth: int = 0) -> str:
    """What defines a user callable, for the pipeline fingerprint: its module and qualified
    name; for a ``functools.partial`` also its function and arguments; for a lambda, a
    nested function or a function of the main script also a hash of its code and
    constants (two lambdas differ, and so do two scripts' ``load``); for a callable object
    also its attributes. The main script's module is one name, :data:`MAIN_SCRIPT`, in
    the script, in its spawn children and under ``python -m``. Stable across processes
    and runs."""
    if isinstance(fn, functools.partial):
        args = ", ".join(stable_repr(a, depth + 1) for a in fn.args)
        kwargs = ", ".join(f"{k}={stable_repr(v, depth + 1)}"
                           for k, v in sorted(fn.keywords.items()))
        return f"partial({fn_identity(fn.func, depth + 1)}; {args}; {kwargs})"
    module = _module_identity(getattr(fn, "__module__", None) or "?")
    if isinstance(fn, (types.FunctionType, types.MethodType)):
        code = getattr(fn, "__code__", None)
        name = f"{module}.{fn.__qualname__}"
        if code is not None and ("<lambda>" in fn.__qualname__ or "<locals>" in fn.__qualname__):
            closure = [c.cell_contents for c in (fn.__closure__ or ()) if _cell_ok(c)]
            name += _code_hash(code) + (f"({stable_repr(closure, depth + 1)})"
                                        if closure else "")
        elif code is not None and module == MAIN_SCRIPT:
            name += _code_hash(code)
        if isinstance(fn, types.MethodType):
            name += f" of {stable_repr(fn.__self__, depth + 1)}"
        return name
    if isinstance(fn, types.BuiltinFunctionType):
        return f"{module}.{fn.__qualname__}"
    cls = type(fn)
    state = getattr(fn, "__dict__", None)
    shown = f"({stable_repr(state, depth + 1)})" if state else ""
    return f"{_module_identity(cls.__module__)}.{cls.__qualname__}{shown}"


def _cell_ok(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True
