"""In-memory snapshots, the agent machine's part (issue 35): what it tells the server of its
holdings, when, and what it does with the server's KeepSnapshot. Fake clock, no I/O."""

from __future__ import annotations

from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from protocol import KeepSnapshot, Resumed, SnapshotsHeld
from protocol.messages import MAX_HELD

from .harness import failure, rejoining, running, sent, settings

READ = st.SnapshotsRead(world_size=4, pairs=((0, 11), (1, 11), (0, 10), (1, 10), (2, 10), (3, 10)))


def test_holdings_go_to_the_server_when_they_change_and_again_after_a_reconnect() -> None:
    m = running()
    (msg,) = sent(m.handle(READ, 2.0))
    assert msg == SnapshotsHeld(world_size=4, ranks=(0, 1, 0, 1, 2, 3), steps=(11, 11, 10, 10, 10, 10))
    assert sent(m.handle(READ, 2.25)) == []  # nothing new: nothing said
    m.handle(st.ConnectionLost("reset"), 3.0)
    assert sent(m.handle(READ, 3.25)) == []  # away: nothing can be said
    m.handle(st.Reconnected(), 4.0)
    m.handle(st.ServerSent(Resumed(job_id="j", round=0)), 4.0)
    assert sent(m.handle(READ, 4.25)) == [msg]  # perhaps a restarted server: it hears it again


def test_nothing_is_said_before_the_node_is_in_a_round() -> None:
    m = AgentMachine(settings())
    m.start(0.0)
    assert m.handle(READ, 1.0) == []  # joining: a connection may say nothing but its join yet


def test_a_node_holding_more_than_a_message_carries_says_its_newest() -> None:
    m = running()
    pairs = tuple((r, s) for s in (9, 8) for r in range(MAX_HELD))  # newest first
    (msg,) = sent(m.handle(st.SnapshotsRead(world_size=MAX_HELD, pairs=pairs), 2.0))
    assert len(msg.ranks) == MAX_HELD and set(msg.steps) == {9}


def test_keep_snapshot_becomes_keep_steps() -> None:
    m = running()
    assert m.handle(st.ServerSent(KeepSnapshot(step=10, replicate=12)), 2.0) == [st.KeepSteps(10, 12)]


def test_a_job_that_never_snapshots_sends_nothing_new_but_an_emptied_node_says_so() -> None:
    m = running()
    assert m.handle(st.SnapshotsRead(world_size=4, pairs=()), 2.0) == []
    m.handle(READ, 2.25)
    (msg,) = sent(m.handle(st.SnapshotsRead(world_size=4, pairs=()), 2.5))
    assert msg == SnapshotsHeld(world_size=4, ranks=(), steps=())


def test_after_a_reconnect_the_holdings_go_before_the_failure_report_that_waited() -> None:
    # A worker dies while the server is away (restarted): when the round is taken back, the
    # server hears what we hold before our failure, so the restart it decides restores from it.
    m = rejoining()
    m.handle(READ, 2.0)
    m.handle(st.ConnectionLost("reset"), 3.0)
    newer = st.SnapshotsRead(world_size=4, pairs=((0, 12), (1, 12), *READ.pairs))
    assert sent(m.handle(newer, 3.1)) == []
    m.handle(st.WorkersExited(failure(), (failure(),)), 3.2)
    m.handle(st.Reconnected(), 4.0)
    said = sent(m.handle(st.ServerSent(Resumed(job_id="j", round=0)), 4.0))
    kinds = [type(x).__name__ for x in said]
    assert kinds[:2] == ["SnapshotsHeld", "WorkersFailed"], kinds
    assert said[0].steps[:2] == (12, 12)
