"""Simulated ranks of one checkpoint round, as threads of this process, over a real medium
(used by tests/test_checkpoint_exchange_scale.py and bench/exchange_scale.py).

Each rank runs the real protocol (:func:`zephon.checkpoint.aggregate.exchange`) on its own
connection: a TCPStore client of a server this process hosts on 127.0.0.1, or the
directory medium. The media are wrapped to count the operations each rank makes.
"""

from __future__ import annotations

import collections
import datetime
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from zephon.checkpoint.aggregate import exchange
from zephon.checkpoint.media import DirMedium

#: the TCPStore calls that reach the server (set_timeout is local)
STORE_CALLS = ("set", "get", "check", "add", "append", "delete_key", "wait", "multi_get",
               "multi_set", "compare_set", "num_keys")


class CountingStore:
    """A real store whose calls that reach the server are counted (``calls``)."""

    def __init__(self, store) -> None:
        self._store, self.calls = store, collections.Counter()

    def set_timeout(self, timeout) -> None:
        self._store.set_timeout(timeout)

    def __getattr__(self, name):
        method = getattr(self._store, name)
        if name not in STORE_CALLS:
            return method

        def counted(*args):
            self.calls[name] += 1
            return method(*args)

        return counted


class CountingDir(DirMedium):
    """The directory medium with its file operations counted (``calls``)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.calls: collections.Counter = collections.Counter()

    def put(self, key, data):
        self.calls["write"] += 1
        return super().put(key, data)

    def get(self, key):
        self.calls["read"] += 1
        return super().get(key)

    def _list(self, prefix):
        self.calls["list"] += 1
        return super()._list(prefix)

    def _readers(self, key, rank):
        self.calls["link"] += 1
        return super()._readers(key, rank)

    def remove(self, prefix):
        self.calls["remove"] += 1
        return super().remove(prefix)


def submission(rank: int, world: int) -> dict:
    """Rank ``rank``'s state: one dp group per rank, each owning lane ``rank``."""
    return {"fingerprint": "f" * 64, "lanes_total": world, "resume": "cursor",
            "start_epoch": 0, "lanes": {str(rank): [0, 3 + rank, 100]}, "group": rank,
            "world": world, "dp_degree": world, "mapping": "contiguous"}


def run_round(media, world: int, *, round_no: int = 1, timeout_s: float = 120.0,
              scope: str = "s", ranks=None, ready=None, grace_s: float | None = None) -> dict:
    """One round, rank ``r`` on ``media[r]`` for each of ``ranks`` (default: all); returns
    ``{"results", "errors", "seconds"}``. With ``ready`` (a callable), every rank's thread
    is started first and waits; ``ready()`` is called (a barrier with the other processes
    of a simulated world) and then all of them enter the round at once, so that the
    round's clock does not include starting thousands of threads. ``grace_s``: rank 0's
    wait for arrivals (default: the protocol's, from ``timeout_s``)."""
    results: dict = {}
    errors: dict = {}
    gate = threading.Event()
    if ready is None:
        gate.set()

    def rank(r: int) -> None:
        gate.wait()
        try:
            results[r] = exchange(media[r], submission(r, world), round_no=round_no, rank=r,
                                  world=world, timeout_s=timeout_s, serializer="msgpack",
                                  compressor="zstd", scope=scope, grace_s=grace_s)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True)
               for r in (range(world) if ranks is None else ranks)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    if ready is not None:
        ready()
        start = time.perf_counter()
        gate.set()
    for t in threads:
        t.join(timeout_s + 30)
    return {"results": results, "errors": errors, "seconds": time.perf_counter() - start}


class StoreWorld:
    """A TCPStore server on 127.0.0.1 in this process and one counted client per rank."""

    def __init__(self, world: int, run_id: str = "scale") -> None:
        import torch.distributed as dist

        from zephon.checkpoint.store import StoreMedium

        timeout = datetime.timedelta(seconds=60)
        self.server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout,
                                    wait_for_workers=False)
        port = self.server.port

        def client(_):
            return CountingStore(dist.TCPStore("127.0.0.1", port, world, False,
                                               timeout=timeout))

        # connecting one by one stalls now and then for seconds: connect in parallel
        with ThreadPoolExecutor(64) as pool:
            self.clients = list(pool.map(client, range(world)))
        self.baseline = self.server.num_keys()
        deadline = time.monotonic() + 3600
        self.media = [StoreMedium(c, f"torch://127.0.0.1:{self.server.port}", run_id,
                                  deadline, hosted=False) for c in self.clients]

    def keys_left(self) -> int:
        return self.server.num_keys() - self.baseline

    def calls(self) -> list[int]:
        """Store calls per rank since the last call of ``calls``."""
        out = [sum(c.calls.values()) for c in self.clients]
        for c in self.clients:
            c.calls.clear()
        return out

    def close(self) -> None:
        self.clients.clear()
        self.media.clear()
        del self.server


def dir_media(root: str, world: int) -> list[CountingDir]:
    return [CountingDir(os.path.join(root, "run")) for _ in range(world)]
