#!/usr/bin/env bash
# Build the separate environment the vision benchmarks run in.
#
# torchvision 0.29.1 needs torch 2.14.1 (the CUDA build, ~5 GB installed; it runs on the CPU),
# which the repository's own environment does not carry, so the vision rows live in their own
# virtual environment.  Usage:
#
#     bash bench/vision/make_env.sh [VENV_DIR]      # default /work/venvs/vision
#
# Each optional package (grain, tensorflow-cpu, pytest-benchmark) is installed on its own, so
# one that has no wheel for this platform leaves its benchmark rows out instead of the build.
set -euo pipefail

VENV="${1:-/work/venvs/vision}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

"${PIP[@]}" --upgrade pip setuptools wheel
# The core the rows cannot run without.
"${PIP[@]}" "torch==2.14.1" "torchvision==0.29.1" pillow simplejpeg numpy \
    pytest psutil
# The comparison frameworks and extras: each may be missing without failing the build.
for pkg in grain tensorflow-cpu pytest-benchmark scipy; do
    if ! "${PIP[@]}" "$pkg"; then
        echo "make_env.sh: could not install $pkg; the rows that need it are skipped" >&2
    fi
done
# The library itself, editable, with its compiled kernels.
"${PIP[@]}" -e "$REPO"

"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "torchvision", "PIL", "simplejpeg", "zephon", "grain", "tensorflow",
             "psutil", "scipy"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:12s} {getattr(mod, '__version__', 'ok')}")
    except Exception as exc:  # noqa: BLE001 - a report, not a failure
        print(f"{name:12s} MISSING ({type(exc).__name__}: {exc})")
PY
