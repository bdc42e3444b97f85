"""Remote sources against a real S3-compatible server (moto) on 127.0.0.1.

Every ``StoreOptions`` field that governs remote reads has a test here that fails
if the field is ignored: cache_enabled, cache_root, cache_limit_bytes,
download_retry, download_timeout_s, retry_backoff_initial_s/retry_backoff_max_s.
Faults are injected by a TCP proxy between the client and the server (a
connection cut mid-object, a response held back) or by deleting objects.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from _s3_server import BUCKET, proxy, s3, storage_options  # noqa: E402, F401 (fixtures)

from zephon import OpError, Pipeline, RuntimeOptions, StoreOptions, sources  # noqa: E402
from zephon.io import FileCache, FileRef, IoConfig, SourceError  # noqa: E402

FAST = dict(retry_backoff_initial_s=0.01, retry_backoff_max_s=0.05)


def store(tmp_path, **kw) -> StoreOptions:
    kw.setdefault("cache_root", str(tmp_path / "cache"))
    return StoreOptions(**{**FAST, **kw})


def tokens_in(pipe) -> np.ndarray:
    """All tokens of one fresh run of ``pipe`` (a definition: each call starts over)."""
    return np.concatenate([s["tokens"] for s in pipe.options(pipe.runtime)])


def put_tokens(s3, key: str, n: int, dtype="uint32") -> tuple[str, np.ndarray]:
    data = (np.arange(n, dtype=np.int64) * 7919 % 100_003).astype(dtype)
    return s3.put(key, data.tobytes()), data


# -- the cache ----------------------------------------------------------------------------------
def test_cache_enabled_serves_later_epochs_without_the_server(s3, proxy, tmp_path):
    url, data = put_tokens(s3, "cached/a.bin", 4096)
    so = storage_options(proxy.endpoint)
    src = sources.token_windows(url, 256, "uint32", storage_options=so)
    on = RuntimeOptions(io_options=store(tmp_path, cache_enabled=True))
    pipe = Pipeline(src, shuffle=False).options(on)
    assert np.array_equal(tokens_in(pipe), data)
    fetched = proxy.gets("cached/a.bin")
    assert fetched >= 1
    s3.delete("cached/a.bin")  # gone from the store: the cached copy still serves
    assert np.array_equal(tokens_in(pipe), data)
    assert proxy.gets("cached/a.bin") == fetched

    url, data = put_tokens(s3, "cached/b.bin", 4096)
    src = sources.token_windows(url, 256, "uint32", storage_options=so)
    off = Pipeline(src, shuffle=False).options(
        RuntimeOptions(io_options=store(tmp_path, cache_enabled=False, download_retry=1)))
    assert np.array_equal(tokens_in(off), data)
    first = proxy.gets("cached/b.bin")
    assert first >= 16  # one ranged read per window
    assert np.array_equal(tokens_in(off), data)
    assert proxy.gets("cached/b.bin") >= 2 * first - 1  # and again: nothing was kept
    assert not any("b.bin" in f for _, _, fs in os.walk(tmp_path / "cache") for f in fs)
    s3.delete("cached/b.bin")
    with pytest.raises(OpError, match="s3://zephon-test/cached/b.bin"):
        tokens_in(off)


def test_cache_root_is_where_files_go(s3, tmp_path, monkeypatch):
    url, data = put_tokens(s3, "root/a.bin", 1024)
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "default"))
    src = sources.token_windows(url, 128, "uint32", storage_options=storage_options(s3.endpoint))
    for root in (tmp_path / "one", None):
        io = StoreOptions(cache_enabled=True, cache_root=None if root is None else str(root))
        got = tokens_in(Pipeline(src, shuffle=False).options(RuntimeOptions(io_options=io)))
        assert np.array_equal(got, data)
    cached = lambda d: [f for _, _, fs in os.walk(d) for f in fs if f.endswith("a.bin")]  # noqa: E731
    assert len(cached(tmp_path / "one")) == 1
    assert len(cached(tmp_path / "default")) == 1  # cache_root=None: $ZEPHON_CACHE_DIR


def test_cache_limit_bytes_evicts_the_least_recently_used(s3, tmp_path):
    so = storage_options(s3.endpoint)
    refs = {}
    for name in "abc":
        url = s3.put(f"lru/{name}.bin", bytes([ord(name)]) * 10_000)
        refs[name] = FileRef(url, 10_000)
    cfg = IoConfig.from_store_options(store(tmp_path, cache_enabled=True,
                                            cache_limit_bytes=25_000))
    cache = FileCache(cfg, so)
    for name in "abc":
        cache.fetch(refs[name])
        time.sleep(0.02)  # distinct LRU stamps
    assert not os.path.exists(cache.entry_path(refs["a"]))  # a was the oldest
    cache.fetch(refs["b"])  # a hit: b is now the most recent
    time.sleep(0.02)
    with open(cache.fetch(refs["a"]), "rb") as fh:  # a again: c (not b) must go
        assert fh.read() == b"a" * 10_000
    present = {n for n in "abc" if os.path.exists(cache.entry_path(refs[n]))}
    assert present == {"a", "b"} and cache.total_bytes() <= 25_000

    unbounded = FileCache(IoConfig.from_store_options(store(tmp_path / "u", cache_enabled=True)),
                          so)
    for name in "abc":
        unbounded.fetch(refs[name])
    assert unbounded.total_bytes() == 30_000


# -- retries, back-off, timeouts ----------------------------------------------------------------
def _reappear(s3, key: str, data: bytes, after: float) -> threading.Timer:
    timer = threading.Timer(after, lambda: s3.put(key, data))
    timer.start()
    return timer


def test_download_retry_outlasts_an_object_that_comes_back(s3, tmp_path):
    url, data = put_tokens(s3, "retry/a.bin", 1024)
    src = sources.token_windows(url, 128, "uint32", storage_options=storage_options(s3.endpoint))
    s3.delete("retry/a.bin")
    once = Pipeline(src, shuffle=False).options(RuntimeOptions(io_options=store(
        tmp_path, cache_enabled=True, download_retry=0)))
    with pytest.raises(OpError, match=r"cannot read s3://zephon-test/retry/a\.bin.*after 0 "
                                      r"retries"):
        list(once)
    timer = _reappear(s3, "retry/a.bin", data.tobytes(), 0.6)
    patient = Pipeline(src, shuffle=False).options(RuntimeOptions(io_options=store(
        tmp_path, cache_enabled=True, download_retry=20, retry_backoff_initial_s=0.1,
        retry_backoff_max_s=0.2)))
    try:
        assert np.array_equal(tokens_in(patient), data)
    finally:
        timer.join()


def test_throttled_reads_are_retried_download_retry_times(s3, proxy, tmp_path):
    """Throttled requests (a transient 503) are retried up to ``download_retry`` times:
    two refusals are outlasted by two retries, endless refusals are an error naming the
    object; the attempts are counted where they arrive (no clock involved)."""
    url, data = put_tokens(s3, "backoff/a.bin", 1024)
    src = sources.token_windows(url, 128, "uint32",
                                storage_options=storage_options(proxy.endpoint))
    for refused, retries, succeeds in ((50, 2, False), (2, 2, True)):
        proxy.fail("backoff/a.bin", 503, "SlowDown", times=refused)
        io = StoreOptions(cache_enabled=True, cache_root=str(tmp_path / f"c{refused}"),
                          download_retry=retries, retry_backoff_initial_s=0.3,
                          retry_backoff_max_s=0.3)
        pipe = Pipeline(src, shuffle=False).options(RuntimeOptions(io_options=io))
        before = proxy.gets("backoff/a.bin")
        try:
            if succeeds:
                assert np.array_equal(tokens_in(pipe), data)
            else:
                with pytest.raises(OpError, match="backoff/a.bin"):
                    tokens_in(pipe)
        finally:
            proxy.clear()
        attempts = proxy.gets("backoff/a.bin") - before
        assert attempts >= retries + 1  # every attempt reached the server


def test_download_timeout_abandons_a_stalled_attempt(s3, proxy, tmp_path):
    url, data = put_tokens(s3, "timeout/a.bin", 2048)
    src = sources.token_windows(url, 256, "uint32",
                                storage_options=storage_options(proxy.endpoint))
    proxy.stall("timeout/a.bin", 3.0, times=5)
    impatient = Pipeline(src, shuffle=False).options(RuntimeOptions(io_options=store(
        tmp_path, cache_enabled=True, download_retry=0, download_timeout_s=0.5)))
    with pytest.raises(OpError, match=r"timeout/a\.bin.*download_timeout_s=0\.5"):
        list(impatient)
    proxy.stall("timeout/a.bin", 3.0, times=1)
    retried = Pipeline(src, shuffle=False).options(RuntimeOptions(io_options=store(
        tmp_path, cache_enabled=True, download_retry=2, download_timeout_s=0.5)))
    before = proxy.gets("timeout/a.bin")
    assert np.array_equal(tokens_in(retried), data)  # the stalled attempt was given up
    assert proxy.gets("timeout/a.bin") - before == 2


def test_a_connection_dropped_mid_object_is_retried_to_the_right_bytes(s3, proxy, tmp_path):
    payload = np.random.default_rng(0).integers(0, 2**32, 750_000, dtype=np.uint32)
    url = s3.put("drop/a.bin", payload.tobytes())  # 3 MB
    src = sources.token_windows(url, 50_000, "uint32",
                                storage_options=storage_options(proxy.endpoint))
    proxy.cut("drop/a.bin", after=200_000, times=2)
    pipe = Pipeline(src, shuffle=False).options(RuntimeOptions(io_options=store(
        tmp_path, cache_enabled=True, download_retry=3)))
    before = proxy.gets("drop/a.bin")
    assert np.array_equal(tokens_in(pipe), payload)
    assert proxy.gets("drop/a.bin") - before == 3  # two cut, the third complete
    proxy.cut("drop/a.bin", after=200_000, times=5)
    fresh = Pipeline(src, shuffle=False).options(RuntimeOptions(io_options=store(
        tmp_path / "other", cache_enabled=True, download_retry=0)))
    with pytest.raises(OpError, match=r"drop/a\.bin"):
        list(fresh)


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_an_object_that_disappears_is_named_after_the_retries(s3, tmp_path, runner):
    url, _ = put_tokens(s3, f"gone/{runner}.bin", 1024)
    src = sources.token_windows(url, 128, "uint32", storage_options=storage_options(s3.endpoint))
    s3.delete(f"gone/{runner}.bin")
    pipe = Pipeline(src, shuffle=False).options(RuntimeOptions(
        runner=runner, max_workers=2, io_options=store(tmp_path, cache_enabled=True,
                                                       download_retry=2)))
    with pytest.raises(OpError, match=rf"SourceError: cannot read s3://zephon-test/gone/"
                                      rf"{runner}\.bin.*after 2 retries") as info:
        list(pipe)
    assert info.value.sample_id[0] == "tokens"


# -- the cache under crashes and concurrency ---------------------------------------------------
_FETCH = textwrap.dedent("""
    import hashlib, sys
    from zephon.io import FileCache, FileRef, IoConfig
    url, size, root, endpoint = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    so = {"key": "test", "secret": "test",
          "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    cfg = IoConfig(cache_enabled=True, cache_root=root, download_retry=0)
    print("go", flush=True)
    path = FileCache(cfg, so).fetch(FileRef(url, size))
    print(hashlib.sha256(open(path, "rb").read()).hexdigest(), flush=True)
""")


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _spawn(children, *args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _FETCH, *map(str, args)],
                            stdout=subprocess.PIPE, text=True)
    children.append(proc)
    return proc


def test_a_download_killed_midway_never_leaves_a_file_that_is_served(s3, proxy, tmp_path,
                                                                     children):
    payload = os.urandom(9 << 20)  # two download requests of at most 8 MiB
    url = s3.put("crash/big.bin", payload)
    proxy.stall("crash/big.bin", 60.0, times=1, skip=1)  # the second request hangs
    root = tmp_path / "cache"
    proc = _spawn(children, url, len(payload), root, proxy.endpoint)
    assert proc.stdout.readline().strip() == "go"
    cfg = IoConfig(cache_enabled=True, cache_root=str(root))
    entry = FileCache(cfg).entry_path(FileRef(url, len(payload)))
    parts = lambda: [f for f in os.listdir(os.path.dirname(entry)) if ".part-" in f]  # noqa: E731
    deadline = time.monotonic() + 60
    while not (os.path.isdir(os.path.dirname(entry)) and parts() and
               os.path.getsize(os.path.join(os.path.dirname(entry), parts()[0])) >= 8 << 20):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # mid-download: 8 of 9 MiB written
    proc.wait()
    assert not os.path.exists(entry) and parts()
    path = FileCache(cfg, storage_options(s3.endpoint)).fetch(FileRef(url, len(payload)))
    with open(path, "rb") as fh:
        assert fh.read() == payload
    assert parts() == []  # the crashed download's leftovers were cleared


def test_concurrent_processes_share_one_download(s3, proxy, tmp_path, children):
    payload = os.urandom(1 << 20)
    url = s3.put("shared/a.bin", payload)
    proxy.stall("shared/a.bin", 1.0, times=1)  # keep the first download open a while
    procs = [_spawn(children, url, len(payload), tmp_path / "cache", proxy.endpoint)
             for _ in range(3)]
    digests = {p.communicate(timeout=120)[0].split()[-1] for p in procs}
    assert digests == {hashlib.sha256(payload).hexdigest()}
    assert all(p.returncode == 0 for p in procs)
    assert proxy.gets("shared/a.bin") == 1  # one process downloaded; the others waited


# -- formats over the remote store --------------------------------------------------------------
@pytest.mark.parametrize("cache", [True, False])
def test_remote_parquet_webdataset_and_jsonl_read_like_local(s3, tmp_path, cache):
    pytest.importorskip("pyarrow")
    import gzip

    from _sources_data import write_parquet, write_shards

    so = storage_options(s3.endpoint)
    prefix = f"formats-{cache}"
    for path in write_parquet(tmp_path, files=2) + write_shards(tmp_path, shards=2):
        s3.put(f"{prefix}/{os.path.basename(path)}", open(path, "rb").read())
    s3.put(f"{prefix}/a.jsonl.gz", gzip.compress(b'{"i": 0}\n{"i": 1}\n'))
    io = store(tmp_path, cache_enabled=cache)
    opts = RuntimeOptions(io_options=io, runner="process", max_workers=2)
    pairs = [(sources.parquet(f"s3://{BUCKET}/{prefix}/*.parquet", storage_options=so,
                              io_options=io), sources.parquet(str(tmp_path / "*.parquet"))),
             (sources.webdataset(f"s3://{BUCKET}/{prefix}/shard-{{000..001}}.tar",
                                 storage_options=so, io_options=io),
              sources.webdataset(str(tmp_path / "*.tar")))]
    for remote, local in pairs:
        assert len(remote) == len(local)
        got = list(Pipeline(remote, seed=4, chunk_size=16).options(opts))
        want = list(Pipeline(local, seed=4, chunk_size=16))
        assert [sorted((k, str(v)) for k, v in s.items()) for s in got] == \
            [sorted((k, str(v)) for k, v in s.items()) for s in want]
    lines = sources.jsonl(f"s3://{BUCKET}/{prefix}/*.jsonl.gz", storage_options=so,
                          io_options=io)
    assert [s["i"] for s in Pipeline(lines, shuffle=False).options(opts)] == [0, 1]
    if cache:  # the shard index was stored beside the cached shards
        tags = [f for _, _, fs in os.walk(tmp_path / "cache") for f in fs if f.endswith(".wdsidx")]
        assert len(tags) == 2
