"""Layering (docs/architecture.md): lower layers never import higher ones.

The options core imports the standard library and zephon.errors only; every
other import rule is checked against the tables below by reading the source
(top-level, function-level and ``TYPE_CHECKING`` imports alike): between packages
(``ALLOWED``) and between the modules of ``zephon.pipeline`` (``PIPELINE_ALLOWED``,
``PIPELINE_APART``).

Two rules go past imports. The option objects of :mod:`zephon.options` stop at the
pipeline layer: the pipeline resolves them once into per-layer configs (a pool config
for the transport, an explicit mode per stage), so no option object is named, and no
resolver (a function of an option object) is called, in ``zephon.transport`` or
``zephon.runners``. And the pipeline talks to an executor through the written executor
contract only: no ``getattr`` probes an executor for what it is.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import zephon

ROOT = pathlib.Path(zephon.__file__).parent
# package -> zephon packages it may import (besides itself, zephon.errors and
# zephon._modules, two leaf modules of the standard library alone)
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
    # image ops: plain map ops, they need nothing of the engine; _kernels: the optional
    # region decoder (kernels/jpeg)
    "vision": {"_kernels"},
    # the pytest plugin (loaded by every pytest session where zephon is installed): it
    # drives a pipeline through iter()/next()/close() alone, importing nothing of zephon
    "testing": set(),
}
# zephon.pipeline module (or subpackage) -> pipeline modules it may import (besides
# itself). Bottom: what flows down a lane and how callables are named; then the ops;
# then lanes and dispatch; the frozen spec; the plan (which fingerprints the spec
# itself); the carry and the stage program; the autotune policy and its controller; the
# engine; and on top the run (state, progress, iterator) and the user-facing Pipeline,
# which may import anything.
PIPELINE_ALLOWED = {
    "records": set(),
    "fingerprint": set(),
    "collate": set(),
    "stats": set(),
    "tuning": set(),  # the pure autotune policy: signals in, a decision out
    "autotune": {"tuning"},
    "shares": set(),
    "sources": {"fingerprint", "collate", "shares"},
    "ops": {"records", "fingerprint", "collate", "shares"},
    "shards": set(),
    "lanes": {"records", "shards"},
    "columnar": {"records", "collate", "sources"},
    "dispatch": {"records", "lanes"},
    "rngs": set(),  # the global generators seeded per op call
    "validate": {"ops", "rngs"},
    "spec": {"ops", "shards", "sources"},  # the frozen definition a plan is made from
    "plan": {"ops", "lanes", "dispatch", "spec", "fingerprint"},
    "carry": {"records", "ops", "lanes", "plan"},
    "program": {"records", "ops", "lanes", "columnar", "sources", "collate", "rngs"},
    "keep": set(),  # a pipeline's process pools kept between its runs
    "engine": {"records", "ops", "lanes", "dispatch", "plan", "carry", "program", "stats",
               "autotune", "keep"},
    "text": {"records", "ops"},
    "training": {"records"},
    # what a checkpoint proves about the stream it continues (checked on restore)
    "proof": {"engine", "lanes", "sources"},
}
PIPELINE_TOP = {"state", "iterator", "progress", "pipeline"}
# pairs of top modules that may not import each other: one of the two sits below the
# other (the iterator drives a run's progress; progress never calls back into it)
PIPELINE_APART = {("iterator", "progress")}
THIRD_PARTY_OK = {
    "options": set(),
    "kernels": {"numpy"},
    "vision": {"numpy"},  # Pillow and simplejpeg are imported when an image is decoded
}


def _imports(path: pathlib.Path, submodules: bool = False):
    """The modules ``path`` imports; ``submodules``: ``from pkg import mod`` also yields
    ``pkg.mod`` (a name imported from a package may be a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            if submodules:
                for alias in node.names:
                    yield f"{node.module}.{alias.name}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_downward(package):
    base = ROOT / package
    if not base.exists():
        pytest.skip(f"zephon/{package} does not exist yet")
    for path in base.rglob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "zephon":
                if len(parts) == 1 or parts[1] in ("errors", "_modules", package):
                    continue
                assert parts[1] in ALLOWED[package], f"{path}: imports {name}"
            elif package in THIRD_PARTY_OK:
                stdlib = parts[0] in sys.stdlib_module_names or parts[0] == "__future__"
                assert stdlib or parts[0] in THIRD_PARTY_OK[package], f"{path}: imports {name}"


def _pipeline_layer(path: pathlib.Path) -> str:
    """The layer of a module of zephon/pipeline: its module or subpackage name."""
    rel = path.relative_to(ROOT / "pipeline")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_pipeline_modules_import_only_lower_layers():
    known = set(PIPELINE_ALLOWED) | PIPELINE_TOP
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        layer = _pipeline_layer(path)
        if layer == "__init__":
            continue
        assert layer in known, f"zephon/pipeline/{layer}: give it a row in PIPELINE_ALLOWED"
        if layer in PIPELINE_TOP:
            continue
        for name in _imports(path, submodules=True):
            parts = name.split(".")
            if parts[:2] != ["zephon", "pipeline"] or len(parts) < 3 or parts[2] == layer:
                continue
            if parts[2] in known:
                assert parts[2] in PIPELINE_ALLOWED[layer], f"{path}: imports {name}"


def test_the_pipeline_layers_have_no_cycle():
    """Every layer's allowed imports sit strictly below it (a topological order exists)."""
    placed: list[str] = []
    left = dict(PIPELINE_ALLOWED)
    while left:
        ready = [m for m, deps in left.items() if deps <= set(placed)]
        assert ready, f"a cycle among {sorted(left)}"
        placed += sorted(ready)
        for m in ready:
            del left[m]


def _imports_layer(path: pathlib.Path, layer: str) -> str | None:
    """The first import of ``zephon.pipeline.<layer>`` (or below it) in ``path``."""
    for name in _imports(path, submodules=True):
        if name.split(".")[:3] == ["zephon", "pipeline", layer]:
            return name
    return None


def test_the_pipeline_top_has_no_cycle():
    """The top modules may import anything below them, but of each pair in
    ``PIPELINE_APART`` at most one imports the other (``TYPE_CHECKING`` imports count:
    a type the other module owns is a dependency on it)."""
    for a, b in sorted(PIPELINE_APART):
        up = _imports_layer(ROOT / "pipeline" / f"{a}.py", b)
        down = _imports_layer(ROOT / "pipeline" / f"{b}.py", a)
        assert not (up and down), f"zephon.pipeline.{a} imports {up} and {b} imports {down}"


# the packages below the pipeline layer: they take resolved configs, never options
BELOW_OPTIONS = ("transport", "runners")


def _option_objects() -> tuple[set[str], set[str]]:
    """The option object classes of :mod:`zephon.options` (every ``OptionsBase``
    subclass it exports, whatever it names them) and the modules defining nothing but
    option objects (their import is itself the smell)."""
    import zephon.options as options
    from zephon.options._spec import OptionsBase

    classes = {name: obj for name, obj in vars(options).items()
               if isinstance(obj, type) and issubclass(obj, OptionsBase)}
    modules = set()
    for obj in classes.values():
        module = sys.modules[obj.__module__]
        public = [v for k, v in vars(module).items() if not k.startswith("_")
                  and getattr(v, "__module__", None) == module.__name__
                  and (isinstance(v, type) or callable(v))]
        if all(isinstance(v, type) and issubclass(v, OptionsBase) for v in public):
            modules.add(module.__name__)
    assert {"RuntimeOptions", "StoreOptions"} <= set(classes)
    assert "zephon.options.runtime" in modules
    return set(classes), modules


def _name_of(node: ast.AST) -> str | None:
    """The name a node spells: a plain name, an attribute's name, an import's last
    dotted part."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.alias):
        return node.name.rsplit(".", 1)[-1]
    return None


def _names_used(tree: ast.AST):
    """``(line, name)`` for every name a module binds, reads, imports or annotates
    with, the names inside string annotations included."""
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        yield line, _name_of(node)
        ann = getattr(node, "annotation", None) or getattr(node, "returns", None)
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            for sub in ast.walk(ast.parse(ann.value, mode="eval")):
                yield line, _name_of(sub)


@pytest.mark.parametrize("package", BELOW_OPTIONS)
def test_no_option_object_below_the_pipeline(package):
    """Options are resolved once, above these layers, into their own configs: no
    module here imports an option module or names an option class (annotations,
    defaults and ``isinstance`` checks included)."""
    classes, modules = _option_objects()
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name in _imports(path, submodules=True):
            assert name not in modules, f"{path}: imports {name}"
        for line, name in _names_used(tree):
            assert name not in classes, f"{path}:{line}: names the option object {name}"


def _option_readers() -> set[str]:
    """The functions of :mod:`zephon.options` that read an option object (their first
    parameter is the options or the run policy): the resolvers."""
    import inspect

    import zephon.options as options

    readers = set()
    for module in {sys.modules[f.__module__] for f in vars(options).values()
                   if inspect.isfunction(f)}:
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__:
                first = next(iter(inspect.signature(fn).parameters), None)
                if first in ("opts", "options", "policy"):
                    readers.add(name)
    assert {"resolve_prefetch_batches", "resolve_mtp_buffer"} <= readers
    return readers


@pytest.mark.parametrize("package", BELOW_OPTIONS)
def test_no_option_resolved_below_the_pipeline(package):
    """A resolver takes an option object, so one called here means the options reached
    this layer: what it derives belongs in the layer's config, resolved above."""
    readers = _option_readers()
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, name in _names_used(ast.parse(path.read_text(encoding="utf-8"))):
            assert name not in readers, f"{path}:{line}: resolves options ({name})"


def _is_executor(node: ast.expr) -> bool:
    """Whether an expression reads as an executor: ``ex``, ``executor``, or any name or
    attribute chain containing ``executor`` (``self.executor``, ``executors[s]``)."""
    if not isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
        return False
    text = ast.unparse(node)
    return text == "ex" or "executor" in text.lower()


def test_the_pipeline_reads_executors_through_their_contract():
    """No ``getattr``/``hasattr`` on an executor in zephon.pipeline: what an executor is
    and what it can do is its contract's to say, not a probe's to guess."""
    found = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and _is_executor(node.args[0])):
                rel = path.relative_to(ROOT.parent)
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "executor probed by getattr:\n" + "\n".join(found)


def test_errors_module_is_stdlib_only():
    for name in _imports(ROOT / "errors.py"):
        assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__"


def test_the_leaf_modules_import_the_standard_library_alone():
    for leaf in ("errors.py", "_modules.py"):
        for name in _imports(ROOT / leaf):
            top = name.split(".")[0]
            assert top in sys.stdlib_module_names or top == "__future__", f"{leaf}: {name}"
