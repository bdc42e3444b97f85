"""Ops that keep a hold on what they return (module level: process workers import them)."""

from __future__ import annotations

import threading

import numpy as np

#: What an op keeps, per thread (two threads sharing one buffer would race each other
#: inside the op, which no runner can undo): buffers, dicts, the last result.
_KEEP = threading.local()


def _kept(name: str, default):
    if not hasattr(_KEEP, name):
        setattr(_KEEP, name, default)
    return getattr(_KEEP, name)


def load(i):
    """Sample ``i``: 16 Ki int32 of value ``i`` (64 KiB)."""
    return {"x": np.full(16 << 10, i, dtype=np.int32), "i": i}


def load_big(i):
    """Sample ``i``: 512 Ki int32 of value ``i`` (2 MiB: the shared heap serves it)."""
    return {"x": np.full(512 << 10, i, dtype=np.int32), "i": i}


def reuse_buffer(s):
    """``2 * x`` written into one buffer the op keeps for every sample it runs."""
    x = s["x"]
    bufs = _kept("bufs", {})
    buf = bufs.get(x.size)
    if buf is None:
        buf = bufs[x.size] = np.empty_like(x)
    np.multiply(x, 2, out=buf)
    return {"x": buf, "i": s["i"]}


def reuse_dict(s):
    """The same dict (and array) returned for every sample."""
    x = s["x"]
    out = _kept("dicts", {}).setdefault(x.size, {"x": np.empty_like(x)})
    np.multiply(x, 2, out=out["x"])
    out["i"] = s["i"]
    return out


def scribble_later(s):
    """``2 * x`` as a fresh array; while the next sample runs, a thread the op started
    overwrites the array this one returned (after its return, before anyone reads it)."""
    out = s["x"] * 2
    kept = _kept("previous", [])
    for previous in kept:
        writer = threading.Thread(target=previous.fill, args=(-1,))
        writer.start()
        writer.join()
    kept[:] = [out]
    return {"x": out, "i": s["i"]}


def fresh(s):
    """``2 * x`` as a fresh array (nothing kept)."""
    return {"x": s["x"] * 2, "i": s["i"]}


def pass_on(s):
    """The input's array passed on under a new dict (a later stage)."""
    return {"x": s["x"], "i": s["i"]}


#: Data addresses of the arrays :func:`fresh_noted` made (ints: nothing holds the arrays).
MADE: set[int] = set()


def fresh_noted(s):
    """``2 * x`` as a fresh array whose address is noted (this process's runners only)."""
    out = s["x"] * 2
    MADE.add(out.ctypes.data)
    return {"x": out, "i": s["i"]}
