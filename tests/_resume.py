"""The one save/restore assertion of the suite: a restored run gives exactly what the
uninterrupted run gives, for the rest of the pass and for the pass after it.

:func:`assert_resumes` takes ``k`` items of a fresh pipeline, checkpoints (the
iterator's ``checkpoint()``: only what was handed over counts), restores the state
into another fresh pipeline (optionally built with another runner or worker count) and
checks, against a run that was never interrupted:

* the rest of the pass: head plus the restored pipeline's first run is the reference
  pass;
* the pass after it: the restored pipeline's next run is the uninterrupted next pass
  (the next epoch, or the next ``num_epochs`` epochs);
* end-of-pass states: with ``k`` the whole pass (:data:`END`), the state is taken right
  after the pass's last item, and the restored pipeline's first run is the next pass.

:func:`assert_resumes_at` runs it at several cuts against one reference;
:func:`take_and_checkpoint` is its first half, for tests that look at the state or at
what the restored run reads before they compare; :func:`passes` makes the reference.
An endless stream has no pass: ``limit`` compares its first ``limit`` items only.

Items are compared through ``key`` (a function of one item, see :mod:`_streams`).
A pipeline-like object needs ``iter()`` (one run per call, the next run going on after
the last item the previous one delivered), an iterator with ``close()``, and a
checkpoint and a restore: by default the iterator's ``checkpoint()`` and the
pipeline's ``restore(state)``; ``save`` and ``load`` replace them (a torch loader's
``state_dict``/``load_state_dict``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from _streams import identity, keys_of, take

__all__ = ["END", "Resumed", "assert_resumes", "assert_resumes_at", "assert_same",
           "keys_of", "passes", "take_and_checkpoint"]

END = -1
"""A cut at the end of the pass: the state is taken right after its last item."""

Key = Callable[[Any], Any]


def _checkpoint(pipe, it) -> Any:
    return it.checkpoint()


def _restore(pipe, state) -> None:
    pipe.restore(state)


def passes(make: Callable[[], Any], n: int = 2, key: Key = identity) -> list[list]:
    """The first ``n`` passes of one pipeline ``make()``, each a list of keys."""
    pipe = make()
    return [keys_of(pipe, key) for _ in range(n)]


def take_and_checkpoint(pipe, k: int, key: Key = identity, *,
                        save: Callable[[Any, Any], Any] = _checkpoint) -> tuple[list, Any]:
    """The first ``k`` items of a run of ``pipe`` (through ``key``) and the checkpoint
    taken right after them (``save(pipe, iterator)``, by default ``it.checkpoint()``);
    the run is closed (also when taking fails)."""
    it = iter(pipe)
    try:
        head = [key(next(it)) for _ in range(k)]
        return head, save(pipe, it)
    finally:
        it.close()


def assert_same(got: list, expected: list, what: str) -> None:
    """Assert two key lists are equal, naming ``what`` was compared, the first position
    where they differ and both lengths."""
    if got == expected:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False))
                  if a != b),
                 min(len(got), len(expected)))
    raise AssertionError(
        f"{what}: the stream differs from the uninterrupted one at position {first} "
        f"({len(got)} items against {len(expected)}): "
        f"{got[first:first + 1]} != {expected[first:first + 1]}")


class Resumed(NamedTuple):
    """What :func:`assert_resumes` compared: the head, the rest of the pass after the
    restore, the state between them, the reference pass, and the pass the restored
    pipeline gave next with its uninterrupted counterpart (both empty when unchecked)."""

    head: list
    rest: list
    state: Any
    reference: list
    after: list
    following: list


def _following(head_pipe, k: int, total: int, key: Key) -> list:
    """The pass after the reference, from the pipeline the head came from: its next run
    finishes the pass the head left (skipped unless the head ended it), the one after is
    the next pass."""
    if k < total:
        keys_of(head_pipe, key)
    return keys_of(head_pipe, key)


def assert_resumes(make: Callable[[], Any], k: int, *,
                   again: Callable[[], Any] | None = None,
                   key: Key = identity,
                   reference: list | None = None,
                   following: list | None = None,
                   next_pass: bool = True,
                   limit: int | None = None,
                   save: Callable[[Any, Any], Any] = _checkpoint,
                   load: Callable[[Any, Any], None] = _restore) -> Resumed:
    """Take ``k`` items of ``make()``, checkpoint, restore into ``again()`` (default: a
    fresh ``make()``) and assert that head + rest equals ``reference`` (default: the
    first pass of an uninterrupted ``make()``), then that the restored pipeline's next
    run equals ``following`` (the pass after ``reference``; default: that pipeline's
    second pass, or, with ``reference`` given, the pass after the head's pipeline's).
    ``k`` may be ``len(reference)`` or :data:`END`: an end-of-pass state, whose
    restored first run is the next pass. ``next_pass=False`` leaves the next pass out
    after a mid-pass state; ``limit`` compares the first ``limit`` items of an endless
    stream (no pass, so no next pass).

    Raises:
        AssertionError: naming what differed, the first position where the streams
            differ and the lengths of both.
    """
    if limit is not None:
        return _resumes_within(make, k, again, key, reference, limit, save, load)
    ref_pipe = make() if reference is None else None
    if ref_pipe is not None:
        reference = keys_of(ref_pipe, key)
    assert reference is not None
    k = len(reference) if k == END else k
    if not 0 <= k <= len(reference):
        raise ValueError(f"cut {k} outside the pass of {len(reference)} items")
    at_end = k == len(reference)
    head_pipe = make()
    head, state = take_and_checkpoint(head_pipe, k, key, save=save)
    if following is None and (next_pass or at_end):
        following = (keys_of(ref_pipe, key) if ref_pipe is not None
                     else _following(head_pipe, k, len(reference), key))
    resumed = (again or make)()
    load(resumed, state)
    rest = [] if at_end else keys_of(resumed, key)
    assert_same(head + rest, reference, f"restored after {k} item(s)")
    if not (next_pass or at_end):
        return Resumed(head, rest, state, reference, [], [])
    assert following is not None
    after = keys_of(resumed, key)
    assert_same(after, following, f"restored after {k} item(s), the pass after "
                + ("the state" if at_end else "the rest"))
    return Resumed(head, rest, state, reference, after, following)


def _resumes_within(make, k, again, key, reference, limit, save, load) -> Resumed:
    """:func:`assert_resumes` on the first ``limit`` items of an endless stream."""
    if reference is None:
        reference = take(make(), limit, key)
    head, state = take_and_checkpoint(make(), k, key, save=save)
    resumed = (again or make)()
    load(resumed, state)
    rest = take(resumed, limit - k, key)
    assert_same(head + rest, reference[:limit], f"restored after {k} item(s)")
    return Resumed(head, rest, state, reference, [], [])


def assert_resumes_at(make: Callable[[], Any], cuts: Iterable[int] | None = None, *,
                      key: Key = identity, reference: list | None = None,
                      following: list | None = None, **kwargs) -> list[Resumed]:
    """:func:`assert_resumes` at each of ``cuts`` (default: every position of the pass,
    its end included) against one reference: the first two passes of ``make()``, unless
    ``reference`` and ``following`` are given. The other keywords go to
    :func:`assert_resumes`."""
    if reference is None:
        reference, following = passes(make, 2, key)
    elif following is None:
        pipe = make()
        keys_of(pipe, key)
        following = keys_of(pipe, key)
    cuts = range(len(reference) + 1) if cuts is None else cuts
    return [assert_resumes(make, k, key=key, reference=reference, following=following,
                           **kwargs) for k in cuts]
