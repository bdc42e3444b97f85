"""``InterruptGuard`` nesting with real SIGINTs (``signal.raise_signal``, handled by the
interpreter as a Ctrl-C is): what ``zephon.jobs.run`` relies on so that a second Ctrl-C
right behind the first is never lost nor skips the stop (tests/test_jobs_signals.py
drives the real thing). Main thread, Python's own SIGINT handler restored after each."""

from __future__ import annotations

import signal

import pytest

from zephon.transport.supervisor import InterruptGuard


@pytest.fixture(autouse=True)
def default_sigint():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _stop(steps: list[str]) -> None:
    """A stop as the jobs backend does it: held from the start, armed once under way."""
    with InterruptGuard(hold=True, take_held=True) as guard:
        try:
            guard.arm()
            steps.append("graceful")
            signal.raise_signal(signal.SIGINT)  # a Ctrl-C during the graceful wait
            steps.append("waited out")
        except KeyboardInterrupt:
            steps.append("killed")
            signal.raise_signal(signal.SIGINT)  # held: the kill is never cut short
            raise


def test_a_ctrl_c_right_behind_the_first_is_held_and_kills_in_the_stop():
    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with InterruptGuard():  # the run's loop
            try:
                signal.raise_signal(signal.SIGINT)  # the first: raised
                steps.append("not reached")
            except KeyboardInterrupt:
                signal.raise_signal(signal.SIGINT)  # the second, while the first unwinds
                raise
            finally:
                with InterruptGuard(hold=True):  # the run's close
                    _stop(steps)
    assert steps == ["killed"]  # the stop began with the held one: no graceful wait


def test_one_ctrl_c_in_the_stop_cuts_it_short_and_later_ones_wait():
    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with InterruptGuard():
            with InterruptGuard(hold=True):
                _stop(steps)
    assert steps == ["graceful", "killed"]


def test_a_held_ctrl_c_in_an_inner_block_is_raised_when_it_ends():
    # a worker's start is never split; the Ctrl-C then takes effect, once
    with InterruptGuard(raise_held=False) as outer:  # (the held one: not raised again)
        with pytest.raises(KeyboardInterrupt):
            with InterruptGuard(hold=True):
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
        assert outer.holding and outer.held == 1
