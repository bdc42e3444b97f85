"""Per-subject jobs under a RunPolicy: ``run(fn, subjects, policy=RunPolicy(...))``.

See :mod:`zephon.jobs.runner` for the run's lifecycle, :mod:`zephon.jobs.process`
for workers, timeouts and OOM back-off, and :mod:`zephon.jobs.store` for the
checkpoint store.

Names load on first use: a job worker imports :mod:`zephon.jobs.worker` only, and
must not pay for the run loop, the store (NumPy, msgpack, zstd) or the options.
"""

_LAZY = {"JobSetupError": "zephon.jobs.process", "JobRun": "zephon.jobs.runner",
         "RecordedFailure": "zephon.jobs.runner", "SubjectResult": "zephon.jobs.runner",
         "run": "zephon.jobs.runner", "CheckpointStore": "zephon.jobs.store",
         "RunPolicy": "zephon.options", "resolve_backend": "zephon.options"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon.jobs' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
