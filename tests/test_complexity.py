"""Every function in zephon/ stays at radon grade C or better (cyclomatic complexity
at most 20).

ruff holds each function to McCabe 12 (``C901`` in pyproject.toml); radon counts
boolean operators and comprehensions too, so its grade is the second, coarser bound a
function can cross while ruff still passes. A function past it is split, not exempted.
"""

from __future__ import annotations

import pathlib

import pytest

import zephon

radon_complexity = pytest.importorskip("radon.complexity")

ROOT = pathlib.Path(zephon.__file__).parent
MAX_COMPLEXITY = 20  # the top of radon's grade C


def _functions(path: pathlib.Path):
    """The functions and methods of one module, closures included, each once (radon
    lists a method both on its own and under its class)."""
    seen = set()
    todo = list(radon_complexity.cc_visit(path.read_text(encoding="utf-8")))
    while todo:
        block = todo.pop()
        todo += getattr(block, "methods", []) + getattr(block, "closures", [])
        key = (block.lineno, block.fullname)
        if key not in seen and not hasattr(block, "methods"):  # a class is no function
            seen.add(key)
            yield block


def test_no_function_above_radon_grade_c():
    over = []
    for path in sorted(ROOT.rglob("*.py")):
        for block in sorted(_functions(path), key=lambda b: b.lineno):
            if block.complexity > MAX_COMPLEXITY:
                grade = radon_complexity.cc_rank(block.complexity)
                rel = path.relative_to(ROOT.parent)
                over.append(f"{rel}:{block.lineno} {block.fullname} {grade} "
                            f"({block.complexity})")
    assert not over, "above radon grade C:\n" + "\n".join(over)
