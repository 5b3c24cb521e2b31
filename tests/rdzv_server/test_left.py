"""A Leave is answered with Left(job_continues), then the connection closes.

The agent picks its exit code from that answer, so a scheduler that cancels a job's last node
sees a failure, and one that scales an elastic job down sees a success.
"""

from __future__ import annotations

from typing import Any

from protocol import Assignment, Leave, Left, Restart, WorkersFailed, WorkersSucceeded
from rdzv_server.machine.state import Close, Received, Send

from .harness import Harness, failure
from .test_state import assignments

ELASTIC: dict[str, Any] = dict(min_nodes=1, max_nodes=2, last_call_timeout=1.0)
FIXED: dict[str, Any] = dict(min_nodes=2, max_nodes=2, max_restarts=3)


def leave(h: Harness, conn: int, reason: str = "drain: received SIGTERM") -> Left:
    """Send Leave; the answer must come to that connection just before it is closed."""
    effects = h.machine.handle(Received(conn, Leave(reason=reason)), h.now)
    h._apply(effects)
    mine = [e for e in effects if isinstance(e, Send | Close) and e.conn == conn]
    assert [type(e) for e in mine] == [Send, Close], mine
    first = mine[0]
    assert isinstance(first, Send) and isinstance(first.msg, Left)
    return first.msg


def test_elastic_job_goes_on_without_one_node_but_not_without_the_last() -> None:
    h = Harness()
    a, b = h.join(**ELASTIC), h.join(**ELASTIC)
    assignments(h, [a, b])
    left = leave(h, b)
    assert left.job_continues and "1 node(s) remain" in left.reason
    assert isinstance(h.last(a, Restart), Restart)
    h.join(a, **ELASTIC)
    h.advance(1.5)
    left = leave(h, a)
    assert not left.job_continues and "last" in left.reason
    assert "job" not in h.machine.jobs


def test_fixed_size_job_does_not_go_on_one_node_short_unless_a_spare_steps_in() -> None:
    h = Harness()
    a, b = h.join(**FIXED), h.join(**FIXED)
    assignments(h, [a, b])
    left = leave(h, b)
    assert not left.job_continues and "only 1 node(s) remain and the job needs 2" in left.reason

    h = Harness()
    a, b = h.join(**FIXED), h.join(**FIXED)
    assignments(h, [a, b])
    spare = h.join(**FIXED)
    left = leave(h, b)
    assert left.job_continues and "2 node(s) remain" in left.reason
    h.join(a, **FIXED)
    got = assignments(h, [a, spare])  # the spare took the place
    assert got[spare].group_world_size == 2


def test_a_spare_leaving_is_no_loss_to_the_job() -> None:
    h = Harness()
    a, b = h.join(**FIXED), h.join(**FIXED)
    assignments(h, [a, b])
    spare = h.join(**FIXED)
    left = leave(h, spare)
    assert left.job_continues and "spare" in left.reason
    assert h.last(a, Restart) is None  # nothing restarts


def test_a_node_whose_workers_finished_may_leave() -> None:
    h = Harness()
    a, b = h.join(**FIXED), h.join(**FIXED)
    assignments(h, [a, b])
    h.send(a, WorkersSucceeded(round=0))
    left = leave(h, a)
    assert left.job_continues and "finished" in left.reason


def test_leaving_a_failed_job_or_a_finished_one() -> None:
    h = Harness()
    a, b = h.join(**FIXED), h.join(**FIXED)
    assignments(h, [a, b])
    h.send(a, WorkersFailed(round=0, failure=failure()))
    h.join(a, **FIXED), h.join(b, **FIXED)
    for _ in range(3):
        got = assignments(h, [a, b])
        h.send(a, WorkersFailed(round=got[a].round, failure=failure()))
        if h.machine.jobs["job"].phase.value == "failed":
            break
        h.join(a, **FIXED), h.join(b, **FIXED)
    left = leave(h, b)
    assert not left.job_continues and left.reason.startswith("the job failed: ")

    h = Harness()
    a, b = h.join(**FIXED), h.join(**FIXED)
    assignments(h, [a, b])
    h.send(a, WorkersSucceeded(round=0))
    h.send(b, WorkersSucceeded(round=0))
    left = leave(h, b)
    assert left.job_continues and left.reason == "the job finished"


def test_leave_before_joining_is_answered_too() -> None:
    h = Harness()
    c = h.connect()
    left = leave(h, c, "health check failed")
    assert not left.job_continues and "had not joined" in left.reason


def test_a_draining_node_keeps_its_place_until_its_workers_have_exited() -> None:
    # Its agent says it leaves when it starts stopping its workers: the others restart at
    # once (no restart counted), but the next round waits for the node's Leave, which comes
    # once its workers are gone (one may be writing the checkpoint the next round loads).
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=3, last_call_timeout=1.0)
    a, b = h.join(**kw), h.join(**kw)
    h.advance(1.5)
    assignments(h, [a, b])
    h.send(b, Leave(reason="drain: received SIGTERM", workers_stopping=True))
    rs = h.last(a, Restart)
    assert rs is not None and "is leaving (drain: received SIGTERM)" in rs.reason
    assert h.last(b, Restart) is None and b not in h.closed  # no answer: its Leave comes later
    job = h.machine.jobs["job"]
    assert job.restart_count == 0 and "node2" in job.members
    h.inbox.clear()
    h.join(a, **kw)
    h.advance(5.0)
    assert h.last(a, Assignment) is None  # not while node2's workers may live
    left = leave(h, b)
    assert left.job_continues and "1 node(s) remain" in left.reason
    got = assignments(h, [a])
    assert got[a].group_world_size == 1
    assert [e.kind for e in job.history if e.kind in ("left", "round")][-3:] == ["left", "left", "round"]


def test_a_spare_takes_a_draining_nodes_place_only_once_it_has_left() -> None:
    h = Harness()
    a, b = h.join(**FIXED), h.join(**FIXED)
    assignments(h, [a, b])
    spare = h.join(**FIXED)
    h.send(b, Leave(reason="drain: maintenance", workers_stopping=True))
    assert isinstance(h.last(a, Restart), Restart)
    h.join(a, **FIXED)
    assert h.last(spare, Assignment) is None and "node3" in h.machine.jobs["job"].spares
    left = leave(h, b)
    assert left.job_continues
    got = assignments(h, [a, spare])
    assert got[spare].group_world_size == 2
