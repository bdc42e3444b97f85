"""The HTML report in a real headless browser (Chromium): it renders, its plots have
data points, its script ran, and the page logs no console message (the report's script
logs only on an error). Skipped where Chromium is not installed."""

from __future__ import annotations

import re
import shutil
import subprocess

import _profile_fns as F
import pytest

import zephon
from zephon import Pipeline, RuntimeOptions, sources

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium); not on PATH")
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
         "--v=0"]


def chromium(*args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *FLAGS, *args], capture_output=True, text=True,
                          timeout=120)


def console_lines(stderr: str) -> list[str]:
    """What the page logged (Chromium writes each console message as an INFO:CONSOLE
    line on stderr with --enable-logging)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def report_path(tmp_path_factory):
    pipe = Pipeline(sources.from_sequence(list(range(480))), chunk_size=8) \
        .map(F.cheap).shuffle(16).map(F.slow).batch(8) \
        .options(RuntimeOptions(runner="threads"))
    path = tmp_path_factory.mktemp("report") / "report.html"
    zephon.profile(pipe, steps=40).write(path)
    return path


def test_console_errors_are_seen_on_stderr(tmp_path):
    """The check below can fail: a page that logs an error shows up."""
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>console.error('seen'); missing();</script>"
                    "</body></html>")
    lines = console_lines(chromium("--dump-dom", page.as_uri()).stderr)
    assert any("seen" in line for line in lines)
    assert any("missing is not defined" in line for line in lines)


def test_report_renders_with_data_and_no_console_errors(report_path):
    done = chromium("--dump-dom", report_path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert console_lines(done.stderr) == []
    plots = set(re.findall(r'<svg class="plot" data-plot="(\w+)"', dom))
    assert plots == {"timeline", "throughput", "batches", "wait", "depth", "breakdown"}
    points = [int(n) for n in re.findall(r'<polyline class="series"[^>]*data-points="(\d+)"',
                                         dom)]
    assert len(points) >= 4 and min(points) >= 2
    assert dom.count('<circle class="pt"') == sum(points)
    # the page's script ran in the browser and counted the same points
    body = re.search(r'<body data-points="(\d+)"', dom)
    assert body is not None and int(body.group(1)) == sum(points)
    busy = [float(v) for v in re.findall(r'<rect class="cell" data-busy="([\d.]+)"', dom)]
    assert busy and max(busy) > 0.5  # the slow stage's cells are dark
    assert len(re.findall(r'<rect class="bar"', dom)) >= 8
    assert "Stage 1 map(slow) is the bottleneck" in dom


def test_report_screenshot(report_path, tmp_path):
    shot = tmp_path / "report.png"
    done = chromium(f"--screenshot={shot}", "--window-size=850,2400", report_path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert console_lines(done.stderr) == []
    assert shot.stat().st_size > 20_000  # a page of plots, not a blank one
