"""Checkpoint bytes are trusted no more than they deserve.

The envelope is rebuilt here from its documented layout (not through the codec), so
crafted checkpoints with a *valid* checksum can be made: the bounds on decompressed
size, element count and nesting must hold even then. Real checkpoints come from a
real pipeline for every serializer/compressor pair.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import subprocess
import sys
import textwrap

import msgpack
import pytest
import zstandard

import _pipeline_fns
from zephon import CheckpointError, Pipeline, RuntimeOptions, sources
from zephon.checkpoint.codec import (
    MAX_DECODED_BYTES, MAX_DEPTH, MAX_ITEMS, VERSION, decode_state, encode_state,
)

PAIRS = [(s, c) for s in ("msgpack", "json") for c in ("none", "zstd")]
SER = {"msgpack": 0, "json": 1}
COMP = {"none": 0, "zstd": 1}


def envelope(payload: bytes, serializer: int, compressor: int, raw_len: int, *,
             version: int = VERSION) -> bytes:
    """An envelope (this format version unless told) with a correct BLAKE2b-128 over
    magic+header+payload."""
    body = struct.pack(">8sBBBBQQ", b"ZEPHONCK", version, serializer, compressor, 0,
                       len(payload), raw_len) + payload
    return body + hashlib.blake2b(body, digest_size=16).digest()


def crafted(raw: bytes, serializer: str, compressor: str = "none") -> bytes:
    payload = zstandard.ZstdCompressor().compress(raw) if compressor == "zstd" else raw
    return envelope(payload, SER[serializer], COMP[compressor], len(raw))


def real_checkpoint(serializer: str, compressor: str) -> bytes:
    opts = RuntimeOptions(aggregate_serializer=serializer, aggregate_compressor=compressor)
    pipe = (Pipeline(sources.from_sequence([{"x": i} for i in range(40)]), seed=3,
                     chunk_size=2).map(_pipeline_fns.double).shuffle(4).batch(3)
            .options(opts))
    try:
        it = iter(pipe)
        for _ in range(4):
            next(it)
        return pipe.checkpoint()
    finally:
        pipe.close()


@pytest.mark.parametrize("serializer,compressor", PAIRS)
def test_round_trip_keeps_wide_ints_and_structure(serializer, compressor):
    state = {"rng": [2**127 + 5, -(2**100), 2**64, -1, 0], "lanes": {"0": [1, 2, (3, 4)]},
             "f": 1.5, "s": "ü", "none": None, "flag": True}
    decoded = decode_state(encode_state(state, serializer, compressor))
    assert decoded == {**state, "lanes": {"0": [1, 2, [3, 4]]}}


@pytest.mark.parametrize("serializer,compressor", PAIRS)
def test_every_single_bit_flip_is_refused(serializer, compressor):
    data = real_checkpoint(serializer, compressor)
    decode_state(data)  # the original is fine
    accepted = []
    for i in range(len(data)):
        for bit in range(8):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            try:
                decode_state(bytes(bad))
            except CheckpointError:
                continue
            accepted.append((i, bit))
    assert accepted == [], f"{len(accepted)} of {8 * len(data)} flips accepted"


@pytest.mark.parametrize("serializer,compressor", PAIRS)
def test_truncation_at_every_length_and_appended_bytes_are_refused(serializer, compressor):
    data = real_checkpoint(serializer, compressor)
    for n in range(len(data)):
        with pytest.raises(CheckpointError):
            decode_state(data[:n])
    for extra in (b"\x00", b"junk", data):
        with pytest.raises(CheckpointError, match="corrupt or truncated"):
            decode_state(data + extra)


def test_version_one_checkpoint_is_named():
    # The version-1 layout: magic, version, serializer, compressor, payload; no checksum.
    old = b"ZEPHONCK" + bytes([1, 0, 1]) + zstandard.ZstdCompressor().compress(
        msgpack.packb({"lanes": {}}))
    with pytest.raises(CheckpointError, match=rf"version 1 .*reads versions 4 to {VERSION}"):
        decode_state(old)
    with pytest.raises(CheckpointError, match="version 9"):
        decode_state(b"ZEPHONCK\x09" + bytes(60))


def test_garbage_inputs_are_checkpoint_errors():
    for bad in (b"", b"ZEPHONC", b"not a checkpoint at all", bytes(100), "text", None,
                memoryview(b"ZEPHONCK\x02")):
        with pytest.raises(CheckpointError):
            decode_state(bad)
    with pytest.raises(CheckpointError, match="unknown serializer"):
        encode_state({}, "pickle")
    with pytest.raises(CheckpointError, match="cannot encode"):
        encode_state({"x": object()})


@pytest.mark.parametrize("serializer", ["msgpack", "json"])
def test_crafted_envelopes_with_valid_checksums_are_refused(serializer):
    ok = msgpack.packb({"a": 1}) if serializer == "msgpack" else b'{"a":1}'
    assert decode_state(crafted(ok, serializer)) == {"a": 1}
    cases = {
        "not a mapping": msgpack.packb([1, 2]) if serializer == "msgpack" else b"[1,2]",
        "corrupt checkpoint": b"\xc1\xff" if serializer == "msgpack" else b"{",
    }
    for reason, raw in cases.items():
        with pytest.raises(CheckpointError, match=reason):
            decode_state(crafted(raw, serializer))
    # A header that lies about the serialized length, the payload length or the codes.
    with pytest.raises(CheckpointError, match="announces"):
        decode_state(envelope(ok, SER[serializer], 0, len(ok) + 1))
    with pytest.raises(CheckpointError, match="bound"):
        decode_state(envelope(ok, SER[serializer], 0, MAX_DECODED_BYTES + 1))
    with pytest.raises(CheckpointError, match="unknown serializer"):
        decode_state(envelope(ok, 7, 0, len(ok)))
    body = struct.pack(">8sBBBBQQ", b"ZEPHONCK", VERSION, SER[serializer], 0, 0, 2**40,
                       len(ok)) + ok
    with pytest.raises(CheckpointError, match="payload length"):
        decode_state(body + hashlib.blake2b(body, digest_size=16).digest())


def _nested(depth: int) -> dict:
    state: object = 0
    for _ in range(depth - 1):
        state = [state]
    return {"deep": state}


@pytest.mark.parametrize("serializer", ["msgpack", "json"])
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 200, 5000, 100_000])
def test_deep_nesting_is_refused(serializer, depth):
    if serializer == "msgpack":
        raw = b"\x81\xa4deep" + b"\x91" * (depth - 1) + b"\x00"
    else:
        raw = b'{"deep":' + b"[" * (depth - 1) + b"0" + b"]" * (depth - 1) + b"}"
    with pytest.raises(CheckpointError, match="nests deeper|corrupt"):
        decode_state(crafted(raw, serializer, "zstd"))
    assert decode_state(encode_state(_nested(MAX_DEPTH - 1), serializer))
    with pytest.raises(CheckpointError):
        encode_state(_nested(depth), serializer)


@pytest.mark.parametrize("serializer", ["msgpack", "json"])
def test_element_count_is_bounded(serializer):
    n = MAX_ITEMS + 1
    if serializer == "msgpack":
        one = b"\xdd" + struct.pack(">I", n) + b"\x90" * n  # n empty lists in one list
        half = n // 2 + 1  # two lists, each within the per-list limit, over in total
        two = b"\x92" + (b"\xdd" + struct.pack(">I", half) + b"\x90" * half) * 2
        raws = [b"\x81\xa1a" + one, b"\x81\xa1a" + two]
    else:
        raws = [b'{"a":[' + b",".join([b"[]"] * n) + b"]}"]
    for raw in raws:
        assert len(raw) <= MAX_DECODED_BYTES
        with pytest.raises(CheckpointError, match="more than"):
            decode_state(crafted(raw, serializer, "zstd"))


def _zstd_bomb(decompressed_bytes: int, *, content_size: bool) -> bytes:
    """A zstd frame of zeros, streamed so the test never holds the decompressed bytes."""
    out = io.BytesIO()
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
    size = decompressed_bytes if content_size else -1
    with cctx.stream_writer(out, size=size, closefd=False) as writer:
        zeros = bytes(8 << 20)
        for _ in range(decompressed_bytes // len(zeros)):
            writer.write(zeros)
    return out.getvalue()


RSS_CHILD = textwrap.dedent("""
    import resource, sys
    from zephon import CheckpointError
    from zephon.checkpoint.codec import decode_state
    data = open(sys.argv[1], "rb").read()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        decode_state(data)
        print("ACCEPTED")
    except CheckpointError as exc:
        print("REFUSED", exc, file=sys.stderr)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)
""")


@pytest.mark.parametrize("content_size", [True, False], ids=["sized-frame", "stream-frame"])
def test_zstd_bomb_is_refused_without_allocating_it(tmp_path, content_size):
    bomb_bytes = 1 << 30
    payload = _zstd_bomb(bomb_bytes, content_size=content_size)
    assert len(payload) < bomb_bytes // 1000  # a small input...
    # ... whose header claims a tiny state, with a valid checksum: only the streaming
    # bound stands between it and a GiB allocation.
    path = tmp_path / "bomb.ckpt"
    path.write_bytes(envelope(payload, 0, 1, 100))
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] != "ACCEPTED"
    assert "bound" in out.stderr, out.stderr
    growth = int(out.stdout.split()[-1])
    # Peak RSS grows by the bound (16 MiB) and buffers, far below the bomb (1 GiB).
    assert growth < bomb_bytes // 16, f"peak RSS grew {growth} bytes for a {bomb_bytes} bomb"


def test_largest_legal_state_round_trips():
    blob = "x" * (MAX_DECODED_BYTES - 64)
    data = encode_state({"blob": blob}, "msgpack", "zstd")
    assert decode_state(data)["blob"] == blob
    with pytest.raises(CheckpointError, match="exceeds"):
        encode_state({"blob": blob + "x" * 128}, "json", "none")


def test_state_of_4096_lanes_is_far_below_the_bounds():
    state = {"fingerprint": "f" * 64, "lanes_total": 4096, "group": 0,
             "lanes": {str(i): [i, 10**9 + i, 2, 10**6] for i in range(4096)}}
    for serializer, compressor in PAIRS:
        data = encode_state(state, serializer, compressor)
        assert decode_state(data) == state
    raw = json.dumps(state).encode()
    assert len(raw) * 100 < MAX_DECODED_BYTES

