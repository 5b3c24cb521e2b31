"""The agent's decisions, deterministic: events in, effects out, a fake clock."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from node_agent.machine.events import DumpStacks, WriteStop
from node_agent.machine.training import Training
from node_agent.machine.watch import HangPolicy
from protocol import (
    MAX_TEXT_LEN,
    Assignment,
    Drain,
    Error,
    Failure,
    GoingAway,
    JobDone,
    JobFailed,
    Leave,
    Left,
    Restart,
    Resumed,
    Waiting,
    Welcome,
    WorkersFailed,
    WorkersSucceeded,
)


def settings(**kw: object) -> st.AgentSettings:
    base: dict[str, object] = dict(
        node_id="n1", addr="10.0.0.1", join_timeout=10.0, exit_barrier_timeout=30.0, shutdown_timeout=5.0
    )
    base.update(kw)
    return st.AgentSettings(**base)  # type: ignore[arg-type]


def assignment(round: int = 0, restart_count: int = 0) -> Assignment:
    return Assignment(
        job_id="j",
        round=round,
        group_rank=0,
        group_world_size=2,
        rank_offset=0,
        world_size=4,
        master_addr="10.0.0.1",
        master_port=29501,
        restart_count=restart_count,
        max_restarts=3,
    )


def failure(ts: float = 5.0) -> Failure:
    return Failure(node_id="n1", addr="10.0.0.1", rank=1, local_rank=1, exitcode=3, timestamp=ts)


def kinds(effects: list[st.Effect]) -> list[type]:
    return [type(e) for e in effects if not isinstance(e, st.Log)]


def running(m: AgentMachine | None = None) -> AgentMachine:
    m = m or AgentMachine(settings())
    assert kinds(m.start(0.0)) == [st.SendJoin]
    assert kinds(m.handle(st.ServerSent(assignment()), 1.0)) == [st.StartWorkers]
    m.handle(st.WorkersStarted((11, 12)), 1.0)
    assert m.phase is st.Phase.RUNNING
    return m


def test_success_goes_through_exit_barrier() -> None:
    m = running()
    eff = m.handle(st.WorkersExited(None), 2.0)
    sent = [e.msg for e in eff if isinstance(e, st.Send)]
    assert sent == [WorkersSucceeded(round=0)]
    assert m.phase is st.Phase.BARRIER
    (ex,) = m.handle(st.ServerSent(JobDone()), 3.0)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK


def test_exit_barrier_times_out_successfully() -> None:
    m = running()
    m.handle(st.WorkersExited(None), 2.0)
    assert m.handle(st.Tick(), 31.0) == []
    (ex,) = m.handle(st.Tick(), 32.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK and "barrier" in ex.reason


def test_own_failure_reports_then_waits_for_verdict_restart() -> None:
    m = running()
    eff = m.handle(st.WorkersExited(failure(), (failure(),)), 5.0)
    assert kinds(eff) == [st.Send, st.StopWorkers]
    assert isinstance(eff[0], st.Send) and isinstance(eff[0].msg, WorkersFailed)
    # the server's verdict may arrive before our workers are down
    m.handle(st.ServerSent(Restart(round=0, reason="worker failure", restart_count=1)), 5.1)
    assert m.phase is st.Phase.STOPPING
    assert kinds(m.handle(st.WorkersStopped(), 5.2)) == [st.SendJoin]
    assert m.phase is st.Phase.JOINING
    assert kinds(m.handle(st.ServerSent(assignment(1, 1)), 5.3)) == [st.StartWorkers]


def test_own_failure_then_job_failed_exits_with_root_cause() -> None:
    m = running()
    m.handle(st.WorkersExited(failure(), (failure(),)), 5.0)
    m.handle(st.WorkersStopped(), 5.2)
    assert m.phase is st.Phase.VERDICT
    root = failure(4.0)
    (ex,) = m.handle(st.ServerSent(JobFailed(reason="no restarts left", failure=root)), 5.3)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED
    assert ex.failure == root and ex.local_failures == (failure(),)


def test_restart_from_server_stops_and_rejoins() -> None:
    m = running()
    eff = m.handle(st.ServerSent(Restart(round=0, reason="node joined", restart_count=0)), 3.0)
    assert kinds(eff) == [st.StopWorkers]
    # a worker dying of our SIGTERM is not reported as a failure
    assert m.handle(st.WorkersExited(failure(), (failure(),)), 3.1) == []
    assert kinds(m.handle(st.WorkersStopped(), 3.2)) == [st.SendJoin]


def test_restart_at_barrier_rejoins_without_stopping() -> None:
    m = running()
    m.handle(st.WorkersExited(None), 2.0)
    eff = m.handle(st.ServerSent(Restart(round=0, reason="rank 3 failed", restart_count=1)), 3.0)
    assert kinds(eff) == [st.SendJoin]


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


def test_sigterm_forwards_and_exits_after_stop() -> None:
    m = running()
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    # workers get the signal first, then the server hears we are about to leave
    assert kinds(eff) == [st.StopWorkers, st.Send]
    stop, notice = eff
    assert isinstance(stop, st.StopWorkers) and stop.signum == signal.SIGTERM and stop.grace == 5.0
    assert isinstance(notice, st.Send) and notice.msg == Leave(
        reason="agent received SIGTERM", workers_stopping=True
    )
    # a second signal escalates
    assert kinds(m.handle(st.SignalReceived(signal.SIGINT), 3.1)) == [st.ForwardSignal]
    # our Leave goes once the workers are down
    leave, ex = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(leave, st.Send) and leave.msg == Leave(reason="agent received SIGTERM")
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "SIGTERM" in ex.reason


def test_sigusr1_is_forwarded_to_workers() -> None:
    m = running()
    assert m.handle(st.SignalReceived(signal.SIGUSR1), 2.0) == [st.ForwardSignal(signal.SIGUSR1)]


def test_connection_lost_stops_workers_then_exits_nonzero() -> None:
    m = running()
    assert kinds(m.handle(st.ConnectionLost("reset"), 2.0)) == [st.StopWorkers]
    (ex,) = m.handle(st.WorkersStopped(), 2.5)
    assert isinstance(ex, st.Exit) and ex.code != 0 and "reset" in ex.reason


def test_server_error_while_joining_exits_with_its_message() -> None:
    m = AgentMachine(settings())
    m.start(0.0)
    (ex,) = m.handle(st.ServerSent(Error(code="job_mismatch", message="node range differs")), 0.1)
    assert isinstance(ex, st.Exit) and ex.code != 0 and "node range differs" in ex.reason


def test_spawn_failure_is_reported_as_worker_failure() -> None:
    m = AgentMachine(settings())
    m.start(0.0)
    m.handle(st.ServerSent(assignment()), 0.5)
    eff = m.handle(st.WorkersStartFailed("no such file: train.py"), 0.6)
    (send,) = [e for e in eff if isinstance(e, st.Send)]
    assert isinstance(send.msg, WorkersFailed) and "train.py" in send.msg.failure.message
    assert m.phase is st.Phase.VERDICT


def test_an_assignment_we_did_not_join_for_is_the_servers_protocol_error() -> None:
    m = running()
    eff = m.handle(st.ServerSent(assignment(1)), 2.0)
    assert kinds(eff) == [st.StopWorkers]
    (note,) = [e for e in eff if isinstance(e, st.Log)]
    assert note.level == "error" and "protocol error by the rendezvous server" in note.text
    assert (
        "an assignment for round 1, but this node did not join for one (it was running round 0)" in note.text
    )
    (ex,) = m.handle(st.WorkersStopped(), 2.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_RDZV and "round 1" in ex.reason
    # the same assignment again is harmless: said, and ignored
    m = running()
    (note,) = m.handle(st.ServerSent(assignment(0)), 2.0)
    assert isinstance(note, st.Log) and "again; ignored" in note.text and m.phase is st.Phase.RUNNING


def test_an_unknown_event_is_our_own_bug() -> None:
    with pytest.raises(st.UnexpectedEvent, match="unknown event"):
        running().handle("not an event", 2.0)  # type: ignore[arg-type]


def test_sigterm_in_elastic_job_drains_and_exits_zero_when_the_job_goes_on() -> None:
    m = running(AgentMachine(settings(elastic=True)))
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert kinds(eff) == [st.StopWorkers, st.Send]
    # the server hears at once that we leave once our workers are down (it restarts the others)
    assert isinstance(eff[-1], st.Send) and eff[-1].msg == Leave(
        reason="drain: received SIGTERM", workers_stopping=True
    )
    # our Leave itself waits for the workers: the next round must not start while they live
    (leave,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(leave, st.Send) and leave.msg == Leave(reason="drain: received SIGTERM")
    assert m.phase is st.Phase.LEAVING
    (ex,) = m.handle(st.ServerSent(Left(job_continues=True, reason="1 node(s) remain")), 3.55)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK
    assert "drained" in ex.reason and "goes on without this node (1 node(s) remain)" in ex.reason
    # the server closes our connection once we have left: expected, not an error
    assert m.handle(st.ConnectionLost("closed"), 3.6) == []


def test_an_older_server_that_answers_the_notice_as_the_leave_itself() -> None:
    # It drops us at once, answers Left and closes: we exit with its answer once the workers are down.
    m = running(AgentMachine(settings(elastic=True, reconnect_timeout=30.0)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert m.handle(st.ServerSent(Left(job_continues=True, reason="1 node(s) remain")), 3.05) == []
    assert m.handle(st.ConnectionLost("closed"), 3.1) == []  # no reconnect: our course is set
    (ex,) = m.handle(st.WorkersStopped(), 3.5)  # and no second Leave
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK and "1 node(s) remain" in ex.reason


def test_sigterm_to_the_last_node_of_an_elastic_job_exits_as_torchrun() -> None:
    m = running(AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.ServerSent(Left(job_continues=False, reason="this node was the last of the job")), 3.05)
    m.handle(st.ConnectionLost("closed"), 3.1)
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED == 1  # torchrun's SignalException
    assert "does not go on without this node (this node was the last of the job)" in ex.reason


def test_a_drain_answered_after_the_workers_stopped_waits_in_leaving() -> None:
    m = running(AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert kinds(m.handle(st.WorkersStopped(), 3.5)) == [st.Send]
    assert m.phase is st.Phase.LEAVING and m.next_deadline() == 3.5 + st.LEAVE_ANSWER_TIMEOUT
    # an assignment that crossed our Leave changes nothing
    assert m.handle(st.ServerSent(assignment(1)), 3.6) == []
    (ex,) = m.handle(st.ServerSent(Left(job_continues=True)), 3.7)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK


def test_a_drain_without_an_answer_is_conservative() -> None:
    # The connection closes first (an older server sends no Left): not known to go on.
    m = running(AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert m.handle(st.ConnectionLost("the server closed the connection"), 3.1) == []
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "closed" in ex.reason
    # No answer and no close at all (a server that stopped answering): the wait is bounded.
    m = running(AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.WorkersStopped(), 3.5)
    assert m.handle(st.Tick(), 3.5 + st.LEAVE_ANSWER_TIMEOUT - 0.1) == []
    (ex,) = m.handle(st.Tick(), 3.5 + st.LEAVE_ANSWER_TIMEOUT)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "did not answer" in ex.reason
    # A second SIGTERM while waiting exits at once, still non-zero.
    m = running(AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.WorkersStopped(), 3.5)
    (ex,) = m.handle(st.SignalReceived(signal.SIGTERM), 4.0)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED


def test_a_drain_while_the_server_is_unreachable_asks_it_once_it_is_back() -> None:
    m = running(AgentMachine(settings(elastic=True, reconnect_timeout=30.0)))
    assert kinds(m.handle(st.ConnectionLost("reset"), 2.0)) == [st.Reconnect]
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert kinds(eff) == [st.StopWorkers]  # nothing to send it to
    assert m.handle(st.WorkersStopped(), 3.5) == []
    assert m.phase is st.Phase.LEAVING and m.next_deadline() is None  # the reconnect window bounds it
    assert kinds(m.handle(st.Reconnected(), 4.0)) == [st.SendResume]  # our place back first
    assert m.next_deadline() == 4.0 + st.LEAVE_ANSWER_TIMEOUT
    eff = m.handle(st.ServerSent(Resumed(job_id="j", round=0)), 4.1)
    assert sent(eff) == [Leave(reason="drain: received SIGTERM")]  # then leave it
    assert m.next_deadline() == 4.1 + st.LEAVE_ANSWER_TIMEOUT
    (ex,) = m.handle(st.ServerSent(Left(job_continues=True, reason="1 node(s) remain")), 4.2)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK
    # Never back: nobody confirmed that the job goes on without us.
    m = running(AgentMachine(settings(elastic=True, reconnect_timeout=30.0)))
    m.handle(st.ConnectionLost("reset"), 2.0)
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.WorkersStopped(), 3.5)
    (ex,) = m.handle(st.ReconnectFailed("connection refused"), 32.0)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "unreachable" in ex.reason


def test_sigterm_while_joining_or_at_the_barrier_waits_for_the_answer() -> None:
    m = AgentMachine(settings(elastic=True))
    m.start(0.0)
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 1.0)
    assert kinds(eff) == [st.Send] and m.phase is st.Phase.LEAVING
    (ex,) = m.handle(st.ServerSent(Left(job_continues=False, reason="only 1 node(s) remain")), 1.1)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED
    # At the exit barrier our part is done; the job finishing first answers as well as Left.
    m = running(AgentMachine(settings(elastic=True)))
    m.handle(st.WorkersExited(None), 2.0)
    assert kinds(m.handle(st.SignalReceived(signal.SIGTERM), 3.0)) == [st.Send]
    (ex,) = m.handle(st.ServerSent(JobDone()), 3.1)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK
    assert m.handle(st.ServerSent(Left(job_continues=True, reason="the job finished")), 3.2) == []


def test_the_job_failing_while_draining_reports_the_jobs_failure() -> None:
    m = running(AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.ServerSent(JobFailed(reason="rank 3 failed; no restarts left", failure=failure())), 3.1)
    m.handle(st.ServerSent(Left(job_continues=False, reason="the job failed")), 3.2)
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "rank 3 failed" in ex.reason


def test_sigterm_in_a_fixed_size_job_exits_nonzero_whatever_the_server_answers() -> None:
    m = running()  # elastic=False
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert kinds(eff) == [st.StopWorkers, st.Send]
    # (an older server, or the static backend, answers the notice as a Leave)
    assert m.handle(st.ServerSent(Left(job_continues=True, reason="a spare took its place")), 3.1) == []
    assert kinds(m.handle(st.WorkersStopped(), 3.5)) == [st.Send, st.Exit]
    m = running()
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    _, ex = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "received SIGTERM" in ex.reason


def test_drain_message_from_server_is_a_clean_leave() -> None:
    from protocol import Drain

    m = running()
    eff = m.handle(st.ServerSent(Drain(reason="maintenance")), 3.0)
    assert kinds(eff) == [st.StopWorkers, st.Send]
    assert m.handle(st.ServerSent(Drain(reason="again")), 3.1) == []
    assert kinds(m.handle(st.WorkersStopped(), 3.5)) == [st.Send]
    (ex,) = m.handle(st.ServerSent(Left(job_continues=True, reason="a spare took its place")), 3.6)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK and "maintenance" in ex.reason


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


def test_first_reason_to_exit_wins_over_the_connection_closing() -> None:
    m = running()
    m.handle(st.WorkersExited(failure(), (failure(),)), 5.0)
    m.handle(st.ServerSent(Error(code="excluded", message="node n1 is excluded: failed 2 times")), 5.1)
    m.handle(st.ConnectionLost("the server closed the connection"), 5.1)
    (ex,) = m.handle(st.WorkersStopped(), 5.2)
    assert isinstance(ex, st.Exit) and "excluded" in ex.reason


def test_server_going_away_keeps_workers_and_the_lost_connection_reconnects() -> None:
    from protocol import GoingAway

    m = running(AgentMachine(settings(reconnect_timeout=30.0)))
    effects = m.handle(st.ServerSent(GoingAway(reason="received SIGTERM")), 2.0)
    assert kinds(effects) == []
    assert any("going away (received SIGTERM); workers keep running" in e.text for e in effects)
    assert kinds(m.handle(st.ConnectionLost("closed"), 2.1)) == [st.Reconnect]
    assert kinds(m.handle(st.Reconnected(), 3.0)) == [st.SendResume]
    (note,) = m.handle(st.ServerSent(Resumed(job_id="j", round=0, rebuilt=False)), 3.1)
    assert isinstance(note, st.Log) and "the server kept it" in note.text
    assert m.phase is st.Phase.RUNNING


def test_a_non_fatal_server_error_is_logged_not_fatal() -> None:
    m = AgentMachine(settings(reconnect_timeout=30.0))
    m.start(0.0)
    msg = Error(code="server_draining", message="the server is shutting down", fatal=False)
    (note,) = m.handle(st.ServerSent(msg), 0.1)
    assert isinstance(note, st.Log) and "server_draining" in note.text
    assert m.phase is st.Phase.JOINING


def test_the_job_finishing_while_our_workers_stop_for_a_drain_is_a_success() -> None:
    m = running(AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert m.handle(st.ServerSent(JobDone()), 3.1) == []
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK and ex.reason == "all nodes finished"


# --- a lost connection, in every phase ------------------------------------------------------
#
# With a reconnect window every phase rides out a lost connection and picks up what it was
# doing once back; what the workers do meanwhile is each test's first assertion.


def rejoining() -> AgentMachine:
    return running(AgentMachine(settings(reconnect_timeout=30.0)))


def sent(effects: list[st.Effect]) -> list[object]:
    return [e.msg for e in effects if isinstance(e, st.Send)]


def test_a_restart_cut_off_by_the_server_going_away_finishes_stopping_then_joins_once_back() -> None:
    from protocol import GoingAway

    m = rejoining()
    m.handle(st.ServerSent(Restart(round=0, reason="node n3 joined", restart_count=0)), 2.0)
    assert m.phase is st.Phase.STOPPING
    (note,) = m.handle(st.ServerSent(GoingAway(reason="received SIGTERM")), 2.1)
    assert (
        isinstance(note, st.Log) and "workers are being stopped; this node joins the next round" in note.text
    )
    eff = m.handle(st.ConnectionLost("the server closed the connection"), 2.2)
    assert kinds(eff) == [st.Reconnect]  # the workers go on stopping, nobody exits
    # Back before the workers are down: the join waits for them.
    assert kinds(m.handle(st.Reconnected(), 3.0)) == []
    assert kinds(m.handle(st.WorkersStopped(), 3.5)) == [st.SendJoin]
    assert kinds(m.handle(st.ServerSent(assignment(1)), 4.0)) == [st.StartWorkers]


def test_a_restart_queued_behind_a_frozen_agent_ends_in_a_rejoin_once_it_is_back() -> None:
    # SIGSTOP past the heartbeat timeout: the server dropped us, but a Restart it sent first
    # is still in our socket. SIGCONT: we read it, then the closed connection.
    m = rejoining()
    assert kinds(m.handle(st.ServerSent(Restart(round=0, reason="rank 2 failed", restart_count=1)), 9.0)) == [
        st.StopWorkers
    ]
    assert kinds(m.handle(st.ConnectionLost("connection reset"), 9.0)) == [st.Reconnect]
    # Workers down while still away: joining, once there is someone to join.
    assert m.handle(st.WorkersStopped(), 9.5) == []
    assert m.phase is st.Phase.JOINING and m.next_deadline() == 9.5 + 10.0
    assert kinds(m.handle(st.Reconnected(), 10.0)) == [st.SendJoin]


def test_our_failure_waiting_for_its_verdict_is_reported_again_once_back() -> None:
    m = rejoining()
    first = m.handle(st.WorkersExited(failure(), (failure(),)), 5.0)
    report = WorkersFailed(round=0, failure=failure())
    assert sent(first) == [report]
    m.handle(st.WorkersStopped(), 5.2)
    assert m.phase is st.Phase.VERDICT
    (note, reconnect) = m.handle(st.ConnectionLost("reset"), 5.3)
    assert isinstance(reconnect, st.Reconnect) and "their failure is reported again" in note.text
    eff = m.handle(st.Reconnected(), 6.0)
    # Take the round back, then report: the server's answer is the verdict.
    assert kinds(eff) == [st.SendResume]
    resume = eff[1]
    assert isinstance(resume, st.SendResume) and resume.assignment == assignment() and not resume.succeeded
    assert sent(m.handle(st.ServerSent(Resumed(job_id="j", round=0)), 6.1)) == [report]
    assert m.phase is st.Phase.VERDICT
    assert kinds(
        m.handle(st.ServerSent(Restart(round=0, reason="worker failure", restart_count=1)), 6.2)
    ) == [st.SendJoin]


def test_our_failure_already_decided_before_the_server_restarted() -> None:
    # The server had restarted the round (our member waits to re-join): its Restart answers our
    # Resume, and is the verdict: nothing is reported again.
    m = rejoining()
    m.handle(st.WorkersExited(failure(), (failure(),)), 5.0)
    m.handle(st.ConnectionLost("reset"), 5.1)
    assert kinds(m.handle(st.Reconnected(), 6.0)) == [st.SendResume]
    restart = Restart(round=0, reason="stopped while the server restarted", restart_count=1)
    assert kinds(m.handle(st.ServerSent(restart), 6.1)) == []  # still stopping: the join follows
    assert kinds(m.handle(st.WorkersStopped(), 6.2)) == [st.SendJoin]
    # After a verdict nothing is reported again.
    m.handle(st.ConnectionLost("reset"), 6.3)
    assert kinds(m.handle(st.Reconnected(), 7.0)) == [st.SendJoin]


def test_a_worker_failure_while_the_server_is_unreachable_is_reported_when_it_is_back() -> None:
    m = rejoining()
    m.handle(st.ConnectionLost("reset"), 4.0)
    eff = m.handle(st.WorkersExited(failure(), (failure(),)), 5.0)
    assert kinds(eff) == [st.StopWorkers]  # nobody to tell yet; the workers stop as for any failure
    assert any(isinstance(e, st.Log) and "reported once reconnected" in e.text for e in eff)
    assert m.handle(st.WorkersStopped(), 5.2) == []
    assert m.phase is st.Phase.VERDICT
    assert kinds(m.handle(st.Reconnected(), 8.0)) == [st.SendResume]
    eff = m.handle(st.ServerSent(Resumed(job_id="j", round=0)), 8.05)
    assert sent(eff) == [WorkersFailed(round=0, failure=failure())]
    root = failure(4.5)
    (ex,) = m.handle(st.ServerSent(JobFailed(reason="no restarts left", failure=root)), 8.1)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and ex.failure == root


def test_what_only_a_node_of_the_round_may_say_waits_for_the_answer_to_our_resume() -> None:
    m = rejoining()
    m.handle(st.ConnectionLost("reset"), 4.0)
    assert kinds(m.handle(st.Reconnected(), 5.0)) == [st.SendResume]
    # The workers fail before the server answers: if it dropped us, a report would be refused.
    assert kinds(m.handle(st.WorkersExited(failure(), (failure(),)), 5.1)) == [st.StopWorkers]
    assert sent(m.handle(st.ServerSent(Resumed(job_id="j", round=0)), 5.2)) == [
        WorkersFailed(round=0, failure=failure())
    ]
    # A draining server answers a Resume with a non-fatal error, then closes: we come back.
    m = rejoining()
    m.handle(st.ConnectionLost("reset"), 4.0)
    m.handle(st.Reconnected(), 5.0)
    draining = Error(code="server_draining", message="the server is shutting down", fatal=False)
    assert kinds(m.handle(st.ServerSent(draining), 5.1)) == []
    assert kinds(m.handle(st.ConnectionLost("closed"), 5.2)) == [st.Reconnect]
    assert kinds(m.handle(st.Reconnected(), 6.0)) == [st.SendResume]


def test_a_success_while_the_server_is_unreachable_is_said_by_the_resume() -> None:
    m = rejoining()
    m.handle(st.ConnectionLost("reset"), 4.0)
    assert kinds(m.handle(st.WorkersExited(None), 5.0)) == []
    assert m.phase is st.Phase.BARRIER
    (_, resume) = m.handle(st.Reconnected(), 6.0)
    assert isinstance(resume, st.SendResume) and resume.succeeded
    (ex,) = m.handle(st.ServerSent(JobDone()), 6.1)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK


def test_a_drain_cut_off_mid_stop_resumes_its_place_and_leaves_once_the_workers_are_down() -> None:
    m = running(AgentMachine(settings(elastic=True, reconnect_timeout=30.0)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    (note, reconnect) = m.handle(st.ConnectionLost("reset"), 3.1)
    assert isinstance(reconnect, st.Reconnect) and "stopped for the drain" in note.text
    # Our place back (the server counts us until our Leave), and the notice again.
    assert kinds(m.handle(st.Reconnected(), 3.5)) == [st.SendResume]
    eff = m.handle(st.ServerSent(Resumed(job_id="j", round=0)), 3.6)
    assert sent(eff) == [Leave(reason="drain: received SIGTERM", workers_stopping=True)]
    assert sent(m.handle(st.WorkersStopped(), 4.0)) == [Leave(reason="drain: received SIGTERM")]
    (ex,) = m.handle(st.ServerSent(Left(job_continues=True, reason="1 node(s) remain")), 4.1)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK


def test_a_leave_cut_off_before_its_answer_is_asked_again() -> None:
    m = running(AgentMachine(settings(elastic=True, reconnect_timeout=30.0)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.WorkersStopped(), 3.5)
    assert m.phase is st.Phase.LEAVING
    assert kinds(m.handle(st.ConnectionLost("reset"), 3.6)) == [st.Reconnect]
    assert m.next_deadline() is None  # no answer can come before we are back
    assert kinds(m.handle(st.Reconnected(), 4.0)) == [st.SendResume]
    # A server that had dropped us: "join again"; our Leave goes all the same...
    join_again = Restart(round=0, reason="the server dropped node n1 while it was away", restart_count=0)
    assert sent(m.handle(st.ServerSent(join_again), 4.1)) == [Leave(reason="drain: received SIGTERM")]
    # ...and is the Leave of a node not in its job: conservative.
    (ex,) = m.handle(st.ServerSent(Left(job_continues=False, reason="this node had not joined a job")), 4.2)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "had not joined" in ex.reason
    # Drained while joining: no round to take back; the new connection says which node it is
    # (a Join) before the Leave, so the server answers for this node, not for a stranger.
    m = AgentMachine(settings(elastic=True, reconnect_timeout=30.0))
    m.start(0.0)
    m.handle(st.SignalReceived(signal.SIGTERM), 1.0)
    m.handle(st.ConnectionLost("reset"), 1.1)
    effects = m.handle(st.Reconnected(), 2.0)
    assert kinds(effects) == [st.SendJoin, st.Send]
    assert isinstance(effects[-1], st.Send) and isinstance(effects[-1].msg, Leave)


@pytest.mark.parametrize(
    ("phase", "code"),
    [
        ("joining", st.EXIT_RDZV),
        ("starting", st.EXIT_RDZV),
        ("running", st.EXIT_RDZV),
        ("stopping to rejoin", st.EXIT_RDZV),
        ("stopping after our failure", st.EXIT_FAILED),
        ("verdict", st.EXIT_FAILED),
        ("barrier", st.EXIT_OK),
        ("stopping to leave", st.EXIT_FAILED),
        ("leaving", st.EXIT_FAILED),
    ],
)
def test_every_phase_reconnects_and_exits_when_the_window_closes(phase: str, code: int) -> None:
    m = in_phase(phase, elastic=True)
    eff = m.handle(st.ConnectionLost("reset"), 20.0)
    assert kinds(eff) == [st.Reconnect], phase  # nobody exits, nothing stops that was not stopping
    assert not any(isinstance(e, st.Send) for e in m.handle(st.WorkersStopped(), 20.5))
    eff = m.handle(st.ReconnectFailed("connection refused"), 50.0)
    eff += m.handle(st.WorkersStopped(), 50.5)
    assert not any(isinstance(e, st.Send | st.SendJoin | st.SendResume) for e in eff)
    (ex,) = [e for e in eff if isinstance(e, st.Exit)]
    assert ex.code == code and m.phase is st.Phase.EXITED


def test_an_agent_on_its_way_out_does_not_reconnect() -> None:
    m = rejoining()
    m.handle(st.ServerSent(JobFailed(reason="rank 3 failed; no restarts left")), 3.0)
    assert m.handle(st.ConnectionLost("closed"), 3.1) == []
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and "rank 3 failed" in ex.reason
    m = rejoining()
    m.handle(st.SignalReceived(signal.SIGINT), 3.0)
    assert m.handle(st.ConnectionLost("closed"), 3.1) == []
    eff = m.handle(st.WorkersStopped(), 3.5)
    assert kinds(eff) == [st.Exit]  # the Leave has nowhere to go


# --- every server message in every phase ----------------------------------------------------


def in_phase(name: str, *, elastic: bool = False, link: str = "up") -> AgentMachine:
    """A machine brought to a phase by the events that lead there; its connection ``up``,
    lost (``away``), or back with our Resume not yet answered (``resuming``)."""
    training = Training(policy=HangPolicy.parse("off"), nproc=1, node_id="n1", addr="10.0.0.1", interval=1.0)
    m = AgentMachine(settings(elastic=elastic, reconnect_timeout=30.0), training=training)
    m.start(0.0)
    steps: dict[str, list[st.Event]] = {
        "joining": [],
        "spare": [
            st.ServerSent(
                Waiting(job_id="j", round=0, joined=2, min_nodes=2, max_nodes=2, reason="full", spare=True)
            )
        ],
        "starting": [st.ServerSent(assignment())],
        "running": [st.ServerSent(assignment()), st.WorkersStarted((11,))],
        "stopping to rejoin": [
            st.ServerSent(assignment()),
            st.WorkersStarted((11,)),
            st.ServerSent(Restart(round=0, reason="r", restart_count=0)),
        ],
        "stopping after our failure": [
            st.ServerSent(assignment()),
            st.WorkersStarted((11,)),
            st.WorkersExited(failure(), (failure(),)),
        ],
        "verdict": [
            st.ServerSent(assignment()),
            st.WorkersStarted((11,)),
            st.WorkersExited(failure(), (failure(),)),
            st.WorkersStopped(),
        ],
        "barrier": [st.ServerSent(assignment()), st.WorkersStarted((11,)), st.WorkersExited(None)],
        "stopping to leave": [
            st.ServerSent(assignment()),
            st.WorkersStarted((11,)),
            st.ServerSent(Drain(reason="maintenance")),
        ],
        "stopping to exit": [
            st.ServerSent(assignment()),
            st.WorkersStarted((11,)),
            st.SignalReceived(signal.SIGINT),
        ],
        "leaving": [
            st.ServerSent(assignment()),
            st.WorkersStarted((11,)),
            st.ServerSent(Drain(reason="maintenance")),
            st.WorkersStopped(),
        ],
        "leaving while joining": [st.ServerSent(Drain(reason="maintenance"))],
    }
    for i, event in enumerate(steps[name]):
        m.handle(event, 1.0 + i / 10)
    if link in ("away", "resuming"):
        m.handle(st.ConnectionLost("reset"), 2.0)
    if link == "resuming":
        m.handle(st.Reconnected(), 2.5)
    return m


PHASES = [
    "joining",
    "spare",
    "starting",
    "running",
    "stopping to rejoin",
    "stopping after our failure",
    "verdict",
    "barrier",
    "stopping to leave",
    "stopping to exit",
    "leaving",
    "leaving while joining",
]


def server_messages() -> list[object]:
    from protocol import SERVER_MESSAGES, CollectStacks, GoingAway, Resumed, StopAt, Welcome

    msgs = [
        Welcome(version=1, software="s"),
        Waiting(job_id="j", round=1, joined=1, min_nodes=2, max_nodes=2),
        assignment(0),
        assignment(1, 1),
        Restart(round=0, reason="r", restart_count=1),
        JobFailed(reason="no restarts left", failure=failure()),
        JobDone(),
        Drain(reason="maintenance"),
        Error(code="job_mismatch", message="refused"),
        Error(code="server_draining", message="later", fatal=False),
        Resumed(job_id="j", round=0),
        Resumed(job_id="j", round=0, rebuilt=True),
        GoingAway(reason="upgrade"),
        Left(job_continues=True, reason="goes on"),
        Left(job_continues=False, reason="does not"),
        CollectStacks(round=0, reason="rank 3 hung"),
        JobFailed(reason="3 restarts in a row made no step progress", code="crash_loop"),
        StopAt(round=0, step=50, state="arm"),
        StopAt(round=0, step=50, state="go"),
        StopAt(round=0, step=50, state="cancel"),
        StopAt(round=7, step=50, state="arm"),
    ]
    assert {type(m) for m in msgs} == set(SERVER_MESSAGES.values())  # none forgotten
    return msgs


@pytest.mark.parametrize("link", ["up", "away", "resuming"])
@pytest.mark.parametrize("phase", PHASES)
def test_every_server_message_in_every_phase_has_a_defined_outcome(phase: str, link: str) -> None:
    for msg in server_messages():
        m = in_phase(phase, elastic=phase != "stopping to exit", link=link)
        before = m.phase
        eff = m.handle(st.ServerSent(msg), 3.0)  # type: ignore[arg-type]
        for e in eff:
            assert isinstance(
                e,
                st.SendJoin | st.Send | st.SendResume | st.StartWorkers | st.StopWorkers | st.Log | st.Exit,
            ) or (isinstance(e, WriteStop | DumpStacks) and before is st.Phase.RUNNING), (phase, msg, e)
            if isinstance(e, st.Exit):
                assert e.reason and m.phase is st.Phase.EXITED
        for e in eff:
            if isinstance(e, st.Log) and "protocol error" in e.text:
                assert e.level == "error"
        if isinstance(msg, Assignment) and before is not st.Phase.JOINING and msg != assignment(0):
            # An assignment we did not join for: the server's mistake, said, and fatal.
            assert m.phase in (st.Phase.STOPPING, st.Phase.EXITED) or before is st.Phase.LEAVING, (phase, msg)
        # Whatever it was, the machine still ends: workers stop, the last deadlines pass.
        m.handle(st.WorkersStopped(), 4.0)
        m.handle(st.ConnectionLost("closed"), 4.5)
        m.handle(st.ReconnectFailed("refused"), 40.0)
        m.handle(st.WorkersStopped(), 41.0)
        m.handle(st.Tick(), 1000.0)
        assert m.phase is st.Phase.EXITED, (phase, msg, m.phase)


def test_the_job_done_while_our_workers_run_stops_them_and_exits_nonzero() -> None:
    # The server finishes a job without a node only after dropping it (frozen past the
    # heartbeat timeout): the node's Resume is answered JobDone.
    m = running()
    eff = m.handle(st.ServerSent(JobDone()), 2.0)
    assert kinds(eff) == [st.StopWorkers]
    (note,) = [e for e in eff if isinstance(e, st.Log)]
    assert note.level == "error" and "the job finished while this node was running round 0" in note.text
    (ex,) = m.handle(st.WorkersStopped(), 2.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED
    assert ex.reason == "the job finished without this node (it was running round 0)"


# --- what the server says is checked against what this node was started with (issue 17) ----


def checking(**kw: object) -> AgentMachine:
    """A machine that knows its job, budget and node range, as the runner builds it."""
    base: dict[str, object] = dict(job_id="j", max_restarts=3, min_nodes=2, max_nodes=2, nproc=2)
    base.update(kw)
    m = AgentMachine(settings(**base))
    m.start(0.0)
    return m


def refused(m: AgentMachine, a: Assignment) -> st.Exit:
    eff = m.handle(st.ServerSent(a), 1.0)
    assert not any(isinstance(e, st.StartWorkers) for e in eff), eff  # no worker runs for it
    (ex,) = [e for e in eff if isinstance(e, st.Exit)]
    assert ex.code == st.EXIT_RDZV and m.phase is st.Phase.EXITED
    return ex


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"job_id": "other"}, "an assignment for job 'other', but this node runs job 'j'"),
        ({"restart_count": 4}, "restart 4, past this node's budget (--max-restarts 3)"),
        ({"max_restarts": 100}, "says --max-restarts 100, but this node has --max-restarts 3"),
        ({"group_world_size": 3, "world_size": 6}, "a round of 3 nodes, but this node has --nnodes 2"),
        ({"world_size": 3, "rank_offset": 2}, "ranks 2-3 of this node's 2 worker(s) in a world size 3"),
    ],
)
def test_an_assignment_that_contradicts_this_nodes_config_is_refused(changes: dict, says: str) -> None:
    ex = refused(checking(), dataclasses.replace(assignment(), **changes))
    assert says in ex.reason and "broke the protocol" in ex.reason


def test_the_assignment_a_node_expects_is_accepted() -> None:
    m = checking()
    assert kinds(m.handle(st.ServerSent(assignment(restart_count=3)), 1.0)) == [st.StartWorkers]


def test_a_restart_past_the_budget_stops_the_workers_and_exits() -> None:
    m = running(checking())
    eff = m.handle(st.ServerSent(Restart(round=0, reason="again", restart_count=4)), 2.0)
    assert kinds(eff) == [st.StopWorkers] and eff[-1].signum == signal.SIGTERM  # type: ignore[union-attr]
    (ex,) = m.handle(st.WorkersStopped(), 3.0)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_RDZV and "--max-restarts 3" in ex.reason
    # within the budget, the restart goes on as usual
    m = running(checking())
    eff = m.handle(st.ServerSent(Restart(round=0, reason="again", restart_count=3)), 2.0)
    assert kinds(eff) == [st.StopWorkers]
    assert kinds(m.handle(st.WorkersStopped(), 3.0)) == [st.SendJoin]


def test_a_verdict_that_never_comes_ends_at_the_join_timeout() -> None:
    m = running()  # join_timeout 10
    m.handle(st.WorkersExited(failure()), 2.0)
    m.handle(st.WorkersStopped(), 3.0)
    assert m.phase is st.Phase.VERDICT and m.next_deadline() == 13.0
    assert m.handle(st.Tick(), 12.9) == []
    (ex,) = m.handle(st.Tick(), 13.0)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED
    assert "did not answer the report of this node's worker failure of round 0 within 10 s" in ex.reason
    assert ex.local_failures  # the failure is still what the person reads about


def test_the_verdict_wait_pauses_while_away_and_starts_again_once_back() -> None:
    m = running(AgentMachine(settings(reconnect_timeout=30.0)))
    m.handle(st.WorkersExited(failure()), 2.0)
    m.handle(st.WorkersStopped(), 3.0)
    m.handle(st.ConnectionLost("reset"), 4.0)
    assert m.next_deadline() is None  # the reconnect window bounds it now
    m.handle(st.Reconnected(), 20.0)
    assert m.next_deadline() == 30.0
    m.handle(st.ServerSent(Resumed(job_id="j", round=0)), 20.5)
    (ex,) = m.handle(st.Tick(), 30.0)
    assert isinstance(ex, st.Exit) and "no verdict" in ex.reason


def test_a_start_failure_waits_for_its_verdict_no_longer_than_the_join_timeout() -> None:
    m = AgentMachine(settings())
    m.start(0.0)
    m.handle(st.ServerSent(assignment()), 0.5)
    m.handle(st.WorkersStartFailed("no such file"), 1.0)
    assert m.phase is st.Phase.VERDICT and m.next_deadline() == 11.0


def test_a_drain_reason_of_any_length_drains() -> None:
    m = running(AgentMachine(settings(elastic=True)))
    eff = m.handle(st.ServerSent(Drain(reason="x" * MAX_TEXT_LEN)), 2.0)
    assert kinds(eff) == [st.StopWorkers, st.Send]
    (notice,) = sent(eff)
    assert isinstance(notice, Leave) and len(notice.reason) <= MAX_TEXT_LEN
    (note,) = [e for e in eff if isinstance(e, st.Log)]
    assert "more characters" in note.text and len(note.text) < 3000  # said once, cut


def test_server_texts_are_escaped_in_what_the_agent_says() -> None:
    forged = "\n[node-agent] ERROR: forged\x1b[31m\r"
    m = AgentMachine(settings())
    m.start(0.0)
    (note,) = m.handle(
        st.ServerSent(Waiting(job_id="j", round=0, joined=1, min_nodes=2, max_nodes=2, reason=forged)), 1.0
    )
    assert "\\n[node-agent] ERROR: forged\\x1b[31m\\r" in note.text  # type: ignore[union-attr]
    (ex,) = m.handle(st.ServerSent(JobFailed(reason=forged)), 2.0)
    assert isinstance(ex, st.Exit) and "\n" not in ex.reason and "\x1b" not in ex.reason


def test_a_resume_into_another_job_is_refused() -> None:
    m = running(checking(min_nodes=1, max_nodes=2, reconnect_timeout=30.0))
    m.handle(st.ConnectionLost("reset"), 2.0)
    m.handle(st.Reconnected(), 3.0)
    eff = m.handle(st.ServerSent(Resumed(job_id="other", round=0)), 3.5)
    assert kinds(eff) == [st.StopWorkers]
    (ex,) = m.handle(st.WorkersStopped(), 4.0)
    assert isinstance(ex, st.Exit) and "job 'other', but it runs job 'j'" in ex.reason


def test_a_drain_whose_resume_is_never_answered_still_ends() -> None:
    m = running(AgentMachine(settings(elastic=True, reconnect_timeout=30.0)))
    m.handle(st.SignalReceived(signal.SIGTERM), 2.0)  # drain: workers stop, then Leave
    m.handle(st.ConnectionLost("reset"), 2.5)
    m.handle(st.Reconnected(), 3.0)  # Resume out; the server never answers it
    m.handle(st.WorkersStopped(), 4.0)
    assert m.phase is st.Phase.LEAVING and m.next_deadline() == 4.0 + st.LEAVE_ANSWER_TIMEOUT
    (ex,) = m.handle(st.Tick(), 4.0 + st.LEAVE_ANSWER_TIMEOUT)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "did not answer" in ex.reason


def _in_every_phase() -> list[tuple[str, AgentMachine]]:
    """Machines in each phase (and mid-resume), built through their events, checking config."""

    def joining() -> AgentMachine:
        return checking(min_nodes=1, max_nodes=2, reconnect_timeout=30.0, elastic=True)

    def starting() -> AgentMachine:
        m = joining()
        m.handle(st.ServerSent(assignment()), 1.0)
        return m

    def run_() -> AgentMachine:
        m = starting()
        m.handle(st.WorkersStarted((11,)), 1.0)
        return m

    def stopping(after: str) -> AgentMachine:
        m = run_()
        if after == "rejoin":
            m.handle(st.ServerSent(Restart(round=0, reason="r", restart_count=1)), 2.0)
        elif after == "verdict":
            m.handle(st.WorkersExited(failure()), 2.0)
        else:
            m.handle(st.SignalReceived(signal.SIGTERM), 2.0)
        return m

    def verdict() -> AgentMachine:
        m = stopping("verdict")
        m.handle(st.WorkersStopped(), 3.0)
        return m

    def barrier() -> AgentMachine:
        m = run_()
        m.handle(st.WorkersExited(None), 2.0)
        return m

    def leaving() -> AgentMachine:
        m = stopping("leave")
        m.handle(st.WorkersStopped(), 3.0)
        return m

    def resuming(make):  # type: ignore[no-untyped-def]
        def build() -> AgentMachine:
            m = make()
            m.handle(st.ConnectionLost("reset"), 4.0)
            m.handle(st.Reconnected(), 4.5)
            return m

        return build

    makers = {
        "joining": joining,
        "starting": starting,
        "running": run_,
        "stopping-rejoin": lambda: stopping("rejoin"),
        "stopping-verdict": lambda: stopping("verdict"),
        "stopping-leave": lambda: stopping("leave"),
        "verdict": verdict,
        "barrier": barrier,
        "leaving": leaving,
        "running-resuming": resuming(run_),
        "verdict-resuming": resuming(verdict),
        "leaving-resuming": resuming(leaving),
    }
    return [(name, make()) for name, make in makers.items()]


_HOSTILE = "x" * (MAX_TEXT_LEN - 5) + "\n\x1b[2J"
_SERVER_SAYS = [
    assignment(),
    assignment(round=1, restart_count=1),
    dataclasses.replace(assignment(), job_id="other"),
    assignment(restart_count=99),
    dataclasses.replace(assignment(), world_size=1, group_world_size=1),
    Restart(round=0, reason=_HOSTILE, restart_count=1),
    Restart(round=0, reason="r", restart_count=99),
    Resumed(job_id="j", round=0),
    Resumed(job_id="other", round=0, rebuilt=True),
    Waiting(job_id="other", round=0, joined=1, min_nodes=1, max_nodes=2, reason=_HOSTILE),
    Drain(reason=_HOSTILE),
    Left(job_continues=True, reason=_HOSTILE),
    Left(job_continues=False),
    Error(code="x", message=_HOSTILE, fatal=False),
    Error(code="x", message=_HOSTILE),
    JobFailed(reason=_HOSTILE, failure=failure()),
    JobDone(),
    GoingAway(reason=_HOSTILE),
    Welcome(version=1, software="again"),
]


@pytest.mark.parametrize("msg", _SERVER_SAYS, ids=lambda m: m.TYPE)
def test_every_server_message_has_an_outcome_in_every_phase(msg: object) -> None:
    for name, m in _in_every_phase():
        try:
            effects = m.handle(st.ServerSent(msg), 5.0)  # type: ignore[arg-type]
            # and what follows: the workers stop, time passes far beyond every deadline
            effects += m.handle(st.WorkersStopped(), 6.0)
            effects += m.handle(st.Tick(), 1e6)
        except Exception as exc:
            raise AssertionError(f"{msg.TYPE} while {name}: {exc!r}") from exc  # type: ignore[attr-defined]
        for e in effects:
            if isinstance(e, st.Log):
                assert "\x1b" not in e.text and len(e.text) < 5000, (name, e.text[:200])
        # nothing waits on the server for ever: the agent has exited, or has a deadline, or
        # runs its workers (which need no server), or is mid-stop
        assert (
            m.phase in (st.Phase.EXITED, st.Phase.RUNNING, st.Phase.STARTING, st.Phase.STOPPING)
            or m.next_deadline() is not None
        ), (name, msg, m.phase)


# -- signals a scheduler sends to every process of the step (signal_witness.py) ---------------


def test_a_notice_the_workers_have_already_is_not_forwarded_again() -> None:
    m = running()
    (note,) = m.handle(st.SignalReceived(signal.SIGUSR1, delivered=True), 2.0)
    assert isinstance(note, st.Log) and "not forwarded again" in note.text


def test_a_worker_killed_by_a_forwarded_notice_stops_the_job_without_a_restart() -> None:
    m = running()
    assert m.handle(st.SignalReceived(signal.SIGUSR1), 2.0) == [st.ForwardSignal(signal.SIGUSR1)]
    killed = dataclasses.replace(failure(), exitcode=-signal.SIGUSR1)
    eff = m.handle(st.WorkersExited(killed, (killed,)), 2.1)
    assert st.StopWorkers in kinds(eff) and not any(
        isinstance(e, st.Send) and isinstance(e.msg, WorkersFailed) for e in eff
    )
    assert any(isinstance(e, st.Log) and "was killed by SIGUSR1" in e.text for e in eff)
    (ex,) = [e for e in m.handle(st.WorkersStopped(), 2.5) if isinstance(e, st.Exit)]
    assert ex.code == st.EXIT_FAILED and "killed by SIGUSR1" in ex.reason


def test_a_worker_killed_by_a_signal_nobody_passed_on_is_a_failure() -> None:
    m = running()
    killed = dataclasses.replace(failure(), exitcode=-signal.SIGUSR1)
    eff = m.handle(st.WorkersExited(killed, (killed,)), 2.1)
    assert any(isinstance(e, st.Send) and isinstance(e.msg, WorkersFailed) for e in eff)


def test_a_listed_signal_stops_even_when_it_is_one_to_forward() -> None:
    m = running(AgentMachine(settings(handled_signals=frozenset({signal.SIGTERM, signal.SIGUSR1}))))
    eff = m.handle(st.SignalReceived(signal.SIGUSR1), 2.0)
    (stop,) = [e for e in eff if isinstance(e, st.StopWorkers)]
    assert stop.signum == signal.SIGUSR1
    (ex,) = [e for e in m.handle(st.WorkersStopped(), 2.5) if isinstance(e, st.Exit)]
    assert ex.code == st.EXIT_FAILED and "SIGUSR1" in ex.reason


def test_a_delivered_sigterm_is_not_sent_again() -> None:
    m = running()
    eff = m.handle(st.SignalReceived(signal.SIGTERM, delivered=True), 2.0)
    (stop,) = [e for e in eff if isinstance(e, st.StopWorkers)]
    assert stop.signum == 0 and stop.grace == 5.0  # wait for them, SIGKILL after the grace


def test_under_slurm_a_signal_drain_exits_one_even_when_the_job_goes_on() -> None:
    m = running(AgentMachine(settings(elastic=True, signals_end_job=True)))
    eff = m.handle(st.SignalReceived(signal.SIGTERM, delivered=True), 3.0)
    (stop,) = [e for e in eff if isinstance(e, st.StopWorkers)]
    assert stop.signum == 0
    m.handle(st.WorkersStopped(), 3.5)
    (ex,) = m.handle(st.ServerSent(Left(job_continues=True, reason="1 node(s) remain")), 3.55)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "Slurm" in ex.reason
