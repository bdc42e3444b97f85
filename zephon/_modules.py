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
from types import ModuleType

__all__ = ["imported"]


def imported(name: str) -> ModuleType | None:
    """Module ``name`` if it is imported (waiting for an import another thread is running
    to end), else None; never imports it."""
    module = sys.modules.get(name)
    if module is None:
        return None
    if getattr(getattr(module, "__spec__", None), "_initializing", False):
        # importlib waits on the module's import lock here (or, in the thread that is
        # importing it, hands the partial module back at once, as ``import`` does)
        module = importlib.import_module(name)
    return module
