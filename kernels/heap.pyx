# cython: language_level=3
"""A NumPy data allocator (NEP 49) that can place large arrays in shared memory.

Caller: :mod:`zephon.transport.heap` (a pool worker's :class:`WorkerHeap`), which
installs it in the thread that runs tasks. It has no pure-Python reference: without
this module the worker copies results into its arena, as it always could.

What it does, per NumPy data allocation in a thread where it is installed:

- below ``threshold`` bytes, or while no ``take`` callback is set: the allocator
  that was current when it was installed (NumPy's default, with its cache of
  small buffers), called through that handler's own functions;
- at or above ``threshold``: ``take(nbytes)`` (Python, called with the GIL) returns an
  address inside one of the worker's arena slabs, or 0 for "use malloc". ``calloc``
  then zeroes the region (recycled shared memory is not zero);
- ``free`` of an address inside a registered slab range calls ``give(address)``
  (the owner decides when the region is reused: not before the consumer has
  released it too); every other address goes to the C library's ``free``;
- ``realloc`` of a slab address moves the data to memory of the previous
  allocator (``size(address)`` says how much to copy) and gives the region back.
- when ``take`` answers 0 (no room without waiting), the previous allocator.

``configure(None, None, size, t)`` turns it off (a forked child): an arena address
is then never taken, and freeing one does nothing. A realloc of an arena address
whose size is unknown copies up to the end of its slab (never less than the data).

Arrays remember the allocator that made them, so an array from the arena is freed
through ``give`` whichever thread drops it. Slab ranges are only ever added: a slab of
the worker's arena stays mapped until the worker exits. Callback errors are reported
as unraisable and answered with malloc (never a failed allocation because of the
arena).
"""

from cpython.exc cimport PyErr_Fetch, PyErr_Restore, PyErr_WriteUnraisable
from cpython.ref cimport PyObject
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New
from libc.stdint cimport uint8_t, uintptr_t
from libc.string cimport memcpy, memset, strncpy
from posix.mman cimport (
    MAP_ANONYMOUS, MAP_FAILED, MAP_FIXED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap,
)

cimport numpy as cnp

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    ctypedef struct PyDataMemAllocator:
        void *ctx
        void *(*malloc)(void *ctx, size_t size) noexcept nogil
        void *(*calloc)(void *ctx, size_t nelem, size_t elsize) noexcept nogil
        void *(*realloc)(void *ctx, void *ptr, size_t new_size) noexcept nogil
        void (*free)(void *ctx, void *ptr, size_t size) noexcept nogil

    ctypedef struct PyDataMem_Handler:
        char name[127]
        uint8_t version
        PyDataMemAllocator allocator

    object PyDataMem_SetHandler(object handler)

DEF MAX_RANGES = 512

cdef uintptr_t _starts[MAX_RANGES]
cdef uintptr_t _ends[MAX_RANGES]
cdef int _n_ranges = 0
cdef size_t _threshold = 1 << 20
cdef object _take = None  # nbytes -> address (0: use malloc)
cdef object _give = None  # address -> None
cdef object _size = None  # address -> region bytes
cdef PyDataMem_Handler _handler
cdef object _capsule = None
cdef PyDataMem_Handler *_prev = NULL  # the allocator everything else goes to
cdef object _prev_capsule = None  # keeps it alive


cdef inline uintptr_t _range_end(void *ptr) noexcept nogil:
    """The end of the registered slab range ``ptr`` is in, or 0."""
    cdef uintptr_t p = <uintptr_t>ptr
    cdef int i
    for i in range(_n_ranges):
        if _starts[i] <= p < _ends[i]:
            return _ends[i]
    return 0


cdef inline bint _in_ranges(void *ptr) noexcept nogil:
    return _range_end(ptr) != 0


# Each callback runs with an exception possibly in flight (NumPy frees a temporary while
# the stack unwinds, or a result on its own error path): it is put aside and restored, or
# the call would fail and the exception be lost.

cdef enum:
    TAKE = 0
    GIVE = 1
    SIZE = 2


cdef uintptr_t _call(int which, uintptr_t arg) noexcept nogil:
    """``take(arg)``, ``give(arg)`` or ``size(arg)`` with the GIL and the pending
    exception put aside; 0 when the callback is unset or fails (reported as
    unraisable)."""
    cdef uintptr_t out = 0
    cdef PyObject *et
    cdef PyObject *ev
    cdef PyObject *tb
    with gil:
        PyErr_Fetch(&et, &ev, &tb)
        fn = (_take, _give, _size)[which]
        try:
            if fn is not None:
                result = fn(arg)
                out = <uintptr_t>result if result is not None else 0
        except BaseException:
            PyErr_WriteUnraisable(fn)
            out = 0
        PyErr_Restore(et, ev, tb)
    return out


cdef inline void *_take_region(size_t size) noexcept nogil:
    """An arena address for ``size`` bytes, or NULL (then the caller uses malloc)."""
    return <void *>_call(TAKE, size)


cdef inline void _give_region(void *ptr) noexcept nogil:
    _call(GIVE, <uintptr_t>ptr)


cdef inline size_t _region_size(void *ptr) noexcept nogil:
    return <size_t>_call(SIZE, <uintptr_t>ptr)


cdef inline void *_p_malloc(size_t size) noexcept nogil:
    return _prev.allocator.malloc(_prev.allocator.ctx, size)


cdef void *_h_malloc(void *ctx, size_t size) noexcept nogil:
    cdef void *p
    if size >= _threshold:
        p = _take_region(size)
        if p != NULL:
            return p
    return _p_malloc(size)


cdef void *_h_calloc(void *ctx, size_t nelem, size_t elsize) noexcept nogil:
    cdef size_t size = nelem * elsize
    cdef void *p
    if elsize and size / elsize != nelem:
        return NULL  # overflow
    if size >= _threshold:
        p = _take_region(size)
        if p != NULL:
            memset(p, 0, size)
            return p
    return _prev.allocator.calloc(_prev.allocator.ctx, nelem, elsize)


cdef void *_h_realloc(void *ctx, void *ptr, size_t new_size) noexcept nogil:
    cdef void *p
    cdef size_t old
    cdef uintptr_t end = _range_end(ptr) if ptr != NULL else 0
    if end == 0:
        return _prev.allocator.realloc(_prev.allocator.ctx, ptr, new_size)
    old = _region_size(ptr)
    if old == 0:  # unknown: all the slab holds after it (the data cannot be longer)
        old = end - <uintptr_t>ptr
    p = _p_malloc(new_size)
    if p == NULL:
        return NULL  # the old region stays valid, as realloc promises
    memcpy(p, ptr, old if old < new_size else new_size)
    _give_region(ptr)
    return p


cdef void _h_free(void *ctx, void *ptr, size_t size) noexcept nogil:
    if ptr != NULL and _in_ranges(ptr):
        _give_region(ptr)
    else:
        _prev.allocator.free(_prev.allocator.ctx, ptr, size)


def add_range(uintptr_t start, size_t nbytes):
    """Register ``[start, start + nbytes)`` (an arena slab) as memory ``give`` owns."""
    global _n_ranges
    cdef int i
    for i in range(_n_ranges):
        if _starts[i] == start and _ends[i] == start + nbytes:
            return
    if _n_ranges >= MAX_RANGES:
        raise OverflowError(f"more than {MAX_RANGES} slab ranges")
    _starts[_n_ranges] = start
    _ends[_n_ranges] = start + nbytes
    _n_ranges += 1


def privatize(keep=None):
    """In a forked child: make every registered slab range private memory at the same
    addresses (anonymous), as fork gives for malloc memory. Without it the child's
    writes to arrays it inherited would land in the shared slabs, in memory the worker
    may have handed to the consumer.

    ``keep``: ``(address, nbytes)`` of every region the child can still reach (the heap
    arrays alive at the fork); only those bytes are copied, the rest of each range
    becomes fresh zero pages (nothing in the child refers to it, and the kernel makes
    those pages only when touched). None: every range is copied whole."""
    cdef int i
    cdef size_t n, m
    cdef uintptr_t start, end, a
    cdef void *tmp
    cdef void *p
    cdef const char *src
    for i in range(_n_ranges):
        start, end = _starts[i], _ends[i]
        n = end - start
        if keep is None:
            tmp = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            if tmp == MAP_FAILED:
                raise MemoryError(f"no memory for a private copy of a {n}-byte slab")
            memcpy(tmp, <void *>start, n)
            p = _remap(start, n)
            if p == NULL:
                munmap(tmp, n)
                raise MemoryError(f"cannot remap a {n}-byte slab privately")
            memcpy(p, tmp, n)
            munmap(tmp, n)
            continue
        saved = []
        for address, nbytes in keep:
            a, m = address, nbytes
            if start <= a < end:
                m = min(m, end - a)
                src = <const char *>a
                saved.append((a, src[:m]))
        if _remap(start, n) == NULL:
            raise MemoryError(f"cannot remap a {n}-byte slab privately")
        for a, data in saved:
            memcpy(<void *>a, <const char *>data, len(data))


cdef void *_remap(uintptr_t start, size_t n) noexcept nogil:
    """Anonymous private memory over ``[start, start + n)``; NULL on failure."""
    cdef void *p = mmap(<void *>start, n, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
    return NULL if p == MAP_FAILED else p


def configure(take, give, size, size_t threshold):
    """Set the callbacks and the threshold (``take=None``: every allocation is malloc's)."""
    global _take, _give, _size, _threshold
    _take, _give, _size, _threshold = take, give, size, threshold


def install():
    """Make this allocator the current thread's (context's) NumPy data allocator;
    returns the previous handler (a capsule, for :func:`restore`). Everything this
    allocator does not serve from the arena goes to that previous handler, so it can
    be installed in one thread of a process only (a second thread: ``RuntimeError``)."""
    global _capsule, _prev, _prev_capsule
    cdef PyDataMem_Handler *prev
    if _capsule is None:
        strncpy(_handler.name, b"zephon_worker_heap", 126)
        _handler.version = 1
        _handler.allocator.ctx = NULL
        _handler.allocator.malloc = _h_malloc
        _handler.allocator.calloc = _h_calloc
        _handler.allocator.realloc = _h_realloc
        _handler.allocator.free = _h_free
        _capsule = PyCapsule_New(<void *>&_handler, b"mem_handler", NULL)
    previous = PyDataMem_SetHandler(_capsule)
    prev = <PyDataMem_Handler *>PyCapsule_GetPointer(previous, b"mem_handler")
    if prev == &_handler or (_prev != NULL and prev != _prev):
        PyDataMem_SetHandler(previous)
        raise RuntimeError("the zephon worker heap is installed already")
    _prev, _prev_capsule = prev, previous
    return previous


def restore(previous):
    """Put back the handler :func:`install` returned."""
    PyDataMem_SetHandler(previous)


HANDLER_NAME = "zephon_worker_heap"
