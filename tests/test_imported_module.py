"""``zephon._modules.imported``: a module another thread is importing is handed over only
once its import is over (a half-made torch crashed a generator-state read), and nothing
is ever imported by the lookup."""

from __future__ import annotations

import sys
import threading
import time

from zephon._modules import imported


def test_a_module_mid_import_on_another_thread_is_given_whole(tmp_path, monkeypatch):
    name = "zephon_slow_import_probe"
    (tmp_path / f"{name}.py").write_text(
        "import time\nSTARTED = True\ntime.sleep(0.5)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    importer = threading.Thread(target=__import__, args=(name,), daemon=True)
    importer.start()
    deadline = time.monotonic() + 30
    while name not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not getattr(sys.modules[name], "DONE", False)  # really caught mid-import
    module = imported(name)
    assert module is not None and module.DONE
    importer.join(30)
    monkeypatch.delitem(sys.modules, name)


def test_a_module_not_imported_is_not_imported():
    assert imported("zephon_no_such_module_anywhere") is None
    assert "zephon_no_such_module_anywhere" not in sys.modules
    import json

    assert imported("json") is json


def test_an_import_that_fails_on_another_thread_is_not_run_again(tmp_path, monkeypatch):
    """The other thread's import raised: the module is gone, and the lookup says so
    without running the module's code a second time (it never imports)."""
    name = "zephon_failing_import_probe"
    runs = tmp_path / "runs"
    (tmp_path / f"{name}.py").write_text(
        f"import time\nopen({str(runs)!r}, 'a').write('x')\ntime.sleep(0.5)\n"
        "raise RuntimeError('this import fails')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    failures = []

    def importer():
        try:
            __import__(name)
        except RuntimeError as exc:
            failures.append(exc)

    thread = threading.Thread(target=importer, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while name not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.001)
    assert imported(name) is None
    thread.join(30)
    assert failures and runs.read_text() == "x"
