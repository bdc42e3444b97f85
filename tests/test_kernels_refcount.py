"""Exact reference counts: the compiled kernel equals its reference on random object
graphs, and both count a holder's reference and nothing of their own."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.kernels import refcount_ref

compiled = pytest.importorskip("zephon._kernels.refcount", reason="kernels not built")
IMPLS = {"compiled": compiled, "reference": refcount_ref}


class _Slotted:
    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=30),
       st.sampled_from(["list", "tuple", "dict"]))
def test_the_kernel_counts_as_its_reference_does(spec, kind):
    # a pool of objects, each held by `extra` more lists; the container holds some of
    # them once or several times
    pool = [np.zeros(2) for _ in range(6)]
    extras = [[pool[i]] * n for i, n in spec]
    items = [pool[i] for i, _ in spec]
    if kind == "tuple":
        container = tuple(items)
    elif kind == "dict":
        container = {k: v for k, v in enumerate(items)}
    else:
        container = list(items)
    del items
    got = {name: m.item_refcounts(container) for name, m in IMPLS.items()}
    assert got["compiled"] == got["reference"]
    if kind != "dict":
        for i in range(len(container)):
            assert compiled.item_refcount(container, i) == refcount_ref.item_refcount(
                container, i) == got["compiled"][i]
    del extras


@pytest.mark.parametrize("name", list(IMPLS))
def test_a_count_is_the_holders_and_nothing_of_the_call(name):
    # (each count is taken before the assert: pytest's rewritten asserts keep their
    # operands alive, which would be holders of their own)
    m = IMPLS[name]
    kept, base = np.zeros(1), np.zeros(4)
    counts = [
        m.item_refcounts([np.zeros(1)]),  # the list alone
        m.item_refcounts({"k": np.zeros(1)}),
        m.item_refcounts((kept, kept)),  # the tuple twice, the name
        m.item_refcount([np.zeros(1), kept], 1),
        m.base_refcount(np.zeros(4)[1:]),  # the view alone
        m.base_refcount(np.zeros(4)),  # no base
        m.base_refcount(base[1:]),  # the view, the name
        m.attr_refcount(_Slotted(np.zeros(1)), "value"),  # the slot alone
        m.attr_refcount(_Slotted(kept), "value"),
    ]
    assert counts == [[1], [1], [3, 3], 2, 1, 0, 2, 1, 2]


@pytest.mark.parametrize("name", list(IMPLS))
def test_a_dict_subclass_is_read_from_its_storage_without_a_key_look_up(name):
    class Values(dict):
        def values(self):
            raise AssertionError("the subclass's values() must not run")

    class Loud:
        armed = False

        def __hash__(self):
            if Loud.armed:
                raise AssertionError("a key must not be hashed")
            return 1

    d = Values()
    dict.__setitem__(d, Loud(), np.zeros(1))
    Loud.armed = True
    assert IMPLS[name].item_refcounts(d) == [1]


@pytest.mark.parametrize("name", list(IMPLS))
def test_refusals_name_the_type(name):
    m = IMPLS[name]
    with pytest.raises(TypeError, match="set"):
        m.item_refcounts({1, 2})
    with pytest.raises(TypeError, match="dict"):
        m.item_refcount({}, 0)
    with pytest.raises(IndexError):
        m.item_refcount([1], 3)
