"""Joining a round (``machine/joining.py``): the health check before the join, the waiting
updates, the join timeout, and a job that ends while this node waits to join, deterministic:
events in, effects out, a fake clock."""

from __future__ import annotations

import signal

import pytest

from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from protocol import JobDone, JobFailed, Leave, Left, Restart, Waiting

from .harness import assignment, failure, kinds, settings


def test_join_timeout_leaves_and_exits() -> None:
    m = AgentMachine(settings(join_timeout=10.0))
    m.start(0.0)
    m.handle(st.ServerSent(Waiting(job_id="j", round=0, joined=1, min_nodes=2, max_nodes=2)), 1.0)
    assert m.handle(st.Tick(), 9.0) == []
    eff = m.handle(st.Tick(), 10.0)
    assert kinds(eff) == [st.Send, st.Exit]
    assert isinstance(eff[0], st.Send) and isinstance(eff[0].msg, Leave)
    ex = eff[1]
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_RDZV and "1 joined" in ex.reason


def test_waiting_is_logged_once_per_change() -> None:
    m = AgentMachine(settings())
    m.start(0.0)
    w = Waiting(job_id="j", round=0, joined=1, min_nodes=2, max_nodes=2)
    (log,) = m.handle(st.ServerSent(w), 1.0)
    assert isinstance(log, st.Log) and "waiting for nodes: 1 of 2 joined" in log.text
    assert m.handle(st.ServerSent(w), 1.5) == []


def test_a_spare_that_outlives_the_job_exits_cleanly_saying_so() -> None:
    m = AgentMachine(settings())
    m.start(0.0)
    # The typed field says so, not the reason's text (which a server may word as it likes).
    spare = Waiting(
        job_id="j", round=0, joined=1, min_nodes=1, max_nodes=1, reason="the job is full", spare=True
    )
    m.handle(st.ServerSent(spare), 0.1)
    eff = m.handle(st.ServerSent(JobDone()), 5.0)
    assert kinds(eff) == [st.Exit]
    ex = eff[-1]
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_NOT_NEEDED == 0
    assert "nothing left to do" in ex.reason
    (note,) = [e for e in eff if isinstance(e, st.Log)]
    assert note.level == "warning" and "finished without it (it waited as a spare" in note.text
    assert m.phase is st.Phase.EXITED
    # A newcomer that joined a running job, not yet in a round, ends the same way.
    m = AgentMachine(settings())
    m.start(0.0)
    (note, ex) = m.handle(st.ServerSent(JobDone()), 5.0)
    assert isinstance(ex, st.Exit) and ex.code == 0
    assert isinstance(note, st.Log) and "no place in a round yet" in note.text
    # A reason that merely mentions "spare" does not make the node one.
    m = AgentMachine(settings())
    m.start(0.0)
    m.handle(
        st.ServerSent(Waiting(job_id="j", round=0, joined=1, min_nodes=2, max_nodes=2, reason="spare")), 0.1
    )
    (note, ex) = m.handle(st.ServerSent(JobDone()), 5.0)
    assert isinstance(note, st.Log) and "no place in a round yet" in note.text


def test_a_spare_told_the_job_failed_exits_nonzero_with_the_jobs_reason() -> None:
    m = AgentMachine(settings())
    m.start(0.0)
    root = failure(4.0)
    (ex,) = m.handle(st.ServerSent(JobFailed(reason="rank 1 failed; no restarts left", failure=root)), 5.0)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED
    assert "waited to join" in ex.reason and "rank 1 failed; no restarts left" in ex.reason
    assert ex.failure == root and ex.local_failures == ()


def test_failed_health_check_never_joins() -> None:
    m = AgentMachine(settings(health_check=True))
    assert kinds(m.start(0.0)) == [st.RunHealthCheck]
    eff = m.handle(st.HealthCheckDone(ok=False, detail="gpu 3 is missing"), 0.1)
    assert kinds(eff) == [st.Send, st.Exit]
    ex = eff[-1]
    assert isinstance(ex, st.Exit) and ex.code != 0 and "gpu 3 is missing" in ex.reason


def test_the_join_waits_for_the_health_check_once_per_round() -> None:
    m = AgentMachine(settings(health_check=True, reconnect_timeout=30.0))
    assert kinds(m.start(0.0)) == [st.RunHealthCheck]
    assert kinds(m.handle(st.HealthCheckDone(ok=True), 1.0)) == [st.SendJoin]
    # A reconnect while joining joins again without checking again ...
    m.handle(st.ConnectionLost("reset"), 1.5)
    assert kinds(m.handle(st.Reconnected(), 1.6)) == [st.SendJoin]
    m.handle(st.ServerSent(assignment()), 2.0)
    m.handle(st.WorkersStarted((11,)), 2.1)
    # ... but the next round's join is checked again, once the workers are down.
    m.handle(st.ServerSent(Restart(round=0, reason="node n2 left", restart_count=1)), 3.0)
    assert kinds(m.handle(st.WorkersStopped(), 3.5)) == [st.RunHealthCheck]
    assert kinds(m.handle(st.HealthCheckDone(ok=True), 4.0)) == [st.SendJoin]


@pytest.mark.parametrize("elastic", [False, True])
def test_a_sigterm_during_the_health_check_is_handled_at_once(elastic: bool) -> None:
    m = AgentMachine(settings(health_check=True, elastic=elastic))
    m.start(0.0)
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 1.0)
    (leave,) = [e for e in eff if isinstance(e, st.Send)]
    assert isinstance(leave.msg, Leave)
    if elastic:
        # A drain: the server answers a Leave before any Join at once, and nothing goes on.
        assert m.phase is st.Phase.LEAVING
        eff = m.handle(st.ServerSent(Left(job_continues=False, reason="this node had not joined a job")), 1.1)
    (ex,) = [e for e in eff if isinstance(e, st.Exit)]
    assert ex.code == st.EXIT_FAILED and "SIGTERM" in ex.reason
    # The check finishing afterwards joins nothing.
    assert m.handle(st.HealthCheckDone(ok=True), 2.0) == []
