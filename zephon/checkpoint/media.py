"""Where the ranks' checkpoint records travel: a directory, an fsspec URL, a TCPStore.

A *medium* is a tiny key -> bytes space shared by the ranks of one run. What the
round protocol (:mod:`zephon.checkpoint.aggregate`) asks of it, each a constant
number of operations whatever the world size:

- ``put(key, data)``: publish ``data`` under ``key`` atomically (a reader sees
  the old value, nothing, or all of ``data``);
- ``get(key)``: the bytes under ``key`` or ``None`` when there are none yet;
- ``wait(key, until)``: the bytes under ``key`` once they are there, or
  ``None`` at the monotonic time ``until``. A store blocks server-side; a
  directory or an object store re-reads with a bounded exponential backoff
  (:func:`backoff`: 2 ms, x1.5, at most 0.5 s between reads on a directory;
  50 ms to 2 s on an object store), so a wait of ``t`` seconds costs about
  ``17 + 2 t`` reads on a directory, whatever the number of ranks;
- ``submit(prefix, rank, world, blob)`` / ``gather(prefix, world, until)``:
  each rank other than 0 hands in its state once; rank 0 gets all of them
  (``{rank: blob}``, the ranks there by ``until``) in a number of round trips
  that does not grow with the world size on a store, and one listing per
  backoff step plus one read per rank on a directory;
- ``tidy(base, tokens, rank, world, until)``: called by every rank once it has
  its result; the last one removes the round (everything under ``base``). A
  medium that cannot count its readers (an object store) leaves the round,
  and rank 0 removes it at the next round (``remove``);
- ``remove(prefix)``, ``address`` (for messages), ``close()``.

Directories count readers with hard links: each rank links the merged record
once and reads its link count; the rank that sees ``world + 1`` links removes
the round (two that see it both remove it, which is harmless). Where hard links
fail the round stays until rank 0 removes it at the next round.

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

import abc
import logging
import os
import re
import shutil
import threading
import time
from typing import Iterator

from zephon.errors import AggregationTimeoutError, CheckpointError, ZephonConfigError

__all__ = ["DirMedium", "FsspecMedium", "backoff", "open_medium"]

log = logging.getLogger("zephon.checkpoint")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_EXTRA_OF = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def backoff(until: float, first_s: float, cap_s: float, factor: float = 1.5) -> Iterator[None]:
    """Yield at once, then after sleeps of ``first_s``, ``first_s * factor``, ... (at most
    ``cap_s`` each, never past the monotonic time ``until``); stops once ``until`` has
    passed. The caller checks its condition at every step and breaks when it holds."""
    delay = first_s
    while True:
        yield
        remaining = until - time.monotonic()
        if remaining <= 0:
            return
        time.sleep(min(delay, remaining))
        delay = min(delay * factor, cap_s)


_RANK_FILE = re.compile(r"rank-([0-9]{1,9})")


class _PollingMedium(abc.ABC):
    """The waits, submissions and gathering of a medium without server-side waits, from
    its ``put``/``get`` of whole records and ``_list`` of a prefix's names, with a
    backoff between reads (``first_s``, ``cap_s``)."""

    first_s, cap_s = 0.002, 0.5

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def _list(self, prefix: str) -> list[str]: ...

    def wait(self, key: str, until: float) -> bytes | None:
        for _ in backoff(until, self.first_s, self.cap_s):
            blob = self.get(key)
            if blob is not None:
                return blob
        return None

    def submit(self, prefix: str, rank: int, world: int, blob: bytes) -> None:
        self.put(f"{prefix}/rank-{rank}", blob)

    def gather(self, prefix: str, world: int, until: float) -> dict[int, bytes]:
        got: dict[int, bytes] = {}
        for _ in backoff(until, self.first_s, self.cap_s):
            for name in self._list(prefix):
                match = _RANK_FILE.fullmatch(name)
                rank = int(match.group(1)) if match else 0
                if 0 < rank < world and rank not in got:
                    blob = self.get(f"{prefix}/{name}")
                    if blob is not None:
                        got[rank] = blob
            if len(got) == world - 1:
                break
        return got


class DirMedium(_PollingMedium):
    """Records as files under a local (or network-mounted) directory; atomic by
    write-to-temp, fsync, rename."""

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

    def _list(self, prefix: str) -> list[str]:
        path = self._path(prefix)
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(f"cannot list checkpoint records in {path}: {exc}") from exc

    def _readers(self, key: str, rank: int) -> int:
        """Link the record ``key`` as read by ``rank``; its number of links after that."""
        path = self._path(key)
        os.link(path, f"{path}.read-{rank}")
        return os.stat(path).st_nlink

    def tidy(self, base: str, tokens: list[str], rank: int, world: int,
             until: float) -> None:
        try:
            links = self._readers(f"{base}/{tokens[0]}/merged", rank)
        except OSError:  # no hard links here: rank 0 removes the round at the next one
            log.debug("checkpoint exchange: cannot count the readers of %s/%s", self.root,
                      base, exc_info=True)
            return
        if links >= world + 1:  # the record and one link per rank: everyone has read
            self.remove(base)

    def remove(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def close(self) -> None:
        return None


class FsspecMedium(_PollingMedium):
    """Records as objects under an fsspec URL (``s3://bucket/path``, ``gs://...``,
    ``memory://...``). An object store's PUT is atomic. Every call runs on a helper
    thread and is abandoned at the exchange deadline, so a server that stops
    answering is an error by then, not a hang. An object store cannot count a round's
    readers: rank 0 removes each round at the next one."""

    first_s, cap_s = 0.05, 2.0

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
            self.first_s, self.cap_s = 0.002, 0.5

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

    def _list(self, prefix: str) -> list[str]:
        path = f"{self.root}/{prefix}"
        try:
            names = self._call("reading", prefix, self.fs.ls, path, False)
        except FileNotFoundError:
            return []
        return [str(name).rstrip("/").rsplit("/", 1)[-1] for name in names]

    def tidy(self, base: str, tokens: list[str], rank: int, world: int,
             until: float) -> None:
        return None  # rank 0 removes the round at the next one

    def remove(self, prefix: str) -> None:
        path = f"{self.root}/{prefix}"
        try:
            self._call("removing", prefix, self.fs.rm, path, True)
        except FileNotFoundError:
            pass

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
