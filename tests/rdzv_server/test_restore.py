"""In-memory snapshots on the server (issue 35): one restore step for every rank, where each
node fetches what it lacks, what every agent keeps, and what the history says."""

from __future__ import annotations

from protocol import Assignment, KeepSnapshot, Progress, Restart, SnapshotsHeld, WorkersFailed
from rdzv_server.restore_points import RestorePoints

from .harness import Harness, failure

KEYS = {"na": "aa" * 32, "nb": "bb" * 32, "nc": "cc" * 32}


def _join(h: Harness, node: str, conn: int | None = None, **kw: object) -> int:
    fields: dict[str, object] = {"max_restarts": 3, "replica_port": 40000, "replica_key": KEYS[node]}
    fields.update(kw)
    return h.join(conn, node=node, **fields)


def _assignment(h: Harness, conn: int) -> Assignment:
    a = h.last(conn, Assignment)
    assert isinstance(a, Assignment)
    return a


def _held(h: Harness, conn: int, world: int, pairs: list[tuple[int, int]]) -> None:
    h.send(
        conn,
        SnapshotsHeld(world_size=world, ranks=tuple(r for r, _ in pairs), steps=tuple(s for _, s in pairs)),
    )


def _two_nodes(h: Harness) -> tuple[int, int]:
    a, b = _join(h, "na"), _join(h, "nb")
    return (a, b) if _assignment(h, a).group_rank == 0 else (b, a)


def test_each_node_replicates_to_the_next_in_a_ring() -> None:
    h = Harness()
    first, second = _two_nodes(h)
    one, two = _assignment(h, first), _assignment(h, second)
    assert one.replica_to == f"10.0.0.{second}:40000" and two.replica_to == f"10.0.0.{first}:40000"
    assert {one.replica_key, two.replica_key} == {KEYS["na"], KEYS["nb"]}
    assert one.replica_key != KEYS["na" if first == 1 else "nb"]  # the peer's key, not its own
    assert one.restore_step == two.restore_step == -1  # nothing held yet


def test_the_step_every_rank_has_twice_is_kept_and_a_failure_restores_the_newest_held() -> None:
    h = Harness()
    first, second = _two_nodes(h)
    rnd = _assignment(h, first).round
    # Node 0 holds ranks 0-1 (its own) and replicas of 2-3; node 1 the other way round. Its
    # newest own snapshots (11) are not replicated yet.
    _held(h, first, 4, [(0, 10), (1, 10), (0, 11), (1, 11), (2, 10), (3, 10)])
    # Ranks 2-3 are on one node only: nothing kept yet; step 10, which every rank has, is copied.
    assert h.last(first, KeepSnapshot) == KeepSnapshot(step=-1, replicate=10)
    _held(h, second, 4, [(2, 10), (3, 10), (2, 11), (3, 11), (0, 10), (1, 10)])
    kept = KeepSnapshot(step=10, replicate=11)  # 10 on two nodes; 11 now on one for every rank
    assert h.last(first, KeepSnapshot) == kept == h.last(second, KeepSnapshot)
    assert h.machine.jobs["job"].snapshot_step == 11
    h.send(first, Progress(round=rnd, min_step=12, max_step=13))
    h.take(first), h.take(second)
    h.send(second, WorkersFailed(round=rnd, failure=failure(node="nb")))
    assert h.last(first, Restart) is not None
    _join(h, "na", first), _join(h, "nb", second)
    got = [_assignment(h, c) for c in (first, second)]
    assert {a.restore_step for a in got} == {11}
    assert all(a.restore_source == (-1, -1) and a.restore_addrs == () for a in got)  # held locally
    texts = [e.text for e in h.machine.jobs["job"].history]
    assert any(
        "resumes every rank from the in-memory snapshot of step 11: 2 steps lost" in t for t in texts
    ), texts


def test_a_spare_that_takes_a_lost_nodes_place_fetches_its_ranks_from_the_replica() -> None:
    h = Harness()
    first, second = _two_nodes(h)
    spare = _join(h, "nc")
    _held(h, first, 4, [(0, 10), (1, 10), (2, 10), (3, 10)])
    _held(h, second, 4, [(2, 10), (3, 10), (0, 10), (1, 10)])
    h.drop(second)  # node 1 is lost; the spare takes its place
    _join(h, "na" if first == 1 else "nb", first)
    _join(h, "nc", spare)
    a, s = _assignment(h, first), _assignment(h, spare)
    assert a.restore_step == s.restore_step == 10
    assert a.restore_source == (-1, -1)
    assert s.rank_offset == 2 and s.restore_source == (0, 0)
    assert s.restore_addrs == (f"10.0.0.{first}:40000",)
    assert s.restore_keys == (KEYS["na" if first == 1 else "nb"],)


def test_no_restore_when_a_rank_is_held_nowhere_or_the_world_changed() -> None:
    h = Harness()
    first, second = _two_nodes(h)
    rnd = _assignment(h, first).round
    _held(h, first, 4, [(0, 10), (1, 10), (2, 10)])  # rank 3 at step 10: nowhere
    _held(h, second, 4, [(2, 10), (7, 10), (9, 10)])  # ranks past the world are ignored
    h.send(second, WorkersFailed(round=rnd, failure=failure(node="nb")))
    _join(h, "na" if first == 1 else "nb", first), _join(h, "nb" if first == 1 else "na", second)
    assert _assignment(h, first).restore_step == -1
    assert not any(e.kind == "restore" for e in h.machine.jobs["job"].history)


def test_an_agent_that_never_snapshots_gets_nothing_new() -> None:
    h = Harness()
    a, b = h.join(node="na", max_restarts=1), h.join(node="nb", max_restarts=1)
    for c in (a, b):
        got = _assignment(h, c)
        assert (got.restore_step, got.replica_to, got.restore_source) == (-1, "", ())
    _held(h, a, 4, [(0, 1)])
    assert h.last(b, KeepSnapshot) is None


def test_restore_points_count_copies_and_forget_a_node() -> None:
    p = RestorePoints()
    p.update("a", 2, [(0, 5), (1, 5), (0, 6)])
    assert p.newest(2) == 5 and p.newest(2, twice=True) == -1
    p.update("b", 2, [(0, 5), (1, 5), (1, 6)])
    assert (p.newest(2), p.newest(2, twice=True)) == (6, 5)
    assert p.newest_among(2, {"a"}) == 5 and p.holders(2, 6, 1) == {"b"}
    assert not p.update("b", 2, [(1, 6), (0, 5), (1, 5)])  # the same holdings: no news
    p.drop("b")
    assert (p.newest(2), p.newest(2, twice=True), len(p)) == (5, -1, 1)
    p.update("a", 2, [])
    assert (p.newest(2), len(p), p._index, p._twice) == (-1, 0, {}, {})


def test_the_step_being_copied_stays_the_same_until_every_copy_is_done() -> None:
    # Ranks snapshotting every step: each node's newest moves on while the copies are made. The
    # server names one step for all to copy and keeps naming it until it is on two nodes.
    h = Harness()
    first, second = _two_nodes(h)
    _held(h, first, 4, [(0, 5), (1, 5)])
    _held(h, second, 4, [(2, 5), (3, 5)])
    assert h.last(first, KeepSnapshot) == KeepSnapshot(step=-1, replicate=5) == h.last(second, KeepSnapshot)
    h.take(first), h.take(second)
    for step in (6, 7, 8):  # newer steps everywhere, and the copy of 5 half done
        _held(h, first, 4, [(0, step), (1, step), (0, 5), (1, 5), (2, 5)])
        _held(h, second, 4, [(2, step), (3, step), (2, 5), (3, 5)])
    assert h.last(first, KeepSnapshot) is None and h.last(second, KeepSnapshot) is None
    _held(h, second, 4, [(2, 8), (3, 8), (2, 5), (3, 5), (0, 5), (1, 5)])
    assert h.last(first, KeepSnapshot) is None  # rank 3's copy on node 0 is still missing
    _held(h, first, 4, [(0, 8), (1, 8), (0, 5), (1, 5), (2, 5), (3, 5)])
    assert h.last(first, KeepSnapshot) == KeepSnapshot(step=5, replicate=8) == h.last(second, KeepSnapshot)
    assert h.machine.jobs["job"].snapshot_step == 8


def test_a_job_of_one_node_keeps_its_newest_and_copies_nothing() -> None:
    h = Harness()
    conn = _join(h, "na", min_nodes=1, max_nodes=1)
    _held(h, conn, 2, [(0, 3), (1, 3)])
    assert h.last(conn, KeepSnapshot) == KeepSnapshot(step=3, replicate=-1)


def test_a_restore_and_the_steps_it_lost_replay_from_the_state_log() -> None:
    """The step restored from and the step the job had reached are both volatile live (the
    holdings, the progress): the history a replay rebuilds says what the live server said.
    Found by the model test: a replay said "no step lost" where the live server counted them."""
    from .test_journal import Recording, replays_from_every_cut

    h = Harness(machine=Recording())
    first, second = _two_nodes(h)
    rnd = _assignment(h, first).round
    _held(h, first, 4, [(0, 10), (1, 10), (2, 10), (3, 10)])
    _held(h, second, 4, [(2, 10), (3, 10), (0, 10), (1, 10)])
    h.send(first, Progress(round=rnd, min_step=14, max_step=15))
    h.send(second, WorkersFailed(round=rnd, failure=failure(node="nb")))
    _join(h, "na", first), _join(h, "nb", second)
    assert {_assignment(h, c).restore_step for c in (first, second)} == {10}
    said = [e.text for e in h.machine.jobs["job"].history if e.kind == "restore"]
    assert said == [
        f"round {rnd + 1} resumes every rank from the in-memory snapshot of step 10: "
        "5 steps lost (the job had reached step 15)"
    ]
    replays_from_every_cut(h.machine.records, h.machine)


def test_a_new_job_restores_the_newest_step_every_member_offers_from_its_snapshot_dir() -> None:
    """--snapshot-dir: nothing in memory (the whole job was lost), every Join offers the steps
    its directory holds complete: the round restores the newest one all offer, read back by
    each node from its directory."""
    from .test_journal import Recording, replays_from_every_cut

    h = Harness(machine=Recording())
    a = _join(h, "na", durable_world=4, durable_steps=(30, 20))
    b = _join(h, "nb", durable_world=4, durable_steps=(20, 10))  # 30 not complete there yet
    got = [_assignment(h, c) for c in (a, b)]
    assert [(x.restore_step, x.restore_durable, x.restore_source) for x in got] == [(20, True, ())] * 2
    said = [e.text for e in h.machine.jobs["job"].history if e.kind == "restore"]
    assert said == [
        "round 0 resumes every rank from the snapshot of step 20 persisted in --snapshot-dir: no step lost"
    ]
    replays_from_every_cut(h.machine.records, h.machine)


def test_no_durable_restore_unless_every_member_offers_a_common_step_of_the_worlds_size() -> None:
    for first, second in (
        ({"durable_world": 4, "durable_steps": (30,)}, {}),  # one offers nothing
        ({"durable_world": 4, "durable_steps": (30,)}, {"durable_world": 4, "durable_steps": (20,)}),
        ({"durable_world": 2, "durable_steps": (30,)}, {"durable_world": 2, "durable_steps": (30,)}),
    ):
        h = Harness()
        a, b = _join(h, "na", **first), _join(h, "nb", **second)
        assert [(_assignment(h, c).restore_step, _assignment(h, c).restore_durable) for c in (a, b)] == [
            (-1, False)
        ] * 2


def test_a_newer_step_in_memory_wins_over_the_snapshot_dir() -> None:
    h = Harness()
    first, second = _two_nodes(h)
    rnd = _assignment(h, first).round
    _held(h, first, 4, [(0, 40), (1, 40), (2, 40), (3, 40)])
    _held(h, second, 4, [(2, 40), (3, 40), (0, 40), (1, 40)])
    h.send(second, WorkersFailed(round=rnd, failure=failure(node="nb")))
    durable = {"durable_world": 4, "durable_steps": (40, 30)}  # a tie: memory, no disk read
    _join(h, "na", first, **durable), _join(h, "nb", second, **durable)
    got = [_assignment(h, c) for c in (first, second)]
    assert [(x.restore_step, x.restore_durable) for x in got] == [(40, False)] * 2
