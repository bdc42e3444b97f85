"""IoConfig: the I/O knobs as plain numbers, and the retry loop that honours them.

:class:`IoConfig` mirrors ``zephon.options.StoreOptions`` field for field but is a
plain slotted class: a source unpickled in a worker carries one without importing
the options layer. The pipeline builds it from ``io_options`` (see
``zephon.pipeline.sources.base.io_config``).

:func:`call_with_retry` runs one *attempt* at a time: each attempt gets at most
``download_timeout_s`` (it runs in a helper thread and is abandoned, its result
discarded, when the time is up), failed attempts are retried ``download_retry``
times with a back-off starting at ``retry_backoff_initial_s`` and doubling up to
``retry_backoff_max_s``. The last error is raised. Deterministic errors (a bad
argument, a directory, a refused permission, a :class:`SourceError` verdict such
as an object that changed) are raised after one attempt.

``unchecked_objects`` (:data:`UNCHECKED_POLICIES`) is what a whole-object read does with
a remote object that has no checksum zephon can check (see :mod:`zephon.io.remote`);
a ``StoreOptions`` without that field gives the default, ``'read_twice'``.

:func:`is_transient` says which OS errors of a local open are worth another
attempt (used by :func:`zephon.io.reader.open_with_retry`).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Callable, TypeVar

from zephon.errors import AttemptTimeout, SourceError, ZephonConfigError

__all__ = ["DEFAULT_IO", "TRANSIENT_ERRNOS", "UNCHECKED_POLICIES", "AttemptTimeout", "IoConfig", "call_with_retry",
           "is_transient"]

log = logging.getLogger("zephon.io")
T = TypeVar("T")
# what a whole-object read does with a remote object that has no checksum zephon can check
# (see zephon.io.remote): read it twice and require the reads to agree, or refuse it
UNCHECKED_POLICIES = ("read_twice", "refuse")


class IoConfig:
    """``StoreOptions`` as plain values (see that class for the meaning of each field).

    >>> IoConfig(cache_enabled=True, cache_root="/tmp/c").cache_dir()
    '/tmp/c'
    """

    __slots__ = (
        "cache_enabled",
        "cache_limit_bytes",
        "cache_root",
        "download_retry",
        "download_timeout_s",
        "open_retry_attempts",
        "retry_backoff_initial_s",
        "retry_backoff_max_s",
        "unchecked_objects",
    )

    def __init__(self, *, cache_enabled: bool = False, cache_root: str | None = None,
                 cache_limit_bytes: int | None = None, download_retry: int = 12,
                 download_timeout_s: float = 180.0, open_retry_attempts: int = 5,
                 retry_backoff_initial_s: float = 0.1, retry_backoff_max_s: float = 2.0,
                 unchecked_objects: str = "read_twice") -> None:
        self.cache_enabled = bool(cache_enabled)
        self.cache_root = None if cache_root is None else os.fspath(cache_root)
        self.cache_limit_bytes = cache_limit_bytes
        self.download_retry = int(download_retry)
        self.download_timeout_s = float(download_timeout_s)
        self.open_retry_attempts = int(open_retry_attempts)
        self.retry_backoff_initial_s = float(retry_backoff_initial_s)
        self.retry_backoff_max_s = float(retry_backoff_max_s)
        if unchecked_objects not in UNCHECKED_POLICIES:
            raise ZephonConfigError(f"unchecked_objects must be one of {UNCHECKED_POLICIES}, "
                                    f"got {unchecked_objects!r}",
                                    field="StoreOptions.unchecked_objects")
        self.unchecked_objects = unchecked_objects

    @classmethod
    def from_store_options(cls, store) -> "IoConfig":
        """From a ``StoreOptions`` (duck-typed: any object with the same fields)."""
        kw: dict = {name: getattr(store, name) for name in cls.__slots__
                    if name != "unchecked_objects"}
        kw["unchecked_objects"] = getattr(store, "unchecked_objects", "read_twice")  # newer
        return cls(**kw)

    def key(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other) -> bool:
        return isinstance(other, IoConfig) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __getstate__(self):
        return self.key()

    def __setstate__(self, state) -> None:
        for name, value in zip(self.__slots__, state, strict=True):
            setattr(self, name, value)

    def __repr__(self) -> str:
        return "IoConfig(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"

    def cache_dir(self) -> str:
        """The cache directory: ``cache_root``, else ``$ZEPHON_CACHE_DIR``, else
        ``~/.cache/zephon`` (resolved in the process that reads)."""
        if self.cache_root is not None:
            return self.cache_root
        env = os.environ.get("ZEPHON_CACHE_DIR")
        if env:
            return env
        return os.path.join(os.path.expanduser("~"), ".cache", "zephon")

    @property
    def open_retry(self) -> tuple:
        return (self.open_retry_attempts, self.retry_backoff_initial_s, self.retry_backoff_max_s)


DEFAULT_IO = IoConfig()


def _attempt(fn: Callable[[], T], timeout: float) -> T:
    """Run ``fn`` in a helper thread for at most ``timeout`` seconds."""
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=run, name="zephon-download", daemon=True)
    thread.start()
    if not done.wait(timeout):
        # The thread is abandoned: its result is never used (a late reply cannot leak
        # into the data); it ends when the transport's own timeouts give up.
        raise AttemptTimeout(f"no answer within download_timeout_s={timeout:g} s",
                             timeout_s=timeout)
    if "error" in box:
        raise box["error"]
    return box["value"]


# Deterministic errors are not worth another attempt: programming errors, a path that
# names a directory (or goes through a file), a refused permission, a bad argument and
# zephon's own verdicts (an object that changed, a corrupt file).
_NEVER_RETRY = (TypeError, AttributeError, NameError, ImportError, AssertionError,
                ValueError, IsADirectoryError, NotADirectoryError, PermissionError,
                SourceError)

# errno values of transient failures: worth another attempt on the same path.
TRANSIENT_ERRNOS = frozenset(getattr(errno, name) for name in (
    "EIO", "ESTALE", "EAGAIN", "EINTR", "EBUSY", "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED",
    "ECONNABORTED", "EHOSTUNREACH", "ENETUNREACH", "ENETDOWN", "ENETRESET", "EPIPE", "EMFILE",
    "ENFILE", "ENOLCK", "ENOBUFS", "EREMOTEIO", "ENOMEM") if hasattr(errno, name))


def is_transient(exc: BaseException) -> bool:
    """True for an OS error worth retrying on the same local path (a stale NFS handle,
    an I/O error, a timeout, too many open files...); False for deterministic ones (no
    such file, a directory, no permission, ...) and for everything that is not an
    OSError."""
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError,
                        PermissionError, FileExistsError)):
        return False
    return isinstance(exc, (OSError, TimeoutError)) and (
        isinstance(exc, (TimeoutError, ConnectionError, InterruptedError, BlockingIOError))
        or exc.errno in TRANSIENT_ERRNOS)


def call_with_retry(fn: Callable[[], T], cfg: IoConfig, what: str,
                    retry_on: tuple = (Exception,)) -> T:
    """``fn()`` with ``cfg.download_retry`` retries, each attempt limited to
    ``cfg.download_timeout_s``; ``what`` names the object in the log.

    Only ``retry_on`` errors are retried (by default every ``Exception``: the
    transports raise network errors, throttling and objects missing for a while
    under many classes), and never a deterministic one (a bad argument, a
    directory, a refused permission, a :class:`SourceError` verdict such as an
    object that changed): those are raised after one attempt.
    """
    delay = cfg.retry_backoff_initial_s
    attempts = cfg.download_retry + 1
    for attempt in range(1, attempts + 1):
        try:
            return _attempt(fn, cfg.download_timeout_s)
        except retry_on as exc:
            if attempt == attempts or isinstance(exc, _NEVER_RETRY):
                raise
            log.warning("reading %s failed (%s: %s); attempt %d of %d in %.2f s", what,
                        type(exc).__name__, exc, attempt + 1, attempts, delay)
            time.sleep(delay)
            delay = min(cfg.retry_backoff_max_s, delay * 2)
    raise AssertionError("unreachable")
