"""Reference reference counts: the specification of ``kernels/refcount.pyx``.

Caller: :mod:`zephon.transport.heap`, whose one walk decides which arrays of a result
nothing but the result can reach (see its "Exclusivity" section). Every function
answers the **exact** reference count of an object *as its holder holds it*: the
object is read where it lives (a container's slot, an array's ``base``, an attribute)
and the count is taken while nothing of the call holds it, so the answer is the
holder's reference plus every other one, never an interpreter's temporary. The
caller subtracts the holders it can name (the container, the view, the encoder's
leaf list); what is left is a reference someone else has.

``item_refcounts(container)``
    One count per item of a ``list`` or ``tuple`` (in order) or per value of a
    ``dict`` or dict subclass (insertion order, read from the dict's storage: no key
    is hashed or compared). Any other type is a ``TypeError``.
``item_refcount(seq, i)``
    The count of ``seq[i]`` for a ``list`` or ``tuple`` (``IndexError`` when out of
    range, ``TypeError`` for another type).
``base_refcount(array)``
    The count of ``array.base`` for a NumPy array, 0 when it has no base.
``attr_refcount(obj, name)``
    The count of ``getattr(obj, name)`` (a slot or instance attribute: its holder is
    ``obj``).

Counts are CPython's: with the GIL (the heap is off without it) and for mortal
objects (an immortal one, 3.12+, answers a count far above any real one, which no
caller takes for exclusive). This reference reads ``ob_refcnt`` through ``ctypes``
at the object's address once the expression that found the object has let go of
it; the compiled kernel reads it with ``Py_REFCNT`` on a borrowed pointer.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

__all__ = ["attr_refcount", "base_refcount", "item_refcount", "item_refcounts"]

# ob_refcnt is the first field of every object (Py_ssize_t, or a union over it)
_ob_refcnt = ctypes.c_ssize_t.from_address


def _count(address: int) -> int:
    return _ob_refcnt(address).value


def item_refcounts(container: Any) -> list[int]:
    t = type(container)
    if t is list or t is tuple:
        return [_count(id(container[k])) for k in range(len(container))]
    if isinstance(container, dict):
        # dict.values, not the subclass's: its storage, without a key look-up; each
        # value is found and let go of before its count is read
        addresses = [id(v) for v in dict.values(container)]
        return [_count(a) for a in addresses]
    raise TypeError(f"item_refcounts needs a list, tuple or dict, not {t.__name__}")


def item_refcount(seq: Any, i: int) -> int:
    t = type(seq)
    if not (t is list or t is tuple):
        raise TypeError(f"item_refcount needs a list or tuple, not {t.__name__}")
    return _count(id(seq[i]))


def base_refcount(array: np.ndarray) -> int:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"base_refcount needs a NumPy array, not {type(array).__name__}")
    if array.base is None:
        return 0
    return _count(id(array.base))


def attr_refcount(obj: Any, name: str) -> int:
    return _count(id(getattr(obj, name)))
