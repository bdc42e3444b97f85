"""Looking up a module another thread may be importing right now.

``name in sys.modules`` is true from the moment an import *starts*: a second thread that
takes the module from there while the first is still running its ``__init__`` sees a
half-made module. For torch that is not an AttributeError but a crash: reading
``torch.default_generator``'s state while another thread imports torch segfaulted here.
:func:`imported` gives the module only once its import is over (it waits for the
importing thread, as ``import`` itself does), and never starts an import.
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType

__all__ = ["imported"]


def imported(name: str) -> ModuleType | None:
    """Module ``name`` if it is imported (waiting for an import another thread is running
    to end), else None; never imports it. An import that fails in the other thread
    leaves None here (the module is gone from ``sys.modules``); in the thread that is
    importing it, the partial module is handed back at once, as ``import`` does."""
    module = sys.modules.get(name)
    if module is None:
        return None
    if not getattr(getattr(module, "__spec__", None), "_initializing", False):
        return module
    lock_of = getattr(importlib._bootstrap, "_get_module_lock", None)
    if lock_of is None:  # an interpreter without it: wait as ``import`` does
        try:
            return importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the other thread's import failed here too
            return None
    # the import system's own lock of this module: held by the importing thread for the
    # whole import (re-entrant in that thread), free once the import is over
    lock = lock_of(name)
    lock.acquire()
    lock.release()
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return module if module is not None and _importing_here(name) else None
    return module


def _importing_here(name: str) -> bool:
    """Whether this thread is the one importing ``name`` (a circular import)."""
    lock = getattr(importlib._bootstrap, "_module_locks", {}).get(name)
    ref = lock() if callable(lock) else None
    return getattr(ref, "owner", None) == threading.get_ident()
