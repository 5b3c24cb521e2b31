"""--node-rank with our rendezvous: a fixed-size job whose nodes all give one is ordered by it.

The rules (rdzv_server/machine/state.py, "Node ranks"): every node of a fixed-size job gave a node
rank -> group rank = node rank, in every round; some did not -> address order, said once in
the job's history; an elastic job ignores node ranks. A rank out of range or held by another
node is refused with an Error that names the value and both nodes; the others go on.
"""

from __future__ import annotations

from typing import Any

import msgpack

from protocol import Assignment, Error, Leave, WorkersFailed
from rdzv_server import state_image
from rdzv_server.machine.state import Rendezvous

from .harness import Harness, failure
from .test_journal import Recording, replayed, state
from .test_state import assignments

FIXED3: dict[str, Any] = dict(min_nodes=3, max_nodes=3, max_restarts=3)


def ranks_history(h: Harness, job: str = "job") -> list[str]:
    return [e.text for e in h.machine.jobs[job].history if e.kind == "ranks"]


def test_group_ranks_follow_node_ranks_when_every_node_gives_one() -> None:
    h = Harness()
    c1, c2, c3 = h.connect(), h.connect(), h.connect()
    # Addresses 10.0.0.1 < .2 < .3 would give c1, c2, c3; the node ranks say the reverse.
    h.join(c1, node_rank=2, nproc=1, **FIXED3)
    h.join(c2, node_rank=1, nproc=2, **FIXED3)
    h.join(c3, node_rank=0, nproc=4, **FIXED3)
    got = assignments(h, [c1, c2, c3])
    assert [got[c].group_rank for c in (c1, c2, c3)] == [2, 1, 0]
    # global ranks are prefix sums of nproc in node-rank order: c3 (4), c2 (2), c1 (1)
    assert [got[c].rank_offset for c in (c1, c2, c3)] == [6, 4, 0]
    assert {(a.master_addr, a.master_port) for a in got.values()} == {("10.0.0.3", 20003)}
    assert any("group ranks by --node-rank" in line for line in h.logs)
    assert ranks_history(h) == []


def test_later_rounds_keep_the_node_rank_order() -> None:
    h = Harness()
    c1, c2, c3 = h.connect(), h.connect(), h.connect()
    for c, r in ((c1, 1), (c2, 2), (c3, 0)):
        h.join(c, node_rank=r, **FIXED3)
    first = assignments(h, [c1, c2, c3])
    h.take(c1), h.take(c2), h.take(c3)
    h.send(c3, WorkersFailed(round=0, failure=failure(rank=0, node="node3")))  # group rank 0 fails
    for c, r in ((c3, 0), (c2, 2), (c1, 1)):
        h.join(c, node_rank=r, **FIXED3)
    again = assignments(h, [c1, c2, c3])
    assert (
        [again[c].group_rank for c in (c1, c2, c3)]
        == [first[c].group_rank for c in (c1, c2, c3)]
        == [1, 2, 0]
    )
    assert again[c1].round == 1 and again[c1].restart_count == 1


def test_a_duplicate_node_rank_is_refused_naming_both_nodes_and_the_job_goes_on() -> None:
    h = Harness()
    a = h.join(node="alpha", node_rank=0, **FIXED3)
    dup = h.join(node="beta", node_rank=0, **FIXED3)
    err = h.last(dup, Error)
    assert err is not None and err.code == "duplicate_node_rank" and err.fatal
    assert "--node-rank 0" in err.message and "alpha" in err.message and "beta" in err.message
    assert "10.0.0.1" in err.message and "10.0.0.2" in err.message
    assert dup in h.closed and a not in h.closed
    assert any(line.startswith("refused") and "--node-rank 0" in line for line in h.logs)
    b, c = h.join(node="gamma", node_rank=1, **FIXED3), h.join(node="delta", node_rank=2, **FIXED3)
    got = assignments(h, [a, b, c])
    assert [got[x].group_rank for x in (a, b, c)] == [0, 1, 2]


def test_a_duplicate_is_refused_even_when_the_job_is_full_and_it_would_be_a_spare() -> None:
    h = Harness()
    conns = [h.join(node_rank=r, **FIXED3) for r in range(3)]
    assignments(h, conns)
    late = h.join(node_rank=1, **FIXED3)
    err = h.last(late, Error)
    assert err is not None and err.code == "duplicate_node_rank" and "heartbeat" in err.message
    assert not h.machine.jobs["job"].spares


def test_a_node_rank_out_of_range_is_refused_and_creates_no_job() -> None:
    h = Harness()
    bad = h.join(node="far", node_rank=3, **FIXED3)
    err = h.last(bad, Error)
    assert err is not None and err.code == "node_rank_out_of_range" and err.fatal
    assert "--node-rank 3" in err.message and "--nnodes 3" in err.message and "0..2" in err.message
    assert "job" not in h.machine.jobs  # nothing left behind for a refused first join
    a = h.join(node_rank=0, **FIXED3)
    late = h.join(node_rank=7, **FIXED3)
    assert h.last(late, Error).code == "node_rank_out_of_range"  # type: ignore[union-attr]
    assert list(h.machine.jobs["job"].members) == [f"node{a}"]


def test_a_departed_nodes_rank_is_free_for_its_replacement() -> None:
    h = Harness()
    c1, c2, c3 = (h.join(node_rank=r, **FIXED3) for r in (2, 1, 0))
    assignments(h, [c1, c2, c3])
    h.drop(c2)  # node rank 1 lost
    new = h.join(node="replacement", node_rank=1, **FIXED3)
    assert h.last(new, Error) is None
    h.join(c1, node_rank=2, **FIXED3)
    h.join(c3, node_rank=0, **FIXED3)
    got = assignments(h, [c1, new, c3])
    assert [got[c].group_rank for c in (c3, new, c1)] == [0, 1, 2]


def test_a_mix_of_given_and_not_given_falls_back_to_address_order_said_once() -> None:
    h = Harness()
    c1, c2, c3 = h.connect(), h.connect(), h.connect()
    h.join(c1, node_rank=2, **FIXED3)
    h.join(c2, **FIXED3)  # no --node-rank
    h.join(c3, node_rank=0, **FIXED3)
    got = assignments(h, [c1, c2, c3])
    assert [got[c].group_rank for c in (c1, c2, c3)] == [0, 1, 2]  # by address
    (note,) = ranks_history(h)
    assert "2 of 3 nodes" in note and "node2" in note and "address order" in note
    h.send(c1, WorkersFailed(round=0, failure=failure()))
    for c, kw in ((c1, dict(node_rank=2)), (c2, {}), (c3, dict(node_rank=0))):
        h.join(c, **kw, **FIXED3)
    assignments(h, [c1, c2, c3])
    assert len(ranks_history(h)) == 1  # once per job, not per round


def test_an_elastic_job_ignores_node_ranks_and_says_so_once() -> None:
    h = Harness()
    kw: dict[str, Any] = dict(min_nodes=2, max_nodes=3, last_call_timeout=1.0)
    c1, c2 = h.connect(), h.connect()
    h.join(c1, node_rank=1, **kw)
    h.join(c2, node_rank=1, **kw)  # the same value is no conflict where ranks order nothing
    assert h.last(c2, Error) is None
    h.advance(1.5)
    got = assignments(h, [c1, c2])
    assert [got[c].group_rank for c in (c1, c2)] == [0, 1]
    (note,) = ranks_history(h)
    assert "elastic" in note and "--nnodes 2:3" in note
    c3 = h.join(node_rank=9, **kw)  # nor is a value beyond the job's size
    assert h.last(c3, Error) is None


def test_a_rejoin_must_repeat_its_node_rank() -> None:
    h = Harness()
    conns = [h.join(node_rank=r, **FIXED3) for r in range(3)]
    assignments(h, conns)
    h.send(conns[0], WorkersFailed(round=0, failure=failure()))
    h.join(conns[1], node_rank=0, **FIXED3)
    err = h.last(conns[1], Error)
    assert err is not None and err.code == "job_mismatch" and conns[1] in h.closed


def test_node_ranks_survive_a_snapshot_and_old_snapshots_still_load() -> None:
    h = Harness()
    h.join(node="alpha", node_rank=1, **FIXED3)
    h.join(node_rank=2, **FIXED3)
    d = msgpack.unpackb(msgpack.packb(state_image.dump(h.machine)), raw=False)
    assert [m["node_rank"] for m in d["jobs"][0]["members"]] == [1, 2]
    restored = Harness(machine=state_image.load(d))
    restored._next = h._next
    dup = restored.join(node="beta", node_rank=1, **FIXED3)
    err = restored.last(dup, Error)
    assert err is not None and err.code == "duplicate_node_rank" and "alpha" in err.message
    assert state_image.dump(state_image.load(d)) == d
    # A snapshot written before node ranks existed: no such keys, every node "not given".
    for job in d["jobs"]:
        job.pop("ranks_noted")
        for m in job["members"] + job["spares"]:
            m.pop("node_rank")
    old = state_image.load(d)
    assert {m.node_rank for m in old.jobs["job"].members.values()} == {-1}
    assert not old.jobs["job"].rank_holders


def test_replaying_the_log_keeps_node_ranks_and_refusals() -> None:
    h = Harness(machine=Recording())
    conns = [h.join(node_rank=r, **FIXED3) for r in (2, 0, 1)]
    h.join(node_rank=0, **FIXED3)  # refused: a duplicate
    h.join(node_rank=5, **FIXED3)  # refused: out of range
    got = assignments(h, conns)
    assert [got[c].group_rank for c in conns] == [2, 0, 1]
    h.send(conns[0], Leave(reason="bye"))
    m = h.machine
    assert isinstance(m, Recording)
    again: Rendezvous = replayed(m.records)
    assert state(again) == state(m)
    assert again.jobs["job"].order == m.jobs["job"].order
    assert isinstance(h.last(conns[1], Assignment), Assignment)


def test_node_ranks_that_are_not_0_to_n_minus_1_fall_back_to_address_order() -> None:
    # Joins cannot produce this (duplicates are refused); a round rebuilt from agents' Resumes
    # is not checked, so the order guards itself.
    h = Harness()
    c1, c2 = h.join(node_rank=1, **FIXED3), h.join(node_rank=2, **FIXED3)
    h.machine.jobs["job"].members[f"node{c2}"].node_rank = 1
    c3 = h.join(node_rank=0, **FIXED3)
    got = assignments(h, [c1, c2, c3])
    assert [got[c].group_rank for c in (c1, c2, c3)] == [0, 1, 2]
    (note,) = ranks_history(h)
    assert "not 0..n-1" in note
