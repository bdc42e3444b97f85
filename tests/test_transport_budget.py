"""The memory budget (zephon.transport.budget): one owner for the split of an arena bound.

- the parts (lanes, prefetch, heap, consumer) add up to the bound, with the figures the
  module promises;
- an arena never holds more recycled slabs than its bound, whatever mix of messages and
  shared-heap arrays it serves (a seeded random walk, and a worker whose op keeps an
  array in the heap while the consumer holds every result);
- no module but the budget's divides an arena bound or sizes a slab generation (the
  sources are read).
"""

from __future__ import annotations

import ast
import os
import pathlib
import random
import re
import warnings

import _transport_handlers as H
import pytest

import zephon
from zephon import Pipeline, RuntimeOptions, sources
from zephon.errors import ArenaFull, ZephonConfigError
from zephon.transport import WorkerPool
from zephon.transport import budget as B
from zephon.transport.arena import ShmArena, memfd_available
from zephon.transport.budget import (
    PIPELINE_ARENA_BYTES,
    MemoryBudget,
    arena_bytes_for,
    default_arena_bytes,
    pipeline_budget,
    split_arena,
)
from zephon.transport.config import PoolConfig

MIB = 1 << 20
KIND = "memfd" if memfd_available() else "named"


def _add_one(x):
    return x + 1


# -- the split ------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [1, 7, 64 * MIB, 100 * MIB + 3, PIPELINE_ARENA_BYTES])
@pytest.mark.parametrize("lanes", [1, 3, 8])
def test_the_parts_add_up_to_the_bound(bound, lanes):
    b = split_arena(bound, lanes)
    assert b.lanes_bytes + b.prefetch_bytes + b.heap_bytes + b.consumer_bytes == bound
    assert min(b.lanes_bytes, b.prefetch_bytes, b.heap_bytes) >= 0
    assert b.consumer_bytes >= b.lanes_bytes  # the consumer has the largest part
    assert b.message_bytes == bound - b.heap_bytes
    assert b.lane_bytes * lanes <= max(b.lanes_bytes, lanes)  # at least 1 byte a lane


def test_the_pipeline_bound_keeps_a_gib_for_messages():
    b = split_arena(PIPELINE_ARENA_BYTES)
    assert (b.lanes_bytes, b.prefetch_bytes, b.heap_bytes, b.consumer_bytes) == \
        (256 * MIB, 256 * MIB, 256 * MIB, 512 * MIB)
    assert b.message_bytes == 1 << 30


def test_a_bound_for_a_message_room_holds_it_and_a_quarter_for_the_heap():
    assert arena_bytes_for(64 * MIB) == 80 * MIB
    for room in [1, 5, 64 * MIB, 64 * MIB + 1, 999_999_937]:
        b = split_arena(arena_bytes_for(room))
        assert b.message_bytes >= room
        assert b.heap_bytes >= room // 4 - 1


def test_a_bare_pool_keeps_its_message_room():
    # 4 tasks in flight + prefetch_batches // 2 = 8 messages of 16 MiB (the defaults)
    bound = default_arena_bytes(16 * MIB, 8, 4)
    assert bound == 160 * MIB and split_arena(bound).message_bytes == 128 * MIB
    assert PoolConfig().arena_bound == bound  # a bare pool's
    # no message size: 64 MiB each, for 2 in flight and 4 // 2 of the prefetch
    assert split_arena(default_arena_bytes(None, 4, 2)).message_bytes == 4 * 64 * MIB


def test_a_pipeline_budget_is_at_least_the_pipeline_bound_shared_by_its_lanes():
    b = pipeline_budget(4, 4, 8, 16 * MIB)
    assert b.arena_bytes == PIPELINE_ARENA_BYTES and b.lanes == 4
    assert b.lane_bytes == 64 * MIB
    assert pipeline_budget(1, 4, 8, 512 * MIB).message_bytes >= 8 * 512 * MIB


def test_a_budget_whose_parts_exceed_the_bound_is_refused():
    with pytest.raises(ZephonConfigError, match="do not fit the arena bound of 100 bytes"):
        MemoryBudget(100, 1, 50, 50, 1)
    with pytest.raises(ZephonConfigError, match="-1"):
        MemoryBudget(100, 1, -1, 0, 0)
    with pytest.raises(ZephonConfigError, match="at least one lane, got 0"):
        MemoryBudget(100, 0, 0, 0, 0)
    with pytest.raises(ZephonConfigError, match="at least one byte, got 0"):
        split_arena(0)


def test_explain_prints_the_split_once_with_a_process_stage():
    pipe = Pipeline(sources.from_callable(8, _add_one)).map(_add_one, parallelism=2)
    plan = pipe.plan()
    text = pipe.explain()
    assert plan.memory.describe() in text
    assert "memory: arena bound 1280 MiB/worker = lanes 256 MiB (256 MiB x 1 lane(s) in " \
        "flight) + prefetch 256 MiB + heap 256 MiB (worker arrays not sent) + consumer " \
        "512 MiB (what the loop and serial ops hold)" in text
    assert text.count("memory:") == 1
    threads = pipe.options(RuntimeOptions(runner="threads"))
    assert "memory:" not in threads.explain() and threads.plan().prefetch_bytes is None


# -- the arena stays within its bound ------------------------------------------------------


def test_messages_never_take_the_heaps_part_and_the_slabs_never_pass_the_bound():
    a = ShmArena(1, KIND, arena_bytes_for(16 * MIB), parent_pid=os.getpid(),
                 min_slab_bytes=MIB, wait_timeout_s=0)
    try:
        a.alloc_many([8 * MIB, 8 * MIB])  # all that messages may hold
        with pytest.raises(ArenaFull):
            a.alloc_many([MIB])
        got = a.take(4 * MIB, a.heap_bytes)  # the heap's part is still free
        assert got is not None and a.take(MIB, 2 * a.heap_bytes) is None  # no room left
        assert a.total_bytes == a.max_bytes == 20 * MIB
    finally:
        a.close()


def test_a_random_mix_of_messages_and_heap_arrays_stays_within_the_bound():
    rng = random.Random(27)
    a = ShmArena(1, KIND, arena_bytes_for(24 * MIB), parent_pid=os.getpid(),
                 min_slab_bytes=MIB, wait_timeout_s=0)
    sent: list[int] = []  # regions the consumer holds
    heap: list[int] = []  # heap regions the worker's NumPy holds (not sent)
    try:
        for _ in range(3000):
            step = rng.random()
            size = rng.choice([64 << 10, MIB, 3 * MIB, 5 * MIB])
            if step < 0.3:
                try:
                    sent += [t for _, _, t in a.alloc_many([size] * rng.randint(1, 3))]
                except ArenaFull:
                    pass
            elif step < 0.55:
                got = a.take(size, a.heap_bytes)
                if got is not None:
                    heap.append(got[2])
            elif step < 0.7 and heap:
                token = heap.pop(rng.randrange(len(heap)))
                if a.mark_sent(token):
                    a.give(token)  # the worker's NumPy drops it: the consumer's alone
                    sent.append(token)
                else:
                    heap.append(token)
            elif step < 0.8 and heap:
                a.give(heap.pop(rng.randrange(len(heap))))
            elif sent:
                a.free([sent.pop(rng.randrange(len(sent)))])
            assert a.total_bytes <= a.max_bytes  # recycled slabs: the bound, heap included
            assert a.consumer_bytes <= a.message_bytes
            assert a.live_bytes - a.consumer_bytes <= a.heap_bytes
        assert a.total_bytes > a.message_bytes  # the walk did reach into the heap's part
    finally:
        a.close()


def test_a_worker_whose_op_keeps_a_heap_array_stays_within_the_bound():
    # The op keeps an array as large as the heap's part, in the heap; the consumer keeps
    # every result until the arena starves. The worker's slabs (recycled slabs are never
    # unmapped: their size is the peak) stay within the configured bound.
    bound = arena_bytes_for(16 * MIB)
    pool = WorkerPool(H.HeapOps(), 1, config=H.config(arena_bytes=bound)).start()
    try:
        pool.submit(("stats", None))
        if pool.get(timeout=60).value is None:
            pytest.skip("no shared heap in this build")
        pool.submit(("keep_table", bound // 5))
        assert pool.get(timeout=60).value == "kept"
        kept = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the arena fills up: in-band, said once
            for v in range(8):
                pool.submit(("fresh", (4 * MIB, v)))
                kept.append(pool.get(timeout=60).value)
        assert [int(r["data"][0]) for r in kept] == list(range(8))
        pool.submit(("stats", None))
        stats = pool.get(timeout=60).value
        assert stats["held"] == bound // 5  # the table: the heap's whole part
        assert 16 * MIB <= stats["slab_bytes"] <= bound
    finally:
        pool.close()


# -- one owner ----------------------------------------------------------------------------

ROOT = pathlib.Path(zephon.__file__).parent
BUDGET = ROOT / "transport" / "budget.py"
#: what names an arena bound or a part of one in an expression
_BOUND = re.compile(r"arena|max_bytes|bound|(?<!cpu_)budget|prefetch_bytes|heap_bytes|message_bytes|"
                    r"lanes_bytes", re.IGNORECASE)
_UNITS = (10, 20, 30)  # ``>> 20``: bytes shown in MiB
_GENERATION = re.compile(r"slab_base|generation")


def _constants(tree: ast.Module) -> set[str]:
    return {t.id.lstrip("_") for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name) and t.id.lstrip("_").isupper()}


def _splits(tree: ast.AST) -> list[str]:
    """Divisions (and shifts other than unit conversions) of an arena bound."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.BinOp):
            continue
        shift = isinstance(node.op, ast.RShift) and not (
            isinstance(node.right, ast.Constant) and node.right.value in _UNITS)
        if (isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) or shift) and \
                _BOUND.search(ast.unparse(node.left)):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _generation_sizes(tree: ast.AST) -> list[str]:
    """Slab index arithmetic on a generation that does not use SLABS_PER_GENERATION."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            for one, other in ((node.left, node.right), (node.right, node.left)):
                if _GENERATION.search(ast.unparse(one)) and \
                        ast.unparse(other) not in ("SLABS_PER_GENERATION", "1"):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _sources():
    for path in sorted(ROOT.rglob("*.py")):
        if path != BUDGET:
            yield path.relative_to(ROOT), ast.parse(path.read_text(encoding="utf-8"))


def test_the_budget_module_exports_what_it_promises():
    assert set(B.__all__) <= set(vars(B))
    names = _constants(ast.parse(BUDGET.read_text(encoding="utf-8")))
    assert {"PIPELINE_ARENA_BYTES", "SLABS_PER_GENERATION", "HEAP_DIVISOR"} <= names


def test_no_other_module_defines_a_budget_constant():
    names = _constants(ast.parse(BUDGET.read_text(encoding="utf-8")))
    twice = {f"{path}: {name}" for path, tree in _sources() for name in _constants(tree) & names}
    assert not twice


def test_no_other_module_divides_an_arena_bound():
    found = {str(path): s for path, tree in _sources() if (s := _splits(tree))}
    assert not found, f"ask zephon.transport.budget instead: {found}"


def test_no_other_module_sizes_a_slab_generation():
    found = {str(path): g for path, tree in _sources() if (g := _generation_sizes(tree))}
    assert not found, f"use budget.SLABS_PER_GENERATION: {found}"


def test_the_scans_find_what_they_look_for():
    # the forms the budget replaced: each scan reports its own
    old = ast.parse("def f(arena_bytes, lanes, arenas, arena, generation, slab_base):\n"
                    "    a = max(1, arena_bytes // 4 // max(1, lanes))\n"
                    "    b = min(arenas) // 4\n"
                    "    c = arena.max_bytes // HELD_SHARE\n"
                    "    d = arena_bytes >> 20\n"
                    "    return generation * _SLABS_PER_GENERATION, slab_base + 256\n")
    lines = {s.split(":")[0] for s in _splits(old)}
    assert lines == {"line 2", "line 3", "line 4"}  # a, b and c; not the MiB shift
    assert len(_generation_sizes(old)) == 2
    assert _constants(ast.parse("_SLABS_PER_GENERATION = 256\nx = 1\n")) == \
        {"SLABS_PER_GENERATION"}
