"""Compute threads of a worker process: how many threads its numerical libraries use.

What it owns: :class:`ComputeThreads`, which a worker process makes once, after
it has unpickled the code it runs and before its first task (it applies the
limit then), and asks :meth:`~ComputeThreads.before_task` before every task. N workers on
a machine of C cores that each keep a thread pool as large as the machine run
N x C threads, and torch ops or BLAS calls in two pipeline workers run many
times slower than with one thread each. torch's DataLoader sets one intra-op thread
per worker for the same reason; zephon does the same by default
(``RuntimeOptions.worker_compute_threads = 1``; the pipeline's process stage
workers, ``zephon.transport.worker``) and in job workers (``zephon.jobs.worker``).

For ``n >= 1`` it sets, in this order:

- ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` (and the
  ``VECLIB``/``NUMEXPR`` ones, and ``RAYON_NUM_THREADS``: the Rust thread pool of
  Hugging Face ``tokenizers``, which its ``encode_batch`` starts on its first parallel
  call and sizes to the machine otherwise) in ``os.environ``: read by a library loaded later
  in the process (torch imported by the first task initialises its pools from
  them) and inherited by subprocesses the worker starts. They are overwritten:
  the option is the one setting for the worker (a parent's values would be the
  machine-wide choice this replaces);
- the pools of the BLAS and OpenMP libraries already loaded (NumPy's OpenBLAS,
  torch's libgomp), through threadpoolctl, for the rest of the process;
- ``torch.set_num_threads(n)`` when torch is already imported, and otherwise
  before the first task after a task imported it. A task that imports torch
  itself runs with the pool torch sized from ``OMP_NUM_THREADS=n``: ``n`` for
  ``n`` up to the cores, the cores for more (2 threads on 2 cores with ``n = 3``)
  until the next task. The check is a dictionary lookup per task
  until torch appears. torch is never imported here: a worker
  whose code does not use it does not pay for it.

Spawn imports the user's ``__main__`` before the worker's entry point runs, so
libraries that script imports are loaded (with the parent's environment) by
the time this runs: that is why the environment alone is not enough and the
loaded pools are limited too. ``n == 0`` leaves everything alone.

It only suits a process that is one of several workers: the limits are
process-wide (OpenBLAS and torch have one pool per process), so it is never
applied to threads-runner stages, which share the consumer's process and would
slow its own computations (the training step) as well.
"""

from __future__ import annotations

import logging
import os
import sys

from zephon._modules import imported

__all__ = ["THREAD_ENV_VARS", "ComputeThreads", "compute_threads_report",
           "limit_compute_threads"]

log = logging.getLogger("zephon.transport.threads")

#: environment variables the limit sets, read by the libraries at load time
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                   "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "RAYON_NUM_THREADS")


def limit_compute_threads(n: int) -> None:
    """Limit this process's numerical libraries to ``n`` threads (0: leave them alone).

    Args:
        n: threads per pool, an int >= 0.
    """
    if not n:
        return
    for name in THREAD_ENV_VARS:
        os.environ[name] = str(n)
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
    except ImportError:  # a core dependency; without it only the env vars and torch act
        log.debug("threadpoolctl is missing: loaded BLAS/OpenMP pools are not limited")
    else:
        threadpool_limits(limits=n)  # not as a context: for the rest of the process
    _limit_torch(n)


def _limit_torch(n: int) -> bool:
    """``torch.set_num_threads(n)`` if torch is imported; whether it was."""
    set_threads = getattr(imported("torch"), "set_num_threads", None)
    if not callable(set_threads):
        return False
    set_threads(n)
    return True


class ComputeThreads:
    """The compute-thread limit of one worker process: applied at construction, and to
    torch once more before the first task after torch was imported by a task.

    Args:
        n: threads per pool, an int >= 0 (0: leave the libraries alone).
    """

    __slots__ = ("_torch_pending", "n")

    def __init__(self, n: int) -> None:
        self.n = n
        limit_compute_threads(n)
        self._torch_pending = bool(n) and "torch" not in sys.modules

    def before_task(self) -> None:
        """Limit torch's threads if a task imported torch since the last check."""
        if self._torch_pending and imported("torch") is not None:
            self._torch_pending = not _limit_torch(self.n)


def compute_threads_report() -> dict:
    """What this process's libraries use now: ``{"torch": n or None, "pools": {api: n}}``
    (torch only when imported; ``pools`` from threadpoolctl, by internal API). For tests and
    diagnostics; never imports torch."""
    torch = sys.modules.get("torch")
    pools: dict = {}
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        pass
    else:
        for info in threadpool_info():
            pools[info["internal_api"]] = info["num_threads"]
    get = getattr(torch, "get_num_threads", None)
    return {"torch": get() if callable(get) else None, "pools": pools}
