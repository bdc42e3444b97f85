"""RunPolicy: how a per-subject job runs, independent of what it computes.

Scheduling concerns only: worker counts and lifecycle, per-subject timeouts,
failure policy, OOM back-off, retries and the resumable checkpoint store. The
callable and the subjects are the job; the policy can change without changing
any result (seeds belong to the job, and to its fingerprint).

The effective backend is a resolver (:func:`zephon.options.resolve_backend`):
``ray`` when requested; else ``process`` when requested or when a subject
timeout is set.
"""

from __future__ import annotations

from dataclasses import dataclass

from zephon.options._spec import (
    Bool,
    Float,
    Int,
    OptionsBase,
    PathStr,
    Str,
    StrTuple,
    option,
    option_class,
)
from zephon.options.limits import MAX_COUNT, MAX_JOB_WORKERS, MAX_RETRIES, MAX_SECONDS

__all__ = ["BACKENDS", "FAILURE_POLICIES", "PARALLEL_MODES", "RunPolicy"]

BACKENDS = ("serial", "process", "ray")
FAILURE_POLICIES = ("continue", "fail_fast")
PARALLEL_MODES = ("persistent", "isolated")


@option_class
@dataclass(frozen=True, slots=True, kw_only=True)
class RunPolicy(OptionsBase):
    """Execution policy of ``zephon.jobs.run``: backend, workers, timeouts, failures, resume.

    Keyword arguments only, validated at construction (a
    :class:`~zephon.errors.ZephonConfigError` names the field, the value and what is
    allowed).

    Examples:
        >>> policy = RunPolicy(backend="process", workers=4, subject_timeout_sec=600,
        ...                    on_subject_failure="fail_fast", checkpoint_dir="ckpt")
        >>> policy.replace(workers=2).workers
        2
    """

    workers: int = option(
        1, check=Int(min=1, max=MAX_JOB_WORKERS),
        doc="Concurrent worker processes (process backend); concurrent subjects on the Ray "
            "cluster (ray backend); at most 1024.",
    )
    backend: str = option(
        "serial", check=Str(choices=BACKENDS),
        doc="serial runs subjects in this process; process in spawned workers; ray as Ray "
            "actors (persistent mode) or tasks (isolated mode) on the cluster ray.init "
            "reaches (RAY_ADDRESS, else a local one; needs the zephon[ray] extra). A subject "
            "timeout turns serial into process (it cannot be enforced in-process); ray stays "
            "ray (a timeout kills the Ray worker).",
    )
    subject_timeout_sec: float | None = option(
        900.0, check=Float(min=0.0, exclusive_min=True, max=MAX_SECONDS, optional=True),
        doc="Seconds a subject may run, counted from when it starts in the worker; on expiry "
            "the worker's process group is terminated, then killed after "
            "graceful_shutdown_sec (ray backend: the Ray worker is killed). None disables; "
            "at most 30 days (longer waits overflow the runtime's timeouts).",
    )
    subject_spawn_timeout_sec: float | None = option(
        120.0, check=Float(min=0.0, exclusive_min=True, max=MAX_SECONDS, optional=True),
        doc="Seconds a worker (first start or replacement) may take to become ready, "
            "callable unpickled and setup() done (ray backend: an actor's setup() from when Ray "
            "placed it); None disables; at most 30 days.",
    )
    graceful_shutdown_sec: float = option(
        15.0, check=Float(min=0.0, exclusive_min=True, max=MAX_SECONDS),
        doc="Grace between terminate and kill, for timeouts, fail_fast and Ctrl-C; at most "
            "30 days.",
    )
    on_subject_failure: str = option(
        "continue", check=Str(choices=FAILURE_POLICIES),
        doc="continue: keep the error in the subject's result; fail_fast: stop every worker "
            "at once and raise the subject's exception.",
    )
    oom_backoff: bool = option(
        True, check=Bool(),
        doc="After an OOM (MemoryError, or death by SIGKILL; on ray also Ray's memory "
            "monitor or a worker that died while its node stayed up) lower the concurrency for "
            "the rest of the run, retry rounds included.",
    )
    oom_reduce_workers_by: int = option(
        1, check=Int(min=1, max=MAX_JOB_WORKERS),
        doc="Workers removed per OOM back-off; the concurrency never drops below one.",
    )
    cap_workers_to_gpu_pool: bool = option(
        False, check=Bool(),
        doc="Cap workers to the visible GPU count and give each worker a distinct "
            "ZEPHON_GPU_SLOT (ray backend: the cluster's GPU resources; each worker requests "
            "num_gpus=1 and its slot is the GPU id Ray assigned).",
    )
    resume: bool = option(
        True, check=Bool(),
        doc="Serve subjects already stored in the checkpoint store instead of recomputing.",
    )
    checkpoint_dir: str | None = option(
        None, check=PathStr(optional=True),
        doc="Checkpoint store directory; None = a default under the working directory when "
            "resume is on.",
    )
    parallel_mode: str = option(
        "persistent", check=Str(choices=PARALLEL_MODES),
        doc="persistent: long-lived workers, setup() once each; isolated: a fresh child per "
            "subject.",
    )
    auto_retry_rounds: int = option(
        2, check=Int(min=0, max=MAX_RETRIES),
        doc="Extra rounds within one run for subjects that failed; 0 disables.",
    )
    retry_failed_subjects: bool = option(
        False, check=Bool(),
        doc="Re-run subjects whose failure an earlier run recorded in the store (else the "
            "recorded failure is reported again).",
    )
    force_rerun_subjects: tuple = option(
        (), check=StrTuple(),
        doc="Subject ids recomputed even when the store has them.",
    )
    clear_checkpoint_on_success: bool = option(
        False, check=Bool(),
        doc="Remove the store after the run when every subject's final outcome, replayed "
            "ones included, is a success.",
    )
    strict_checkpoint_hash: bool = option(
        False, check=Bool(),
        doc="A store written under another fingerprint raises instead of being ignored.",
    )
    persistent_worker_max_consecutive_failures: int = option(
        10, check=Int(min=1, max=MAX_RETRIES),
        doc="Restart a persistent worker after this many consecutive failed subjects (a "
            "crash or a timeout always replaces it; an ordinary exception alone keeps the "
            "worker and its setup()).",
    )
    persistent_worker_recycle_after_tasks: int = option(
        0, check=Int(min=0, max=MAX_COUNT),
        doc="Replace a persistent worker after this many successes (0 = never); its last "
            "result is never lost.",
    )
