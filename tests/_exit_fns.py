"""Ops for the exit tests (module level: process workers import them).

``stall`` passes every sample through except sample 2: there it records the pids of the
process running it (and, in a process other than the test script's, of a ``sleep``
child it starts, in that process's group) in ``$ZEPHON_TEST_DIR/stall.json`` (a file
barrier the script waits on), sleeps ``$ZEPHON_STALL_S`` seconds (30 by default) and then
writes ``stall.done``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

STALL_ID = 2


def _dir() -> str:
    return os.environ["ZEPHON_TEST_DIR"]


def stall(s):
    if s["id"] != STALL_ID:
        return s
    pids = [os.getpid()]
    children = []
    if os.getpid() != int(os.environ.get("ZEPHON_MAIN_PID", "0")):
        children.append(subprocess.Popen(["sleep", "30"]))
        pids.append(children[-1].pid)
    tmp = os.path.join(_dir(), f"stall.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(pids, fh)
    os.replace(tmp, os.path.join(_dir(), "stall.json"))
    time.sleep(float(os.environ.get("ZEPHON_STALL_S", "30")))
    for child in children:
        child.kill()
        child.wait()
    open(os.path.join(_dir(), "stall.done"), "w").close()
    return s


def wait_for_stall(timeout: float = 120.0) -> list[int]:
    """Block until ``stall`` is in its sleep; the pids it recorded."""
    path = os.path.join(_dir(), "stall.json")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("the stalling op never started")
        time.sleep(0.01)
    with open(path) as fh:
        return json.load(fh)


def stall_finished() -> bool:
    return os.path.exists(os.path.join(_dir(), "stall.done"))


def _square(x: int) -> int:
    return x * x


def with_mp_pool(s):
    """An op that runs a ``multiprocessing.Pool(2)`` of its own (the pool's pids go to
    ``$ZEPHON_TEST_DIR/mp-<id>.json``)."""
    import multiprocessing

    with multiprocessing.Pool(2) as workers:
        pids = [p.pid for p in workers._pool]
        squares = workers.map(_square, range(s["id"] + 1))
    with open(os.path.join(_dir(), f"mp-{s['id']}.json"), "w") as fh:
        json.dump(pids, fh)
    return {"id": s["id"], "squares": squares}


def lock_at_57(s):
    """A map whose result for sample 57 holds a lock (it cannot be pickled)."""
    import threading

    out = {"id": s["id"], "x": s["x"] * 2}
    if s["id"] == 57:
        out["meta"] = {"lock": threading.Lock()}
    return out


def lock_always(s):
    import threading

    return {"id": s["id"], "lock": threading.Lock()}


def generator_out(s):
    return (v for v in s["x"])


_BUF = None


def into_buffer(s):
    """Writes every output into one buffer it keeps (``out=``)."""
    global _BUF
    import numpy as np

    if _BUF is None:
        _BUF = np.empty_like(s["x"])
    np.multiply(s["x"], 2, out=_BUF)
    return {"id": s["id"], "x": _BUF}
