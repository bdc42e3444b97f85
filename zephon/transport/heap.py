"""A worker's shared heap: large NumPy arrays made by ops live in the arena already.

Without it, a worker's result array is made in the process heap and then copied
into an arena region for the consumer: one extra pass over every byte, a fifth
of a worker's time on 4 MiB items. With it, NumPy allocations of at least
:data:`DEFAULT_THRESHOLD_BYTES` made in the thread that runs tasks come from
the worker's arena (a NEP 49 allocator, ``zephon._kernels.heap``), and the
encoder sends such an array **by reference**: the region it already lives in
becomes the message's region, with no copy.

Invariants
----------
- **Fixed when the op returns.** What the consumer receives of a sample is what
  it held when the stage's last op on it returned, on every runner:
  :func:`settle` runs right then (``StageProgram.run_ops``, per sample) and
  replaces every array (and ``bytearray``) under the sample that the worker can
  still reach another way by a copy, with the walk below (without the
  encoder's leaf list); an exclusive one is handed over as it is. So a reused
  output buffer, a dict the op keeps or a thread still writing to the result
  changes nothing already returned, and the common case (fresh arrays) costs a
  walk, no copy. Objects of types the walk does not enter are handed over as
  they are.
- **Exclusive or copied.** A region is sent by reference only when nothing in
  the worker but the message itself can still reach the array: every container
  on its path from the payload's root (dicts, lists, tuples, the pipeline's
  records and batches) is referenced by its parent alone, the array by its container and
  the encoder's leaf list, and every array on its ``base`` chain by its view
  alone (:func:`exclusive_arrays`, :func:`exclusive_owner`). One walk decides,
  for the encoder and for :func:`settle`: each count is exact (the refcount
  kernel, :mod:`zephon.kernels.refcount_ref`, reads it where the object lives,
  before the walk binds it anywhere) and the walk subtracts exactly the holders
  it can name (:data:`BY_PARENT`, :data:`BY_VIEW`, :data:`BY_LEAF_LIST`); any
  reference left over is someone else's. An array under any other object (whose
  ``__reduce__`` could reach anything), or one with a weak reference to it, to an
  array on its base chain or to a container on its path (a finaliser, a
  ``WeakValueDictionary`` or another thread could turn it into a strong one after
  the check), is copied. A strong reference obtained after the check in any
  other way (``gc.get_referrers``), or a raw address an op kept (an integer
  holds no reference), is not detected. An op that keeps its output (a cache, a
  reused buffer, an attribute, a memoryview, a ``ctypes`` pointer, a closure)
  keeps a reference, so its array is copied and a later write in the worker can
  never reach the consumer's view.
- **Checked at first use.** The counts are trusted only after a self-test in
  the process (:func:`counts_trusted`: settle's walk must copy arrays a module
  global keeps and hand fresh ones over) and, for the heap, through the real
  encoder (:meth:`WorkerHeap.verify`: a kept heap array copied, a fresh one sent
  by reference). If either fails, one warning says why, :func:`settle` copies
  every array and the heap is off; the check is code, not an ``assert``, so it
  runs under ``python -O`` too.
- **Two-party release.** A region taken by the heap is reused only when both
  sides are done with it: the worker's NumPy frees it (``give``) and, if it was
  sent, the consumer releases it (the FREE message). Either may come first
  (:meth:`ShmArena.take` / ``give`` / ``mark_sent`` / ``free``).
- **Never at the transport's expense.** The heap holds at most its part of the
  arena bound (a fifth, ``ShmArena.heap_bytes``, :mod:`zephon.transport.budget`)
  in regions not (yet) sent, and messages never hold that part: they may fill
  the rest of the bound whatever the heap holds, and the slabs never exceed the
  bound. Beyond its part, and whenever the arena has no room without waiting,
  NumPy gets ``malloc`` memory. An
  allocation never waits and never fails because of the arena; one made while
  this thread is inside an arena method (a deallocation run by the garbage
  collector there) gets ``malloc`` memory too, as the free lists are mid-update.
- **Bounded to one thread.** The allocator is installed in the worker's task
  thread only (NumPy keeps the current allocator per context); arrays made in
  threads an op starts come from ``malloc`` and are copied.
- **Not in a forked child.** A process an op forks inherits the allocator and a
  copy of the arena's bookkeeping, and the arena mapping is shared: if it took
  regions it would write into results the worker hands out at the same time,
  and its writes to arrays it inherited would reach the worker's. An at-fork
  hook turns the heap off in the child (its arrays come from ``malloc``;
  freeing an inherited arena array there does nothing) and replaces the heap's
  slabs in the child by private memory, as fork does for ``malloc`` memory:
  only the bytes of the heap arrays alive at the fork (what the child can
  reach) are copied, the rest of each slab becomes fresh pages the child never
  touches (the price: a copy of the live heap arrays per fork, 6 MiB of
  32 MiB of slabs in ``tests/test_transport_abort.py``; ``subprocess`` does not
  run the hook and needs none, it executes a new program at once).
- **Nothing lost.** A region the heap takes from a slab the allocator cannot
  register (its range table is full) goes back at once, and NumPy gets
  ``malloc`` memory; a heap array claimed for a message that is never sent is
  the worker's again (:meth:`~zephon.transport.codec.Encoder.abort`).
- **Mapped until exit.** Heap arrays point into the slabs without holding the
  mapping (an op's daemon thread or exit handler may still read one): a slab
  the heap used is never unmapped, only its descriptor closed, when the arena
  closes.

Region states
-------------
A region the heap takes is tracked by the arena (``ShmArena._heap``: token ->
``_HELD | _SENT``); its two holders are the worker's NumPy array (``_HELD``) and
the consumer (``_SENT``), and it is free again only when neither holds it:

=================  ==========================================  =================
state              event (who)                                 next state
=================  ==========================================  =================
free               ``take`` (NumPy allocates >= threshold)     ``_HELD``
``_HELD``          ``give`` (NumPy frees the array)            free (recycled)
``_HELD``          ``mark_sent`` (``claim``: exclusive, sent)  ``_HELD|_SENT``
``_HELD|_SENT``    ``give`` (the worker drops its array)       ``_SENT``
``_HELD|_SENT``    ``free`` (the consumer's FREE message)      ``_HELD``
``_HELD|_SENT``    ``abort`` (the message was never sent)      ``_HELD``
``_SENT``          ``free`` (the consumer releases it)         free (recycled)
``_SENT``          ``abort`` (the message was never sent)      free (recycled)
=================  ==========================================  =================

``mark_sent`` refuses a region that is not ``_HELD`` alone (sent twice) or that
would take what messages hold past the bound; ``give`` is only queued (it runs
inside deallocations) and applied under the arena's lock. Only ``_HELD`` regions
count against the heap's share; ``_SENT`` ones count as the consumer's.

Lifecycle: :meth:`WorkerHeap.install` when the worker is ready, :meth:`close`
before the arena closes (NumPy then gets ``malloc`` for everything; arrays still
alive keep their regions, which go with the process). ``give`` may run inside
any deallocation, even in the middle of an arena method on the same thread, so it
only appends to a deque; the arena drains it under its lock.

``ZEPHON_WORKER_SHARED_HEAP=0`` in the worker's environment turns it off (then
every result is copied into the arena); so does a build without the
compiled kernels.
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import sys
import weakref
from typing import Any, Callable, cast

import numpy as np

from zephon.kernels import attr_refcount, base_refcount, item_refcount, item_refcounts

__all__ = ["DEFAULT_THRESHOLD_BYTES", "WorkerHeap", "by_reference_bytes", "exclusive_owner",
           "heap_enabled", "installed", "settle"]

log = logging.getLogger("zephon.transport.heap")

#: Smallest NumPy allocation the heap serves from the arena. Smaller results are cheap
#: to copy and are better coalesced with their neighbours into one region.
DEFAULT_THRESHOLD_BYTES = 1 << 20


def heap_enabled() -> bool:
    """Off with ``ZEPHON_WORKER_SHARED_HEAP=0``, and on an interpreter without the GIL
    (reference counts there do not prove that nothing else holds an array)."""
    gil = getattr(sys, "_is_gil_enabled", None)
    if gil is not None and not gil():
        return False
    return os.environ.get("ZEPHON_WORKER_SHARED_HEAP", "1") != "0"


def by_reference_bytes() -> int:
    """The smallest NumPy array a process worker's result carries by reference (made in
    its shared heap, handed to the consumer without a copy): ``DEFAULT_THRESHOLD_BYTES``,
    or 0 when the heap is off or the kernels are not compiled (every result is copied)."""
    return DEFAULT_THRESHOLD_BYTES if heap_enabled() and _compiled() is not None else 0


def _compiled() -> Any:
    try:
        return importlib.import_module("zephon._kernels.heap")
    except ImportError:
        return None


_installed: "WorkerHeap | None" = None
_fork_hook_registered = False


#: The mappings of every slab registered with the allocator in this process (see _take).
_KEPT_MAPPINGS: list = []


def _off_in_forked_child() -> None:
    global _installed
    heap = _installed
    if heap is not None and heap.kernel is not None:
        heap.kernel.configure(None, None, heap._size, heap.threshold)
        # only the arrays alive at the fork can be reached in the child: their bytes are
        # copied, the rest of each slab becomes fresh private pages
        heap.kernel.privatize([(address, entry[3])
                               for address, entry in list(heap._by_address.items())])
        # The forking thread may be the one the heap was installed in (an MTP worker's
        # engine starting its stage's workers with fork): its NumPy allocations go back
        # to the previous handler, and the child is free to install a heap of its own
        # (a forked pool worker does). Arrays the child inherited keep their handler.
        if heap._previous is not None:
            heap.kernel.restore(heap._previous)
            heap._previous = None
        _installed = None


def installed() -> "WorkerHeap | None":
    """The heap installed in this process (a pool worker's), or None."""
    return _installed


# -- exclusivity: one walk -----------------------------------------------------------------
#
# Every count is the refcount kernel's (zephon.kernels.refcount): exact, read where the
# object lives before the walk binds it anywhere. The walk subtracts the holders it can
# name, and a count of anything more is a holder it cannot: the object is shared.

#: The container an item is in (a list's, tuple's or dict's slot, a record's ``value``).
BY_PARENT = 1
#: The view whose ``base`` an array is.
BY_VIEW = 1
#: The encoder's list of the payload's leaves (once per occurrence of an array).
BY_LEAF_LIST = 1

#: A class attribute that lets the walk into an object: ``__heap_walk__ = True`` on a class
#: with a ``value`` slot whose instances pickle as ``(cls, (value, ...))`` and whose other
#: fields hold no arrays (the pipeline's ``Record``).
WALK_MARKER = "__heap_walk__"
#: A class attribute that lets the encoder's walk into a dict subclass as into a dict:
#: ``__heap_walk_items__ = True`` on a dict subclass whose instances pickle their items as
#: a plain dict of the same values (``dict(self)``) beside fields the walk does not enter
#: (the pipeline's ``Batch`` and its ``meta``). An array in such a field is no leaf the walk
#: vouches for, so it is copied.
WALK_ITEMS_MARKER = "__heap_walk_items__"
#: Nesting the walk follows (deeper containers: nothing goes by reference, and
#: :func:`settle` hands them over as they are).
MAX_SETTLE_DEPTH = 64
_SAME = object()  # "keep this node": no copy was needed at or below it
#: Values the walk passes over at once (immutable, hold no array).
_PLAIN = frozenset({int, float, bool, str, bytes, type(None), complex})
#: A list or tuple longer than this is first checked for anything the walk enters, by
#: the set of its items' types (a list of 100 000 ints is not visited item by item).
_SCAN_ITEMS = 16


class _Walk:
    """What one walk is for. ``holders``: the references an exclusive array has beyond
    its container's (the encoder's leaf list: 1; :func:`settle`: 0). ``exclusive``:
    collects ``id()`` of the exclusive arrays (the encoder's), or None. ``settling``:
    replace what is shared by copies (and enter dict subclasses), else only look."""

    __slots__ = ("exclusive", "holders", "settling")

    def __init__(self, holders: int, exclusive: set[int] | None, settling: bool) -> None:
        self.holders, self.exclusive, self.settling = holders, exclusive, settling


_SETTLE = _Walk(0, None, True)


def _chain_end(array: np.ndarray) -> Any:
    """What owns ``array``'s memory when nothing but ``array``'s holder can reach it (no
    weak reference on the way, every base held by its view alone): the array that owns
    its memory, or an immutable ``bytes``; else None."""
    while True:
        if weakref.getweakrefcount(array):
            return None  # a weak reference could give someone a strong one again
        held = base_refcount(array)  # (counted before anything here holds the base)
        if held == 0:
            return array
        base = array.base
        if type(base) is bytes:
            return base
        if type(base) is not np.ndarray or held - BY_VIEW != 0:
            return None
        array = base


def _visit(node: Any, extra: int, depth: int, w: _Walk) -> Any:
    """The walk at ``node``, counted with ``extra`` references beyond its parent's:
    ``node``'s replacement when settling and it is shared, else :data:`_SAME`. The
    common kinds (arrays, bytearrays, plain values, exact lists, tuples and dicts,
    marked records) are decided here, dict subclasses in :func:`_visit_dict_subclass`."""
    t = type(node)
    if t is np.ndarray:
        if extra == w.holders and _chain_end(node) is not None:
            if w.exclusive is not None:
                w.exclusive.add(id(node))
            return _SAME
        return node.copy(order="K") if w.settling else _SAME
    if t is bytearray:
        return bytearray(node) if w.settling and extra != 0 else _SAME
    if depth >= MAX_SETTLE_DEPTH or t in _PLAIN:
        return _SAME
    walk = _WALKERS.get(t)
    if walk is not None:
        if extra != 0 or weakref.getweakrefcount(node):
            return _shared(node, depth, w)
        return walk(node, depth, w)
    if isinstance(node, dict):
        return _visit_dict_subclass(node, extra, depth, w)
    if not w.settling and extra == 0 and getattr(t, WALK_MARKER, False) is True \
            and not weakref.getweakrefcount(node):
        extra = attr_refcount(node, "value") - BY_PARENT  # (before node.value is loaded)
        _visit(node.value, extra, depth + 1, w)
    return _SAME  # any other object (its __reduce__ could reach anything): as it is


def _shared(node: Any, depth: int, w: _Walk) -> Any:
    """A container something beyond its parent holds (or refers to weakly): copied with
    everything under it when settling, else left out of the walk."""
    return _copied(node, depth) if w.settling else _SAME


def _visit_dict_subclass(node: Any, extra: int, depth: int, w: _Walk) -> Any:
    """A dict subclass: walked as a dict when settling or when its class is marked with
    :data:`WALK_ITEMS_MARKER` (copied when settling and shared); else as any other
    object (a record's class marker is honoured as in :func:`_visit`)."""
    t = type(node)
    if w.settling or getattr(t, WALK_ITEMS_MARKER, False) is True:
        if extra != 0 or weakref.getweakrefcount(node):  # (a dict subclass can have one)
            return _shared(node, depth, w)
        return _visit_dict(node, depth, w)
    if extra == 0 and getattr(t, WALK_MARKER, False) is True \
            and not weakref.getweakrefcount(node):  # (the encoder's walk: not settling)
        extra = attr_refcount(node, "value") - BY_PARENT
        _visit(node.value, extra, depth + 1, w)
    return _SAME


def _visit_list(node: list, depth: int, w: _Walk) -> Any:
    if _holds_nothing_to_settle(node):
        return _SAME
    counts = item_refcounts(node)
    for k in range(len(counts)):
        new = _visit(node[k], counts[k] - BY_PARENT, depth + 1, w)
        if new is not _SAME:
            node[k] = new
    return _SAME


def _visit_tuple(node: tuple, depth: int, w: _Walk) -> Any:
    if _holds_nothing_to_settle(node):
        return _SAME
    counts = item_refcounts(node)
    changed: dict[int, Any] = {}
    for k in range(len(counts)):
        new = _visit(node[k], counts[k] - BY_PARENT, depth + 1, w)
        if new is not _SAME:
            changed[k] = new
    if not changed:
        return _SAME
    return tuple(changed.get(k, v) for k, v in enumerate(node))


def _visit_dict(node: dict, depth: int, w: _Walk) -> Any:
    """A dict's values (of a subclass too, when settling: its storage, read without a key
    look-up; a replaced value is stored with ``dict.__setitem__``)."""
    counts = item_refcounts(node)  # before the list of values below holds them too
    values = list(dict.values(node))
    keys = None
    plain = _PLAIN
    for k in range(len(counts)):
        if type(values[k]) in plain:
            continue
        new = _visit(values[k], counts[k] - BY_PARENT, depth + 1, w)
        if new is not _SAME:
            if keys is None:
                keys = list(dict.keys(node))
            dict.__setitem__(node, keys[k], new)
    del values
    return _SAME


#: The walk into each container type it enters by exact type (dict subclasses: see
#: :func:`_visit_dict_subclass`).
_WALKERS: dict[type, Callable[[Any, int, _Walk], Any]] = {
    list: _visit_list, tuple: _visit_tuple, dict: _visit_dict}


def _holds_nothing_to_settle(node: list | tuple) -> bool:
    """Whether a long ``node`` holds no item the walk would enter or copy."""
    if len(node) <= _SCAN_ITEMS:
        return False
    kinds = set(map(type, node))
    return not any(t is np.ndarray or t is bytearray or t is list or t is tuple
                   or issubclass(t, dict) or getattr(t, WALK_MARKER, False) is True
                   for t in kinds)


def exclusive_arrays(box: list) -> set[int]:
    """``id()`` of every array reachable from ``box[0]`` only through the payload:
    through dicts, lists and tuples (exact types), dict subclasses marked with
    :data:`WALK_ITEMS_MARKER` (their values) and objects of classes marked with
    :data:`WALK_MARKER` (their ``.value``), each referenced by its parent alone, the
    array by its parent and the encoder's leaf list, and its base chain as
    :func:`exclusive_owner` says. An array under any other object (its own
    ``__reduce__`` could reach anything), or under a container the worker keeps, is
    not in the set; nor is any when the counts failed their self-test
    (:func:`counts_trusted`). ``box`` is a one-item list the caller holds the payload
    by, and nothing else."""
    if _TRUSTED is not True and not counts_trusted():
        return set()
    w = _Walk(BY_LEAF_LIST, set(), False)
    extra = item_refcount(box, 0) - BY_PARENT  # (counted before box[0] is an argument)
    _visit(box[0], extra, 0, w)
    return cast("set[int]", w.exclusive)


def exclusive_owner(leaves: list, i: int) -> np.ndarray | None:
    """The array that owns the data of ``leaves[i]`` if the leaf is reachable only
    through the payload being encoded (one container) and ``leaves``, nothing refers to
    it weakly, and every array on its base chain is referenced by its view alone; else
    None. The caller must not hold the leaf in a local name (a holder the walk cannot
    name: the leaf would count as shared)."""
    if item_refcount(leaves, i) - BY_PARENT - BY_LEAF_LIST != 0:
        return None
    end = _chain_end(leaves[i])
    return end if type(end) is np.ndarray else None


# -- the self-test: counts that tell a kept array from a fresh one -------------------------

#: What the self-test's "op" keeps (a module global, as an op's cache would be).
_PROBE_KEPT: list = []
_TRUSTED: bool | None = None  # the self-test's verdict (None: not run yet)


def _walk_problem() -> str | None:
    """Settle a sample the way :func:`settle` does, with arrays the "op" keeps (a module
    global, a view of it, one under a tuple) beside fresh ones: None when every kept
    one was copied and every fresh one handed over, else what went wrong."""
    _PROBE_KEPT[:] = [np.arange(8.0)]
    try:
        value = {"kept": _PROBE_KEPT[0], "kept_view": _PROBE_KEPT[0][2:],
                 "fresh": np.zeros(4), "view": np.zeros(8)[2:],
                 "nested": [np.zeros(2), (_PROBE_KEPT[0], np.zeros(2))]}
        fresh = [id(value["fresh"]), id(value["view"]), id(value["nested"][0]),
                 id(value["nested"][1][1])]
        slot = _Slot(value)
        del value
        _settle_counted(slot)
        got = slot.value
        kept = [got["kept"], got["kept_view"].base, got["nested"][1][0]]
        if any(a is _PROBE_KEPT[0] for a in kept):
            return "an array the op keeps (a module global) passed as exclusive"
        if [id(got["fresh"]), id(got["view"]), id(got["nested"][0]),
                id(got["nested"][1][1])] != fresh:
            return "a fresh array was taken for one the op keeps"
        return None
    finally:
        _PROBE_KEPT.clear()


def counts_trusted() -> bool:
    """Whether the reference counts tell arrays the op keeps from fresh ones, checked once
    per process, at first use (:func:`_walk_problem`; the shared heap checks the encoder
    too, :meth:`WorkerHeap.verify`). When they do not (an interpreter, a NumPy or a
    refactor the walk does not know), one warning says why, :func:`settle` copies
    every array and nothing goes by reference."""
    global _TRUSTED
    if _TRUSTED is None:
        problem = None if _counts_exact() else "the interpreter runs without the GIL"
        if problem is None:
            problem = _walk_problem()
        _TRUSTED = problem is None
        if problem is not None:
            _distrust(problem)
    return _TRUSTED


def _distrust(problem: str) -> None:
    global _TRUSTED, _DISTRUST_SAID
    _TRUSTED = False
    if not _DISTRUST_SAID:
        _DISTRUST_SAID = True
        log.warning("zephon: the shared heap's exclusivity check failed its self-test (%s): "
                    "every array a sample holds is copied when its op returns, and no result "
                    "goes by reference", problem)


_DISTRUST_SAID = False


class _Slot:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _counts_exact() -> bool:
    """Reference counts prove exclusivity only with the GIL (see :func:`heap_enabled`)."""
    gil = getattr(sys, "_is_gil_enabled", None)
    return gil is None or bool(gil())


# -- settling a sample when its op returns ------------------------------------------------

def settle(holder: Any) -> None:
    """Fix what the consumer receives of ``holder.value`` (a record) now, when the
    sample's last op has returned: every NumPy array and ``bytearray`` under it that
    the worker can still reach another way is replaced by a copy, an exclusive one is
    left as it is.

    The walk is :func:`exclusive_arrays`' (dicts and their subclasses, lists and tuples
    of exact type) without the encoder's leaf list: an array counts as exclusive when
    its container alone refers to it, nothing refers to it weakly, and every array on
    its ``base`` chain is referenced by its view alone, down to memory that owns itself
    (or immutable ``bytes``). A container something else refers to (the op keeps the
    dict it returns) is copied with every array under it. Objects of other types are
    handed over as they are, and so are containers nested deeper than
    :data:`MAX_SETTLE_DEPTH`. Costs a visit per container and array of the sample;
    copies only what is not exclusive (everything, when the counts failed their
    self-test: :func:`counts_trusted`)."""
    if _TRUSTED is not True and not counts_trusted():
        holder.value = _copied(holder.value, 0)
        return
    _settle_counted(holder)


def _settle_counted(holder: Any) -> None:
    extra = attr_refcount(holder, "value") - BY_PARENT  # (before holder.value is loaded)
    new = _visit(holder.value, extra, 0, _SETTLE)
    if new is not _SAME:
        holder.value = new


def _copied(node: Any, depth: int) -> Any:
    """An independent copy of ``node`` for a consumer: containers of the walked types
    rebuilt, arrays and bytearrays copied, anything else shared."""
    t = type(node)
    if t is np.ndarray:
        return node.copy(order="K")
    if t is bytearray:
        return bytearray(node)
    if depth >= MAX_SETTLE_DEPTH:
        return node
    if (t is list or t is tuple) and _holds_nothing_to_settle(node):
        return list(node) if t is list else node
    if t is list:
        return [_copied(v, depth + 1) for v in node]
    if t is tuple:
        return tuple(_copied(v, depth + 1) for v in node)
    if isinstance(node, dict):
        out = {} if t is dict else copy.copy(node)
        for key, value in list(node.items()):
            dict.__setitem__(out, key, _copied(value, depth + 1))
        return out
    return node


# -- the heap ------------------------------------------------------------------------------

_PROBING = "probing"  # WorkerHeap.verified while its probe runs
_UNDECIDED = "undecided"  # WorkerHeap._probe: no room to probe now


class WorkerHeap:
    """The worker side of the shared heap over ``arena`` (a :class:`ShmArena`)."""

    def __init__(self, arena: Any, threshold: int = DEFAULT_THRESHOLD_BYTES) -> None:
        self.arena, self.threshold = arena, threshold
        self.kernel: Any = _compiled() if heap_enabled() else None
        self._by_address: dict[int, tuple[int, Any, int, int]] = {}  # addr -> token, slab...
        self._ranges: set[int] = set()
        self._previous: Any = None
        self._table_full_said = False
        self.sent = 0  # regions sent by reference (for tests and explain)
        #: The encoder's self-test (:meth:`verify`): None (not run yet), _PROBING, True
        #: (results may go by reference) or False (the heap is off).
        self.verified: Any = None

    @property
    def active(self) -> bool:
        return self._previous is not None

    def install(self) -> bool:
        """Serve this thread's large NumPy allocations from the arena; False when the
        heap is off or not built."""
        if self.kernel is None or self.active:
            return False
        global _installed, _fork_hook_registered
        if not _fork_hook_registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_off_in_forked_child)
            _fork_hook_registered = True
        self.kernel.configure(self._take, self._give, self._size, self.threshold)
        self._previous = self.kernel.install()
        _installed = self
        log.debug("shared heap installed: NumPy arrays of %d bytes or more come from the "
                  "arena", self.threshold)
        return True

    def close(self, give_back: bool = False) -> None:
        """Stop serving allocations (arrays alive keep their regions; with ``give_back``
        their regions still come back to the arena when they are freed: a heap turned off
        in a worker that goes on)."""
        global _installed
        if self.kernel is not None and self.active:
            self.kernel.configure(None, self._give if give_back else None, self._size,
                                  self.threshold)
            self.kernel.restore(self._previous)
            self._previous = None
            if _installed is self:
                _installed = None
            log.debug("shared heap closed: %d results sent by reference", self.sent)

    # -- callbacks from the allocator (GIL held) ----------------------------------------
    def _take(self, nbytes: int) -> int:
        got = self.arena.take(nbytes, self.arena.heap_bytes)
        if got is None:
            return 0
        slab, offset, token = got
        if slab.slab_id not in self._ranges:
            try:
                self.kernel.add_range(slab.address, slab.size)
            except OverflowError:
                # the allocator's range table is full: it could not route this region's
                # free back here, so the region goes back at once and NumPy gets malloc
                # (the result is copied, as without the heap)
                self.arena.give(token)
                if not self._table_full_said:
                    self._table_full_said = True
                    log.warning("shared heap: the allocator's slab range table is full; "
                                "arrays in new slabs come from malloc")
                return 0
            self._ranges.add(slab.slab_id)
            slab.keep_mapped = True
            # The allocator's range table lives as long as the process: so does the
            # mapping (dropping the last Slab would unmap it, and a fork's privatize()
            # would then read unmapped memory; malloc could reuse the addresses).
            _KEPT_MAPPINGS.append(slab.mapping)
        address = slab.address + offset
        self._by_address[address] = (token, slab, offset, nbytes)
        return address

    def _give(self, address: int) -> None:
        entry = self._by_address.pop(address, None)
        if entry is not None:
            self.arena.give(entry[0])

    def _size(self, address: int) -> int:
        entry = self._by_address.get(address)
        return entry[3] if entry is not None else 0

    # -- the encoder's side --------------------------------------------------------------
    def verify(self, encoder: Any, peer: Any) -> bool:
        """Whether results may go by reference, checked at first use through the real
        encoder (:meth:`_probe`): an array the "op" keeps (a module global) must be
        copied and a fresh one sent by reference. If not, one warning says why and the
        heap is off for good (closed: NumPy gets ``malloc``, every result is copied, and
        the regions of heap arrays still alive come back as they are freed).
        ``peer`` is the encoder's peer (the probe encodes for a fresh one of its type
        and aborts what it encoded: nothing is sent, nothing announced to ``peer``)."""
        if self.verified is not None:
            return self.verified is not False
        if not counts_trusted():
            self.verified = False
            self.close(give_back=True)
            return False
        self.verified = _PROBING  # (the probe runs encode_owned: the real path)
        try:
            problem = self._probe(encoder, type(peer)(peer.can_map_fds))
        except Exception as exc:  # noqa: BLE001 - a heap that cannot be checked is off
            problem = f"the probe failed: {type(exc).__name__}: {exc}"
        if problem is _UNDECIDED:
            self.verified = None  # no room to probe now: nothing by reference this time
            return False
        self.verified = problem is None
        if problem is not None:
            _distrust(problem)
            self.close(give_back=True)
        return self.verified

    def _probe(self, encoder: Any, peer: Any) -> Any:
        """None when the encoder copies a kept heap array and sends a fresh one by
        reference; else what went wrong, or :data:`_UNDECIDED` when the arena has no room
        for the probe now (or its arrays did not come from the heap)."""
        arena, n = self.arena, max(self.threshold, 64)
        if arena.starved or arena.consumer_bytes + 2 * n > arena.max_bytes:
            return _UNDECIDED
        _PROBE_KEPT[:] = [np.ones(n // 8, dtype=np.int64)]  # the "op" keeps it
        try:
            if not self._lives_here(_PROBE_KEPT[0]):
                return _UNDECIDED
            kept_shared = self._probe_one(encoder, peer, [{"probe": _PROBE_KEPT[0]}])
        finally:
            _PROBE_KEPT.clear()
        box = [{"probe": np.ones(n // 8, dtype=np.int64)}]
        if not self._lives_here(box[0]["probe"]):
            return _UNDECIDED
        fresh_shared = self._probe_one(encoder, peer, box)
        del box
        if kept_shared:
            return "an array the op keeps (a module global) went by reference"
        if not fresh_shared:
            return "a fresh array nothing else holds was copied"
        return None

    def _lives_here(self, array: np.ndarray) -> bool:
        return array.__array_interface__["data"][0] in self._by_address

    def _probe_one(self, encoder: Any, peer: Any, box: list) -> bool:
        """Whether ``box[0]`` went by reference; what encoding it took is given back."""
        before = self.sent
        header = encoder.encode_owned(box, peer)[0]
        shared = self.sent > before
        encoder.abort(header, peer)  # (a heap region it claimed is the worker's again)
        self.sent = before
        return shared

    def has_live(self) -> bool:
        """Whether any array of the heap is alive (else nothing can go by reference)."""
        return bool(self._by_address)

    def claim(self, leaves: list, i: int) -> tuple[int, Any, int, int, int] | None:
        """``(token, slab, offset, nbytes, start)`` of the region ``leaves[i]`` lives in,
        marked as sent, when the leaf may go by reference (see the module docstring);
        ``start`` is the leaf's first byte in the region. Else None. The caller must not
        hold ``leaves[i]`` in a local name (see :func:`exclusive_owner`)."""
        owner = exclusive_owner(leaves, i)
        if owner is None:
            return None
        leaf = leaves[i]
        address = owner.__array_interface__["data"][0]
        entry = self._by_address.get(address)
        if entry is None:
            return None
        token, slab, offset, nbytes = entry
        if 2 * leaf.nbytes < nbytes:
            return None  # a small view would pin its whole region in the consumer: copied
        if not self.arena.mark_sent(token):
            return None  # already sent by an earlier message: it is the consumer's now
        self.sent += 1
        return token, slab, offset, nbytes, leaf.__array_interface__["data"][0] - address
