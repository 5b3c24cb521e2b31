"""The step's notices held by the node-agent command (node_agent/step_notices.py), in process:
real signals to this process, its dispositions put back after each test."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from node_agent import step_notices

NOTICES = (signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def dispositions() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in NOTICES}
    try:
        yield
    finally:
        step_notices.hold_again()
        step_notices._holding.clear()
        del step_notices._held[:]
        for s, handler in saved.items():
            signal.signal(s, handler)


def _notice(sig: int) -> None:
    os.kill(os.getpid(), sig)  # the handler runs in this (main) thread before kill returns


def test_a_held_notice_is_delivered_once_the_loop_takes_them_and_later_ones_at_once() -> None:
    step_notices.hold()
    assert step_notices.held_signals() == frozenset(NOTICES)
    _notice(signal.SIGUSR1)
    _notice(signal.SIGUSR2)
    got: list[int] = []
    step_notices.deliver_to(got.append)
    assert got == [signal.SIGUSR1, signal.SIGUSR2]
    _notice(signal.SIGUSR1)
    assert got == [signal.SIGUSR1, signal.SIGUSR2, signal.SIGUSR1]
    step_notices.hold_again()  # the loop ends: held again, not delivered
    _notice(signal.SIGUSR2)
    assert len(got) == 3 and step_notices._held == [signal.SIGUSR2]


def test_held_notices_are_bounded() -> None:
    step_notices.hold()
    for _ in range(step_notices.MAX_HELD + 10):
        _notice(signal.SIGUSR1)
    got: list[int] = []
    step_notices.deliver_to(got.append)
    assert got == [signal.SIGUSR1] * step_notices.MAX_HELD


def test_a_handled_notice_is_released_to_its_default_and_the_end_ignores_the_rest() -> None:
    step_notices.hold()
    step_notices.release([signal.SIGUSR1, signal.SIGTERM])  # --signals-to-handle SIGTERM,SIGUSR1
    assert step_notices.held_signals() == frozenset({signal.SIGUSR2})
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    step_notices.ignore()
    # SIG_IGN survives Python's finalization (a Python handler is put back to SIG_DFL there).
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_a_launch_in_a_users_process_holds_nothing() -> None:
    assert step_notices.held_signals() == frozenset()
