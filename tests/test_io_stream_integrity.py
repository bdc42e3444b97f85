"""Streamed remote reads (the cache off) verify what they read, against a real S3 server.

A moto server on 127.0.0.1 behind :class:`_flip_proxy.BitFlipProxy`, a real TCP proxy
that inverts one bit in the middle of the body of chosen GET responses (the length and
headers untouched). A WebDataset shard is indexed by one verified scan of the whole
object (its MD5 against the ETag) that records a digest per member; each sample is then
one ranged GET, compared with those digests before the sample is delivered. Also the
io layer's scan itself, with blocks small enough that one object takes several requests.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from _flip_proxy import BitFlipProxy  # noqa: E402
from _s3_server import s3, storage_options  # noqa: E402, F401 (fixtures)

from zephon import OpError, Pipeline, RuntimeOptions, StoreOptions, sources  # noqa: E402
from zephon.io import FileCache, FileReader, IoConfig, SourceError  # noqa: E402
from zephon.io.remote import expand  # noqa: E402

FAST = dict(retry_backoff_initial_s=0.01, retry_backoff_max_s=0.05)
N = 100


@pytest.fixture
def flipper(s3):
    proxy = BitFlipProxy(s3.port)
    yield proxy
    proxy.close()


def shard(n: int = N, size: int = 8 << 10, salt: int = 0) -> tuple[bytes, list[dict]]:
    """A tar of ``n`` samples ``{key}.bin`` (``size`` random bytes) and ``{key}.json``."""
    rng = np.random.default_rng(salt)
    buf, want = io.BytesIO(), []
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(n):
            sample = {"__key__": f"{i:04d}", "bin": rng.bytes(size),
                      "json": json.dumps({"i": i}).encode()}
            for ext in ("bin", "json"):
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size = len(sample[ext])
                tar.addfile(info, io.BytesIO(sample[ext]))
            want.append(sample)
    return buf.getvalue(), want


def streamed(**kw) -> RuntimeOptions:
    """The cache off; no check of the ops on the first sample (which would read it twice:
    the tests count the requests)."""
    return RuntimeOptions(io_options=StoreOptions(**{**FAST, "cache_enabled": False, **kw}),
                          auto_validation="off")


def put_plain(s3, key: str, data: bytes) -> str:
    """Upload ``data`` with no additional checksum (as older clients and many tools do):
    GETs then carry none that the client could check itself, only the ETag is left."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test",
                          config=Config(request_checksum_calculation="when_required"))
    client.put_object(Bucket="zephon-test", Key=key, Body=data)
    return f"s3://zephon-test/{key}"


def wds(s3, proxy, key: str, **io) -> tuple[object, list[dict]]:
    data, want = shard()
    url = put_plain(s3, key, data)
    src = sources.webdataset(url, storage_options=storage_options(proxy.endpoint),
                             io_options=StoreOptions(**{**FAST, **io}) if io else None)
    return src, want


def test_streamed_samples_altered_in_flight_are_an_error_naming_the_shard(s3, flipper):
    src, want = wds(s3, flipper, "stream/flip.tar")  # indexed through the honest proxy
    flipper.flip("stream/flip.tar", times=10**6)  # from now on every response has a bit flipped
    before = flipper.gets("stream/flip.tar")
    got = []
    with pytest.raises(OpError, match=r"s3://zephon-test/stream/flip\.tar \(members 0000\."
                                      r"\{bin,json\}\): bytes \d+-\d+ do not match the digest"):
        for sample in Pipeline(src, shuffle=False).options(streamed(download_retry=1)):
            got.append(sample)
    assert got == want[:len(got)]  # nothing altered was delivered (here: nothing at all)
    assert flipper.gets("stream/flip.tar") - before == 2  # the read and one more (retry 1)
    assert flipper.flipped == 2


def test_one_altered_response_is_read_again_and_every_sample_is_right(s3, flipper):
    src, want = wds(s3, flipper, "stream/once.tar")
    flipper.flip("stream/once.tar", times=1, skip=10)  # the 11th sample's first read
    before = flipper.gets("stream/once.tar")
    got = list(Pipeline(src, shuffle=False).options(streamed(download_retry=1)))
    assert got == want
    assert flipper.flipped == 1
    assert flipper.gets("stream/once.tar") - before == N + 1  # one ranged GET each, one again


def test_control_an_honest_proxy_serves_every_sample_one_ranged_read_each(s3, flipper):
    src, want = wds(s3, flipper, "stream/honest.tar")
    before = flipper.gets("stream/honest.tar")
    assert list(Pipeline(src, shuffle=False).options(streamed())) == want
    assert flipper.gets("stream/honest.tar") - before == N  # streamed: nothing read whole
    assert flipper.flipped == 0


def test_the_index_is_built_from_verified_bytes_only(s3, flipper):
    flipper.flip("stream/build.tar", times=10**6)
    with pytest.raises(SourceError, match=r"s3://zephon-test/stream/build\.tar \(building the "
                                          r"index\): the MD5 of the bytes received .* in 2 read"):
        wds(s3, flipper, "stream/build.tar", download_retry=1)
    flipper.flip("stream/build.tar", times=1)  # one altered scan, then a good one
    src, want = wds(s3, flipper, "stream/build.tar", download_retry=1)
    assert flipper.flipped == 3
    assert list(Pipeline(src, shuffle=False).options(streamed())) == want


def test_a_scan_spans_blocks_and_is_checked_whole(s3, flipper):
    from zephon.io import ObjectCorrupt
    from zephon.io.remote import range_digest

    rng = np.random.default_rng(7)
    data = rng.bytes(300_000)
    so = storage_options(flipper.endpoint)
    cfg = IoConfig(download_retry=1, **FAST)
    (ref,) = expand(put_plain(s3, "stream/scan.bin", data), "test", cfg, so)
    ranges = [(0, 10), (65_000, 200_000), (131_072, 131_072), (250_000, 300_000)]

    def parse(fh):  # reads in odd pieces and names ranges as it reaches them
        slots = []
        for start, end in ranges:
            fh.seek(start)
            slots.append(fh.digest_range(start, end))
            fh.read(7)
        return slots

    block = 64 << 10  # five requests for the object
    before = flipper.gets("stream/scan.bin")
    slots, digests = FileReader(ref, cfg, so).scan(parse, "a test", block=block)
    assert [digests[s] for s in slots] == [range_digest(data[a:b]) for a, b in ranges]
    assert flipper.gets("stream/scan.bin") - before == 5
    flipper.flip("stream/scan.bin", times=1, skip=3)  # the 4th block of the first scan
    slots, digests = FileReader(ref, cfg, so).scan(parse, "a test", block=block)
    assert [digests[s] for s in slots] == [range_digest(data[a:b]) for a, b in ranges]
    assert flipper.flipped == 1
    flipper.flip("stream/scan.bin", times=10**6)
    with pytest.raises(ObjectCorrupt, match=r"stream/scan\.bin \(a test\): the MD5"):
        FileReader(ref, cfg, so).scan(parse, "a test", block=block)


def test_multipart_objects_are_checked_by_their_parts(s3, flipper, tmp_path):
    """A multipart ETag is the MD5 of the parts' MD5s: checked with the part size the store
    reports; parts of uneven sizes cannot be checked, and are not called corrupt."""
    from zephon.io import ObjectCorrupt

    rng = np.random.default_rng(11)
    mib = 1 << 20
    uniform, uneven = rng.bytes(11 * mib + 5), rng.bytes(12 * mib)
    for key, data, cuts in (("mp/uniform.bin", uniform, (0, 5 * mib, 10 * mib)),
                            ("mp/uneven.bin", uneven, (0, 6 * mib, 11 * mib))):
        up = s3.client.create_multipart_upload(Bucket="zephon-test", Key=key)
        parts = []
        for n, (lo, hi) in enumerate(zip(cuts, (*cuts[1:], len(data))), start=1):
            etag = s3.client.upload_part(Bucket="zephon-test", Key=key, PartNumber=n,
                                         UploadId=up["UploadId"], Body=data[lo:hi])["ETag"]
            parts.append({"PartNumber": n, "ETag": etag})
        s3.client.complete_multipart_upload(Bucket="zephon-test", Key=key,
                                            UploadId=up["UploadId"],
                                            MultipartUpload={"Parts": parts})
    so = storage_options(flipper.endpoint)
    cfg = IoConfig(download_retry=1, **FAST)

    def scan(key: str):
        (ref,) = expand(f"s3://zephon-test/{key}", "test", cfg, so)
        assert ref.etag.endswith("-3")
        reader = FileReader(ref, cfg, so)
        return reader.scan(lambda fh: fh.digest_range(0, ref.size), "a test", block=4 << 20)

    assert scan("mp/uniform.bin")[1] == [hashlib.sha256(uniform).digest()[:16]]
    assert scan("mp/uneven.bin")[1] == [hashlib.sha256(uneven).digest()[:16]]  # unverifiable
    flipper.flip("mp/uniform.bin", times=10**6)
    with pytest.raises(ObjectCorrupt, match=r"mp/uniform\.bin \(a test\): the multipart ETag"):
        scan("mp/uniform.bin")
    # the cache checks its downloads the same way (they were not checked for multipart)
    cached = IoConfig(cache_enabled=True, cache_root=str(tmp_path / "c"), download_retry=1, **FAST)
    (ref,) = expand("s3://zephon-test/mp/uniform.bin", "test", cached, so)
    with pytest.raises(SourceError, match=r"cannot cache s3://zephon-test/mp/uniform\.bin: "
                                          r"the multipart ETag"):
        FileCache(cached, so).fetch(ref)
