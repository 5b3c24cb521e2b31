"""The rendezvous rules, deterministic: a fake clock and scripted agents."""

from __future__ import annotations

from dataclasses import replace

from protocol import (
    SUPPORTED_VERSIONS,
    Assignment,
    Error,
    Heartbeat,
    Hello,
    JobDone,
    JobFailed,
    Join,
    Leave,
    Message,
    Restart,
    Resume,
    Resumed,
    Waiting,
    WorkersFailed,
    WorkersSucceeded,
)
from rdzv_server.machine.state import (
    JOIN_LINES,
    JOIN_LOG_WINDOW,
    SERVER_BUSY,
    Connected,
    DrainRequested,
    JobPhase,
    Received,
    Restarted,
)
from rdzv_server.state_image import dump

from .harness import Harness, failure


def assignments(h: Harness, conns: list[int]) -> dict[int, Assignment]:
    out = {}
    for c in conns:
        a = h.last(c, Assignment)
        assert a is not None, f"connection {c} got no assignment: {h.inbox.get(c)}"
        out[c] = a
    return out


def test_round_completes_when_node_count_reached() -> None:
    h = Harness()
    a = h.join()
    w = h.last(a, Waiting)
    assert w is not None and w.joined == 1
    assert h.last(a, Assignment) is None
    b = h.join()
    got = assignments(h, [a, b])
    # sorted by address: 10.0.0.1 < 10.0.0.2
    assert got[a].group_rank == 0 and got[b].group_rank == 1
    assert got[a].rank_offset == 0 and got[b].rank_offset == 2
    assert {x.world_size for x in got.values()} == {4}
    assert {x.group_world_size for x in got.values()} == {2}
    assert {(x.master_addr, x.master_port) for x in got.values()} == {("10.0.0.1", 20001)}


def test_ranks_follow_address_not_arrival_and_sum_nproc() -> None:
    h = Harness()
    c1, c2, c3 = h.connect(), h.connect(), h.connect()
    kw = dict(min_nodes=3, max_nodes=3)
    h.join(c3, nproc=1, **kw)
    h.join(c1, nproc=4, **kw)
    h.join(c2, nproc=2, **kw)
    got = assignments(h, [c1, c2, c3])
    assert [got[c].group_rank for c in (c1, c2, c3)] == [0, 1, 2]
    assert [got[c].rank_offset for c in (c1, c2, c3)] == [0, 4, 6]
    assert got[c1].world_size == 7
    assert got[c1].master_addr == "10.0.0.1"


def test_two_jobs_never_see_each_other() -> None:
    h = Harness()
    a1 = h.join(job="a")
    b1 = h.join(job="b", node="x")
    assert h.last(a1, Assignment) is None and h.last(b1, Assignment) is None
    a2 = h.join(job="a")
    assert h.last(a1, Assignment) is not None and h.last(a2, Assignment) is not None
    assert h.last(b1, Assignment) is None
    b2 = h.join(job="b", node="y")
    got = assignments(h, [b1, b2])
    assert {x.job_id for x in got.values()} == {"b"}
    assert {x.world_size for x in got.values()} == {4}


def test_mismatched_settings_are_refused_naming_both_values() -> None:
    h = Harness()
    a = h.join(min_nodes=2, max_nodes=2)
    b = h.join(min_nodes=3, max_nodes=3)
    err = h.last(b, Error)
    assert err is not None and err.code == "job_mismatch"
    assert "--nnodes 2" in err.message and "--nnodes 3" in err.message
    assert b in h.closed
    c = h.join(entrypoint="other.py")
    err = h.last(c, Error)
    assert err is not None and "train.py" in err.message and "other.py" in err.message
    # the job itself is untouched
    d = h.join()
    assert h.last(a, Assignment) is not None and h.last(d, Assignment) is not None


def test_hello_is_required_and_versions_negotiated() -> None:
    h = Harness()
    h.machine.handle(Connected(99, "peer"), 0.0)
    h._apply(h.machine.handle(Received(99, Heartbeat()), 0.0))
    err = h.last(99, Error)
    assert err is not None and err.code == "unexpected_message" and 99 in h.closed
    h.machine.handle(Connected(98, "peer"), 0.0)
    h._apply(h.machine.handle(Received(98, Hello(versions=(99,), software="future")), 0.0))
    err = h.last(98, Error)
    assert err is not None and err.code == "version_mismatch"
    assert "99" in err.message and str(SUPPORTED_VERSIONS[0]) in err.message


def test_elastic_first_round_waits_for_last_call() -> None:
    h = Harness()
    kw = dict(min_nodes=2, max_nodes=4, last_call_timeout=3.0)
    a = h.join(**kw)
    b = h.join(**kw)
    assert h.last(a, Assignment) is None
    h.advance(2.0)
    c = h.join(**kw)
    assert h.last(c, Assignment) is None
    h.advance(1.5)
    got = assignments(h, [a, b, c])
    assert {x.group_world_size for x in got.values()} == {3}


def test_elastic_completes_at_once_when_max_reached() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2, last_call_timeout=30.0)
    a = h.join(**kw)
    assert h.last(a, Assignment) is None
    b = h.join(**kw)
    assert assignments(h, [a, b])[a].group_world_size == 2


def test_worker_failure_restarts_everyone_and_counts_once() -> None:
    h = Harness()
    a = h.join(max_restarts=2)
    b = h.join(max_restarts=2)
    r0 = assignments(h, [a, b])
    h.take(a), h.take(b)
    # two failures in the same round (one per node) count as one restart
    h.send(a, WorkersFailed(round=r0[a].round, failure=failure(0, "node1")))
    h.send(b, WorkersFailed(round=r0[b].round, failure=failure(2, "node2")))
    for c in (a, b):
        rs = h.last(c, Restart)
        assert rs is not None and rs.restart_count == 1 and "rank 0" in rs.reason
    h.join(a, max_restarts=2)
    assert h.last(a, Assignment) is None  # b has not re-joined yet
    h.join(b, max_restarts=2)
    r1 = assignments(h, [a, b])
    assert r1[a].restart_count == 1 and r1[a].round == r0[a].round + 1
    assert r1[a].group_rank == 0 and r1[b].group_rank == 1


def test_restarts_exhausted_fails_job_with_root_cause_to_all() -> None:
    h = Harness()
    a = h.join(max_restarts=0)
    b = h.join(max_restarts=0)
    r = assignments(h, [a, b])
    f = failure(3, "node2", exitcode=3)
    h.send(b, WorkersFailed(round=r[b].round, failure=f))
    for c in (a, b):
        jf = h.last(c, JobFailed)
        # The node and address are the sender's own (10.0.0.2), not what it wrote (10.0.0.9).
        assert jf is not None and jf.failure == replace(f, addr="10.0.0.2") and "exit code 3" in jf.reason
    assert h.machine.jobs["job"].phase is JobPhase.FAILED


def test_success_waits_for_every_node_then_job_done() -> None:
    h = Harness()
    a, b = h.join(), h.join()
    r = assignments(h, [a, b])
    h.send(a, WorkersSucceeded(round=r[a].round))
    assert h.last(a, JobDone) is None
    h.send(b, WorkersSucceeded(round=r[b].round))
    assert h.last(a, JobDone) is not None and h.last(b, JobDone) is not None
    # once every node has gone, the id can be used again
    h.drop(a), h.drop(b)
    assert "job" not in h.machine.jobs


def test_finished_job_id_refused_while_nodes_remain() -> None:
    h = Harness()
    a, b = h.join(), h.join()
    r = assignments(h, [a, b])
    h.send(a, WorkersSucceeded(round=r[a].round))
    h.send(b, WorkersSucceeded(round=r[b].round))
    c = h.join()
    err = h.last(c, Error)
    assert err is not None and err.code == "job_closed"


def test_stale_messages_from_an_abandoned_round_are_ignored() -> None:
    h = Harness()
    a, b = h.join(max_restarts=3), h.join(max_restarts=3)
    r = assignments(h, [a, b])
    h.send(a, WorkersFailed(round=r[a].round, failure=failure()))
    h.send(b, WorkersSucceeded(round=r[b].round))  # late: that round is gone
    h.send(b, WorkersFailed(round=r[b].round, failure=failure()))
    assert h.machine.jobs["job"].restart_count == 1


def test_node_loss_in_elastic_job_restarts_survivors_without_using_budget() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=3, last_call_timeout=1.0, max_restarts=0)
    a, b, c = h.join(**kw), h.join(**kw), h.join(**kw)
    r = assignments(h, [a, b, c])
    assert r[a].group_world_size == 3
    h.drop(b)
    for x in (a, c):
        rs = h.last(x, Restart)
        assert rs is not None and "node2" in rs.reason and rs.restart_count == 0
    h.join(a, **kw)
    h.join(c, **kw)
    r2 = assignments(h, [a, c])
    # survivors keep their order; rank 0 stays put, so MASTER_ADDR does too
    assert r2[a].group_rank == 0 and r2[c].group_rank == 1
    assert r2[a].master_addr == r[a].master_addr
    assert r2[a].world_size == 4


def test_rank_zero_stays_when_a_lower_address_joins_later() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=3, last_call_timeout=1.0)
    c5 = h.join(node="z", addr="10.0.0.5", **kw)
    h.advance(1.5)
    assert assignments(h, [c5])[c5].group_rank == 0
    low = h.join(node="a", addr="10.0.0.1", **kw)
    rs = h.last(c5, Restart)
    assert rs is None  # the settle window is still open
    h.advance(1.5)
    assert h.last(c5, Restart) is not None
    h.join(c5, node="z", addr="10.0.0.5", **kw)
    got = assignments(h, [c5, low])
    assert got[c5].group_rank == 0 and got[low].group_rank == 1
    assert got[low].master_addr == "10.0.0.5"


def test_join_during_round_settles_then_one_restart_for_a_burst() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=4, last_call_timeout=2.0)
    a = h.join(**kw)
    h.advance(2.5)
    assert assignments(h, [a])[a].world_size == 2
    h.take(a)
    b = h.join(**kw)
    h.advance(1.0)
    c = h.join(**kw)
    assert h.last(a, Restart) is None
    h.advance(1.5)  # window opened by b's join closes
    restarts = [m for m in h.take(a) if isinstance(m, Restart)]
    assert len(restarts) == 1
    h.join(a, **kw)
    got = assignments(h, [a, b, c])
    assert {x.world_size for x in got.values()} == {6}


def test_silent_node_is_dropped_after_heartbeat_timeout() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2, heartbeat_timeout=3.0)
    a, b = h.join(**kw), h.join(**kw)
    assignments(h, [a, b])
    for _ in range(4):
        h.advance(1.0)
        h.send(a, Heartbeat())
    assert b in h.closed and "silent" in h.closed[b]
    assert a not in h.closed
    assert h.last(a, Restart) is not None


def test_fixed_size_job_losing_a_node_fails_without_restarts() -> None:
    h = Harness()
    a, b = h.join(), h.join()
    assignments(h, [a, b])
    h.drop(b)
    jf = h.last(a, JobFailed)
    assert jf is not None and "node2" in jf.reason


def test_fixed_size_job_waits_for_replacement_when_restarts_remain() -> None:
    h = Harness()
    a, b = h.join(max_restarts=1), h.join(max_restarts=1)
    assignments(h, [a, b])
    h.drop(b)
    rs = h.last(a, Restart)
    assert rs is not None and rs.restart_count == 1
    h.join(a, max_restarts=1)
    w = h.last(a, Waiting)
    assert w is not None and w.joined == 1
    c = h.join(max_restarts=1)
    got = assignments(h, [a, c])
    assert got[a].group_rank == 0 and got[c].restart_count == 1


def test_spare_waits_and_replaces_a_lost_node() -> None:
    h = Harness()
    kw = dict(min_nodes=2, max_nodes=2, max_restarts=1)
    a = h.join(**kw)
    w = h.last(a, Waiting)
    assert w is not None and not w.spare  # waiting for its round, not as a spare
    b = h.join(**kw)
    assignments(h, [a, b])
    s = h.join(**kw)
    w = h.last(s, Waiting)
    assert w is not None and w.spare and "spare" in w.reason and h.last(s, Assignment) is None
    h.drop(b)
    h.join(a, **kw)
    got = assignments(h, [a, s])
    assert got[s].group_world_size == 2 and got[a].group_rank == 0


def test_leave_is_a_clean_departure() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2)
    a, b = h.join(**kw), h.join(**kw)
    assignments(h, [a, b])
    h.send(b, Leave(reason="drain"))
    assert b in h.closed
    rs = h.last(a, Restart)
    assert rs is not None and "left" in rs.reason and rs.restart_count == 0


def test_join_and_loss_in_the_same_settle_window() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=4, last_call_timeout=2.0)
    a, b = h.join(**kw), h.join(**kw)
    h.advance(2.5)
    assignments(h, [a, b])
    h.take(a), h.take(b)
    c = h.join(**kw)  # opens the settle window
    assert h.last(a, Restart) is None
    h.drop(b)  # loss restarts at once; c is admitted in the same new round
    assert h.last(a, Restart) is not None
    h.join(a, **kw)
    got = assignments(h, [a, c])
    assert got[a].group_rank == 0 and got[c].group_world_size == 2


def test_flaky_node_is_excluded_after_threshold_and_job_goes_on() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2, max_restarts=5, exclude_after=2)
    a, b = h.join(**kw), h.join(**kw)
    r = assignments(h, [a, b])
    h.send(b, WorkersFailed(round=r[b].round, failure=failure(2, "node2")))
    assert b not in h.closed  # one failure is not enough
    h.join(a, **kw)
    h.join(b, **kw)
    r = assignments(h, [a, b])
    h.send(b, WorkersFailed(round=r[b].round, failure=failure(2, "node2")))
    err = h.last(b, Error)
    assert err is not None and err.code == "excluded" and "failed 2 times" in err.message
    assert b in h.closed
    job = h.machine.jobs["job"]
    assert "node2" in job.excluded and [e.kind for e in job.history].count("excluded") == 1
    h.join(a, **kw)
    r2 = assignments(h, [a])
    assert r2[a].group_world_size == 1 and r2[a].world_size == 2
    # the excluded node cannot come back under the same id
    again = h.join(node="node2", **kw)
    err = h.last(again, Error)
    assert err is not None and err.code == "excluded"


def test_drain_request_reaches_only_that_node() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2)
    a, b = h.join(**kw), h.join(**kw)
    assignments(h, [a, b])
    h._apply(h.machine.handle(DrainRequested("job", "node2", "maintenance"), h.now))
    from protocol import Drain

    assert h.last(b, Drain) == Drain(reason="maintenance")
    assert h.last(a, Drain) is None


def test_stats_and_history_follow_the_job() -> None:
    h = Harness()
    a, b = h.join(max_restarts=1), h.join(max_restarts=1)
    r = assignments(h, [a, b])
    h.advance(1.0)
    h.send(a, WorkersFailed(round=r[a].round, failure=failure()))
    h.join(a, max_restarts=1)
    h.advance(0.5)
    h.join(b, max_restarts=1)
    s = h.machine.stats
    assert (s.jobs_created, s.rounds_started, s.rounds_completed, s.restarts) == (1, 2, 2, 1)
    assert s.failures["worker"] == 1 and s.latency_count == 2
    assert abs(s.latency_sum - 0.5) < 1e-9
    kinds = [e.kind for e in h.machine.jobs["job"].history]
    assert kinds == ["created", "joined", "joined", "round", "failure", "round"]
    h.drop(a), h.drop(b)
    assert [j.id for j in h.machine.finished_jobs] == ["job"]


def _resume(h: Harness, conn: int, a: Assignment, node: str, **kw: object):
    from protocol import Join, Resume

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
    h.send(conn, Resume(join=Join(**fields), assignment=a))  # type: ignore[arg-type]


def test_server_without_state_rebuilds_the_round_when_all_agents_agree() -> None:
    from protocol import Resumed

    old = Harness()
    a, b = old.join(), old.join()
    held = assignments(old, [a, b])
    new = Harness()  # the restarted server knows nothing
    a2, b2 = new.connect(), new.connect()
    _resume(new, a2, held[a], "node1")
    assert new.last(a2, Resumed) is None
    assert new.machine.jobs["job"].phase is JobPhase.RESUMING
    _resume(new, b2, held[b], "node2")
    for c in (a2, b2):
        r = new.last(c, Resumed)
        assert r is not None and r.rebuilt and r.round == held[a].round
    job = new.machine.jobs["job"]
    assert job.phase is JobPhase.RUNNING and job.order == ["node1", "node2"]
    # the rebuilt job behaves like the original: success ends it
    new.send(a2, WorkersSucceeded(round=held[a].round))
    new.send(b2, WorkersSucceeded(round=held[b].round))
    assert new.last(a2, JobDone) is not None


def test_agents_that_disagree_start_a_new_round() -> None:
    import dataclasses

    old = Harness()
    a, b = old.join(), old.join()
    held = assignments(old, [a, b])
    new = Harness()
    a2, b2 = new.connect(), new.connect()
    _resume(new, a2, held[a], "node1")
    _resume(new, b2, dataclasses.replace(held[b], round=7), "node2")
    for c in (a2, b2):
        rs = new.last(c, Restart)
        assert rs is not None and "disagree" in rs.reason
    new.join(a2, node="node1")
    new.join(b2, node="node2")
    got = assignments(new, [a2, b2])
    assert got[a2].group_rank == 0 and got[b2].group_rank == 1


def test_rebuild_gives_up_when_a_node_never_comes_back() -> None:
    old = Harness()
    a, b = old.join(min_nodes=1), old.join(min_nodes=1)
    held = assignments(old, [a, b])
    new = Harness()
    a2 = new.connect()
    _resume(new, a2, held[a], "node1", min_nodes=1)
    for _ in range(11):
        new.advance(1.0)
        new.send(a2, Heartbeat())
    rs = new.last(a2, Restart)
    assert rs is not None and "did not come back" in rs.reason
    new.join(a2, node="node1", min_nodes=1)
    assert assignments(new, [a2])[a2].group_world_size == 1


def test_resume_of_a_node_the_server_dropped_means_join_again() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2)
    a, b = h.join(**kw), h.join(**kw)
    held = assignments(h, [a, b])
    h.drop(b)
    b2 = h.connect()
    _resume(h, b2, held[b], "node2", **kw)
    rs = h.last(b2, Restart)
    assert rs is not None and "join again" in rs.reason


def test_a_join_storm_logs_its_first_joins_then_one_summary_before_the_round() -> None:
    h = Harness()
    conns = [h.join(min_nodes=100, max_nodes=100, nproc=1) for _ in range(100)]
    assert len(assignments(h, conns)) == 100
    single = [line for line in h.logs if " joined (" in line]
    assert len(single) == JOIN_LINES
    summary = [i for i, line in enumerate(h.logs) if "more nodes" in line]
    assert len(summary) == 1
    assert h.logs[summary[0]] == "job job: 80 more nodes (node21 ... node100) joined; 100 of 100"
    # The summary comes before the round it completed, and the history still has every join.
    assert summary[0] < next(i for i, line in enumerate(h.logs) if "round 0" in line)
    assert sum(e.kind == "joined" for e in h.machine.jobs["job"].history) == 100


def test_joins_beyond_the_lines_of_a_second_are_summed_up_when_it_ends() -> None:
    h = Harness()
    for _ in range(JOIN_LINES + 10):
        h.join(min_nodes=1, max_nodes=200, last_call_timeout=30.0)
    assert sum(" joined (" in line for line in h.logs) == JOIN_LINES
    assert not any("more nodes" in line for line in h.logs)
    h.advance(JOIN_LOG_WINDOW)  # no tick of its own ...
    assert not any("more nodes" in line for line in h.logs)
    h.advance(5.0 / 4 - JOIN_LOG_WINDOW)  # ... the heartbeat sweep's (timeout 5 s) brings it
    assert h.logs[-1] == "job job: 10 more nodes (node21 ... node30) joined; 30 of 1:200"
    h.advance(0.25)
    h.join(min_nodes=1, max_nodes=200, last_call_timeout=30.0, node="late")
    assert h.logs[-1].startswith("job job: node late (") and h.logs[-1].endswith("joined (31 of 1:200)")


def test_an_abandoned_rebuild_restarts_the_nodes_that_held_a_round_not_those_that_joined() -> None:
    # A server without state: one agent comes back holding its round, the other (whose workers
    # were stopping for a restart when the server died) joins. The rebuild cannot complete; the
    # joined node is a newcomer, already ready: told nothing, it must not be waited for.
    old = Harness()
    a, b = old.join(min_nodes=1), old.join(min_nodes=1)
    held = assignments(old, [a, b])
    new = Harness()
    a2, b2 = new.connect(), new.connect()
    _resume(new, a2, held[a], "node1", min_nodes=1)
    new.join(b2, node="node2", min_nodes=1)
    for _ in range(11):
        new.advance(1.0)
        new.send(a2, Heartbeat())
        new.send(b2, Heartbeat())
    assert new.last(a2, Restart) is not None
    assert new.last(b2, Restart) is None
    new.join(a2, node="node1", min_nodes=1)
    got = assignments(new, [a2, b2])
    assert got[a2].group_world_size == 2 and got[a2].round == got[b2].round


def test_resume_of_a_dropped_node_into_a_job_that_ended_says_how_it_ended() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2)
    a, b = h.join(**kw), h.join(**kw)
    held = assignments(h, [a, b])
    h.drop(b)  # frozen past its heartbeat: dropped; a goes on alone and succeeds
    h.join(a, **kw)
    h.send(a, WorkersSucceeded(round=assignments(h, [a])[a].round))
    assert h.machine.jobs["job"].phase is JobPhase.FINISHED
    b2 = h.connect()
    _resume(h, b2, held[b], "node2", **kw)
    assert h.last(b2, JobDone) is not None and h.last(b2, Restart) is None

    h = Harness()
    a, b = h.join(**kw), h.join(**kw)
    held = assignments(h, [a, b])
    h.drop(b)
    h.join(a, **kw)
    h.send(a, WorkersFailed(round=assignments(h, [a])[a].round, failure=failure()))
    b2 = h.connect()
    _resume(h, b2, held[b], "node2", **kw)
    f = h.last(b2, JobFailed)
    assert f is not None and "max-restarts" in f.reason
    assert f.failure == replace(failure(), node_id="node1", addr="10.0.0.1")


# --- hooks for the state log and the service ------------------------------------------------


def _state(h: Harness) -> dict[str, object]:
    """The machine's snapshot, without the connections' last sign of life (which only the
    heartbeat sweep reads, and which a replay never needs)."""
    data = dump(h.machine)
    for c in data["conns"]:
        c.pop("last_seen")
    return data


def _send_checked(h: Harness, conn: int, msg: Message) -> bool:
    """Send, and check the rule of ``unchanged``: True only if the state did not change."""
    before = _state(h)
    h.send(conn, msg)
    if h.machine.unchanged:
        assert _state(h) == before, f"{msg.TYPE} changed the state but was marked unchanged"
    return h.machine.unchanged


def test_ignored_messages_are_marked_unchanged_and_change_nothing() -> None:
    h = Harness()
    kw = dict(min_nodes=2, max_nodes=3, max_restarts=3)
    a, b = h.join(**kw), h.join(**kw)
    h.advance(6.0)  # the last call closes: round 0 runs with two
    assert h.last(a, Assignment) is not None
    spare = h.join(spare=True, **kw)
    assert _send_checked(h, a, Heartbeat())
    assert _send_checked(h, a, WorkersSucceeded(round=7))  # not this round
    assert _send_checked(h, spare, Leave(workers_stopping=True))  # a spare has no workers
    assert _send_checked(h, spare, _rejoin(h, spare, spare=True, **kw))  # same address and port
    # A failure changes the state; a second one in the same round counts once.
    assert not _send_checked(h, a, WorkersFailed(round=0, failure=failure(node=f"node{a}")))
    assert _send_checked(h, b, WorkersFailed(round=0, failure=failure(node=f"node{b}")))
    assert _send_checked(h, b, WorkersSucceeded(round=0))  # told to restart: means nothing now
    # A drain notice makes a ready member not ready; a repeated one changes nothing.
    assert not _send_checked(h, b, _rejoin(h, b, **kw))
    assert not _send_checked(h, b, Leave(workers_stopping=True))
    assert _send_checked(h, b, Leave(workers_stopping=True))
    # A state-changing message is never marked.
    assert not _send_checked(h, b, Leave(reason="bye"))


def _rejoin(h: Harness, conn: int, **kw: object) -> Join:
    return Join(
        job_id="job",
        node_id=f"node{conn}",
        addr=f"10.0.0.{conn}",
        nproc=2,
        entrypoint="train.py",
        master_port=20000 + conn,
        last_call_timeout=5.0,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
        **kw,  # type: ignore[arg-type]
    )


def test_answers_to_a_resume_the_server_cannot_take_back_change_nothing() -> None:
    h = Harness()
    a, b = h.join(), h.join()
    got = h.last(a, Assignment)
    assert got is not None
    h.send(a, WorkersSucceeded(round=0))
    h.send(b, WorkersSucceeded(round=0))
    assert h.last(a, JobDone) is not None
    c = h.connect()
    # node1 comes back on another connection: the job is kept (its nodes are still there).
    resume = Resume(join=_rejoin(h, 9, min_nodes=2, max_nodes=2, max_restarts=0), assignment=got)
    assert _send_checked(h, c, resume)
    assert h.last(c, JobDone) is not None


def test_a_server_short_of_disk_refuses_new_nodes_but_serves_its_members() -> None:
    h = Harness()
    a = h.join()
    h.machine.refuse_joins = "the server's disk is nearly full (12 MB free); try again later"
    b = h.join()  # a new node of an existing job
    err = h.last(b, Error)
    assert err is not None and err.code == SERVER_BUSY and err.fatal and "nearly full" in err.message
    assert b in h.closed and set(h.machine.jobs["job"].members) == {f"node{a}"}
    c = h.join(job="other")  # a new job
    assert h.last(c, Error) is not None and "other" not in h.machine.jobs
    # Once there is room again, joins are served.
    h.machine.refuse_joins = ""
    d = h.join()
    assert h.last(d, Assignment) is not None and h.last(a, Assignment) is not None
    # Members are served while the disk is full: a failure restarts the round, and the
    # members' re-joins complete it.
    h.machine.refuse_joins = "disk full"
    h.send(a, WorkersFailed(round=0, failure=failure(node=f"node{a}")))
    assert h.machine.jobs["job"].phase is JobPhase.FAILED  # max_restarts 0: served, and final


def test_a_server_short_of_disk_takes_back_nodes_of_a_restored_job() -> None:
    h = Harness()
    a, b = h.join(), h.join()
    got_a, got_b = h.last(a, Assignment), h.last(b, Assignment)
    assert got_a is not None and got_b is not None
    h.inbox.clear()
    h._apply(h.machine.handle(Restarted(), h.now))  # what the state log does after a restart
    h.machine.refuse_joins = "disk full"
    for conn, node, got in ((h.connect(), f"node{a}", got_a), (h.connect(), f"node{b}", got_b)):
        j = Join(**{**_join_fields(h, a if node == f"node{a}" else b), "node_id": node})
        h.send(conn, Resume(join=j, assignment=got))
        assert isinstance(h.take(conn)[-1], Resumed)
    assert h.machine.jobs["job"].phase is JobPhase.RUNNING


def _join_fields(h: Harness, conn: int) -> dict[str, object]:
    return dict(
        job_id="job",
        node_id=f"node{conn}",
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
