"""Remote reads pinned and verified, and a cache that trusts nothing, against a real
S3-compatible server (moto) on 127.0.0.1.

Faults come from the TCP proxy of ``_s3_server`` (a byte of a response body inverted,
an S3 error answered in the server's place), from overwriting an object while a run
reads it, from altering or forging files of the cache directory, from a 1 MiB tmpfs
in a private mount namespace, and from real concurrent processes sharing a tiny cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from _s3_server import proxy, s3, storage_options  # noqa: E402, F401 (fixtures)

from zephon import OpError, Pipeline, RuntimeOptions, StoreOptions, sources  # noqa: E402
from zephon.io import FileCache, IoConfig, SourceError  # noqa: E402
from zephon.io.remote import expand  # noqa: E402

FAST = dict(retry_backoff_initial_s=0.01, retry_backoff_max_s=0.05)
NOBODY = 65534


def tokens(n: int, salt: int = 0) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7919 + salt) % 100_003).astype(np.uint32)


def opts(root, **kw) -> RuntimeOptions:
    return RuntimeOptions(io_options=StoreOptions(**{**FAST, "cache_root": str(root), **kw}))


def all_tokens(src, runtime: RuntimeOptions) -> np.ndarray:
    return np.concatenate([s["tokens"] for s in Pipeline(src, shuffle=False).options(runtime)])


def cache_files(root) -> list[str]:
    return sorted(f for _, _, fs in os.walk(root) for f in fs if not f.endswith(".lock"))


# -- 1. integrity and versions ------------------------------------------------------------------
def test_a_download_altered_in_flight_is_never_served_nor_cached(s3, proxy, tmp_path):
    # 9 MiB: two ranged requests of at most 8 MiB, which carry no checksum of their own
    data = tokens(9 << 18)
    url = s3.put("flip/a.bin", data.tobytes())
    src = sources.token_windows(url, 1 << 16, "uint32",
                                storage_options=storage_options(proxy.endpoint))
    proxy.flip("flip/a.bin", times=1000)  # every response altered
    with pytest.raises(OpError, match=r"flip/a\.bin.*MD5 of the bytes received"):
        all_tokens(src, opts(tmp_path / "c", cache_enabled=True, download_retry=1))
    assert not [f for f in cache_files(tmp_path / "c") if f.endswith("a.bin")]
    proxy.clear()
    before = proxy.gets("flip/a.bin")
    # the proxy is honest again: the next run reads the right bytes, from the store
    assert np.array_equal(all_tokens(src, opts(tmp_path / "c", cache_enabled=True)), data)
    assert proxy.gets("flip/a.bin") > before
    proxy.flip("flip/a.bin", times=1, skip=1)  # one download altered, then a good one
    got = all_tokens(src, opts(tmp_path / "d", cache_enabled=True, download_retry=2))
    assert np.array_equal(got, data)


def test_a_cached_copy_altered_on_disk_is_fetched_again(s3, proxy, tmp_path):
    data = tokens(4096, salt=1)
    url = s3.put("rot/a.bin", data.tobytes())
    src = sources.token_windows(url, 256, "uint32",
                                storage_options=storage_options(proxy.endpoint))
    runtime = opts(tmp_path / "c", cache_enabled=True)
    assert np.array_equal(all_tokens(src, runtime), data)
    entry = FileCache(IoConfig.from_store_options(runtime.io_options)).entry_path(src.refs[0])
    st = os.stat(entry)
    with open(entry, "r+b") as fh:  # same size, one byte changed, mtime put back
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(entry, ns=(st.st_atime_ns, st.st_mtime_ns))
    before = proxy.gets("rot/a.bin")
    assert np.array_equal(all_tokens(src, runtime), data)
    assert proxy.gets("rot/a.bin") > before  # removed and downloaded again
    with open(entry, "rb") as fh:
        assert fh.read() == data.tobytes()
    before = proxy.gets("rot/a.bin")
    assert np.array_equal(all_tokens(src, runtime), data)  # and now served from the cache
    assert proxy.gets("rot/a.bin") == before


@pytest.mark.parametrize("cache", [False, True])
def test_an_object_replaced_mid_epoch_is_an_error_naming_it(s3, tmp_path, cache):
    key = f"replaced/{cache}.bin"
    url = s3.put(key, tokens(4096).tobytes())
    src = sources.token_windows(url, 64, "uint32", storage_options=storage_options(s3.endpoint))
    runtime = opts(tmp_path / "c", cache_enabled=cache, download_retry=2)
    if cache:  # replaced after the source was built, before it is downloaded
        s3.put(key, tokens(4096, salt=5).tobytes())  # same size, other bytes
    it = iter(Pipeline(src, shuffle=False, chunk_size=2).options(runtime))
    if not cache:  # streamed: one request per window, the object changes between two
        first = next(it)
        assert np.array_equal(first["tokens"], tokens(4096)[:64])
        s3.put(key, tokens(4096, salt=5).tobytes())
    with pytest.raises(OpError, match=rf"{key}.*changed since the source was built"):
        list(it)
    it.close()
    assert not [f for f in cache_files(tmp_path / "c") if f.endswith(f"{cache}.bin")]
    fresh = sources.token_windows(url, 64, "uint32",
                                  storage_options=storage_options(s3.endpoint))
    assert np.array_equal(all_tokens(fresh, runtime), tokens(4096, salt=5))


class _Objects(BaseHTTPRequestHandler):
    """A plain HTTP object server: HEAD and ranged GET, a strong ETag, If-Match (412)."""

    objects: dict[str, bytes] = {}

    def _etag(self, data: bytes) -> str:
        return '"' + hashlib.sha1(data).hexdigest() + '"'

    def _head(self, status: int, data: bytes, length: int, extra: dict) -> None:
        self.send_response(status)
        self.send_header("ETag", self._etag(data))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(length))
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()

    def do_HEAD(self):  # noqa: N802 - the http.server protocol
        data = self.objects.get(self.path)
        if data is None:
            self.send_error(404)
            return
        self._head(200, data, len(data), {})

    def do_GET(self):  # noqa: N802 - the http.server protocol
        data = self.objects.get(self.path)
        if data is None:
            self.send_error(404)
            return
        wanted = self.headers.get("If-Match")
        if wanted is not None and wanted != self._etag(data):
            self.send_error(412)
            return
        start, end = 0, len(data) - 1
        ranged = self.headers.get("Range", "").startswith("bytes=")
        if ranged:
            lo, hi = self.headers["Range"][6:].split("-")
            start, end = int(lo), min(int(hi) if hi else len(data) - 1, len(data) - 1)
        body = data[start:end + 1]
        extra = {"Content-Range": f"bytes {start}-{end}/{len(data)}"} if ranged else {}
        self._head(206 if ranged else 200, data, len(body), extra)
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_store():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Objects)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Objects.objects
    server.shutdown()
    server.server_close()
    thread.join(10)
    _Objects.objects.clear()


@pytest.mark.parametrize("cache", [False, True])
def test_an_http_object_replaced_mid_epoch_is_an_error_naming_it(http_store, tmp_path, cache):
    pytest.importorskip("aiohttp")
    base, objects = http_store
    objects["/a.bin"] = tokens(4096).tobytes()
    src = sources.token_windows(f"{base}/a.bin", 64, "uint32")
    assert src.refs[0].version.startswith("etag:")
    runtime = opts(tmp_path / "c", cache_enabled=cache, download_retry=2)
    if cache:
        objects["/a.bin"] = tokens(4096, salt=9).tobytes()
    it = iter(Pipeline(src, shuffle=False, chunk_size=2).options(runtime))
    if not cache:
        assert np.array_equal(next(it)["tokens"], tokens(4096)[:64])
        objects["/a.bin"] = tokens(4096, salt=9).tobytes()
    with pytest.raises(OpError, match=r"a\.bin.*changed since the source was built"):
        list(it)
    it.close()
    assert not [f for f in cache_files(tmp_path / "c") if f.endswith("a.bin")]


def test_the_cache_key_is_the_version(s3, tmp_path):
    url = s3.put("keyed/a.bin", b"1" * 1000)
    so = storage_options(s3.endpoint)
    cfg = IoConfig(cache_enabled=True, cache_root=str(tmp_path / "c"))
    (old,) = expand(url, "test", cfg, so)
    s3.put("keyed/a.bin", b"2" * 1000)
    (new,) = expand(url, "test", cfg, so)
    assert old.version != new.version and old.size == new.size
    cache = FileCache(cfg, so)
    assert cache.entry_path(old) != cache.entry_path(new)
    with open(cache.fetch(new), "rb") as fh:
        assert fh.read() == b"2" * 1000


# -- 5. what is retried ---------------------------------------------------------------------------
def test_a_throttling_store_is_retried_and_a_refusal_is_not(s3, proxy, tmp_path):
    url = s3.put("throttle/a.bin", b"t" * 5000)
    so = storage_options(proxy.endpoint)
    cfg = IoConfig(cache_enabled=True, cache_root=str(tmp_path / "c"), download_retry=3, **FAST)
    (ref,) = expand(url, "test", cfg, so)
    proxy.fail("throttle/a.bin", 503, "SlowDown", times=2)
    before = proxy.gets("throttle/a.bin")
    with open(FileCache(cfg, so).fetch(ref), "rb") as fh:
        assert fh.read() == b"t" * 5000
    assert proxy.gets("throttle/a.bin") - before == 3  # two refused, the third served
    proxy.fail("throttle/a.bin", 403, "AccessDenied", times=5)
    cfg = IoConfig(cache_enabled=True, cache_root=str(tmp_path / "d"), download_retry=3, **FAST)
    before = proxy.gets("throttle/a.bin")
    with pytest.raises(SourceError, match=r"throttle/a\.bin.*PermissionError"):
        FileCache(cfg, so).fetch(ref)
    assert proxy.gets("throttle/a.bin") - before == 1  # deterministic: one attempt
    proxy.clear()


# -- 2. a cache that trusts nothing -------------------------------------------------------------
def _source(s3, key: str, n: int = 1024, salt: int = 3):
    data = tokens(n, salt)
    url = s3.put(key, data.tobytes())
    return sources.token_windows(url, 128, "uint32",
                                 storage_options=storage_options(s3.endpoint)), data


def test_a_symlinked_cache_root_is_refused(s3, tmp_path):
    src, _ = _source(s3, "trust/link.bin")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(OpError, match=r"cache directory .*link is a symbolic link"):
        all_tokens(src, opts(tmp_path / "link", cache_enabled=True))
    assert os.listdir(real) == []


def test_a_cache_directory_of_another_user_or_open_to_others_is_refused(s3, tmp_path):
    src, data = _source(s3, "trust/dir.bin")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(OpError, match=r"theirs is owned by uid 65534"):
        all_tokens(src, opts(theirs, cache_enabled=True))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(OpError, match=r"shared is writable by group or others"):
        all_tokens(src, opts(shared, cache_enabled=True))
    assert os.listdir(theirs) == [] and os.listdir(shared) == []
    assert np.array_equal(all_tokens(src, opts(tmp_path / "mine", cache_enabled=True)), data)
    assert stat.S_IMODE(os.stat(tmp_path / "mine").st_mode) == 0o700


def test_a_forged_entry_is_not_served(s3, tmp_path):
    src, data = _source(s3, "trust/forged.bin")
    runtime = opts(tmp_path / "c", cache_enabled=True)
    assert np.array_equal(all_tokens(src, runtime), data)
    entry = FileCache(IoConfig.from_store_options(runtime.io_options)).entry_path(src.refs[0])
    forged = np.zeros_like(data).tobytes()
    for make in ("foreign", "symlink"):
        os.unlink(entry)
        if make == "foreign":  # same size, another owner, writable by all
            with open(entry, "wb") as fh:
                fh.write(forged)
            os.chown(entry, NOBODY, NOBODY)
            os.chmod(entry, 0o666)
        else:
            victim = tmp_path / "victim.bin"
            victim.write_bytes(forged)
            os.symlink(victim, entry)
        assert np.array_equal(all_tokens(src, runtime), data)
        st = os.lstat(entry)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    assert (tmp_path / "victim.bin").read_bytes() == forged  # never written through


def test_temp_files_of_dead_writers_are_removed(s3, tmp_path):
    src, data = _source(s3, "trust/parts-a.bin")
    other, _ = _source(s3, "trust/parts-b.bin")
    root = tmp_path / "c"
    runtime = opts(root, cache_enabled=True)  # unbounded: no eviction, the pass still runs
    assert np.array_equal(all_tokens(src, runtime), data)
    entry = FileCache(IoConfig.from_store_options(runtime.io_options)).entry_path(other.refs[0])
    os.makedirs(os.path.dirname(entry), mode=0o700, exist_ok=True)
    dead = f"{entry}.part-999999-deadbeef"  # a writer killed mid-download
    with open(dead, "wb") as fh:
        fh.write(b"x" * 100)
    fresh, _ = _source(s3, "trust/parts-c.bin")
    all_tokens(fresh, runtime)  # an insertion: the eviction pass clears leftovers
    assert not os.path.exists(dead)


# -- 2. eviction never removes a file a reader holds -------------------------------------------
_READERS = textwrap.dedent("""
    import sys
    from zephon.io import FileReader, FileRef, IoConfig
    root, endpoint, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    refs = [FileRef(u, int(n), v) for u, n, v in (a.split("|") for a in sys.argv[4:])]
    so = {"key": "test", "secret": "test",
          "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    cfg = IoConfig(cache_enabled=True, cache_root=root, cache_limit_bytes=150_000,
                   download_retry=2, retry_backoff_initial_s=0.01, retry_backoff_max_s=0.05)
    for r in range(rounds):  # all five open at once: more than the limit holds
        readers = [FileReader(ref, cfg, so) for ref in refs]
        paths = [reader.local_path() for reader in readers]
        for k, (reader, path) in enumerate(zip(readers, paths)):
            want = bytes([k + 1]) * reader.ref.size
            assert reader.pread(0, reader.ref.size) == want
            with open(path, "rb") as fh:  # by name, later: what memmap and pyarrow do
                assert fh.read() == want, path
        for reader in readers:
            reader.close()
    print("ok", flush=True)
""")


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_eviction_spares_the_files_readers_hold(s3, tmp_path, children):
    so = storage_options(s3.endpoint)
    cfg = IoConfig(cache_enabled=True)
    args = []
    for k in range(5):
        url = s3.put(f"lease/{k}.bin", bytes([k + 1]) * 60_000)
        (ref,) = expand(url, "test", cfg, so)
        args.append(f"{ref.url}|{ref.size}|{ref.version}")
    root = tmp_path / "cache"
    for _ in range(4):
        children.append(subprocess.Popen(
            [sys.executable, "-c", _READERS, str(root), s3.endpoint, "3", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in children:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0 and out.strip() == "ok", err[-2000:]
    cache = FileCache(IoConfig(cache_enabled=True, cache_root=str(root),
                               cache_limit_bytes=150_000))
    cache.evict()  # the readers are gone: nothing is leased any more
    assert cache.total_bytes() <= 150_000


# -- 4. a full disk ------------------------------------------------------------------------------
_FULL = textwrap.dedent("""
    import os, subprocess, sys
    from zephon.io import FileCache, FileRef, IoConfig, SourceError
    mnt, endpoint, url, size, version = sys.argv[1:6]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], check=True)
    so = {"key": "test", "secret": "test",
          "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    cfg = IoConfig(cache_enabled=True, cache_root=os.path.join(mnt, "cache"), download_retry=0)
    try:
        FileCache(cfg, so).fetch(FileRef(url, int(size), version))
        print("no error")
    except SourceError as exc:
        left = [f for _, _, fs in os.walk(mnt) for f in fs if ".part-" in f]
        print("SourceError", left, exc)
    except BaseException as exc:
        print("other", type(exc).__name__, exc)
""")


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --mount is not permitted here: {probe.stderr.strip()}"
    return None


def test_a_full_disk_is_a_source_error_that_says_what_to_do(s3, tmp_path):
    reason = _can_unshare()
    if reason:
        pytest.skip(reason)
    url = s3.put("full/big.bin", os.urandom(3 << 20))  # 3 MiB into a 1 MiB tmpfs
    (ref,) = expand(url, "test", IoConfig(), storage_options(s3.endpoint))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable,
                          "-c", _FULL, str(mnt), s3.endpoint, url, str(ref.size), ref.version],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip()
    assert line.startswith("SourceError [] cannot cache s3://"), line
    assert "No space left on device" in line and str(mnt) in line
    assert "cache_limit_bytes" in line and "cache_enabled=False" in line
