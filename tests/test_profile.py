"""The report-grade statistics, the diagnosis rules, zephon.profile and
``python -m zephon profile``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import _profile_fns as F
import numpy as np
import pytest

import zephon
from zephon import Pipeline, RuntimeOptions, ZephonConfigError, sources
from zephon.options.metrics import TRACKING_ENV, effective_tracking
from zephon.pipeline.engine import pool_config
from zephon.pipeline.stats import MAX_BUCKETS, _Series
from zephon.report import diagnose
from zephon.report.diagnose import BOTTLENECK_BUSY, INPUT_BOUND_STEPS
from zephon.transport import WorkerPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def two_stages(first, second, runner="threads", n=480, **opts):
    """source -> map(first) -> shuffle (a serial op: two parallel stages) -> map(second)."""
    return Pipeline(sources.from_sequence(list(range(n))), chunk_size=8) \
        .map(first).shuffle(16).map(second).batch(8) \
        .options(RuntimeOptions(runner=runner, **opts))


# -- the snapshot ------------------------------------------------------------------------

def test_report_snapshot_schema_and_fractions():
    pipe = two_stages(F.cheap, F.slow, execution_tracking="stages")
    batches = len(list(pipe))
    snap = pipe.stats(report=True)
    assert snap["schema"] == 1 and snap["mode"] == "stages" and snap["elapsed_s"] > 0
    assert set(snap["stages"]) == {"stage0", "stage1"} == set(pipe.stats())
    for node, stage in snap["stages"].items():
        assert stage["busy"] + stage["idle"] + stage["blocked"] == pytest.approx(1.0)
        assert min(stage["busy"], stage["idle"], stage["blocked"]) >= 0
        assert stage["worker_starts"] == stage["worker_stops"] == stage["workers"]
        row = pipe.stats()[node]  # the counters' rows carry the same fractions
        assert row["busy_fraction"] == pytest.approx(stage["busy"], abs=0.05)
    assert snap["stages"]["stage1"]["label"] == "map(slow)"
    assert snap["stages"]["stage1"]["busy_s"] >= 480 * F.SLOW_S * 0.9
    consumer = snap["consumer"]
    assert consumer["batches"] == batches and consumer["startup_s"] > 0
    assert consumer["wait_p50_ms"] <= consumer["wait_p99_ms"]
    series = snap["series"]
    n = len(series["t"])
    assert all(len(v) == n for k, v in series.items() if k not in ("t", "bucket_s"))
    assert sum(series["batches"]) == batches
    assert sum(series["stage1.samples"]) == 480
    assert all(0.0 <= v <= 1.0 for v in series["stage1.busy"])
    assert [e["kind"] for e in snap["events"]].count("start") == 2


def test_tracking_off_has_no_report():
    pipe = two_stages(F.cheap, F.cheap)
    list(pipe)
    assert pipe.stats() == {} and pipe.stats(report=True) == {}


def test_series_doubles_its_buckets_and_keeps_totals():
    series = _Series(t0=0.0)
    for k in range(3 * MAX_BUCKETS):  # 0.1 s apart: three times the buckets it keeps
        series.add(k * 0.1, ("batches", 1))
        series.peak(k * 0.1, "stage0.depth", k % 7)
    out = series.export(3 * MAX_BUCKETS * 0.1 - 0.05, {})
    assert len(out["t"]) <= MAX_BUCKETS and out["bucket_s"] == pytest.approx(0.4)
    assert sum(out["batches"]) == 3 * MAX_BUCKETS
    assert max(out["stage0.depth"]) == 6  # peaks merge by max, not by sum


def test_process_workers_send_their_timing_with_results():
    off = WorkerPool(F.square, 1, config=pool_config(RuntimeOptions()))
    on = WorkerPool(F.square, 1, config=pool_config(RuntimeOptions(execution_tracking="stages")))
    try:
        off.start()
        on.start()
        off.submit(3)
        on.submit(3)
        plain, timed = off.get(timeout=60), on.get(timeout=60)
    finally:
        off.close()
        on.close()
    assert plain.value == timed.value == 9
    assert plain.timing is None
    # the op seconds alone come back either way: the dispatch sizes its parts by them
    assert plain.busy_s is not None and plain.busy_s >= 0 and timed.busy_s >= 0
    busy, placing, nbytes = timed.timing
    assert busy >= 0 and placing >= 0 and nbytes == 0


def test_process_stage_reports_busy_time_and_arena_bytes():
    pipe = Pipeline(sources.from_callable(96, F.array_sample), chunk_size=8) \
        .map(F.slow_array).batch(8) \
        .options(RuntimeOptions(runner="process", max_workers=1,
                                execution_tracking="stages", persistent_workers=False))
    assert len(list(pipe)) == 12  # (with persistent workers they are kept: no stop)
    stage = pipe.stats(report=True)["stages"]["stage0"]
    assert stage["runner"] == "process"
    assert stage["busy_s"] >= 96 * F.SLOW_S * 0.9  # measured in the worker
    assert stage["arena_bytes"] >= 96 * 131072 * 4  # the arrays went through the arena
    assert stage["worker_starts"] == stage["worker_stops"] == stage["workers"]


# -- the environment variable ---------------------------------------------------------------

def test_tracking_env_raises_the_mode_never_lowers_it(monkeypatch):
    monkeypatch.delenv(TRACKING_ENV, raising=False)
    assert effective_tracking("off") == "off"
    monkeypatch.setenv(TRACKING_ENV, "nodes")
    assert effective_tracking("off") == "nodes"
    pipe = two_stages(F.cheap, F.cheap)  # its options say off
    list(pipe)
    assert pipe.stats()["tail"]["delivered"] == 60
    monkeypatch.setenv(TRACKING_ENV, "stages")
    assert effective_tracking("nodes") == "nodes"
    monkeypatch.setenv(TRACKING_ENV, "everything")
    with pytest.raises(ZephonConfigError, match="'everything'"):
        effective_tracking("off")


# -- the diagnosis on real runs -------------------------------------------------------------

@pytest.mark.parametrize("slow_stage", [0, 1])
def test_diagnosis_names_the_stage_made_slow(slow_stage):
    ops = (F.slow, F.cheap) if slow_stage == 0 else (F.cheap, F.slow)
    report = zephon.profile(two_stages(*ops), steps=40)
    d = report.diagnosis
    assert d.verdict == "input-bound" and d.bottleneck == f"stage{slow_stage}"
    assert f"Stage {slow_stage} map(slow) is the bottleneck" in d.text
    assert report.snapshot["stages"][f"stage{slow_stage}"]["busy"] >= BOTTLENECK_BUSY


def test_diagnosis_names_a_slow_process_stage():
    pipe = Pipeline(sources.from_callable(160, F.array_sample), chunk_size=8) \
        .map(F.slow_array).batch(8).options(RuntimeOptions(runner="process", max_workers=1))
    d = zephon.profile(pipe).diagnosis
    assert d.verdict == "input-bound" and d.bottleneck == "stage0"
    assert "map(slow_array) is the bottleneck" in d.text and "1 worker" in d.text


def test_slow_consumer_is_compute_bound():
    report = zephon.profile(two_stages(F.cheap, F.cheap), steps=30, step_time=F.slow_step)
    d = report.diagnosis
    assert d.verdict == "compute-bound" and d.bottleneck is None
    assert d.text.startswith("Compute-bound") and "input-bound" not in d.text.lower()
    assert report.snapshot["consumer"]["input_bound_fraction"] < INPUT_BOUND_STEPS


def test_profile_leaves_the_pipeline_where_it_was():
    pipe = two_stages(F.cheap, F.cheap)
    report = zephon.profile(pipe, steps=5)
    assert report.snapshot["consumer"]["batches"] == 5
    assert pipe.stats() == {}  # it ran a copy
    firsts = []
    for p in (pipe, two_stages(F.cheap, F.cheap)):
        it = iter(p)
        firsts.append(np.asarray(next(it)))
        it.close()
    assert np.array_equal(*firsts)  # the pipeline starts at its start, as a fresh one


@pytest.mark.parametrize("kwargs, name", [({"steps": 0}, "steps"), ({"steps": 1.5}, "steps"),
                                          ({"seconds": -1}, "seconds"),
                                          ({"step_time": "fast"}, "step_time")])
def test_profile_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ZephonConfigError, match=name):
        zephon.profile(two_stages(F.cheap, F.cheap), **kwargs)


# -- the diagnosis rules on made-up snapshots ---------------------------------------------------

def snapshot(bound=0.5, batches=50, stages=None, startup=0.1, elapsed=10.0):
    stages = stages if stages is not None else {
        "stage0": stage(busy=0.2, blocked=0.7), "stage1": stage(busy=0.9, blocked=0.05)}
    return {"schema": 1, "elapsed_s": elapsed, "stages": stages, "events": [],
            "consumer": {"batches": batches, "startup_s": startup, "wait_s": 1.0,
                         "compute_s": 2.0, "wait_mean_ms": 20.0,
                         "input_bound_fraction": bound}}


def stage(busy, blocked, workers=2, runner="process", label="map(decode)", restarts=0):
    return {"busy": busy, "blocked": blocked, "idle": 1 - busy - blocked,
            "workers": workers, "runner": runner, "label": label,
            "worker_restarts": restarts}


def test_rule_input_bound_names_the_busiest_stage():
    d = diagnose(snapshot(bound=0.37))
    assert d.verdict == "input-bound" and d.bottleneck == "stage1"
    assert d.text.startswith("Input-bound 37 % of 49 steps")
    assert "Stage 1 map(decode) is the bottleneck at 90 % busy with 2 workers" in d.text
    assert "parallelism=4" in d.text


def test_rule_no_stage_busy_enough_points_outside_the_stages():
    d = diagnose(snapshot(stages={"stage0": stage(busy=0.5, blocked=0.1)}))
    assert d.verdict == "input-bound" and d.bottleneck is None
    assert "No stage is busy enough" in d.text and "serial ops" in d.text


def test_rule_inline_bottleneck_suggests_a_parallel_runner():
    d = diagnose(snapshot(stages={"stage0": stage(0.95, 0.0, workers=1, runner="inline")}))
    assert d.bottleneck == "stage0" and 'runner="threads"' in d.text


def test_rule_compute_bound_with_spare_workers():
    d = diagnose(snapshot(bound=0.05))
    assert d.verdict == "compute-bound" and d.bottleneck is None
    assert "stage 0 map(decode) (70 % blocked); fewer workers would do" in d.text
    assert "stage 1" not in d.text


def test_rules_startup_restarts_and_too_few_steps():
    d = diagnose(snapshot(startup=4.0, stages={"stage0": stage(0.9, 0.0, restarts=2)}))
    assert "Start-up (to the first batch) took 4.00 s, 40 % of the run." in d.text
    assert "restarted crashed workers 2 time(s)" in d.text
    d = diagnose(snapshot(batches=1))
    assert d.verdict == "no-steps" and d.bottleneck is None
    with pytest.raises(ValueError, match="schema 1"):
        diagnose({"stage0": {}})


# -- the command line ---------------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import sys
    import _profile_fns as F
    from zephon import Pipeline, RuntimeOptions, sources

    if __name__ == "__main__":
        pipe = Pipeline(sources.from_sequence(list(range(240))), chunk_size=8) \\
            .map(F.cheap).shuffle(16).map(F.slow).batch(8) \\
            .options(RuntimeOptions(runner="threads"))
        assert sum(1 for _ in pipe) == 30
        assert pipe.stats()["tail"]["delivered"] == 30  # tracking is on for the script
        if sys.argv[1] == "raise":
            raise RuntimeError("the script failed")
        sys.exit(int(sys.argv[1]))
""")


def run_cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    env.pop(TRACKING_ENV, None)
    return subprocess.run([sys.executable, "-m", "zephon", "profile", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_cli_profile_writes_the_report_and_keeps_the_exit_status(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "report.html"
    done = run_cli("--out", str(out), str(script), "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}: 1 pipeline run(s)" in done.stdout
    assert "Stage 1 map(slow) is the bottleneck" in done.stdout
    page = out.read_text()
    assert page.count('<svg class="plot"') == 6 and "map(slow) is the bottleneck" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    done = run_cli("--out", str(out), str(script), "3", cwd=tmp_path)
    assert done.returncode == 3
    out.unlink()
    done = run_cli("--out", str(out), str(script), "raise", cwd=tmp_path)
    assert done.returncode == 1 and "RuntimeError: the script failed" in done.stderr
    assert "map(slow) is the bottleneck" in out.read_text()  # written all the same


def test_cli_profile_missing_script_is_a_usage_error(tmp_path):
    done = run_cli(str(tmp_path / "nope.py"), cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("error: profile: no script at")
