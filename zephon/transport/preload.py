"""Workers forked from a fork server that did the heavy imports once.

A ``spawn`` worker is a new interpreter: it imports whatever its ops need itself.
With torch and torchvision that is about 3 s and 390 MiB of private memory per
worker here, the same for every worker. Under ``multiprocessing``'s
``forkserver`` start method the workers are forked from one server process
instead (a clean, single-threaded interpreter that the program starts once, not a
fork of the program itself, so none of ``fork``'s hazards with threads apply).
The modules the server imports before it forks (its *preload*) are imported once,
and their pages are shared copy-on-write with every worker.

Shared only while nobody writes them: reference counting and the cyclic garbage
collector write into the objects, so the server ends its preload with
:mod:`zephon.transport._frozen`, which collects and then freezes (``gc.freeze``)
everything imported so far: the collector never visits those objects again, in
the server or in a worker, and their pages stay shared.

:func:`forkserver_context` is the whole API: ``RuntimeOptions(mp_context=
zephon.forkserver_context("torch", "torchvision"))``. Measured on the three-epoch
image benchmark (``bench/vision/epochs.py``, two workers running torchvision's
transforms): the process tree's peak PSS went from 1733 MiB (spawn) to 1391 MiB,
the same epoch times; each further worker saves about as much again.

Limits (``multiprocessing``'s): a program has one fork server, started by its
first ``forkserver`` process, and its preload is fixed then. A context asked for
after that with modules the running server lacks still works (the workers import
them themselves) and says so with a :class:`RuntimeWarning`. Workers get the
server's environment, the one the program had when the server started: a variable
set later reaches spawned workers but not these. The server exits when the program
does; zephon's workers leave it no reason to stay (see
:func:`~zephon.transport.supervisor._leave_fork_server`).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import warnings
from multiprocessing import forkserver

from zephon.errors import ZephonConfigError

__all__ = ["FREEZE_MODULE", "forkserver_context"]

#: The module a zephon fork server imports last: it freezes the server's heap.
FREEZE_MODULE = "zephon.transport._frozen"


def forkserver_context(*modules: str):
    """The ``forkserver`` context whose server imports ``modules`` before it forks a
    worker (then freezes its heap, see the module docstring), for
    ``RuntimeOptions(mp_context=...)`` or ``PoolConfig(mp_context=...)``.

    Args:
        *modules: names of importable modules (``"torch"``, ``"torchvision"``, your own
            ops' module). The program's ``__main__`` comes first, as in
            ``multiprocessing``'s default preload.

    Returns:
        ``multiprocessing.get_context("forkserver")``, its preload set.

    Raises:
        ZephonConfigError: a name that is not a string or not an importable module.

    Warns:
        RuntimeWarning: the program's fork server already runs without some of
            ``modules`` (started by an earlier ``forkserver`` process), and workers
            then import those themselves.

    Examples:
        >>> ctx = forkserver_context("numpy")
        >>> ctx.get_start_method()
        'forkserver'
    """
    for name in modules:
        if not isinstance(name, str) or not name:
            raise ZephonConfigError(f"forkserver_context: module names are strings, got "
                                    f"{name!r}", field="modules")
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:
            raise ZephonConfigError(f"forkserver_context: cannot find module {name!r}: "
                                    f"{exc}", field="modules") from exc
        if found is None:
            raise ZephonConfigError(f"forkserver_context: no module named {name!r}",
                                    field="modules")
    ctx = multiprocessing.get_context("forkserver")
    wanted = ["__main__", *dict.fromkeys(modules), FREEZE_MODULE]
    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None:
        have = list(getattr(server, "_preload_modules", ()))
        missing = [m for m in wanted if m not in have]
        if missing:
            warnings.warn(
                f"zephon.forkserver_context: this program's fork server is already running "
                f"(started by an earlier forkserver process) without {missing}: its preload "
                "is fixed when it starts, so workers will import those themselves. Ask for "
                "the context before the program's first forkserver process.",
                RuntimeWarning, stacklevel=2)
        return ctx
    ctx.set_forkserver_preload(wanted)
    return ctx
