"""The one save/restore assertion of the suite: the output after a restore equals the
uninterrupted output.

:func:`assert_resumes` takes ``k`` items of a fresh pipeline, checkpoints (the
iterator's ``checkpoint()``: only what was handed over counts), restores the state
into another fresh pipeline (optionally built with another runner or worker count) and
checks that the head plus the rest equals a reference run that was never interrupted.
:func:`take_and_checkpoint` is its first half, for tests that look at the state or at
what the restored run reads before they compare.

Items are compared through ``key`` (a function of one item: its ids, a signature),
since batches hold arrays and views that do not compare with ``==``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Resumed", "assert_resumes", "keys_of", "take_and_checkpoint"]


def _identity(item: Any) -> Any:
    return item


def keys_of(pipe, key: Callable[[Any], Any] = _identity) -> list:
    """Every item of a whole run of ``pipe``, through ``key``."""
    return [key(item) for item in pipe]


def take_and_checkpoint(pipe, k: int, key: Callable[[Any], Any] = _identity
                        ) -> tuple[list, bytes]:
    """The first ``k`` items of a run of ``pipe`` (through ``key``) and the checkpoint
    taken right after them; the run is closed (also when taking fails)."""
    it = iter(pipe)
    try:
        head = [key(next(it)) for _ in range(k)]
        return head, it.checkpoint()
    finally:
        it.close()


class Resumed(NamedTuple):
    """What :func:`assert_resumes` compared: the head, the rest after the restore, the
    state between them and the reference."""

    head: list
    rest: list
    state: bytes
    reference: list


def assert_resumes(make: Callable[[], Any], k: int, *,
                   again: Callable[[], Any] | None = None,
                   key: Callable[[Any], Any] = _identity,
                   reference: list | None = None) -> Resumed:
    """Take ``k`` items of ``make()``, checkpoint, restore into ``again()`` (default: a
    fresh ``make()``) and assert that head + rest equals ``reference`` (default: the keys
    of an uninterrupted run of ``make()``).

    Raises:
        AssertionError: naming the first position where the streams differ and the
            lengths of both.
    """
    if reference is None:
        reference = keys_of(make(), key)
    head, state = take_and_checkpoint(make(), k, key)
    resumed = (again or make)()
    resumed.restore(state)
    rest = keys_of(resumed, key)
    got = head + rest
    if got != reference:
        first = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b),
                     min(len(got), len(reference)))
        raise AssertionError(
            f"restored after {k} item(s): the stream differs from the uninterrupted one at "
            f"position {first} ({len(got)} items against {len(reference)}): "
            f"{got[first:first + 1]} != {reference[first:first + 1]}")
    return Resumed(head, rest, state, reference)
