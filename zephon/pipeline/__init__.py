"""Streaming pipelines: sources, ops, lanes, the plan and engine, checkpoint/restore."""

from zephon.pipeline import sources
from zephon.pipeline.ops import Batch, OpError
from zephon.pipeline.pipeline import Pipeline

__all__ = ["Batch", "OpError", "Pipeline", "sources"]
