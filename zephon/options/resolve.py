"""Resolvers: every derived runtime value as a pure function of the options.

A numeric knob left at ``None`` is derived through one cascade::

    max_workers            = explicit, else clamp(os.cpu_count(), 4, 16)
    prefetch_batches       = explicit, else max(8, 2 * max_workers)
    op_queue_capacity      = explicit, else max(8, prefetch_batches)
    mtp_buffer             = explicit, else min(4096, max(4, prefetch_batches // 2))
    mtp_prefetch           = explicit, else min(mtp_buffer, max(4, mtp_buffer // 10))
    default_stage_prefetch = explicit, else max(4, prefetch_batches // 4)  (process)
                                            max(8, prefetch_batches // 2)  (threads, inline)
    flush_every_k_chunks   = explicit, else 8 if an op breaks cursor order, else 0
    dp_degree              = explicit, else world_size
    dp_group_id            = explicit, else global_rank // (world_size // dp_degree)
    canonical_replicas     = explicit, else dp_degree

Notes on the two places where this goes beyond the bare formulas:
- a derived ``mtp_prefetch`` never exceeds ``mtp_buffer`` (an explicit
  ``mtp_buffer`` below 4 would otherwise make the default break the
  ``mtp_prefetch <= mtp_buffer`` rule);
- ``dp_group_id`` equals ``global_rank`` in 1-D data parallelism (the usual
  case); with ``dp_degree < world_size`` consecutive blocks of
  ``world_size // dp_degree`` ranks share a data partition (tensor/pipeline
  parallel ranks innermost). Set it explicitly for any other layout.

Only ``resolve_max_workers`` reads the machine (``os.cpu_count()``); every
resolver that depends on it takes the same optional ``cpu_count`` so a caller
(or a test) can pin it. The autotune budgets read it too, the cgroup-aware way
(:func:`available_cpus`, :func:`available_memory_bytes`), with the same kind of
override (``cpu_count``, ``memory_bytes``). Functions here duck-type their argument and import
nothing above the options layer.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, NamedTuple, Sequence

from zephon.errors import ZephonConfigError
from zephon.options._spec import field_default
from zephon.options.limits import MAX_MTP_BUFFER

__all__ = [
    "CLOUD_AGGREGATE_MIN_TIMEOUT_S",
    "OUT_OF_PROCESS_RUNNERS",
    "STAGE_RUNNERS",
    "ResolvedValue",
    "available_cpus",
    "available_memory_bytes",
    "backend_reason",
    "default_prefetch_batches",
    "is_cloud_path",
    "resolve_aggregate_timeout_s",
    "resolve_all",
    "resolve_autotune_cpu_budget",
    "resolve_autotune_memory_bytes",
    "resolve_backend",
    "resolve_canonical_replicas",
    "resolve_default_stage_prefetch",
    "resolve_dp_degree",
    "resolve_dp_group_id",
    "resolve_flush_every_k_chunks",
    "resolve_mapping_strategy",
    "resolve_max_workers",
    "resolve_mtp_buffer",
    "resolve_mtp_prefetch",
    "resolve_op_queue_capacity",
    "resolve_prefetch_batches",
    "resolve_stage_prefetch",
    "resolve_stage_workers",
]

STAGE_RUNNERS = ("inline", "threads", "process", "ray")
#: runners whose stages run in processes of their own (a worker process, a Ray actor):
#: their ops and samples must pickle and each process seeds its own generators
OUT_OF_PROCESS_RUNNERS = frozenset({"process", "ray"})
CLOUD_AGGREGATE_MIN_TIMEOUT_S = 90.0
AUTO_FLUSH_EVERY_K_CHUNKS = 8


def resolve_max_workers(opts, cpu_count: int | None = None) -> int:
    """Workers per stage or in total: ``max_workers``, else the CPU count clamped to [4, 16].

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        cpu_count: the CPU count to assume (None: ``os.cpu_count()``).

    Returns:
        An int >= 1.

    Examples:
        >>> resolve_max_workers(RuntimeOptions(), cpu_count=2)
        4
        >>> resolve_max_workers(RuntimeOptions(max_workers=3))
        3
    """
    if opts.max_workers is not None:
        return opts.max_workers
    return _default_max_workers(cpu_count)


def _default_max_workers(cpu_count: int | None) -> int:
    n = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return min(16, max(4, n))


def default_prefetch_batches(cpu_count: int | None = None) -> int:
    """The prefetch a run resolves when neither ``prefetch_batches`` nor ``max_workers``
    is set: ``max(8, 2 * the CPU count clamped to [4, 16])``. A bare
    :class:`~zephon.transport.WorkerPool` sizes its arena for it, as a pool of a default
    run does.

    Examples:
        >>> default_prefetch_batches(cpu_count=2), default_prefetch_batches(cpu_count=64)
        (8, 32)
    """
    return max(8, 2 * _default_max_workers(cpu_count))


def resolve_prefetch_batches(opts, *, cpu_count: int | None = None) -> int:
    """Batches buffered at the pipeline tail: ``prefetch_batches``, else
    ``max(8, 2 * max_workers)``.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        cpu_count: the CPU count to assume (None: ``os.cpu_count()``).

    Returns:
        An int >= 1.

    Examples:
        >>> resolve_prefetch_batches(RuntimeOptions(max_workers=6))
        12
    """
    if opts.prefetch_batches is not None:
        return opts.prefetch_batches
    return max(8, 2 * resolve_max_workers(opts, cpu_count))


def resolve_op_queue_capacity(opts, *, cpu_count: int | None = None) -> int:
    """In-flight items per lane inside a stage: ``op_queue_capacity``, else
    ``max(8, prefetch_batches)``.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        cpu_count: the CPU count to assume (None: ``os.cpu_count()``).

    Returns:
        An int >= 1.

    Examples:
        >>> resolve_op_queue_capacity(RuntimeOptions(prefetch_batches=20))
        20
    """
    if opts.op_queue_capacity is not None:
        return opts.op_queue_capacity
    return max(8, resolve_prefetch_batches(opts, cpu_count=cpu_count))


def resolve_mtp_buffer(opts, *, cpu_count: int | None = None) -> int:
    """Batches in flight on the MTP channel: ``mtp_buffer``, else
    ``min(4096, max(4, prefetch_batches // 2))``.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        cpu_count: the CPU count to assume (None: ``os.cpu_count()``).

    Returns:
        An int >= 1.

    Examples:
        >>> resolve_mtp_buffer(RuntimeOptions(prefetch_batches=64))
        32
    """
    if opts.mtp_buffer is not None:
        return opts.mtp_buffer
    return min(MAX_MTP_BUFFER, max(4, resolve_prefetch_batches(opts, cpu_count=cpu_count) // 2))


def resolve_mtp_prefetch(opts, *, cpu_count: int | None = None) -> int:
    """Batches the consumer-side MTP thread receives ahead: ``mtp_prefetch``, else
    ``min(mtp_buffer, max(4, mtp_buffer // 10))``; 0 means no thread.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        cpu_count: the CPU count to assume (None: ``os.cpu_count()``).

    Returns:
        An int >= 0.

    Examples:
        >>> resolve_mtp_prefetch(RuntimeOptions(mtp_buffer=100))
        10
    """
    if opts.mtp_prefetch is not None:
        return opts.mtp_prefetch
    buffer = resolve_mtp_buffer(opts, cpu_count=cpu_count)
    return min(buffer, max(4, buffer // 10))


def resolve_default_stage_prefetch(opts, runner: str, *, cpu_count: int | None = None) -> int:
    """Items buffered between stages for a stage on ``runner``: ``default_stage_prefetch``,
    else ``max(4, prefetch // 4)`` for process and Ray stages and ``max(8, prefetch // 2)`` for
    thread and inline stages.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        runner: ``"inline"``, ``"threads"``, ``"process"`` or ``"ray"``.
        cpu_count: the CPU count to assume (None: ``os.cpu_count()``).

    Returns:
        An int >= 1.

    Raises:
        ZephonConfigError: an unknown runner.

    Examples:
        >>> opts = RuntimeOptions(prefetch_batches=32)
        >>> [resolve_default_stage_prefetch(opts, r) for r in ("process", "threads")]
        [8, 16]
    """
    if runner not in STAGE_RUNNERS:
        raise ZephonConfigError(
            f"resolve_default_stage_prefetch: runner {runner!r} is not one of {STAGE_RUNNERS}"
        )
    if opts.default_stage_prefetch is not None:
        return opts.default_stage_prefetch
    prefetch = resolve_prefetch_batches(opts, cpu_count=cpu_count)
    if runner in OUT_OF_PROCESS_RUNNERS:
        return max(4, prefetch // 4)
    return max(8, prefetch // 2)


def resolve_stage_prefetch(opts, stage: int, runner: str, *, cpu_count: int | None = None) -> int:
    """Prefetch depth of stage ``stage``: ``per_stage_prefetch[stage]`` wins over the default.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        stage: the stage index.
        runner: the stage's runner (``"inline"``, ``"threads"``, ``"process"``).
        cpu_count: the CPU count to assume (None: ``os.cpu_count()``).

    Returns:
        An int >= 1.

    Examples:
        >>> opts = RuntimeOptions(per_stage_prefetch={1: 3}, prefetch_batches=32)
        >>> resolve_stage_prefetch(opts, 1, "threads"), resolve_stage_prefetch(opts, 0, "threads")
        (3, 16)
    """
    if stage in opts.per_stage_prefetch:
        return opts.per_stage_prefetch[stage]
    return resolve_default_stage_prefetch(opts, runner, cpu_count=cpu_count)


def resolve_flush_every_k_chunks(opts, preserves_cursor_order: bool) -> int:
    """Flush cadence: a flush boundary every K lane chunks (0: only at epoch starts).

    ``flush_every_k_chunks``, else 8 when an op breaks cursor order (a shuffle buffer,
    a packer: they resume by replay from a boundary) and 0 when none does.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        preserves_cursor_order: True when every op of the pipeline preserves cursor
        order.

    Returns:
        An int >= 0.

    Raises:
        ZephonConfigError: an explicit 0 with an op that breaks cursor order.

    Examples:
        >>> resolve_flush_every_k_chunks(RuntimeOptions(), preserves_cursor_order=False)
        8
        >>> resolve_flush_every_k_chunks(RuntimeOptions(), preserves_cursor_order=True)
        0
    """
    k = opts.flush_every_k_chunks
    if k is None:
        return 0 if preserves_cursor_order else AUTO_FLUSH_EVERY_K_CHUNKS
    if k == 0 and not preserves_cursor_order:
        raise ZephonConfigError(
            "RuntimeOptions.flush_every_k_chunks: got 0, but the pipeline has an op that "
            "does not preserve cursor order (a shuffle buffer or a packer); such ops need "
            "flush boundaries for exact replay. Leave it None (auto = "
            f"{AUTO_FLUSH_EVERY_K_CHUNKS}) or set a positive value.",
            field="RuntimeOptions.flush_every_k_chunks",
        )
    return k


def resolve_dp_degree(opts) -> int:
    """Number of data-parallel groups: ``dp_degree``, else ``world_size``.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.

    Returns:
        An int >= 1.

    Examples:
        >>> resolve_dp_degree(RuntimeOptions(world_size=4, global_rank=1))
        4
    """
    return opts.dp_degree if opts.dp_degree is not None else opts.world_size


def resolve_dp_group_id(opts) -> int:
    """This rank's data-parallel group: ``dp_group_id``, else
    ``global_rank // (world_size // dp_degree)`` (consecutive ranks share a group).

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.

    Returns:
        An int, ``0 <= group < dp_degree``.

    Examples:
        >>> resolve_dp_group_id(RuntimeOptions(world_size=4, global_rank=3, dp_degree=2))
        1
    """
    if opts.dp_group_id is not None:
        return opts.dp_group_id
    dp = resolve_dp_degree(opts)
    if dp <= 0 or opts.world_size % dp:
        return opts.global_rank  # the cross-field check reports the real problem
    return opts.global_rank // (opts.world_size // dp)


def resolve_canonical_replicas(opts) -> int:
    """Number of canonical lanes C: ``canonical_replicas``, else ``dp_degree``.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.

    Returns:
        An int >= 1.

    Examples:
        >>> resolve_canonical_replicas(RuntimeOptions(world_size=2, global_rank=0))
        2
    """
    if opts.canonical_replicas is not None:
        return opts.canonical_replicas
    return resolve_dp_degree(opts)


def resolve_mapping_strategy(opts) -> str:
    """How lanes map to dp groups: ``mapping_strategy``, else ``"contiguous"``.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.

    Returns:
        ``"contiguous"`` or ``"interleaved"``.

    Examples:
        >>> resolve_mapping_strategy(RuntimeOptions())
        'contiguous'
    """
    return opts.mapping_strategy if opts.mapping_strategy is not None else "contiguous"


_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def is_cloud_path(path: str | None) -> bool:
    """True for a URL with a scheme other than ``file`` (``s3://``, ``gs://``, ...).

    Args:
        path: a path or URL, or None.

    Returns:
        A bool.

    Examples:
        >>> [is_cloud_path(p) for p in ("s3://bucket/runs", "/tmp/runs", "file:///tmp")]
        [True, False, False]
    """
    if not path:
        return False
    match = _URL_SCHEME.match(path)
    return match is not None and match.group(1).lower() != "file"


def resolve_aggregate_timeout_s(opts) -> float:
    """Budget of one checkpoint exchange: ``aggregate_timeout_s``, raised to at least 90 s
    when ``aggregate_dir`` is a cloud URL.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.

    Returns:
        Seconds, a float > 0.

    Examples:
        >>> opts = RuntimeOptions(aggregate_timeout_s=10.0, aggregate_dir="s3://bucket/agg")
        >>> resolve_aggregate_timeout_s(opts)
        90.0
    """
    if is_cloud_path(opts.aggregate_dir):
        return max(CLOUD_AGGREGATE_MIN_TIMEOUT_S, opts.aggregate_timeout_s)
    return opts.aggregate_timeout_s


def resolve_stage_workers(opts, stage_parallelism: Sequence[int], *,
                          cpu_count: int | None = None) -> list[int]:
    """Worker cap of each stage, given the summed op parallelism of each stage.

    - ``fit_to_ops``: a stage's cap is the sum of its ops' parallelism (at most an explicit
      ``max_workers``: no stage ever runs more workers than that);
    - ``per_stage_fixed``: every stage gets ``max_workers``;
    - ``global``: ``max_workers`` is split over the stages by largest remainder,
      weighted by parallelism (ties to the earlier stage); a stage never gets
      fewer than one worker, so with more stages than workers the total exceeds
      ``max_workers`` by the number of stages bumped to one;
    - ``autotune``: every stage starts with one worker; the run's controller
      (:mod:`zephon.pipeline.autotune`) grows and shrinks them within
      :func:`resolve_autotune_cpu_budget` workers in total.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        stage_parallelism: the summed ``parallelism`` of each stage's ops (ints >= 1).
        cpu_count: the CPU count to assume (None: ``os.cpu_count()``).

    Returns:
        A list of ints >= 1, one per stage.

    Raises:
        ZephonConfigError: a parallelism below 1.

    Examples:
        >>> resolve_stage_workers(RuntimeOptions(max_workers=4), [1, 8])
        [1, 4]
        >>> resolve_stage_workers(RuntimeOptions(max_workers=4, worker_allocation="global"), [1, 3])
        [1, 3]
    """
    weights = [int(p) for p in stage_parallelism]
    if any(w < 1 for w in weights):
        raise ZephonConfigError(
            f"resolve_stage_workers: stage parallelism must be >= 1, got {weights}"
        )
    mode = opts.worker_allocation
    if mode == "fit_to_ops":
        if opts.max_workers is not None:
            return [min(w, opts.max_workers) for w in weights]
        return list(weights)
    if mode == "per_stage_fixed":
        return [resolve_max_workers(opts, cpu_count)] * len(weights)
    if mode == "global":
        total = resolve_max_workers(opts, cpu_count)
        if not weights:
            return []
        weight_sum = sum(weights)
        quotas = [total * w / weight_sum for w in weights]
        shares = [int(q) for q in quotas]
        left = total - sum(shares)
        order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - shares[i]), i))
        for i in order[:left]:
            shares[i] += 1
        return [max(1, s) for s in shares]
    if mode == "autotune":
        return [1] * len(weights)
    raise ZephonConfigError(f"resolve_stage_workers: unknown worker_allocation {mode!r}",
                            field="RuntimeOptions.worker_allocation")


def _cgroup_cpu_limit(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """The cgroup v2 CPU quota in cores (``quota / period``), None when unlimited or
    unreadable."""
    try:
        with open(path, encoding="ascii") as fh:
            quota, period = fh.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def available_cpus(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Cores this process may run on: its CPU affinity (``os.sched_getaffinity``, else
    ``os.cpu_count()``), lowered to the cgroup's CPU quota (``cpu.max``, rounded up).

    Returns:
        An int >= 1.

    Examples:
        >>> available_cpus() >= 1
        True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_limit(cgroup_cpu_max)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _read_int(path: str, key: str | None = None) -> int | None:
    """An int from a cgroup file (``max``: None) or a ``key: N kB`` line of a proc file."""
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read()
    except OSError:
        return None
    if key is None:
        word = text.strip()
        return None if word == "max" or not word.isdigit() else int(word)
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def available_memory_bytes() -> int | None:
    """Memory this process may still take: ``MemAvailable`` (``/proc/meminfo``), lowered
    to the cgroup's room (``memory.max - memory.current``); None when neither is known.

    Examples:
        >>> m = available_memory_bytes()
        >>> m is None or m > 0
        True
    """
    room = [m for m in (_read_int("/proc/meminfo", "MemAvailable"),) if m is not None]
    limit = _read_int("/sys/fs/cgroup/memory.max")
    used = _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None:
        room.append(max(0, limit - (used or 0)))
    return min(room) if room else None


def resolve_autotune_cpu_budget(opts, cpu_count: int | None = None) -> int:
    """Workers the autotune controller may run in total, over every stage: an explicit
    ``max_workers``, else the cores available to the process (:func:`available_cpus`).

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        cpu_count: the cores to assume (None: :func:`available_cpus`).

    Returns:
        An int >= 1.

    Examples:
        >>> resolve_autotune_cpu_budget(RuntimeOptions(max_workers=3))
        3
        >>> resolve_autotune_cpu_budget(RuntimeOptions(), cpu_count=6)
        6
    """
    if opts.max_workers is not None:
        return opts.max_workers
    return max(1, cpu_count if cpu_count is not None else available_cpus())


#: Used when the machine says nothing of its memory (not Linux): 4 GiB for the workers.
AUTOTUNE_FALLBACK_MEMORY_BYTES = 4 << 30


def resolve_autotune_memory_bytes(opts, memory_bytes: int | None = None) -> int:
    """Resident bytes the autotune controller lets the process workers use together:
    ``autotune_memory_bytes``, else half the memory available (:func:`available_memory_bytes`;
    4 GiB when unknown).

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        memory_bytes: the available memory to assume (None: read it).

    Returns:
        An int >= 1.

    Examples:
        >>> resolve_autotune_memory_bytes(RuntimeOptions(autotune_memory_bytes=1 << 30))
        1073741824
        >>> resolve_autotune_memory_bytes(RuntimeOptions(), memory_bytes=8 << 30) >> 30
        4
    """
    if opts.autotune_memory_bytes is not None:
        return opts.autotune_memory_bytes
    room = memory_bytes if memory_bytes is not None else available_memory_bytes()
    return max(1, room // 2) if room is not None else AUTOTUNE_FALLBACK_MEMORY_BYTES


def resolve_backend(policy) -> str:
    """The effective jobs backend of ``policy``.

    ``ray`` when asked (a subject timeout is enforced by killing the Ray worker); else
    ``process`` when asked or when a subject timeout is set (it cannot be enforced
    in-process); else ``serial``.

    Args:
        policy: a :class:`~zephon.RunPolicy`.

    Returns:
        ``"serial"``, ``"process"`` or ``"ray"``.

    Examples:
        >>> resolve_backend(RunPolicy()), resolve_backend(RunPolicy(subject_timeout_sec=None))
        ('process', 'serial')
    """
    if policy.backend == "ray":
        return "ray"
    if policy.backend == "process" or policy.subject_timeout_sec is not None:
        return "process"
    return "serial"


def backend_reason(policy) -> str:
    """One sentence saying why :func:`resolve_backend` chose what it chose.

    Args:
        policy: a :class:`~zephon.RunPolicy`.

    Returns:
        A string (``JobRun.explain()`` shows it).

    Examples:
        >>> backend_reason(RunPolicy(subject_timeout_sec=None))
        "backend='serial' and no subject timeout"
    """
    if policy.backend == "ray":
        if policy.subject_timeout_sec is not None:
            return ("backend='ray' was requested; subject_timeout_sec="
                    f"{policy.subject_timeout_sec} is enforced by cancelling the Ray task "
                    "(killing its worker)")
        return "backend='ray' was requested"
    if policy.backend == "process":
        return "backend='process' was requested"
    if policy.subject_timeout_sec is not None:
        return (
            f"subject_timeout_sec={policy.subject_timeout_sec} is set and a timeout cannot "
            "be enforced in-process (set subject_timeout_sec=None to run serially)"
        )
    return "backend='serial' and no subject timeout"


class ResolvedValue(NamedTuple):
    """One resolved option: its value and where it came from.

    Attributes:
        value: the value the engine uses.
        source: ``"explicit"`` (set by the user), ``"derived"`` (computed from other
            options) or ``"default"``.

    Examples:
        >>> RuntimeOptions(max_workers=2).resolved()["max_workers"]
        ResolvedValue(value=2, source='explicit')
    """

    value: Any
    source: str  # "explicit" | "derived" | "default"


_DERIVED = {
    "max_workers": lambda o, c: resolve_max_workers(o, c),
    "prefetch_batches": lambda o, c: resolve_prefetch_batches(o, cpu_count=c),
    "op_queue_capacity": lambda o, c: resolve_op_queue_capacity(o, cpu_count=c),
    "mtp_buffer": lambda o, c: resolve_mtp_buffer(o, cpu_count=c),
    "mtp_prefetch": lambda o, c: resolve_mtp_prefetch(o, cpu_count=c),
    "default_stage_prefetch": lambda o, c: {
        r: resolve_default_stage_prefetch(o, r, cpu_count=c) for r in STAGE_RUNNERS
    },
    "flush_every_k_chunks": lambda o, c: (
        f"auto: {AUTO_FLUSH_EVERY_K_CHUNKS} if an op breaks cursor order, else 0"
    ),
    "dp_degree": lambda o, c: resolve_dp_degree(o),
    "dp_group_id": lambda o, c: resolve_dp_group_id(o),
    "canonical_replicas": lambda o, c: resolve_canonical_replicas(o),
    "mapping_strategy": lambda o, c: resolve_mapping_strategy(o),
}


def resolve_all(opts, cpu_count: int | None = None) -> dict[str, ResolvedValue]:
    """Every field of ``opts`` with its resolved value and provenance, in field order.

    Args:
        opts: a :class:`~zephon.RuntimeOptions`.
        cpu_count: the CPU count to assume (None: ``os.cpu_count()``).

    Returns:
        A dict: field name -> :class:`ResolvedValue` (``source`` is ``"explicit"``,
        ``"derived"`` or ``"default"``).

    Examples:
        >>> resolve_all(RuntimeOptions(max_workers=2))["prefetch_batches"]
        ResolvedValue(value=8, source='derived')
    """
    import dataclasses

    out: dict[str, ResolvedValue] = {}
    for f in dataclasses.fields(opts):
        raw = getattr(opts, f.name)
        default = field_default(f)
        if f.name in _DERIVED and raw is None:
            out[f.name] = ResolvedValue(_DERIVED[f.name](opts, cpu_count), "derived")
        elif f.name == "aggregate_timeout_s" and resolve_aggregate_timeout_s(opts) != raw:
            out[f.name] = ResolvedValue(resolve_aggregate_timeout_s(opts), "derived")
        else:
            out[f.name] = ResolvedValue(raw, "default" if raw == default else "explicit")
    return out
