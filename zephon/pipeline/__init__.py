"""Streaming pipelines: sources, ops, lanes, the plan and engine, checkpoint/restore.

Names load on first use: a worker unpickling a stage program needs
``zephon.pipeline.program`` and the ops, not the engine, the runners or the
checkpoint code.
"""

_LAZY = {"Pipeline": "zephon.pipeline.pipeline", "Batch": "zephon.pipeline.records",
         "BatchList": "zephon.pipeline.records",
         "OpError": "zephon.errors", "sources": "zephon.pipeline.sources"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon.pipeline' has no attribute {name!r}")
    import importlib

    loaded = importlib.import_module(module)
    value = loaded if name == "sources" else getattr(loaded, name)
    globals()[name] = value
    return value
