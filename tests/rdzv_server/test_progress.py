"""Training progress on the server: routing, the job's progress view, straggler scores and
leaving stragglers out of the next round (with a replay that agrees)."""

from __future__ import annotations

import sys
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import Assignment, Error, Progress, Restart, Waiting, WorkersFailed
from rdzv_server.machine.history import EventKind
from rdzv_server.machine.jobs import Job, JobSettings, Member, pop_member, put_member, rank_spans
from rdzv_server.machine.progress import (
    SCORE_MAX,
    JobProgress,
    NodeProgress,
    flagged_by_node,
    flagged_scores,
    may_flag,
    straggler_scores,
)
from rdzv_server.machine.state import JobPhase

from .harness import Harness, failure
from .test_journal import Recording, replayed, state


def progress(
    rnd: int = 0, step: int = 10, compute: tuple[float, ...] = (100.0, 100.0), **kw: object
) -> Progress:
    fields: dict[str, object] = dict(
        round=rnd, min_step=step, max_step=step, step_p50_ms=120.0, step_p90_ms=150.0, compute_ms=compute
    )
    fields.update(kw)
    return Progress(**fields)  # type: ignore[arg-type]


def running(h: Harness, n: int = 2, **kw: object) -> list[int]:
    """``n`` nodes of 2 ranks each in round 0 of job "job" (fixed size unless kw says)."""
    kw = {"min_nodes": n, "max_nodes": n, "max_restarts": 5, **kw}
    conns = [h.join(**kw) for _ in range(n)]
    h.advance(0.1)
    assert all(h.last(c, Assignment) for c in conns)
    return conns


# --- pure: scores -------------------------------------------------------------------------


def view(*nodes: tuple[str, int, tuple[float, ...]]) -> JobProgress:
    p = JobProgress()
    for nid, offset, compute in nodes:
        p.nodes[nid] = NodeProgress(0, 1, 1, 0.0, 0.0, "", 0.0, 0.0, compute, offset)
    return p


def test_a_rank_twice_as_slow_is_flagged_and_a_balanced_job_flags_nobody() -> None:
    slow = straggler_scores(view(("a", 0, (100.0, 100.0)), ("b", 2, (100.0, 200.0))), 0.75)
    assert [(s.rank, s.node, s.local_rank) for s in slow] == [
        (0, "a", 0),
        (1, "a", 1),
        (2, "b", 0),
        (3, "b", 1),
    ]
    assert [s.rank for s in slow if s.flagged] == [3]
    assert slow[3].score == pytest.approx(0.5)
    assert flagged_by_node(slow) == {"b": [slow[3]]}
    balanced = straggler_scores(view(("a", 0, (100.0, 104.0)), ("b", 2, (98.0, 101.0))), 0.75)
    assert len(balanced) == 4 and not any(s.flagged for s in balanced)


def test_unknown_compute_times_are_not_scored_and_one_known_rank_scores_nobody() -> None:
    scores = straggler_scores(view(("a", 0, (0.0, 100.0)), ("b", 2, (0.0, 0.0))), 0.75)
    assert scores == []
    scores = straggler_scores(view(("a", 0, (0.0, 100.0)), ("b", 2, (300.0, 0.0))), 0.75)
    assert [(s.rank, s.flagged) for s in scores] == [(1, False), (2, True)]


# Compute times as Progress lets them through (finite, >= 0, at most 1e10 ms), with the
# extremes, exact ties and unknown ranks (0.0) a job of many nodes has.
_MS = st.one_of(
    st.sampled_from([0.0, 0.0, 5e-324, 1e-3, 100.0, 100.0, 150.0, 200.0, 1e10]),
    st.floats(min_value=0.0, max_value=1e10, allow_nan=False, allow_infinity=False),
)


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.lists(
        st.tuples(st.integers(0, 64), st.lists(_MS, max_size=9).map(tuple)),  # (offset, compute)
        max_size=12,
    ),
    threshold=st.one_of(
        st.sampled_from([0.0, 0.5, 0.75, 1.0, SCORE_MAX, 2 * SCORE_MAX]),
        st.floats(min_value=-1.0, max_value=3 * SCORE_MAX, allow_nan=False),
    ),
)
def test_the_straggler_check_flags_exactly_the_ranks_that_scoring_every_rank_flags(
    nodes: list[tuple[int, tuple[float, ...]]], threshold: float
) -> None:
    """flagged_scores (a float sort and a bisection) against straggler_scores (every rank
    scored), whatever the times: the same records in the same order, ties and overlapping
    rank offsets included."""
    p = view(*((f"n{i}", offset, compute) for i, (offset, compute) in enumerate(nodes)))
    assert flagged_scores(p, threshold) == [s for s in straggler_scores(p, threshold) if s.flagged]


@settings(max_examples=400, deadline=None)
@given(
    nodes=st.lists(
        st.tuples(st.integers(0, 64), st.lists(_MS, max_size=9).map(tuple)),  # (offset, compute)
        max_size=12,
    ),
    threshold=st.one_of(
        st.sampled_from([0.0, 0.5, 0.75, 1.0, SCORE_MAX, 2 * SCORE_MAX]),
        st.floats(min_value=-1.0, max_value=3 * SCORE_MAX, allow_nan=False),
    ),
    hint=st.one_of(_MS, st.sampled_from([100.0, 104.0])),
    known=st.sets(st.integers(0, 11)),
)
def test_the_bound_that_skips_a_straggler_check_never_hides_a_new_straggler(
    nodes: list[tuple[int, tuple[float, ...]]], threshold: float, hint: float, known: set[int]
) -> None:
    """may_flag (issue 31: the once-a-second check sorts nothing when it cannot flag a node
    not flagged already) is False only if flagged_scores flags no rank of such a node, for
    any median hint, even a stale or wrong one."""
    p = view(*((f"n{i}", offset, compute) for i, (offset, compute) in enumerate(nodes)))
    p.median_hint = hint
    skip = {f"n{i}" for i in known}
    if not may_flag(p, threshold, skip):
        assert {s.node for s in flagged_scores(p, threshold)} <= skip


def test_once_its_stragglers_are_flagged_a_jobs_check_sorts_nothing() -> None:
    times = [(f"n{i}", 8 * i, tuple(300.0 + (i * 7 + r) % 5 for r in range(8))) for i in range(50)]
    times[13] = ("n13", 104, (300.0,) * 5 + (480.0,) + (300.0,) * 2)  # 0.63 of the median speed
    p = view(*times)
    assert may_flag(p, 0.75, set())  # no median yet: the check sorts
    assert {s.node for s in flagged_scores(p, 0.75)} == {"n13"} and p.median_hint == 302.0
    assert may_flag(p, 0.75, set()) and not may_flag(p, 0.75, {"n13"})
    p.nodes["n20"].compute_ms = (300.0,) * 7 + (0.0,)  # a rank that does not mark its compute
    assert may_flag(p, 0.75, {"n13"})


def test_the_straggler_check_follows_every_update_of_the_round() -> None:
    """As the nodes' summaries replace each other (and nodes are forgotten), the cheap check
    keeps agreeing with scoring every rank from scratch."""
    import random

    rng = random.Random(7)
    p = JobProgress()
    p.start_round(0, {f"n{i}": 8 * i for i in range(40)})
    for turn in range(400):
        nid = f"n{rng.randrange(40)}"
        if turn % 37 == 36:
            p.forget(nid)
        else:
            compute = [round(300 * (1 + 0.02 * (rng.random() - 0.5)), 3) for _ in range(8)]
            if nid == "n13":
                compute[5] *= 1.6
            if rng.random() < 0.1:
                compute[rng.randrange(8)] = 0.0
            msg = progress(step=turn, compute=tuple(compute))
            p.update(nid, msg, 8, float(turn))
        for threshold in (0.75, 0.99):
            assert flagged_scores(p, threshold) == [s for s in straggler_scores(p, threshold) if s.flagged]
    assert {s.node for s in flagged_scores(p, 0.75)} <= {"n13"}


def _spans_from_scratch(job: Job) -> tuple[dict[str, range], int]:
    spans, at, nodes = {}, 0, 0
    for nid in job.order:
        m = job.members.get(nid)
        if m is not None:
            spans[nid] = range(at, at + m.nproc)
            at += m.nproc
            nodes += 1
    return spans, nodes


def test_rank_spans_are_derived_again_exactly_when_the_order_or_the_members_change() -> None:
    """jobs.rank_spans (kept between changes) equals the spans computed from scratch after
    each change of the members or the order, and costs nothing while they stay."""
    job = Job("job", JobSettings(1, 8, "train.py", 0, 0.0, 5.0))

    def member(nid: str, nproc: int) -> Member:
        return Member(node_id=nid, conn=0, addr="10.0.0.1", nproc=nproc, master_port=1, seq=0)

    def check() -> None:
        got = rank_spans(job)
        assert (dict(got.spans), got.nodes) == _spans_from_scratch(job)
        assert rank_spans(job) is got  # nothing changed: the same, not derived again

    check()
    for nid, nproc in (("a", 2), ("b", 4), ("c", 1)):
        put_member(job, member(nid, nproc))
        check()
    job.order = ["b", "a", "c"]
    check()
    pop_member(job, "a")  # a member of the round left: the later ones' ranks move down
    check()
    put_member(job, member("a", 8))  # back, with another nproc
    check()
    job.order = ["c", "a", "x", "b"]  # a node of the order that is not a member counts no ranks
    check()
    with pytest.raises(TypeError):
        rank_spans(job).spans["c"] = range(0)  # type: ignore[index]


# --- routing ------------------------------------------------------------------------------


def test_progress_is_kept_per_node_with_its_age_lag_and_rate() -> None:
    h = Harness()
    a, b = running(h)
    h.take(a), h.take(b)
    job = h.machine.jobs["job"]
    h.send(a, progress(step=10, phase="compute", age_ms=500.0))
    h.send(b, progress(step=7))
    assert not h.machine.unchanged
    p = job.progress
    assert p.round == 0 and set(p.nodes) == {"node1", "node2"}
    assert p.nodes["node2"].rank_offset == 2  # the second node's ranks are 2 and 3
    assert p.lag("node2") == 3 and p.lag("node1") == 0 and p.fastest() == 10 and p.min_step() == 7
    h.advance(2.0)
    assert p.nodes["node1"].age_s(h.now) == pytest.approx(2.5, abs=0.01)  # agent's 0.5 s + 2 s here
    assert p.oldest(h.now) is p.nodes["node1"]
    h.send(a, progress(step=30))
    assert p.steps_per_s == pytest.approx(20 / 2.0, rel=0.01)
    assert p.max_step == 30
    assert h.take(a) == [] and h.take(b) == []  # nothing is answered to a Progress


def test_progress_of_another_round_or_from_a_spare_is_ignored_and_before_joining_refused() -> None:
    h = Harness()
    a, b = running(h)
    h.send(a, progress(rnd=5))
    assert h.machine.unchanged and not h.machine.jobs["job"].progress.nodes
    spare = h.join(spare=True, min_nodes=2, max_nodes=2, max_restarts=5)
    h.take(spare)
    h.send(spare, progress())
    assert h.machine.unchanged and spare not in h.closed
    # A round restarted: the old round's frames are stale, not errors.
    h.send(a, WorkersFailed(round=0, failure=failure()))
    assert h.last(b, Restart)
    h.send(b, progress(rnd=0))
    assert h.machine.unchanged and b not in h.closed
    c = h.connect()
    h.send(c, progress())
    err = h.last(c, Error)
    assert err is not None and err.code == "unexpected_message" and c in h.closed


def test_a_member_flooding_progress_keeps_memory_flat() -> None:
    h = Harness()
    a, b = running(h)
    job = h.machine.jobs["job"]
    h.send(b, progress(step=1))
    for i in range(200):
        h.send(a, progress(step=i, compute=(100.0 + i, 100.0)))
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(200, 10_200):
        h.now += 0.001
        h.send(a, progress(step=i, compute=(100.0 + i % 7, 100.0)))
    grew = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert grew < 64 * 1024, f"10,000 Progress frames grew the machine by {grew} bytes"
    assert len(job.progress.nodes) == 2 and len(job.history) < 20
    assert sys.getsizeof(job.progress.nodes["node1"].compute_ms) < 200


def test_compute_times_beyond_the_nodes_ranks_are_cut() -> None:
    h = Harness()
    a, _ = running(h)
    h.send(a, progress(compute=(1.0,) * 4096))
    assert len(h.machine.jobs["job"].progress.nodes["node1"].compute_ms) == 2  # nproc 2


# --- stragglers ---------------------------------------------------------------------------


def test_a_slow_rank_is_noted_once_per_round_with_its_score() -> None:
    h = Harness()
    a, b = running(h)
    job = h.machine.jobs["job"]
    for i in range(3):  # within a bounded number of summaries: the first that has both nodes
        h.send(a, progress(step=i, compute=(100.0, 100.0)))
        h.send(b, progress(step=i, compute=(100.0, 210.0)))
        h.advance(1.0)
    events = [e for e in job.history if e.kind is EventKind.STRAGGLER]
    assert len(events) == 1
    e = events[0]
    assert e.node == "node2" and e.ranks == (3,) and e.scores[0] == pytest.approx(100 / 210)
    assert "rank 3 at 0.48" in e.text and e.round == 0
    assert job.progress.flagged == {"node2": (3,)}


def test_a_balanced_job_notes_no_straggler() -> None:
    h = Harness()
    a, b = running(h)
    for i in range(5):
        h.send(a, progress(step=i, compute=(100.0, 101.0)))
        h.send(b, progress(step=i, compute=(99.0, 102.0)))
        h.advance(1.0)
    assert not [e for e in h.machine.jobs["job"].history if e.kind is EventKind.STRAGGLER]


def test_the_threshold_is_the_jobs_setting() -> None:
    h = Harness()
    a, b = running(h, straggler_threshold=0.4)
    h.send(a, progress(compute=(100.0, 100.0)))
    h.send(b, progress(compute=(100.0, 210.0)))  # 0.48: above 0.4
    assert not [e for e in h.machine.jobs["job"].history if e.kind is EventKind.STRAGGLER]


def test_a_node_with_other_straggler_settings_is_refused() -> None:
    h = Harness()
    h.join()
    c = h.join(straggler_threshold=0.6)
    err = h.last(c, Error)
    assert err is not None and err.code == "job_mismatch"
    assert "straggler_threshold: the job has 0.75, this agent has 0.6" in err.message
    d = h.join(exclude_stragglers=True)
    err = h.last(d, Error)
    assert err is not None and "exclude_stragglers: the job has 0, this agent has 1" in err.message
    e = h.join(crash_loop_restarts=0)
    err = h.last(e, Error)
    assert err is not None and "crash_loop_restarts: the job has 3, this agent has 0" in err.message


def elastic_with_a_straggler(h: Harness, *, exclude: bool) -> list[int]:
    kw = dict(min_nodes=2, max_nodes=3, max_restarts=5, last_call_timeout=1.0, exclude_stragglers=exclude)
    conns = [h.join(**kw) for _ in range(3)]
    h.advance(0.1)
    assert all(h.last(c, Assignment) for c in conns)
    for i in range(2):
        for c in conns:
            slow = 250.0 if c == conns[2] else 100.0
            h.send(c, progress(step=i, compute=(100.0, slow)))
        h.advance(1.0)
    return conns


def test_exclude_stragglers_leaves_the_node_out_of_the_next_round_only_when_one_forms() -> None:
    h = Harness()
    a, b, c = elastic_with_a_straggler(h, exclude=True)
    job = h.machine.jobs["job"]
    assert c not in h.closed and job.phase is JobPhase.RUNNING  # never stopped on the spot
    h.send(a, WorkersFailed(round=0, failure=failure()))  # a restart, for another reason
    kw = dict(min_nodes=2, max_nodes=3, max_restarts=5, last_call_timeout=1.0, exclude_stragglers=True)
    for x in (a, b, c):
        h.join(x, **kw)
    h.advance(0.1)
    err = h.last(c, Error)
    assert err is not None and err.code == "excluded" and "straggler: rank 5" in err.message
    assert c in h.closed and "node3" in job.excluded
    assert job.phase is JobPhase.RUNNING and job.order == ["node1", "node2"]
    assert h.last(a, Assignment).round == 1  # type: ignore[union-attr]


def test_without_exclude_stragglers_the_node_stays() -> None:
    h = Harness()
    a, b, c = elastic_with_a_straggler(h, exclude=False)
    h.send(a, WorkersFailed(round=0, failure=failure()))
    kw = dict(min_nodes=2, max_nodes=3, max_restarts=5, last_call_timeout=1.0)
    for x in (a, b, c):
        h.join(x, **kw)
    h.advance(0.1)
    assert c not in h.closed and len(h.machine.jobs["job"].order) == 3


def test_a_straggler_is_kept_when_the_job_cannot_go_on_without_it() -> None:
    h = Harness()
    a, b = running(h, exclude_stragglers=True)  # fixed size 2, no spare
    h.send(a, progress(compute=(100.0, 100.0)))
    h.send(b, progress(compute=(100.0, 300.0)))
    h.send(a, WorkersFailed(round=0, failure=failure()))
    kw = dict(min_nodes=2, max_nodes=2, max_restarts=5, exclude_stragglers=True)
    h.join(a, **kw), h.join(b, **kw)
    assert b not in h.closed and h.last(b, Assignment) is not None


def test_a_spare_takes_the_stragglers_place_in_a_fixed_size_job() -> None:
    h = Harness()
    kw = dict(min_nodes=2, max_nodes=2, max_restarts=5, exclude_stragglers=True)
    a, b = running(h, exclude_stragglers=True)
    s = h.join(spare=True, **kw)
    assert h.last(s, Waiting) is not None
    h.send(a, progress(compute=(100.0, 100.0)))
    h.send(b, progress(compute=(100.0, 300.0)))
    h.send(a, WorkersFailed(round=0, failure=failure()))
    h.join(a, **kw), h.join(b, **kw)
    assert b in h.closed
    got = h.last(s, Assignment)
    assert got is not None and got.round == 1 and h.machine.jobs["job"].order == ["node1", "node3"]


def test_straggler_notes_and_exclusion_replay_to_the_same_state() -> None:
    """Progress is not logged; what the machine decided from it is, with the event that did."""
    h = Harness(machine=Recording())
    a, b, c = elastic_with_a_straggler(h, exclude=True)
    h.send(a, WorkersFailed(round=0, failure=failure()))
    kw = dict(min_nodes=2, max_nodes=3, max_restarts=5, last_call_timeout=1.0, exclude_stragglers=True)
    for x in (a, b, c):
        h.join(x, **kw)
    h.advance(0.1)
    m = h.machine
    assert "node3" in m.jobs["job"].excluded
    kinds = [r["k"] for r in m.records]
    # No Progress record but the one that noted a straggler and the round's first step (its
    # time and step are a fact of the job's goodput, issue 47).
    assert kinds.count("received") < 20
    with_facts = [r for r in m.records if "x" in r]
    assert [sorted(r["x"]) for r in with_facts] == [["first_step"], ["stragglers"], ["left_out"]]
    again = replayed(m.records)
    assert state(again) == state(m)
    assert any(e.kind is EventKind.STRAGGLER for e in again.jobs["job"].history)
    # Without the facts the replay would differ: the decision is in the log, not recomputed.
    bare = [{k: v for k, v in r.items() if k != "x"} for r in m.records]
    assert state(replayed(bare)) != state(m)
