"""StoreOptions: how sources open, retry and cache files (local or remote).

Owned here: the knobs only. The readers that honour them live in the source
and integration layers; remote stores (fsspec URLs) use the cache, local paths
never do.
"""

from __future__ import annotations

from dataclasses import dataclass

from zephon.errors import ZephonConfigError
from zephon.options._spec import (
    Bool,
    Float,
    Int,
    OptionsBase,
    PathStr,
    Str,
    option,
    option_class,
)
from zephon.options.limits import MAX_CACHE_BYTES, MAX_RETRIES, MAX_SECONDS

__all__ = ["StoreOptions"]


@option_class
@dataclass(frozen=True, slots=True, kw_only=True)
class StoreOptions(OptionsBase):
    """I/O behaviour of sources: local caching of remote files and retries.

    Pass it as ``RuntimeOptions(io_options=...)`` (the reads while iterating) or as a
    source constructor's ``io_options=`` (the reads made while building the source).
    Keyword arguments only, validated at construction.

    Examples:
        >>> io = StoreOptions(cache_enabled=True, cache_root="cache", cache_limit_bytes=1 << 30)
        >>> RuntimeOptions(io_options=io).io_options.cache_limit_bytes
        1073741824
    """

    cache_enabled: bool = option(
        False, check=Bool(),
        doc="Cache remote files on local disk before reading them; local paths are never cached.",
    )
    cache_root: str | None = option(
        None, check=PathStr(optional=True),
        doc="Directory of the local cache; None means ~/.cache/zephon (or $ZEPHON_CACHE_DIR).",
    )
    cache_limit_bytes: int | None = option(
        None, check=Int(min=1, max=MAX_CACHE_BYTES, optional=True),
        doc="Evict least recently used cached files above this many bytes; None = unbounded.",
    )
    download_retry: int = option(
        12, check=Int(min=0, max=MAX_RETRIES),
        doc="Retries of a failed remote download before the error reaches the pipeline.",
    )
    download_timeout_s: float = option(
        180.0, check=Float(min=0.0, exclusive_min=True, max=MAX_SECONDS),
        doc="Seconds one remote download attempt may take (at most 30 days).",
    )
    open_retry_attempts: int = option(
        5, check=Int(min=1, max=MAX_RETRIES),
        doc="Attempts to open a file (transient errors such as a stale NFS handle).",
    )
    retry_backoff_initial_s: float = option(
        0.1, check=Float(min=0.0, max=MAX_SECONDS),
        doc="First back-off between retries; doubles each retry up to retry_backoff_max_s.",
    )
    retry_backoff_max_s: float = option(
        2.0, check=Float(min=0.0, max=MAX_SECONDS),
        doc="Longest back-off between retries.",
    )
    unchecked_objects: str = option(
        "read_twice", check=Str(choices=("read_twice", "refuse")),
        doc="Remote objects with no checksum zephon can check (SSE-KMS/SSE-C with no "
            "additional checksum, non-S3 stores): 'read_twice' reads them whole twice and "
            "uses them only when the reads agree; 'refuse' refuses them.",
    )

    def _check_cross(self) -> None:
        if self.retry_backoff_initial_s > self.retry_backoff_max_s:
            raise ZephonConfigError(
                "StoreOptions: retry_backoff_initial_s "
                f"({self.retry_backoff_initial_s}) must be <= retry_backoff_max_s "
                f"({self.retry_backoff_max_s})",
                field="StoreOptions.retry_backoff_initial_s",
            )
