"""The runner in process: real Agents and real workers, on the server's real rendezvous machine
(``node_agent/rdzv/fake.py``); and its safety net: a bug of ours stops the workers gracefully."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time
from pathlib import Path

import pytest

from node_agent.cli.parse import parse_config
from node_agent.config import AgentConfig
from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from node_agent.rdzv.fake import FakeBackend, FakeLink, FakeRendezvous
from node_agent.runner import Agent, AgentOutcome
from protocol import Assignment, Drain, Join, Leave, Message, Restart, Resume, WorkersFailed, WorkersSucceeded


def test_a_bug_in_the_machine_stops_the_workers_with_sigterm_not_sigkill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    started, termed = tmp_path / "started", tmp_path / "termed"
    script.write_text(
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(termed)!r}, 'w').close(), sys.exit(143)))\n"
        f"open({str(started)!r}, 'w').close()\n"
        "time.sleep(60)\n"
    )

    def broken(self: AgentMachine) -> list[st.Effect]:
        deadline = time.monotonic() + 30
        # Until the worker's handler is in place (another process: no event to await).
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("a bug")

    monkeypatch.setattr(AgentMachine, "_on_started", broken)
    config = parse_config(["--standalone", "--nproc-per-node", "1", str(script)], {})
    err = io.StringIO()
    outcome = asyncio.run(Agent(config, stdout=io.StringIO(), stderr=err).run())
    assert outcome.code == st.EXIT_FAILED
    assert "internal error while handling WorkersStarted: RuntimeError('a bug')" in err.getvalue()
    assert termed.exists()  # SIGTERM first: the worker had its grace period


# --- a real Agent, real workers, the server's real machine in process (rdzv/fake.py) ----------


def agent_config(tmp_path: Path, body: str, *flags: str) -> AgentConfig:
    script = tmp_path / "train.py"
    script.write_text(body)
    argv = [*flags, "--rdzv-endpoint=fake.invalid:29400", "--rdzv-id=job", f"--log-dir={tmp_path / 'logs'}"]
    return parse_config([*argv, str(script)], {})


def start(cfg: AgentConfig, hub: FakeRendezvous) -> tuple[Agent, asyncio.Task[AgentOutcome], io.StringIO]:
    err = io.StringIO()
    agent = Agent(cfg, stdout=io.StringIO(), stderr=err, backend=hub.backend(local_ip="10.0.0.1"))
    return agent, asyncio.ensure_future(agent.run()), err


def sent(agent: Agent, kind: type[Message]) -> list[Message]:
    """What the agent sent of one kind, over every link it opened."""
    backend = agent.backend
    assert isinstance(backend, FakeBackend)
    return [m for link in backend.opened for m in link.sent if isinstance(m, kind)]


async def join_as_peer(hub: FakeRendezvous, agent: Agent) -> FakeLink:
    """A second node, scripted by the test: the agent's own Join with another name and address."""
    await hub.wait_until(lambda: bool(sent(agent, Join)), what="the agent's join")
    peer = hub.link("10.0.0.2")
    join = sent(agent, Join)[-1]
    assert isinstance(join, Join)
    same = ["job_id", "nproc", "min_nodes", "max_nodes", "entrypoint", "master_port", "max_restarts"]
    same += ["last_call_timeout", "heartbeat_interval", "heartbeat_timeout", "exclude_after"]
    peer.send(Join(node_id="peer", addr="10.0.0.2", **{name: getattr(join, name) for name in same}))
    return peer


def last(link: FakeLink, kind: type[Message]) -> Message | None:
    found = [m for m in link.inbox if isinstance(m, kind)]
    return found[-1] if found else None


def test_an_agent_runs_a_round_with_another_node_and_reports_its_ranks(tmp_path: Path) -> None:
    out = tmp_path / "env"
    out.mkdir()
    body = (
        "import os\n"
        f"with open(os.path.join({str(out)!r}, os.environ['RANK']), 'w') as f:\n"
        "    f.write(os.environ['WORLD_SIZE'] + ' ' + os.environ['GROUP_RANK'])\n"
    )
    cfg = agent_config(tmp_path, body, "--nnodes=2", "--nproc-per-node=2")

    async def scenario() -> tuple[AgentOutcome, Assignment]:
        hub = FakeRendezvous()
        agent, run, _ = start(cfg, hub)
        peer = await join_as_peer(hub, agent)
        await hub.wait_until(lambda: last(peer, Assignment) is not None, what="the peer's assignment")
        theirs = last(peer, Assignment)
        assert isinstance(theirs, Assignment)
        # Our workers ran and exited 0; the agent waits at the exit barrier for the peer.
        await hub.wait_until(lambda: bool(sent(agent, WorkersSucceeded)), what="our workers' success")
        assert not run.done()
        peer.send(WorkersSucceeded(round=theirs.round))
        return await asyncio.wait_for(run, 30), theirs

    outcome, theirs = asyncio.run(scenario())
    ours = 1 - theirs.group_rank
    assert (outcome.code, outcome.reason) == (st.EXIT_OK, "all nodes finished")
    assert outcome.ranks == {0: 2 * ours, 1: 2 * ours + 1}
    assert sorted(os.listdir(out)) == [str(2 * ours), str(2 * ours + 1)]
    assert (out / str(2 * ours)).read_text() == f"4 {ours}"


def test_a_worker_failure_restarts_the_workers_within_the_budget(tmp_path: Path) -> None:
    body = (
        "import os, sys\n"
        "n = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
        f"open(os.path.join({str(tmp_path)!r}, 'attempt' + n), 'w').close()\n"
        "sys.exit(3 if n == '0' else 0)\n"
    )
    cfg = agent_config(tmp_path, body, "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1")

    async def scenario() -> tuple[AgentOutcome, Agent]:
        hub = FakeRendezvous()
        agent, run, _ = start(cfg, hub)
        return await asyncio.wait_for(run, 30), agent

    outcome, agent = asyncio.run(scenario())
    assert outcome.code == st.EXIT_OK
    assert (tmp_path / "attempt0").exists() and (tmp_path / "attempt1").exists()
    failed = sent(agent, WorkersFailed)
    assert len(failed) == 1 and isinstance(failed[0], WorkersFailed) and failed[0].failure.exitcode == 3
    assert len(sent(agent, Join)) == 2 and len(sent(agent, WorkersSucceeded)) == 1


def test_a_failure_past_the_budget_is_the_outcome_with_its_root_cause(tmp_path: Path) -> None:
    cfg = agent_config(tmp_path, "import sys\nsys.exit(3)\n", "--nnodes=1", "--nproc-per-node=2")

    async def scenario() -> tuple[AgentOutcome, str]:
        hub = FakeRendezvous()
        _, run, err = start(cfg, hub)
        return await asyncio.wait_for(run, 30), err.getvalue()

    outcome, err = asyncio.run(scenario())
    assert outcome.code == st.EXIT_FAILED
    assert outcome.reason.startswith("job failed")
    assert outcome.failure is not None and outcome.failure.exitcode == 3
    assert outcome.failure.addr == "10.0.0.1"  # the link's address, as the peers would see it
    assert {f.rank for f in outcome.local_failures} <= {0, 1} and outcome.local_failures
    assert outcome.ranks == {0: 0, 1: 1}
    assert outcome.reason in err  # the same why, as the agent's last line


def test_a_drain_stops_the_workers_with_sigterm_and_leaves_a_job_that_goes_on(tmp_path: Path) -> None:
    started, termed, release = tmp_path / "started", tmp_path / "termed", tmp_path / "release"
    body = (
        "import os, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(termed)!r}, 'w').close(), sys.exit(143)))\n"
        f"open({str(started)!r}, 'w').close()\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    time.sleep(0.05)\n"
    )
    cfg = agent_config(tmp_path, body, "--nnodes=1:2", "--nproc-per-node=1")

    async def scenario() -> tuple[AgentOutcome, FakeLink]:
        hub = FakeRendezvous()
        agent, run, _ = start(cfg, hub)
        peer = await join_as_peer(hub, agent)
        try:
            await hub.wait_until(started.exists, what="the worker to start")
            hub.link_of(agent.node_id).deliver(Drain(reason="maintenance"))  # what the server's drain sends
            return await asyncio.wait_for(run, 30), peer
        finally:
            release.touch()  # whatever happened, no worker waits for ever

    outcome, peer = asyncio.run(scenario())
    assert termed.exists()  # SIGTERM: the worker could checkpoint
    assert outcome.code == st.EXIT_OK, outcome.reason  # the job goes on without this node
    assert last(peer, Restart) is not None  # the peer's round restarts without us


def test_a_lost_link_is_opened_again_and_the_round_resumes_without_a_restart(tmp_path: Path) -> None:
    starts, release = tmp_path / "starts", tmp_path / "release"
    body = (
        "import os, time\n"
        f"with open({str(starts)!r}, 'a') as f:\n"
        "    f.write('started\\n')\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    time.sleep(0.05)\n"
    )
    cfg = agent_config(tmp_path, body, "--nnodes=1", "--nproc-per-node=1")

    async def scenario() -> tuple[AgentOutcome, Agent]:
        hub = FakeRendezvous()
        agent, run, _ = start(cfg, hub)
        try:
            await hub.wait_until(starts.exists, what="the worker to start")
            hub.cut(hub.link_of(agent.node_id))
            await hub.wait_until(lambda: bool(sent(agent, Resume)), what="the agent's resume")
        finally:
            release.touch()
        return await asyncio.wait_for(run, 30), agent

    outcome, agent = asyncio.run(scenario())
    assert outcome.code == st.EXIT_OK, outcome.reason
    assert isinstance(agent.backend, FakeBackend) and len(agent.backend.opened) == 2
    assert starts.read_text() == "started\n"  # the workers ran on: nothing restarted


@pytest.mark.parametrize("nnodes", ["1", "1:2"])  # fixed-size: SIGTERM ends the run; elastic: a drain
def test_a_sigterm_during_a_long_health_check_ends_the_agent_at_once(tmp_path: Path, nnodes: str) -> None:
    pidfile = tmp_path / "check.pid"
    check = f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile} && exec sleep 600"
    cfg = agent_config(tmp_path, "print('never')\n", f"--nnodes={nnodes}", f"--health-check={check}")

    async def scenario() -> tuple[AgentOutcome, Agent]:
        hub = FakeRendezvous()
        agent, run, _ = start(cfg, hub)
        # The check runs (another process: no event to await); the agent's handlers are in place.
        await hub.wait_until(pidfile.exists, what="the health check to start", timeout=30)
        os.kill(os.getpid(), signal.SIGTERM)
        # Far less than the check's own 60 s limit: the signal does not wait for the check.
        return await asyncio.wait_for(run, 30), agent

    outcome, agent = asyncio.run(scenario())
    assert outcome.code == st.EXIT_FAILED
    assert "received SIGTERM" in outcome.reason
    assert not sent(agent, Join)  # the check never passed: this node never joined
    with pytest.raises(ProcessLookupError):  # the check's process was killed (and reaped)
        os.kill(int(pidfile.read_text()), 0)


# --- the agent's own deadlines, on a clock the test moves ------------------------------------


def on_a_test_clock(agent: Agent) -> list[float]:
    """Give the agent a clock that stands still until the test moves it (``now[0] = ...``)."""
    now = [0.0]
    agent.clock = lambda: now[0]
    return now


def past_the_deadline(agent: Agent, now: list[float], seconds: float) -> None:
    """Move the agent's clock on by ``seconds``, and wake its loop as its timer would have."""
    now[0] += seconds
    agent.events.put_nowait(st.Tick())


def test_a_rendezvous_that_never_completes_ends_at_the_join_timeout(tmp_path: Path) -> None:
    # Two nodes wanted, only this one comes: the agent gives up at join_timeout, says how many
    # had joined, and tells the server it leaves. (The live wiring of the same timer, a real
    # agent that gives up: tests/integration/test_bad_input.py, test_etcd.py, test_tls.py.)
    cfg = agent_config(tmp_path, "print('never')\n", "--nnodes=2", "--nproc-per-node=1")

    async def scenario() -> tuple[AgentOutcome, Agent, str]:
        hub = FakeRendezvous()
        agent, run, err = start(cfg, hub)
        now = on_a_test_clock(agent)
        await hub.wait_until(lambda: bool(sent(agent, Join)), what="the agent's join")
        link = hub.link_of(agent.node_id)
        await hub.wait_until(lambda: not link.inbox, what="the agent to read its Waiting")
        past_the_deadline(agent, now, cfg.rdzv_conf.join_timeout - 1)
        await asyncio.sleep(0.05)
        assert not run.done(), "gave up before the join timeout"
        past_the_deadline(agent, now, 1)
        return await asyncio.wait_for(run, 30), agent, err.getvalue()

    outcome, agent, err = asyncio.run(scenario())
    assert outcome.code == st.EXIT_RDZV
    why = "timed out after 600 s waiting for the rendezvous to complete (1 joined) (join_timeout)"
    assert outcome.reason == why and why in err
    leaves = sent(agent, Leave)
    assert len(leaves) == 1 and isinstance(leaves[0], Leave) and leaves[0].reason == "join timeout"
    assert "Traceback" not in err


def test_a_server_that_never_gives_its_verdict_does_not_hold_the_agent_forever(tmp_path: Path) -> None:
    # Moved here from tests/integration/test_attack_agent.py, where a real agent waited out a
    # 3 s join_timeout: the server takes the failure report and says nothing more.
    started, release = tmp_path / "started", tmp_path / "release"
    body = (
        "import os, sys, time\n"
        f"open({str(started)!r}, 'w').close()\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    time.sleep(0.05)\n"
        "sys.exit(1)\n"
    )
    cfg = agent_config(tmp_path, body, "--nnodes=1", "--nproc-per-node=1", "--max-restarts=3")

    async def scenario() -> tuple[AgentOutcome, Agent, str]:
        hub = FakeRendezvous()
        agent, run, err = start(cfg, hub)
        now = on_a_test_clock(agent)
        try:
            await hub.wait_until(started.exists, what="the worker to start")
            # From here the server hears the agent but answers nothing (its Restart is lost).
            hub.link_of(agent.node_id).deliver = lambda msg: None  # type: ignore[method-assign]
        finally:
            release.touch()
        await hub.wait_until(lambda: bool(sent(agent, WorkersFailed)), what="the failure report")
        past_the_deadline(agent, now, cfg.rdzv_conf.join_timeout - 1)
        await asyncio.sleep(0.05)
        assert not run.done(), "gave up before the join timeout"
        past_the_deadline(agent, now, 1)
        return await asyncio.wait_for(run, 30), agent, err.getvalue()

    outcome, agent, err = asyncio.run(scenario())
    assert outcome.code == st.EXIT_FAILED == 1  # the command's exit code
    (report,) = sent(agent, WorkersFailed)
    assert isinstance(report, WorkersFailed) and report.failure.exitcode == 1
    assert "did not answer" in err, err
    assert (
        "did not answer the report of this node's worker failure of round 0 within 600 s (join_timeout)"
        in outcome.reason
    )
    assert "Traceback" not in err
