"""Where the ranks' checkpoint records travel: a directory, an fsspec URL, a TCPStore.

A *medium* is a tiny key -> bytes space shared by the ranks of one run, with:

- ``put(key, data)``: publish ``data`` under ``key`` atomically (a reader sees
  the old value, nothing, or all of ``data``);
- ``get(key)``: the bytes under ``key`` or ``None`` when there are none yet;
- ``address``: where it is, for messages; ``poll_s``: how often to re-read;
- ``after_merge(prefix, world, deadline)`` / ``acknowledge(prefix)``: a rank
  that hosts the store waits until the others read the merged record before it
  may go away (a no-op for directories);
- ``remove(prefix)``: drop every record under ``prefix`` (rank 0 drops the
  previous round once every rank has moved on to the next one);
- ``close()``.

Any failure of the medium itself (a server gone, a permission error) is a
:class:`~zephon.errors.CheckpointError` naming the address, never a hang: a
remote call that does not return by the exchange deadline is abandoned.

Media: :class:`DirMedium` (a local or shared path, or ``file://``),
:class:`FsspecMedium` (``memory://``, ``s3://`` via s3fs, ``gs://`` via gcsfs,
any fsspec protocol) and the TCPStore medium of :mod:`zephon.checkpoint.store`.
:func:`open_medium` picks one from the options. Keys live under
``<aggregate_dir>/<run_id>/`` (or the ``zephon/<run_id>/`` prefix of a store).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time

from zephon.errors import AggregationTimeoutError, CheckpointError, ZephonConfigError

__all__ = ["DirMedium", "FsspecMedium", "open_medium"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_EXTRA_OF = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class DirMedium:
    """Records as files under a local (or network-mounted) directory; atomic by
    write-to-temp, fsync, rename."""

    poll_s = 0.02

    def __init__(self, root: str) -> None:
        self.root = root
        self.address = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoint record {path}: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint record {path}: {exc}") from exc

    def remove(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def after_merge(self, prefix: str, world: int, deadline: float) -> None:
        return None

    def acknowledge(self, prefix: str) -> None:
        return None

    def close(self) -> None:
        return None


class FsspecMedium:
    """Records as objects under an fsspec URL (``s3://bucket/path``, ``gs://...``,
    ``memory://...``). An object store's PUT is atomic. Every call runs on a helper
    thread and is abandoned at the exchange deadline, so a server that stops
    answering is an error by then, not a hang."""

    poll_s = 0.2

    def __init__(self, url: str, run_id: str, deadline: float) -> None:
        try:
            import fsspec
        except ImportError:
            raise ZephonConfigError(
                f"aggregate_dir={url!r} is a URL: it needs fsspec "
                f"(python -m pip install -e \".[{_extra(url)}]\" in the zephon checkout)") from None
        try:
            fs, root = fsspec.core.url_to_fs(url)
        except ImportError as exc:
            raise ZephonConfigError(
                f"aggregate_dir={url!r}: {exc} (python -m pip install -e \".[{_extra(url)}]\" in the zephon checkout)") from None
        except Exception as exc:  # noqa: BLE001 - a bad URL, bad credentials, ...
            raise ZephonConfigError(f"aggregate_dir={url!r} cannot be opened: "
                                    f"{type(exc).__name__}: {exc}") from None
        self.fs, self.url, self.deadline = fs, url, deadline
        self.root = root.rstrip("/") + "/" + run_id
        self.address = url.rstrip("/") + "/" + run_id
        if getattr(fs, "protocol", None) in ("memory",) or \
                (isinstance(fs.protocol, tuple) and "memory" in fs.protocol):
            self.poll_s = 0.02

    def _call(self, what: str, key: str, fn, *args):
        # A daemon thread per call: one that never returns is abandoned at the deadline
        # and cannot keep the interpreter from exiting.
        box: list = []
        done = threading.Event()

        def run():
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()

        threading.Thread(target=run, name="zephon-agg-io", daemon=True).start()
        if not done.wait(max(self.deadline - time.monotonic(), 0.01)):
            raise AggregationTimeoutError(
                f"checkpoint exchange: {what} {self.address}/{key} did not return before the "
                "aggregate_timeout_s deadline (the storage server does not answer)")
        ok, value = box[0]
        if ok:
            return value
        if isinstance(value, FileNotFoundError) and what == "reading":
            raise value  # not there (yet): the caller polls
        raise CheckpointError(
            f"checkpoint exchange: {what} {self.address}/{key} failed: "
            f"{type(value).__name__}: {value}; nothing was merged") from value

    def put(self, key: str, data: bytes) -> None:
        path = f"{self.root}/{key}"
        self._call("writing", key, self.fs.pipe_file, path, data)

    def get(self, key: str) -> bytes | None:
        path = f"{self.root}/{key}"
        try:
            return self._call("reading", key, self.fs.cat_file, path)
        except FileNotFoundError:
            return None

    def remove(self, prefix: str) -> None:
        path = f"{self.root}/{prefix}"
        try:
            self._call("removing", prefix, self.fs.rm, path, True)
        except FileNotFoundError:
            pass

    def after_merge(self, prefix: str, world: int, deadline: float) -> None:
        return None

    def acknowledge(self, prefix: str) -> None:
        return None

    def close(self) -> None:
        return None


def _extra(url: str) -> str:
    match = _SCHEME.match(url)
    return _EXTRA_OF.get(match.group(1).lower(), "cloud") if match else "cloud"


def open_medium(opts, timeout_s: float):
    """The medium of ``opts`` (aggregate_dir or aggregate_store), its operations bounded
    by ``timeout_s`` from now."""
    deadline = time.monotonic() + timeout_s
    if opts.aggregate_store is not None:
        from zephon.checkpoint.store import StoreMedium

        return StoreMedium.open(opts.aggregate_store, run_id=opts.run_id,
                                rank=opts.global_rank, world=opts.world_size,
                                deadline=deadline)
    path = opts.aggregate_dir
    match = _SCHEME.match(path)
    if match is None:
        return DirMedium(os.path.join(path, opts.run_id))
    if match.group(1).lower() == "file":
        return DirMedium(os.path.join(path[len("file://"):], opts.run_id))
    return FsspecMedium(path, opts.run_id, deadline)
