"""The checkpoint exchange through torch's TCPStore (``aggregate_store="torch://..."``).

Which store:

- ``torch://`` with an initialized default process group: that group's store
  (the one ``init_process_group`` built; nothing new is opened);
- ``torch://`` otherwise: the store at ``MASTER_ADDR``/``MASTER_PORT`` (what
  torchrun sets);
- ``torch://host:port``: that address.

When zephon opens the connection itself it is a client, except that rank 0
hosts the server when nobody else does: outside torchrun's agent store
(``TORCHELASTIC_USE_AGENT_STORE`` not ``True``), rank 0 binds a listening
socket to exactly the address given (``host`` resolved, its first address) and
hands it to the ``TCPStore`` it hosts (``master_listen_fd``): the store then
listens on that address only, not on every interface as a ``TCPStore`` that
binds its own port does. When the address is in use (a launcher, or another
job's rank 0, hosts a store there) or is not this machine's, rank 0 is a
client of the store that answers there like every other rank. Connections are
cached per address for the life of the process, so a hosted server outlives
the round.

A round on a store, under ``<round>/<token>/`` (see
:mod:`zephon.checkpoint.aggregate` for the tokens):

- a rank other than 0 waits for ``open`` (a blocking ``get``: the server
  answers when the key is set, nothing polls), appends its state as one frame
  (rank, length, bytes) to ``subs`` and counts itself in ``count`` (``add``);
  the rank that makes the count ``world - 1`` sets ``full``;
- rank 0 blocks on ``full`` (at most the arrival grace), then reads ``subs``
  once: two round trips, whatever the world size; at the grace it reads
  ``subs`` to name the ranks that are not there;
- every rank blocks on ``merged`` and reads it once, then counts itself in
  ``ack``; the rank that makes that count ``world - 1`` sets ``acked``;
- rank 0 blocks on ``acked`` (the server may live in rank 0's process, its
  own or its process group's, and rank 0 may exit right after
  ``checkpoint()``), then deletes the round's keys: nothing is left.

A rank other than 0 makes at most 8 store calls a round, rank 0 16 (7 of them
deletes; 24 when it reopens a round an earlier launch left), for 2 ranks as for
16384.

Keys are ``zephon/<run_id>/...``. The default process group's store is
``launch_private``: only the ranks of this launch reach it, so the launch needs
no other name there (see :func:`zephon.checkpoint.aggregate.launch_identity`);
any other store may be shared by several launches. The round protocol is
:func:`zephon.checkpoint.aggregate.exchange`; torch is imported only here, and
only when such a store is asked for. Connecting or talking to an address that
does not answer is an :class:`~zephon.errors.AggregationTimeoutError` naming
the address within the exchange's budget.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import re
import socket
import time

from zephon.checkpoint.media import pack_frames, read_frames
from zephon.errors import AggregationTimeoutError, CheckpointError, ZephonConfigError

__all__ = ["StoreMedium"]

_URL = re.compile(r"^torch://(?:(?P<host>[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5}))?$")
_connections: dict = {}  # (host, port) -> (store, hosted)
_BACKLOG = 2048  # pending connections of a hosted store's socket
log = logging.getLogger("zephon.checkpoint")


def _torch_distributed():
    try:
        import torch.distributed as dist
    except ImportError:
        raise ZephonConfigError('aggregate_store="torch://..." needs torch '
                                '(python -m pip install -e ".[torch]" in the zephon checkout)') from None
    if not dist.is_available():
        raise ZephonConfigError("aggregate_store: this torch build has no torch.distributed")
    return dist


def _parse(url: str) -> tuple[str | None, int | None]:
    match = _URL.match(url or "")
    if match is None:
        raise ZephonConfigError(f"aggregate_store={url!r}: expected 'torch://' or "
                                "'torch://host:port'", field="RuntimeOptions.aggregate_store")
    if match.group("host") is None:
        return None, None
    port = int(match.group("port"))
    if not 0 < port < 65536:
        raise ZephonConfigError(f"aggregate_store={url!r}: port {port} is not in 1..65535",
                                field="RuntimeOptions.aggregate_store")
    return match.group("host"), port


def _default_group_store(dist):
    if not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a backend without a store: open our own
        return None


def _listening_fd(host: str, port: int) -> int | None:
    """The descriptor of a socket bound to ``host:port`` (its first address) and
    listening, for a hosted TCPStore to take over; None when a socket listens there
    already or the address is not this machine's (then a client connects to it)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
        sock.bind(addr)
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None
        raise
    return sock.detach()  # the store owns it now


def _open_tcp_store(dist, host: str, port: int, world: int, may_host: bool,
                    deadline: float, address: str):
    """``(store, hosted)``: a TCPStore hosted on exactly ``host:port`` when ``may_host``
    and nothing listens there, else a client of the store there."""
    remaining = deadline - time.monotonic()
    # A client's connect retries inside the timeout and may take about twice it.
    timeout = datetime.timedelta(seconds=max(0.5, remaining / 2.5))
    fd = None
    try:
        fd = _listening_fd(host, port) if may_host else None
        if fd is not None:
            store = dist.TCPStore(host, port, world, True, timeout=timeout,
                                  wait_for_workers=False, master_listen_fd=fd)
        else:
            store = dist.TCPStore(host, port, world, False, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - DistNetworkError, gaierror, ...
        if fd is not None:
            _close_quietly(fd)
        what = "host a store at" if fd is not None else "connect to the store at"
        raise AggregationTimeoutError(
            f"checkpoint exchange: cannot {what} {address} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); is the address right "
            "and is the rank that hosts it running?", missing=[address]) from None
    if fd is not None:
        log.debug("checkpoint exchange: rank 0 hosts a store on %s", address)
    return store, fd is not None


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class StoreMedium:
    """A medium (see :mod:`zephon.checkpoint.media`) over a torch.distributed Store."""

    def __init__(self, store, address: str, run_id: str, deadline: float,
                 hosted: bool, launch_private: bool = False) -> None:
        self.store, self.address, self.deadline = store, address, deadline
        self.prefix, self.hosted = f"zephon/{run_id}/", hosted
        # the default process group's store: only this launch's ranks reach it
        self.launch_private = launch_private

    @classmethod
    def open(cls, url: str, *, run_id: str, rank: int, world: int,
             deadline: float) -> "StoreMedium":
        host, port = _parse(url)
        dist = _torch_distributed()
        if host is None:
            store = _default_group_store(dist)
            if store is not None:
                return cls(store, "torch:// (the default process group's store)", run_id,
                           deadline, hosted=False, launch_private=True)
            host, port_text = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not host or not port_text:
                raise ZephonConfigError(
                    "aggregate_store='torch://' needs MASTER_ADDR and MASTER_PORT (torchrun sets "
                    "them) or an initialized default process group; or give the address: "
                    "'torch://host:port'", field="RuntimeOptions.aggregate_store")
            try:
                port = int(port_text)
            except ValueError:
                raise ZephonConfigError(f"MASTER_PORT={port_text!r} is not a port number") \
                    from None
        assert port is not None  # (given with the host, or from MASTER_PORT)
        address = f"torch://{host}:{port}"
        key = (host, port)
        cached = _connections.get(key)
        if cached is None:
            may_host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            cached = _connections[key] = _open_tcp_store(dist, host, port, world, may_host,
                                                         deadline, address)
        store, hosted = cached
        return cls(store, address, run_id, deadline, hosted=hosted)

    def _guard(self, what: str, key: str, fn, *args, timeout_s: float | None = None):
        remaining = self.deadline - time.monotonic()
        try:
            wait = max(0.5, remaining) if timeout_s is None else timeout_s
            self.store.set_timeout(datetime.timedelta(seconds=wait))
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - DistStoreError, DistNetworkError, ...
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise CheckpointError(f"checkpoint exchange: {what} {key!r} at {self.address} "
                                  f"failed ({type(exc).__name__}: {first}); nothing was "
                                  "merged") from None

    def put(self, key: str, data: bytes) -> None:
        self._guard("writing", key, self.store.set, self.prefix + key, data)

    def get(self, key: str) -> bytes | None:
        full = self.prefix + key
        if not self._guard("checking", key, self.store.check, [full]):
            return None
        return bytes(self._guard("reading", key, self.store.get, full))

    def wait(self, key: str, until: float) -> bytes | None:
        """The value of ``key`` once it is set (the server answers when it is: no
        polling), or None at ``until``."""
        remaining = until - time.monotonic()
        if remaining <= 0:
            return self.get(key)
        try:
            return bytes(self._guard("waiting for", key, self.store.get, self.prefix + key,
                                     timeout_s=remaining))
        except CheckpointError:
            if time.monotonic() >= until - _TIMEOUT_SLACK_S:
                return None  # the wait timed out
            raise

    def submit(self, prefix: str, rank: int, world: int, blob: bytes,
               until: float | None = None) -> None:
        """Append this rank's frame to the round's one submissions key and count it in;
        the rank that completes the count tells rank 0 (``full``)."""
        base = self.prefix + prefix
        self._guard("submitting to", prefix, self.store.append, base + "/subs",
                    pack_frames({rank: blob}))
        if self._guard("counting", prefix, self.store.add, base + "/count", 1) == world - 1:
            self._guard("writing", prefix, self.store.set, base + "/full", b"1")

    def gather(self, prefix: str, world: int, until: float) -> dict[int, bytes]:
        """Every submission there once all ``world - 1`` are (or at ``until``): one
        blocking wait and one read, whatever the world size."""
        self.wait(f"{prefix}/full", until)
        return read_frames(self.get(f"{prefix}/subs") or b"", world, f"{self.address} ({prefix})")

    def tidy(self, base: str, tokens: list[str], rank: int, world: int,
             until: float) -> None:
        """A rank other than 0 counts itself as having read; the one that completes the
        count tells rank 0, which waits for that (whoever hosts the server may exit
        right after ``checkpoint()``) and then deletes the round's keys."""
        acks, acked = f"{base}/{tokens[0]}/ack", f"{base}/{tokens[0]}/acked"
        if rank != 0:
            if self._guard("acknowledging", acks, self.store.add, self.prefix + acks, 1) \
                    == world - 1:
                self.put(acked, b"1")
            return
        if world > 1 and self.wait(acked, until) is None:
            log.warning("checkpoint exchange: not every rank read the merged state at %s "
                        "before the deadline; they will time out", self.address)
            return
        for key in [f"{base}/open"] + [f"{base}/{t}/{name}" for t in tokens
                                       for name in _ROUND_KEYS]:
            self._guard("removing", key, self.store.delete_key, self.prefix + key)

    def remove(self, prefix: str) -> None:
        return None  # every rank has read a round when rank 0 deletes it (tidy)

    def close(self) -> None:
        return None  # connections are kept for the next round (see the module docstring)


_ROUND_KEYS = ("subs", "count", "full", "merged", "ack", "acked")
_TIMEOUT_SLACK_S = 0.05
