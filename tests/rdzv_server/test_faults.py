"""A fault of the machine's own rules costs one job, never the server (issue 31).

Values a peer may send (each within its field's bounds) must not make a rule raise; should
one still raise, the job whose rule it was fails with ``internal_error`` (its agents told
why), the rest of the event goes on for every other job, and the state log, replayed,
rebuilds the same state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from protocol import MAX_TIMEOUT, Assignment, Heartbeat, JobFailed, Progress, Restart, StopAt
from rdzv_server.machine.commits import CommitRules
from rdzv_server.machine.state import JobPhase, Rendezvous, Tick

from .harness import Harness
from .test_journal import Recording, replayed, replays_from_every_cut, state

MAX_COUNT = 2**63 - 1
# A job whose nodes can stop at a commit point, so a newcomer's settle window picks a step.
COMMITS = dict(min_nodes=2, max_nodes=4, max_restarts=3, last_call_timeout=1.0, heartbeat_timeout=60.0)


def running(h: Harness, job: str, **kw: Any) -> list[int]:
    conns = [h.join(job=job, **{**COMMITS, **kw}) for _ in range(2)]
    h.advance(1.1)
    assert all(h.last(c, Assignment) for c in conns)
    return conns


def internal_errors(h: Harness) -> list[str]:
    return [line for line in h.logs if "internal error" in line]


def test_progress_at_the_edges_of_its_bounds_never_makes_a_rule_raise() -> None:
    """Each case was a Tick that raised once the newcomer's settle window closed (and so, in
    the server, a timer never armed again): S or its deadline left its range."""
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        # The case: the commit step S would pass MAX_COUNT.
        (dict(min_step=MAX_COUNT, max_step=MAX_COUNT), {}),
        # A step time of 1e-307 ms: COMMIT_LEAD / step time is inf (OverflowError in ceil).
        (dict(min_step=5, max_step=5, step_p50_ms=1e-307), {}),
        # commit_timeout at its bound: StopAt.deadline_s past MAX_TIMEOUT (InvalidField).
        (dict(min_step=5, max_step=5, step_p50_ms=100.0), dict(commit_timeout=MAX_TIMEOUT)),
        # Step times at their bound: the steps to S take longer than StopAt.deadline_s holds.
        (dict(min_step=5, max_step=5, step_p50_ms=1e10, step_p90_ms=1e10), {}),
    ]
    for progress, settings in cases:
        h = Harness()
        a, b = running(h, "job", **settings)
        for c in (a, b):
            h.send(c, Progress(round=0, checks=True, **progress))
        h.join(job="job", **{**COMMITS, **settings})
        h.advance(1.1)  # the settle window closes: a commit point is chosen, or none can be
        job = h.machine.jobs["job"]
        assert not internal_errors(h), (progress, settings, internal_errors(h))
        assert job.phase is JobPhase.RUNNING, (progress, settings)
        stop = h.last(a, StopAt)
        assert stop is None or (0 <= stop.step <= MAX_COUNT and 0 <= stop.deadline_s <= MAX_TIMEOUT)
        if stop is None:  # no step could be chosen: the change waits for one, then restarts
            h.advance(5.0)
            assert h.last(a, Restart) is not None and not internal_errors(h)


def raising_for(job_id: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, but raising for one job: a bug that only that job's state reaches."""

    def rule(self: Rendezvous, job: Any, *args: Any, **kw: Any) -> Any:
        if job.id == job_id:
            raise ArithmeticError("a bug")
        return original(self, job, *args, **kw)

    return rule


def two_jobs_due_at_one_tick(h: Harness) -> tuple[list[int], list[int], int]:
    """Job "bad" with a newcomer whose settle window closes at the same tick as job "good"'s
    silent node is found by the heartbeat sweep. Returns the conns of both and the newcomer."""
    good = running(h, "good", heartbeat_timeout=3.0)
    bad = running(h, "bad", heartbeat_timeout=30.0)
    for c in bad:
        h.send(c, Progress(round=0, min_step=10, max_step=10, step_p50_ms=100.0, checks=True))
    newcomer = h.join(job="bad", **{**COMMITS, "heartbeat_timeout": 30.0})
    h.send(good[0], Heartbeat())
    return good, bad, newcomer


def check_contained(h: Harness, good: list[int], bad: list[int], newcomer: int, rule: str) -> None:
    # The faulty job failed, and every agent of it was told why.
    job = h.machine.jobs["bad"]
    assert job.phase is JobPhase.FAILED and job.fail_code == "internal_error"
    for c in [*bad, newcomer]:
        told = h.last(c, JobFailed)
        assert told is not None and told.code == "internal_error", c
        assert told.reason.startswith(f"internal error in {rule} (") and "handling tick" in told.reason
        assert told.reason.endswith("ArithmeticError: a bug")
    # The other job's deadline of the same tick still went: its silent node is gone.
    assert good[1] in h.closed and "went silent" in h.closed[good[1]]
    assert h.last(good[0], Restart) is not None and h.machine.jobs["good"].phase is JobPhase.GATHERING
    # And the machine still has its deadlines (the sweep, for everyone still connected).
    assert h.machine.next_deadline() is not None and h.machine.next_deadline() > h.now


def test_a_rule_that_raises_in_a_tick_fails_its_job_and_the_tick_goes_on_for_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(CommitRules, "_plan_change", raising_for("bad", CommitRules._plan_change))
    h = Harness(machine=Recording())
    good, bad, newcomer = two_jobs_due_at_one_tick(h)
    for _ in range(7):  # good[1] is silent from here; good[0] beats
        h.advance(0.5)
        h.send(good[0], Heartbeat())
    check_contained(h, good, bad, newcomer, "_maybe_regather")
    # The tick is in the log with the fault as its fact, and replays to the same state (the
    # same code raises at the same place, and is contained the same way).
    ticks = [r for r in h.machine.records if r["k"] == "tick" and "fault" in r.get("x", {})]
    assert [f[:2] for f in ticks[0]["x"]["fault"]] == [["bad", "tick"]]
    assert state(replayed(h.machine.records)) == state(h.machine)


def test_a_fault_of_a_rule_of_volatile_state_replays_to_the_same_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S is chosen from Progress, which the log does not keep (a replay takes S from the
    event's facts): where the live rule raised is a fact too, and the replay raises there."""
    monkeypatch.setattr(CommitRules, "_choose_stop", raising_for("bad", CommitRules._choose_stop))
    h = Harness(machine=Recording())
    good, bad, newcomer = two_jobs_due_at_one_tick(h)
    for _ in range(7):
        h.advance(0.5)
        h.send(good[0], Heartbeat())
    check_contained(h, good, bad, newcomer, "_stop_choice")
    replays_from_every_cut(h.machine.records, h.machine)


def test_a_settle_window_whose_newcomers_left_does_not_stay_due() -> None:
    """A deadline a Tick at its time leaves due makes the server deliver Ticks without end."""
    h = Harness()
    running(h, "job")
    newcomer = h.join(job="job", **COMMITS)
    h.drop(newcomer)  # before its settle window closes
    due = h.machine.next_deadline()
    assert due is not None
    h.now = due
    h.machine.handle(Tick(), h.now)
    after = h.machine.next_deadline()
    assert after is None or after > h.now
