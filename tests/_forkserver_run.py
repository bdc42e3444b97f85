"""Run as a script (``python _forkserver_run.py spawn|forkserver``): a seeded process
pipeline whose workers report what they see, under spawn or under
``zephon.forkserver_context("xml.dom.minidom")``; prints one JSON line."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import sys
import warnings

PRELOADED = "xml.dom.minidom"  # a module nothing in a zephon worker imports otherwise


def look(x, ctx):
    return {"x": x, "draw": float(ctx.rng.random()), "preloaded": PRELOADED in sys.modules,
            "frozen": gc.get_freeze_count(), "ppid": os.getppid()}


def main(mode: str) -> None:
    import zephon
    from zephon import Pipeline, RuntimeOptions, sources

    if mode == "forkserver":
        ctx = zephon.forkserver_context(PRELOADED)
    else:
        ctx = multiprocessing.get_context("spawn")
    pipe = (Pipeline(sources.from_sequence(list(range(12))), seed=3)
            .map(look, parallelism=2)
            .options(RuntimeOptions(runner="process", max_workers=2, mp_context=ctx)))
    try:
        rows = list(pipe)
    finally:
        pipe.close()
    out = {"rows": rows, "main": os.getpid(), "server": None, "warned": None}
    if mode == "forkserver":
        from multiprocessing import forkserver

        out["server"] = forkserver._forkserver._forkserver_pid
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zephon.forkserver_context("email.mime.text")  # the server runs without it
        out["warned"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
