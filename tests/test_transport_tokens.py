"""Region tokens: the packed layout round-trips, stays a non-negative int64 (what the
kernels take as a region id), and every field out of range is refused by name, the
arena's owner included."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zephon.errors import ZephonConfigError
from zephon.kernels import compaction_plan
from zephon.transport import tokens as T
from zephon.transport.arena import ShmArena

owners = st.integers(1, T.MAX_OWNER)
indices = st.integers(0, T.MAX_SLAB_INDEX)
offsets = st.integers(0, T.MAX_OFFSET)


@given(owners, indices, offsets)
def test_round_trip_of_every_field(owner, index, offset):
    sid = T.pack_slab_id(owner, index)
    token = T.region_token(sid, offset)
    assert T.slab_owner(sid) == owner and T.slab_index(sid) == index
    assert T.token_slab(token) == sid and T.token_offset(token) == offset
    assert T.unpack_token(token) == (owner, index, offset)
    assert 0 < token <= np.iinfo(np.int64).max  # a region id the kernels accept
    assert int(np.int64(token)) == token


@given(st.tuples(owners, indices, offsets), st.tuples(owners, indices, offsets))
def test_distinct_fields_give_distinct_tokens(a, b):
    ta = T.region_token(T.pack_slab_id(a[0], a[1]), a[2])
    tb = T.region_token(T.pack_slab_id(b[0], b[1]), b[2])
    assert (ta == tb) == (a == b)


def test_the_largest_token_is_the_largest_int64():
    token = T.region_token(T.pack_slab_id(T.MAX_OWNER, T.MAX_SLAB_INDEX), T.MAX_OFFSET)
    assert token == np.iinfo(np.int64).max


@pytest.mark.parametrize("owner", [0, -1, T.MAX_OWNER + 1, 255, 256, 1.0, True])
def test_an_owner_out_of_range_is_refused_by_name(owner):
    with pytest.raises(ZephonConfigError, match=r"owner must be an int in \[1, 127\]") as info:
        T.pack_slab_id(owner, 0)
    assert isinstance(info.value, ValueError) and info.value.field == "owner"
    with pytest.raises(ZephonConfigError, match="owner"):
        T.check_owner(owner)


@pytest.mark.parametrize("index", [-1, T.MAX_SLAB_INDEX + 1])
def test_a_slab_index_out_of_range_is_refused(index):
    with pytest.raises(ZephonConfigError, match=r"slab index must be an int in \[0, 65535\]"):
        T.pack_slab_id(1, index)


@pytest.mark.parametrize("offset", [-1, T.MAX_OFFSET + 1])
def test_an_offset_out_of_range_is_refused(offset):
    with pytest.raises(ZephonConfigError, match=r"offset must be an int in \[0, "):
        T.region_token(T.pack_slab_id(1, 0), offset)


@pytest.mark.parametrize("sid", [0, (1 << T.INDEX_BITS) - 1, (T.MAX_OWNER + 1) << T.INDEX_BITS])
def test_a_slab_id_without_a_valid_owner_is_refused(sid):
    with pytest.raises(ZephonConfigError, match="slab id"):
        T.region_token(sid, 0)


@pytest.mark.parametrize("owner", [0, 128, 255])
def test_an_arena_refuses_an_owner_that_does_not_fit_a_token(owner):
    with pytest.raises(ZephonConfigError, match=r"owner must be an int in \[1, 127\], got"):
        ShmArena(owner, "memfd", 1 << 20, parent_pid=os.getpid())


@pytest.fixture
def arena():
    made: list[ShmArena] = []

    def make(owner: int) -> ShmArena:
        a = ShmArena(owner, "memfd" if hasattr(os, "memfd_create") else "named", 4 << 20,
                     parent_pid=os.getpid(), min_slab_bytes=1 << 20)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def test_the_last_owner_allocates_tokens_the_kernels_take(arena):
    a = arena(T.MAX_OWNER)
    regions = a.alloc_many([1000, 3000])
    for slab, offset, token in regions:
        assert T.unpack_token(token) == (T.MAX_OWNER, T.slab_index(slab.slab_id), offset)
    plan = compaction_plan([t for _, _, t in regions], [1024, 3008], [0, 0], [1000, 3000],
                           0, None, 0)
    assert sorted(plan.region_id.tolist()) == sorted(t for _, _, t in regions)
    a.free([t for _, _, t in regions])
    assert a.live_regions == 0
