"""The agent machine watching its ranks' training (machine/training.py routed by machine/agent.py): progress
summaries, a hang found and turned into a failure after the stacks, another node's hang, the
step a failure reports, and a crash loop's exit code. Fake clock, fake pages: samples in."""

from __future__ import annotations

import signal
from dataclasses import replace

from node_agent.machine import events as st
from node_agent.machine.agent import AgentMachine
from node_agent.machine.events import DumpStacks, JobHangReport, ProgressRead, StacksDumped
from node_agent.machine.training import JOB_REPORT_TITLE, Training
from node_agent.machine.watch import HangPolicy
from node_agent.progress.pages import RankSample
from protocol import (
    Assignment,
    CollectStacks,
    Failure,
    HangDetected,
    JobFailed,
    Progress,
    Restart,
    Stacks,
    WorkersFailed,
    WorkersSucceeded,
)

NS = 1_000_000_000


def machine(timeout: str = "3") -> AgentMachine:
    settings = st.AgentSettings(
        node_id="n1",
        addr="10.0.0.1",
        join_timeout=10.0,
        exit_barrier_timeout=30.0,
        shutdown_timeout=5.0,
        nproc=2,
    )
    training = Training(
        policy=HangPolicy.parse(timeout), nproc=2, node_id="n1", addr="10.0.0.1", interval=1.0
    )
    m = AgentMachine(settings, training=training)
    m.start(0.0)
    a = Assignment(
        job_id="j", round=4, group_rank=1, group_world_size=2, rank_offset=2, world_size=4,
        master_addr="10.0.0.9", master_port=29501, restart_count=0, max_restarts=3,
    )  # fmt: skip
    m.handle(st.ServerSent(a), 1.0)
    m.handle(st.WorkersStarted((11, 12)), 1.0)
    assert m.phase is st.Phase.RUNNING
    return m


def sample(step: int, at: float, phase: str = "compute", compute_s: float = 0.0, pid: int = 11) -> RankSample:
    return RankSample(
        step=step, progress_ns=int(at * NS), count=step + 1, phase=phase, phase_ns=int(at * NS),
        compute_ns=int(compute_s * NS), pid=pid, stack_signal=38, attached_ns=NS,
    )  # fmt: skip


def read(m: AgentMachine, now: float, *samples: RankSample | None) -> list[st.Effect]:
    return m.handle(ProgressRead(tuple(samples)), now)


def sent(effects: list[st.Effect]) -> list[object]:
    return [e.msg for e in effects if isinstance(e, st.Send)]


def train(m: AgentMachine, steps: int, t0: float = 2.0, dt: float = 0.1) -> float:
    """Both ranks report ``steps`` steps, ``dt`` apart; returns the time of the last read."""
    now = t0
    for step in range(steps):
        now = t0 + step * dt
        read(
            m, now, sample(step, now, compute_s=step * 0.05), sample(step, now, compute_s=step * 0.05, pid=12)
        )
    return now


def test_progress_goes_to_the_server_at_most_once_per_interval_and_only_when_it_moved() -> None:
    m = machine()
    summaries = []
    now = 2.0
    for step in range(30):  # 3 s of steps, 0.1 s apart
        now = 2.0 + step * 0.1
        eff = read(m, now, sample(step, now), sample(step, now, pid=12))
        summaries += [msg for msg in sent(eff) if isinstance(msg, Progress)]
    assert 3 <= len(summaries) <= 4  # one per heartbeat interval (1 s), not one per read
    last = summaries[-1]
    assert last.round == 4 and last.max_step >= 20 and last.phase == "compute"
    # The steps since the last summary go once the interval has passed; then nothing moves and
    # nothing is sent, however many reads (the server ages the last summary itself).
    (pending,) = [m_ for m_ in sent(read(m, now + 1.0, sample(29, now), sample(29, now, pid=12)))]
    assert isinstance(pending, Progress) and pending.max_step == 29
    quiet = [read(m, now + 2.5 + i * 0.5, sample(29, now), sample(29, now, pid=12)) for i in range(5)]
    assert not [msg for eff in quiet for msg in sent(eff) if isinstance(msg, Progress)]


def test_a_hang_is_reported_its_stacks_collected_then_it_is_this_nodes_failure() -> None:
    m = machine("3")
    now = train(m, 20)
    # Rank 3 (local 1) stops at step 19; rank 2 goes on reporting.
    eff = []
    t = now
    while not any(isinstance(e, DumpStacks) for e in eff):
        t += 0.5
        assert t < now + 10, "no hang found within the 3 s budget"
        eff = read(m, t, sample(int(t * 10), t), sample(19, now, pid=12))
    assert t - now >= 3  # not before its budget
    (hang,) = [msg for msg in sent(eff) if isinstance(msg, HangDetected)]
    assert hang.ranks == (3,) and hang.step == 19 and hang.round == 4
    (dump,) = [e for e in eff if isinstance(e, DumpStacks)]
    assert [h.local_rank for h in dump.hung] == [1]
    logged = " ".join(e.text for e in eff if isinstance(e, st.Log))
    assert "hang: rank 3 (local 1): no progress for" in logged and "last step 19" in logged
    # The workers still run while the stacks are collected; a second hung read changes nothing.
    assert m.phase is st.Phase.RUNNING
    assert not [e for e in read(m, t + 0.5, None, sample(19, now, pid=12)) if isinstance(e, DumpStacks)]
    stacks = Stacks(round=4, ranks=(3, 2), steps=(19, 40), phases=("compute", "compute"), silent_s=(3.5, 0.0),
                    stacks=("stuck", "all_reduce"))  # fmt: skip
    eff = m.handle(StacksDumped(stacks=stacks, report="REPORT TEXT", path="/logs/hang_report.txt"), t + 1)
    msgs = sent(eff)
    assert msgs[0] == stacks
    (failed,) = [msg for msg in msgs if isinstance(msg, WorkersFailed)]
    assert failed.round == 4 and failed.failure.rank == 3 and failed.step == int(t * 10)  # rank 2's last
    assert failed.failure.message.startswith("hang: rank 3")
    assert "/logs/hang_report.txt" in failed.failure.message and "REPORT TEXT" in failed.failure.message
    assert any(isinstance(e, st.StopWorkers) and e.signum == signal.SIGTERM for e in eff)
    assert m.phase is st.Phase.STOPPING
    # Stopping: the ranks' silence from now on is no hang.
    assert read(m, t + 60, None, None) == []


def test_a_hung_rank_that_progressed_while_its_stacks_were_collected_was_slow_and_is_no_failure() -> None:
    # A loaded node: rank 3 (local 1) starved past its 3 s budget, then stepped on while the
    # stacks were collected. A restart would cost more than the slow step did.
    m = machine("3")
    now = train(m, 20)
    eff: list[st.Effect] = []
    t = now
    while not any(isinstance(e, DumpStacks) for e in eff):
        t += 0.5
        eff = read(m, t, sample(int(t * 10), t), sample(19, now, pid=12))
    read(m, t + 0.2, sample(int(t * 10) + 2, t + 0.2), sample(20, t + 0.2, pid=12))  # it moved on
    stacks = Stacks(round=4, ranks=(3, 2), steps=(19, 40), phases=("compute", "compute"), silent_s=(3.5, 0.0),
                    stacks=("slow", "all_reduce"))  # fmt: skip
    eff = m.handle(StacksDumped(stacks=stacks, report="R", path=""), t + 0.3)
    assert sent(eff) == [stacks]  # the stacks, no failure
    assert not [e for e in eff if isinstance(e, st.StopWorkers)] and m.phase is st.Phase.RUNNING
    (line,) = [e.text for e in eff if isinstance(e, st.Log)]
    assert line.startswith("rank 3 made progress again while the stacks were collected: slow, not hung")
    # Watched again: a later silence past the budget is a new hang, and without progress this
    # time it is the node's failure.
    t2 = t + 0.3
    eff = []
    while not any(isinstance(e, DumpStacks) for e in eff):
        t2 += 0.5
        assert t2 < t + 10, "the rank is no longer watched"
        eff = read(m, t2, sample(int(t2 * 10), t2), sample(20, t + 0.2, pid=12))
    eff = m.handle(StacksDumped(stacks=stacks, report="R", path=""), t2 + 0.3)
    assert any(isinstance(msg, WorkersFailed) for msg in sent(eff))


def test_another_nodes_hang_asks_for_our_stacks_and_nothing_else() -> None:
    m = machine("off")
    train(m, 5)
    eff = m.handle(st.ServerSent(CollectStacks(round=4, reason="rank 0 on node n2 hung")), 3.0)
    (dump,) = [e for e in eff if isinstance(e, DumpStacks)]
    assert dump.hung == () and dump.round == 4
    # Asked again while collecting, or for another round: nothing more.
    assert not [e for e in m.handle(st.ServerSent(CollectStacks(round=4)), 3.1) if isinstance(e, DumpStacks)]
    stacks = Stacks(
        round=4, ranks=(2, 3), steps=(4, 4), phases=("", ""), silent_s=(0.0, 0.0), stacks=("a", "b")
    )
    eff = m.handle(StacksDumped(stacks=stacks, report="", path=""), 4.0)
    assert sent(eff) == [stacks]
    assert m.phase is st.Phase.RUNNING  # its workers run until the server's Restart
    assert not [e for e in m.handle(st.ServerSent(CollectStacks(round=3)), 4.1) if isinstance(e, DumpStacks)]
    eff = m.handle(st.ServerSent(Restart(round=4, reason="rank 0 hung", restart_count=1)), 5.0)
    assert any(isinstance(e, st.StopWorkers) for e in eff)


def test_a_round_that_moved_on_while_we_collected_is_not_failed_again() -> None:
    m = machine("2")
    now = train(m, 10)
    eff = read(m, now + 5, sample(9, now), sample(9, now, pid=12))
    assert any(isinstance(e, DumpStacks) for e in eff)
    m.handle(st.ServerSent(Restart(round=4, reason="node n2 hung first", restart_count=1)), now + 5.1)
    stacks = Stacks(round=4, ranks=(2,), steps=(9,), phases=("",), silent_s=(5.0,), stacks=("x",))
    eff = m.handle(StacksDumped(stacks=stacks, report="r", path=""), now + 6)
    assert sent(eff) == [stacks]  # the evidence still goes; no failure of ours is added
    assert not any(isinstance(e, st.StopWorkers) for e in eff)


def test_an_ordinary_failure_reports_the_highest_step_its_ranks_reached() -> None:
    m = machine("off")
    train(m, 12)
    f = Failure(node_id="n1", addr="10.0.0.1", rank=2, local_rank=0, exitcode=1, timestamp=9.0)
    eff = m.handle(st.WorkersExited(f, (f,)), 9.0)
    (failed,) = [msg for msg in sent(eff) if isinstance(msg, WorkersFailed)]
    assert failed.step == 11


def test_a_crash_loop_ends_the_agent_with_its_own_exit_code() -> None:
    m = machine()
    m.handle(
        st.ServerSent(JobFailed(reason="3 restarts in a row made no step progress", code="crash_loop")), 3.0
    )
    (ex,) = [e for e in m.handle(st.WorkersStopped(), 4.0) if isinstance(e, st.Exit)]
    assert ex.code == st.EXIT_CRASH_LOOP == 3
    assert "crash loop" in ex.reason and "no step progress" in ex.reason
    plain = machine()
    plain.handle(st.ServerSent(JobFailed(reason="max restarts reached")), 3.0)
    (ex,) = [e for e in plain.handle(st.WorkersStopped(), 4.0) if isinstance(e, st.Exit)]
    assert ex.code == st.EXIT_FAILED


def test_our_hang_found_while_collecting_for_another_node_is_collected_again_then_failed() -> None:
    m = machine("2")
    now = train(m, 10)
    (first,) = [
        e for e in m.handle(st.ServerSent(CollectStacks(round=4)), now + 0.1) if isinstance(e, DumpStacks)
    ]
    assert first.hung == ()
    eff = read(m, now + 5, sample(9, now), sample(9, now, pid=12))  # our ranks hang meanwhile
    assert [msg for msg in sent(eff) if isinstance(msg, HangDetected)]
    assert not [e for e in eff if isinstance(e, DumpStacks)]  # one collection at a time
    stacks = Stacks(
        round=4, ranks=(2, 3), steps=(9, 9), phases=("", ""), silent_s=(0.0, 0.0), stacks=("a", "b")
    )
    eff = m.handle(StacksDumped(stacks=stacks, report="", path=""), now + 6)
    (again,) = [e for e in eff if isinstance(e, DumpStacks)]
    assert [h.local_rank for h in again.hung] == [0, 1]  # this time the report marks them
    assert not [msg for msg in sent(eff) if isinstance(msg, WorkersFailed)]
    eff = m.handle(StacksDumped(stacks=stacks, report="marked", path=""), now + 7)
    assert [msg for msg in sent(eff) if isinstance(msg, WorkersFailed)]
    assert m.phase is st.Phase.STOPPING


JOB_REPORT = "hang: suspect rank 7 on n2 (last step 19, no progress for 8 s)\n\x1b[2Jranks 7 <- odd one out\n"


def test_the_jobs_hang_report_with_a_restart_is_said_and_filed() -> None:
    m = machine()
    restart = Restart(round=4, reason="worker failure: rank 7 (local rank 1) on node n2 ...", restart_count=1)
    eff = m.handle(st.ServerSent(replace(restart, report=JOB_REPORT)), 3.0)
    (filed,) = [e for e in eff if isinstance(e, JobHangReport)]
    assert filed.text.startswith("hang: suspect rank 7 on n2") and "\x1b" not in filed.text
    logged = "\n".join(e.text for e in eff if isinstance(e, st.Log))
    assert f"{JOB_REPORT_TITLE}:\nhang: suspect rank 7 on n2" in logged
    assert "\\x1b[2Jranks 7 <- odd one out" in logged  # a line of its own, its escape shown
    assert any(isinstance(e, st.StopWorkers) for e in eff)  # and the restart as ever
    # An older server sends no report: nothing more than before.
    old = machine()
    assert not [e for e in old.handle(st.ServerSent(restart), 3.0) if isinstance(e, JobHangReport)]


def test_the_jobs_hang_report_with_a_failed_job_is_filed_and_the_banner_tells_the_cause() -> None:
    m = machine()
    eff = m.handle(st.ServerSent(JobFailed(reason="rank 7 ... failed with a hang", report=JOB_REPORT)), 3.0)
    (filed,) = [e for e in eff if isinstance(e, JobHangReport)]
    assert "odd one out" in filed.text
    # Not printed again: the banner's root cause (the failure's message) shows it.
    assert not [e for e in eff if isinstance(e, st.Log) and JOB_REPORT_TITLE in e.text]
    old = machine()
    eff = old.handle(st.ServerSent(JobFailed(reason="rank 2 ... failed with a hang")), 3.0)
    assert not [e for e in eff if isinstance(e, JobHangReport)]


def test_finished_workers_tell_the_server_how_long_ago_their_last_step_was() -> None:
    """The goodput's training ends at the last step, not at the report: the report says how
    long before it the node's most recent step was (the pages' own time)."""
    m = machine()
    last = train(m, 10)  # the last step at 2.9 s
    eff = m.handle(st.WorkersExited(None), last + 2.5)
    assert sent(eff) == [WorkersSucceeded(round=4, idle_ms=2500.0)]
