"""MosaicML Streaming's own MDS writer and reader, for the tests and benchmarks of
``sources.mds``.

Why this module exists: ``import streaming`` fails in this environment. The package's
``__init__`` imports ``streaming.vision``, which needs ``torchvision``, and torchvision
has no CPU build on PyPI that matches the project's CPU torch (the CUDA build cannot
load). ``mosaicml-streaming`` is also installed with ``--no-deps`` (it pins
``transformers<5``, which conflicts with the project's ``transformers`` extra).

:func:`load` therefore registers an empty ``streaming`` package (the installed
package's directory as its ``__path__``, without running its ``__init__``) and imports
``streaming.base`` from it: ``MDSWriter``, ``StreamingDataset`` and the encodings are
the package's own code, unchanged. Where ``import streaming`` works, it is used as is.

:func:`library_session` is where ``StreamingDataset`` may be used: it leaves shared
memory in ``/dev/shm`` (``<6 digits>_locals``, ``..._barrier``, ...) and file locks in
``tempfile.gettempdir()`` (``<6 digits>_cache_filelock``; a prefix with a lock is never
reused, so the library's own ``clean_stale_shared_memory``, which stops at the first
free prefix, misses what follows). The session points ``tempfile.tempdir`` at a private
directory (removed after) and then removes the shared memory that appeared during it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import types
from typing import Any, Iterator

__all__ = ["SHM", "available", "library_session", "load", "shm_entries"]

SHM = re.compile(r"^\d{6}_[a-z_]+$")  # the names StreamingDataset gives its shared memory


def load() -> Any:
    """The ``streaming.base`` module (MDSWriter, StreamingDataset, ...), imported as the
    module docstring says.

    Raises:
        ImportError: mosaicml-streaming is not installed (check :func:`available` first:
            ``pytest.importorskip("streaming")`` would import the package's ``__init__``).
    """
    if "streaming.base" in sys.modules:
        return sys.modules["streaming.base"]
    spec = importlib.util.find_spec("streaming")
    if spec is None or spec.origin is None:
        raise ImportError("mosaicml-streaming is not installed")
    try:
        importlib.import_module("streaming")
    except Exception:  # noqa: BLE001  torchvision missing or unloadable: see the docstring
        for name in [m for m in sys.modules if m == "streaming" or m.startswith("streaming.")]:
            del sys.modules[name]
        pkg = types.ModuleType("streaming")
        pkg.__path__ = [os.path.dirname(spec.origin)]
        pkg.__spec__ = spec
        pkg.__file__ = spec.origin
        sys.modules["streaming"] = pkg
    return importlib.import_module("streaming.base")


def available() -> bool:
    """Whether mosaicml-streaming is installed (without importing it)."""
    return importlib.util.find_spec("streaming") is not None


def shm_entries() -> set[str]:
    """The names in /dev/shm that StreamingDataset gives its shared memory, now."""
    try:
        return {n for n in os.listdir("/dev/shm") if SHM.match(n)}
    except OSError:
        return set()


@contextlib.contextmanager
def library_session() -> Iterator[None]:
    """A block that may build StreamingDatasets (in this process or its DataLoader
    workers): their file locks go to a private temporary directory, and the shared
    memory that appeared during the block is removed after it (the library's
    ``clean_stale_shared_memory`` first, then any name it missed)."""
    load()
    from streaming.base.util import clean_stale_shared_memory

    before = shm_entries()
    private = tempfile.mkdtemp(prefix="mds-locks-")
    saved, tempfile.tempdir = tempfile.tempdir, private
    try:
        yield
    finally:
        gc.collect()  # a dataset still referenced from a cycle holds its shared memory
        try:
            clean_stale_shared_memory()
        finally:
            tempfile.tempdir = saved
            for name in shm_entries() - before:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join("/dev/shm", name))
            shutil.rmtree(private, ignore_errors=True)
