"""A small /dev/shm (Docker's 64 MB default) with ``ipc_transport="pipe"``.

The scenario runs in a private mount namespace (``unshare -m``, as root) where a 48 MiB
tmpfs is mounted over /dev/shm: the real /dev/shm is never touched. A pool and a
pipeline move results far larger than that through named segments; segment space is
reserved before any write, so running out is a clear condition (results travel by copy,
one warning naming /dev/shm and its size), never a SIGBUS, and nothing is left in that
tmpfs afterwards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
SIZE = 48 << 20

SCRIPT = textwrap.dedent(f"""
    import json, sys, warnings
    sys.path.insert(0, {TESTS!r})
    import _transport_handlers as H
    from zephon import Pipeline, RuntimeOptions, sources
    from zephon.transport import WorkerPool

    if __name__ == "__main__":
        out = {{}}
        opts = RuntimeOptions(ipc_transport="pipe")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with WorkerPool(H.handle, 2, config=H.config(opts)) as pool:
                kept = []
                for i in range(24):  # 24 x 8 MiB kept: four times the tmpfs
                    pool.submit(("full", (8 << 20, i)))
                    kept.append(pool.get(timeout=120).value)
                out["pool"] = [int(r["data"][-1]) for r in kept]
                del kept
            pipe = Pipeline(sources.from_callable(40, H.load_4mib)).map(H.plus_one).options(
                RuntimeOptions(ipc_transport="pipe", runner="process", max_workers=2))
            batches = list(pipe)
            pipe.close()
            out["pipeline"] = sorted(int(b[0]) for b in batches)
            del batches
        out["warnings"] = [str(w.message) for w in caught]
        print(json.dumps(out), flush=True)
""")


def _namespace_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "private mount namespaces are Linux only"
    if shutil.which("unshare") is None:
        return "the unshare command is not installed"
    if os.geteuid() != 0:
        return "mounting a tmpfs in a private mount namespace needs root"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -m / mount is not permitted here: {probe.stderr.strip()}"
    return None


def test_pipe_transport_on_a_48mib_dev_shm_completes_and_leaves_nothing(tmp_path):
    reason = _namespace_unavailable()
    if reason:
        pytest.skip(reason)
    script = tmp_path / "small_shm.py"
    script.write_text(SCRIPT)
    shell = (f"mount -t tmpfs -o size={SIZE} tmpfs /dev/shm && "
             f"{sys.executable} {script}; rc=$?; echo LEFT: $(ls -A /dev/shm); exit $rc")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-2])
    assert result["pool"] == list(range(24))
    assert result["pipeline"] == list(range(1, 41))
    left = lines[-1].removeprefix("LEFT:").split()
    assert left == [], left
    space = [w for w in result["warnings"] if "/dev/shm" in w]
    assert space, result["warnings"]
    assert f"/dev/shm is {SIZE} bytes" in space[0] and "--shm-size" in space[0]
    assert "signal" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
