"""The error raised when a file or a sample cannot be read (defined in zephon.errors).

It is exported by the io layer (the lowest layer that reads files) so that the cache, the
remote-store access and the format readers raise the same class; the pipeline's
sources re-export it as ``zephon.sources.SourceError``.
"""

from __future__ import annotations

from zephon.errors import SourceError

__all__ = ["SourceError"]

