"""Commit points on the server (issue 20), on a fake clock: a planned change (a join after its
settle window, a drain) stops every rank at one step S before the job regathers.

Times are multiples of 1/4 s and steps take 1/4 s, so every estimate is exact: a node that
reported step 60 half a second ago is at step 62, and k = ceil(1 s / 0.25 s) = 4 steps ahead.
"""

from __future__ import annotations

from typing import Any

from protocol import (
    Armed,
    Assignment,
    Drain,
    Leave,
    LeaveAfterCommit,
    Left,
    Progress,
    Restart,
    StopAt,
    WorkersCommitted,
    WorkersFailed,
)
from rdzv_server import state_image
from rdzv_server.machine.commits import COMMIT_LEAD, MAX_ARMS, PENDING_WAIT_S
from rdzv_server.machine.events import DrainRequested
from rdzv_server.machine.history import EventKind
from rdzv_server.machine.state import JobPhase

from .harness import Harness, failure
from .test_journal import Recording, replayed, state

STEP_MS = 250.0
KW: dict[str, Any] = dict(
    min_nodes=1, max_nodes=4, max_restarts=5, last_call_timeout=2.0, heartbeat_timeout=600.0
)


def running(h: Harness, n: int = 2, **kw: Any) -> list[int]:
    """``n`` nodes running round 0 of an elastic job (1..4 nodes), at time 2.0 (its settle
    window closed)."""
    conns = [h.join(**{**KW, **kw}) for _ in range(n)]
    h.advance(2.0)
    for c in conns:
        assert h.last(c, Assignment) is not None
        h.take(c)
    return conns


def report(h: Harness, conns: list[int], step: int, *, rnd: int = 0, checks: bool = True) -> None:
    for c in conns:
        msg = Progress(
            round=rnd, min_step=step, max_step=step, step_p50_ms=STEP_MS, step_p90_ms=STEP_MS, checks=checks
        )
        h.send(c, msg)


def stops(h: Harness, conns: list[int]) -> list[StopAt]:
    """The StopAt messages ``conns`` got (left in their inboxes)."""
    return [m for c in conns for m in h.inbox.get(c, []) if isinstance(m, StopAt)]


def asked(h: Harness, conns: list[int]) -> StopAt:
    """The one StopAt every node of ``conns`` got (the same for all)."""
    got = [[m for m in h.take(c) if isinstance(m, StopAt)] for c in conns]
    assert all(len(g) == 1 for g in got), got
    first = got[0][0]
    assert all(g[0] == first for g in got)
    return first


def commit_events(h: Harness) -> list[str]:
    return [e.text for e in h.machine.jobs["job"].history if e.kind is EventKind.COMMIT]


def join_and_settle(h: Harness, running_conns: list[int], step: int = 60, **kw: Any) -> int:
    """A newcomer joins; the nodes report ``step`` just before its settle window closes half a
    second later. Returns the newcomer's connection."""
    new = h.join(**{**KW, **kw})
    h.advance(1.5)
    report(h, running_conns, step)
    h.advance(0.5)  # the window closes: the node is at step + 2 by then
    return new


def test_a_join_asks_every_rank_to_stop_a_few_steps_past_where_it_is() -> None:
    h = Harness()
    a, b = running(h)
    new = join_and_settle(h, [a, b])
    stop = asked(h, [a, b])
    # 60 reported half a second ago at 4 steps a second: at 62 now; k = 4 steps (1 s of lead).
    assert (stop.round, stop.step, stop.state) == (0, 66, "arm")
    job = h.machine.jobs["job"]
    assert job.phase is JobPhase.RUNNING and job.round == 0  # nobody restarts yet
    assert h.last(new, Assignment) is None and h.last(a, Restart) is None
    c = job.commit
    assert c is not None
    # The deadline: 4 steps at the slowest step time, the lead and the checkpoint budget.
    assert c.deadline == h.now + 4 * 0.25 + COMMIT_LEAD + 300.0
    (text,) = commit_events(h)
    assert "asking every rank to stop at step 66 (a commit point) for: node(s) joined: node3" in text


def test_commit_steps_sets_how_far_ahead() -> None:
    h = Harness()
    a, b = running(h, commit_steps=20)
    join_and_settle(h, [a, b], commit_steps=20)
    assert asked(h, [a, b]).step == 62 + 20


def test_armed_in_time_everywhere_then_go_then_committed_regathers_with_no_restart_used() -> None:
    h = Harness()
    a, b = running(h)
    new = join_and_settle(h, [a, b])
    s = asked(h, [a, b]).step
    h.send(a, Armed(round=0, step=s, late=False, checked=62))
    assert stops(h, [a, b]) == []  # not before every node of the round armed
    h.send(b, Armed(round=0, step=s, late=False, checked=62))
    go = asked(h, [a, b])
    assert (go.step, go.state) == (s, "go")
    h.send(a, WorkersCommitted(round=0, step=s))
    assert h.last(a, Restart) is None  # b's ranks are still saving
    h.send(b, WorkersCommitted(round=0, step=s))
    for c in (a, b):
        r = h.last(c, Restart)
        assert r is not None and f"committed at step {s}" in r.reason and r.restart_count == 0
    job = h.machine.jobs["job"]
    assert job.commit is None and job.restart_count == 0
    assert all(m.failures == 0 for m in job.members.values())
    assert f"committed at step {s} for: node(s) joined: node3" in commit_events(h)[-1]
    # The agents rejoin: one round of all three nodes.
    for c in (a, b):
        h.take(c)
        h.join(c, **KW)
    h.advance(0.25)
    got = [h.last(c, Assignment) for c in (a, b, new)]
    assert all(g is not None and g.group_world_size == 3 and g.restart_count == 0 for g in got)


def test_a_rank_past_the_step_makes_the_server_ask_for_a_later_one() -> None:
    h = Harness()
    a, b = running(h)
    join_and_settle(h, [a, b])
    s = asked(h, [a, b]).step
    h.send(a, Armed(round=0, step=s, late=False, checked=62))
    # b's rank had already decided at s + 1: nobody may stop at s; every node gets a later step.
    h.send(b, Armed(round=0, step=s, late=True, checked=s + 1))
    later = asked(h, [a, b])
    assert later.state == "arm" and later.step > s + 1
    assert h.machine.jobs["job"].commit is not None and h.machine.jobs["job"].commit.arms == 2
    # An answer to the old step changes nothing; go needs every node armed for the new one.
    h.send(a, Armed(round=0, step=s, late=False, checked=62))
    assert h.machine.unchanged and stops(h, [a, b]) == []
    h.send(a, Armed(round=0, step=later.step, late=False, checked=s + 1))
    h.send(b, Armed(round=0, step=later.step, late=False, checked=s + 2))
    go = asked(h, [a, b])
    assert (go.round, go.step, go.state) == (0, later.step, "go")
    # One bound for the whole commit: the re-ask kept the first deadline, and says what is left.
    job = h.machine.jobs["job"]
    assert job.commit is not None and go.deadline_s == later.deadline_s == job.commit.deadline - h.now


def test_ranks_that_keep_racing_past_end_the_commit_with_a_hard_restart() -> None:
    h = Harness()
    a, b = running(h)
    join_and_settle(h, [a, b])
    s = asked(h, [a, b]).step
    for _ in range(MAX_ARMS - 1):
        h.send(b, Armed(round=0, step=s, late=True, checked=s))
        s = asked(h, [a, b]).step
    h.send(b, Armed(round=0, step=s, late=True, checked=s))
    for c in (a, b):
        r = h.last(c, Restart)
        assert r is not None and "no commit" in r.reason and r.restart_count == 0
    assert h.machine.jobs["job"].commit is None
    assert f"no commit at step {s}: a rank of node node2 was at step {s}" in commit_events(h)[-1]


def test_a_commit_past_its_deadline_restarts_as_before() -> None:
    h = Harness()
    a, b = running(h, commit_timeout=10.0)
    join_and_settle(h, [a, b], commit_timeout=10.0)
    s = asked(h, [a, b]).step
    h.send(a, Armed(round=0, step=s, late=False))
    h.send(b, Armed(round=0, step=s, late=False))
    asked(h, [a, b])
    h.send(a, WorkersCommitted(round=0, step=s))  # b's ranks never finish saving
    h.advance(1.0 + COMMIT_LEAD + 10.0 - 0.25)
    assert h.last(b, Restart) is None
    h.advance(0.5)
    for c in (a, b):
        r = h.last(c, Restart)
        assert r is not None and "no commit: not every rank stopped within 12 s" in r.reason
    job = h.machine.jobs["job"]
    assert job.commit is None and job.restart_count == 0 and job.phase is JobPhase.GATHERING


def test_a_failure_during_a_commit_is_an_ordinary_failure() -> None:
    h = Harness()
    a, b = running(h)
    join_and_settle(h, [a, b])
    s = asked(h, [a, b]).step
    h.send(a, Armed(round=0, step=s, late=False))
    h.send(b, WorkersFailed(round=0, failure=failure(rank=2, node="node2"), step=63))
    job = h.machine.jobs["job"]
    assert job.commit is None and job.restart_count == 1 and job.members["node2"].failures == 1
    r = h.last(a, Restart)
    assert r is not None and r.reason.startswith("worker failure")
    # The round is gone: a late answer for it changes nothing.
    h.send(a, Armed(round=0, step=s, late=False))
    assert h.machine.unchanged


def test_a_second_join_during_a_commit_waits_for_it_and_is_let_in_with_the_first() -> None:
    h = Harness()
    a, b = running(h, n=2, max_nodes=5)
    kw = {**KW, "max_nodes": 5}
    new = h.join(**kw)
    h.advance(1.5)
    report(h, [a, b], 60)
    h.advance(0.5)
    s = asked(h, [a, b]).step
    second = h.join(**kw)
    h.advance(5.0)  # its own settle window passes during the commit: no second commit
    assert stops(h, [a, b]) == [] and h.machine.jobs["job"].commit is not None
    for c in (a, b):
        h.send(c, Armed(round=0, step=s, late=False))
    asked(h, [a, b])
    for c in (a, b):
        h.send(c, WorkersCommitted(round=0, step=s))
    for c in (a, b):
        assert h.last(c, Restart) is not None
        h.take(c)
        h.join(c, **kw)
    h.advance(0.25)
    got = [h.last(c, Assignment) for c in (a, b, new, second)]
    assert all(g is not None and g.group_world_size == 4 for g in got)


def test_the_joining_node_drained_during_a_commit_calls_it_off() -> None:
    h = Harness()
    a, b = running(h)
    new = join_and_settle(h, [a, b])
    s = asked(h, [a, b]).step
    h._apply(h.machine.handle(DrainRequested("job", "node3", "wrong node"), h.now))
    assert h.last(new, Drain) is not None  # not in the round: drained at once
    h.send(new, Leave(reason="drain: asked to drain"))
    assert h.last(new, Left) is not None
    cancel = asked(h, [a, b])
    assert (cancel.step, cancel.state) == (s, "cancel")
    job = h.machine.jobs["job"]
    assert job.commit is None and job.phase is JobPhase.RUNNING and job.round == 0
    assert h.last(a, Restart) is None and h.last(b, Restart) is None  # they train on
    assert "no commit at step 66: the node(s) joining left" in commit_events(h)[-1]


def test_an_operator_drain_stops_every_rank_at_a_commit_point_then_drains_the_node() -> None:
    h = Harness()
    a, b = running(h)
    report(h, [a, b], 40)
    h._apply(h.machine.handle(DrainRequested("job", "node2", "maintenance"), h.now))
    assert h.last(b, Drain) is None  # first the commit
    s = asked(h, [a, b]).step
    assert s == 44
    for c in (a, b):
        h.send(c, Armed(round=0, step=s, late=False))
    asked(h, [a, b])
    for c in (a, b):
        h.send(c, WorkersCommitted(round=0, step=s))
    assert h.last(a, Restart) is not None and h.last(b, Restart) is None
    d = h.last(b, Drain)
    assert d is not None and d.reason == "node node2 (10.0.0.2) is drained by the operator: maintenance"
    assert (
        "committed at step 44 for: node node2 (10.0.0.2) is drained by the operator: maintenance"
        in (commit_events(h)[-1])
    )
    # The drained node's place waits for its Leave: no round forms with it.
    h.take(a)
    h.join(a, **KW)
    h.advance(0.25)
    assert h.last(a, Assignment) is None
    h.send(b, Leave(reason="drain: asked to drain by the server: maintenance"))
    left = h.last(b, Left)
    assert left is not None and left.job_continues
    h.advance(0.25)
    got = h.last(a, Assignment)
    assert got is not None and got.group_world_size == 1 and got.restart_count == 0


def test_an_agent_leaving_after_a_commit_is_drained_once_every_rank_stopped() -> None:
    h = Harness()
    a, b = running(h)
    report(h, [a, b], 40)
    h.send(b, LeaveAfterCommit(round=0, reason="received SIGTERM"))
    s = asked(h, [a, b]).step
    for c in (a, b):
        h.send(c, Armed(round=0, step=s, late=False))
    asked(h, [a, b])
    for c in (a, b):
        h.send(c, WorkersCommitted(round=0, step=s))
    d = h.last(b, Drain)
    assert d is not None and "node node2 (10.0.0.2) is leaving (received SIGTERM)" in d.reason
    assert h.last(a, Restart) is not None


def test_a_drain_during_a_join_commit_joins_it() -> None:
    h = Harness()
    a, b = running(h)
    join_and_settle(h, [a, b])
    s = asked(h, [a, b]).step
    h._apply(h.machine.handle(DrainRequested("job", "node1", "swap"), h.now))
    assert stops(h, [a, b]) == [] and h.last(a, Drain) is None
    for c in (a, b):
        h.send(c, Armed(round=0, step=s, late=False))
    asked(h, [a, b])
    for c in (a, b):
        h.send(c, WorkersCommitted(round=0, step=s))
    assert h.last(a, Drain) is not None and h.last(a, Restart) is None
    assert h.last(b, Restart) is not None


def test_a_failure_during_a_drain_commit_still_drains_the_node() -> None:
    h = Harness()
    a, b = running(h)
    report(h, [a, b], 40)
    h._apply(h.machine.handle(DrainRequested("job", "node2", "maintenance"), h.now))
    asked(h, [a, b])
    h.send(a, WorkersFailed(round=0, failure=failure(rank=0, node="node1"), step=41))
    assert h.last(b, Restart) is not None and h.last(b, Drain) is not None


def test_jobs_whose_ranks_do_not_check_or_that_turned_commits_off_restart_at_once() -> None:
    for checks, kw in ((False, {}), (True, {"commit_timeout": 0.0})):
        h = Harness()
        a, b = running(h, **kw)
        report(h, [a, b], 50, checks=checks)
        h.advance(PENDING_WAIT_S)  # they have said so for a while (see the early-round tests)
        new = h.join(**{**KW, **kw})
        h.advance(1.5)
        report(h, [a, b], 60, checks=checks)
        h.advance(0.5)
        assert stops(h, [a, b]) == []
        r = h.last(a, Restart)
        assert r is not None and r.reason == "node(s) joined: node3"
        assert h.machine.jobs["job"].commit is None and h.last(new, Assignment) is None


def test_a_node_with_no_progress_means_no_commit_once_the_wait_for_it_is_over() -> None:
    h = Harness()
    a, b = running(h)
    h.join(**KW)
    h.advance(1.5)
    report(h, [a], 60)  # b reported nothing
    h.advance(0.5)
    assert stops(h, [a, b]) == [] and h.last(a, Restart) is None
    h.advance(PENDING_WAIT_S)
    assert stops(h, [a, b]) == [] and h.last(a, Restart) is not None


def test_a_job_that_never_reports_progress_restarts_at_once_as_before() -> None:
    h = Harness()
    a, _b = running(h)
    h.join(**KW)
    h.advance(2.0)
    r = h.last(a, Restart)
    assert r is not None and r.reason == "node(s) joined: node3" and h.machine.jobs["job"].commit is None


def test_a_change_early_in_a_round_waits_for_every_nodes_progress_then_commits() -> None:
    """A join in the round's first seconds, before every node said its ranks check: the server
    waits for their summaries (no step time yet either) instead of restarting at once."""
    h = Harness()
    a, b = running(h)
    new = h.join(**KW)
    h.send(a, Progress(round=0, min_step=0, max_step=0, checks=True))  # one step, no step time
    h.advance(2.0)  # the newcomer's settle window closes; b has not reported yet
    assert stops(h, [a, b]) == [] and h.last(a, Restart) is None
    commit = h.machine.jobs["job"].commit
    assert commit is not None and commit.pending
    h.send(b, Progress(round=0, min_step=1, max_step=1, checks=True))
    arm = asked(h, [a, b])
    assert arm.state == "arm" and arm.step >= 1 + 2 and arm.deadline_s > 0
    for c in (a, b):
        h.send(c, Armed(round=0, step=arm.step, late=False, checked=1))
    assert asked(h, [a, b]).state == "go"
    for c in (a, b):
        h.send(c, WorkersCommitted(round=0, step=arm.step))
    assert f"committed at step {arm.step} for: node(s) joined: node3" in commit_events(h)[-1]
    assert h.last(a, Restart) is not None and h.last(new, Assignment) is None


def test_an_early_change_that_gets_no_progress_in_time_restarts_as_before() -> None:
    h = Harness()
    a, b = running(h)
    h.join(**KW)
    report(h, [a], 0, checks=False)  # a's ranks have not called should_stop() yet
    h.advance(2.0)
    assert h.machine.jobs["job"].commit is not None and h.last(a, Restart) is None
    h.advance(PENDING_WAIT_S)
    r = h.last(a, Restart)
    assert r is not None and "no commit point could be chosen in time" in r.reason
    assert stops(h, [a, b]) == []


def test_ranks_that_check_every_few_steps_commit_at_their_common_check_past_s() -> None:
    """should_stop() called every 10 steps: every rank stops at its first check past S, the
    same step on every node; the job goes on from there (no success, no failure)."""
    h = Harness()
    a, b = running(h)
    new = join_and_settle(h, [a, b])
    s = asked(h, [a, b]).step
    for c in (a, b):
        h.send(c, Armed(round=0, step=s, late=False, checked=59))
    asked(h, [a, b])
    t = (s // 10) * 10 + 9  # the first check at or past S
    for c in (a, b):
        h.send(c, WorkersCommitted(round=0, step=t))
    job = h.machine.jobs["job"]
    assert job.phase is JobPhase.GATHERING and job.restart_count == 0
    assert f"committed at step {t} for: node(s) joined: node3" in commit_events(h)[-1]
    assert h.last(a, Restart) is not None and h.last(new, Assignment) is None


def test_ranks_that_stopped_at_different_steps_end_the_commit_with_a_hard_restart() -> None:
    h = Harness()
    a, b = running(h)
    join_and_settle(h, [a, b])
    s = asked(h, [a, b]).step
    for c in (a, b):
        h.send(c, Armed(round=0, step=s, late=False, checked=59))
    asked(h, [a, b])
    h.send(a, WorkersCommitted(round=0, step=s))
    h.send(b, WorkersCommitted(round=0, step=s + 3))
    r = h.last(a, Restart)
    assert r is not None and "stopped at different steps" in r.reason
    assert h.machine.jobs["job"].phase is not JobPhase.FINISHED


def test_workers_committed_at_a_step_nobody_asked_for_regathers_the_round() -> None:
    h = Harness()
    a, b = running(h)
    h.send(a, WorkersCommitted(round=0, step=12))
    r = h.last(b, Restart)
    assert r is not None and "stopped at step 12, a commit point no longer asked for" in r.reason


def test_a_commit_replays_from_the_state_log_and_survives_a_snapshot() -> None:
    h = Harness(machine=Recording())
    a, b = running(h)
    join_and_settle(h, [a, b])
    s = asked(h, [a, b]).step
    h.send(b, Armed(round=0, step=s, late=True, checked=s))
    s = asked(h, [a, b]).step
    h.send(a, Armed(round=0, step=s, late=False))
    m = h.machine
    assert m.jobs["job"].commit is not None
    # Mid-commit: the replay (which has no Progress) takes S from the logged facts.
    assert state(replayed(m.records)) == state(m)
    assert state(state_image.load(state_image.dump(m))) == state(m)
    h.send(b, Armed(round=0, step=s, late=False))
    for c in (a, b):
        h.send(c, WorkersCommitted(round=0, step=s))
    assert state(replayed(m.records)) == state(m)


def test_an_early_commit_chosen_on_a_progress_replays_and_survives_a_snapshot() -> None:
    """S chosen while a Progress (volatile, not logged) comes in: that Progress is logged with
    S as its fact, and replay arms the same step at the same point."""
    h = Harness(machine=Recording())
    a, b = running(h)
    h.join(**KW)
    h.send(a, Progress(round=0, min_step=0, max_step=0, checks=True))
    h.advance(2.0)
    m = h.machine
    assert m.jobs["job"].commit is not None and m.jobs["job"].commit.pending
    assert state(replayed(m.records)) == state(m)
    assert state(state_image.load(state_image.dump(m))) == state(m)
    h.send(b, Progress(round=0, min_step=1, max_step=1, checks=True))
    s = asked(h, [a, b]).step
    assert state(replayed(m.records)) == state(m)
    for c in (a, b):
        h.send(c, Armed(round=0, step=s, late=False, checked=1))
    for c in (a, b):
        h.send(c, WorkersCommitted(round=0, step=s + 5))
    assert state(replayed(m.records)) == state(m)
    assert state(state_image.load(state_image.dump(m))) == state(m)
