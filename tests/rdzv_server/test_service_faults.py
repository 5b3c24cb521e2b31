"""The server's timer outlives any fault (issue 31): every job's deadlines hang on it.

A real service on loopback. Each test ends when the server does what only its timer makes it
do (drop a node whose heartbeats stopped), awaited as the connection's close.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from protocol import Assignment, JobFailed, Join, Message, Progress, Welcome
from rdzv_server.journal import StateLog
from rdzv_server.machine.commits import CommitRules
from rdzv_server.machine.state import JobPhase, Tick
from rdzv_server.service import RendezvousService

from .test_service import RawAgent


def joining(job: str, node: str, port: int, **kw: Any) -> Join:
    fields: dict[str, Any] = dict(
        job_id=job,
        node_id=node,
        addr="127.0.0.1",
        nproc=1,
        min_nodes=1,
        max_nodes=1,
        entrypoint="x.py",
        master_port=port,
        max_restarts=0,
        last_call_timeout=0.0,
        heartbeat_interval=0.1,
        heartbeat_timeout=0.5,
    )
    fields.update(kw)
    return Join(**fields)


async def agent(port: int, msg: Join) -> RawAgent:
    a = await RawAgent.open(port)
    assert isinstance(await a.recv(), Welcome)
    a.send(msg)
    return a


async def until(a: RawAgent, kind: type[Message]) -> Message:
    while True:
        msg = await a.recv()
        if isinstance(msg, kind):
            return msg


async def closed(a: RawAgent, timeout: float = 5.0) -> None:
    """Until the server closes ``a`` (what it read meanwhile is dropped)."""

    async def drain() -> None:
        while await a.reader.read(65536):
            pass

    await asyncio.wait_for(drain(), timeout)


def raising_for(job_id: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def rule(self: Any, job: Any, *args: Any, **kw: Any) -> Any:
        if job.id == job_id:
            raise ArithmeticError("a bug")
        return original(self, job, *args, **kw)

    return rule


async def test_a_rule_raising_in_a_tick_fails_its_job_and_the_timer_still_serves_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Job "bad"'s settle window closes in a tick whose rule raises: "bad" fails (its agents
    told), and the timer still fires for job "good", whose silent node is dropped."""
    monkeypatch.setattr(CommitRules, "_plan_change", raising_for("bad", CommitRules._plan_change))
    svc = RendezvousService()
    port = await svc.start("127.0.0.1", 0)
    try:
        silent = await agent(port, joining("good", "g", 30001))
        await until(silent, Assignment)
        kw = dict(min_nodes=2, max_nodes=3, last_call_timeout=0.05, heartbeat_timeout=30.0)
        bad = [await agent(port, joining("bad", f"b{i}", 30010 + i, **kw)) for i in range(2)]
        for a in bad:
            await until(a, Assignment)
            a.send(Progress(round=0, min_step=1, max_step=1, step_p50_ms=10.0, checks=True))
        bad.append(await agent(port, joining("bad", "b2", 30012, **kw)))  # its settle window: 50 ms
        for a in bad:
            told = await until(a, JobFailed)
            assert isinstance(told, JobFailed) and told.code == "internal_error"
            assert "_maybe_regather" in told.reason and "ArithmeticError: a bug" in told.reason
        assert svc.machine.jobs["bad"].phase is JobPhase.FAILED
        await closed(silent)  # the heartbeat sweep still runs: 0.5 s of silence drops it
        assert "good" not in svc.machine.jobs
        assert svc._timer is not None  # bad's agents are still swept
    finally:
        await svc.close()


async def test_an_exception_escaping_the_machine_leaves_the_timer_armed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Should the machine itself raise in a Tick, the timer is armed again (and, with a state
    log, the machine is snapshotted as it is, since the tick's record cannot say what it did)."""
    log, _, _ = StateLog.open(tmp_path / "state", fsync=False)
    svc = RendezvousService(state_log=log)
    port = await svc.start("127.0.0.1", 0)
    handle = svc.machine.handle
    raised = asyncio.Event()

    def once(event: Any, now: float) -> Any:
        if isinstance(event, Tick) and not raised.is_set():
            raised.set()
            raise RuntimeError("a bug of the containment itself")
        return handle(event, now)

    try:
        silent = await agent(port, joining("good", "g", 30001))
        await until(silent, Assignment)
        svc.machine.handle = once  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="rdzv_server"):
            await asyncio.wait_for(raised.wait(), 5)
            await closed(silent)  # a later tick's sweep drops the silent node
        assert any("the machine raised handling Tick" in r.getMessage() for r in caplog.records)
        assert log.snapshot_bytes > 0  # compacted: the snapshot holds the machine as it was
    finally:
        await svc.close()
        log.close()


async def test_the_watchdog_arms_a_timer_found_missing() -> None:
    """Whatever lost the timer, a pending deadline gets one again within a watchdog period."""
    svc = RendezvousService()
    port = await svc.start("127.0.0.1", 0)
    try:
        silent = await agent(port, joining("good", "g", 30001))
        await until(silent, Assignment)
        assert svc._timer is not None
        svc._timer.cancel()  # what a Tick that raised used to leave: no timer, no deadline fires
        svc._timer = None
        await closed(silent)
    finally:
        await svc.close()
