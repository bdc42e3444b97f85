"""Layering (docs/architecture.md): lower layers never import higher ones.

The options core imports the standard library and zephon.errors only; every
other import rule is checked against the table below by reading the source
(top-level and function-level imports alike).
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import zephon

ROOT = pathlib.Path(zephon.__file__).parent
# package -> zephon packages it may import (besides itself and zephon.errors)
ALLOWED = {
    "options": set(),
    "kernels": set(),
    "_kernels": {"kernels"},
    "transport": {"options", "kernels", "_kernels"},
    "runners": {"transport", "options", "kernels", "_kernels"},
    "checkpoint": {"options"},
    "io": {"options"},  # reading files (local, cached, remote); pipeline sources use it
    "pipeline": {"runners", "options", "kernels", "_kernels", "checkpoint", "transport", "io"},
    "jobs": {"transport", "runners", "options", "kernels"},  # kernels: the dtype token
    # the top layer: integrations may import everything below them
    "torch": {"pipeline", "checkpoint", "transport", "runners", "options", "kernels",
              "_kernels", "jobs"},
    "report": {"pipeline", "options"},  # profiling runs and renders pipeline statistics
}
THIRD_PARTY_OK = {
    "options": set(),
    "kernels": {"numpy"},
}


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_downward(package):
    base = ROOT / package
    if not base.exists():
        pytest.skip(f"zephon/{package} does not exist yet")
    for path in base.rglob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "zephon":
                if len(parts) == 1 or parts[1] in ("errors", package):
                    continue
                assert parts[1] in ALLOWED[package], f"{path}: imports {name}"
            elif package in THIRD_PARTY_OK:
                stdlib = parts[0] in sys.stdlib_module_names or parts[0] == "__future__"
                assert stdlib or parts[0] in THIRD_PARTY_OK[package], f"{path}: imports {name}"


def test_errors_module_is_stdlib_only():
    for name in _imports(ROOT / "errors.py"):
        assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__"
