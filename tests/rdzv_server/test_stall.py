"""A stall of the server itself (a blocked loop, a SIGSTOP) is no agent's silence: the
service's watchdog measures it and hands it to ``Rendezvous.credit_stall`` before the sweep
runs. Scripted here on a fake clock; tests/integration/test_attack_conn.py stops a live
server for longer than the heartbeat timeout to prove the wiring."""

from __future__ import annotations

from protocol import Assignment

from .harness import Harness

TIMEOUT = 5.0  # the harness's heartbeat_timeout


def running_pair() -> tuple[Harness, int, int]:
    h = Harness()
    a, b = h.join(), h.join()
    h.advance(0.0)
    assert h.last(a, Assignment) is not None and h.last(b, Assignment) is not None
    return h, a, b


def stall(h: Harness, seconds: float, *, credited: bool) -> None:
    """The server does not run for ``seconds``: no tick, no frame is read meanwhile."""
    h.now += seconds
    if credited:
        h.machine.credit_stall(seconds)
    h.advance(0.0)  # the overdue sweep runs as soon as the loop does


def test_a_stall_longer_than_the_heartbeat_timeout_drops_nobody_once_credited() -> None:
    h, a, b = running_pair()
    stall(h, TIMEOUT + 3, credited=True)
    assert a not in h.closed and b not in h.closed
    assert not [line for line in h.logs if "went silent" in line]
    assert h.machine.jobs["job"].phase.name == "RUNNING"


def test_without_the_credit_the_same_stall_would_drop_both() -> None:
    # The control: what the watchdog prevents (before it, the job failed this way).
    h, a, b = running_pair()
    stall(h, TIMEOUT + 3, credited=False)
    assert "went silent" in h.closed[a] and "went silent" in h.closed[b]


def test_the_credit_is_no_immunity_a_node_silent_after_it_is_still_dropped() -> None:
    h, a, b = running_pair()
    stall(h, TIMEOUT + 3, credited=True)
    h.advance(TIMEOUT - 1)
    assert a not in h.closed
    h.machine.heartbeat(b, h.now)  # b keeps beating; a has gone quiet since the stall
    h.advance(2.5)  # past a's timeout by more than one sweep interval (timeout / 4)
    assert "went silent" in h.closed[a]
    assert b not in h.closed
