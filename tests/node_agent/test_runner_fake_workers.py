"""The runner's logic with FakeWorkerGroup (supervisor/fake.py) and the server's real machine in
process (rdzv/fake.py): no process at all, so each case runs in milliseconds. What the workers
themselves do (signals, output, reaping) is test_supervisor.py's and the end-to-end tests'."""

from __future__ import annotations

import asyncio
import io
import signal
from pathlib import Path

from node_agent.cli.parse import parse_config
from node_agent.config import AgentConfig
from node_agent.machine import events as st
from node_agent.rdzv.fake import FakeBackend, FakeRendezvous
from node_agent.runner import Agent, AgentOutcome
from node_agent.supervisor.fake import FakeWorkerGroup
from protocol import Drain, Join, Message, WorkersFailed, WorkersSucceeded


def config(tmp_path: Path, *flags: str) -> AgentConfig:
    script = tmp_path / "train.py"
    script.write_text("")
    argv = [*flags, "--rdzv-endpoint=fake.invalid:29400", "--rdzv-id=job", f"--log-dir={tmp_path / 'logs'}"]
    return parse_config([*argv, str(script)], {})


def sent(agent: Agent, kind: type[Message]) -> list[Message]:
    backend = agent.backend
    assert isinstance(backend, FakeBackend)
    return [m for link in backend.opened for m in link.sent if isinstance(m, kind)]


async def started(hub: FakeRendezvous, group: FakeWorkerGroup, count: int) -> None:
    await hub.wait_until(lambda: len(group.started) >= count, what=f"start {count} of the workers")


def run(cfg: AgentConfig, scenario_body: object) -> tuple[AgentOutcome, Agent, FakeWorkerGroup, str]:
    async def scenario() -> tuple[AgentOutcome, Agent, FakeWorkerGroup, str]:
        hub = FakeRendezvous()
        group = FakeWorkerGroup()
        err = io.StringIO()
        agent = Agent(
            cfg, stdout=io.StringIO(), stderr=err, backend=hub.backend(local_ip="10.0.0.1"), group=group
        )
        task = asyncio.ensure_future(agent.run())
        await scenario_body(hub, agent, group)  # type: ignore[operator]
        return await asyncio.wait_for(task, 30), agent, group, err.getvalue()

    return asyncio.run(scenario())


def test_workers_that_exit_0_end_the_job(tmp_path: Path) -> None:
    async def body(hub: FakeRendezvous, agent: Agent, group: FakeWorkerGroup) -> None:
        await started(hub, group, 1)
        group.exit(0, 0)
        group.exit(1, 0)

    outcome, agent, group, _ = run(config(tmp_path, "--nnodes=1", "--nproc-per-node=2"), body)
    assert (outcome.code, outcome.reason) == (st.EXIT_OK, "all nodes finished")
    assert [[s.rank for s in specs] for specs in group.started] == [[0, 1]]
    assert len(sent(agent, WorkersSucceeded)) == 1


def test_a_failure_restarts_the_workers_within_the_budget_then_fails_the_job(tmp_path: Path) -> None:
    async def body(hub: FakeRendezvous, agent: Agent, group: FakeWorkerGroup) -> None:
        for attempt in (1, 2):
            await started(hub, group, attempt)
            group.exit(1, 3, "Traceback: ValueError")

    cfg = config(tmp_path, "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1")
    outcome, agent, group, err = run(cfg, body)
    assert outcome.code == st.EXIT_FAILED
    assert len(group.started) == 2  # one restart: the budget
    assert [s.env["TORCHELASTIC_RESTART_COUNT"] for s in group.started[1]] == ["1", "1"]
    failed = sent(agent, WorkersFailed)
    assert len(failed) == 2 and all(isinstance(f, WorkersFailed) and f.failure.exitcode == 3 for f in failed)
    assert outcome.failure is not None and outcome.failure.local_rank == 1
    assert (signal.SIGTERM in {sig for _, sig in group.stops}) and outcome.reason in err


def test_a_drain_stops_the_workers_with_sigterm(tmp_path: Path) -> None:
    async def body(hub: FakeRendezvous, agent: Agent, group: FakeWorkerGroup) -> None:
        await started(hub, group, 1)
        hub.link_of(agent.node_id).deliver(Drain(reason="maintenance"))

    outcome, agent, group, _ = run(config(tmp_path, "--nnodes=1", "--nproc-per-node=1"), body)
    assert group.stops[0][1] == signal.SIGTERM
    assert outcome.code == st.EXIT_FAILED  # the job does not go on without its only node
    assert len(sent(agent, Join)) == 1


class _SlowWitness(FakeWorkerGroup):
    """Workers a scheduler signals with the agent, whose watchdog's answer comes late."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def delivered(self, sig: int) -> bool:
        await self.answer.wait()
        return True


def test_workers_started_after_a_signal_came_are_sent_it(tmp_path: Path) -> None:
    # Slurm's scancel signals every process of the step at once; workers the agent starts while
    # it still asks the watchdog whether they have it (a restart in between) do not: they are
    # stopped with the signal, not waited on for a grace they never get the signal for.
    group = _SlowWitness()

    async def body(hub: FakeRendezvous, agent: Agent, _: FakeWorkerGroup) -> None:
        await started(hub, group, 1)
        agent._on_signal(signal.SIGTERM)
        group.exit(0, 3, "Traceback: ValueError")
        await started(hub, group, 2)
        group.answer.set()

    async def scenario() -> list[tuple[float, int]]:
        hub = FakeRendezvous()
        cfg = config(tmp_path, "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1")
        agent = Agent(cfg, stdout=io.StringIO(), stderr=io.StringIO(), backend=hub.backend(), group=group)
        task = asyncio.ensure_future(agent.run())
        await body(hub, agent, group)
        await asyncio.wait_for(task, 30)
        return group.stops

    stops = asyncio.run(scenario())
    assert stops[1][1] == signal.SIGTERM, stops  # the restarted worker's stop sends it


class _LateWitness(FakeWorkerGroup):
    """A watchdog whose answer comes late, and says the workers do not have the signal."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def delivered(self, sig: int) -> bool:
        await self.answer.wait()
        return False


def test_a_notice_is_not_passed_on_to_workers_started_after_it_came(tmp_path: Path) -> None:
    # The notice came while round 0's worker ran; it failed and round 1's started while the
    # agent still asked the watchdog. The new worker never had the notice from its sender, and
    # one passed on at its start would kill it before its handler is in: said, not passed on.
    group = _LateWitness()

    async def body(hub: FakeRendezvous, agent: Agent, _: FakeWorkerGroup) -> None:
        await started(hub, group, 1)
        agent._on_signal(signal.SIGUSR1)
        group.exit(0, 3, "Traceback: ValueError")
        await started(hub, group, 2)
        group.answer.set()
        await hub.wait_until(lambda: "not passed on" in err.getvalue(), what="the notice said")
        group.exit(0, 0)

    err = io.StringIO()

    async def scenario() -> AgentOutcome:
        hub = FakeRendezvous()
        cfg = config(tmp_path, "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1")
        agent = Agent(cfg, stdout=io.StringIO(), stderr=err, backend=hub.backend(), group=group)
        task = asyncio.ensure_future(agent.run())
        await body(hub, agent, group)
        return await asyncio.wait_for(task, 30)

    outcome = asyncio.run(scenario())
    assert outcome.code == st.EXIT_OK, err.getvalue()
    assert group.signals == [], group.signals
    assert "received SIGUSR1 while no workers of this node ran" in err.getvalue()
