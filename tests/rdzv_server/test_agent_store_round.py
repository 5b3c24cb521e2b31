"""Assignment.agent_store: every node of a round hears whether the group-rank-0 node's agent
hosts the workers' TCPStore (its Join said hosts_store), so all ranks agree (issue 21)."""

from __future__ import annotations

from protocol import Assignment, Restart, WorkersFailed
from rdzv_server import state_image

from .harness import Harness, failure


def _assignments(h: Harness, *conns: int) -> dict[int, Assignment]:
    got = {}
    for c in conns:
        a = h.last(c, Assignment)
        assert isinstance(a, Assignment)
        got[c] = a
    return got


def test_every_node_hears_the_group_rank_0_nodes_store() -> None:
    h = Harness()
    a = h.join(hosts_store=True)
    b = h.join(hosts_store=False)
    got = _assignments(h, a, b)
    master = next(x for x in got.values() if x.group_rank == 0)
    conn_of_master = next(c for c, x in got.items() if x.group_rank == 0)
    assert master.agent_store is (conn_of_master == a)
    assert {x.agent_store for x in got.values()} == {master.agent_store}


def test_a_node_that_cannot_host_gives_todays_behaviour_everywhere() -> None:
    h = Harness()
    a, b = h.join(), h.join()  # older agents: no hosts_store
    assert {x.agent_store for x in _assignments(h, a, b).values()} == {False}


def test_a_rejoin_updates_what_the_node_can_host() -> None:
    h = Harness()
    a = h.join(hosts_store=True, node="na", max_restarts=1)
    b = h.join(hosts_store=True, node="nb", max_restarts=1)
    assert all(x.agent_store for x in _assignments(h, a, b).values())
    round1 = _assignments(h, a).get(a)
    assert round1 is not None
    h.send(a, WorkersFailed(round=round1.round, failure=failure(node="na")))
    assert h.last(a, Restart) is not None and h.last(b, Restart) is not None
    # The store process of both died meanwhile: they rejoin saying so.
    h.join(a, node="na", hosts_store=False, max_restarts=1)
    h.join(b, node="nb", hosts_store=False, max_restarts=1)
    got = _assignments(h, a, b)
    assert {x.round for x in got.values()} == {round1.round + 1}
    assert {x.agent_store for x in got.values()} == {False}


def test_a_snapshot_keeps_what_each_member_can_host() -> None:
    h = Harness()
    h.join(hosts_store=True, node="na")
    h.join(hosts_store=False, node="nb")
    restored = state_image.load(state_image.dump(h.machine))
    members = restored.jobs["job"].members
    assert (members["na"].hosts_store, members["nb"].hosts_store) == (True, False)
