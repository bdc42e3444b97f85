"""The vision benchmarks (bench/vision/): their parts here, each script's smoke run there.

Fast tests (this interpreter, NumPy and Pillow only): the data generator is a pure
function of its arguments and refuses to reuse a directory that is another data set;
the KS fallback tells equal from different distributions; the process-tree monitor
counts a child's memory and CPU time.

Slow tests (``-m slow``): ``epochs.py``, ``decode.py`` and ``compare.py`` run with
``--quick`` in the vision environment (torchvision; Grain and tensorflow-cpu where
installed), found as ``$ZEPHON_VISION_PYTHON``, this interpreter when it has
torchvision, or ``/work/venvs/vision/bin/python`` (what ``bench/vision/make_env.sh``
builds); skipped where none exists. A smoke run passes when the script exits 0 (every
row it planned gave a result) and its JSON holds the rows and ratios it reports. Each
runs in its own session and is killed with its whole process group if it overruns.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("PIL")

BENCH = Path(__file__).resolve().parent.parent / "bench" / "vision"
sys.path.insert(0, str(BENCH))
import _common as C  # noqa: E402
import decode  # noqa: E402
import make_data  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import HANG_S  # noqa: E402

SMOKE_TIMEOUT_S = 900


# -- fast: the harness's own parts ----------------------------------------------------------

def test_images_are_a_pure_function_of_seed_and_index():
    a, b = make_data.render(0, 3), make_data.render(0, 3)
    assert a == b
    assert make_data.render(1, 3)[0] != a[0]
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(a[0]))
    assert image.size == (a[1], a[2]) and image.format == "JPEG"


def test_ensure_makes_the_tree_once_and_refuses_another_data_set(tmp_path):
    root = tmp_path / "images"
    manifest = make_data.ensure(root, n=12)
    assert manifest["n"] == 12 and len(manifest["files"]) == 12
    for f in manifest["files"]:
        assert (root / f["path"]).is_file()
        assert f["path"].startswith(manifest["classes"][f["label"]] + "/")
    stamp = (root / "manifest.json").stat().st_mtime_ns
    assert make_data.ensure(root, n=12) == manifest  # reused, not rebuilt
    assert (root / "manifest.json").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="not the benchmark data set"):
        make_data.ensure(root, n=13)
    assert not [p for p in tmp_path.iterdir() if p.name != "images"]  # no temp dir left


def test_ks_fallback_tells_equal_from_shifted_distributions(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.stats", None)  # the fallback, scipy or not
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0, 1, 4000), rng.uniform(0, 1, 4000)
    d_same, p_same = decode.ks_2samp(a, b)
    d_diff, p_diff = decode.ks_2samp(a, rng.uniform(0.05, 1.05, 4000))
    assert p_same > 0.01 and d_same < 0.04
    assert p_diff < 1e-6 and d_diff > 0.04


def test_tv_box_stays_inside_the_image_within_the_scale_range():
    rng = np.random.default_rng(0)
    for width, height in ((500, 375), (375, 500), (1600, 1200), (40, 400)):
        for _ in range(500):
            left, top, right, bottom = C.tv_box(width, height, rng)
            assert 0 <= left < right <= width and 0 <= top < bottom <= height
            assert (right - left) * (bottom - top) <= width * height


def test_tree_monitor_counts_a_child_process():
    code = ("import sys, time; b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); "
            "t = time.process_time() + 0.5\nwhile time.process_time() < t: pass\n"
            "print('ready', flush=True); sys.stdin.read()")
    base = C.TreeMonitor().start()
    time.sleep(0.3)
    alone = base.stop()
    memory = C.TreeMonitor().start()
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # several samples with the child's pages resident
        seen = memory.stop()
    finally:
        child.kill()
        child.wait(HANG_S)
    assert seen["max_procs"] >= 2
    assert seen["peak_rss_mib"] - alone["peak_rss_mib"] > 250
    assert seen["peak_pss_mib"] - alone["peak_pss_mib"] > 250
    assert seen["cpu_s"] >= 0.4  # the child's half second of CPU, counted in the tree


# -- slow: each script's smoke run in the vision environment -----------------------------

def _vision_python() -> str | None:
    named = os.environ.get("ZEPHON_VISION_PYTHON")
    if named:
        return named
    if importlib.util.find_spec("torchvision") is not None:
        return sys.executable
    default = Path("/work/venvs/vision/bin/python")
    return str(default) if default.exists() else None


def _run(python: str, script: str, data: Path, out: Path) -> dict:
    """``script --quick`` in its own session; its JSON. The whole group is killed when it
    overruns, and when the test fails on the way."""
    cmd = [python, str(BENCH / script), "--quick", "--data", str(data), "--json", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=str(BENCH.parent.parent))
    try:
        output, _ = proc.communicate(timeout=SMOKE_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(HANG_S)
        try:  # rows and their workers are in the group: none may outlive the test
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{script} --quick exited {proc.returncode}:\n{output[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    python = _vision_python()
    if python is None:
        pytest.skip("no vision environment (bench/vision/make_env.sh builds it)")
    probe = subprocess.run([python, "-c", "import torchvision, zephon"], capture_output=True,
                           timeout=HANG_S * 2, check=False)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import torchvision and zephon")
    data = tmp_path_factory.mktemp("vision-data")
    return python, data


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT_S + 300)
def test_epochs_quick(vision, tmp_path):
    python, data = vision
    got = _run(python, "epochs.py", data, tmp_path / "epochs.json")
    assert got["failed"] == [] and "torch DataLoader" in got["rows"] and "zephon" in got["rows"]
    for row in got["rows"].values():
        assert row["peak_pss_mib"] > 0 and row["max_procs"] >= 3  # parent + 2 workers
    run = got["runs"]["zephon"][0]
    assert run["images"] == [C.QUICK_IMAGES] * 3  # three whole epochs
    assert "total_dataloader_vs_zephon[tv]" in got["ratios"]


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT_S + 300)
def test_decode_quick(vision, tmp_path):
    python, data = vision
    got = _run(python, "decode.py", data, tmp_path / "decode.json")
    assert got["failed"] == []
    assert {"torchvision / 1600x1200", "torchvision / 500x375"} <= set(got["rows"])
    if got["features"]["zephon_vision"]:
        assert "torchvision_vs_zephon[1600x1200]" in got["ratios"]
        for feats in got["quality"]["ks"].values():
            assert set(feats) == {"scale", "log_ratio", "centre_x", "centre_y"}
        assert got["quality"]["psnr"]["500x375"]["images"] > 0


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT_S + 300)
def test_compare_quick(vision, tmp_path):
    python, data = vision
    got = _run(python, "compare.py", data, tmp_path / "compare.json")
    assert got["failed"] == [] and "torch DataLoader" in got["rows"]
    for run in got["runs"].values():
        assert run[0]["images"] == C.QUICK_IMAGES  # every loader gave the whole epoch
