"""A hang's verdict names the rank every node's stacks point at (issue 30, section 2).

Node 1 (ranks 0, 1) finds its ranks hung, both waiting in all_reduce; node 2's rank 3 stopped
outside any collective. The verdict on node 1's failure waits (bounded) for node 2's stacks,
and the job's root cause, the restart's reason and the report the agents get then name rank
3 with its frame; a replay from any cut of the state log agrees.
"""

from __future__ import annotations

from dataclasses import replace

from protocol import (
    Assignment,
    Failure,
    HangDetected,
    JobFailed,
    Restart,
    Stacks,
    WorkersFailed,
)
from protocol.failure_text import HUNG
from rdzv_server import tables
from rdzv_server.machine.hang_cause import HANG_VERDICT_WAIT_S
from rdzv_server.machine.progress import HANG_NODES_KEPT
from rdzv_server.machine.state import JobPhase

from .harness import Harness
from .test_hang_server import first_rank
from .test_journal import Recording, replays_from_every_cut
from .test_progress_surfaces import job

WAITING = """Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/job/train.py", line 52 in main
  File "/job/train.py", line 61 in <module>
"""
STUCK = """Current thread 0x00007f0000000002 (most recent call first):
  File "/job/train.py", line 26 in stuck_in_data_loader
  File "/job/train.py", line 44 in main
  File "/job/train.py", line 61 in <module>
"""


def running(h: Harness, max_restarts: int, n: int = 2) -> list[int]:
    kw = dict(min_nodes=n, max_nodes=n, max_restarts=max_restarts, heartbeat_timeout=30.0)
    conns = [h.join(**kw) for _ in range(n)]
    h.advance(0.1)
    assert all(h.last(c, Assignment) for c in conns)
    for c in conns:
        h.take(c)
    return conns


def stacks(ranks: tuple[int, ...], texts: tuple[str, ...]) -> Stacks:
    n = len(ranks)
    return Stacks(round=0, ranks=ranks, steps=(19,) * n, phases=("",) * n, silent_s=(8.0,) * n, stacks=texts)


def hung(rank: int, node: str = "node1") -> Failure:
    return Failure(
        node_id=node,
        addr="10.0.0.1",
        rank=rank,
        local_rank=rank % 2,
        exitcode=-15,
        signal=HUNG,
        timestamp=1.0,
        pid=4242,
        message=f"hang: rank {rank} (local {rank % 2}): no progress for 8 s",
    )


def node1_hangs(h: Harness, a: int) -> None:
    """Node 1 (ranks 0, 1): its ranks hung in all_reduce, its stacks, then its failure."""
    h.send(a, HangDetected(round=0, ranks=(0, 1), step=19, silent_s=8.0))
    h.send(a, stacks((0, 1), (WAITING, WAITING)))
    h.send(a, WorkersFailed(round=0, failure=hung(0), step=19))


def test_the_root_cause_is_the_odd_one_out_of_every_nodes_stacks_not_the_first_reported() -> None:
    h = Harness()
    a, b = running(h, max_restarts=0)
    node1_hangs(h, a)
    # Node 2's stacks are asked for and not in yet: no verdict.
    assert h.last(a, JobFailed) is None and h.machine.jobs["job"].phase is JobPhase.RUNNING
    h.send(b, stacks((2, 3), (WAITING, STUCK)))
    failed = h.last(a, JobFailed)
    assert isinstance(failed, JobFailed) and h.last(b, JobFailed) == failed
    f = failed.failure
    assert f is not None
    assert (f.rank, f.local_rank, f.node_id, f.addr, f.pid) == (3, 1, "node2", "10.0.0.2", 0)
    assert f.signal == HUNG and f.message.startswith("job-wide hang report")
    assert "stuck_in_data_loader" in f.message.split("ranks 0-2")[0]  # the odd one out first
    assert failed.reason.startswith("rank 3 (local rank 1) on node node2 (10.0.0.2) failed with a hang")
    assert "hang: suspect rank 3 on node2" in failed.report and "all_reduce" in failed.report
    job = h.machine.jobs["job"]
    assert job.failures == [f] and job.failures_total == 1
    assert (job.members["node1"].failures, job.members["node2"].failures) == (0, 1)


def test_a_restart_carries_the_named_cause_and_the_report_to_every_node() -> None:
    h = Harness()
    a, b = running(h, max_restarts=3)
    node1_hangs(h, a)
    assert h.last(a, Restart) is None
    h.send(b, stacks((2, 3), (WAITING, STUCK)))
    restart = h.last(a, Restart)
    assert isinstance(restart, Restart) and h.last(b, Restart) == restart
    assert "worker failure: rank 3 (local rank 1) on node node2" in restart.reason
    assert "stuck_in_data_loader" in restart.report
    assert h.machine.jobs["job"].restart_count == 1


def test_without_the_other_nodes_stacks_the_verdict_goes_at_its_deadline() -> None:
    h = Harness()
    a, b = running(h, max_restarts=3)
    node1_hangs(h, a)
    h.advance(HANG_VERDICT_WAIT_S - 0.5)
    assert h.last(a, Restart) is None
    h.advance(1.0)
    restart = h.last(b, Restart)
    assert isinstance(restart, Restart)
    # Node 1's ranks alone have no odd one out: its report stands, told job-wide.
    assert "rank 0 (local rank 0) on node node1" in restart.reason
    f = h.machine.jobs["job"].failures[-1]
    assert f.rank == 0 and f.pid == 4242 and f.message.startswith("job-wide hang report")
    assert "rank 3" not in restart.report


def test_no_wait_when_the_reporters_own_stacks_never_came() -> None:
    # An older agent, or stacks that could not be read: the verdict is taken at once, as before.
    h = Harness()
    a, b = running(h, max_restarts=3)
    h.send(a, HangDetected(round=0, ranks=(0,), step=19))
    h.send(a, WorkersFailed(round=0, failure=hung(0), step=19))
    restart = h.last(b, Restart)
    assert isinstance(restart, Restart) and restart.report == ""
    assert h.machine.jobs["job"].failures[-1] == hung(0)


def test_a_second_failure_while_the_verdict_waits_counts_once() -> None:
    h = Harness()
    a, b = running(h, max_restarts=3)
    node1_hangs(h, a)
    h.send(b, WorkersFailed(round=0, failure=hung(2, node="node2"), step=19))
    assert h.machine.unchanged and h.last(a, Restart) is None
    h.send(b, stacks((2, 3), (WAITING, STUCK)))
    job = h.machine.jobs["job"]
    assert job.failures_total == 1 and job.restart_count == 1 and job.failures[-1].rank == 3


def test_a_node_lost_while_the_verdict_waits_ends_the_round_and_the_hang_still_counts() -> None:
    h = Harness()
    a, _, c = running(h, max_restarts=3, n=3)
    node1_hangs(h, a)
    h.drop(c)
    job = h.machine.jobs["job"]
    assert job.hang_verdict is None and job.phase is JobPhase.GATHERING
    assert job.failures == [hung(0)] and job.failures_total == 1 and job.members["node1"].failures == 1
    restart = h.last(a, Restart)
    assert isinstance(restart, Restart) and "node3" in restart.reason
    h.advance(HANG_VERDICT_WAIT_S + 1)  # its deadline passes: nothing more happens
    assert job.failures_total == 1


def test_a_named_cause_replays_from_every_cut_though_stacks_are_not_logged() -> None:
    h = Harness(machine=Recording())
    a, b = running(h, max_restarts=3)
    node1_hangs(h, a)
    h.send(b, stacks((2, 3), (WAITING, STUCK)))
    job = h.machine.jobs["job"]
    assert job.failures[-1].rank == 3 and job.phase is JobPhase.GATHERING
    replays_from_every_cut(h.machine.records, h.machine)


def test_a_verdict_at_its_deadline_and_one_waiting_replay_from_every_cut() -> None:
    h = Harness(machine=Recording())
    a, _ = running(h, max_restarts=3)
    node1_hangs(h, a)
    replays_from_every_cut(h.machine.records, h.machine)  # waiting: kept in snapshots
    assert h.machine.jobs["job"].hang_verdict is not None
    h.advance(HANG_VERDICT_WAIT_S + 0.1)
    assert h.machine.jobs["job"].restart_count == 1
    replays_from_every_cut(h.machine.records, h.machine)


def test_status_prints_the_named_cause_and_its_report_as_lines() -> None:
    h = Harness()
    a, b = running(h, max_restarts=0)
    node1_hangs(h, a)
    h.send(b, stacks((2, 3), (WAITING, STUCK.replace("stuck_in_data_loader", "stuck\x1b[2J"))))
    lines = tables.format_job(job(h)).splitlines()
    at = lines.index("failures (the root cause of each restart):")
    assert lines[at + 1].startswith(
        "  round 0: rank 3 (local rank 1) on node node2 (10.0.0.2) failed with a hang"
    )
    assert lines[at + 1].endswith(
        ": job-wide hang report (every node's stacks, merged by the rendezvous server):"
    )
    body = lines[at + 2 : lines.index("", at + 2)] if "" in lines[at + 2 :] else lines[at + 2 :]
    assert body[0] == "      hang: suspect rank 3 on node2 (last step 19, no progress for 8 s)"
    assert "      ranks 3 (1 of 4; stacks by node-agent)  <- odd one out" in lines
    assert "          stuck?[2J (/job/train.py:26)" in lines  # on its own line, made printable
    assert not [line for line in lines if "\\n" in line]


def test_status_prints_a_workers_multi_line_error_as_escaped_indented_lines() -> None:
    h = Harness()
    a, _ = running(h, max_restarts=0)
    error = "Traceback (most recent call last):\n  boom\x1b[2J\njob x: FINISHED\n"
    h.send(a, WorkersFailed(round=0, failure=replace(hung(0), signal="", exitcode=1, message=error)))
    lines = tables.format_job(job(h)).splitlines()
    at = lines.index("failures (the root cause of each restart):")
    assert lines[at + 1].endswith("failed with exit code 1: Traceback (most recent call last):")
    # Each line escaped, and indented under the first: none passes for a line of the table.
    assert lines[at + 2 : at + 4] == ["        boom\\x1b[2J", "      job x: FINISHED"]


def test_past_the_nodes_kept_the_culprits_stacks_still_make_the_report() -> None:
    # Issue 31: the report keeps HANG_NODES_KEPT nodes' stacks. The culprit's come after the
    # crowd's have filled them: they bring a group no kept rank shows, so they take the place
    # of a node whose stacks the others repeat, and the verdict names the culprit's rank.
    h = Harness()
    n = HANG_NODES_KEPT + 36
    conns = running(h, max_restarts=3, n=n)
    a = conns[0]
    assert first_rank(h, a) == 0
    node1_hangs(h, a)
    culprit = conns[n - 10]
    for c in conns[1:]:
        if c != culprit:
            r = first_rank(h, c)
            h.send(c, stacks((r, r + 1), (WAITING, WAITING)))
    assert h.last(a, Restart) is None  # the culprit's stacks are not in yet
    rank = first_rank(h, culprit) + 1
    h.send(culprit, stacks((rank - 1, rank), (WAITING, STUCK)))
    restart = h.last(a, Restart)
    assert isinstance(restart, Restart)
    node = h.machine.conns[culprit].node_id
    assert f"worker failure: rank {rank} (local rank 1) on node {node}" in restart.reason
    assert "stuck_in_data_loader" in restart.report
    hang = h.machine.jobs["job"].hang
    assert hang is not None and len(hang.stacks) == HANG_NODES_KEPT
    assert hang.nodes_dropped == n - HANG_NODES_KEPT and "node1" in hang.stacks  # the first report's stay


def test_stacks_a_node_sends_again_count_once_towards_the_verdicts_wait() -> None:
    # Issue 31: a node past the cap that sent its stacks twice counted twice, so the verdict
    # took "every node's stacks are in" before the last nodes' came.
    h = Harness()
    n = HANG_NODES_KEPT + 4
    conns = running(h, max_restarts=3, n=n)
    a = conns[0]
    node1_hangs(h, a)
    for c in conns[1:-1]:
        r = first_rank(h, c)
        h.send(c, stacks((r, r + 1), (WAITING, WAITING)))
        h.send(c, stacks((r, r + 1), (WAITING, WAITING)))  # collected again
    hang = h.machine.jobs["job"].hang
    assert hang is not None and hang.nodes_dropped == n - 1 - HANG_NODES_KEPT
    assert h.last(a, Restart) is None  # the last node's are still to come
    last = conns[-1]
    r = first_rank(h, last)
    h.send(last, stacks((r, r + 1), (WAITING, STUCK)))
    restart = h.last(a, Restart)
    assert isinstance(restart, Restart) and f"rank {r + 1} (local rank 1)" in restart.reason
