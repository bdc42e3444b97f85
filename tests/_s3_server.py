"""A real S3-compatible server for the source tests, and a fault-injecting proxy.

:class:`MotoServer` runs ``python -m moto.server`` as a subprocess on 127.0.0.1
(stopped by the fixture's finalizer). :class:`FaultProxy` is a TCP proxy (threads
in the test process) between the S3 client and that server: it records every
request line and, per object key, can cut the next responses after N bytes,
hold them for a while, flip a byte of their body, or answer them itself with an
S3 error, which is how the tests drop connections mid-object, make downloads time
out, alter data in flight and make a store fail for a while.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

BUCKET = "zephon-test"
_REQUEST = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) (/[^ ?]*)[^ ]* HTTP/1\.[01]\r\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    def __init__(self) -> None:
        self.port = free_port()
        env = dict(os.environ, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto server did not start")
                time.sleep(0.1)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                   aws_access_key_id="test", aws_secret_access_key="test")
        self.client.create_bucket(Bucket=BUCKET)

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=data)
        return f"s3://{BUCKET}/{key}"

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=BUCKET, Key=key)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def storage_options(endpoint: str) -> dict:
    return {"key": "test", "secret": "test",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


class TcpProxy:
    """``127.0.0.1:port`` -> the server, one pair of threads per connection: ``_up``
    (client to server) and ``_down`` (server to client), which subclasses write, sharing
    the state :meth:`_new_state` makes for the connection. ``requests``: every
    (method, path) a subclass records. :meth:`close` closes the listening socket, then
    every connection."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.closed = False
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _new_state(self) -> Any:
        return {}

    def _up(self, client, upstream, state) -> None:
        raise NotImplementedError

    def _down(self, upstream, client, state) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            state = self._new_state()
            threading.Thread(target=self._up, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, state),
                             daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        with self.lock:
            for conn in self.conns:
                _close(conn)


class FaultProxy(TcpProxy):
    """A :class:`TcpProxy` that hurts chosen responses. ``cut(key, after, times)``: the
    next ``times`` responses to a GET of ``key`` are cut after ``after`` bytes;
    ``stall(key, s, times)``: held ``s`` seconds before the first byte."""

    def __init__(self, upstream_port: int) -> None:
        self.rules: dict[str, list] = {}
        super().__init__(upstream_port)

    def _new_state(self) -> Any:
        return {"rule": None}

    def cut(self, key: str, after: int, times: int = 1, skip: int = 0) -> None:
        with self.lock:
            self.rules[key] = ["cut", after, times, skip]

    def stall(self, key: str, seconds: float, times: int = 1, skip: int = 0) -> None:
        with self.lock:
            self.rules[key] = ["stall", seconds, times, skip]

    def flip(self, key: str, times: int = 1, skip: int = 0) -> None:
        """The next ``times`` responses to a GET of ``key`` have the first byte of their
        body inverted (the length and headers unchanged)."""
        with self.lock:
            self.rules[key] = ["flip", 0, times, skip]

    def fail(self, key: str, status: int, code: str, times: int = 1) -> None:
        """The next ``times`` GETs of ``key`` are answered by the proxy with ``status``
        and the S3 error ``code`` (never reaching the server)."""
        with self.lock:
            self.rules[key] = ["fail", (status, code), times, 0]

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def gets(self, key: str) -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m == "GET" and p.endswith("/" + key))

    def _up(self, client, upstream, state) -> None:
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                rule = None
                for match in _REQUEST.finditer(data):
                    method, path = match.group(1).decode(), match.group(2).decode()
                    with self.lock:
                        self.requests.append((method, path))
                        state["rule"] = None
                        for key, rule in self.rules.items():
                            if method != "GET" or not path.endswith("/" + key):
                                continue
                            if rule[3] > 0:
                                rule[3] -= 1
                            elif rule[2] > 0:
                                rule[2] -= 1
                                state["rule"], state["sent"] = [rule[0], rule[1]], 0
                    rule = state["rule"]
                if rule and rule[0] == "fail":
                    state["rule"] = None
                    client.sendall(_error_response(*rule[1]))
                    continue
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def _down(self, upstream, client, state) -> None:
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                rule = state["rule"]
                if rule and rule[0] == "stall":
                    state["rule"] = None
                    time.sleep(rule[1])
                elif rule and rule[0] in ("flip", "flip-body"):
                    at = 0 if rule[0] == "flip-body" else data.find(b"\r\n\r\n") + 4
                    if 4 <= at < len(data) or (rule[0] == "flip-body" and data):
                        state["rule"] = None
                        body = bytearray(data)
                        body[at] ^= 0xFF
                        data = bytes(body)
                    elif at >= 4:  # the headers end this chunk: the body starts the next
                        state["rule"] = ["flip-body", 0]
                elif rule and rule[0] == "cut":
                    room = rule[1] - state["sent"]
                    if len(data) >= room:
                        client.sendall(data[:max(room, 0)])
                        break
                    state["sent"] += len(data)
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client, upstream)


def _error_response(status: int, code: str) -> bytes:
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>injected by the test proxy</Message></Error>").encode()
    return (f"HTTP/1.1 {status} Injected\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _close(*socks) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            s.close()
        except OSError:
            pass


# Fixtures shared by the test modules that import them (``from _s3_server import s3, proxy``).
@pytest.fixture(scope="module")
def s3():
    """A moto S3 server for one test module, stopped at its end."""
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def proxy(s3):
    """A :class:`FaultProxy` in front of the module's server, closed after the test."""
    p = FaultProxy(s3.port)
    yield p
    p.close()
