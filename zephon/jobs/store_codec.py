"""The bytes of one checkpoint-store entry: values, records, and what a good record is.

A record is msgpack ``{key, subject, fingerprint, value | error, attempts,
duration_s, time}``, zstd-compressed when it is large (a zstd frame with its content
checksum), stored in a frame that makes any damage to its bytes detectable::

    tag (1 byte: 1 plain msgpack, 2 zstd)  body  crc32 of tag + body (4 bytes, LE)

The checksum covers every byte of the record but itself, so a flipped bit, a torn
or truncated record is caught before anything is decoded (CRC-32 catches every
error burst up to 32 bits, hence every flipped byte; it is not a signature: the
store's trust in what it reads comes from its files being the user's own). Records
of the earlier formats carry no frame (the first compressed every record, the
second from 512 bytes on); :func:`frame` gives one its checksum, unchanged inside,
when a store of those formats is migrated, and :meth:`RecordCodec.unpack_body`
reads such a body. Values are msgpack-native types
plus extension types for NumPy arrays and scalars, tuples and integers wider than
64 bits; any other object is stored with pickle only when allowed, and such a value
is refused at load time otherwise (loading a pickle runs code).

:meth:`RecordCodec.judge` is the one judge of a record read back: every kind of bad
record (a checksum mismatch, truncated, corrupt, missing or mistyped fields, written
for another key) raises :class:`~zephon.errors.CheckpointError` with one message
naming where it was read, the key and what is wrong; a good record of another
fingerprint is None (not served).
"""

from __future__ import annotations

import pickle
import struct
import zlib
from typing import Any

import msgpack
import numpy as np
import zstandard

from zephon.errors import CheckpointError, SerializationError
from zephon.kernels.types import dtype_from_token, dtype_token

__all__ = ["FRAME_BYTES", "KIND_FAILED", "KIND_OK", "RecordCodec", "decode_value",
           "encode_value", "frame"]

KIND_OK, KIND_FAILED = 0, 1
#: Records of at least this many msgpack bytes are stored zstd-compressed.
COMPRESS_FROM = 512
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_TAG_PLAIN, _TAG_ZSTD = b"\x01", b"\x02"  # a record's first byte: how its body is stored
_PLAIN = _TAG_PLAIN[0]
_CRC = struct.Struct("<I")
#: The CRC-32 of any bytes followed by their own CRC-32 (little-endian): a record is
#: checked with one call over all its bytes.
_CRC_RESIDUE = 0x2144DF1C
#: Bytes the frame adds to a record body: the tag and the checksum.
FRAME_BYTES = 1 + _CRC.size
_BODY_END = -_CRC.size  # a framed record's body: blob[1:_BODY_END]
#: Framed records from this size on are decoded through a view, not a copy of the body.
_VIEW_FROM = 1 << 16
_EXT_ARRAY, _EXT_BIGINT, _EXT_TUPLE, _EXT_SCALAR, _EXT_PICKLE = 1, 2, 3, 4, 5


def _encoder(allow_pickle: bool):
    """The msgpack ``default`` hook of :func:`encode_value` and a one-shot packer (a
    nested value, a tuple's items, is packed by a packer of its own: a msgpack Packer
    is not reentrant)."""
    def default(obj):
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            data = np.ascontiguousarray(obj)
            return msgpack.ExtType(_EXT_ARRAY, msgpack.packb(
                [dtype_token(obj.dtype), list(obj.shape), data.tobytes()], use_bin_type=True))
        if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return msgpack.ExtType(_EXT_SCALAR, msgpack.packb(
                [dtype_token(obj.dtype), obj.tobytes()], use_bin_type=True))
        if isinstance(obj, tuple):
            return msgpack.ExtType(_EXT_TUPLE, pack(list(obj)))
        if isinstance(obj, int) and not isinstance(obj, bool):
            return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
        if allow_pickle:
            return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj, protocol=5))
        raise SerializationError(
            f"cannot store a {type(obj).__name__} in the checkpoint store without pickle; "
            "return msgpack-able values (numbers, strings, bytes, lists, dicts, tuples, NumPy "
            "arrays) or open the run with allow_pickle=True")

    def pack(obj):
        return msgpack.packb(obj, default=default, use_bin_type=True, strict_types=True)

    return pack, default


def _decoder(allow_pickle: bool):
    """The unpacker of :func:`decode_value` with its extension hook (built once)."""
    def ext_hook(code, payload):
        if code == _EXT_ARRAY:
            dtype, shape, raw = msgpack.unpackb(payload, raw=False)
            return np.frombuffer(raw, dtype=dtype_from_token(dtype)).reshape(shape).copy()
        if code == _EXT_SCALAR:
            dtype, raw = msgpack.unpackb(payload, raw=False)
            return np.frombuffer(raw, dtype=dtype_from_token(dtype))[0]
        if code == _EXT_TUPLE:
            return tuple(unpack(payload))
        if code == _EXT_BIGINT:
            return int(payload.decode())
        if code == _EXT_PICKLE:
            if not allow_pickle:
                raise CheckpointError(
                    "the stored value was pickled; refusing to unpickle it (that runs code) "
                    "unless the run is opened with allow_pickle=True")
            return pickle.loads(payload)
        return msgpack.ExtType(code, payload)

    def unpack(raw):
        return msgpack.unpackb(raw, raw=False, ext_hook=ext_hook, strict_map_key=False)

    return unpack


_ENCODERS = {flag: _encoder(flag) for flag in (False, True)}
_PACK = {flag: pack for flag, (pack, _default) in _ENCODERS.items()}
_UNPACK = {flag: _decoder(flag) for flag in (False, True)}


def encode_value(value: Any, *, allow_pickle: bool) -> bytes:
    """msgpack bytes of ``value`` (see the module docstring for what is allowed)."""
    return _PACK[bool(allow_pickle)](value)


def decode_value(data: bytes, *, allow_pickle: bool) -> Any:
    """The value :func:`encode_value` encoded (a pickle only with ``allow_pickle``)."""
    return _UNPACK[bool(allow_pickle)](data)


def _framed(tag: bytes, body: bytes) -> bytes:
    data = tag + body
    return data + _CRC.pack(zlib.crc32(data))


def frame(body: bytes) -> bytes:
    """The record ``body`` of an earlier format (msgpack, or a zstd frame: told apart by
    the zstd magic number, which no msgpack map starts with) in the current frame, its
    bytes unchanged: what a migration stores."""
    return _framed(_TAG_ZSTD if body[:4] == _ZSTD_MAGIC else _TAG_PLAIN, body)


def _damaged(blob: bytes, where: str) -> CheckpointError:
    """The error of a framed record whose checksum does not match its bytes."""
    if len(blob) <= FRAME_BYTES:
        return CheckpointError(f"{where} is corrupt: truncated ({len(blob)} bytes)")
    recorded = _CRC.unpack_from(blob, len(blob) - _CRC.size)[0]
    computed = zlib.crc32(memoryview(blob)[:-_CRC.size])
    return CheckpointError(
        f"{where} is corrupt: checksum mismatch (crc32 {computed:08x}, recorded "
        f"{recorded:08x}): its bytes were damaged after they were written")


def _open_frame(blob: Any, where: str) -> tuple[bool, bytes | memoryview]:
    """(compressed, body) of the framed record ``blob``; CheckpointError when it is not
    bytes, too short, or its checksum does not match its bytes."""
    if not isinstance(blob, bytes):
        raise CheckpointError(f"{where} is corrupt: a {type(blob).__name__}, not bytes")
    if len(blob) <= FRAME_BYTES or zlib.crc32(blob) != _CRC_RESIDUE:
        raise _damaged(blob, where)
    tag = blob[0]
    if tag != _TAG_PLAIN[0] and tag != _TAG_ZSTD[0]:
        raise CheckpointError(f"{where} is not a record of this store format (tag {tag})")
    body = blob[1:-_CRC.size] if len(blob) < _VIEW_FROM else memoryview(blob)[1:-_CRC.size]
    return tag == _TAG_ZSTD[0], body


def _check_fields(record: dict, kind: int, where: str) -> None:
    attempts, duration = record.get("attempts"), record.get("duration_s")
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 0 or \
            not isinstance(duration, (int, float)) or isinstance(duration, bool):
        raise CheckpointError(f"{where} is corrupt: attempts={attempts!r}, "
                              f"duration_s={duration!r}")
    if kind == KIND_OK and not isinstance(record.get("value"), bytes):
        raise CheckpointError(f"{where} is corrupt: it holds no encoded value")
    if kind == KIND_FAILED:
        error = record.get("error")
        if not isinstance(error, dict) or not isinstance(error.get("type"), str) or \
                not isinstance(error.get("message"), str) or \
                not isinstance(error.get("traceback", ""), str):
            raise CheckpointError(f"{where} is corrupt: error={error!r:.200}")


class RecordCodec:
    """Packs, frames and judges records: one zstd context pair and one reusable msgpack
    packer per kind of bytes, per store (``msgpack.packb`` builds a packer per call, which
    costs more than packing a small record); not thread-safe, like the store's saves.

    Args:
        allow_pickle: what :meth:`encode` may store with pickle.
    """

    def __init__(self, allow_pickle: bool = False) -> None:
        self._cctx = zstandard.ZstdCompressor(level=3, write_checksum=True)
        self._dctx = zstandard.ZstdDecompressor()
        self._records = msgpack.Packer(use_bin_type=True)
        self._values = msgpack.Packer(default=_ENCODERS[bool(allow_pickle)][1],
                                      use_bin_type=True, strict_types=True)

    def encode(self, value: Any) -> bytes:
        """:func:`encode_value` of ``value`` under this codec's ``allow_pickle``."""
        return self._values.pack(value)

    def pack(self, record: dict) -> bytes:
        """The record's bytes: msgpack, zstd-compressed (with the frame's content
        checksum) from :data:`COMPRESS_FROM` bytes on (a small record is not worth a zstd
        frame), framed with its tag and checksum (see the module docstring)."""
        raw = self._records.pack(record)
        if len(raw) >= COMPRESS_FROM:
            return _framed(_TAG_ZSTD, self._cctx.compress(raw))
        return _framed(_TAG_PLAIN, raw)

    def unpack(self, blob: Any, where: str) -> dict:
        """The record in the framed ``blob`` (any record: the caller checks key and kind),
        or CheckpointError when it is not one (first of all: a checksum mismatch)."""
        # The common case inline (a small plain record whose checksum holds): a resume
        # reads one per subject, and two calls more cost a third of its decoding.
        if type(blob) is bytes and _VIEW_FROM > len(blob) > FRAME_BYTES and \
                blob[0] == _PLAIN and zlib.crc32(blob) == _CRC_RESIDUE:
            try:
                record = msgpack.unpackb(blob[1:_BODY_END], raw=False)
            except Exception:  # noqa: BLE001 - judged below, with its message
                pass
            else:
                if type(record) is dict:
                    return record
        compressed, body = _open_frame(blob, where)
        return self._decode(body, compressed, where)

    def unpack_body(self, body: Any, where: str, compressed: bool | None = None) -> dict:
        """The record in an unframed ``body`` (compressed or not; None: a zstd frame if it
        starts with the zstd magic number, as the earlier formats stored it), or
        CheckpointError when it is not one."""
        if not isinstance(body, (bytes, memoryview)):
            raise CheckpointError(f"{where} is corrupt: a {type(body).__name__}, not bytes")
        if compressed is None:
            compressed = body[:4] == _ZSTD_MAGIC
        return self._decode(body, compressed, where)

    def _decode(self, body: bytes | memoryview, compressed: bool, where: str) -> dict:
        try:
            raw = self._dctx.decompress(body) if compressed else body
            record = msgpack.unpackb(raw, raw=False)
        except Exception as exc:  # noqa: BLE001 - corrupt entry: recompute, do not serve
            raise CheckpointError(f"{where} is corrupt (truncated or damaged): "
                                  f"{type(exc).__name__}: {exc}") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{where} is corrupt: not a record")
        return record

    def judge(self, blob: Any, key: str, kind: int, fingerprint: str,
              where: str) -> dict | None:
        """The record in ``blob`` if it is a good ``kind`` record of ``key`` under
        ``fingerprint``; None for another fingerprint; CheckpointError otherwise."""
        record = self.unpack(blob, where)
        if record.get("key") != key:
            raise CheckpointError(f"{where} is not this subject's: it was written for key "
                                  f"{record.get('key')!r:.200} (forged or moved)")
        if record.get("fingerprint") != fingerprint:
            return None
        _check_fields(record, kind, where)
        return record
