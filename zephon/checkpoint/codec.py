"""Checkpoint bytes: a self-describing, versioned, checksummed envelope around a state dict.

Format version 5 (all integers big-endian)::

    offset  size  field
    0       8     magic b"ZEPHONCK"
    8       1     format version (5; 4 is read too)
    9       1     serializer (0 msgpack, 1 json)
    10      1     compressor (0 none, 1 zstd)
    11      1     reserved, 0
    12      8     payload length in bytes
    20      8     serialized (decompressed) length in bytes
    28      n     payload
    28+n    16    BLAKE2b-128 of bytes [0, 28+n): magic, header and payload

Trust: nothing in a checkpoint is believed before it is checked, and a check never
costs more memory than the bounds below.

- The checksum covers the whole envelope, so any corruption (a flipped bit, a
  truncation, appended bytes) is detected before anything is decompressed or parsed.
- It is not a signature: a crafted checkpoint can carry a valid checksum, so every
  bound holds regardless. The serialized length is at most
  :data:`MAX_DECODED_BYTES`; zstd is decompressed as a stream that stops one byte past
  that bound and with a window of at most that size (a small input that would expand
  to gigabytes is refused after at most the bound is produced). The decoded value has
  at most :data:`MAX_ITEMS` elements in all and nests at most :data:`MAX_DEPTH` deep.
- Every failure is a :class:`~zephon.errors.CheckpointError` saying what is wrong;
  nothing is partially decoded. A checkpoint of an older format version is refused
  with its version named: version 1 had no checksum; version 2 has the same envelope
  but holds a state of an earlier stream definition (partial batches at every flush
  boundary, no carry across boundaries, every run from epoch 0), which no restore
  could continue as the same stream; version 3 has no ended lanes (a lane that
  delivered its last item of the pass looks like one with more to come), so after
  the pass's last item a restore could not tell every rank alike that the pass was
  over. Version 4 is read: its state is version 5's without the resume proof
  (:mod:`zephon.pipeline.proof`), and restores with the fingerprint check only; every
  state written now is version 5.

msgpack integers wider than 64 bits (a NumPy PCG64 state has them) travel as an
extension type; JSON carries them natively. The schema of the pipeline state inside
is checked by the pipeline, not here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Any

import msgpack
import zstandard

from zephon.errors import CheckpointError, SerializationError

__all__ = [
    "MAGIC",
    "MAX_DECODED_BYTES",
    "MAX_DEPTH",
    "MAX_ITEMS",
    "VERSION",
    "decode_state",
    "encode_state",
]

MAGIC = b"ZEPHONCK"
VERSION = 7
#: the format versions this zephon reads (4: a state without the resume proof; 5: without
#: a ``mixture`` field, which no pipeline of version 5 could have; 6: every per-sample op
#: drew the first op's ``ctx.rng`` numbers: a pipeline where a later op takes ``ctx`` has
#: another fingerprint now (its op says "ctx.rng stream k"), so such a state is refused
#: by the fingerprint, naming the op, and every other version-6 state is the same stream)
READABLE = (4, 5, 6, 7)
#: why an older format version cannot be read
_OLDER = {
    1: " (written by an earlier zephon, without a checksum); re-create the checkpoint "
       "with this version",
    2: ": the state is from the previous stream definition (partial batches at every "
       "flush boundary, each run from epoch 0) and cannot be restored as the same stream; "
       "start the run again from the beginning",
    3: ": the state is from the previous stream definition (no ended lanes: whether the "
       "pass was over was decided by each rank alone) and cannot be restored as the same "
       "stream; start the run again from the beginning, or with set_epoch()",
}
#: Largest serialized state accepted (and written). A pipeline state of 4096 lanes is
#: about 40 KB serialized; 16 MiB leaves room for any real state.
MAX_DECODED_BYTES = 16 << 20
#: Deepest nesting of lists and dicts in a state (a pipeline state nests 3 deep).
MAX_DEPTH = 32
#: Most elements (container entries, keys included) in a state.
MAX_ITEMS = 1 << 20

_HEADER = struct.Struct(">8sBBBBQQ")
_CHECKSUM_BYTES = 16
_SERIALIZERS = {"msgpack": 0, "json": 1}
_COMPRESSORS = {"none": 0, "zstd": 1}
_EXT_BIGINT = 7
_ZSTD_LEVEL = 3


def _checksum(data) -> bytes:
    return hashlib.blake2b(data, digest_size=_CHECKSUM_BYTES).digest()


def _default(obj):
    if isinstance(obj, int) and not isinstance(obj, bool):
        return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
    if isinstance(obj, tuple):
        return list(obj)
    raise SerializationError(f"cannot encode {type(obj).__name__} in a checkpoint")


def _ext_hook(code, data):
    if code == _EXT_BIGINT:
        text = data.decode("ascii")
        if not text.lstrip("-").isdigit():
            raise CheckpointError("corrupt checkpoint: a big-int extension holds "
                                  f"{text[:20]!r}")
        return int(text)
    raise CheckpointError(f"corrupt checkpoint: unknown msgpack extension type {code}")


def encode_state(state: dict, serializer: str = "msgpack", compressor: str = "zstd") -> bytes:
    """Encode a state dict into checkpoint bytes (format version 4).

    Args:
        state: a dict of str/int/float/bool/None, lists, tuples (stored as lists) and
            dicts; ints of any width.
        serializer: ``"msgpack"`` (default) or ``"json"``.
        compressor: ``"zstd"`` (default) or ``"none"``.

    Returns:
        The envelope bytes; :func:`decode_state` gives back an equal dict.

    Raises:
        CheckpointError: an unknown serializer/compressor, a value that cannot be
            encoded, or a state larger or deeper than a checkpoint may be (so nothing
            is written that :func:`decode_state` would refuse).

    Examples:
        >>> decode_state(encode_state({"lanes": {"0": [0, 2**70]}}))
        {'lanes': {'0': [0, 1180591620717411303424]}}
    """
    if serializer not in _SERIALIZERS or compressor not in _COMPRESSORS:
        raise CheckpointError(f"unknown serializer/compressor {serializer!r}/{compressor!r}; "
                              f"expected one of {sorted(_SERIALIZERS)} / {sorted(_COMPRESSORS)}")
    if not isinstance(state, dict):
        raise CheckpointError(f"a checkpoint state is a dict, got {type(state).__name__}")
    try:
        if serializer == "msgpack":
            raw = msgpack.packb(state, default=_default, use_bin_type=True)
        else:
            raw = json.dumps(state, sort_keys=True, separators=(",", ":"),
                             allow_nan=True).encode()
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise CheckpointError(f"cannot encode the checkpoint state: {exc}") from None
    if len(raw) > MAX_DECODED_BYTES:
        raise CheckpointError(f"checkpoint state of {len(raw)} serialized bytes exceeds the "
                              f"{MAX_DECODED_BYTES}-byte bound")
    _check_shape(state)
    payload = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw) \
        if compressor == "zstd" else raw
    head = _HEADER.pack(MAGIC, VERSION, _SERIALIZERS[serializer], _COMPRESSORS[compressor],
                        0, len(payload), len(raw))
    body = head + payload
    return body + _checksum(body)


def decode_state(data: Any) -> dict:
    """Decode checkpoint bytes written by :func:`encode_state`.

    Args:
        data: ``bytes``, ``bytearray`` or ``memoryview``.

    Returns:
        The state dict.

    Raises:
        CheckpointError: not a zephon checkpoint, another format version, a checksum
            mismatch (corrupt or truncated), a size, element-count or nesting bound
            exceeded, or undecodable content; the message says which.

    Examples:
        >>> data = encode_state({"lanes_total": 1})
        >>> decode_state(data)
        {'lanes_total': 1}
        >>> decode_state(data[:-1] + bytes([data[-1] ^ 1]))
        Traceback (most recent call last):
        ...
        zephon.errors.CheckpointError: corrupt checkpoint: checksum mismatch ...
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CheckpointError(f"a checkpoint is bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(MAGIC) + 1 or not data.startswith(MAGIC):
        raise CheckpointError("not a zephon checkpoint (bad magic or too short: "
                              f"{len(data)} bytes)")
    version = data[len(MAGIC)]
    if version not in READABLE:
        hint = _OLDER.get(version, "")
        raise CheckpointError(f"checkpoint format version {version}{hint}; this zephon "
                              f"reads versions {READABLE[0]} to {READABLE[-1]}")
    if len(data) < _HEADER.size + _CHECKSUM_BYTES:
        raise CheckpointError(f"corrupt or truncated checkpoint: {len(data)} bytes, shorter "
                              f"than the {_HEADER.size + _CHECKSUM_BYTES}-byte envelope")
    body, digest = data[:-_CHECKSUM_BYTES], data[-_CHECKSUM_BYTES:]
    if not hmac.compare_digest(_checksum(body), digest):
        _, _, _, _, _, payload_len, _ = _HEADER.unpack_from(data)
        expected = _HEADER.size + payload_len + _CHECKSUM_BYTES
        if expected != len(data):
            raise CheckpointError(f"corrupt or truncated checkpoint: {len(data)} bytes, the "
                                  f"header announces {expected} (checksum mismatch)")
        raise CheckpointError("corrupt checkpoint: checksum mismatch (the bytes were "
                              "altered after they were written)")
    _, _, serializer, compressor, reserved, payload_len, raw_len = _HEADER.unpack_from(data)
    if serializer not in _SERIALIZERS.values() or compressor not in _COMPRESSORS.values() \
            or reserved:
        raise CheckpointError(f"unknown serializer {serializer} or compressor {compressor} "
                              f"(reserved byte {reserved})")
    if _HEADER.size + payload_len + _CHECKSUM_BYTES != len(data):
        raise CheckpointError(f"corrupt checkpoint: payload length {payload_len} does not "
                              f"match the {len(data)}-byte envelope")
    if raw_len > MAX_DECODED_BYTES:
        raise CheckpointError(f"checkpoint state of {raw_len} serialized bytes exceeds the "
                              f"{MAX_DECODED_BYTES}-byte bound")
    payload = body[_HEADER.size:]
    raw = _decompress(payload) if compressor == 1 else payload
    if len(raw) != raw_len:
        raise CheckpointError(f"corrupt checkpoint: {len(raw)} serialized bytes, the header "
                              f"announces {raw_len}")
    state = _deserialize(raw, serializer)
    if not isinstance(state, dict):
        raise CheckpointError("corrupt checkpoint: the state is not a mapping")
    _check_shape(state)
    return state


def _decompress(payload: bytes) -> bytes:
    """zstd-decompress at most MAX_DECODED_BYTES, with a bounded window."""
    dctx = zstandard.ZstdDecompressor(max_window_size=MAX_DECODED_BYTES)
    chunks, total = [], 0
    try:
        with dctx.stream_reader(payload, read_across_frames=True) as reader:
            while True:
                chunk = reader.read(min(1 << 20, MAX_DECODED_BYTES + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > MAX_DECODED_BYTES:
                    raise CheckpointError(
                        "checkpoint decompresses to more than the "
                        f"{MAX_DECODED_BYTES}-byte bound (refused without decompressing "
                        "the rest)")
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - zstd reports corruption in several types
        raise CheckpointError(f"corrupt checkpoint: zstd: {type(exc).__name__}: "
                              f"{exc}") from None
    return b"".join(chunks)


class _Budget:
    """Counts decoded elements; refuses past MAX_ITEMS (msgpack hooks)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_ITEMS

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise CheckpointError(f"checkpoint state has more than {MAX_ITEMS} elements")

    def list_hook(self, items):
        self.spend(len(items))
        return items

    def pairs_hook(self, pairs):
        self.spend(2 * len(pairs))
        return dict(pairs)


def _deserialize(raw: bytes, serializer: int):
    try:
        if serializer == 0:
            budget = _Budget()
            return msgpack.unpackb(
                raw, raw=False, ext_hook=_ext_hook, strict_map_key=False,
                list_hook=budget.list_hook, object_pairs_hook=budget.pairs_hook,
                max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS // 2)
        # JSON has no list hook: bound the elements by their separators before parsing
        # (an over-estimate: a separator inside a string counts too).
        separators = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if separators > MAX_ITEMS:
            raise CheckpointError(f"checkpoint state has more than {MAX_ITEMS} elements")
        return json.loads(raw)
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"checkpoint state nests deeper than {MAX_DEPTH}") from None
    except ValueError as exc:
        if "exceeds max_" in str(exc):  # msgpack's per-container length limits
            raise CheckpointError(f"checkpoint state has more than {MAX_ITEMS} elements "
                                  f"({exc})") from None
        raise CheckpointError(f"corrupt checkpoint: ValueError: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any decode failure: corrupt content
        raise CheckpointError(f"corrupt checkpoint: {type(exc).__name__}: {exc}") from None


def _check_shape(state: dict) -> None:
    """Refuse states nesting deeper than MAX_DEPTH (iteratively: no recursion)."""
    stack = [(state, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CheckpointError(f"checkpoint state nests deeper than {MAX_DEPTH}")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)
