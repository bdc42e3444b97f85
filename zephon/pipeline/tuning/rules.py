"""The autotune policy's pure helpers: judging a trial, choosing the stage to grow,
taking workers back within the memory budget, the period's fractions and the state's
small moves (see :mod:`zephon.pipeline.tuning`)."""


from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

from zephon.pipeline.tuning.records import (
    Measures,
    Signals,
    StageState,
    TuningParams,
    TuningState,
)

__all__ = ["changed", "choose", "fitting", "initial_state", "judge", "judge_inline",
           "measure", "most_workers", "take_back"]


# -- the pure helpers ---------------------------------------------------------------------
def judge(params: TuningParams, before: float, after: float) -> bool:
    """Whether a grow (a move to processes) paid: ``after`` at least the gain above."""
    return after >= before * (1.0 + params.trial_gain)


def judge_inline(params: TuningParams, before: float, after: float) -> bool:
    """Whether a move back inline is kept: ``after`` at most the gain below ``before``
    (inline holds no process and no memory: it may be a little slower and still win)."""
    return after * (1.0 + params.trial_gain) >= before


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def _worth_moving(params: TuningParams, profile: tuple[float | None, float | None] | None
                  ) -> bool:
    """Whether an inline stage's samples cost enough for processes to pay; unknown
    costs: not yet."""
    if profile is None or profile[0] is None:
        return False
    per_sample_s, per_sample_bytes = profile[0], profile[1]
    if per_sample_s < params.move_min_sample_s:
        return False
    return not per_sample_bytes or per_sample_s / per_sample_bytes >= params.move_min_byte_s


def _pays(params: TuningParams, spent: float, progress: tuple[int, int] | None) -> bool:
    """Whether the work left in the run, at the op seconds ``spent`` so far per source
    sample read, would take at least ``move_payback_s`` (None progress: for ever)."""
    if progress is None:
        return True
    read, left = progress
    return read > 0 and spent / read * left >= params.move_payback_s


def take_back(rss: Mapping[int, tuple[int, ...]], budget: int, counts: Mapping[int, int],
              floors: Mapping[int, int]) -> tuple[int, int, str] | None:
    """The memory budget's decision: None while the process workers' resident bytes
    (``rss``: per stage, each worker's) add up to at most ``budget``; else ``(stage,
    workers after, reason)``: the stage holding the most that has workers above its floor
    (``counts``: its workers now; ``floors``: the fewest it may keep, 0 for an adaptive
    stage: inline) gives back the fewest after which the total fits whichever of its
    workers go (its smallest are counted), down to its floor. A stage running inline
    (count 0) that still has workers (a parked pool) comes first: ``(stage, 0, reason)``.
    ``workers after`` equals ``counts[stage]`` (> 0) when no stage has a worker left to
    give back (the reason says so)."""
    total = sum(sum(sizes) for sizes in rss.values())
    if total <= budget:
        return None
    over = f"memory budget: workers resident {_mib(total)} > {_mib(budget)}"
    for s in sorted(rss, key=lambda x: (counts.get(x, 0) > 0, -sum(rss[x]), x)):
        n, floor = counts.get(s, 0), floors.get(s, 1)
        if n == 0:
            return s, 0, f"{over}, stage {s}'s parked workers {_mib(sum(rss[s]))}: stopped"
        if n <= floor:
            continue
        left, k = total, 0
        for size in sorted(rss[s])[:n - floor]:
            if left <= budget:
                break
            left, k = left - size, k + 1
        return s, n - k, f"{over}, stage {s}'s {_mib(sum(rss[s]))}: takes {k} back"
    s = max(rss, key=lambda x: (sum(rss[x]), -x))
    return s, counts.get(s, 0), (f"memory budget {_mib(budget)} passed, stage {s} holding "
                                 f"the most: no worker left to take back (raise "
                                 f"autotune_memory_bytes, or keep less in the op's workers)")


def _waiting(params: TuningParams, m: Measures, s: int) -> bool:
    return s in m.cpu and m.cpu[s] < params.waiting_cpu * m.busy[s]


def choose(params: TuningParams, m: Measures, workers: Mapping[int, int],
           caps: Mapping[int, int], budget: int, idle: Mapping[int, int],
           memory_ok: Callable[[int, int], bool],
           waiting_caps: Mapping[int, int] | None = None
           ) -> tuple[tuple[int, int, str] | None, dict[int, int]]:
    """The rule's grow or shrink over the stages on workers (``workers``: their counts):
    ``((stage, workers more (> 0) or -1, reason) or None, the idle periods after it)``;
    ``idle``: the periods in a row each stage could have lost a worker;
    ``memory_ok(stage, n)``: whether ``n`` more workers fit; ``waiting_caps``: the caps
    of the stages that may grow past the budget while their workers wait."""
    busy = m.busy
    after = {s: idle.get(s, 0) + 1 if w > 1 and busy[s] * w / (w - 1) < params.busy_shrink
             else 0 for s, w in workers.items()}
    if m.wait >= params.wait_grow:
        grow = _grow(params, m, workers, caps, budget, memory_ok, waiting_caps or {})
        if grow is not None:
            return grow, after
    for s in sorted(workers, key=lambda x: busy[x]):
        if after[s] >= params.shrink_periods:
            after[s] = 0
            return (s, -1, f"busy {busy[s]:.0%} with {workers[s]} for "
                    f"{params.shrink_periods} periods"), after
    return None, after


def _grow(params: TuningParams, m: Measures, workers: Mapping[int, int],
          caps: Mapping[int, int], budget: int, memory_ok: Callable[[int, int], bool],
          waiting_caps: Mapping[int, int]) -> tuple[int, int, str] | None:
    def cap(x: int) -> int:
        return max(caps[x], waiting_caps.get(x, 0)) if _waiting(params, m, x) else caps[x]

    open_ = [s for s in workers if workers[s] < cap(s) and m.busy[s] >= params.busy_grow]
    if not open_:
        return None
    s = max(open_, key=lambda x: (m.busy[x], -x))
    why = f"the consumer waited {m.wait:.0%}, stage {s} busy {m.busy[s]:.0%}"
    if sum(workers.values()) < budget and workers[s] < caps[s]:
        return (s, +1, why) if memory_ok(s, 1) else None
    if _waiting(params, m, s):
        used = sum(workers[x] * m.cpu.get(x, 1.0) for x in workers)
        if used + m.cpu[s] <= budget:
            return _double(m, workers, s, cap(s), budget - used, used, budget, why,
                           memory_ok)
    donors = [d for d in workers if d != s and workers[d] > 1
              and m.busy[d] * workers[d] / (workers[d] - 1) < params.busy_grow]
    if donors:
        d = min(donors, key=lambda x: (m.busy[x], x))
        return d, -1, f"CPU budget {budget} full: gives a worker to stage {s} ({why})"
    return None


def _double(m: Measures, workers: Mapping[int, int], s: int, cap: int, spare_cpu: float,
            used: float, budget: int, why: str, memory_ok: Callable[[int, int], bool]
            ) -> tuple[int, int, str] | None:
    """A waiting stage's grow: as many workers more as it has, bounded by its waiting cap,
    the CPU the new ones are measured to need and the memory budget (a stage waiting on
    storage may want tens of workers: one at a time would take a minute)."""
    cpu = m.cpu[s]
    room = int(spare_cpu / cpu) if cpu > 0 else workers[s]
    k = max(1, min(workers[s], cap - workers[s], room))
    while k > 1 and not memory_ok(s, k):
        k //= 2
    if k > 1 or memory_ok(s, 1):
        return s, +k, (f"{why}, its workers use {cpu:.0%} of a core each "
                       f"(all: {used:.1f} of {budget}): past the CPU budget")
    return None


def measure(state: TuningState, sig: Signals) -> Measures:
    """The period's fractions (see :class:`Measures`)."""
    elapsed = max(sig.now - sig.start, 1e-9)
    busy: dict[int, float] = {}
    cpu: dict[int, float] = {}
    for g in sig.stages:
        busy[g.stage] = min(1.0, g.op_s / (g.workers * elapsed))
        if state.of(g.stage).adaptive and g.runner == "inline":
            if g.demand_s is not None:  # else not reported: CPU-bound, as a thread stage
                cpu[g.stage] = min(1.0, g.demand_s / elapsed)
        elif g.cpu_s is not None:
            cpu[g.stage] = min(1.0, g.cpu_s / (g.workers * elapsed))
    return Measures(busy, cpu, min(1.0, sig.wait_s / elapsed), sig.items / elapsed,
                    {g.stage: g.rss for g in sig.stages if g.rss})


def _count(state: TuningState, sig: Signals, stage: int) -> int:
    g = sig.of(stage)
    return 0 if state.of(stage).adaptive and g.runner == "inline" else g.workers


def _inline(state: TuningState, sig: Signals) -> set[int]:
    return {ss.stage for ss in state.stages
            if ss.adaptive and sig.of(ss.stage).runner == "inline"}


def _caps_now(params: TuningParams, state: TuningState, inline: set[int]) -> dict[int, int]:
    """Each stage's cap now: the budget less one worker per other stage on it not inline
    (a stage with a budget of its own: that budget)."""
    out = {}
    for ss in state.stages:
        if ss.budget is not None:
            out[ss.stage] = ss.budget
            continue
        others = sum(1 for t in state.stages if t.stage != ss.stage and t.stage not in inline
                     and t.budget is None)
        most = max(1, state.cpu_budget - others)
        out[ss.stage] = min(most, params.max_process_workers) if ss.process else most
    return out


def initial_state(params: TuningParams, stages: Mapping[int, tuple[bool, bool]],
                  cpu_budget: int, memory_bytes: int, started: float,
                  budgets: Mapping[int, int] | None = None) -> TuningState:
    """The state a run starts from: ``stages``: stage -> ``(adaptive, process)``;
    ``budgets``: the stages whose workers draw on CPUs of their own (a Ray stage: the
    cluster's), apart from the host's ``cpu_budget``, which is at least one worker per
    other stage pinned to workers."""
    own = dict(budgets or {})
    host = {s: v for s, v in stages.items() if s not in own}
    pinned = sum(1 for adaptive, _ in host.values() if not adaptive)
    budget = max(cpu_budget, pinned, 1)
    most = max(1, budget - (len(host) - 1))
    records = []
    for s, (adaptive, process) in sorted(stages.items()):
        if s in own:
            records.append(StageState(s, adaptive, process, cap=max(1, own[s]),
                                      budget=max(1, own[s])))
            continue
        records.append(StageState(
            s, adaptive, process,
            cap=min(most, params.max_process_workers) if process else most,
            waiting_cap=(min(params.waiting_factor * budget, params.max_process_workers)
                         if process else 0)))
    return TuningState(budget, memory_bytes, started, tuple(records))


def most_workers(params: TuningParams, state: TuningState, stage: int) -> int:
    """The most workers ``stage``'s executor may ever have (its lane windows' size): the
    budget less one per other pinned stage (adaptive ones may all be inline), or its
    waiting cap."""
    ss = state.of(stage)
    if ss.budget is not None:
        return ss.budget
    others = sum(1 for t in state.stages if not t.adaptive and t.budget is None) - \
        (not ss.adaptive)
    top = state.cpu_budget - others
    return max(min(top, params.max_process_workers) if ss.process else top, ss.waiting_cap)


def _hold(state: TuningState, why: str) -> TuningState:
    return state if why == state.held else replace(state, held=why)


def _held(until: float, now: float) -> bool:
    return until > now


def changed(state: TuningState, stage: int | None = None) -> TuningState:
    """The state after a change of ``stage`` (None: a change carried in, not decided):
    the new setting settles, its run starts at the next period, nothing is held."""
    state = replace(state, settled=False, run_since=None, run_items=0, held="")
    return state if stage is None else state.update(stage, decided=True)


def _fail(params: TuningParams, state: TuningState, stage: int, what: str, now: float
          ) -> tuple[TuningState, float]:
    """One more change of kind ``what`` ("grow", "in", "out") that did not pay: held for
    ``hold_s`` doubled with each in a row, at most ``hold_max_s``."""
    fails = getattr(state.of(stage), f"fails_{what}") + 1
    hold = min(params.hold_s * 2 ** (fails - 1), params.hold_max_s)
    return state.update(stage, **{f"fails_{what}": fails, f"held_{what}": now + hold}), hold


def _memory_ok(state: TuningState, sig: Signals, rss: Mapping[int, tuple[int, ...]],
               stage: int, n: int, size: int | None = None) -> tuple[bool, str]:
    """Whether ``n`` more workers of ``stage`` (each as large as its largest, or ``size``
    bytes) fit in the memory budget beside the workers' resident bytes; else why not."""
    if sig.of(stage).runner != "process" and size is None:
        return True, ""
    if size is None:
        size = max(rss.get(stage, ()), default=0)
    need = sum(sum(sizes) for sizes in rss.values()) + n * size
    if need <= state.memory_bytes:
        return True, ""
    return False, (f"memory budget: {need >> 20} MiB with {n} more worker(s) of stage "
                   f"{stage} > {state.memory_bytes >> 20} MiB")


def _new_worker_size(params: TuningParams, sig: Signals) -> int:
    """The bytes a worker not started yet counts at: the largest process worker running,
    else this process's, at most ``new_worker_bytes`` (0: unknown)."""
    sizes = [size for g in sig.stages for size in g.rss]
    return max(sizes, default=0) or min(sig.own_rss, params.new_worker_bytes)


def fitting(params: TuningParams, state: TuningState, sig: Signals, stage: int, n: int
            ) -> tuple[int, TuningState]:
    """The most of ``n`` new workers of adaptive ``stage`` that fit in the memory budget
    (0: none; the reason held)."""
    size = _new_worker_size(params, sig)
    rss = {g.stage: g.rss for g in sig.stages if g.rss}
    while n >= 1:
        ok, why = _memory_ok(state, sig, rss, stage, n, size)
        if ok:
            break
        state = _hold(state, why)
        n = n - 1 if n <= params.move_workers else n // 2
    return n, state
