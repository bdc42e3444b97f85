"""The user-facing API documents itself, and its examples run.

What a user reaches is walked from the ``__all__`` of ``zephon``, ``zephon.sources``,
``zephon.jobs``, ``zephon.torch``, ``zephon.checkpoint`` and ``zephon.options``, plus
the objects those hand out (the iterator ``iter(pipe)`` returns, the torch
dataset). For every public class, method, property and function:

- there is a docstring;
- there is an ``Example:`` section;
- a callable with parameters has an ``Args:`` section naming every parameter
  (for a class: its constructor's, in the class or ``__init__`` docstring; an
  option class or a named tuple may list its fields under ``Attributes:``).
  Exception classes only need a docstring (no example, no ``Args:``): users
  catch them, they do not build them.

Every ``>>>`` example in those docstrings then runs with :mod:`doctest`, in a
fresh temporary directory, with ``np``, ``zephon``, ``Pipeline``, ``sources``,
``RuntimeOptions``, ``StoreOptions`` and ``RunPolicy`` predefined. An example
that needs an optional extra (torch, pyarrow, datasets) or a file the reader
brings is marked ``# doctest: +SKIP`` and only read.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import re
from typing import Any, Iterator

import numpy as np
import pytest

import zephon

PUBLIC = ["zephon", "zephon.vision", "zephon.sources", "zephon.jobs", "zephon.torch",
          "zephon.checkpoint", "zephon.options"]
# Handed out by the public API without being in an ``__all__``: (module, name, needs).
HANDED_OUT = [("zephon.pipeline.iterator", "PipelineIterator", None),
              ("zephon.torch._dataset", "PipelineDataset", "torch"),
              ("zephon.torch.lightning", "ZephonDataModule", "lightning"),
              ("zephon.torch.hf", "ZephonTrainer", "transformers"),
              ("zephon.torch.hf", "register", "transformers"),
              ("zephon.torch.titan", "ZephonDataLoader", "torchtitan")]
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}\w+)(\s*\(.*\))?:(\s|$)")
_INHERITED_FROM = (object, BaseException, tuple)


def _module(name: str):
    if name == "zephon.sources":
        return zephon.sources
    return importlib.import_module(name)


def _member_names(cls: type) -> Iterator[tuple[str, Any]]:
    """(name, raw attribute) of every public method/property a user reaches on ``cls``,
    defined by zephon (not by object, Exception or tuple). A framework's hook that a
    zephon class overrides (Lightning's ``setup``, the Trainer's ``train``) is the
    framework's to document; the class's docstring says what zephon does in it."""
    seen: set[str] = set()
    framework = [k for k in cls.__mro__ if k not in _INHERITED_FROM
                 and k.__module__.split(".")[0] != "zephon"]
    seen.update(name for klass in framework for name in vars(klass))
    for klass in cls.__mro__:
        if klass in _INHERITED_FROM or klass.__module__.split(".")[0] != "zephon":
            continue
        for name, raw in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(raw, (staticmethod, classmethod)):
                raw = raw.__func__
            if inspect.isfunction(raw) or isinstance(raw, property):
                yield name, raw


def _public_objects() -> list[tuple[str, Any]]:
    found: dict[int, tuple[str, Any]] = {}

    def add(qualname: str, obj: Any) -> None:
        if id(obj) in found:
            return
        found[id(obj)] = (qualname, obj)
        if inspect.isclass(obj):
            for name, member in _member_names(obj):
                found.setdefault(id(member), (f"{qualname}.{name}", member))

    for modname in PUBLIC:
        module = _module(modname)
        for name in module.__all__:
            if modname == "zephon.torch" and name == "TorchLoader":
                continue  # imports torch; walked below when torch is there
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                add(f"{modname}.{name}", obj)
    for modname, name, needs in [*HANDED_OUT, ("zephon.torch._loader", "TorchLoader", "torch")]:
        if needs is not None and importlib.util.find_spec(needs) is None:
            continue
        add(f"{modname}.{name}", getattr(importlib.import_module(modname), name))
    return sorted(found.values(), key=lambda item: item[0])


OBJECTS = _public_objects()


def _documented_names(doc: str) -> set[str]:
    """Names listed in the ``Args:``/``Attributes:`` sections of a Google-style docstring
    (the entries at the section's first indentation; their continuation lines are
    deeper)."""
    names: set[str] = set()
    lines = inspect.cleandoc(doc).splitlines()
    for i, line in enumerate(lines):
        header = _SECTION.match(line)
        if header is None:
            continue
        indent, entry_indent = len(header.group(1)), None
        for entry in lines[i + 1:]:
            if not entry.strip():
                continue
            depth = len(entry) - len(entry.lstrip())
            if depth <= indent:
                break
            entry_indent = depth if entry_indent is None else entry_indent
            match = _ENTRY.match(entry.strip())
            if depth == entry_indent and match:
                names.add(match.group(1).lstrip("*"))
    return names


def _parameters(obj: Any) -> list[str]:
    """The parameters a user passes (``self``/``cls`` excluded)."""
    target = obj.fget if isinstance(obj, property) else obj
    if isinstance(obj, property):
        return []
    if inspect.isclass(obj):
        init = obj.__init__ if "__init__" in _own_init_classes(obj) else None
        if init is None:
            init = obj.__new__ if tuple in obj.__mro__ else None
        if init is None:
            return []
        target = init
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    params = list(signature.parameters.values())
    if params and params[0].name in ("self", "cls", "_cls"):
        params = params[1:]
    return [p.name for p in params]


def _own_init_classes(cls: type) -> set[str]:
    """``{"__init__"}`` when a zephon class in ``cls``'s MRO defines a constructor."""
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "zephon" and "__init__" in vars(klass):
            return {"__init__"}
    return set()


def _docs(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and "__init__" in vars(obj):
        doc += "\n" + (inspect.getdoc(vars(obj)["__init__"]) or "")
    return doc


@pytest.mark.parametrize("qualname,obj", OBJECTS, ids=[q for q, _ in OBJECTS])
def test_public_object_is_documented(qualname, obj):
    doc = inspect.getdoc(obj)
    assert doc and doc.strip(), f"{qualname} has no docstring"
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return
    assert re.search(r"^Example[s]?:", doc, re.MULTILINE), f"{qualname}: no Example: section"
    params = _parameters(obj)
    if not params:
        return
    listed = _documented_names(_docs(obj))
    missing = [p for p in params if p not in listed]
    assert not missing, (f"{qualname}: the Args: section does not name {missing} "
                         f"(documented: {sorted(listed)})")


def test_walk_reaches_the_user_facing_api():
    """The walk is not vacuous: it finds the objects a training script uses."""
    names = {q for q, _ in OBJECTS}
    for expected in ("zephon.Pipeline.map", "zephon.Pipeline.checkpoint",
                     "zephon.pipeline.iterator.PipelineIterator.restore",
                     "zephon.sources.parquet", "zephon.jobs.run", "zephon.torch.loader",
                     "zephon.RuntimeOptions", "zephon.RuntimeOptions.resolved",
                     "zephon.checkpoint.encode_state"):
        assert expected in names
    # Methods inherited by every option class are walked once, under the first name.
    assert any(name.endswith("Options.replace") or name.endswith("Config.replace")
               for name in names)


def test_section_parser_reads_google_style():
    doc = """Summary.

    Args:
        path: a file.
        seq_len (int): tokens
            per sample.
        **kwargs: more.

    Returns:
        nothing: not an argument.
    """
    assert _documented_names(doc) == {"path", "seq_len", "kwargs"}


def _examples() -> list[tuple[str, Any, doctest.DocTest]]:
    parser = doctest.DocTestParser()
    out = []
    for qualname, obj in OBJECTS:
        doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj)
        if doc and ">>>" in doc:
            out.append((qualname, obj, parser.get_doctest(doc, {}, qualname, None, 0)))
    return out


EXAMPLES = _examples()


def test_examples_exist():
    assert len(EXAMPLES) >= 20


@pytest.mark.parametrize("qualname,obj,test", EXAMPLES, ids=[q for q, _, _ in EXAMPLES])
def test_docstring_example_runs(qualname, obj, test, tmp_path, monkeypatch):
    if qualname.startswith("zephon.torch"):
        pytest.importorskip("torch")
    if all(example.options.get(doctest.SKIP) for example in test.examples):
        pytest.skip("every example needs an extra or the reader's files: read, not run")
    monkeypatch.chdir(tmp_path)
    from zephon import Pipeline, RunPolicy, RuntimeOptions, StoreOptions, sources

    module = inspect.getmodule(obj.fget if isinstance(obj, property) else obj)
    test.globs = {**vars(module), "np": np, "zephon": zephon, "Pipeline": Pipeline,
                  "sources": sources,
                  "RuntimeOptions": RuntimeOptions, "StoreOptions": StoreOptions,
                  "RunPolicy": RunPolicy}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS |
                                   doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    try:
        result = runner.run(test, out=report.append)
    finally:
        for value in list(test.globs.values()):
            close = getattr(value, "close", None)
            if callable(close) and not inspect.isclass(value) and \
                    type(value).__module__.startswith("zephon"):
                close()
        test.globs.clear()
    assert result.attempted > 0
    assert result.failed == 0, f"{qualname}: example fails:\n{''.join(report)}"
