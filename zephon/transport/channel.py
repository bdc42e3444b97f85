"""Message channels between two processes: ``socketpair`` (default) and ``pipe``.

A message is a small msgpack-able ``header`` dict, a list of binary ``frames``
(sent from the caller's memory, scatter-gather, no concatenation) and, on
socket channels only, file descriptors passed with ``SCM_RIGHTS``. On the wire::

    prefix  <I I I>  header length, frame count, fd count
    lengths <Q>*n    one per frame
    header  msgpack
    frames  raw bytes

Socket channels are ``AF_UNIX``/``SOCK_STREAM`` pairs whose kernel buffers are
requested at ``buffer_bytes`` on both ends (Linux charges in-flight bytes to the
sender, macOS to the receiver) and read back; when the kernel grants less, one
warning per requested size says so. Pipe channels are two one-way stock
``multiprocessing`` pipes (one per direction); they cannot carry descriptors.

Invariants:
- One thread sends at a time and one thread receives at a time per channel
  end (callers serialise; :class:`Channel` holds a send lock for convenience).
- ``recv`` returns whole messages or raises :class:`ChannelClosed` (the peer
  closed or died, possibly mid-message); it never returns a partial message.
- Received descriptors are owned by the caller (close them or hand them on).
- All descriptors are close-on-exec (Python's default, PEP 446).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import struct
import sys
import threading
import warnings
from typing import Any, Sequence

import msgpack

from zephon.errors import TransportError

__all__ = ["Channel", "ChannelClosed", "channel_pair", "granted_buffer_bytes"]

log = logging.getLogger("zephon.transport")

_PREFIX = struct.Struct("<III")
_CLOEXEC_FLAG = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
_MAX_FDS = 64
_warned_sizes: set[int] = set()
_warn_lock = threading.Lock()


class ChannelClosed(TransportError):
    """The other end closed the channel or its process died (maybe mid-message)."""


def _granted(sock: socket.socket, option: int) -> int:
    value = sock.getsockopt(socket.SOL_SOCKET, option)
    # Linux reports twice the usable size (it counts its bookkeeping); halve it back.
    return value // 2 if sys.platform.startswith("linux") else value


def _size_socket(sock: socket.socket, requested: int) -> int:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, requested)
        except OSError:  # some kernels refuse large values outright
            pass
    return min(_granted(sock, socket.SO_SNDBUF), _granted(sock, socket.SO_RCVBUF))


def granted_buffer_bytes(requested: int) -> int:
    """What the kernel grants a socketpair buffer asked to be ``requested`` bytes."""
    a, b = socket.socketpair()
    try:
        return _size_socket(a, requested)
    finally:
        a.close()
        b.close()


class Channel:
    """One end of a duplex message channel (picklable to a spawned child before use)."""

    kind = "abstract"

    def __init__(self) -> None:
        self.send_lock = threading.Lock()
        self.closed = False

    def send(self, header: dict, frames: Sequence[Any] = (), fds: Sequence[int] = ()) -> None:
        raise NotImplementedError

    def recv(self) -> tuple[dict, list[bytearray], list[int]]:
        raise NotImplementedError

    def fileno(self) -> int:
        """The descriptor to wait on for incoming messages."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    @staticmethod
    def _meta(header: dict, frames: Sequence[Any], nfds: int) -> tuple[bytes, list[memoryview]]:
        views = []
        for frame in frames:
            view = memoryview(frame)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            views.append(view)
        packed = msgpack.packb(header, use_bin_type=True)
        lengths = struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
        return _PREFIX.pack(len(packed), len(views), nfds) + lengths + packed, views

    @staticmethod
    def _header(data: bytes | memoryview) -> dict:
        try:
            return msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # noqa: BLE001 - any decode failure is a corrupt frame
            raise TransportError(f"corrupt message header: {exc}") from exc


class SocketChannel(Channel):
    kind = "socketpair"

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock

    def __getstate__(self):
        return {"sock": self.sock}

    def __setstate__(self, state):
        state["sock"].set_inheritable(False)
        self.__init__(state["sock"])

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, header, frames=(), fds=()):
        if len(fds) > _MAX_FDS:
            raise TransportError(f"at most {_MAX_FDS} descriptors per message, got {len(fds)}")
        meta, views = self._meta(header, frames, len(fds))
        buffers = [memoryview(meta), *views]
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] \
            if fds else []
        with self.send_lock:
            try:
                sent = self.sock.sendmsg(buffers, ancillary)
                # A blocking stream socket may still send partially (signals, huge frames):
                # finish the rest without repeating the descriptors.
                for buf in buffers:
                    if sent >= buf.nbytes:
                        sent -= buf.nbytes
                        continue
                    self.sock.sendall(buf[sent:])
                    sent = 0
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno not in (32, 104, 9, 57, 107):
                    raise
                raise ChannelClosed(f"peer closed the channel: {exc}") from exc

    def _recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            try:
                n = self.sock.recv_into(view[got:])
            except ConnectionResetError as exc:  # the peer died with data unread
                raise ChannelClosed(f"peer reset the channel mid-message: {exc}") from exc
            if n == 0:
                raise ChannelClosed("peer closed the channel mid-message")
            got += n

    def recv(self):
        fds: list[int] = []
        prefix = bytearray(_PREFIX.size)
        view = memoryview(prefix)
        got = 0
        while got < _PREFIX.size:
            try:
                n, ancdata, flags, _ = self.sock.recvmsg_into(
                    [view[got:]], socket.CMSG_SPACE(_MAX_FDS * 4), _CLOEXEC_FLAG)
            except ConnectionResetError as exc:
                raise ChannelClosed(f"peer reset the channel: {exc}") from exc
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(data) - len(data) % 4
                    for fd in struct.unpack(f"{usable // 4}i", data[:usable]):
                        os.set_inheritable(fd, False)  # where MSG_CMSG_CLOEXEC is missing
                        fds.append(fd)
            if flags & getattr(socket, "MSG_CTRUNC", 0):
                raise TransportError("descriptors were truncated in transit")
            if n == 0:
                for fd in fds:
                    _close_fd(fd)
                raise ChannelClosed("peer closed the channel" if got == 0
                                    else "peer closed the channel mid-message")
            got += n
        header_len, nframes, nfds = _PREFIX.unpack(prefix)
        rest = bytearray(8 * nframes + header_len)
        self._recv_exact(memoryview(rest))
        lengths = struct.unpack_from(f"<{nframes}Q", rest)
        header = self._header(memoryview(rest)[8 * nframes:])
        frames = []
        for length in lengths:
            frame = bytearray(length)
            self._recv_exact(memoryview(frame))
            frames.append(frame)
        if len(fds) != nfds:
            raise TransportError(f"expected {nfds} descriptors, received {len(fds)}")
        return header, frames, fds

    def close(self):
        if not self.closed:
            self.closed = True
            self.sock.close()


class PipeChannel(Channel):
    """Two one-way ``multiprocessing`` pipes; every frame is one ``send_bytes``."""

    kind = "pipe"

    def __init__(self, reader, writer) -> None:
        super().__init__()
        self.reader, self.writer = reader, writer

    def __getstate__(self):
        return {"reader": self.reader, "writer": self.writer}

    def __setstate__(self, state):
        self.__init__(state["reader"], state["writer"])

    def fileno(self) -> int:
        return self.reader.fileno()

    def send(self, header, frames=(), fds=()):
        if fds:
            raise TransportError("pipe channels cannot carry file descriptors")
        meta, views = self._meta(header, frames, 0)
        with self.send_lock:
            try:
                self.writer.send_bytes(meta)
                for view in views:
                    self.writer.send_bytes(view)
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise ChannelClosed(f"peer closed the pipe: {exc}") from exc

    def recv(self):
        try:
            meta = self.reader.recv_bytes()
            header_len, nframes, _ = _PREFIX.unpack_from(meta)
            lengths = struct.unpack_from(f"<{nframes}Q", meta, _PREFIX.size)
            header = self._header(memoryview(meta)[_PREFIX.size + 8 * nframes:])
            frames = []
            for length in lengths:
                frame = bytearray(length)
                if length:
                    self.reader.recv_bytes_into(frame)
                else:
                    self.reader.recv_bytes()
                frames.append(frame)
        except (EOFError, ConnectionResetError, OSError) as exc:
            raise ChannelClosed(f"peer closed the pipe: {exc}") from exc
        return header, frames, []

    def close(self):
        if not self.closed:
            self.closed = True
            self.reader.close()
            self.writer.close()


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def channel_pair(transport: str = "socketpair",
                 buffer_bytes: int = 512 * 1024) -> tuple[Channel, Channel]:
    """Two connected channel ends ``(parent, child)`` of the given transport."""
    if transport == "socketpair":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        granted = min(_size_socket(a, buffer_bytes), _size_socket(b, buffer_bytes))
        if granted < buffer_bytes:
            with _warn_lock:
                first = buffer_bytes not in _warned_sizes
                _warned_sizes.add(buffer_bytes)
            if first:
                warnings.warn(
                    f"zephon: socket buffers of {buffer_bytes} bytes were requested, the kernel "
                    f"granted {granted} (raise net.core.wmem_max/rmem_max, or "
                    "kern.ipc.maxsockbuf on macOS, for the full size)",
                    RuntimeWarning, stacklevel=2)
        return SocketChannel(a), SocketChannel(b)
    if transport == "pipe":
        down_r, down_w = multiprocessing.Pipe(duplex=False)
        up_r, up_w = multiprocessing.Pipe(duplex=False)
        return PipeChannel(up_r, down_w), PipeChannel(down_r, up_w)
    raise ValueError(f"unknown transport {transport!r}; expected 'socketpair' or 'pipe'")
