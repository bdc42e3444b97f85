"""Distinct string ids: the specification of the compiled ``zephon._kernels.ids``.

Caller: :func:`zephon.jobs.runner._subject_ids`, which must refuse a run whose subject
ids are not unique before it yields anything, and for 10^6 ids well inside a resume's
first-result budget (a Python ``set`` of 10^6 fresh strings costs 0.2-0.4 s of CPU on
a loaded machine: hashing every string and a cache miss per insert).

``distinct_str_ids(ids)`` takes a list and returns:

- ``-1`` when an item is not an exact ``str`` (a subclass counts as not) or is empty;
- ``1`` when every item is a non-empty exact ``str`` and no two are equal: a certain
  answer;
- ``0`` otherwise: there may be equal items. The reference returns 0 only when two items
  are equal; the compiled kernel also when two distinct items share its 64-bit hash (for
  10^6 random ids about once in 3 * 10^7 calls), so a caller decides 0 exactly itself.

The compiled kernel hashes each string's code units (with its byte length) in one
sequential pass, partitions the hashes by their top bits and checks each part in a small
table that stays in cache; it holds 16 bytes per id while it runs and nothing after.
"""

from __future__ import annotations

__all__ = ["distinct_str_ids"]


def distinct_str_ids(ids: list) -> int:
    if not all(type(s) is str and s for s in ids):
        return -1
    return 1 if len(set(ids)) == len(ids) else 0
