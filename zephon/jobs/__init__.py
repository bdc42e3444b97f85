"""Per-subject jobs under a RunPolicy: ``run(fn, subjects, policy=RunPolicy(...))``.

See :mod:`zephon.jobs.run` for the run's lifecycle, :mod:`zephon.jobs.process`
for workers, timeouts and OOM back-off, and :mod:`zephon.jobs.store` for the
checkpoint store.
"""

from zephon.jobs.process import JobSetupError
from zephon.jobs.run import JobRun, RecordedFailure, SubjectResult, run
from zephon.jobs.store import CheckpointStore
from zephon.options import RunPolicy, resolve_backend

__all__ = ["CheckpointStore", "JobRun", "JobSetupError", "RecordedFailure", "RunPolicy",
           "SubjectResult", "resolve_backend", "run"]
