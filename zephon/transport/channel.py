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
- Any number of frames and descriptors: one ``sendmsg`` takes at most IOV_MAX
  (1024) buffers and SCM_MAX_FD (253) descriptors, so a larger message is sent
  in several calls (each further chunk of descriptors rides on one byte of the
  message) and the receiver collects descriptors from every read.
- ``send`` raises :class:`ChannelClosed` when the peer is gone or the stream
  broke mid-message, and a plain ``OSError`` only when nothing was sent (the
  channel is intact: the caller reports the error on it).
- All descriptors are close-on-exec (Python's default, PEP 446).
"""

from __future__ import annotations

import errno
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

from zephon.errors import ChannelClosed, TransportError, ZephonConfigError

__all__ = ["Channel", "ChannelClosed", "channel_pair", "granted_buffer_bytes"]

log = logging.getLogger("zephon.transport")

_PREFIX = struct.Struct("<III")
_CLOEXEC_FLAG = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
# Per sendmsg call Linux takes at most SCM_MAX_FD (253) descriptors and IOV_MAX (1024)
# buffers: larger messages are split across calls.
_MAX_FDS = 253
_MAX_IOV = 1024
_FD_BYTES = struct.calcsize("i")  # one descriptor in an SCM_RIGHTS payload
_DISCARD_CHUNK = 1 << 20  # bytes read per call while discarding a stream at shutdown
DEFAULT_BUFFER_BYTES = 512 * 1024
# send() errors that mean the peer is gone (the value differs per platform: ENOTCONN is
# 107 on Linux, 57 on macOS), as opposed to a failure the channel survives.
_PEER_GONE_ERRNOS = frozenset((errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENOTCONN))
_warned_sizes: set[int] = set()
_warn_lock = threading.Lock()


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

    def discard_pending(self) -> bool:
        """Read and drop whatever the peer has sent, without blocking and without parsing
        (the stream may be mid-message); descriptors riding on it are closed by the kernel.
        Returns False once the peer has closed its end. For shutdown only: the channel
        cannot carry messages afterwards."""
        fd = self.fileno()
        os.set_blocking(fd, False)
        try:
            while True:
                if not os.read(fd, _DISCARD_CHUNK):
                    return False
        except BlockingIOError:
            return True
        except OSError:
            return False

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
        except Exception as exc:  # any decode failure means a corrupt header
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
        Channel.__init__(self)
        self.sock = state["sock"]

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, header, frames=(), fds=()):
        meta, views = self._meta(header, frames, len(fds))
        buffers = [memoryview(meta), *views]
        fd_chunks = [list(fds[k:k + _MAX_FDS]) for k in range(0, len(fds), _MAX_FDS)]
        if len(fd_chunks) > len(meta):  # each chunk rides on at least one byte
            raise TransportError(f"{len(fds)} descriptors cannot ride on a {len(meta)}-byte "
                                 "message header")
        with self.send_lock:
            progress = [False]
            try:
                self._send_all(buffers, fd_chunks, progress)
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                if exc.errno in _PEER_GONE_ERRNOS:
                    raise ChannelClosed(f"peer closed the channel: {exc}") from exc
                if progress[0]:  # part of the message is out: the stream cannot recover
                    self.close()
                    raise ChannelClosed(f"sending failed mid-message: {exc}") from exc
                raise  # nothing was sent: the channel is intact, the caller reports it

    def _send_all(self, buffers: list, fd_chunks: list, progress: list) -> None:
        """Scatter-gather ``buffers`` with at most ``_MAX_IOV`` entries and ``_MAX_FDS``
        descriptors per ``sendmsg``. Every chunk of descriptors but the last rides on one
        byte of its own (the receiver collects descriptors from every read); a partial
        send resumes where it stopped, without repeating descriptors."""
        pos, off = 0, 0  # next buffer, offset in it
        while pos < len(buffers) and buffers[pos].nbytes == 0:
            pos += 1
        while pos < len(buffers):
            ancillary = []
            if fd_chunks:
                chunk = fd_chunks.pop(0)
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                              struct.pack(f"{len(chunk)}i", *chunk))]
            if fd_chunks:  # more descriptors follow: this call carries a single byte
                iov = [buffers[pos][off:off + 1]]
            else:
                iov = [buffers[pos][off:], *buffers[pos + 1:pos + _MAX_IOV]]
            sent = self.sock.sendmsg(iov, ancillary)
            progress[0] = True
            while sent:
                left = buffers[pos].nbytes - off
                if sent >= left:
                    sent -= left
                    pos, off = pos + 1, 0
                else:
                    off += sent
                    sent = 0
            while pos < len(buffers) and buffers[pos].nbytes == off:
                pos, off = pos + 1, 0

    def _recv_exact(self, view: memoryview, fds: list[int]) -> None:
        """Fill ``view``, collecting descriptors from every read (a message's descriptors
        may arrive in several chunks)."""
        got = 0
        space = socket.CMSG_SPACE(_MAX_FDS * _FD_BYTES)
        while got < view.nbytes:
            try:
                n, ancdata, flags, _ = self.sock.recvmsg_into([view[got:]], space,
                                                              _CLOEXEC_FLAG)
            except ConnectionResetError as exc:  # the peer died with data unread
                raise ChannelClosed(f"peer reset the channel mid-message: {exc}") from exc
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(data) - len(data) % _FD_BYTES
                    for fd in struct.unpack(f"{usable // _FD_BYTES}i", data[:usable]):
                        os.set_inheritable(fd, False)  # where MSG_CMSG_CLOEXEC is missing
                        fds.append(fd)
            if flags & getattr(socket, "MSG_CTRUNC", 0):
                raise TransportError("descriptors were truncated in transit")
            if n == 0:
                raise ChannelClosed("peer closed the channel" if got == 0
                                    else "peer closed the channel mid-message")
            got += n

    def recv(self):
        fds: list[int] = []
        try:
            prefix = bytearray(_PREFIX.size)
            self._recv_exact(memoryview(prefix), fds)
            header_len, nframes, nfds = _PREFIX.unpack(prefix)
            rest = bytearray(8 * nframes + header_len)
            self._recv_exact(memoryview(rest), fds)
            lengths = struct.unpack_from(f"<{nframes}Q", rest)
            header = self._header(memoryview(rest)[8 * nframes:])
            frames = []
            for length in lengths:
                frame = bytearray(length)
                self._recv_exact(memoryview(frame), fds)
                frames.append(frame)
            if len(fds) != nfds:
                raise TransportError(f"expected {nfds} descriptors, received {len(fds)}")
        except BaseException:
            for fd in fds:
                _close_fd(fd)
            raise
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
        Channel.__init__(self)
        self.reader, self.writer = state["reader"], state["writer"]

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
            _, nframes, _ = _PREFIX.unpack_from(meta)
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
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> tuple[Channel, Channel]:
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
    raise ZephonConfigError(f"unknown transport {transport!r}; expected 'socketpair' or 'pipe'",
                            field="transport")
