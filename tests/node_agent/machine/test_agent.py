"""The agent's decisions, deterministic: events in, effects out, a fake clock."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from node_agent.machine.events import DumpStacks, WriteStop
from protocol import (
    MAX_TEXT_LEN,
    Assignment,
    Drain,
    Error,
    GoingAway,
    JobDone,
    JobFailed,
    Left,
    Restart,
    Resumed,
    Waiting,
    Welcome,
    WorkersFailed,
    WorkersSucceeded,
)

from .harness import PHASES, assignment, checking, failure, in_phase, kinds, running, settings


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


def test_a_restore_step_the_node_could_not_get_is_told_with_its_failure() -> None:
    """Issue 42: no holder had the owner's bytes of a local rank's restore step; the server is
    told which step, and restores the next round from another."""
    m = AgentMachine(settings())
    m.start(0.0)
    m.handle(st.ServerSent(assignment()), 0.5)
    eff = m.handle(
        st.WorkersStartFailed("could not fetch rank 1's snapshot of step 7", restore_failed=7), 0.6
    )
    (send,) = [e for e in eff if isinstance(e, st.Send)]
    assert isinstance(send.msg, WorkersFailed) and send.msg.restore_failed == 7
    assert "step 7" in send.msg.failure.message


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


def test_a_non_fatal_server_error_is_logged_not_fatal() -> None:
    m = AgentMachine(settings(reconnect_timeout=30.0))
    m.start(0.0)
    msg = Error(code="server_draining", message="the server is shutting down", fatal=False)
    (note,) = m.handle(st.ServerSent(msg), 0.1)
    assert isinstance(note, st.Log) and "server_draining" in note.text
    assert m.phase is st.Phase.JOINING


# --- every server message in every phase ----------------------------------------------------


def server_messages() -> list[object]:
    from protocol import (
        SERVER_MESSAGES,
        CollectStacks,
        GoingAway,
        KeepSnapshot,
        Resumed,
        Standbys,
        StopAt,
        Welcome,
    )

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
        KeepSnapshot(step=50),
        Standbys(term=1, host_node="h", endpoints=("10.0.0.2:29500",), nodes=("n2",)),
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
                st.SendJoin
                | st.Send
                | st.SendResume
                | st.StartWorkers
                | st.StopWorkers
                | st.Log
                | st.Exit
                | st.KeepSteps,
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


def test_a_start_failure_waits_for_its_verdict_no_longer_than_the_join_timeout() -> None:
    m = AgentMachine(settings())
    m.start(0.0)
    m.handle(st.ServerSent(assignment()), 0.5)
    m.handle(st.WorkersStartFailed("no such file"), 1.0)
    assert m.phase is st.Phase.VERDICT and m.next_deadline() == 11.0


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


def _stop(eff: list[st.Effect]) -> st.StopWorkers:
    (stop,) = [e for e in eff if isinstance(e, st.StopWorkers)]
    return stop


def test_the_stops_of_a_restart_park_the_survivors_and_the_stops_of_an_exit_do_not() -> None:
    """Issue 44: where the job goes on in a next round (a restart, our own failure awaiting the
    verdict), workers under worker.run are parked; where this node leaves or exits, stopped."""
    restart = Restart(round=0, reason="node joined", restart_count=0)
    assert _stop(running().handle(st.ServerSent(restart), 3.0)).park
    assert _stop(running().handle(st.WorkersExited(failure(), (failure(),)), 3.0)).park
    # The verdict is the job's failure: the parked survivors are stopped on the way out.
    m = running()
    m.handle(st.WorkersExited(failure(), (failure(),)), 3.0)
    m.handle(st.WorkersStopped(), 3.1)
    (ex,) = m.handle(st.ServerSent(JobFailed(reason="no restarts left", failure=failure())), 3.2)
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_FAILED
    for leave in (Drain(reason="scale down"), JobFailed(reason="no restarts left", failure=failure())):
        assert not _stop(running().handle(st.ServerSent(leave), 3.0)).park
    assert not _stop(running().handle(st.SignalReceived(signal.SIGINT), 3.0)).park
