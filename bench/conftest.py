"""Ratio reporting for the pytest-benchmark suites.

Each benchmark records its timing under a comparison name and a role
(``"subject"`` = zephon's code, ``"baseline"`` = what it is compared with).
At the end of the run a table gives, per comparison, baseline time / subject
time (> 1 means zephon is faster), the raw medians beside it and the target;
the last line is machine-readable ``name=ratio`` pairs. Ratios come from one
run on one machine; absolute times are never asserted. ``--enforce-ratios``
turns a missed target into a failed session (for a CI performance gate).
"""

from __future__ import annotations

import json

import pytest

_RESULTS: dict[str, dict] = {}


def pytest_addoption(parser):
    parser.addoption("--enforce-ratios", action="store_true",
                     help="fail the session when a ratio misses its target")
    parser.addoption("--ratios-json", default=None,
                     help="write the ratio table to this JSON file")


@pytest.fixture
def record_ratio(benchmark):
    """``record_ratio(name, role, target=None)``: call after ``benchmark(...)`` ran."""

    def record(name: str, role: str, target: float | None = None) -> None:
        stats = benchmark.stats.stats
        entry = _RESULTS.setdefault(name, {"target": None})
        entry[role] = {"median_s": stats.median, "min_s": stats.min, "rounds": stats.rounds}
        if target is not None:
            entry["target"] = target

    return record


def _rows():
    for name, entry in sorted(_RESULTS.items()):
        if "subject" in entry and "baseline" in entry:
            ratio = entry["baseline"]["median_s"] / entry["subject"]["median_s"]
            yield name, ratio, entry


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = list(_rows())
    if not rows:
        return
    tr = terminalreporter
    tr.section("zephon ratios (baseline time / zephon time; > 1 = zephon faster)")
    tr.write_line(f"{'comparison':<34} {'ratio':>8} {'target':>8}  "
                  f"{'zephon median':>14} {'baseline median':>16}")
    missed = []
    for name, ratio, entry in rows:
        target = entry["target"]
        mark = ""
        if target is not None and ratio < target:
            mark = "  BELOW TARGET"
            missed.append(name)
        tr.write_line(
            f"{name:<34} {ratio:>8.2f} {('>= %.2f' % target) if target else '':>8}  "
            f"{entry['subject']['median_s'] * 1e3:>11.3f} ms {entry['baseline']['median_s'] * 1e3:>13.3f} ms"
            f"{mark}")
    tr.write_line(" ".join(f"{name}={ratio:.3f}" for name, ratio, _ in rows))
    path = config.getoption("--ratios-json")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({name: {"ratio": ratio, **entry} for name, ratio, entry in rows}, fh,
                      indent=2)
    if missed and config.getoption("--enforce-ratios"):
        tr.write_line(f"ratios below target: {', '.join(missed)}", red=True)


def _missed() -> list[str]:
    return [name for name, ratio, entry in _rows()
            if entry["target"] is not None and ratio < entry["target"]]


def pytest_sessionfinish(session, exitstatus):
    # (pytest runs this before the terminal summary, which only prints the table)
    if _missed() and session.config.getoption("--enforce-ratios"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
