"""Guards for every private CPython (and torch) API zephon relies on: each test fails
with a message naming the API and the zephon code that needs it when the API vanishes
or changes its signature or meaning, and a scan of the package fails when code starts
relying on one that has no guard here."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest

import zephon

PACKAGE = os.path.dirname(zephon.__file__)

#: private API -> the code that uses it (a new use needs a guard test below)
GUARDED = {
    "threading._register_atexit": "zephon/transport/pool.py, zephon/pipeline/iterator.py",
    "Condition._is_owned": "zephon/transport/arena.py (ShmArena.take)",
    "sys._is_gil_enabled": "zephon/transport/heap.py (heap_enabled, _counts_exact)",
    "distributed_c10d._get_default_store": "zephon/checkpoint/store.py",
}
_PRIVATE = re.compile(
    r"\b(threading|sys|os|gc|socket|mmap|multiprocessing|selectors|signal|pickle|weakref|"
    r"ctypes|distributed_c10d)\._[a-z]\w*|\bimport _thread\b|multiprocessing\.util|"
    r"\.(_is_owned)\(")


def _uses() -> set[str]:
    found = set()
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            with open(os.path.join(root, name), encoding="utf-8") as fh:
                for line in fh:
                    code = line.split("#", 1)[0]
                    for m in _PRIVATE.finditer(code):
                        text = m.group(0)
                        if text == "os._exit":  # documented: os._exit(n) is public
                            continue
                        found.add("Condition._is_owned" if m.group(2) else text)
    return found


def test_every_private_api_the_package_uses_has_a_guard():
    unguarded = _uses() - set(GUARDED)
    assert not unguarded, (
        f"zephon uses private APIs without a guard test in {__file__}: {sorted(unguarded)}")


def test_threading_register_atexit_runs_before_non_daemon_threads_are_joined():
    api = getattr(threading, "_register_atexit", None)
    assert callable(api), ("threading._register_atexit is gone: zephon's pools and "
                           f"iterators close at exit through it ({GUARDED['threading._register_atexit']})")
    params = list(inspect.signature(api).parameters.values())
    assert [p.kind for p in params[:1]] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] and \
        any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params), \
        f"threading._register_atexit changed its signature: {inspect.signature(api)}"
    # the meaning zephon needs: the hook runs before the interpreter joins a non-daemon
    # thread (here one that waits for the hook), so exit does not hang
    code = textwrap.dedent("""
        import threading
        done = threading.Event()
        threading.Thread(target=done.wait).start()  # non-daemon: joined at exit
        threading._register_atexit(done.set)
        print("exiting")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "exiting", proc.stderr


def test_condition_is_owned_says_whether_this_thread_holds_the_lock():
    cond = threading.Condition()
    api = getattr(cond, "_is_owned", None)
    assert callable(api), ("Condition._is_owned is gone: the shared heap uses it to give "
                           f"NumPy malloc inside an arena method ({GUARDED['Condition._is_owned']})")
    assert api() is False
    with cond:
        assert api() is True
        seen = []
        t = threading.Thread(target=lambda: seen.append(cond._is_owned()))
        t.start()
        t.join()
        assert seen == [False], "Condition._is_owned is True in a thread without the lock"
    assert api() is False


def test_sys_is_gil_enabled_is_absent_or_answers_a_bool():
    api = getattr(sys, "_is_gil_enabled", None)
    if sys.version_info >= (3, 13):
        assert callable(api), ("sys._is_gil_enabled is gone: the shared heap needs it to "
                               f"stay off without the GIL ({GUARDED['sys._is_gil_enabled']})")
    if api is not None:
        assert isinstance(api(), bool), "sys._is_gil_enabled() no longer answers a bool"


def test_torch_distributed_default_store_is_a_function_of_no_arguments():
    pytest.importorskip("torch", reason="the torch extra is not installed")
    try:
        from torch.distributed import distributed_c10d
    except ImportError:
        pytest.skip("torch is built without distributed")
    api = getattr(distributed_c10d, "_get_default_store", None)
    assert callable(api), ("torch's distributed_c10d._get_default_store is gone: the "
                           "checkpoint exchange reuses the process group's store through it "
                           f"({GUARDED['distributed_c10d._get_default_store']})")
    required = [p for p in inspect.signature(api).parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not required, f"_get_default_store now needs arguments: {inspect.signature(api)}"
