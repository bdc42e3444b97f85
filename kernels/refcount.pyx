# cython: language_level=3
"""Exact reference counts of objects as their holders hold them.

Specification: :mod:`zephon.kernels.refcount_ref` (this module must match it).
Caller: :mod:`zephon.transport.heap`'s exclusivity walk. Every count is
``Py_REFCNT`` of a borrowed pointer read where the object lives (a list's or
tuple's slot, a dict's value storage through ``PyDict_Next``, an array's
``PyArray_BASE``), so nothing of the call is in it; ``attr_refcount`` gets a new
reference from ``getattr`` and leaves its own out.
"""

from cpython.object cimport PyObject

cimport numpy as cnp

cnp.import_array()

cdef extern from "Python.h":
    Py_ssize_t Py_REFCNT(PyObject *o)
    Py_ssize_t PyList_GET_SIZE(object o)
    PyObject *PyList_GET_ITEM(object o, Py_ssize_t i)
    Py_ssize_t PyTuple_GET_SIZE(object o)
    PyObject *PyTuple_GET_ITEM(object o, Py_ssize_t i)
    int PyDict_Next(object p, Py_ssize_t *pos, PyObject **key, PyObject **value)
    PyObject *PyObject_GetAttr(object o, object name) except NULL
    void Py_DECREF(PyObject *o)


def item_refcounts(container):
    """One count per item of a list or tuple, or per value of a dict (no key look-up)."""
    cdef Py_ssize_t n, i, pos = 0
    cdef PyObject *key
    cdef PyObject *value
    cdef list out
    if type(container) is list:
        n = PyList_GET_SIZE(container)
        out = [0] * n
        for i in range(n):
            out[i] = Py_REFCNT(PyList_GET_ITEM(container, i))
        return out
    if type(container) is tuple:
        n = PyTuple_GET_SIZE(container)
        out = [0] * n
        for i in range(n):
            out[i] = Py_REFCNT(PyTuple_GET_ITEM(container, i))
        return out
    if isinstance(container, dict):
        n = len(<dict>container)
        out = [0] * n  # made before counting (an int stored below is not tracked by gc)
        i = 0
        while i < n and PyDict_Next(container, &pos, &key, &value):
            out[i] = Py_REFCNT(value)
            i += 1
        return out
    raise TypeError(
        f"item_refcounts needs a list, tuple or dict, not {type(container).__name__}")


def item_refcount(seq, Py_ssize_t i):
    """The count of ``seq[i]`` for a list or tuple."""
    cdef Py_ssize_t n
    if type(seq) is list:
        n = PyList_GET_SIZE(seq)
        if i < 0 or i >= n:
            raise IndexError(f"item {i} of a list of {n}")
        return Py_REFCNT(PyList_GET_ITEM(seq, i))
    if type(seq) is tuple:
        n = PyTuple_GET_SIZE(seq)
        if i < 0 or i >= n:
            raise IndexError(f"item {i} of a tuple of {n}")
        return Py_REFCNT(PyTuple_GET_ITEM(seq, i))
    raise TypeError(f"item_refcount needs a list or tuple, not {type(seq).__name__}")


def base_refcount(cnp.ndarray array not None):
    """The count of ``array.base``, 0 when it has none."""
    cdef PyObject *base = cnp.PyArray_BASE(array)
    if base == NULL:
        return 0
    return Py_REFCNT(base)


def attr_refcount(obj, name):
    """The count of ``getattr(obj, name)`` without the reference getattr returns."""
    cdef PyObject *value = PyObject_GetAttr(obj, name)
    cdef Py_ssize_t n = Py_REFCNT(value) - 1
    Py_DECREF(value)
    return n
