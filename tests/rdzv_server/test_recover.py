"""After a restart from the state log: nodes come back into the round the server kept.

``Restarted`` is what a restarted server handles once its state is replayed: the old process's
connections are gone, so their members wait (AWAY) for their agents' ``Resume``. Pure: a fake
clock and scripted agents; the harness's connection ids keep growing, as the service's do.
"""

from __future__ import annotations

from protocol import (
    Assignment,
    Error,
    GoingAway,
    Heartbeat,
    JobDone,
    JobFailed,
    Join,
    Restart,
    Resume,
    Resumed,
    Waiting,
    WorkersFailed,
    WorkersSucceeded,
)
from rdzv_server.machine.state import RESUME_WINDOW, ConnPhase, JobPhase, Restarted, ShuttingDown

from .harness import Harness, failure


def join_msg(conn: int, node: str, **kw: object) -> Join:
    fields: dict[str, object] = dict(
        job_id="job",
        node_id=node,
        addr=f"10.0.0.{conn}",
        nproc=2,
        min_nodes=2,
        max_nodes=2,
        entrypoint="train.py",
        master_port=20000 + conn,
        max_restarts=0,
        last_call_timeout=5.0,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )
    fields.update(kw)
    return Join(**fields)  # type: ignore[arg-type]


def restart_server(h: Harness) -> None:
    """What StateLog.open does after replay (the replayed state is the harness's own)."""
    h.inbox.clear()
    h._apply(h.machine.handle(Restarted(), h.now))


def beat(h: Harness, conns: list[int], seconds: float) -> None:
    """Let time pass while these agents send heartbeats."""
    end = h.now + seconds
    while h.now < end:
        h.advance(min(1.0, end - h.now))
        for c in conns:
            h.send(c, Heartbeat())


def running(h: Harness, **kw: object) -> dict[str, Assignment]:
    a, b = h.join(**kw), h.join(**kw)
    got = {}
    for c, node in ((a, "node1"), (b, "node2")):
        x = h.last(c, Assignment)
        assert x is not None
        got[node] = x
    return got


def test_a_known_round_resumes_with_nothing_restarted() -> None:
    h = Harness()
    held = running(h)
    restart_server(h)
    job = h.machine.jobs["job"]
    assert all(c.phase is ConnPhase.AWAY for c in h.machine.conns.values())
    assert (
        job.phase is JobPhase.RUNNING
        and h.machine.next_deadline() == h.machine.resume_deadline == RESUME_WINDOW
    )
    h.advance(3.0)  # agents reconnect with backoff
    new = {}
    for node, a in held.items():
        c = h.connect()
        h.send(c, Resume(join=join_msg(c, node), assignment=a))
        r = h.last(c, Resumed)
        assert r is not None and not r.rebuilt and r.round == 0
        assert h.last(c, Restart) is None
        new[node] = c
    assert job.round == 0 and job.restart_count == 0 and job.order == ["node1", "node2"]
    assert not any(c.phase is ConnPhase.AWAY for c in h.machine.conns.values())
    assert [e.kind for e in job.history][-3:] == ["recovered", "resumed", "resumed"]
    beat(h, list(new.values()), RESUME_WINDOW)  # the window closing drops nobody
    assert len(job.members) == 2
    for c in new.values():
        h.send(c, WorkersSucceeded(round=0))
    assert all(h.last(c, JobDone) is not None for c in new.values())


def test_a_node_at_the_exit_barrier_resumes_as_succeeded() -> None:
    h = Harness()
    held = running(h)
    conns = list(h.machine.conns)
    h.send(conns[0], WorkersSucceeded(round=0))
    restart_server(h)
    c1, c2 = h.connect(), h.connect()
    h.send(c1, Resume(join=join_msg(c1, "node1"), assignment=held["node1"], succeeded=True))
    h.send(c2, Resume(join=join_msg(c2, "node2"), assignment=held["node2"]))
    assert h.last(c1, JobDone) is None
    h.send(c2, WorkersSucceeded(round=0))
    assert h.last(c1, JobDone) is not None and h.last(c2, JobDone) is not None


def test_a_node_not_back_within_the_window_is_lost() -> None:
    h = Harness()
    held = running(h, max_restarts=1)
    restart_server(h)
    c = h.connect()
    h.send(c, Resume(join=join_msg(c, "node1", max_restarts=1), assignment=held["node1"]))
    assert h.last(c, Resumed) is not None
    beat(h, [c], RESUME_WINDOW + 0.1)
    job = h.machine.jobs["job"]
    rs = h.last(c, Restart)
    assert rs is not None and "node2" in rs.reason
    assert job.restart_count == 1 and list(job.members) == ["node1"]
    assert any("did not come back after the server restarted" in e.text for e in job.history)


def test_a_node_that_was_joining_rejoins_its_place() -> None:
    h = Harness()
    h.join()  # node1 waits for a second node
    restart_server(h)
    c1 = h.connect()
    h.send(c1, join_msg(c1, "node1"))
    w = h.last(c1, Waiting)
    assert w is not None and w.joined == 1
    job = h.machine.jobs["job"]
    assert job.next_seq == 1  # the same member, not a new one
    c2 = h.join()
    assert h.last(c1, Assignment) is not None and h.last(c2, Assignment) is not None


def test_a_node_told_to_restart_before_the_crash_restarts() -> None:
    h = Harness()
    held = running(h, max_restarts=3)
    conns = list(h.machine.conns)
    h.send(conns[1], WorkersFailed(round=0, failure=failure(rank=2, node="node2")))
    restart_server(h)  # node1 may never have seen its Restart
    c1, c2 = h.connect(), h.connect()
    for c, node in ((c1, "node1"), (c2, "node2")):
        h.send(c, Resume(join=join_msg(c, node, max_restarts=3), assignment=held[node]))
        rs = h.last(c, Restart)
        assert rs is not None and rs.restart_count == 1
    h.send(c1, join_msg(c1, "node1", max_restarts=3))
    h.send(c2, join_msg(c2, "node2", max_restarts=3))
    a = h.last(c1, Assignment)
    assert a is not None and a.round == 1 and a.restart_count == 1


def test_a_node_of_a_failed_job_hears_that_it_failed() -> None:
    h = Harness()
    held = running(h)
    conns = list(h.machine.conns)
    h.send(conns[1], WorkersFailed(round=0, failure=failure(rank=2, node="node2")))
    restart_server(h)
    c = h.connect()
    h.send(c, Resume(join=join_msg(c, "node1"), assignment=held["node1"]))
    f = h.last(c, JobFailed)
    assert f is not None and "max-restarts" in f.reason


def test_going_away_tells_agents_and_refuses_joins_without_blame() -> None:
    h = Harness()
    a = h.join()
    ready = h.connect()
    h._apply(h.machine.handle(ShuttingDown("SIGTERM"), h.now))
    assert h.last(a, GoingAway) is not None and h.last(ready, GoingAway) is not None
    h.join(ready)
    err = h.last(ready, Error)
    assert err is not None and err.code == "server_draining" and not err.fatal
    assert ready not in h.closed
    assert len(h.machine.jobs["job"].members) == 1


def elastic_running(h: Harness, **kw: object) -> dict[str, Assignment]:
    a, b = h.join(**kw), h.join(**kw)
    h.advance(float(kw["last_call_timeout"]) + 0.1)  # type: ignore[arg-type]
    return {node: h.last(c, Assignment) for c, node in ((a, "node1"), (b, "node2"))}  # type: ignore[misc]


def test_a_newcomer_away_after_the_restart_is_not_counted_on_until_it_is_back() -> None:
    # node3 joined the running job and waited for its settle window when the server died. The
    # window closes after the restart, node1 and node2 resume and re-join: the round must not
    # complete while node3 is away (its assignment would go to a dead connection, and it would
    # come back "without its round" and restart everyone again).
    h = Harness()
    kw = dict(min_nodes=2, max_nodes=4, last_call_timeout=2.0)
    held = elastic_running(h, **kw)
    c3 = h.join(**kw)
    assert h.last(c3, Waiting) is not None
    restart_server(h)
    job = h.machine.jobs["job"]
    assert job.members["node3"].state.value == "waiting"
    new = {}
    for node, a in held.items():
        c = h.connect()
        h.send(c, Resume(join=join_msg(c, node, **kw), assignment=a))
        assert h.last(c, Resumed) is not None
        new[node] = c
    beat(h, list(new.values()), 2.5)  # the settle window closes: everyone restarts to admit node3
    for node, c in new.items():
        assert h.last(c, Restart) is not None
        h.send(c, join_msg(c, node, **kw))
    beat(h, list(new.values()), 2.0)
    assert job.phase is JobPhase.GATHERING  # node3 is not back: no round yet
    assert not any(isinstance(m, Assignment) for msgs in h.inbox.values() for m in msgs)
    c3b = h.connect()
    h.send(c3b, join_msg(c3b, "node3", **kw))
    for c in [*new.values(), c3b]:
        a = h.last(c, Assignment)
        assert a is not None and a.group_world_size == 3 and a.round == 1
    assert not any("came back without its round" in e.text for e in job.history)


def test_a_member_not_back_in_time_is_dropped_and_the_round_goes_on_without_it() -> None:
    h = Harness()
    kw = dict(min_nodes=2, max_nodes=4, last_call_timeout=2.0)
    held = elastic_running(h, **kw)
    h.join(**kw)
    restart_server(h)
    new = {}
    for node, a in held.items():
        c = h.connect()
        h.send(c, Resume(join=join_msg(c, node, **kw), assignment=a))
        new[node] = c
    beat(h, list(new.values()), 2.5)
    for node, c in new.items():
        h.send(c, join_msg(c, node, **kw))
    beat(h, list(new.values()), RESUME_WINDOW)
    for c in new.values():
        a = h.last(c, Assignment)
        assert a is not None and a.group_world_size == 2 and a.round == 1


def test_a_spare_away_after_the_restart_is_not_ready_when_it_takes_a_place() -> None:
    h = Harness()
    kw = dict(max_restarts=3)
    held = running(h, **kw)
    spare = h.join(**kw)
    assert h.last(spare, Waiting) is not None
    restart_server(h)
    new = {}
    for node, a in held.items():
        c = h.connect()
        h.send(c, Resume(join=join_msg(c, node, **kw), assignment=a))
        new[node] = c
    h.drop(new["node2"])  # lost again before the spare is back: the spare takes its place...
    job = h.machine.jobs["job"]
    assert job.members["node3"].state.value == "waiting"  # ...but is not ready while away
    c1 = new["node1"]
    assert h.last(c1, Restart) is not None
    h.send(c1, join_msg(c1, "node1", **kw))
    assert h.last(c1, Assignment) is None
    c3 = h.connect()
    h.send(c3, join_msg(c3, "node3", **kw))
    for c in (c1, c3):
        assert h.last(c, Assignment) is not None


def test_a_spare_back_after_the_restart_is_told_it_waits_as_a_spare() -> None:
    h = Harness()
    running(h)
    spare = h.join()
    w = h.last(spare, Waiting)
    assert w is not None and w.spare
    restart_server(h)
    c = h.connect()
    h.send(c, join_msg(c, "node3"))
    w = h.last(c, Waiting)
    assert w is not None and w.spare and h.last(c, Assignment) is None
    assert "node3" in h.machine.jobs["job"].spares


# --- a job token proves the job, not the node (issue 17, item 6) ---------------------------


def secret_of(node: str) -> str:
    return f"secret-of-{node}-" + "0" * 16


def running_with_secrets(h: Harness) -> dict[str, Assignment]:
    a = h.join(node_secret=secret_of("node1"))
    b = h.join(node_secret=secret_of("node2"))
    return {"node1": h.last(a, Assignment), "node2": h.last(b, Assignment)}  # type: ignore[dict-item]


def test_after_a_restart_a_stranger_with_the_token_cannot_resume_a_nodes_place() -> None:
    h = Harness()
    held = running_with_secrets(h)
    restart_server(h)
    job = h.machine.jobs["job"]
    for secret in ("", "guessed-" + "0" * 24):
        thief = h.connect()
        h.send(thief, Resume(join=join_msg(thief, "node1", node_secret=secret), assignment=held["node1"]))
        err = h.last(thief, Error)
        assert err is not None and err.code == "duplicate_node" and "node secret" in err.message
        assert thief in h.closed and h.last(thief, Resumed) is None
    # A Join with the node's id is no better.
    thief = h.connect()
    h.send(thief, join_msg(thief, "node1", node_secret="x" * 32))
    assert h.last(thief, Error) is not None and thief in h.closed
    # The real nodes come back; nothing restarts.
    for node, a in held.items():
        c = h.connect()
        h.send(c, Resume(join=join_msg(c, node, node_secret=secret_of(node)), assignment=a))
        r = h.last(c, Resumed)
        assert r is not None and not r.rebuilt and r.round == 0
    assert job.round == 0 and job.restart_count == 0 and job.order == ["node1", "node2"]
    assert not any(c.phase is ConnPhase.AWAY for c in h.machine.conns.values())


def test_an_older_agent_without_a_secret_resumes_as_before() -> None:
    h = Harness()
    held = running(h)
    restart_server(h)
    c = h.connect()
    h.send(c, Resume(join=join_msg(c, "node1"), assignment=held["node1"]))
    assert h.last(c, Resumed) is not None


def test_a_node_coming_back_between_rounds_shows_its_secret() -> None:
    h = Harness()
    a = h.join(node_secret=secret_of("node1"))  # waiting for a second node
    restart_server(h)
    thief = h.connect()
    h.send(thief, join_msg(thief, "node1"))
    assert h.last(thief, Error) is not None and thief in h.closed
    back = h.connect()
    h.send(back, join_msg(back, "node1", node_secret=secret_of("node1")))
    assert h.last(back, Error) is None and back not in h.closed
    assert h.machine.jobs["job"].members["node1"].conn == back and a not in h.machine.conns


def test_a_member_cannot_change_its_secret_on_a_rejoin() -> None:
    h = Harness()
    a = h.join(node_secret=secret_of("node1"), max_restarts=3)
    b = h.join(node_secret=secret_of("node2"), max_restarts=3)
    h.send(a, WorkersFailed(round=0, failure=failure(node="node1")))
    h.send(b, join_msg(b, "node2", node_secret="other" * 8, max_restarts=3))
    err = h.last(b, Error)
    assert err is not None and err.code == "job_mismatch" and b in h.closed


def test_two_resumes_with_one_node_id_during_a_rebuild_keep_the_first() -> None:
    h = Harness()
    held = running(h)
    h2 = Harness()  # a server that lost its state: the agents' Resumes rebuild the round
    first = h2.connect()
    h2.send(first, Resume(join=join_msg(first, "node1"), assignment=held["node1"]))
    second = h2.connect()
    h2.send(second, Resume(join=join_msg(second, "node1"), assignment=held["node1"]))
    err = h2.last(second, Error)
    assert err is not None and err.code == "duplicate_node" and second in h2.closed
    job = h2.machine.jobs["job"]
    assert job.phase is JobPhase.RESUMING and job.members["node1"].conn == first
    other = h2.connect()
    h2.send(other, Resume(join=join_msg(other, "node2"), assignment=held["node2"]))
    assert job.phase is JobPhase.RUNNING and job.order == ["node1", "node2"]
    assert h2.last(first, Resumed) is not None and h2.last(other, Resumed) is not None
    assert not any("internal error" in line for line in h2.logs)
