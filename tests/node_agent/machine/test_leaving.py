"""Leaving the job (``machine/leaving.py``): drains, SIGTERM, the Leave and the Left,
deterministic: events in, effects out, a fake clock."""

from __future__ import annotations

import signal

from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from protocol import (
    MAX_TEXT_LEN,
    Drain,
    JobDone,
    JobFailed,
    Leave,
    Left,
    Resumed,
)

from .harness import assignment, failure, kinds, running, sent, settings


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


def test_the_job_finishing_while_our_workers_stop_for_a_drain_is_a_success() -> None:
    m = running(AgentMachine(settings(elastic=True)))
    m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert m.handle(st.ServerSent(JobDone()), 3.1) == []
    (ex,) = m.handle(st.WorkersStopped(), 3.5)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK and ex.reason == "all nodes finished"


def test_a_drain_reason_of_any_length_drains() -> None:
    m = running(AgentMachine(settings(elastic=True)))
    eff = m.handle(st.ServerSent(Drain(reason="x" * MAX_TEXT_LEN)), 2.0)
    assert kinds(eff) == [st.StopWorkers, st.Send]
    (notice,) = sent(eff)
    assert isinstance(notice, Leave) and len(notice.reason) <= MAX_TEXT_LEN
    (note,) = [e for e in eff if isinstance(e, st.Log)]
    assert "more characters" in note.text and len(note.text) < 3000  # said once, cut


def test_under_slurm_a_signal_drain_exits_one_even_when_the_job_goes_on() -> None:
    m = running(AgentMachine(settings(elastic=True, signals_end_job=True)))
    eff = m.handle(st.SignalReceived(signal.SIGTERM, delivered=True), 3.0)
    (stop,) = [e for e in eff if isinstance(e, st.StopWorkers)]
    assert stop.signum == 0
    m.handle(st.WorkersStopped(), 3.5)
    (ex,) = m.handle(st.ServerSent(Left(job_continues=True, reason="1 node(s) remain")), 3.55)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED and "Slurm" in ex.reason


def test_leaving_pending_commit_settled_and_moot_leave() -> None:
    from node_agent.machine.leaving import Leaving

    leaving = Leaving(settings(elastic=True, commit_timeout=10.0))
    assert leaving.pending_commit is None
    leaving.ask_commit("SIGTERM", 0, 1.0)
    assert leaving.pending_commit == "SIGTERM"
    leaving.quit("got SIGTERM")
    assert leaving.leave is not None
    leaving.leave_moot()
    assert leaving.leave is None
    leaving.awaiting_left = True
    leaving.exit_decided()
    assert not leaving.awaiting_left
    leaving.quit("again")
    leaving.awaiting_left = True
    leaving.settled()
    assert leaving.leave is None and not leaving.awaiting_left
