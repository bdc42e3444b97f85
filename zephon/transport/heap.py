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
  records) is referenced by its parent alone, the array by its container and
  the encoder, and every array on its ``base`` chain by its child alone
  (:func:`exclusive_arrays`, :func:`exclusive_owner`: reference counts compared
  with calibrations made on the same code paths). An array under any other
  object (whose ``__reduce__`` could reach anything), or one with a weak
  reference to it or to an array on its base chain (a finaliser, a
  ``WeakValueDictionary`` or another thread could turn it into a strong one
  after the check), is copied. A strong reference obtained after the check in
  any other way (``gc.get_referrers``) is not detected. An op that keeps its output (a
  cache, a reused buffer, an attribute) keeps a reference, so its array is
  copied as before and a later write in the worker can never reach the
  consumer's view.
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

Lifecycle: :meth:`WorkerHeap.install` when the worker is ready, :meth:`close`
before the arena closes (NumPy then gets ``malloc`` for everything; arrays still
alive keep their regions, which go with the process). ``give`` may run inside
any deallocation, even in the middle of an arena method on the same thread, so it
only appends to a deque; the arena drains it under its lock.

``ZEPHON_WORKER_SHARED_HEAP=0`` in the worker's environment turns it off (then
every result is copied into the arena, as before); so does a build without the
compiled kernels.
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import sys
import weakref
from typing import Any

import numpy as np

__all__ = ["DEFAULT_THRESHOLD_BYTES", "WorkerHeap", "exclusive_owner", "heap_enabled",
           "installed", "settle"]

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


# -- exclusivity -------------------------------------------------------------------------
#
# Reference counts are compared with calibrations made on the very code paths below (a
# name bound to an object, a temporary argument: each adds one), so none of these
# helpers may bind the object it counts to a local name before counting it.

def _held_once(parent: Any, key: Any) -> int:
    return sys.getrefcount(parent[key])


def _held_once_listed(values: list, i: int) -> int:
    """Of a dict's value, counted in ``list(d.values())`` (no key lookup: that would
    call the keys' ``__hash__``, which pickling never does)."""
    return sys.getrefcount(values[i])


def _value_refs(record: Any) -> int:
    return sys.getrefcount(record.value)


#: A class attribute that lets the walk into an object: ``__heap_walk__ = True`` on a class
#: with a ``value`` slot whose instances pickle as ``(cls, (value, ...))`` and whose other
#: fields hold no arrays (the pipeline's ``Record``).
WALK_MARKER = "__heap_walk__"


def _leaf_refs(leaves: list, i: int) -> int:
    leaf = leaves[i]
    return sys.getrefcount(leaf)


def _base_refs(array: np.ndarray) -> int:
    return sys.getrefcount(array.base)


class _Slot:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _calibrate() -> tuple[int, int, int, int]:
    """Reference counts of an object held by one container (``parent[key]``), by one
    ``.value`` slot, of an exclusive leaf (one container plus the encoder's leaf list),
    and of an exclusive base (held by one view)."""
    once = _held_once([np.empty(2)], 0)
    d = {"k": np.empty(2)}
    values = list(d.values())
    once_listed = _held_once_listed(values, 0)
    del values
    assert once_listed == once + 1, "calibration"
    slot = _value_refs(_Slot(np.empty(2)))
    container = [np.empty(2)]
    leaves = [container[0]]
    leaf = _leaf_refs(leaves, 0)
    base = _base_refs([np.empty(4)[1:]][0])
    return once, slot, leaf, base


_ONCE, _SLOT, _LEAF_REFS, _BASE_REFS = _calibrate()
#: Nodes :func:`exclusive_arrays` visits at most (beyond: nothing goes by reference).
MAX_WALK_NODES = 4096


def exclusive_arrays(box: list) -> set[int]:
    """``id()`` of every array reachable from ``box[0]`` only through the payload:
    through dicts, lists and tuples (exact types) and objects of classes marked with
    :data:`WALK_MARKER` (their ``.value``), each referenced by its parent alone, the array itself by its parent
    and the encoder's leaf list. An array under any other object (its own
    ``__reduce__`` could reach anything), or under a container the worker keeps, is
    not in the set. ``box`` is a one-item list the caller holds the payload by, and
    nothing else."""
    out: set[int] = set()
    stack: list = []
    # (each count is taken before the object is an argument: that would add one)
    extra = _held_once(box, 0) - _ONCE
    _consider(box[0], extra, stack, out)
    visited = 0
    while stack:
        node = stack.pop()
        visited += 1
        if visited > MAX_WALK_NODES:
            return set()
        t = type(node)
        if t is dict:
            values = list(node.values())
            for k in range(len(values)):
                extra = _held_once_listed(values, k) - _ONCE - 1
                _consider(values[k], extra, stack, out)
            del values
        elif t is list or t is tuple:
            for k in range(len(node)):
                extra = _held_once(node, k) - _ONCE
                _consider(node[k], extra, stack, out)
        else:  # a marked object
            extra = _value_refs(node) - _SLOT
            _consider(node.value, extra, stack, out)
    return out


def _consider(child: Any, extra: int, stack: list, out: set[int]) -> None:
    """``child`` was counted with ``extra`` references beyond its parent's: an array with
    exactly one more (the encoder's leaf list) is exclusive; a container with none is
    walked."""
    t = type(child)
    if t is np.ndarray:
        if extra == 1:
            out.add(id(child))
    elif extra == 0 and (t is dict or t is list or t is tuple
                         or getattr(t, WALK_MARKER, False) is True):
        stack.append(child)


def exclusive_owner(leaves: list, i: int) -> np.ndarray | None:
    """The array that owns the data of ``leaves[i]`` if the leaf is reachable only
    through the payload being encoded (one container) and ``leaves``, and every array
    on its base chain only through its child; else None."""
    # The caller must not hold the leaf in a local name: its count is compared with the
    # calibration's exactly (and no name here holds a base while its count is taken).
    if _leaf_refs(leaves, i) != _LEAF_REFS:
        return None
    array = leaves[i]
    while True:
        if weakref.getweakrefcount(array):
            return None  # a weak reference could give the op a strong one again
        if array.base is None:
            return array
        if type(array.base) is not np.ndarray or _base_refs(array) != _BASE_REFS:
            return None
        array = array.base


# -- settling a sample when its op returns ------------------------------------------------

#: Nesting :func:`settle` follows (deeper containers are handed over as they are).
MAX_SETTLE_DEPTH = 64
_SAME = object()  # "keep this node": no copy was needed at or below it


def settle(holder: Any) -> None:
    """Fix what the consumer receives of ``holder.value`` (a record) now, when the
    sample's last op has returned: every NumPy array and ``bytearray`` under it that
    the worker can still reach another way is replaced by a copy, an exclusive one is
    left as it is.

    The walk is :func:`exclusive_arrays`' (dicts and their subclasses, lists and tuples
    of exact type; reference counts against the same calibrations) without the
    encoder's leaf list: an array counts as exclusive when its container alone refers
    to it, nothing refers to it weakly, and every array on its ``base`` chain is
    referenced by its child alone, down to memory that owns itself (or immutable
    ``bytes``). A container something else refers to (the op keeps the dict it
    returns) is copied with every array under it. Objects of other types are handed
    over as they are, and so are containers nested deeper than
    :data:`MAX_SETTLE_DEPTH`. Costs a visit per container and array of the sample;
    copies only what is not exclusive."""
    if not _COUNTS_EXACT:
        holder.value = _copied(holder.value, 0)
        return
    extra = _value_refs(holder) - _SLOT
    if extra == 0 and type(holder.value) is dict:  # the common case: a fresh dict
        _settle_dict(holder.value, 0)
        return
    new = _settled(holder.value, extra, 0)
    if new is not _SAME:
        holder.value = new


#: Values :func:`settle` passes over at once (immutable, hold no array).
_PLAIN = frozenset({int, float, bool, str, bytes, type(None), complex})


def _counts_exact() -> bool:
    """Reference counts prove exclusivity only with the GIL (see :func:`heap_enabled`)."""
    gil = getattr(sys, "_is_gil_enabled", None)
    return gil is None or bool(gil())


_COUNTS_EXACT = _counts_exact()
#: A list or tuple longer than this is first checked for anything the walk enters, by
#: the set of its items' types (a list of 100 000 ints is not visited item by item).
_SCAN_ITEMS = 16


def _holds_nothing_to_settle(node: list | tuple) -> bool:
    """Whether a long ``node`` holds no item the walk would enter or copy."""
    if len(node) <= _SCAN_ITEMS:
        return False
    kinds = set(map(type, node))
    return not any(t is np.ndarray or t is bytearray or t is list or t is tuple
                   or issubclass(t, dict) for t in kinds)


def _chain_exclusive(array: np.ndarray) -> bool:
    """Whether nothing but ``array``'s holder can reach its memory: no weak references,
    every base on its chain held by its child alone, the chain ending in an array that
    owns its memory or in ``bytes``."""
    while True:
        if weakref.getweakrefcount(array):
            return False
        if array.base is None or type(array.base) is bytes:
            return True
        if type(array.base) is not np.ndarray or _base_refs(array) != _BASE_REFS:
            return False
        array = array.base


def _settled(node: Any, extra: int, depth: int) -> Any:
    """``node``'s replacement (counted with ``extra`` references beyond its parent's), or
    :data:`_SAME` when it stays."""
    t = type(node)
    if t is np.ndarray:
        return _SAME if extra == 0 and _chain_exclusive(node) else node.copy(order="K")
    if t is bytearray:
        return _SAME if extra == 0 else bytearray(node)
    if depth >= MAX_SETTLE_DEPTH or not (t is list or t is tuple or isinstance(node, dict)):
        return _SAME
    if extra != 0:
        return _copied(node, depth)
    if (t is list or t is tuple) and _holds_nothing_to_settle(node):
        return _SAME
    if isinstance(node, dict):
        _settle_dict(node, depth)
        return _SAME
    if t is list:
        for k in range(len(node)):
            extra = _held_once(node, k) - _ONCE
            new = _settled(node[k], extra, depth + 1)
            if new is not _SAME:
                node[k] = new
        return _SAME
    return _settle_tuple(node, depth)


def _settle_dict(node: dict, depth: int) -> None:
    values = list(node.values())
    keys = None
    plain, ndarray, once = _PLAIN, np.ndarray, _ONCE + 1
    for k in range(len(values)):
        t = type(values[k])
        if t in plain:
            continue
        # (counted inline, as _held_once_listed does: the dict, the list, the argument)
        extra = sys.getrefcount(values[k]) - once
        if t is ndarray and extra == 0 and values[k].base is None and \
                not weakref.getweakrefcount(values[k]):
            continue  # a fresh array that owns its memory: the common case
        new = _settled(values[k], extra, depth + 1)
        if new is not _SAME:
            if keys is None:
                keys = list(node)
            dict.__setitem__(node, keys[k], new)
    del values


def _settle_tuple(node: tuple, depth: int) -> Any:
    changed: dict[int, Any] = {}
    for k in range(len(node)):
        extra = _held_once(node, k) - _ONCE
        new = _settled(node[k], extra, depth + 1)
        if new is not _SAME:
            changed[k] = new
    if not changed:
        return _SAME
    return tuple(changed.get(k, v) for k, v in enumerate(node))


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

    def close(self) -> None:
        """Stop serving allocations (arrays alive keep their regions)."""
        global _installed
        if self.kernel is not None and self.active:
            self.kernel.configure(None, None, self._size, self.threshold)
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
