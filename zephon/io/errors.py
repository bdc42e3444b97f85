"""The error raised when a file or a sample cannot be read.

It lives in the io layer (the lowest layer that reads files) so that the cache, the
remote-store access and the format readers raise the same class; the pipeline's
sources re-export it as ``zephon.sources.SourceError``.
"""

from __future__ import annotations

from zephon.errors import ZephonError

__all__ = ["SourceError"]


class SourceError(ZephonError):
    """A file or a sample could not be read. The message names the file (or URL) and
    the position inside it (line, row group, tar member) when there is one."""
