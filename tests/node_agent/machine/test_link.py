"""A lost connection and the Resume (``machine/link.py``), deterministic: events in, effects out,
a fake clock."""

from __future__ import annotations

import signal

import pytest

from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from protocol import (
    Error,
    GoingAway,
    JobDone,
    JobFailed,
    Leave,
    Left,
    Restart,
    Resumed,
    WorkersFailed,
)

from .harness import assignment, checking, failure, in_phase, kinds, rejoining, running, sent, settings


def test_connection_lost_stops_workers_then_exits_nonzero() -> None:
    m = running()
    assert kinds(m.handle(st.ConnectionLost("reset"), 2.0)) == [st.StopWorkers]
    (ex,) = m.handle(st.WorkersStopped(), 2.5)
    assert isinstance(ex, st.Exit) and ex.code != 0 and "reset" in ex.reason


def test_first_reason_to_exit_wins_over_the_connection_closing() -> None:
    m = running()
    m.handle(st.WorkersExited(failure(), (failure(),)), 5.0)
    m.handle(st.ServerSent(Error(code="excluded", message="node n1 is excluded: failed 2 times")), 5.1)
    m.handle(st.ConnectionLost("the server closed the connection"), 5.1)
    (ex,) = m.handle(st.WorkersStopped(), 5.2)
    assert isinstance(ex, st.Exit) and "excluded" in ex.reason


def test_server_going_away_keeps_workers_and_the_lost_connection_reconnects() -> None:

    m = running(AgentMachine(settings(reconnect_timeout=30.0)))
    effects = m.handle(st.ServerSent(GoingAway(reason="received SIGTERM")), 2.0)
    assert kinds(effects) == []
    assert any("going away (received SIGTERM); workers keep running" in e.text for e in effects)
    assert kinds(m.handle(st.ConnectionLost("closed"), 2.1)) == [st.Reconnect]
    assert kinds(m.handle(st.Reconnected(), 3.0)) == [st.SendResume]
    (note,) = m.handle(st.ServerSent(Resumed(job_id="j", round=0, rebuilt=False)), 3.1)
    assert isinstance(note, st.Log) and "the server kept it" in note.text
    assert m.phase is st.Phase.RUNNING


# --- a lost connection, in every phase ------------------------------------------------------
#
# With a reconnect window every phase rides out a lost connection and picks up what it was
# doing once back; what the workers do meanwhile is each test's first assertion.


def test_a_restart_cut_off_by_the_server_going_away_finishes_stopping_then_joins_once_back() -> None:

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


# --- the machine's helpers own their fields (h11's Connection never assigns ConnectionState's) --


def test_the_machine_never_assigns_its_helpers_fields() -> None:
    """``link.py`` and ``leaving.py`` change their own state through their methods; a field
    written from ``agent.py`` would split one decision across two files again."""
    import ast
    from pathlib import Path

    import node_agent.machine.agent as agent_module

    tree = ast.parse(Path(agent_module.__file__).read_text())
    written = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        for target in targets:
            for t in ast.walk(target):
                if not isinstance(t, ast.Attribute) or not isinstance(t.value, ast.Attribute):
                    continue
                owner = t.value
                mine = isinstance(owner.value, ast.Name) and owner.value.id == "self"
                if mine and owner.attr in ("link", "leaving"):
                    written.append(f"{node.lineno}: self.{owner.attr}.{t.attr}")
    assert written == []


def test_link_keeps_a_report_until_the_verdict() -> None:
    from node_agent.machine.link import Link

    link = Link(settings())
    report = WorkersFailed(round=0, failure=failure(), step=3)
    assert link.reported(report) == [st.Send(report)]
    assert link.report == report
    link.lost()
    assert link.reported(report) == []  # said once back, from link.report
    link.verdict()
    assert link.report is None


def test_link_a_commit_is_no_success_and_a_new_round_forgets_both() -> None:
    from node_agent.machine.link import Link

    link = Link(settings())
    link.finished()
    assert link.succeeded
    link.committed_at(7)
    assert link.committed == 7 and not link.succeeded
    link.new_round()
    assert link.committed is None and not link.succeeded


def test_link_an_answered_resume_lets_the_link_speak() -> None:
    from node_agent.machine.link import Link

    link = Link(settings(reconnect_timeout=30.0))
    link.lost()
    link.back()
    link.resume(st.Phase.RUNNING, assignment())
    assert link.quiet
    link.answered()
    assert not link.quiet
