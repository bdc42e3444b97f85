"""The memory of a process tree, sampled: this process and all its descendants.

What it measures: the sum of the resident set sizes (RSS) of this process and every
live descendant started since :meth:`TreeMemory.start` (the pipeline's worker
processes, their helpers; not a descendant that was running before), read every
``interval`` seconds by a daemon thread, and the largest such sum seen. On Linux it
reads ``/proc/<pid>/statm`` (about 60 us a process) and finds descendants through
``/proc/<pid>/task/<tid>/children`` (a scan of ``/proc`` where that file is missing);
elsewhere it uses psutil when that is installed, and measures nothing (None) when not.

RSS counts a page once in every process that maps it: shared libraries and the shared
memory zephon moves batches through count once per process. The sum is an upper bound
of the tree's footprint, stable from run to run, which is what a regression gate
needs. (The proportional set size would split shared pages, but reading it walks every
page table, milliseconds a process with torch loaded: sampled often, it would disturb
the throughput being measured.)

Phases: while :meth:`TreeMemory.phase` says ``"baseline"`` (a baseline loop runs in
this process), samples do not count toward the peak, and a process first seen then is
the baseline's (a DataLoader's workers): it never counts. At every phase change the
tree is read once synchronously, so a process that starts during a baseline round is
seen before the phase ends.

Lifecycle: ``start()`` takes a first sample and starts the thread; ``stop()`` ends
it (idempotent) and takes a last sample.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Callable

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _linux_children(pid: int) -> list[int] | None:
    """The children of ``pid`` (every thread's), or None when the kernel does not
    list them (no ``children`` file)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                out.extend(int(c) for c in fh.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended meanwhile
            return None
        except OSError:
            continue
    return out


def _scan_children() -> dict[int, list[int]]:
    """ppid -> children, from every ``/proc/<pid>/stat``."""
    table: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])
        table.setdefault(ppid, []).append(int(entry))
    return table


def linux_tree(root: int) -> list[int]:
    """``root`` and its live descendants, read from ``/proc``.

    Args:
        root: a process id.

    Returns:
        The process ids, ``root`` first.

    Examples:
        >>> os.getpid() in linux_tree(os.getpid())
        True
    """
    found, todo = [root], [root]
    table: dict[int, list[int]] | None = None
    while todo:
        pid = todo.pop()
        kids = _linux_children(pid) if table is None else table.get(pid, [])
        if kids is None:  # no children files: one scan of /proc for the rest
            table = _scan_children()
            kids = table.get(pid, [])
        found += kids
        todo += kids
    return found


def _linux_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None  # the process ended meanwhile


def _psutil_reader() -> Callable[[int], dict[int, int]] | None:
    try:  # optional, untyped: imported by name
        psutil = importlib.import_module("psutil")
    except ImportError:
        return None

    def read(root: int) -> dict[int, int]:
        out: dict[int, int] = {}
        try:
            procs = [psutil.Process(root)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            return out
        for proc in procs:
            try:
                out[proc.pid] = proc.memory_info().rss
            except psutil.Error:
                continue
        return out

    return read


def _proc_reader(root: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for pid in linux_tree(root):
        rss = _linux_rss(pid)
        if rss is not None:
            out[pid] = rss
    return out


def tree_reader() -> Callable[[int], dict[int, int]] | None:
    """The function that reads ``{pid: rss bytes}`` of a process tree on this system,
    or None where none can (no ``/proc`` and no psutil).

    Returns:
        ``read(root_pid) -> {pid: rss_bytes}``, or None.

    Examples:
        >>> read = tree_reader()
        >>> read is None or read(os.getpid())[os.getpid()] > 0
        True
    """
    if sys.platform.startswith("linux") and os.path.exists(f"/proc/{os.getpid()}/statm"):
        return _proc_reader
    return _psutil_reader()


class TreeMemory:
    """Samples the summed RSS of this process's tree on a daemon thread.

    Args:
        interval: seconds between samples.

    Examples:
        >>> mem = TreeMemory(0.01)
        >>> mem.start()
        >>> mem.stop()
        >>> mem.peak is None or mem.peak > 0
        True
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak: int | None = None       # largest sum seen in a counted phase
        self.start_bytes: int | None = None  # the first sample's sum
        self.peak_processes = 0            # processes in the sample that gave the peak
        self._read = tree_reader()
        self._root = os.getpid()
        self._excluded: set[int] = set()   # first seen during a baseline phase
        self._known: set[int] = set()
        self._counting = True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        """Whether this system can be measured (Linux ``/proc``, or psutil)."""
        return self._read is not None

    def sample(self) -> None:
        """Read the tree once; count it toward the peak unless in a baseline phase."""
        if self._read is None:
            return
        sizes = self._read(self._root)
        with self._lock:
            new = sizes.keys() - self._known
            self._known |= new
            if not self._counting:
                self._excluded |= new
                return
            counted = {pid: rss for pid, rss in sizes.items() if pid not in self._excluded}
            total = sum(counted.values())
            if self.start_bytes is None:
                self.start_bytes = total
            if self.peak is None or total > self.peak:
                self.peak, self.peak_processes = total, len(counted)

    def phase(self, name: str) -> None:
        """Enter ``"pipeline"`` (counted) or ``"baseline"`` (not counted); the tree is
        read at the change, under the phase that ends."""
        self.sample()
        with self._lock:
            self._counting = name != "baseline"

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        """Take the first sample and start sampling. The descendants already running
        (multiprocessing's resource tracker, a server the test started) are not the
        measured run's: they never count."""
        if self._read is not None:
            # multiprocessing's resource tracker lives as long as the interpreter: started
            # here, it is running before every measurement, never counted in one test
            # and not in the next (spawn workers would start it on first use)
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
            running = set(self._read(self._root)) - {self._root}
            with self._lock:
                self._known |= running
                self._excluded |= running
        self.sample()
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, name="zephon-memory",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop sampling (idempotent); a last sample is taken first."""
        if self._thread is None:
            return
        self.sample()
        self._stop.set()
        self._thread.join()
        self._thread = None
