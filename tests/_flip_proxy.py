"""A bit-flipping HTTP proxy on 127.0.0.1 for the streamed-read integrity tests.

:class:`BitFlipProxy` forwards TCP connections to an upstream HTTP server (moto) and
parses the responses as HTTP/1.1 (status line, headers, a ``Content-Length`` body; 1xx
answers and HEAD replies carry no body) so that it knows which request each response
answers. ``flip(key, times, skip)`` makes it invert *one bit* (0x10) of the middle
byte of the body of ``times`` GET responses for ``key`` after ``skip`` untouched ones;
the length and headers are never changed, so only a check of the bytes can notice.
``gets(key)`` counts the GETs of ``key`` and ``flipped`` the bodies altered.
``alter_etag(key, method, times, skip)`` changes one hex digit of the ``ETag`` header
of chosen responses instead (the body intact; ``etags_altered`` counts them).

Threads in the test process, closed by :meth:`BitFlipProxy.close` (the fixture's
finalizer): the listening socket first, then every connection.
"""

from __future__ import annotations

import collections
import re

from _s3_server import TcpProxy, _close

_REQUEST = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) (/[^ ?]*)[^ ]* HTTP/1\.[01]\r\n")
BIT = 0x10


class BitFlipProxy(TcpProxy):
    def __init__(self, upstream_port: int) -> None:
        self.rules: dict[str, list[int]] = {}  # key -> [times left, skips left]
        self.etag_rules: dict[tuple[str, str], list[int]] = {}  # (method, key) -> same
        self.flipped = 0
        self.etags_altered = 0
        super().__init__(upstream_port)

    def _new_state(self) -> collections.deque:
        return collections.deque()  # (method, action) per request, in order

    # -- rules ---------------------------------------------------------------------------
    def flip(self, key: str, times: int = 1, skip: int = 0) -> None:
        """Flip one bit in the bodies of the next ``times`` GET responses for ``key``
        (after ``skip`` untouched ones)."""
        with self.lock:
            self.rules[key] = [times, skip]

    def alter_etag(self, key: str, method: str = "GET", times: int = 1, skip: int = 0) -> None:
        """Change one hex digit of the ``ETag`` header of the next ``times`` ``method``
        responses for ``key`` (after ``skip`` untouched ones); the body is left as is."""
        with self.lock:
            self.etag_rules[(method, key)] = [times, skip]

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
            self.etag_rules.clear()

    def gets(self, key: str) -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m == "GET" and p.endswith("/" + key))

    def _action(self, method: str, path: str) -> str:
        """What to do to the response: '' (nothing), 'flip' or 'etag'."""
        with self.lock:
            for (how, key), rule in self.etag_rules.items():
                if how == method and path.endswith("/" + key) and _take(rule):
                    self.requests.append((method, path))
                    return "etag"
        return "flip" if self._should_flip(method, path) else ""

    def _should_flip(self, method: str, path: str) -> bool:
        with self.lock:
            self.requests.append((method, path))
            if method != "GET":
                return False
            for key, rule in self.rules.items():
                if path.endswith("/" + key):
                    return _take(rule)
            return False

    # -- plumbing: TcpProxy's, and the two directions -------------------------------------
    def _up(self, client, upstream, pending) -> None:
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                for match in _REQUEST.finditer(data):
                    method, path = match.group(1).decode(), match.group(2).decode()
                    pending.append((method, self._action(method, path)))
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def _down(self, upstream, client, pending) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = upstream.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                head += b"\r\n\r\n"
                status = int(head.split(b" ", 2)[1])
                if 100 <= status < 200:  # an interim answer: the real one follows
                    client.sendall(head)
                    continue
                method, action = pending.popleft() if pending else ("GET", "")
                length = 0 if method == "HEAD" or status in (204, 304) else _length(head)
                if length is None:  # not framed by a length: pass the rest through as is
                    client.sendall(head + buf)
                    _pipe(upstream, client)
                    return
                while len(buf) < length:
                    data = upstream.recv(65536)
                    if not data:
                        client.sendall(head + buf)
                        return
                    buf += data
                body, buf = bytearray(buf[:length]), buf[length:]
                if action == "etag":
                    head = _alter_etag(head)
                    with self.lock:
                        self.etags_altered += 1
                if action == "flip" and body:
                    body[len(body) // 2] ^= BIT
                    with self.lock:
                        self.flipped += 1
                client.sendall(head + bytes(body))
        except OSError:
            pass
        finally:
            _close(client, upstream)


def _take(rule: list[int]) -> bool:
    """Count one response against ``[times left, skips left]``: True when it is altered."""
    if rule[1] > 0:
        rule[1] -= 1
        return False
    if rule[0] > 0:
        rule[0] -= 1
        return True
    return False


def _alter_etag(head: bytes) -> bytes:
    """``head`` with the first hex digit of its ETag value changed (same length)."""
    lines = head.split(b"\r\n")
    for n, line in enumerate(lines):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"etag":
            at = value.index(b'"') + 1
            digit = b"1" if value[at:at + 1] == b"0" else b"0"
            lines[n] = name + b":" + value[:at] + digit + value[at + 1:]
    return b"\r\n".join(lines)


def _length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
        if name.strip().lower() == b"transfer-encoding":
            return None
    return None


def _pipe(src, dst) -> None:
    while True:
        data = src.recv(65536)
        if not data:
            return
        dst.sendall(data)
