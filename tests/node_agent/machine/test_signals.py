"""The signals the agent receives (``machine/signals.py``): handled, forwarded, delivered by
their sender, and the workers they kill, deterministic: events in, effects out, a fake clock."""

from __future__ import annotations

import dataclasses
import signal

from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from protocol import WorkersFailed

from .harness import failure, kinds, running, settings


def test_sigusr1_is_forwarded_to_workers() -> None:
    m = running()
    assert m.handle(st.SignalReceived(signal.SIGUSR1), 2.0) == [st.ForwardSignal(signal.SIGUSR1)]


def test_a_notice_that_came_while_no_workers_ran_is_said_and_not_passed_on() -> None:
    # Before the first start (a notice the agent held from its first instruction:
    # step_notices.py), between rounds, or before the workers running now were started: they
    # never had it from its sender, and a worker just started has no handler to take it.
    joining = AgentMachine(settings())
    joining.start(0.0)
    for m in (joining, running()):
        (note,) = m.handle(st.SignalReceived(signal.SIGUSR2, stale=True), 2.0)
        assert isinstance(note, st.Log) and "while no workers of this node ran" in note.text
    (note,) = joining.handle(st.SignalReceived(signal.SIGUSR1), 2.0)
    assert isinstance(note, st.Log) and "not passed on" in note.text


def test_a_stale_handled_signal_still_stops_the_job() -> None:
    eff = running().handle(st.SignalReceived(signal.SIGTERM, stale=True), 2.0)
    assert st.StopWorkers in kinds(eff)


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
