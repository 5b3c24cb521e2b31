"""The handshake deadlines (a hello within hello_timeout, a join within auth_timeout of it) are
the machine's: scripted here on a fake clock. test_limits.py keeps one real-socket test of the
wiring (the service delivers the Tick and closes the socket)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from protocol import SUPPORTED_VERSIONS, Error, Heartbeat, Hello, Waiting
from rdzv_server.journal import StateLog, apply_record, event_record
from rdzv_server.machine.state import (
    Close,
    Connected,
    Disconnected,
    Effect,
    Event,
    Received,
    Rendezvous,
    Tick,
)
from rdzv_server.service import RendezvousService
from rdzv_server.state_image import dump

from .harness import Harness

HELLO, AUTH = 0.3, 0.6


def harness() -> Harness:
    return Harness(machine=Rendezvous(hello_timeout=HELLO, auth_timeout=AUTH))


def connect(h: Harness, *, hello: bool = True, since: float | None = None) -> int:
    """A connection (and its hello, unless not); returns its id."""
    h._next += 1
    c = h._next
    h._apply(h.machine.handle(Connected(c, f"127.0.0.1:{1000 + c}", since=since), h.now))
    if hello:
        h.send(c, Hello(versions=SUPPORTED_VERSIONS, software="t"))
        h.take(c)
    return c


def test_silence_is_cut_at_the_hello_timeout_not_before() -> None:
    h = harness()
    c = connect(h, hello=False)
    assert h.machine.next_deadline() == HELLO
    h.advance(HELLO - 0.01)
    assert c not in h.closed
    h.advance(0.01)
    assert h.closed[c] == "no hello within 0.3 s"
    assert f"closing 127.0.0.1:{1000 + c}: no hello within 0.3 s" in h.logs
    assert c not in h.machine.conns and h.machine.next_deadline() is None


def test_the_hello_deadline_counts_from_the_accept() -> None:
    # The service reads a socket's first bytes before the machine hears of it; that time counts.
    h = harness()
    h.now = 5.0
    c = connect(h, hello=False, since=4.9)
    assert h.machine.next_deadline() == 4.9 + HELLO
    h.advance(4.9 + HELLO - 5.0)
    assert h.closed[c] == "no hello within 0.3 s"


def test_a_hello_without_a_join_is_cut_at_the_auth_timeout() -> None:
    # Before the fix, the hello cancelled the only timer: a peer could say hello, then hold
    # the socket for ever without proving anything.
    h = harness()
    h.advance(0.1)
    c = connect(h)
    assert h.machine.next_deadline() == 0.1 + AUTH
    for _ in range(5):  # heartbeats do not buy time
        h.advance(0.1)
        h.send(c, Heartbeat())
    h.advance(AUTH - 0.5 - 0.01)  # now 0.69: just before 0.1 + AUTH
    assert c not in h.closed
    h.advance(0.01)
    assert h.closed[c] == "no join within 0.6 s of its hello"
    assert any(line.endswith("no join within 0.6 s of its hello") for line in h.logs)


def test_a_joined_agent_is_not_cut() -> None:
    h = harness()
    c = connect(h)
    h.join(c)  # a two-node job: it waits for the second node
    assert isinstance(h.last(c, Waiting), Waiting)
    for _ in range(20):  # well past both timeouts (beating, as a member must)
        h.advance(0.5)
        h.send(c, Heartbeat())
    assert c not in h.closed and c in h.machine.conns


def test_a_refused_join_leaves_no_deadline_behind() -> None:
    h = harness()
    c = connect(h)
    h.send(c, Hello(versions=SUPPORTED_VERSIONS, software="t"))  # not a join: refused, closed
    assert isinstance(h.last(c, Error), Error) and c in h.closed
    assert h.machine.next_deadline() is None


def test_only_the_late_ones_are_cut_and_dropped_ones_cost_no_tick() -> None:
    h = harness()
    early = connect(h, hello=False)
    h.advance(0.1)
    gone = connect(h, hello=False)
    h.drop(gone)
    h.advance(0.1)
    late = connect(h)
    ticks = 0
    real_handle = h.machine.handle

    def counting(event: Event, now: float) -> list[Effect]:
        nonlocal ticks
        ticks += isinstance(event, Tick)
        return real_handle(event, now)

    h.machine.handle = counting  # type: ignore[method-assign]
    h.advance(1.0)
    assert set(h.closed) == {early, late}
    assert ticks == 2  # one per live deadline: the dropped connection's is skipped


def test_replay_gets_the_closes_from_the_logged_tick() -> None:
    """A late hello is closed by a Tick; the state log keeps the close as the tick's drop, and
    a replaying machine (expire_silent=False, no deadlines of its own) ends in the same state."""
    h = harness()
    records = []
    real_handle = h.machine.handle

    def logging_handle(event: Event, now: float) -> list[Effect]:
        effects = real_handle(event, now)
        rec = event_record(event, effects, unchanged=h.machine.unchanged)
        if rec is not None:
            rec["t"], rec["w"] = now, 0.0
            records.append(msgpack.unpackb(msgpack.packb(rec, use_bin_type=True), raw=False))
        return effects

    h.machine.handle = logging_handle  # type: ignore[method-assign]
    a = connect(h)
    h.join(a)
    late = connect(h, hello=False)
    h.advance(1.0)
    assert late in h.closed
    assert [r["drops"] for r in records if r["k"] == "tick"] == [[[late, "no hello within 0.3 s"]]]
    copy = Rendezvous(None, expire_silent=False, hello_timeout=HELLO, auth_timeout=AUTH)
    for rec in records:
        apply_record(copy, rec)
    assert copy.next_deadline() is None  # replay times nothing itself
    assert set(copy.conns) == set(h.machine.conns) == {a}
    ours, theirs = dump(h.machine), dump(copy)
    for d in (ours, theirs):
        for conn in d["conns"]:
            conn.pop("last_seen")
    assert ours == theirs


def test_no_deadlines_without_expire_silent() -> None:
    # etcd replicas and replay: they have no sockets to time.
    m = Rendezvous(expire_silent=False, hello_timeout=HELLO, auth_timeout=AUTH)
    m.handle(Connected(1, "p"), 0.0)
    m.handle(Received(1, Hello(versions=SUPPORTED_VERSIONS, software="t")), 0.0)
    assert m.next_deadline() is None
    assert not [e for e in m.handle(Tick(), 100.0) if isinstance(e, Close)]
    m.handle(Disconnected(1), 100.0)
    assert not m.conns


def test_a_churn_of_connections_keeps_the_deadline_heap_small() -> None:
    # Strangers connecting and going leave stale entries; the heap is rebuilt from the live ones.
    h = harness()
    for _ in range(1000):
        h.drop(connect(h))
    assert len(h.machine._handshake_due) <= 64 + 2


def test_a_resume_answered_with_restart_stays_on_the_auth_deadline() -> None:
    # Only a join the machine takes stops the clock: a Resume it answers with "join again"
    # (the node was dropped while it was away) leaves the connection unjoined, and it is cut
    # at the auth timeout if it never joins. Before the fix, any Resume cancelled the timer.
    from protocol import Assignment, Join, Restart, Resume

    h = harness()
    kw: dict[str, object] = dict(min_nodes=1, max_nodes=2, last_call_timeout=1.0, heartbeat_timeout=30.0)
    a, b = h.join(**kw), h.join(**kw)
    h.advance(1.0)  # the last call for more nodes ends: one round with both
    held = h.last(a, Assignment)
    assert isinstance(held, Assignment) and isinstance(h.last(b, Assignment), Assignment)
    h.drop(a)  # node a is lost; the elastic job goes on without it
    h.advance(1.0)
    c = connect(h)
    fields = {**dict(job_id="job", node_id=f"node{a}", addr=f"10.0.0.{a}", nproc=2,
                     entrypoint="train.py", master_port=20000 + a, max_restarts=0,
                     heartbeat_interval=1.0), **kw}  # fmt: skip
    h.send(c, Resume(join=Join(**fields), assignment=held))  # type: ignore[arg-type]
    assert isinstance(h.last(c, Restart), Restart), h.inbox.get(c)
    assert c not in h.closed and h.machine.next_deadline() is not None
    h.advance(AUTH - 0.01)
    assert c not in h.closed
    h.advance(0.02)
    assert h.closed[c] == "no join within 0.6 s of its hello"


def test_a_machine_restored_from_the_state_log_is_built_with_its_timeouts(tmp_path: Path) -> None:
    # --state-dir: the machine StateLog.open restores is constructed with the process's
    # timeouts (before, the service patched them onto it afterwards).
    log, _, _ = StateLog.open(
        tmp_path / "state", hello_timeout=HELLO, auth_timeout=AUTH, monotonic=lambda: 100.0, wall=lambda: 0.0
    )
    try:
        h = Harness(machine=log.machine, now=log.clock())
        quiet, unjoined = connect(h, hello=False), connect(h)
        h.advance(AUTH)
        assert h.closed == {quiet: "no hello within 0.3 s", unjoined: "no join within 0.6 s of its hello"}
    finally:
        log.close()


def test_a_service_refuses_a_restored_machine_with_other_timeouts(tmp_path: Path) -> None:
    # Its sockets' deadlines and the machine's would disagree: refused, never patched over.
    log, _, _ = StateLog.open(tmp_path / "state", hello_timeout=HELLO, auth_timeout=AUTH)
    try:
        with pytest.raises(ValueError, match=r"pass the same ones to StateLog\.open"):
            RendezvousService(state_log=log)
        svc = RendezvousService(state_log=log, hello_timeout=HELLO, auth_timeout=AUTH)
        assert svc.machine is log.machine
    finally:
        log.close()
