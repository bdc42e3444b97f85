"""The autotune policy: a pure function from one period's signals to a decision.

:func:`decide` takes the policy's parameters (:class:`TuningParams`), the controller's
state (:class:`TuningState`: one frozen :class:`StageState` per stage, the change on
trial as a typed :class:`Trial`) and what was measured over one sampling period
(:class:`Signals`, time included), and returns a :class:`Step` (the actions to apply,
in order, the trial judged, the period's derived fractions) with the next state. It
reads no clock, no ``/proc`` and no executor, and changes nothing it is given: the
controller (:mod:`zephon.pipeline.autotune`, whose docstring states the rule) samples
the signals, applies the actions through the executors and keeps the state.

Because the policy is pure, a run can be recorded (the state it started from, then each
period's signals, the actions decided and whether they could be applied) as plain,
JSON-serialisable dicts, and :func:`replay` runs the policy again over them: it returns
the same actions period by period.

Stages are the engine's stage indexes. A stage's *count* is its workers, 0 for an
adaptive stage running inline (its ``workers`` signal is then 1: the engine's thread,
for the busy fraction).
"""

from zephon.pipeline.tuning.period import decide, replay
from zephon.pipeline.tuning.records import (
    Action,
    ActionKind,
    Measures,
    Signals,
    StageSignals,
    StageState,
    Step,
    Trial,
    TrialKind,
    TuningParams,
    TuningState,
    to_plain,
)
from zephon.pipeline.tuning.rules import (
    changed,
    choose,
    fitting,
    initial_state,
    judge,
    judge_inline,
    measure,
    most_workers,
    take_back,
)

__all__ = ["Action", "ActionKind", "Measures", "Signals", "StageSignals", "StageState",
           "Step", "Trial", "TrialKind", "TuningParams", "TuningState", "changed",
           "choose", "decide", "fitting", "initial_state", "judge", "judge_inline",
           "measure", "most_workers", "replay", "take_back", "to_plain"]
