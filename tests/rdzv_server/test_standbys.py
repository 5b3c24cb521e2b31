"""Standby rendezvous hosts (issue 45): a server an agent hosts names, with every round, where
each job's members go if that agent is lost."""

from __future__ import annotations

from protocol import Assignment, Heartbeat, JobFailed, Join, Restart, Resume, Standbys
from rdzv_server.machine.standbys import TakeOver
from rdzv_server.machine.state import RESUME_WINDOW, Rendezvous

from .harness import Harness


def _hosted(node: str = "host", term: int = 0) -> Harness:
    return Harness(machine=Rendezvous(host_node=node, standby_term=term))


def test_every_member_learns_the_same_standbys_in_rank_order_never_the_host() -> None:
    h = _hosted(term=2)
    conns = [h.join(node=n, min_nodes=3, max_nodes=3, standby_port=29500) for n in ("host", "nb", "nc")]
    said = [h.last(c, Standbys) for c in conns]
    assert said[0] == said[1] == said[2]
    order = {h.last(c, Assignment).group_rank: n for c, n in zip(conns, ("host", "nb", "nc"), strict=True)}  # type: ignore[union-attr]
    expected = [order[r] for r in sorted(order) if order[r] != "host"]
    s = said[0]
    assert isinstance(s, Standbys)
    assert (s.term, s.host_node) == (2, "host")
    assert list(s.nodes) == expected
    addrs = {n: f"10.0.0.{c}:29500" for c, n in zip(conns, ("host", "nb", "nc"), strict=True)}
    assert list(s.endpoints) == [addrs[n] for n in expected]


def test_at_most_two_standbys_and_only_nodes_that_offered_a_port() -> None:
    h = _hosted()
    ports = {"host": 29500, "nb": 0, "nc": 29501, "nd": 29502, "ne": 29503}
    conns = [h.join(node=n, min_nodes=5, max_nodes=5, standby_port=p) for n, p in ports.items()]
    s = h.last(conns[0], Standbys)
    assert isinstance(s, Standbys)
    assert len(s.nodes) == 2 and "nb" not in s.nodes and "host" not in s.nodes
    assert h.last(conns[1], Standbys) is None  # it offered no port: an older agent, never told


def test_a_rdzv_server_names_no_standbys() -> None:
    h = Harness()
    conns = [h.join(node=n, standby_port=29500) for n in ("na", "nb")]
    assert all(h.last(c, Assignment) is not None and h.last(c, Standbys) is None for c in conns)


def test_each_new_round_names_them_again_without_the_lost_node() -> None:
    h = _hosted()
    a = h.join(node="host", min_nodes=1, max_nodes=3, standby_port=29500, max_restarts=3)
    b = h.join(node="nb", min_nodes=1, max_nodes=3, standby_port=29500, max_restarts=3)
    h.advance(6.0)  # the last call
    s = h.last(b, Standbys)
    assert isinstance(s, Standbys) and s.nodes == ("nb",)
    c = h.join(node="nc", min_nodes=1, max_nodes=3, standby_port=29500, max_restarts=3)
    h.drop(b)
    h.take(a)
    for conn in (a, c):
        h.join(
            conn,
            node="host" if conn == a else "nc",
            min_nodes=1,
            max_nodes=3,
            standby_port=29500,
            max_restarts=3,
        )
    h.advance(6.0)
    s = h.last(c, Standbys)
    assert isinstance(s, Standbys) and s.nodes == ("nc",)


def test_a_standby_that_took_over_does_not_wait_for_the_lost_host() -> None:
    """The round's nodes resume into the standby's new server; the old host cannot come back,
    so once the others are back the round goes on without it, not at the resume window."""
    old = _hosted()
    conns = {
        n: old.join(node=n, min_nodes=1, max_nodes=3, standby_port=29500, max_restarts=3)
        for n in ("host", "nb", "nc")
    }
    old.advance(6.0)
    held = {n: old.last(c, Assignment) for n, c in conns.items()}
    said = old.last(conns["nb"], Standbys)
    assert isinstance(said, Standbys) and said.host_in_round and said.nodes[0] in ("nb", "nc")
    standby = said.nodes[0]
    new = Harness(machine=Rendezvous(host_node=standby, standby_term=1, taken_over=TakeOver("job", "host")))
    first = {}
    for node in ("nb", "nc"):
        c = new.connect()
        a = held[node]
        assert isinstance(a, Assignment)
        join = Join(
            job_id="job", node_id=node, addr=f"10.0.0.{conns[node]}", nproc=2, min_nodes=1, max_nodes=3,
            entrypoint="train.py", master_port=20000 + c, max_restarts=3, last_call_timeout=5.0,
            heartbeat_interval=1.0, heartbeat_timeout=5.0, standby_port=29500,
        )  # fmt: skip
        new.send(c, Resume(join=join, assignment=a))
        first[node] = new.take(c)
    # The first back waits for the others; the second completes what can come back: restarted.
    assert not any(isinstance(m, Restart) for m in first["nb"])
    assert any(isinstance(m, Restart) for m in first["nc"])
    assert any("node host, which hosted the rendezvous, is lost" in line for line in new.logs)
    assert new.now == 0.0  # no window waited out
    # The history (status, /v1/jobs) says who took over, at which term, from whom, and when.
    took = [e for e in new.machine.jobs["job"].history if e.kind == "takeover"]
    assert len(took) == 1 and took[0].time == 0.0 and took[0].node == standby, took
    assert took[0].text == (
        f"node {standby} took over the rendezvous (term 1): node host, which hosted it, is lost; "
        f"rebuilding round {held['nb'].round}"  # type: ignore[union-attr]
    )


def test_the_lost_host_is_waited_for_only_where_it_held_a_place() -> None:
    h = Harness(machine=Rendezvous(host_node="nb", standby_term=1, taken_over=TakeOver("other-job", "host")))
    c = h.connect()
    a = Assignment(
        job_id="job", round=0, group_rank=0, group_world_size=2, rank_offset=0, world_size=4,
        master_addr="10.0.0.1", master_port=20001, restart_count=0, max_restarts=3,
    )  # fmt: skip
    join = Join(
        job_id="job", node_id="nb", addr="10.0.0.2", nproc=2, min_nodes=1, max_nodes=3,
        entrypoint="train.py", master_port=20002, max_restarts=3, last_call_timeout=5.0,
        heartbeat_interval=1.0, heartbeat_timeout=5.0,
    )  # fmt: skip
    h.send(c, Resume(join=join, assignment=a))
    assert not any(isinstance(m, Restart) for m in h.take(c))  # another job's host: the window


def test_a_spare_that_waits_is_told_the_standbys_at_once() -> None:
    h = _hosted()
    for n in ("host", "nb"):
        h.join(node=n, standby_port=29500)
    spare = h.join(node="nc", standby_port=29500)
    s = h.last(spare, Standbys)
    assert isinstance(s, Standbys) and s.nodes == ("nb",) and s.host_in_round


def _resume_after_take_over(node: str, conn_addr: int, round_of: int = 2) -> tuple[Harness, int]:
    """A fixed-size job of ``round_of`` nodes whose host ("host") was lost: ``node`` took over
    and resumes its place (group rank 1) into its own new server."""
    h = Harness(machine=Rendezvous(host_node=node, standby_term=1, taken_over=TakeOver("job", "host")))
    c = h.connect()
    a = Assignment(
        job_id="job", round=0, group_rank=1, group_world_size=round_of, rank_offset=2,
        world_size=2 * round_of, master_addr="10.0.0.1", master_port=20001, restart_count=0,
        max_restarts=3,
    )  # fmt: skip
    join = Join(
        job_id="job", node_id=node, addr=f"10.0.0.{conn_addr}", nproc=2, min_nodes=round_of,
        max_nodes=round_of, entrypoint="train.py", master_port=20002, max_restarts=3,
        last_call_timeout=5.0, heartbeat_interval=1.0, heartbeat_timeout=5.0,
    )  # fmt: skip
    h.send(c, Resume(join=join, assignment=a))
    return h, c


def _beat(h: Harness, conn: int, seconds: float) -> None:
    for _ in range(int(seconds)):
        h.advance(1.0)
        h.send(conn, Heartbeat())


def test_a_fixed_size_job_without_a_spare_fails_naming_the_lost_host() -> None:
    h, c = _resume_after_take_over("nb", 2)
    assert h.last(c, Restart) is not None  # the rebuild gave up on the host at once
    _beat(h, c, RESUME_WINDOW - 1)
    assert h.last(c, JobFailed) is None  # a spare may still be on its way
    _beat(h, c, 2)
    failed = h.last(c, JobFailed)
    assert isinstance(failed, JobFailed) and failed.code == "host_lost"
    assert "node host, which hosted the rendezvous, is lost" in failed.reason
    assert "needs 2 nodes, 1 remain" in failed.reason


def test_a_spare_arriving_within_the_window_takes_the_lost_hosts_place() -> None:
    h, c = _resume_after_take_over("nb", 2)
    _beat(h, c, 4)  # the spare's walk: the old host first, then this standby
    d = h.join(node="nd", min_nodes=2, max_nodes=2, max_restarts=3)
    h.send(c, Join(
        job_id="job", node_id="nb", addr="10.0.0.2", nproc=2, min_nodes=2, max_nodes=2,
        entrypoint="train.py", master_port=20002, max_restarts=3, last_call_timeout=5.0,
        heartbeat_interval=1.0, heartbeat_timeout=5.0,
    ))  # fmt: skip
    _beat(h, c, RESUME_WINDOW)
    assert h.last(c, Assignment) is not None and h.last(d, Assignment) is not None
    assert h.last(c, JobFailed) is None


def test_nor_for_the_standbys_before_it_that_did_not_answer() -> None:
    h = Harness(
        machine=Rendezvous(host_node="nd", standby_term=1, taken_over=TakeOver("job", "host", ("nb",)))
    )
    conns = []
    for rank, node in ((2, "nc"), (3, "nd")):
        c = h.connect()
        a = Assignment(
            job_id="job", round=0, group_rank=rank, group_world_size=4, rank_offset=2 * rank,
            world_size=8, master_addr="10.0.0.1", master_port=20001, restart_count=0, max_restarts=3,
        )  # fmt: skip
        join = Join(
            job_id="job", node_id=node, addr=f"10.0.0.{rank + 1}", nproc=2, min_nodes=2, max_nodes=4,
            entrypoint="train.py", master_port=20002, max_restarts=3, last_call_timeout=5.0,
            heartbeat_interval=1.0, heartbeat_timeout=5.0,
        )  # fmt: skip
        h.send(c, Resume(join=join, assignment=a))
        conns.append(c)
    assert h.last(conns[1], Restart) is not None and h.now == 0.0
    line = "node host, which hosted the rendezvous, is lost; its standby nb did not answer"
    assert any(line in text for text in h.logs), h.logs


def test_a_newcomer_first_through_the_door_starts_the_job_anew_and_the_history_says_so() -> None:
    """A node that waited to join (told the standbys) can reach the standby before any node
    of the round resumes: the job gathers anew there, and its history still says who took over."""
    new = Harness(machine=Rendezvous(host_node="nb", standby_term=1, taken_over=TakeOver("job", "host")))
    c = new.join(node="nc", min_nodes=1, max_nodes=3, standby_port=29500)
    assert c
    took = [e.text for e in new.machine.jobs["job"].history if e.kind == "takeover"]
    assert took == [
        "node nb took over the rendezvous (term 1): node host, which hosted it, is lost; "
        "a node joined first: the job gathers anew"
    ]
    other = Harness(machine=Rendezvous(host_node="nb", standby_term=1, taken_over=TakeOver("other", "host")))
    other.join(node="nc", min_nodes=1, max_nodes=3, standby_port=29500)
    assert not any(e.kind == "takeover" for e in other.machine.jobs["job"].history)
