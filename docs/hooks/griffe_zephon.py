"""Griffe extension for the API reference: what zephon's code says, read as its users need it.

- **Option fields.** Each field of an option class is declared as
  ``name: type = option(default, check=..., doc="...")``; its ``doc=`` string becomes the
  field's docstring and its default the shown value, so the reference lists every
  field of ``RuntimeOptions``, ``RunPolicy`` and the rest with what it does.
- **Source functions that share a submodule's name.** ``zephon.sources.jsonl`` is a
  function defined in ``zephon/pipeline/sources/__init__.py`` beside a submodule
  ``jsonl.py``; griffe lets the submodule win. The functions a package module defines
  are put back once the package is loaded, so the reference shows what
  ``zephon.sources.jsonl`` is at run time.
"""

from __future__ import annotations

import ast
from typing import Any

import griffe


def _text(node: ast.AST) -> str | None:
    """A string literal, or implicitly concatenated literals, as one string."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class ZephonReference(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self._shadowed: list[tuple[str, str, Any]] = []

    def on_attribute_instance(self, *, node: ast.AST | griffe.ObjectNode, attr: griffe.Attribute,
                              **_: Any) -> None:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.value, ast.Call):
            return
        call = node.value
        if not (isinstance(call.func, ast.Name) and call.func.id == "option"):
            return
        doc = next((_text(k.value) for k in call.keywords if k.arg == "doc"), None)
        if doc:
            attr.docstring = griffe.Docstring(doc, parent=attr)
        if call.args:
            attr.value = ast.unparse(call.args[0])

    def on_function_instance(self, *, func: griffe.Function, **_: Any) -> None:
        parent = func.parent
        if isinstance(parent, griffe.Module) and parent.is_init_module:
            self._shadowed.append((parent.path, func.name, func))

    def on_package(self, *, pkg: griffe.Module, **_: Any) -> None:
        for module_path, name, func in self._shadowed:
            if not module_path.startswith(pkg.path):
                continue
            module = pkg if module_path == pkg.path else \
                pkg.get_member(module_path[len(pkg.path) + 1:])
            member = module.members.get(name)
            if isinstance(member, griffe.Module):
                module.set_member(name, func)
