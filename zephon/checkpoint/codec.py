"""Checkpoint bytes: a self-describing, versioned envelope around a state dict.

Layout: ``b"ZEPHONCK"`` magic, one byte format version, one byte serializer
(0 msgpack, 1 json), one byte compressor (0 none, 1 zstd), then the payload.
msgpack integers wider than 64 bits (a NumPy PCG64 state has them) travel as an
extension type. Anything that is not such an envelope, or is truncated,
corrupt, of another version or undecodable, is a
:class:`~zephon.errors.CheckpointError` with the reason; nothing is partially
decoded.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import zstandard

from zephon.errors import CheckpointError

__all__ = ["encode_state", "decode_state", "MAGIC", "VERSION"]

MAGIC = b"ZEPHONCK"
VERSION = 1
_SERIALIZERS = {"msgpack": 0, "json": 1}
_COMPRESSORS = {"none": 0, "zstd": 1}
_EXT_BIGINT = 7


def _default(obj):
    if isinstance(obj, int) and not isinstance(obj, bool):
        return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in a checkpoint")


def _ext_hook(code, data):
    if code == _EXT_BIGINT:
        return int(data.decode())
    raise CheckpointError(f"unknown extension type {code} in checkpoint")


def encode_state(state: dict, serializer: str = "msgpack", compressor: str = "zstd") -> bytes:
    if serializer not in _SERIALIZERS or compressor not in _COMPRESSORS:
        raise CheckpointError(f"unknown serializer/compressor {serializer!r}/{compressor!r}")
    if serializer == "msgpack":
        payload = msgpack.packb(state, default=_default, use_bin_type=True)
    else:
        payload = json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
    if compressor == "zstd":
        payload = zstandard.ZstdCompressor(level=3).compress(payload)
    return MAGIC + bytes([VERSION, _SERIALIZERS[serializer], _COMPRESSORS[compressor]]) + payload


def decode_state(data: Any) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CheckpointError(f"a checkpoint is bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(MAGIC) + 3 or not data.startswith(MAGIC):
        raise CheckpointError("not a zephon checkpoint (bad magic or too short)")
    version, serializer, compressor = data[len(MAGIC):len(MAGIC) + 3]
    if version != VERSION:
        raise CheckpointError(f"checkpoint format version {version}; this zephon reads "
                              f"version {VERSION}")
    if serializer not in _SERIALIZERS.values() or compressor not in _COMPRESSORS.values():
        raise CheckpointError(f"unknown serializer {serializer} or compressor {compressor}")
    payload = data[len(MAGIC) + 3:]
    try:
        if compressor == 1:
            payload = zstandard.ZstdDecompressor().decompress(payload)
        if serializer == 0:
            state = msgpack.unpackb(payload, raw=False, ext_hook=_ext_hook,
                                    strict_map_key=False)
        else:
            state = json.loads(payload)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decode failure: corrupt or truncated
        raise CheckpointError(f"corrupt or truncated checkpoint: {type(exc).__name__}: "
                              f"{exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError("corrupt checkpoint: the state is not a mapping")
    return state
