"""Machines for the tests of ``node_agent/machine/``: settings, messages, and machines brought
to a phase by the events that lead there (a fake clock throughout)."""

from __future__ import annotations

import signal

from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from node_agent.machine.training import Training
from node_agent.machine.watch import HangPolicy
from protocol import (
    Assignment,
    Drain,
    Failure,
    Restart,
    Waiting,
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


def rejoining() -> AgentMachine:
    return running(AgentMachine(settings(reconnect_timeout=30.0)))


def sent(effects: list[st.Effect]) -> list[object]:
    return [e.msg for e in effects if isinstance(e, st.Send)]


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


def checking(**kw: object) -> AgentMachine:
    """A machine that knows its job, budget and node range, as the runner builds it."""
    base: dict[str, object] = dict(job_id="j", max_restarts=3, min_nodes=2, max_nodes=2, nproc=2)
    base.update(kw)
    m = AgentMachine(settings(**base))
    m.start(0.0)
    return m
