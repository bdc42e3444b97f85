"""Job callables for the Ray backend tests (module level: Ray workers import them by name,
so the tests put this directory on the workers' PYTHONPATH).

Subjects are the dicts of :mod:`_job_fns` (``subject_id``, ``dir``, ``action``, ``arg``);
``where`` runs them through :func:`_job_fns.work` and adds which Ray node and process ran
the subject, so a test can assert where subjects landed.
"""

from __future__ import annotations

import os

import _job_fns as J


def where(subject):
    """``{"value": work(subject), "node": <Ray node id>, "pid": <worker pid>}``."""
    import ray

    value = J.work(subject)
    return {"value": value, "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid()}


def noop(subject):
    """Returns the subject unchanged (for overhead and batching checks)."""
    return subject


def kill_once(subject):
    """SIGKILLs its own worker process on the first attempt (a marker file remembers it),
    then runs :func:`_job_fns.work` like any other subject."""
    import signal

    marker = os.path.join(subject["dir"], f"{subject['subject_id']}.killed")
    if not os.path.exists(marker):
        with open(marker, "w") as fh:
            fh.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return J.work(subject)


def gpu_slot(subject):
    """Sleeps ``subject["arg"]`` seconds, then reports ``ZEPHON_GPU_SLOT``, the
    ``CUDA_VISIBLE_DEVICES`` Ray set, and the worker pid."""
    import time

    time.sleep(subject.get("arg") or 0)
    return {"slot": os.environ.get("ZEPHON_GPU_SLOT"),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}
