"""Upper bounds of every numeric option, each one a limit the consuming code honours.

An option value is accepted only if everything downstream can act on it: no C
integer overflows, no wait that the runtime refuses, no structure sized by the
value that would exhaust memory or hang. Each bound below names the reason; the
field checks of the option classes use these constants, so the bound appears in
the field's documentation and in its error message.

- ``MAX_WORKERS`` (127): a shared-memory region token is a signed 64-bit value
  ``owner << 56 | slab << 40 | offset`` whose owner (1 + worker index) has 7 bits.
- ``MAX_SOCKET_BUFFER_BYTES`` (1 GiB): ``setsockopt(SO_SNDBUF/SO_RCVBUF)`` takes a
  C ``int`` and the kernel doubles the request; 1 GiB is the largest power of two
  that survives both.
- ``MAX_SECONDS`` (30 days): thread, lock and selector waits overflow near 1e9 s
  (``threading.TIMEOUT_MAX`` and ``time.monotonic() + timeout`` in C ``timespec``);
  no timeout, interval or back-off in zephon is meaningful beyond a month.
- ``MAX_QUEUE_DEPTH`` (65536): prefetch depths and in-flight item caps size
  queues, reorder windows and arena bounds (``depth x workers x 16 MiB``).
- ``MAX_MTP_BUFFER`` (4096): requests in flight on the single MTP channel; each
  holds a reply slot in the subprocess's arena.
- ``MAX_CANONICAL_REPLICAS`` (4096): one lane stream, lane state and round-robin
  slot per canonical lane; a checkpoint of 4096 lanes stays well inside the
  decoder's decompressed-size bound.
- ``MAX_WORLD_SIZE`` (2**20): ranks of one job (ranks beyond the lanes share
  data partitions through ``dp_degree``).
- ``MAX_STAGE_INDEX`` (1024): keys of per-stage mappings; a pipeline has far fewer
  stages, and a larger key can only be a mistake.
- ``MAX_BYTES`` (2**40, 1 TiB): byte thresholds of the shared-memory transport;
  offsets inside a region token have 40 bits.
- ``MAX_CACHE_BYTES`` (2**50, 1 PiB): a cache size limit (int64 file-size sums).
- ``MAX_RETRIES`` (1000): retry and attempt counts; each retry costs a process
  start or a back-off, so more than 1000 is a hang in disguise.
- ``MAX_JOB_WORKERS`` (1024): worker processes of ``zephon.jobs.run`` (each holds a
  pipe pair and a process; the per-user process and fd limits end near there).
- ``MAX_COUNT`` (2**31 - 1): plain counters compared in Python (e.g. tasks
  before a worker is recycled): the C ``int`` range, so they log and serialise
  everywhere.
- ``MAX_RATIO`` (1e6): multiplicative thresholds (a ratio larger than that is
  "never": disable the feature instead).
- ``MAX_SEED`` (2**64 - 1): seeds travel in checkpoints as unsigned 64-bit ints.
"""

from __future__ import annotations

__all__ = [
    "MAX_BYTES",
    "MAX_CACHE_BYTES",
    "MAX_CANONICAL_REPLICAS",
    "MAX_COUNT",
    "MAX_JOB_WORKERS",
    "MAX_MTP_BUFFER",
    "MAX_QUEUE_DEPTH",
    "MAX_RATIO",
    "MAX_RETRIES",
    "MAX_SECONDS",
    "MAX_SEED",
    "MAX_SOCKET_BUFFER_BYTES",
    "MAX_STAGE_INDEX",
    "MAX_WORKERS",
    "MAX_WORLD_SIZE",
]

MAX_WORKERS = 127
MAX_SOCKET_BUFFER_BYTES = 1 << 30
MAX_SECONDS = 30 * 24 * 3600.0
MAX_QUEUE_DEPTH = 65536
MAX_MTP_BUFFER = 4096
MAX_CANONICAL_REPLICAS = 4096
MAX_WORLD_SIZE = 1 << 20
MAX_STAGE_INDEX = 1024
MAX_BYTES = 1 << 40
MAX_CACHE_BYTES = 1 << 50
MAX_RETRIES = 1000
MAX_JOB_WORKERS = 1024
MAX_COUNT = (1 << 31) - 1
MAX_RATIO = 1e6
MAX_SEED = (1 << 64) - 1
