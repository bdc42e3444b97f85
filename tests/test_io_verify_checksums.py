"""Whole-object reads of remote objects (cache downloads, the scan that indexes a streamed
WebDataset shard) are checked against a checksum of the store, whatever kind the object
has, and an object with none is read twice: one bit flipped in flight is never cached
or indexed. Also: an ETag header altered once in flight is looked up again, not taken
for a changed object.

A moto server on 127.0.0.1 behind :class:`_flip_proxy.BitFlipProxy` (a real TCP proxy
inverting one bit of chosen GET bodies, or one hex digit of an ETag header).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from _flip_proxy import BitFlipProxy  # noqa: E402
from _s3_server import s3, storage_options  # noqa: E402, F401 (fixtures)
from test_io_stream_integrity import FAST, put_plain, shard, streamed  # noqa: E402

from zephon import OpError, Pipeline, StoreOptions, sources  # noqa: E402
from zephon.io import FileCache, FileReader, IoConfig, ObjectCorrupt, SourceError  # noqa: E402
from zephon.io.remote import BLOCK, expand  # noqa: E402

MIB = 1 << 20
BUCKET = "zephon-test"


@pytest.fixture
def flipper(s3):
    proxy = BitFlipProxy(s3.port)
    yield proxy
    proxy.close()


def client(s3, checksum: bool):
    """A boto3 client that adds an additional checksum to uploads only when asked."""
    import boto3
    from botocore.config import Config

    when = "when_supported" if checksum else "when_required"
    return boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                        aws_access_key_id="test", aws_secret_access_key="test",
                        config=Config(request_checksum_calculation=when))


def put_uneven(s3, key: str, data: bytes, cuts: tuple[int, ...]) -> str:
    """A multipart upload with parts starting at ``cuts`` (no additional checksum)."""
    c = client(s3, False)
    up = c.create_multipart_upload(Bucket=BUCKET, Key=key)
    parts = []
    for n, (lo, hi) in enumerate(zip(cuts, (*cuts[1:], len(data))), start=1):
        etag = c.upload_part(Bucket=BUCKET, Key=key, PartNumber=n, UploadId=up["UploadId"],
                             Body=data[lo:hi])["ETag"]
        parts.append({"PartNumber": n, "ETag": etag})
    c.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up["UploadId"],
                                MultipartUpload={"Parts": parts})
    return f"s3://{BUCKET}/{key}"


def cache_cfg(tmp_path, **kw) -> IoConfig:
    return IoConfig(cache_enabled=True, cache_root=str(tmp_path / "cache"),
                    **{"download_retry": 1, **FAST, **kw})


def cached_bytes(url: str, cfg: IoConfig, so: dict) -> bytes:
    (ref,) = expand(url, "test", cfg, so)
    with open(FileCache(cfg, so).fetch(ref), "rb") as fh:
        return fh.read()


def test_uneven_multipart_objects_are_checked_part_by_part(s3, flipper, tmp_path):
    """Parts of 5.5 MiB, 5 MiB and 3 KiB: the ETag is computed over the part sizes the
    store reports, so one flipped bit is a mismatch, never a cached copy."""
    data = np.random.default_rng(1).bytes(10 * MIB + MIB // 2 + 3000)
    url = put_uneven(s3, "v/uneven.bin", data, (0, 5 * MIB + MIB // 2, 10 * MIB + MIB // 2))
    so, cfg = storage_options(flipper.endpoint), cache_cfg(tmp_path)
    flipper.flip("v/uneven.bin", times=1)  # the first download's first block
    assert cached_bytes(url, cfg, so) == data
    assert flipper.flipped == 1
    flipper.flip("v/uneven.bin", times=10**6)
    (ref,) = expand(url, "test", cfg, so)
    with pytest.raises(SourceError, match=r"cannot cache s3://zephon-test/v/uneven\.bin: the "
                                          r"multipart ETag .* in 2 download"):
        FileCache(cache_cfg(tmp_path / "2"), so).fetch(ref)
    scan_cfg = IoConfig(download_retry=1, **FAST)  # a streamed scan checks the same way
    with pytest.raises(ObjectCorrupt, match=r"v/uneven\.bin \(a test\): the multipart ETag"):
        FileReader(ref, scan_cfg, so).scan(lambda fh: fh.digest_range(0, ref.size), "a test")


def test_sse_kms_objects_are_checked_by_their_additional_checksum(s3, flipper, tmp_path):
    """Under SSE-KMS the ETag is no MD5: the object's CRC32 (as boto3 uploads by default)
    is checked instead, in one read. (botocore checks a GET of a whole object itself; a
    ranged GET of part of one carries no checksum: the objects span several requests.)"""
    data = np.random.default_rng(2).bytes(BLOCK + 200_000)
    client(s3, True).put_object(Bucket=BUCKET, Key="v/kms-crc.bin", Body=data,
                                ServerSideEncryption="aws:kms", ChecksumAlgorithm="CRC32")
    url = f"s3://{BUCKET}/v/kms-crc.bin"
    so, cfg = storage_options(flipper.endpoint), cache_cfg(tmp_path)
    flipper.flip("v/kms-crc.bin", times=1)  # the first download's first block
    assert cached_bytes(url, cfg, so) == data
    assert flipper.gets("v/kms-crc.bin") == 4  # two blocks, twice: checked, not read twice
    assert flipper.flipped == 1
    (ref,) = expand(url, "test", cfg, so)
    scan_cfg = IoConfig(download_retry=1, **FAST)
    flipper.flip("v/kms-crc.bin", times=10**6)
    with pytest.raises(ObjectCorrupt, match=r"v/kms-crc\.bin \(a test\): the CRC32 checksum "
                                            r"of the bytes received .* in 2 read"):
        FileReader(ref, scan_cfg, so).scan(lambda fh: fh.digest_range(0, ref.size), "a test",
                                           block=1 << 20)


def test_sse_kms_multipart_objects_are_checked_by_their_composite_checksum(s3, flipper,
                                                                          tmp_path):
    """SSE-KMS, multipart, SHA-256 parts: the checksum of the parts' checksums (over the
    part sizes the store reports) is checked; one flip is read again, a flip on every
    read is refused."""
    c = client(s3, True)
    cuts = (0, 5 * MIB + 7, 10 * MIB + 7)
    data = np.random.default_rng(4).bytes(10 * MIB + 2000)
    up = c.create_multipart_upload(Bucket=BUCKET, Key="v/kms-mp.bin", ChecksumAlgorithm="SHA256",
                                   ServerSideEncryption="aws:kms")
    parts = []
    for n, (lo, hi) in enumerate(zip(cuts, (*cuts[1:], len(data))), start=1):
        r = c.upload_part(Bucket=BUCKET, Key="v/kms-mp.bin", PartNumber=n,
                          UploadId=up["UploadId"], Body=data[lo:hi], ChecksumAlgorithm="SHA256")
        parts.append({"PartNumber": n, "ETag": r["ETag"], "ChecksumSHA256": r["ChecksumSHA256"]})
    c.complete_multipart_upload(Bucket=BUCKET, Key="v/kms-mp.bin", UploadId=up["UploadId"],
                                MultipartUpload={"Parts": parts})
    url = f"s3://{BUCKET}/v/kms-mp.bin"
    so = storage_options(flipper.endpoint)
    flipper.flip("v/kms-mp.bin", times=1, skip=1)  # the second block of the first download
    assert cached_bytes(url, cache_cfg(tmp_path), so) == data
    assert (flipper.flipped, flipper.gets("v/kms-mp.bin")) == (1, 4)  # checked, not read twice
    flipper.flip("v/kms-mp.bin", times=10**6)
    with pytest.raises(SourceError, match=r"v/kms-mp\.bin: the composite SHA256 checksum of "
                                          r"the bytes received .* in 2 download"):
        cached_bytes(url, cache_cfg(tmp_path / "2"), so)


def test_objects_with_no_checksum_are_read_twice_and_must_agree(s3, flipper, tmp_path):
    """SSE-KMS and no additional checksum: nothing to check against, so two reads must
    agree before the bytes are cached (the cost: the object is read twice), or, with
    ``unchecked_objects='refuse'``, it is refused, naming the way out."""
    data = np.random.default_rng(3).bytes(300_000)
    client(s3, False).put_object(Bucket=BUCKET, Key="v/kms.bin", Body=data,
                                 ServerSideEncryption="aws:kms")
    url = f"s3://{BUCKET}/v/kms.bin"
    so = storage_options(flipper.endpoint)
    assert cached_bytes(url, cache_cfg(tmp_path), so) == data
    assert flipper.gets("v/kms.bin") == 2  # honest: read twice, once each
    flipper.flip("v/kms.bin", times=1)
    assert cached_bytes(url, cache_cfg(tmp_path / "2"), so) == data
    assert flipper.flipped == 1
    flipper.flip("v/kms.bin", times=1)  # no retry: the two reads disagree, nothing cached
    with pytest.raises(SourceError, match=r"cannot cache s3://zephon-test/v/kms\.bin: two reads "
                                          r"of it disagree .* in 1 download"):
        cached_bytes(url, cache_cfg(tmp_path / "3", download_retry=0), so)
    with pytest.raises(SourceError, match=r"v/kms\.bin offers no checksum zephon can check .* "
                                          r"unchecked_objects is 'refuse'"):
        cached_bytes(url, cache_cfg(tmp_path / "4", unchecked_objects="refuse"), so)


def test_a_streamed_shard_with_no_checksum_is_indexed_from_agreeing_reads(s3, flipper):
    """One flip while the index of an SSE-KMS shard is built: the digests come from two
    reads that agree, so every later honest read is served (it failed for good), and a
    read altered for good is an error that claims no verification."""
    data, want = shard()
    client(s3, False).put_object(Bucket=BUCKET, Key="v/kms.tar", Body=data,
                                 ServerSideEncryption="aws:kms")
    so = storage_options(flipper.endpoint)
    flipper.flip("v/kms.tar", times=1)  # the first read of the build
    src = sources.webdataset(f"s3://{BUCKET}/v/kms.tar", storage_options=so,
                             io_options=StoreOptions(**FAST, download_retry=1))
    assert flipper.flipped == 1
    assert list(Pipeline(src, shuffle=False).options(streamed())) == want
    flipper.flip("v/kms.tar", times=10**6)
    with pytest.raises(OpError, match=r"do not match the digest recorded when the source was "
                                      r"built \(from bytes that matched the object's checksum "
                                      r"or, with none, two reads that agreed\)") as err:
        list(Pipeline(src, shuffle=False).options(streamed(download_retry=1)))
    assert "verified" not in str(err.value)


def test_an_etag_header_altered_once_on_a_read_is_looked_up_again(s3, flipper):
    """One ranged GET whose ETag header was altered: the store is asked again, reports
    the recorded ETag, and the read is retried. An object that really changed is still
    an error."""
    data, want = shard()
    url = put_plain(s3, "v/etag-get.tar", data)
    so = storage_options(flipper.endpoint)
    src = sources.webdataset(url, storage_options=so,
                             io_options=StoreOptions(**FAST, download_retry=1))
    flipper.alter_etag("v/etag-get.tar", "GET", times=1, skip=4)  # the 5th sample's read
    assert list(Pipeline(src, shuffle=False).options(streamed(download_retry=1))) == want
    assert flipper.etags_altered == 1
    put_plain(s3, "v/etag-get.tar", shard(salt=9)[0])  # really replaced (same size)
    with pytest.raises(OpError, match=r"v/etag-get\.tar .*changed since the source was built"):
        list(Pipeline(src, shuffle=False).options(streamed(download_retry=1)))


def test_an_etag_header_altered_once_while_building_is_looked_up_again(s3, flipper):
    """The HEAD that lists the shard answered another ETag: its first read finds the
    store's, which is looked up again and indexed; every sample is served."""
    data, want = shard()
    url = put_plain(s3, "v/etag-head.tar", data)
    so = storage_options(flipper.endpoint)
    flipper.alter_etag("v/etag-head.tar", "HEAD", times=1)  # the listing's HEAD
    src = sources.webdataset(url, storage_options=so,
                             io_options=StoreOptions(**FAST, download_retry=1))
    assert flipper.etags_altered == 1
    assert list(Pipeline(src, shuffle=False).options(streamed(download_retry=1))) == want
