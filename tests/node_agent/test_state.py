"""The agent's decisions, deterministic: events in, effects out, a fake clock."""

from __future__ import annotations

import signal

import pytest

from node_agent import state as st
from protocol import (
    Assignment,
    Error,
    Failure,
    JobDone,
    JobFailed,
    Leave,
    Left,
    Restart,
    Waiting,
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


def running(m: st.AgentMachine | None = None) -> st.AgentMachine:
    m = m or st.AgentMachine(settings())
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
    m = st.AgentMachine(settings(join_timeout=10.0))
    m.start(0.0)
    m.handle(st.ServerSent(Waiting(job_id="j", round=0, joined=1, min_nodes=2, max_nodes=2)), 1.0)
    assert m.handle(st.Tick(), 9.0) == []
    eff = m.handle(st.Tick(), 10.0)
    assert kinds(eff) == [st.Send, st.Exit]
    assert isinstance(eff[0], st.Send) and isinstance(eff[0].msg, Leave)
    ex = eff[1]
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_RDZV and "1 joined" in ex.reason


def test_waiting_is_logged_once_per_change() -> None:
    m = st.AgentMachine(settings())
    m.start(0.0)
    w = Waiting(job_id="j", round=0, joined=1, min_nodes=2, max_nodes=2)
    (log,) = m.handle(st.ServerSent(w), 1.0)
    assert isinstance(log, st.Log) and "waiting for nodes: 1 of 2 joined" in log.text
    assert m.handle(st.ServerSent(w), 1.5) == []


def test_sigterm_forwards_and_exits_after_stop() -> None:
    m = running()
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    # workers get the signal first, then the server hears we leave
    assert kinds(eff) == [st.StopWorkers, st.Send]
    stop = eff[0]
    assert isinstance(stop, st.StopWorkers) and stop.signum == signal.SIGTERM and stop.grace == 5.0
    # a second signal escalates
    assert kinds(m.handle(st.SignalReceived(signal.SIGINT), 3.1)) == [st.ForwardSignal]
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
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
    m = st.AgentMachine(settings())
    m.start(0.0)
    (ex,) = m.handle(st.ServerSent(Error(code="job_mismatch", message="node range differs")), 0.1)
    assert isinstance(ex, st.Exit) and ex.code != 0 and "node range differs" in ex.reason


def test_spawn_failure_is_reported_as_worker_failure() -> None:
    m = st.AgentMachine(settings())
    m.start(0.0)
    m.handle(st.ServerSent(assignment()), 0.5)
    eff = m.handle(st.WorkersStartFailed("no such file: train.py"), 0.6)
    (send,) = [e for e in eff if isinstance(e, st.Send)]
    assert isinstance(send.msg, WorkersFailed) and "train.py" in send.msg.failure.message
    assert m.phase is st.Phase.VERDICT


def test_assignment_outside_joining_is_a_local_error() -> None:
    m = running()
    with pytest.raises(st.UnexpectedEvent, match="phase running"):
        m.handle(st.ServerSent(assignment(1)), 2.0)


def test_sigterm_in_elastic_job_drains_and_exits_zero_when_the_job_goes_on() -> None:
    m = running(st.AgentMachine(settings(elastic=True)))
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert kinds(eff) == [st.StopWorkers, st.Send]
    assert isinstance(eff[-1], st.Send) and isinstance(eff[-1].msg, Leave)
    # the server answers, then closes our connection once we have left: expected, not an error
    assert m.handle(st.ServerSent(Left(job_continues=True, reason="1 node(s) remain")), 3.05) == []
    assert m.handle(st.ConnectionLost("closed"), 3.1) == []
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK
    assert "drained" in ex.reason and "goes on without this node (1 node(s) remain)" in ex.reason


def test_sigterm_to_the_last_node_of_an_elastic_job_exits_as_torchrun() -> None:
    m = running(st.AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.ServerSent(Left(job_continues=False, reason="this node was the last of the job")), 3.05)
    m.handle(st.ConnectionLost("closed"), 3.1)
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED == 1  # torchrun's SignalException
    assert "does not go on without this node (this node was the last of the job)" in ex.reason


def test_a_drain_answered_after_the_workers_stopped_waits_in_leaving() -> None:
    m = running(st.AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert m.handle(st.WorkersStopped(), 3.5) == []
    assert m.phase is st.Phase.LEAVING and m.next_deadline() == 3.5 + st.LEAVE_ANSWER_TIMEOUT
    # an assignment that crossed our Leave changes nothing
    assert m.handle(st.ServerSent(assignment(1)), 3.6) == []
    (ex,) = m.handle(st.ServerSent(Left(job_continues=True)), 3.7)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK


def test_a_drain_without_an_answer_is_conservative() -> None:
    # The connection closes first (an older server sends no Left): not known to go on.
    m = running(st.AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert m.handle(st.ConnectionLost("the server closed the connection"), 3.1) == []
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "closed" in ex.reason
    # No answer and no close at all (a server that stopped answering): the wait is bounded.
    m = running(st.AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.WorkersStopped(), 3.5)
    assert m.handle(st.Tick(), 3.5 + st.LEAVE_ANSWER_TIMEOUT - 0.1) == []
    (ex,) = m.handle(st.Tick(), 3.5 + st.LEAVE_ANSWER_TIMEOUT)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "did not answer" in ex.reason
    # A second SIGTERM while waiting exits at once, still non-zero.
    m = running(st.AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.WorkersStopped(), 3.5)
    (ex,) = m.handle(st.SignalReceived(signal.SIGTERM), 4.0)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED


def test_a_drain_while_the_server_is_unreachable_sends_nothing_and_fails() -> None:
    m = running(st.AgentMachine(settings(elastic=True, reconnect_timeout=30.0)))
    assert kinds(m.handle(st.ConnectionLost("reset"), 2.0)) == [st.Reconnect]
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert kinds(eff) == [st.StopWorkers]
    assert m.handle(st.Reconnected(), 3.2) == []  # no join, no resume: we are on our way out
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "unreachable" in ex.reason


def test_sigterm_while_joining_or_at_the_barrier_waits_for_the_answer() -> None:
    m = st.AgentMachine(settings(elastic=True))
    m.start(0.0)
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 1.0)
    assert kinds(eff) == [st.Send] and m.phase is st.Phase.LEAVING
    (ex,) = m.handle(st.ServerSent(Left(job_continues=False, reason="only 1 node(s) remain")), 1.1)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED
    # At the exit barrier our part is done; the job finishing first answers as well as Left.
    m = running(st.AgentMachine(settings(elastic=True)))
    m.handle(st.WorkersExited(None), 2.0)
    assert kinds(m.handle(st.SignalReceived(signal.SIGTERM), 3.0)) == [st.Send]
    (ex,) = m.handle(st.ServerSent(JobDone()), 3.1)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK
    assert m.handle(st.ServerSent(Left(job_continues=True, reason="the job finished")), 3.2) == []


def test_the_job_failing_while_draining_reports_the_jobs_failure() -> None:
    m = running(st.AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    m.handle(st.ServerSent(JobFailed(reason="rank 3 failed; no restarts left", failure=failure())), 3.1)
    m.handle(st.ServerSent(Left(job_continues=False, reason="the job failed")), 3.2)
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "rank 3 failed" in ex.reason


def test_sigterm_in_a_fixed_size_job_exits_nonzero_whatever_the_server_answers() -> None:
    m = running()  # elastic=False
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert kinds(eff) == [st.StopWorkers, st.Send]
    assert m.handle(st.ServerSent(Left(job_continues=True, reason="a spare took its place")), 3.1) == []
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "received SIGTERM" in ex.reason


def test_drain_message_from_server_is_a_clean_leave() -> None:
    from protocol import Drain

    m = running()
    eff = m.handle(st.ServerSent(Drain(reason="maintenance")), 3.0)
    assert kinds(eff) == [st.StopWorkers, st.Send]
    assert m.handle(st.ServerSent(Drain(reason="again")), 3.1) == []
    m.handle(st.ServerSent(Left(job_continues=True, reason="a spare took its place")), 3.2)
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK and "maintenance" in ex.reason


def test_a_spare_that_outlives_the_job_exits_cleanly_saying_so() -> None:
    m = st.AgentMachine(settings())
    m.start(0.0)
    spare = Waiting(job_id="j", round=0, joined=1, min_nodes=1, max_nodes=1, reason="spare: the job is full")
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
    m = st.AgentMachine(settings())
    m.start(0.0)
    (note, ex) = m.handle(st.ServerSent(JobDone()), 5.0)
    assert isinstance(ex, st.Exit) and ex.code == 0
    assert isinstance(note, st.Log) and "no place in a round yet" in note.text


def test_a_spare_told_the_job_failed_exits_nonzero_with_the_jobs_reason() -> None:
    m = st.AgentMachine(settings())
    m.start(0.0)
    root = failure(4.0)
    (ex,) = m.handle(st.ServerSent(JobFailed(reason="rank 1 failed; no restarts left", failure=root)), 5.0)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED
    assert "waited to join" in ex.reason and "rank 1 failed; no restarts left" in ex.reason
    assert ex.failure == root and ex.local_failures == ()


def test_failed_health_check_never_joins() -> None:
    m = st.AgentMachine(settings())
    m.start(0.0)
    eff = m.handle(st.HealthCheckFailed("gpu 3 is missing"), 0.1)
    assert kinds(eff) == [st.Send, st.Exit]
    ex = eff[-1]
    assert isinstance(ex, st.Exit) and ex.code != 0 and "gpu 3 is missing" in ex.reason


def test_first_reason_to_exit_wins_over_the_connection_closing() -> None:
    m = running()
    m.handle(st.WorkersExited(failure(), (failure(),)), 5.0)
    m.handle(st.ServerSent(Error(code="excluded", message="node n1 is excluded: failed 2 times")), 5.1)
    m.handle(st.ConnectionLost("the server closed the connection"), 5.1)
    (ex,) = m.handle(st.WorkersStopped(), 5.2)
    assert isinstance(ex, st.Exit) and "excluded" in ex.reason


def test_server_going_away_keeps_workers_and_the_lost_connection_reconnects() -> None:
    from protocol import GoingAway, Resumed

    m = running(st.AgentMachine(settings(reconnect_timeout=30.0)))
    effects = m.handle(st.ServerSent(GoingAway(reason="received SIGTERM")), 2.0)
    assert kinds(effects) == []
    assert any("going away (received SIGTERM); workers keep running" in e.text for e in effects)
    assert kinds(m.handle(st.ConnectionLost("closed"), 2.1)) == [st.Reconnect]
    assert kinds(m.handle(st.Reconnected(), 3.0)) == [st.SendResume]
    (note,) = m.handle(st.ServerSent(Resumed(job_id="j", round=0, rebuilt=False)), 3.1)
    assert isinstance(note, st.Log) and "the server kept it" in note.text
    assert m.phase is st.Phase.RUNNING


def test_a_non_fatal_server_error_is_logged_not_fatal() -> None:
    m = st.AgentMachine(settings(reconnect_timeout=30.0))
    m.start(0.0)
    msg = Error(code="server_draining", message="the server is shutting down", fatal=False)
    (note,) = m.handle(st.ServerSent(msg), 0.1)
    assert isinstance(note, st.Log) and "server_draining" in note.text
    assert m.phase is st.Phase.JOINING


def test_the_job_finishing_while_our_workers_stop_for_a_drain_is_a_success() -> None:
    m = running(st.AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert m.handle(st.ServerSent(JobDone()), 3.1) == []
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK and ex.reason == "all nodes finished"
