"""Commit points, the agent's part (issue 20): the machine (machine/training.py routed by machine/agent.py)
arms, acknowledges, stops and reports a commit, and drains after one on SIGTERM. Fake clock,
fake pages: samples in, effects out. Plus the --rdzv-conf keys and the poll's wake-up."""

from __future__ import annotations

import asyncio
import io
import signal
from pathlib import Path

import pytest

from node_agent.cli.parse import parse_config
from node_agent.config import ConfigError, RdzvConf
from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from node_agent.machine.events import ProgressRead, WriteStop
from node_agent.machine.settings import machine_settings
from node_agent.machine.training import Training
from node_agent.machine.watch import HangPolicy
from node_agent.outbound import join_message
from node_agent.progress.pages import RankSample
from node_agent.progress.poll import RoundPages, poll
from node_agent.worker import layout as L
from protocol import (
    COMMIT_EARLY_S,
    COMMIT_LEAD,
    Armed,
    Assignment,
    Drain,
    Failure,
    Leave,
    LeaveAfterCommit,
    Left,
    Progress,
    Restart,
    Resumed,
    StopAt,
    WorkersCommitted,
    WorkersFailed,
    WorkersSucceeded,
)

NS = 1_000_000_000
ROUND = 4
BUDGET = 60.0  # commit_timeout


def machine(*, elastic: bool = True, commit_timeout: float = BUDGET) -> AgentMachine:
    settings = st.AgentSettings(
        node_id="n1",
        addr="10.0.0.1",
        join_timeout=10.0,
        exit_barrier_timeout=30.0,
        shutdown_timeout=5.0,
        elastic=elastic,
        reconnect_timeout=30.0,
        nproc=2,
        commit_timeout=commit_timeout,
    )
    training = Training(policy=HangPolicy.parse("off"), nproc=2, node_id="n1", addr="10.0.0.1", interval=1.0)
    m = AgentMachine(settings, training=training)
    m.start(0.0)
    a = Assignment(
        job_id="j", round=ROUND, group_rank=1, group_world_size=2, rank_offset=2, world_size=4,
        master_addr="10.0.0.9", master_port=29501, restart_count=0, max_restarts=3,
    )  # fmt: skip
    m.handle(st.ServerSent(a), 1.0)
    m.handle(st.WorkersStarted((11, 12)), 1.0)
    assert m.phase is st.Phase.RUNNING
    return m


def sample(
    step: int,
    *,
    pid: int = 11,
    checks: bool = True,
    seen: int = -1,
    seen_at: int = -1,
    stopped: int = -1,
) -> RankSample:
    return RankSample(
        step=step, progress_ns=NS, count=step + 1, phase="compute", phase_ns=NS, compute_ns=0,
        pid=pid, stack_signal=38, attached_ns=NS, checks=checks, seen=seen, seen_at=seen_at,
        stopped=stopped,
    )  # fmt: skip


def read(m: AgentMachine, now: float, a: RankSample | None, b: RankSample | None) -> list[st.Effect]:
    return m.handle(ProgressRead((a, b)), now)


def sent(effects: list[st.Effect]) -> list[object]:
    return [e.msg for e in effects if isinstance(e, st.Send)]


def armed(effects: list[st.Effect]) -> list[Armed]:
    return [msg for msg in sent(effects) if isinstance(msg, Armed)]


def logs(effects: list[st.Effect]) -> str:
    return "\n".join(e.text for e in effects if isinstance(e, st.Log))


def kinds(effects: list[st.Effect]) -> list[type]:
    return [type(e) for e in effects if not isinstance(e, st.Log)]


def checking(m: AgentMachine, now: float = 2.0, step: int = 10) -> None:
    """Both ranks train and call should_stop()."""
    read(m, now, sample(step), sample(step, pid=12))
    assert m.training is not None and m.training.checks()


def gone_for_20(seen_at: int) -> AgentMachine:
    """A machine whose ranks acknowledged step 20 at ``seen_at`` (in time) and heard go."""
    m = machine()
    checking(m)
    m.handle(st.ServerSent(StopAt(round=ROUND, step=20, state="arm")), 3.0)
    read(
        m, 3.02, sample(seen_at, seen=20, seen_at=seen_at), sample(seen_at, pid=12, seen=20, seen_at=seen_at)
    )
    m.handle(st.ServerSent(StopAt(round=ROUND, step=20, state="go")), 3.1)
    return m


def committed(m: AgentMachine, step: int = 20, now: float = 3.0) -> list[st.Effect]:
    """Arm step ``step``, both ranks acknowledge in time, go, both stop there and exit 0."""
    m.handle(st.ServerSent(StopAt(round=ROUND, step=step, state="arm")), now)
    eff = read(m, now + 0.02, sample(15, seen=step, seen_at=15), sample(16, pid=12, seen=step, seen_at=16))
    assert Armed(round=ROUND, step=step, late=False, checked=16) in sent(eff)
    m.handle(st.ServerSent(StopAt(round=ROUND, step=step, state="go")), now + 0.1)
    done = (
        sample(step, seen=step, seen_at=15, stopped=step),
        sample(step, pid=12, seen=step, seen_at=16, stopped=step),
    )
    read(m, now + 0.5, *done)  # the runner's read as the workers exit
    return m.handle(st.WorkersExited(None), now + 0.5)


# --- arm, acknowledgements, go, cancel ------------------------------------------------------


def test_progress_says_whether_every_local_rank_calls_should_stop() -> None:
    m = machine()
    first = [
        p for p in sent(read(m, 2.0, sample(1, checks=False), sample(1, pid=12))) if isinstance(p, Progress)
    ]
    assert [p.checks for p in first] == [False]  # one rank does not call it: no commits
    # Both do now: said at the next summary even though no step moved.
    later = sent(read(m, 3.5, sample(1), sample(1, pid=12)))
    assert [p.checks for p in later if isinstance(p, Progress)] == [True]
    # A torn read (None) keeps the rank's last whole sample: still every rank checks.
    assert m.training is not None
    read(m, 4.0, None, sample(2, pid=12))
    assert m.training.checks()


def test_arm_writes_the_pages_and_says_armed_only_once_every_rank_saw_the_step() -> None:
    m = machine()
    checking(m)
    eff = m.handle(st.ServerSent(StopAt(round=ROUND, step=20, state="arm")), 3.0)
    assert [e for e in eff if isinstance(e, WriteStop)] == [WriteStop(20, L.STOP_ARMED)]
    assert "stop at step 20" in logs(eff)
    assert m.training is not None and m.training.arming == 20  # the runner polls fast meanwhile
    # Rank 2 (local 0) saw it, rank 3 not yet; then rank 3 is not attached (None): no answer.
    assert not armed(read(m, 3.02, sample(12, seen=20, seen_at=12), sample(12, pid=12)))
    assert not armed(read(m, 3.04, sample(12, seen=20, seen_at=12), None))
    eff = read(m, 3.06, sample(13, seen=20, seen_at=12), sample(13, pid=12, seen=20, seen_at=13))
    assert [msg for msg in sent(eff) if isinstance(msg, Armed)] == [
        Armed(round=ROUND, step=20, late=False, checked=13)
    ]
    assert m.training.arming is None
    # Said once.
    eff = read(m, 3.08, sample(14, seen=20, seen_at=12), sample(14, pid=12, seen=20, seen_at=13))
    assert not [msg for msg in sent(eff) if isinstance(msg, Armed)]


def test_a_rank_already_at_or_past_the_step_makes_the_answer_late() -> None:
    m = machine()
    checking(m)
    m.handle(st.ServerSent(StopAt(round=ROUND, step=20, state="arm")), 3.0)
    eff = read(m, 3.02, sample(19, seen=20, seen_at=19), sample(22, pid=12, seen=20, seen_at=21))
    (armed,) = [msg for msg in sent(eff) if isinstance(msg, Armed)]
    assert armed == Armed(round=ROUND, step=20, late=True, checked=21)


def test_go_and_cancel_are_written_into_the_pages() -> None:
    m = machine()
    checking(m)
    m.handle(st.ServerSent(StopAt(round=ROUND, step=20, state="arm")), 3.0)
    eff = m.handle(st.ServerSent(StopAt(round=ROUND, step=20, state="cancel")), 3.5)
    assert [e for e in eff if isinstance(e, WriteStop)] == [WriteStop(-1, L.STOP_NONE)]
    assert m.training is not None and m.training.arming is None  # no answer is awaited any more
    assert not armed(read(m, 3.6, sample(15, seen=20, seen_at=15), sample(15, pid=12, seen=20, seen_at=15)))
    m.handle(st.ServerSent(StopAt(round=ROUND, step=30, state="arm")), 4.0)
    eff = m.handle(st.ServerSent(StopAt(round=ROUND, step=30, state="go")), 4.5)
    assert [e for e in eff if isinstance(e, WriteStop)] == [WriteStop(30, L.STOP_GO)]


def test_a_stop_for_another_round_or_while_the_workers_stop_is_ignored() -> None:
    m = machine()
    checking(m)
    assert m.handle(st.ServerSent(StopAt(round=ROUND + 1, step=20, state="arm")), 3.0) == []
    assert m.handle(st.ServerSent(StopAt(round=ROUND - 1, step=20, state="go")), 3.0) == []
    m.handle(st.ServerSent(Restart(round=ROUND, reason="node x joined", restart_count=1)), 3.5)
    assert m.phase is st.Phase.STOPPING
    assert m.handle(st.ServerSent(StopAt(round=ROUND, step=20, state="arm")), 4.0) == []


# --- the committed exit ---------------------------------------------------------------------


def test_workers_that_stopped_at_the_step_report_a_commit_then_rejoin_on_restart() -> None:
    m = machine()
    checking(m)
    eff = committed(m, 20)
    assert sent(eff) == [WorkersCommitted(round=ROUND, step=20)]  # not WorkersSucceeded
    assert "workers stopped at step 20 (a commit point); waiting for the next round" in logs(eff)
    assert m.phase is st.Phase.BARRIER
    eff = m.handle(st.ServerSent(Restart(round=ROUND, reason="node x joined", restart_count=0)), 4.0)
    assert kinds(eff) == [st.SendJoin] and m.phase is st.Phase.JOINING


def test_workers_that_finished_on_their_own_during_a_commit_succeed_as_before() -> None:
    m = gone_for_20(seen_at=15)
    # Neither rank stopped for the commit: the training ended by itself (its last step).
    read(m, 3.5, sample(19, seen=20, seen_at=15), sample(19, pid=12, seen=20, seen_at=15))
    # (its last step 1.5 s before the exit, by the pages' own time: the goodput's end of training)
    assert sent(m.handle(st.WorkersExited(None), 3.5)) == [WorkersSucceeded(round=ROUND, idle_ms=1500.0)]


def test_a_rank_that_ended_at_the_step_the_others_stopped_at_is_a_commit_there() -> None:
    m = gone_for_20(seen_at=15)
    # Rank 3 stopped at 20; rank 2's script returned on its own at 20 (its last step).
    read(m, 3.5, sample(20, seen=20, seen_at=15), sample(20, pid=12, seen=20, seen_at=15, stopped=20))
    assert sent(m.handle(st.WorkersExited(None), 3.5)) == [WorkersCommitted(round=ROUND, step=20)]


def test_ranks_that_check_every_few_steps_commit_at_their_first_check_past_s() -> None:
    """The script calls should_stop() every 10 steps: S = 20 is acknowledged at 19 (in time),
    and every rank stops at 29, its next call. That is a commit at 29, never a success."""
    m = gone_for_20(seen_at=19)
    read(
        m,
        3.5,
        sample(29, seen=20, seen_at=19, stopped=29),
        sample(29, pid=12, seen=20, seen_at=19, stopped=29),
    )
    eff = m.handle(st.WorkersExited(None), 3.5)
    assert sent(eff) == [WorkersCommitted(round=ROUND, step=29)]
    assert m.phase is st.Phase.BARRIER


def test_ranks_that_stopped_at_different_steps_are_a_failure_never_a_success() -> None:
    m = gone_for_20(seen_at=15)
    read(
        m,
        3.5,
        sample(20, seen=20, seen_at=15, stopped=20),
        sample(29, pid=12, seen=20, seen_at=15, stopped=29),
    )
    (failed,) = sent(m.handle(st.WorkersExited(None), 3.5))
    assert isinstance(failed, WorkersFailed)
    assert "did not all stop at one step" in failed.failure.message
    assert "local rank 0 stopped at step 20, local rank 1 stopped at step 29" in failed.failure.message


def test_no_next_round_after_a_commit_ends_the_agent_with_a_rendezvous_error() -> None:
    m = machine()
    checking(m)
    committed(m, 20, now=3.0)
    assert m.handle(st.Tick(), 3.5 + 9.9) == []
    eff = m.handle(st.Tick(), 3.5 + 10.0)  # join_timeout
    (ex,) = [e for e in eff if isinstance(e, st.Exit)]
    assert ex.code == st.EXIT_RDZV
    assert ex.reason == (
        "workers stopped at step 20 (a commit point), but the rendezvous server did not start the "
        "next round within 10 s (join_timeout)"
    )
    assert [type(msg) for msg in sent(eff)] == [Leave]


def test_a_reconnect_after_a_commit_says_committed_again_not_succeeded() -> None:
    m = machine()
    checking(m)
    committed(m, 20)
    m.handle(st.ConnectionLost("reset"), 4.0)
    eff = m.handle(st.Reconnected(), 5.0)
    (resume,) = [e for e in eff if isinstance(e, st.SendResume)]
    assert resume.succeeded is False  # the job's work is not done
    eff = m.handle(st.ServerSent(Resumed(job_id="j", round=ROUND)), 5.1)
    assert sent(eff) == [WorkersCommitted(round=ROUND, step=20)]


def test_losing_the_server_after_a_commit_is_no_success() -> None:
    m = machine()
    checking(m)
    committed(m, 20)
    m.handle(st.ConnectionLost("reset"), 4.0)
    eff = m.handle(st.ReconnectFailed("refused"), 34.0)
    (ex,) = [e for e in eff if isinstance(e, st.Exit)]
    assert ex.code == st.EXIT_RDZV and "refused" in ex.reason


def test_an_armed_answer_found_while_away_is_said_once_back() -> None:
    m = machine()
    checking(m)
    m.handle(st.ServerSent(StopAt(round=ROUND, step=20, state="arm")), 3.0)
    m.handle(st.ConnectionLost("reset"), 3.01)
    acked = (sample(15, seen=20, seen_at=15), sample(15, pid=12, seen=20, seen_at=14))
    assert not sent(read(m, 3.02, *acked))
    m.handle(st.Reconnected(), 3.5)
    assert not sent(read(m, 3.52, *acked))  # our Resume is not answered yet
    m.handle(st.ServerSent(Resumed(job_id="j", round=ROUND)), 3.6)
    eff = read(m, 3.62, *acked)
    assert Armed(round=ROUND, step=20, late=False, checked=15) in sent(eff)


# --- SIGTERM: drain after a commit ----------------------------------------------------------


def test_sigterm_asks_for_a_commit_and_leaves_once_the_server_drains_us() -> None:
    m = machine()
    checking(m)
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 2.5)
    assert kinds(eff) == [st.Send]  # no StopWorkers: they run on to the commit point
    assert sent(eff) == [LeaveAfterCommit(round=ROUND, reason="drain: received SIGTERM")]
    assert "commit point" in logs(eff) and m.phase is st.Phase.RUNNING
    eff = committed(m, 20, now=3.0)
    assert sent(eff) == [WorkersCommitted(round=ROUND, step=20)]
    eff = m.handle(st.ServerSent(Drain(reason="committed at step 20")), 4.0)
    assert m.phase is st.Phase.LEAVING
    assert sent(eff) == [Leave(reason="drain: received SIGTERM")]
    (ex,) = m.handle(st.ServerSent(Left(job_continues=True, reason="2 nodes left")), 4.1)
    assert (
        isinstance(ex, st.Exit)
        and ex.code == st.EXIT_OK
        and ex.reason.startswith("drained: received SIGTERM")
    )


def test_sigterm_without_should_stop_drains_at_once_as_before() -> None:
    for m in (machine(), machine(commit_timeout=0.0)):
        checks = m.settings.commit_timeout == 0
        read(m, 2.0, sample(10), sample(10, pid=12, checks=checks))
        late = COMMIT_EARLY_S  # the ranks have reported for a while (see the early test below)
        read(m, 2.0 + late, sample(11), sample(11, pid=12, checks=checks))
        eff = m.handle(st.SignalReceived(signal.SIGTERM), 2.5 + late)
        assert kinds(eff) == [st.StopWorkers, st.Send]
        assert sent(eff) == [Leave(reason="drain: received SIGTERM", workers_stopping=True)]
        assert m.phase is st.Phase.STOPPING


def test_no_drain_from_the_server_within_the_budget_drains_by_itself() -> None:
    m = machine()
    checking(m)
    m.handle(st.SignalReceived(signal.SIGTERM), 2.5)
    assert m.next_deadline() == 2.5 + BUDGET + COMMIT_LEAD
    assert m.handle(st.Tick(), 2.5 + BUDGET) == []
    eff = m.handle(st.Tick(), 2.5 + BUDGET + COMMIT_LEAD)
    assert kinds(eff) == [st.StopWorkers, st.Send] and m.phase is st.Phase.STOPPING
    assert "no drain from the rendezvous server within 61 s" in logs(eff)
    eff = m.handle(st.WorkersStopped(), 70.0)
    assert sent(eff) == [Leave(reason="drain: received SIGTERM")] and m.phase is st.Phase.LEAVING


def test_a_second_sigterm_drains_at_once() -> None:
    m = machine()
    checking(m)
    m.handle(st.SignalReceived(signal.SIGTERM), 2.5)
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 3.0)
    assert kinds(eff) == [st.StopWorkers, st.Send] and m.phase is st.Phase.STOPPING
    assert m.next_deadline() is None  # the commit budget no longer runs


def test_a_restart_while_waiting_for_the_commit_drains_instead_of_rejoining() -> None:
    m = machine()
    checking(m)
    m.handle(st.SignalReceived(signal.SIGTERM), 2.5)
    eff = m.handle(st.ServerSent(Restart(round=ROUND, reason="node 3 failed", restart_count=1)), 3.0)
    assert kinds(eff) == [st.StopWorkers, st.Send]
    eff = m.handle(st.WorkersStopped(), 4.0)
    assert kinds(eff) == [st.Send] and sent(eff) == [Leave(reason="drain: received SIGTERM")]


def test_a_worker_failure_while_waiting_for_the_commit_is_reported_then_the_node_leaves() -> None:
    m = machine()
    checking(m)
    m.handle(st.SignalReceived(signal.SIGTERM), 2.5)
    f = Failure(node_id="n1", addr="10.0.0.1", rank=3, local_rank=1, exitcode=1, timestamp=3.0)
    eff = m.handle(st.WorkersExited(f, (f,)), 3.0)
    assert [type(msg) for msg in sent(eff)] == [WorkersFailed, Leave]
    m.handle(st.WorkersStopped(), 4.0)
    assert m.phase is st.Phase.LEAVING


def test_a_reconnect_while_waiting_for_the_commit_asks_again() -> None:
    m = machine()
    checking(m)
    m.handle(st.SignalReceived(signal.SIGTERM), 2.5)
    m.handle(st.ConnectionLost("reset"), 3.0)
    m.handle(st.Reconnected(), 4.0)
    eff = m.handle(st.ServerSent(Resumed(job_id="j", round=ROUND)), 4.1)
    assert sent(eff) == [LeaveAfterCommit(round=ROUND, reason="drain: received SIGTERM")]


# --- configuration --------------------------------------------------------------------------


def test_commit_keys_parse_and_travel_in_the_join_and_the_settings(tmp_path: Path) -> None:
    assert (RdzvConf().commit_timeout, RdzvConf().commit_steps) == (300.0, 0)
    conf = RdzvConf.parse("commit_timeout=90.5,commit_steps=4")
    assert (conf.commit_timeout, conf.commit_steps) == (90.5, 4)
    assert RdzvConf.parse("commit_timeout=0").commit_timeout == 0.0  # commits off
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    common = [
        "--rdzv-endpoint=x.invalid:29400",
        "--rdzv-id=j",
        "--rdzv-conf=commit_timeout=90,commit_steps=4",
    ]
    cfg = parse_config(["--nnodes=1:2", *common, str(script)], {"PATH": "/usr/bin"})
    join = join_message(cfg, node_id="n", addr="10.0.0.1", proof="", node_secret="")
    assert (join.commit_timeout, join.commit_steps) == (90.0, 4)
    assert (
        machine_settings(
            cfg, node_id="n", addr="a", reconnects=True, environ={}, wall_offset=0.0
        ).commit_timeout
        == 90.0
    )
    # A fixed-size job's SIGTERM is no drain: it never asks for a commit.
    fixed = parse_config(["--nnodes=2", *common, str(script)], {"PATH": "/usr/bin"})
    assert (
        machine_settings(
            fixed, node_id="n", addr="a", reconnects=True, environ={}, wall_offset=0.0
        ).commit_timeout
        == 0.0
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("commit_timeout=-1", "commit_timeout=-1 must be in 0..1e+07 seconds"),
        ("commit_timeout=soon", "commit_timeout='soon' is not a number"),
        ("commit_timeout=nan", "commit_timeout='nan' must be a finite number"),
        ("commit_steps=-2", "commit_steps=-2 must be in 0..1000000"),
        ("commit_steps=2.5", "commit_steps='2.5' is not an integer"),
    ],
)
def test_bad_commit_keys_are_refused_clearly(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        RdzvConf.parse(text)
    assert needle in str(info.value)


# --- the runner's side: a written stop record wakes the poll --------------------------------


def test_a_stop_record_is_written_and_the_poll_reads_at_once(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"page{i}") for i in range(2)]
    pages = RoundPages(paths, 0, str(tmp_path / "fr"), str(tmp_path / "report.txt"))

    async def scenario() -> int:
        got: asyncio.Queue[ProgressRead] = asyncio.Queue()
        task = asyncio.ensure_future(poll(pages, lambda: 3600.0, got.put_nowait))
        await asyncio.sleep(0)
        pages.write_stop(WriteStop(20, L.STOP_ARMED))
        await asyncio.wait_for(got.get(), 30)  # not an hour: the write woke the poll
        task.cancel()
        return 0

    try:
        asyncio.run(scenario())
        for p in paths:
            data = Path(p).read_bytes()
            step, state, _serial, chk = L.STOP.unpack_from(data, L.STOP_OFFSET)
            assert (step, state, chk) == (20, L.STOP_ARMED, L.check(20, L.STOP_ARMED, 0))
    finally:
        pages.close()


# --- one agent, real workers and pages: arm, acknowledge, go, commit -----------------------


def test_real_workers_stop_at_the_armed_step_and_the_agent_reports_the_commit(tmp_path: Path) -> None:
    """Two real ranks call ``should_stop()``; the StopAt messages are the server's (delivered on
    the agent's link). The ranks are held at step 40 until the test lets them go on, so the
    acknowledgement is in time whatever the machine's load."""
    from node_agent.rdzv.fake import FakeRendezvous
    from node_agent.runner import Agent

    release = tmp_path / "release"
    body = (
        "import os, sys, time\n"
        "from node_agent import worker\n"
        f"out = os.path.join({str(tmp_path)!r}, 'stopped-' + os.environ['LOCAL_RANK'])\n"
        "if os.path.exists(out):\n"
        "    sys.exit(0)  # the round after the commit: nothing left to do\n"
        "step = 0\n"
        "while True:\n"
        f"    if step < 40 or os.path.exists({str(release)!r}):\n"
        "        step += 1\n"
        "    worker.progress(step)\n"
        "    if worker.should_stop():\n"
        "        open(out, 'w').write(str(step))\n"
        "        sys.exit(0)\n"
        "    if step > 1000:\n"
        "        sys.exit(5)  # never asked to stop\n"
        "    time.sleep(0.01)\n"
    )
    script = tmp_path / "train.py"
    script.write_text(body)
    argv = ["--nnodes=1", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-endpoint=fake.invalid:29400"]
    argv += ["--rdzv-id=job", f"--log-dir={tmp_path / 'logs'}", str(script)]
    cfg = parse_config(argv, {"PATH": "/usr/bin:/bin"})

    async def scenario() -> tuple[int, list[object]]:
        hub = FakeRendezvous()
        agent = Agent(
            cfg, stdout=io.StringIO(), stderr=io.StringIO(), backend=hub.backend(local_ip="10.0.0.1")
        )
        run = asyncio.ensure_future(agent.run())
        backend = agent.backend
        assert backend is not None

        def out() -> list[object]:
            return [m for link in backend.opened for m in link.sent]  # type: ignore[attr-defined]

        try:
            await hub.wait_until(
                lambda: any(isinstance(m, Progress) and m.checks for m in out()),
                what="a Progress with checks",
            )
            a = agent._assignment  # the round the workers run
            assert a is not None
            link = hub.link_of(agent.node_id)
            link.deliver(StopAt(round=a.round, step=50, state="arm"))
            await hub.wait_until(lambda: any(isinstance(m, Armed) for m in out()), what="the Armed answer")
            link.deliver(StopAt(round=a.round, step=50, state="go"))
            release.touch()
            await hub.wait_until(
                lambda: any(isinstance(m, WorkersCommitted) for m in out()), what="the committed workers"
            )
            outcome = await asyncio.wait_for(run, 30)
            return outcome.code, out()
        finally:
            release.touch()
            if not run.done():
                run.cancel()

    code, msgs = asyncio.run(scenario())
    (armed_,) = [m for m in msgs if isinstance(m, Armed)]
    assert armed_.step == 50 and not armed_.late and 0 <= armed_.checked <= 40
    assert [m.step for m in msgs if isinstance(m, WorkersCommitted)] == [50]
    assert (tmp_path / "stopped-0").read_text() == (tmp_path / "stopped-1").read_text() == "50"
    assert code == st.EXIT_OK


def test_a_drain_waits_as_long_as_the_servers_commit_deadline() -> None:
    """Slow steps: the armed step lies further ahead than the lead covers. The agent's own
    drain deadline moves to the server's (the steps to it at our step times, the lead, the
    budget), so the checkpoint at that step is not cut off by our own clock."""

    def at(now: float, step: int, pid: int) -> RankSample:
        return RankSample(
            step=step, progress_ns=int(now * NS), count=step + 1, phase="compute", phase_ns=NS,
            compute_ns=0, pid=pid, stack_signal=38, attached_ns=NS, checks=True,
        )  # fmt: skip

    m = machine()
    for i, now in enumerate((2.0, 12.0, 22.0)):  # a step every 10 s
        read(m, now, at(now, 10 + i, 11), at(now, 10 + i, 12))
    m.handle(st.SignalReceived(signal.SIGTERM), 22.5)
    assert m.next_deadline() == 22.5 + BUDGET + COMMIT_LEAD
    m.handle(st.ServerSent(StopAt(round=ROUND, step=17, state="arm")), 23.0)
    assert m.next_deadline() == pytest.approx(23.0 + 5 * 10.0 + COMMIT_LEAD + BUDGET)
    assert m.handle(st.Tick(), 22.5 + BUDGET + COMMIT_LEAD) == []  # the first deadline passes
    eff = m.handle(st.Tick(), 23.0 + 5 * 10.0 + COMMIT_LEAD + BUDGET)
    assert kinds(eff) == [st.StopWorkers, st.Send] and m.phase is st.Phase.STOPPING
    assert "no drain from the rendezvous server within 111.5 s" in logs(eff)  # from the SIGTERM


def test_a_drain_waits_exactly_the_deadline_the_server_says() -> None:
    """StopAt carries the seconds left to the commit's one deadline: the draining agent waits
    that long (and a second for the message), re-asks included, never less, never its own."""
    m = machine()
    checking(m)
    m.handle(st.SignalReceived(signal.SIGTERM), 2.5)
    m.handle(st.ServerSent(StopAt(round=ROUND, step=30, state="arm", deadline_s=200.0)), 3.0)
    assert m.next_deadline() == 3.0 + 200.0 + 1.0
    # A re-ask for a later step: the same deadline, less time left.
    m.handle(st.ServerSent(StopAt(round=ROUND, step=40, state="arm", deadline_s=190.0)), 13.0)
    assert m.next_deadline() == 3.0 + 200.0 + 1.0
    assert m.handle(st.Tick(), 203.9) == []
    eff = m.handle(st.Tick(), 204.0)
    assert kinds(eff) == [st.StopWorkers, st.Send] and m.phase is st.Phase.STOPPING


def test_an_early_sigterm_asks_for_a_commit_before_its_ranks_said_they_check() -> None:
    """In the round's first seconds a rank may not have called should_stop() yet: the agent
    asks the server for a commit anyway (the server waits for every node's summary, or drains
    us at once if the job cannot commit)."""
    m = machine()
    read(m, 2.0, sample(0, checks=False), sample(0, pid=12, checks=False))
    eff = m.handle(st.SignalReceived(signal.SIGTERM), 2.5)
    assert [type(x) for x in sent(eff)] == [LeaveAfterCommit]
    assert m.phase is st.Phase.RUNNING
    eff = m.handle(st.ServerSent(Drain(reason="no commit point")), 3.0)
    assert kinds(eff)[0] is st.StopWorkers
