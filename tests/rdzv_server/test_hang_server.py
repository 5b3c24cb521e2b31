"""Hangs on the server: one HANG event and one CollectStacks to every node per round, the
nodes' stacks merged into the job's latest hang report, bounded whatever the nodes send."""

from __future__ import annotations

from protocol import Assignment, CollectStacks, Error, HangDetected, Restart, Stacks, WorkersFailed
from rdzv_server.machine.history import EventKind
from rdzv_server.machine.progress import HANG_NODES_KEPT, HANG_RANKS_KEPT
from rdzv_server.machine.state import JobPhase

from .harness import Harness, failure
from .test_journal import Recording, replayed, state


def running(h: Harness, n: int = 3, nproc: int = 2) -> list[int]:
    kw = dict(min_nodes=n, max_nodes=n, max_restarts=5, nproc=nproc)
    conns = [h.join(**kw) for _ in range(n)]
    h.advance(0.1)
    assert all(h.last(c, Assignment) for c in conns)
    for c in conns:
        h.take(c)
    return conns


def first_rank(h: Harness, conn: int) -> int:
    """The first global rank of the node on ``conn`` in the running round."""
    job = h.machine.jobs["job"]
    rank = 0
    for nid in job.order:
        m = job.members[nid]
        if m.conn == conn:
            return rank
        rank += m.nproc
    raise AssertionError(f"no member on connection {conn}")


def hang(rnd: int = 0, ranks: tuple[int, ...] = (3,), step: int = 20) -> HangDetected:
    return HangDetected(round=rnd, ranks=ranks, step=step, phase="compute", silent_s=612.4)


def stacks(rnd: int, ranks: tuple[int, ...], text: str = 'File "train.py", line 9 in step') -> Stacks:
    n = len(ranks)
    return Stacks(
        round=rnd,
        ranks=ranks,
        steps=(20,) * n,
        phases=("compute",) * n,
        silent_s=(1.0,) * n,
        stacks=(text,) * n,
    )


def collects(h: Harness, conns: list[int]) -> list[CollectStacks]:
    return [m for c in conns for m in h.take(c) if isinstance(m, CollectStacks)]


def test_the_first_hang_of_a_round_asks_every_node_once_and_notes_it() -> None:
    h = Harness()
    conns = running(h)
    b = conns[1]
    h.send(b, hang())
    got = collects(h, conns)
    assert len(got) == 3  # the sender too: it ignores it if it already collects
    assert got[0].round == 0
    assert got[0].reason == "rank 3 on node node2 made no progress for 612 s (step 20, phase compute)"
    job = h.machine.jobs["job"]
    events = [e for e in job.history if e.kind is EventKind.HANG]
    assert len(events) == 1
    e = events[0]
    assert (e.node, e.ranks, e.step, e.phase, e.round) == ("node2", (3,), 20, "compute", 0)
    assert e.silent_s == 612.4
    assert job.hang is not None and job.hang.node == "node2" and job.hang.ranks == [3]
    # Later reports of the same round add their ranks, and ask nobody again.
    h.send(conns[2], hang(ranks=(4, 5)))
    h.send(b, hang(ranks=(3,)))
    assert collects(h, conns) == []
    events = [e for e in job.history if e.kind is EventKind.HANG]
    assert len(events) == 1 and events[0].ranks == (3, 4, 5) and "hung ranks: 3, 4, 5" in events[0].text
    assert job.phase is JobPhase.RUNNING  # the failure that follows decides, as for any


def test_hang_reports_of_a_stale_round_are_ignored_and_before_joining_refused() -> None:
    h = Harness()
    conns = running(h)
    h.send(conns[0], hang(rnd=7))
    assert h.machine.unchanged and collects(h, conns) == [] and h.machine.jobs["job"].hang is None
    c = h.connect()
    h.send(c, hang())
    err = h.last(c, Error)
    assert err is not None and err.code == "unexpected_message" and c in h.closed


def test_stacks_are_merged_into_the_jobs_hang_report_even_after_the_round_restarted() -> None:
    h = Harness()
    a, b, c = running(h)
    h.send(b, hang(ranks=(3,)))
    h.send(b, stacks(0, (2, 3), "hung frame"))
    h.send(b, WorkersFailed(round=0, failure=failure(rank=3), step=20))  # the hung node's failure
    assert h.last(a, Restart) is not None
    h.send(a, stacks(0, (0, 1), "all_reduce frame"))  # the others' stacks come in after
    h.send(c, stacks(0, (4, 5), "all_reduce frame"))
    report = h.machine.jobs["job"].hang
    assert report is not None
    assert [(r, text) for r, _, _, _, text in report.entries()] == [
        (0, "all_reduce frame"),
        (1, "all_reduce frame"),
        (2, "hung frame"),
        (3, "hung frame"),
        (4, "all_reduce frame"),
        (5, "all_reduce frame"),
    ]
    h.send(a, stacks(5, (0,)))  # a round without a hang: ignored
    assert h.machine.unchanged and len(report.entries()) == 6


def test_a_new_rounds_hang_replaces_the_report() -> None:
    h = Harness()
    a, b, c = running(h)
    h.send(b, hang())
    h.send(b, stacks(0, (3,)))
    h.send(b, WorkersFailed(round=0, failure=failure(rank=3), step=20))
    kw = dict(min_nodes=3, max_nodes=3, max_restarts=5)
    for x in (a, b, c):
        h.join(x, **kw)
    assert h.last(a, Assignment).round == 1  # type: ignore[union-attr]
    h.send(a, hang(rnd=1, ranks=(0,)))
    report = h.machine.jobs["job"].hang
    assert report is not None and report.round == 1 and report.stacks == {} and report.ranks == [0]
    assert len([e for e in h.machine.jobs["job"].history if e.kind is EventKind.HANG]) == 2


def test_stacks_from_100_nodes_keep_at_most_the_cap() -> None:
    h = Harness()
    conns = running(h, n=100, nproc=32)
    h.send(conns[0], hang(ranks=(first_rank(h, conns[0]),)))
    big = "x" * 2048
    for c in conns:
        at = first_rank(h, c)
        h.send(c, stacks(0, tuple(range(at, at + 32)), big))
    report = h.machine.jobs["job"].hang
    assert report is not None
    assert len(report.stacks) <= HANG_NODES_KEPT
    assert report.text_kept <= 1 << 20 and report.nodes_dropped == 100 - len(report.stacks)
    assert report.nodes_dropped > 0
    # A node sending again replaces its own entry; it does not add one.
    kept = next(iter(report.stacks))
    before = report.text_kept
    node = h.machine.jobs["job"].members[kept]
    h.send(node.conn, stacks(0, (first_rank(h, node.conn),), "short"))
    assert report.text_kept < before and len(report.stacks[kept].ranks) == 1


def test_hung_ranks_named_are_bounded() -> None:
    h = Harness()
    conns = running(h, n=10, nproc=64)
    for c in conns:
        at = first_rank(h, c)
        h.send(c, hang(ranks=tuple(range(at, at + 64))))
    report = h.machine.jobs["job"].hang
    assert report is not None and len(report.ranks) == HANG_RANKS_KEPT
    e = next(e for e in h.machine.jobs["job"].history if e.kind is EventKind.HANG)
    assert len(e.ranks) == HANG_RANKS_KEPT and len(e.text) <= 512


def test_a_hang_replays_to_the_same_history_and_stacks_are_not_logged() -> None:
    h = Harness(machine=Recording())
    _, b, c = running(h)
    h.send(b, hang())
    h.send(c, hang(ranks=(4,)))
    h.send(b, stacks(0, (3,)))
    h.send(b, WorkersFailed(round=0, failure=failure(rank=3), step=20))
    m = h.machine
    assert state(replayed(m.records)) == state(m)
    assert not any(r["k"] == "received" and b"stacks" in r["msg"] for r in m.records)
