"""The diagnosis: a small rule set over a report snapshot (``stats(report=True)``).

Rules, in order (thresholds are the constants below):

1. **No steps**: fewer than two batches were delivered: nothing to judge.
2. **Input-bound or compute-bound**: the loop is *input-bound* when at least
   :data:`INPUT_BOUND_STEPS` of its steps waited for data (a step waits when the
   consumer's wait is at least :data:`~zephon.pipeline.stats.INPUT_BOUND_SHARE` of
   it), else *compute-bound*: the pipeline keeps up with the training step.
3. **Bottleneck** (input-bound only): the parallel stage with the highest ``busy``
   fraction is the bottleneck when that is at least :data:`BOTTLENECK_BUSY`; the
   advice is more workers for it (``max_workers``, ``map(parallelism=...)``), or a
   parallel runner for an inline stage. When no stage is that busy, the time goes
   outside the stages' ops: the serial ops, collation and hand-off between the
   engine and the loop (advice: fewer or cheaper serial ops, a process runner).
4. **Capacity to spare** (compute-bound only): stages ``blocked`` at least
   :data:`OVERPROVISIONED_BLOCKED` of the time wait for the consumer (with more than
   one worker: fewer workers would do).
5. **Start-up**: the first batch took at least :data:`STARTUP_SHARE` of the run.
6. **Restarts**: a stage restarted crashed workers.

:func:`diagnose` returns a :class:`Diagnosis`; its ``text`` is the report's
paragraph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BOTTLENECK_BUSY", "INPUT_BOUND_STEPS", "OVERPROVISIONED_BLOCKED",
           "STARTUP_SHARE", "Diagnosis", "diagnose", "stage_title"]

#: Share of steps that waited for data from which the loop is input-bound.
INPUT_BOUND_STEPS = 0.2
#: Busy fraction from which the busiest stage is named the bottleneck.
BOTTLENECK_BUSY = 0.75
#: Blocked fraction from which a stage of a compute-bound loop has workers to spare.
OVERPROVISIONED_BLOCKED = 0.5
#: Share of the run the start-up (the first batch) took from which it is mentioned.
STARTUP_SHARE = 0.25


@dataclass(frozen=True)
class Diagnosis:
    """``verdict``: ``"input-bound"``, ``"compute-bound"`` or ``"no-steps"``;
    ``bottleneck``: the node (``"stage1"``) named the bottleneck, if any; ``findings``:
    the sentences of ``text``, in order."""

    verdict: str
    bottleneck: str | None
    findings: tuple[str, ...] = field(default=())

    @property
    def text(self) -> str:
        return " ".join(self.findings)


def stage_title(node: str, stage: dict) -> str:
    """``"stage 1 map(decode)"`` for node ``"stage1"``."""
    return f"stage {node.removeprefix('stage')} {stage.get('label', '')}".rstrip()


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _workers(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")


def _bottleneck(stages: dict) -> tuple[str | None, list[str]]:
    """Rule 3: the bottleneck stage and the sentences about it."""
    if not stages:
        return None, ["No parallel stage ran: the time goes to the source and the serial "
                      "ops in the loop's thread; try a parallel runner (runner=\"threads\" "
                      "or \"process\")."]
    node, stage = max(stages.items(), key=lambda kv: kv[1]["busy"])
    if stage["busy"] < BOTTLENECK_BUSY:
        return None, [f"No stage is busy enough to be the bottleneck (the busiest, "
                      f"{stage_title(node, stage)}, is {_pct(stage['busy'])} busy): the time "
                      "goes to the serial ops, collation and the hand-off to the loop; try "
                      "fewer or cheaper serial ops, or runner=\"process\" to move work off "
                      "the loop's process."]
    title = f"S{stage_title(node, stage)[1:]} is the bottleneck at {_pct(stage['busy'])} busy " \
            f"with {_workers(stage['workers'])}"
    if stage["runner"] == "inline":
        advice = "try runner=\"threads\" or \"process\" so that it runs beside the loop."
    else:
        advice = (f"try more workers for it (max_workers, or map(..., parallelism="
                  f"{2 * stage['workers']})) or a cheaper op.")
    return node, [f"{title}; {advice}"]


def _spare(stages: dict) -> list[str]:
    """Rule 4: stages of a compute-bound loop that mostly wait for the consumer."""
    spare = {n: s for n, s in sorted(stages.items()) if s["blocked"] >= OVERPROVISIONED_BLOCKED}
    if not spare:
        return []
    names = ", ".join(f"{stage_title(n, s)} ({_pct(s['blocked'])} blocked)"
                      for n, s in spare.items())
    more = "; fewer workers would do" if any(s["workers"] > 1 for s in spare.values()) else ""
    return [f"Waiting for the loop most of the time: {names}{more}."]


def _context(snapshot: dict) -> list[str]:
    """Rules 5 and 6: the start-up and worker restarts."""
    out = []
    startup, elapsed = snapshot["consumer"].get("startup_s", 0.0), snapshot["elapsed_s"]
    if elapsed > 0 and startup >= STARTUP_SHARE * elapsed:
        out.append(f"Start-up (to the first batch) took {startup:.2f} s, "
                   f"{_pct(startup / elapsed)} of the run.")
    for node, stage in sorted(snapshot["stages"].items()):
        if stage.get("worker_restarts"):
            out.append(f"{stage_title(node, stage)} restarted crashed workers "
                       f"{stage['worker_restarts']} time(s).")
    return out


def diagnose(snapshot: dict) -> Diagnosis:
    """The diagnosis of a report snapshot (see the module docstring).

    Raises:
        ValueError: ``snapshot`` is not a report snapshot (schema 1).
    """
    if not isinstance(snapshot, dict) or snapshot.get("schema") != 1:
        raise ValueError("diagnose() takes stats(report=True) (schema 1), got "
                         f"{type(snapshot).__name__} without it")
    consumer, stages = snapshot["consumer"], snapshot["stages"]
    steps = consumer["batches"] - 1
    if steps < 1:
        return Diagnosis("no-steps", None, (f"Only {consumer['batches']} batch(es) were "
                                            "delivered: too few steps to judge.",
                                            *_context(snapshot)))
    bound = consumer["input_bound_fraction"]
    wait = consumer.get("wait_mean_ms", 0.0)
    compute = consumer["compute_s"] / steps * 1e3
    head = f"Input-bound {_pct(bound)} of {steps} steps (mean wait {wait:.1f} ms per step, " \
           f"{compute:.1f} ms of compute between batches)."
    if bound >= INPUT_BOUND_STEPS:
        node, more = _bottleneck(stages)
        return Diagnosis("input-bound", node, (head, *more, *_context(snapshot)))
    head = f"Compute-bound: only {_pct(bound)} of {steps} steps waited for data (mean " \
           f"wait {wait:.1f} ms per step, {compute:.1f} ms of compute between batches); " \
           "the input pipeline keeps up."
    return Diagnosis("compute-bound", None, (head, *_spare(stages), *_context(snapshot)))
