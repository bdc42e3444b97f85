"""The missing ``if __name__ == "__main__":`` guard, diagnosed in one sentence.

zephon starts its workers with the ``spawn`` start method: each worker is a
fresh interpreter that imports the parent's main module (as ``__mp_main__``)
before it runs anything of zephon's. A script that builds and iterates a
pipeline (or calls ``zephon.jobs.run``) at module level, without the guard,
therefore runs that code again inside every worker, which then tries to start
workers of its own while it is still booting. CPython refuses that with a
``RuntimeError`` about the "bootstrapping phase"; a job run may first trip
over its own locked checkpoint store. Either way the parent only sees a worker
that died while starting, and the real cause is lost.

Every zephon entry point that starts processes calls :func:`refuse_in_spawn_bootstrap`
first. In a worker that is still importing the parent's main module it exits at
once with :data:`EXIT_UNGUARDED_MAIN`; the parent that sees a worker die with
that code during start-up raises :func:`unguarded_main_error`, one sentence
naming the fix, instead of a bare "died while starting".

Standard library only: this module sits at the bottom of the transport layer
and is used by the pipeline and the jobs faces alike.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from zephon.errors import TransportError

__all__ = [
    "EXIT_UNGUARDED_MAIN",
    "UNGUARDED_MAIN_ADVICE",
    "in_spawn_bootstrap",
    "refuse_in_spawn_bootstrap",
    "unguarded_main_error",
]

#: Exit status of a worker that stopped because the main module has no guard.
EXIT_UNGUARDED_MAIN = 87

UNGUARDED_MAIN_ADVICE = (
    "zephon workers are started with 'spawn', which re-imports your main script in every "
    "worker; this script starts zephon work at import time: put that code under "
    "`if __name__ == \"__main__\":` (and keep the functions it uses at module level)")


def in_spawn_bootstrap() -> bool:
    """True while this process is a spawn/forkserver child importing the parent's main
    module (``multiprocessing`` marks the current process as inheriting until then)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def refuse_in_spawn_bootstrap(what: str) -> None:
    """Call before ``what`` starts processes: a worker still importing the parent's main
    module exits at once, quietly, with :data:`EXIT_UNGUARDED_MAIN` (the parent, which
    started it, says what happened and how to fix it: once, not once per worker)."""
    if in_spawn_bootstrap():
        os._exit(EXIT_UNGUARDED_MAIN)


def unguarded_main_error(where: str) -> TransportError:
    """The parent's error for a worker that exited with :data:`EXIT_UNGUARDED_MAIN`."""
    main = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return TransportError(f"{where}: a worker re-ran {main} while starting. "
                          f"{UNGUARDED_MAIN_ADVICE}.")
