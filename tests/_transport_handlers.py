"""Worker-side handlers for the transport tests (module level: spawn workers import it)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np

NUMERIC = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "float32", "float64", "complex64", "complex128"]


@dataclasses.dataclass
class Record:
    name: str
    values: np.ndarray
    extra: tuple


def nested_payload(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    arrays = {d: (rng.random(3000 + seed) * 100).astype(d) for d in NUMERIC}
    big = rng.integers(0, 1 << 40, size=(512, 1024), dtype=np.int64)  # 4 MiB
    return {
        "arrays": arrays,
        "strided": big[::3, ::-2],
        "transposed": big[:40].T,
        "zero_d": np.array(seed, dtype=np.int32),
        "empty": np.zeros((0, 7), dtype=np.float32),
        "big": big,
        "small": np.arange(5, dtype=np.uint16),
        "tuple": (np.ones(10_000, dtype=np.float32), "text", 3.5, None),
        "bytes": b"x" * 9000 + bytes([seed % 256]),
        "bytearray": bytearray(b"y" * 5000),
        "short_bytes": b"abc",
        "objects": np.array([{"k": 1}, "s", 2], dtype=object),
        "record": Record("r", np.linspace(0, 1, 4096), ("a", 1)),
        "scalar": np.float64(2.5),
        "seed": seed,
    }


def handle(msg):
    op, arg = msg
    if op == "nested":
        return nested_payload(arg)
    if op == "echo":
        return arg
    if op == "slice":
        obj, index = arg
        return obj[index]
    if op == "full":
        nbytes, value = arg
        return {"data": np.full(nbytes // 8, value, dtype=np.int64), "value": value}
    if op == "sleep":
        time.sleep(arg)
        return arg
    if op == "raise":
        raise ValueError(f"op failed on purpose: {arg}")
    if op == "unpicklable":
        return {"a": [1, lambda: 0], "b": np.zeros(3)}
    if op == "pid":
        return os.getpid()
    if op == "fds":
        out = {}
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                out[fd] = (os.readlink(f"/proc/self/fd/{fd}"), os.get_inheritable(fd))
            except OSError:
                pass
        return out
    if op == "kill_self":
        os.kill(os.getpid(), signal.SIGKILL)
    if op == "tensor":
        import torch

        return {"t": torch.arange(arg, dtype=torch.float32).reshape(-1, 4)[:, 1:],
                "n": np.arange(arg)}
    raise KeyError(op)
