"""The global random generators, seeded around each call of a ``map`` or ``filter`` op.

torchvision's random transforms draw from torch's default generator, albumentations-style
code from NumPy's legacy ``np.random`` and Python's ``random``. Those generators belong
to the process, not to the sample: unseeded, what an op draws depends on which worker ran
it and on what ran there before. This module makes such ops exact
(``RuntimeOptions.seed_global_rngs``): before each call of a *seeded* op, the generators
it draws from are seeded from the sample's identity, and the process's own states are
given back afterwards where they belong to someone else.

What it owns:

- the generators by name (:data:`GENERATORS`: ``"torch"``, ``"numpy"``, ``"random"``)
  and how a message names each (:data:`LABELS`);
- the seed of each generator for one call (:func:`global_seeds`), a pure function of
  ``(pipeline seed, source, index, epoch, ordinal)``: the sample identity ``ctx.rng``
  is seeded from, plus the op's place among the pipeline's per-sample ops (its
  *ordinal*, counted from 0 over the stateless ops in chain order, so two ops drawing on
  one sample do not draw the same numbers). It is BLAKE2b (40 bytes, personalisation
  :data:`PERSON`) of ``f"{seed}:{index}:{epoch}:{ordinal}:{source}"``: bytes 0-8 seed
  torch (``torch.default_generator.manual_seed``, an unsigned 64-bit value), bytes 8-24
  NumPy (``np.random.seed`` with four uint32 words, MT19937's ``init_by_array``), bytes
  24-40 ``random`` (``random.seed`` with a 128-bit int). ``ctx.rng`` is a NumPy
  ``SeedSequence`` of ``[seed, crc32(source), index, epoch]``: another construction, so
  its draws are untouched by this module and unrelated to these streams. No Python
  ``hash()``: every process derives the same seeds;
- which generators an op is seeded for (:func:`chosen`), from the option and from what
  validation saw the op draw from on the first sample
  (:mod:`zephon.pipeline.validate`);
- planting the seeds (:func:`plant`), saving and restoring states (:func:`save`,
  :func:`restore`, :func:`kept`), comparing them (:func:`snapshot`), and the one lock
  of the process (:data:`LOCK`) that every seeded call holds;
- :class:`SeededOp`, what a stage program runs in place of a seeded op.

Where a call runs decides what it costs (:func:`placement`):

- ``OWN``: a process worker, or a process that said it runs nothing but pipeline ops
  (:func:`own_process`, the MTP subprocess): the generators are the pipeline's; each
  call only seeds them (measured: ~3 us a call for torch's, ~5 us for ``random``'s,
  ~10 us for NumPy's, whose ``np.random.seed`` with four words is most of it, ~17 us
  for all three). A worker imports torch to seed it when an op is seeded for torch;
- ``UNIT``: the consumer's process, in its main thread (the inline runner with the
  engine in the consumer's thread): user code does not run while a unit does, so the
  seeded calls only seed, and the consumer's states are saved once before the unit and
  restored once after it (~70 us a unit with NumPy's, whose ``get_state``/``set_state``
  are the costly part; ~1.5 us with torch's alone);
- ``CALL``: the consumer's process, on any other thread (thread workers, the pump that
  runs the engine beside the consumer, a consumer iterating on a thread of its own):
  the states are saved and restored around every seeded call, under :data:`LOCK`
  (~80 us a call with NumPy's, ~5 us with torch's alone).

Invariants:

- a seeded call starts from generators in a state that is a function of the identity
  alone, whatever the runner, the worker count or the restore: its draws are exact;
- seeded calls of one process never overlap: each holds :data:`LOCK` for the whole
  call (threads run
  seeded ops one at a time; unseeded ops and the reads beside them stay parallel;
  ``runner="process"`` runs seeded ops in parallel, one process each);
- the consumer's own states are given back: after a unit (``UNIT``) or a call
  (``CALL``). What this cannot cover: code of the consumer's process that draws from
  these generators *while* a seeded call runs on another thread (a training step on
  the CPU with dropout, while a threads stage runs torchvision transforms) shares the
  generator with that call, which then draws other numbers; such a consumer needs
  ``runner="process"`` or ``mtp_mode=True``;
- an op that is not seeded pays nothing: the stage program runs it as it is.

What it does not cover: generators other than these three process-wide ones (a
``np.random.default_rng()``, ``random.Random()`` or ``torch.Generator()`` made without a
seed, or made once at import and kept between calls; ``os.urandom``; the clock; torch's
CUDA generators). Validation still runs each probed op twice on the first sample, seeded
as at run time, and refuses one whose outputs differ (Z002).

Lifecycle: validation decides, at the start of each run (``iter()``) and before any
worker process exists, the generators of every ``map`` and ``filter`` op, and records
them on the op (:attr:`~zephon.pipeline.ops.base.StatelessOp.global_rngs`); a
:class:`~zephon.pipeline.program.StageProgram` copies them when it is made, and its
copies in worker processes (and in the MTP subprocess) travel with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import os
import random
import sys
import threading
from collections.abc import Iterator
from typing import Any, Final, NamedTuple

import numpy as np

from zephon._modules import imported

__all__ = [
    "CALL",
    "GENERATORS",
    "LABELS",
    "LOCK",
    "NUMPY",
    "OWN",
    "PERSON",
    "RANDOM",
    "TORCH",
    "UNIT",
    "SeededOp",
    "Seeds",
    "changes",
    "chosen",
    "global_seeds",
    "held_here",
    "hold",
    "kept",
    "own_process",
    "placement",
    "plant",
    "restore",
    "save",
    "snapshot",
    "torch_untouched",
]

TORCH: Final = "torch"
NUMPY: Final = "numpy"
RANDOM: Final = "random"
#: the generators that can be seeded, in the order they are seeded
GENERATORS: Final = (TORCH, NUMPY, RANDOM)
#: how a validation message names each generator
LABELS: Final = {
    TORCH: "torch's global RNG (torch.rand, torchvision's random transforms)",
    NUMPY: "numpy's global RNG (np.random)",
    RANDOM: "the random module's global RNG",
}
#: the BLAKE2b personalisation of :func:`global_seeds` (it separates these seeds from
#: any other use of the same identity)
PERSON: Final = b"zephon.globals"

OWN: Final = "own"
UNIT: Final = "unit"
CALL: Final = "call"

#: held by every seeded call (through :func:`hold`), by validation's probe of a seeded op
#: while the run's threads may run seeded calls, and while a consumer's states are saved,
#: planted or restored
LOCK = threading.RLock()
_HELD = threading.local()  # .depth: how deep this thread is in hold()
#: how many times zephon changed a generator's state in this process (planted or
#: restored, always under LOCK): validation's unlocked probe calls compare it before and
#: after, to tell another thread's plants from their op's own draws (:func:`changes`)
_CHANGES = [0]

_NONE: frozenset[str] = frozenset()
_OWNED = {"pid": -1}  # the process that said its generators are the pipeline's


class Seeds(NamedTuple):
    """The seeds of one call: torch's (unsigned 64 bits), NumPy's (four uint32 words),
    ``random``'s (an int of 128 bits)."""

    torch: int
    numpy: np.ndarray
    random: int


def _digest(seed: int, sample_id, ordinal: int) -> bytes:
    """The 40 bytes the seeds of one call are cut from (see :func:`global_seeds`)."""
    source, index, epoch = sample_id
    text = "%d:%d:%d:%d:%s" % (seed, index, epoch, ordinal, source)
    return hashlib.blake2b(text.encode(), digest_size=40, person=PERSON).digest()


def global_seeds(seed: int, sample_id, ordinal: int) -> Seeds:
    """The seeds of op ``ordinal``'s call on the sample ``sample_id = (source, index,
    epoch)`` of a pipeline seeded ``seed`` (see the module docstring): a pure function,
    the same in every process."""
    digest = _digest(seed, sample_id, ordinal)
    return Seeds(int.from_bytes(digest[:8], "little"),
                 np.frombuffer(digest, dtype="<u4", count=4, offset=8),
                 int.from_bytes(digest[24:], "little"))


def _plant_digest(which: frozenset[str], digest: bytes) -> None:
    """:func:`plant` from the bytes of :func:`_digest` (each seed made only if needed)."""
    _CHANGES[0] += 1
    if TORCH in which:
        _torch_generator().manual_seed(int.from_bytes(digest[:8], "little"))
    if NUMPY in which:
        np.random.seed(np.frombuffer(digest, dtype="<u4", count=4, offset=8))
        _clear_cached_normal()
    if RANDOM in which:
        random.seed(int.from_bytes(digest[24:], "little"))


def chosen(mode: str, drew: frozenset[str] | None) -> frozenset[str]:
    """The generators a ``map`` or ``filter`` op is seeded for under
    ``seed_global_rngs=mode``: ``"off"`` none; ``"all"`` all three (torch's only when torch
    is imported when the run starts: a process that never imports it pays nothing for
    it); ``"auto"``: an op validation saw draw from any of them (``drew``; None: it did
    not look, e.g. ``auto_validation="off"``, or the op is not among the leading ones)
    is seeded for all three (torch's when it drew from it or torch is imported): the
    probe sees one sample, and an op whose draws depend on its sample (``if
    random.random() < p: np.random...``) would leave the others unseeded."""
    if mode == "all" or (mode == "auto" and drew):
        return frozenset(g for g in GENERATORS
                         if g != TORCH or imported(TORCH) is not None
                         or (drew and TORCH in drew))
    return _NONE


def _torch_generator() -> Any:
    """torch's default CPU generator (torch is imported here if the process has not yet:
    an op seeded for torch uses it)."""
    torch: Any = imported(TORCH) or importlib.import_module(TORCH)
    return torch.default_generator


def plant(which: frozenset[str], seeds: Seeds) -> None:
    """Seed the generators named in ``which`` with ``seeds`` (the caller holds
    :data:`LOCK`)."""
    _CHANGES[0] += 1
    if TORCH in which:
        _torch_generator().manual_seed(seeds.torch)
    if NUMPY in which:
        np.random.seed(seeds.numpy)
        _clear_cached_normal()
    if RANDOM in which:
        random.seed(seeds.random)


def _clear_cached_normal() -> None:
    """Drop legacy ``np.random``'s cached second normal. ``np.random.seed`` drops it only
    for MT19937; under another global bit generator (``np.random.set_bit_generator``)
    it survived the seeding, so a seeded call drawing a normal took the one the call
    before had cached, and the stream depended on it."""
    get = getattr(np.random, "get_bit_generator", None)
    if get is None or type(get()) is np.random.MT19937:
        return
    state = np.random.get_state(legacy=False)
    if state.get("has_gauss"):
        state["has_gauss"], state["gauss"] = 0, 0.0
        np.random.set_state(state)


def save(which: frozenset[str]) -> list[tuple[str, Any]]:
    """The states of the generators named in ``which``, for :func:`restore`."""
    states: list[tuple[str, Any]] = []
    if TORCH in which:
        states.append((TORCH, _torch_generator().get_state()))
    if NUMPY in which:
        states.append((NUMPY, np.random.get_state(legacy=False)))
    if RANDOM in which:
        states.append((RANDOM, random.getstate()))
    return states


def restore(states: list[tuple[str, Any]]) -> None:
    """Put back the states :func:`save` took (the caller holds :data:`LOCK`)."""
    _CHANGES[0] += 1
    for name, state in states:
        if name == TORCH:
            _torch_generator().set_state(state)
        elif name == NUMPY:
            np.random.set_state(state)
        else:
            random.setstate(state)


@contextlib.contextmanager
def kept(which: frozenset[str]) -> Iterator[None]:
    """The states of ``which`` as they were on entry, given back on exit (each step under
    :data:`LOCK`, so no other thread's seeded call is caught half-way)."""
    with LOCK:
        states = save(which)
    try:
        yield
    finally:
        with LOCK:
            restore(states)


@contextlib.contextmanager
def hold() -> Iterator[None]:
    """:data:`LOCK`, with this thread marked as holding it (:func:`held_here`)."""
    with LOCK:
        _HELD.depth = getattr(_HELD, "depth", 0) + 1
        try:
            yield
        finally:
            _HELD.depth -= 1


def held_here() -> bool:
    """Whether this thread holds :data:`LOCK` through :func:`hold`: a seeded call (or
    the probe of a seeded op) is running user code here, and a pipeline that code starts
    must not run seeded calls on other threads, which would wait for the lock for ever
    (:func:`zephon.pipeline.validate.validate` refuses it)."""
    return getattr(_HELD, "depth", 0) > 0


def changes() -> int:
    """The count of zephon's changes to the generators' states in this process (read it
    under :data:`LOCK`)."""
    return _CHANGES[0]


#: numpy's MT19937 state struct: ``uint32_t key[624]; int pos``.
_MT_STATE_BYTES: Final = 624 * 4 + 4
_RAW_CHECKED: dict[int, tuple[type, bool]] = {}  # id(bit generator) -> (type, raw reads ok)


def _numpy_mark() -> Any:
    """A comparable copy of ``np.random``'s state. Where its bit generator is numpy's
    MT19937 (the default), the raw state struct (its 624 key words and position, read
    through the bit generator's documented ``ctypes.state_address`` in half a
    microsecond; checked once per generator against ``get_state``, so a layout that
    differs falls back); otherwise ``get_state``'s (about 30 us: numpy copies the key
    word by word, which made validation's probes cost more than the pipeline start
    they guard). Legacy's cached second normal (``has_gauss``) is not in the raw mark:
    a probe call starts from a plant, which clears it, or, for an op not seeded for
    NumPy, from a state whose draws also show as two calls' different outputs."""
    get = getattr(np.random, "get_bit_generator", None)
    bitgen = get() if get is not None else None
    if bitgen is not None and type(bitgen) is np.random.MT19937:
        checked = _RAW_CHECKED.get(id(bitgen))
        if checked is None or checked[0] is not type(bitgen):
            checked = _RAW_CHECKED[id(bitgen)] = (type(bitgen), _raw_matches(bitgen))
        if checked[1]:
            return ctypes.string_at(bitgen.ctypes.state_address, _MT_STATE_BYTES)
    return _comparable(np.random.get_state(legacy=False))


def _comparable(state: Any) -> Any:
    """``state`` (a bit generator's state: dicts of ints and arrays) as a value that
    ``==`` compares as a whole (arrays as their bytes)."""
    if isinstance(state, dict):
        return tuple(sorted((k, _comparable(v)) for k, v in state.items()))
    if isinstance(state, np.ndarray):
        return (state.dtype.str, state.shape, state.tobytes())
    return state


def _raw_matches(bitgen) -> bool:
    """Whether ``bitgen``'s raw state struct holds what its ``state`` says, as
    :data:`_MT_STATE_BYTES` bytes (key words, then the position)."""
    try:
        state = bitgen.state["state"]
        raw = ctypes.string_at(bitgen.ctypes.state_address, _MT_STATE_BYTES)
    except Exception:  # noqa: BLE001 - no ctypes interface: get_state it is
        return False
    key = np.asarray(state["key"], dtype=np.uint32).tobytes()
    return raw[:len(key)] == key and len(key) == _MT_STATE_BYTES - 4 and \
        int.from_bytes(raw[len(key):], sys.byteorder, signed=True) == int(state["pos"])


def snapshot() -> dict[str, Any]:
    """A comparable copy of the state of each generator (torch's when torch is imported),
    by name: what validation compares to see which generators a call drew from."""
    states: dict[str, Any] = {NUMPY: _numpy_mark(), RANDOM: random.getstate()}
    if imported(TORCH) is not None:
        states[TORCH] = _torch_generator().get_state().numpy().tobytes()
    return states


def torch_untouched() -> Any:
    """The state torch's default generator had right after it was last seeded (at import
    its seed is random, so only this says whether a call that imported torch drew from
    it)."""
    import torch

    fresh = torch.Generator()
    fresh.manual_seed(torch.default_generator.initial_seed())
    return fresh.get_state().numpy().tobytes()


def own_process() -> None:
    """Say that this process runs nothing but pipeline ops (the MTP subprocess): its
    seeded calls then only seed, as a process worker's do (:data:`OWN`)."""
    _OWNED["pid"] = os.getpid()


def placement(home_pid: int) -> str:
    """Where a seeded call runs now, for a program made in process ``home_pid``:
    :data:`OWN`, :data:`UNIT` or :data:`CALL` (see the module docstring)."""
    pid = os.getpid()
    if pid != home_pid or _OWNED["pid"] == pid:
        return OWN
    return UNIT if threading.current_thread() is threading.main_thread() else CALL


class SeededOp:
    """A seeded op as a stage program runs it: ``apply_one(record, seed)`` plants the
    seeds of the record's first sample (:func:`global_seeds`) in ``which`` and runs the
    op, holding :data:`LOCK`; with ``keep`` (:data:`CALL`) the states are saved before
    and given back after."""

    __slots__ = ("keep", "op", "ordinal", "which")
    #: a per-sample op (what a stage program asks of the ops it runs)
    batched = False

    def __init__(self, op: Any, which: frozenset[str], ordinal: int, keep: bool) -> None:
        self.op, self.which, self.ordinal, self.keep = op, which, ordinal, keep

    def apply_one(self, r: Any, seed: int) -> Any:
        digest = _digest(seed, r.ids[0], self.ordinal)
        with hold():
            states = save(self.which) if self.keep else None
            try:
                _plant_digest(self.which, digest)
                return self.op.apply_one(r, seed)
            finally:
                if states is not None:
                    restore(states)
