"""RuntimeOptions: the execution knobs of a streaming pipeline.

Every field here is a performance or operations knob: none of them may change
the batch stream, except ``canonical_replicas`` (the number of lanes, recorded in
every checkpoint), ``flush_every_k_chunks`` (where a shuffle buffer drains and a replay can start, part of
the pipeline's fingerprint) and ``deterministic=False``, which trades order for
throughput and says so in ``explain()``.

Numeric knobs left at ``None`` are derived by the resolvers in
:mod:`zephon.options.resolve`; ``resolved()`` shows each value and whether it
was explicit, derived or a default. Validation happens once, at construction
(and again when a pickled copy is rebuilt in a worker): per-field checks from
:mod:`zephon.options._spec`, then the cross-field rules in
``_check_cross``.
"""

from __future__ import annotations

import multiprocessing
import re
from dataclasses import dataclass
from typing import Any

from zephon.errors import ZephonConfigError
from zephon.options import resolve as _r
from zephon.options._spec import (
    Bool,
    EnumOf,
    Float,
    FrozenMap,
    Int,
    IntKeyMap,
    MpContext,
    Nested,
    OptionsBase,
    PathStr,
    Str,
    StrTuple,
    option,
    option_class,
)
from zephon.options.limits import (
    MAX_BYTES,
    MAX_CACHE_BYTES,
    MAX_CANONICAL_REPLICAS,
    MAX_MTP_BUFFER,
    MAX_QUEUE_DEPTH,
    MAX_RATIO,
    MAX_RETRIES,
    MAX_SECONDS,
    MAX_SOCKET_BUFFER_BYTES,
    MAX_STAGE_INDEX,
    MAX_WORKERS,
    MAX_WORLD_SIZE,
)
from zephon.options.metrics import ExecutionTrackingMode, MetricsSinkConfig
from zephon.options.mixture import MixtureReadConfig
from zephon.options.store import StoreOptions

__all__ = [
    "DEFAULT_IPC_BUFFER_BYTES",
    "DEFAULT_MTP_BUFFER_BYTES",
    "DEFAULT_RUN_ID",
    "RUNNERS",
    "WORKER_ALLOCATIONS",
    "RuntimeOptions",
]

KiB, MiB = 1 << 10, 1 << 20
#: bound of worker_compute_threads: torch.set_num_threads takes a C int, and a thread pool
#: larger than any machine's cores is a mistake, not a setting
MAX_COMPUTE_THREADS = 4096
DEFAULT_RUN_ID = "default_run_id"
DEFAULT_IPC_BUFFER_BYTES = 512 * KiB
DEFAULT_MTP_BUFFER_BYTES = 8 * MiB
RUNNERS = _r.STAGE_RUNNERS
WORKER_ALLOCATIONS = ("fit_to_ops", "per_stage_fixed", "global", "autotune")
_AGGREGATE_STORE = r"torch://([A-Za-z0-9_.\-]+:[0-9]{1,5})?"


@option_class
@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeOptions(OptionsBase):
    """How the engine runs a pipeline: runners, workers, queues, transport, ranks.

    Keyword arguments only; each is validated at construction (a
    :class:`~zephon.errors.ZephonConfigError` names the field, the value and what is
    allowed). None of them changes the batch stream except ``canonical_replicas`` (the
    number of lanes C), ``flush_every_k_chunks`` (where a shuffle buffer drains and a replay can start) and
    ``deterministic=False`` (completion order). Numeric knobs left at None are
    derived (see :meth:`resolved`).

    Examples:
        >>> opts = RuntimeOptions(runner="threads", max_workers=2)
        >>> opts.resolved()["prefetch_batches"].value
        8
        >>> RuntimeOptions(max_workers=0)
        Traceback (most recent call last):
        ...
        zephon.errors.ZephonConfigError: RuntimeOptions.max_workers: ...
    """

    runner: str | None = option(
        None, check=Str(choices=RUNNERS, optional=True),
        doc="Runner of every stage unless per_stage_runner overrides it; None = chosen per "
            "stage from its ops.",
    )
    run_id: str = option(
        DEFAULT_RUN_ID, check=Str(pattern=r"[A-Za-z0-9_.\-]{1,64}"),
        doc="Name of this run in logs, metrics and shared-memory/aggregation names; "
            "with world_size > 1 outside torchrun and without an initialized process "
            "group, checkpoint() needs a run_id of its own for every launch (the same on "
            "all its ranks).",
    )
    per_stage_runner: FrozenMap = option(
        FrozenMap(), check=IntKeyMap(Str(choices=RUNNERS), max_key=MAX_STAGE_INDEX),
        doc="Runner per stage index; wins over runner (debugging and tuning).",
    )
    mp_context: Any = option(
        multiprocessing.get_context("spawn"), check=MpContext(),
        doc="Start method of worker processes; spawn is the safe default (fork + threads "
            "deadlocks, and crash retries are refused under fork).",
    )
    worker_allocation: str = option(
        "fit_to_ops", check=Str(choices=WORKER_ALLOCATIONS),
        doc="fit_to_ops: stage cap = sum of op parallelism; per_stage_fixed: every stage gets "
            "max_workers; global: max_workers split over stages by parallelism; autotune: "
            "every stage starts at 1 and a controller grows and shrinks the stages at run "
            "time within a CPU budget (max_workers, else the cores available to the "
            "process) and autotune_memory_bytes.",
    )
    max_workers: int | None = option(
        None, check=Int(min=1, max=MAX_WORKERS, optional=True),
        doc="Workers per stage or in total (see worker_allocation); None = cpu_count "
            "clamped to [4, 16]. At most 127: a shared-memory region token has 7 bits "
            "for its owning worker.",
    )
    autotune_memory_bytes: int | None = option(
        None, check=Int(min=1, max=MAX_CACHE_BYTES, optional=True),
        doc="worker_allocation='autotune': resident memory the process workers may use "
            "together (the controller starts no worker past it, and takes workers back, "
            "an adaptive stage's last one included, when their measured resident memory "
            "passes it); None = half the memory available when the run starts "
            "(MemAvailable, and the cgroup's memory.max).",
    )
    worker_compute_threads: int = option(
        1, check=Int(min=0, max=MAX_COMPUTE_THREADS),
        doc="Compute threads of each process worker of a pipeline stage: torch's intra-op "
            "threads, the BLAS/OpenMP pools already loaded (threadpoolctl) and "
            "OMP/OPENBLAS/MKL_NUM_THREADS for libraries loaded later and subprocesses, as "
            "torch's DataLoader sets one thread per worker; 0 = leave the libraries alone. "
            "Threads-runner stages share the consumer's pools and are not limited.",
    )
    deterministic: bool = option(
        True, check=Bool(),
        doc="Release results in sequence order (identical stream for any runner); False "
            "releases in completion order.",
    )
    prefetch_batches: int | None = option(
        None, check=Int(min=1, max=MAX_QUEUE_DEPTH, optional=True),
        doc="Batches buffered at the pipeline tail ahead of the consumer; None = "
            "max(8, 2 * max_workers).",
    )
    default_stage_prefetch: int | None = option(
        None, check=Int(min=1, max=MAX_QUEUE_DEPTH, optional=True),
        doc="Items buffered between stages; None = max(4, prefetch // 4) for process stages, "
            "max(8, prefetch // 2) for thread/inline stages.",
    )
    per_stage_prefetch: FrozenMap = option(
        FrozenMap(), check=IntKeyMap(Int(min=1, max=MAX_QUEUE_DEPTH), max_key=MAX_STAGE_INDEX),
        doc="Prefetch depth per stage index; wins over default_stage_prefetch.",
    )
    op_queue_capacity: int | None = option(
        None, check=Int(min=1, max=MAX_QUEUE_DEPTH, optional=True),
        doc="In-flight items between ops inside a stage; None = max(8, prefetch_batches) "
            "for thread and inline stages, and no item bound for process stages (their "
            "results in flight are bounded in bytes, a share of each worker's arena).",
    )
    ipc_transport: str = option(
        "socketpair", check=Str(choices=("socketpair", "pipe")),
        doc="Channel under process and MTP queues: socketpair (sized buffers, outside the "
            "per-user pipe budget, memfd arena) or pipe (stock multiprocessing).",
    )
    ipc_buffer_bytes: int = option(
        DEFAULT_IPC_BUFFER_BYTES, check=Int(min=4 * KiB, max=MAX_SOCKET_BUFFER_BYTES),
        doc="Kernel buffer requested per socketpair channel; the kernel may clamp it (a "
            "warning says so). At most 1 GiB: setsockopt takes a C int.",
    )
    mixture_config: MixtureReadConfig | None = option(
        None, check=Nested(MixtureReadConfig, optional=True),
        doc="Default read policy of mixture sources that do not set their own.",
    )
    io_options: StoreOptions = option(
        StoreOptions(), check=Nested(StoreOptions),
        doc="File opening, retries and remote caching of sources.",
    )
    allow_latency_flush_in_deterministic: bool = option(
        True, check=Bool(),
        doc="Allow emitting a partial micro-batch after a timeout in deterministic mode, for "
            "stages without batch-shape sensitive ops; False disables it there entirely.",
    )
    flush_every_k_chunks: int | None = option(
        None, check=Int(min=0, max=MAX_QUEUE_DEPTH, optional=True),
        doc="Flush sentinel every K chunks per lane (replay boundaries for history-dependent "
            "ops); None = 8 if an op breaks cursor order, else 0; 0 with such an op is an "
            "error. At most 65536: a restore replays up to K lane chunks.",
    )
    shutdown_mode: str = option(
        "immediate", check=Str(choices=("immediate", "hard", "graceful")),
        doc="What closing a run (break, an exception, close(), Ctrl-C, exit) does to a "
            "process worker busy in an op. immediate: the op is abandoned, its worker "
            "killed at once with its process group and descendants (idle workers get "
            "0.3 s to exit); hard: every worker gets 0.5 s, then SIGTERM; graceful: the op "
            "in flight may finish, up to 10 s (2 s at interpreter exit), then SIGTERM. "
            "Every child is reaped either way. A thread-runner op cannot be stopped: "
            "close() never waits for it.",
    )
    persistent_workers: bool = option(
        True, check=Bool(),
        doc="Keep a pipeline's process workers (and its MTP subprocess) up after a "
            "completed pass, for the next iter() to reuse when its stages are the same "
            "(torch's persistent_workers=True): the next epoch starts without spawning. "
            "They stop at close(), when the pipeline is garbage collected, at interpreter "
            "exit, after persistent_workers_idle_s idle, or when a run ends early (break, "
            "an error, Ctrl-C). False stops them at the end of every pass.",
    )
    persistent_workers_idle_s: float | None = option(
        300.0, check=Float(min=0.0, exclusive_min=True, max=MAX_SECONDS, optional=True),
        doc="Seconds kept workers may wait for the next pass before they are stopped "
            "(the next pass then starts new ones); None = until close(), garbage "
            "collection or exit.",
    )
    seed_global_rngs: str = option(
        "auto", check=Str(choices=("auto", "all", "off")),
        doc="Seed the global generators third-party transforms draw from (torch's default "
            "generator, NumPy's legacy np.random, Python's random) from the sample's "
            "identity before every call of a map or filter op, as ctx.rng is, and give "
            "the consumer's own states back afterwards: torchvision's and albumentations' "
            "random transforms then give the same stream on every runner. auto: the ops "
            "validation saw drawing from them; all: every map and filter op (for ops that "
            "draw only on some samples, or with auto_validation='off'); off: none (a draw "
            "is then validation error Z002).",
    )
    auto_validation: str = option(
        "strict", check=Str(choices=("strict", "warn", "off")),
        doc="Checks on user ops before iteration: strict raises ValidationError, warn "
            "warns, off skips.",
    )
    mtp_mode: bool = option(
        False, check=Bool(),
        doc="Run the whole engine in a non-daemon subprocess; the consumer only receives "
            "finished batches.",
    )
    mtp_buffer: int | None = option(
        None, check=Int(min=1, max=MAX_MTP_BUFFER, optional=True),
        doc="Batches in flight on the MTP channel; None = max(4, prefetch_batches // 2) "
            "(at most 4096 either way).",
    )
    mtp_buffer_bytes: int = option(
        DEFAULT_MTP_BUFFER_BYTES, check=Int(min=4 * KiB, max=MAX_SOCKET_BUFFER_BYTES),
        doc="Kernel buffer requested for the MTP channel (clamped by the kernel, with a "
            "warning). At most 1 GiB: setsockopt takes a C int.",
    )
    mtp_prefetch: int | None = option(
        None, check=Int(min=0, max=MAX_MTP_BUFFER, optional=True),
        doc="Batches a low-priority consumer-side thread receives ahead; None = "
            "max(4, mtp_buffer // 10) (at most mtp_buffer); 0 disables the thread.",
    )
    mtp_auto_checkpoint: bool = option(
        True, check=Bool(),
        doc="Capture the final state from the MTP subprocess when iteration completes; "
            "with world_size > 1 that is a checkpoint merged across ranks (it needs "
            "aggregate_dir and waits for every rank up to aggregate_timeout_s).",
    )
    world_size: int = option(
        1, check=Int(min=1, max=MAX_WORLD_SIZE), doc="Number of ranks in the job.",
    )
    global_rank: int = option(
        0, check=Int(min=0, max=MAX_WORLD_SIZE - 1),
        doc="This rank, 0 <= global_rank < world_size.",
    )
    dp_degree: int | None = option(
        None, check=Int(min=1, max=MAX_CANONICAL_REPLICAS, optional=True),
        doc="Number of data-parallel groups (data partitions); None = world_size; must "
            "divide world_size. Each group owns a canonical lane, so at most 4096.",
    )
    dp_group_id: int | None = option(
        None, check=Int(min=0, max=MAX_CANONICAL_REPLICAS - 1, optional=True),
        doc="Data partition of this rank; None = global_rank // (world_size // dp_degree).",
    )
    canonical_replicas: int | None = option(
        None, check=Int(min=1, max=MAX_CANONICAL_REPLICAS, optional=True),
        doc="Number of canonical lanes C (fixed for the life of a training run: restore "
            "needs the same C); None = dp_degree; must be >= dp_degree. At most 4096 "
            "(one lane stream and one lane state each; the state must fit a checkpoint).",
    )
    mapping_strategy: str | None = option(
        None, check=Str(choices=("contiguous", "interleaved"), optional=True),
        doc="Lanes to dp groups: contiguous blocks or interleaved (lane % dp_degree); "
            "None = contiguous.",
    )
    resume_accept: tuple = option(
        (), check=StrTuple(choices=("files", "samples", "mapping")),
        doc="Differences a restore lets through (with a warning) instead of raising "
            "ResumeMismatchError: 'files' (the source's files changed size, mtime or "
            "ETag), 'samples' (a lane would read other samples next than the checkpoint "
            "recorded), 'mapping' (another mapping_strategy on several dp groups).",
    )
    shm_enabled: bool = option(
        True, check=Bool(),
        doc="Move array payloads through the shared-memory arena; False = plain pickle "
            "protocol 5.",
    )
    shm_coalesce: bool = option(
        True, check=Bool(),
        doc="Group a message's eligible arrays by dtype into shared regions.",
    )
    shm_min_item_bytes: int = option(
        4096, check=Int(min=0, max=MAX_BYTES),
        doc="Private values smaller than this travel in-band.",
    )
    shm_min_new_allocation_bytes: int = option(
        2 * MiB, check=Int(min=0, max=MAX_BYTES),
        doc="A coalesced group with fewer useful bytes travels in-band instead.",
    )
    shm_min_forward_bytes: int = option(
        128 * KiB, check=Int(min=0, max=MAX_BYTES),
        doc="Views of an existing region summing to fewer bytes are copied in-band instead "
            "of forwarded.",
    )
    shm_compact_above_ratio: float | None = option(
        8.0, check=Float(min=1.0, max=MAX_RATIO, optional=True),
        doc="Compact views of a region larger than useful bytes x ratio (with enough "
            "saving); None disables compaction.",
    )
    shm_compact_min_savings_bytes: int = option(
        16 * MiB, check=Int(min=0, max=MAX_BYTES),
        doc="Least bytes a compaction must free to be worth it.",
    )
    shm_max_coalesced_bytes: int | None = option(
        16 * MiB, check=Int(min=1, max=MAX_BYTES, optional=True),
        doc="Largest coalesced region (a larger single value stands alone); None = "
            "unlimited.",
    )
    max_worker_retries: int = option(
        3, check=Int(min=0, max=MAX_RETRIES),
        doc="Re-dispatches of a sequence whose worker died by a signal; 0 disables.",
    )
    aggregate_dir: str | None = option(
        None, check=PathStr(optional=True),
        doc="Directory (local, shared or fsspec URL) where ranks exchange checkpoint state.",
    )
    aggregate_store: str | None = option(
        None, check=Str(pattern=_AGGREGATE_STORE, optional=True),
        doc="Key-value store for checkpoint exchange instead of aggregate_dir: 'torch://' "
            "(MASTER_ADDR/MASTER_PORT) or 'torch://host:port' (rank 0 hosts a store bound "
            "to that address when nothing listens there, else connects to the one that "
            "does).",
    )
    aggregate_timeout_s: float = option(
        180.0, check=Float(min=0.0, exclusive_min=True, max=MAX_SECONDS),
        doc="Budget of one checkpoint exchange; at least 90 s for a cloud aggregate_dir; "
            "at most 30 days (longer waits overflow thread and selector timeouts).",
    )
    aggregate_serializer: str = option(
        "msgpack", check=Str(choices=("json", "msgpack")),
        doc="Encoding of checkpoint state and aggregation files.",
    )
    aggregate_compressor: str = option(
        "zstd", check=Str(choices=("none", "zstd")),
        doc="Compression of checkpoint state and aggregation files.",
    )
    execution_tracking: ExecutionTrackingMode = option(
        ExecutionTrackingMode.OFF, check=EnumOf(ExecutionTrackingMode),
        doc="Statistics granularity: off, stages or nodes.",
    )
    metrics_sink_config: MetricsSinkConfig | None = option(
        None, check=Nested(MetricsSinkConfig, optional=True),
        doc="Where statistics are emitted; None = nowhere.",
    )

    def _check_cross(self) -> None:
        def bad(name: str, message: str) -> ZephonConfigError:
            return ZephonConfigError(f"RuntimeOptions.{name}: {message}",
                                     field=f"RuntimeOptions.{name}")

        if self.global_rank >= self.world_size:
            raise bad("global_rank", f"got {self.global_rank}; expected 0 <= global_rank < "
                                     f"world_size ({self.world_size})")
        dp = _r.resolve_dp_degree(self)
        if self.world_size % dp:
            raise bad("dp_degree", f"got {dp}; world_size ({self.world_size}) must be a "
                                   "multiple of dp_degree")
        group = _r.resolve_dp_group_id(self)
        if group >= dp:
            raise bad("dp_group_id", f"got {group}; expected 0 <= dp_group_id < dp_degree "
                                     f"({dp})")
        lanes = _r.resolve_canonical_replicas(self)
        if lanes > MAX_CANONICAL_REPLICAS:  # derived from dp_degree = world_size
            raise bad("dp_degree", f"got {dp} (derived from world_size={self.world_size}); "
                                   f"expected <= {MAX_CANONICAL_REPLICAS} data-parallel "
                                   "groups: set dp_degree (ranks of a group share data)")
        if lanes < dp:
            raise bad("canonical_replicas", f"got {lanes}; expected >= dp_degree ({dp}) so "
                                            "every data-parallel group owns a lane")
        if self.aggregate_dir is not None and (
                re.match(r"[A-Za-z][A-Za-z0-9+.\-]*:/(?!/)", self.aggregate_dir)
                or re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*://", self.aggregate_dir)):
            raise bad("aggregate_dir", f"got {self.aggregate_dir!r}: a URL needs a scheme, "
                                       "'://' and a path (e.g. 's3://bucket/runs'); a local "
                                       "path must not start with 'name:/'")
        if self.aggregate_dir is not None and self.aggregate_store is not None:
            raise bad("aggregate_store", "set at most one of aggregate_dir and "
                                         f"aggregate_store (got {self.aggregate_dir!r} and "
                                         f"{self.aggregate_store!r})")
        if self.mtp_mode and self.mtp_auto_checkpoint and self.world_size > 1 \
                and self.aggregate_dir is None:
            raise bad("mtp_auto_checkpoint", "with mtp_mode and world_size > 1 the final "
                      "state is a checkpoint merged across ranks, which needs aggregate_dir "
                      "(aggregate_store cannot exchange states yet); set aggregate_dir or "
                      "mtp_auto_checkpoint=False")
        if self.mtp_prefetch is not None:
            buffer = _r.resolve_mtp_buffer(self)
            if self.mtp_prefetch > buffer:
                source = "" if self.mtp_buffer is not None else " (derived; set mtp_buffer)"
                raise bad("mtp_prefetch", f"got {self.mtp_prefetch}; expected <= mtp_buffer "
                                          f"({buffer}{source})")

    def resolved(self, cpu_count: int | None = None) -> dict[str, _r.ResolvedValue]:
        """Each field's resolved value and provenance.

        Args:
            cpu_count: the CPU count to assume for derived values (None: this machine's).

        Returns:
            A dict: field name -> ``ResolvedValue(value, source)`` with ``source``
            ``"explicit"``, ``"derived"`` or ``"default"``.

        Examples:
            >>> RuntimeOptions().resolved(cpu_count=32)["max_workers"]
            ResolvedValue(value=16, source='derived')
        """
        return _r.resolve_all(self, cpu_count)
