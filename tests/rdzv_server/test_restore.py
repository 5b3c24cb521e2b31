"""In-memory snapshots on the server (issue 35): one restore step for every rank, where each
node fetches what it lacks, what every agent keeps, and what the history says."""

from __future__ import annotations

import hashlib

from protocol import Assignment, KeepSnapshot, Progress, Restart, SnapshotsHeld, WorkersFailed
from rdzv_server.machine.restore_points import RestorePoints

from .harness import Harness, failure

KEYS = {"na": "aa" * 32, "nb": "bb" * 32, "nc": "cc" * 32, "nd": "dd" * 32}


def _join(h: Harness, node: str, conn: int | None = None, **kw: object) -> int:
    fields: dict[str, object] = {"max_restarts": 3, "replica_port": 40000, "replica_key": KEYS[node]}
    fields.update(kw)
    return h.join(conn, node=node, **fields)


def _assignment(h: Harness, conn: int) -> Assignment:
    a = h.last(conn, Assignment)
    assert isinstance(a, Assignment)
    return a


def digest(rank: int, step: int, made: str = "") -> str:
    """The sha256 of rank's snapshot of step (``made``: another making of it)."""
    return hashlib.sha256(f"{rank}@{step}{made}".encode()).hexdigest()


def _held(
    h: Harness, conn: int, world: int, pairs: list[tuple[int, int]], digests: list[str] | None = None
) -> None:
    h.send(
        conn,
        SnapshotsHeld(
            world_size=world,
            ranks=tuple(r for r, _ in pairs),
            steps=tuple(s for _, s in pairs),
            digests=tuple(digests if digests is not None else [digest(r, s) for r, s in pairs]),
        ),
    )


def _copied(h: Harness, first: int, second: int, step: int) -> None:
    """Both nodes of a 2 x 2 job snapshot ``step``; the server asks each to copy it to the
    other, and both say they hold the copies (as real agents do, in that order)."""
    _held(h, first, 4, [(0, step), (1, step)])
    _held(h, second, 4, [(2, step), (3, step)])
    _held(h, first, 4, [(0, step), (1, step), (2, step), (3, step)])
    _held(h, second, 4, [(2, step), (3, step), (0, step), (1, step)])


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
    # Node 0 holds ranks 0-1 (its own), node 1 ranks 2-3: step 11, which every rank has on
    # one node, is copied; nothing is on two nodes yet.
    _held(h, first, 4, [(0, 10), (1, 10), (0, 11), (1, 11)])
    assert h.last(first, KeepSnapshot) is None  # ranks 2-3 are nowhere yet
    _held(h, second, 4, [(2, 10), (3, 10), (2, 11), (3, 11)])
    assert h.last(first, KeepSnapshot) == KeepSnapshot(step=-1, replicate=11) == h.last(second, KeepSnapshot)
    _held(h, first, 4, [(0, 10), (1, 10), (0, 11), (1, 11), (2, 11), (3, 11)])
    _held(h, second, 4, [(2, 10), (3, 10), (2, 11), (3, 11), (0, 11), (1, 11)])
    kept = KeepSnapshot(step=11, replicate=-1)  # 11 on two nodes for every rank
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
    _copied(h, first, second, 10)
    h.drop(second)  # node 1 is lost; the spare takes its place
    _join(h, "na" if first == 1 else "nb", first)
    _join(h, "nc", spare)
    a, s = _assignment(h, first), _assignment(h, spare)
    assert a.restore_step == s.restore_step == 10
    assert a.restore_source == (-1, -1)
    assert s.rank_offset == 2 and s.restore_source == (0, 0)
    assert s.restore_addrs == (f"10.0.0.{first}:40000",)
    assert s.restore_keys == (KEYS["na" if first == 1 else "nb"],)
    # The owner's digests, which the fetched copies (and the workers) check.
    assert s.restore_digests == (digest(2, 10), digest(3, 10))


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
    _copied(h, first, second, 10)
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
    # The whole job was lost: nobody knows the step it had reached (issue 42, item 8).
    assert said == [
        "round 0 resumes every rank from the snapshot of step 20 persisted in --snapshot-dir: "
        "steps lost unknown (no rank had reported its step)"
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
    _copied(h, first, second, 40)
    h.send(second, WorkersFailed(round=rnd, failure=failure(node="nb")))
    durable = {"durable_world": 4, "durable_steps": (40, 30)}  # a tie: memory, no disk read
    _join(h, "na", first, **durable), _join(h, "nb", second, **durable)
    got = [_assignment(h, c) for c in (first, second)]
    assert [(x.restore_step, x.restore_durable) for x in got] == [(40, False)] * 2


# -- issue 42: a member is trusted only about its own ranks ---------------------------------


def _fail_and_rejoin(h: Harness, first: int, second: int, **kw: object) -> list[Assignment]:
    rnd = _assignment(h, first).round
    h.send(second, WorkersFailed(round=rnd, failure=failure(node="nb"), **kw))  # type: ignore[arg-type]
    _join(h, "na", first), _join(h, "nb", second)
    return [_assignment(h, c) for c in (first, second)]


def test_a_member_claiming_every_rank_at_a_huge_step_becomes_no_restore_source() -> None:
    """The attack of issue 42 item 1: one member says it holds every rank at step 10**12. Its
    own ranks' claim is its own business; the others' is not believed, so the job restores the
    honest step, and the liar is the source of none of the others' ranks."""
    h = Harness()
    first, second = _two_nodes(h)
    _copied(h, first, second, 10)
    huge = 10**12
    _held(h, second, 4, [(r, huge) for r in range(4)] + [(2, 10), (3, 10), (0, 10), (1, 10)])
    job = h.machine.jobs["job"]
    assert job.snapshot_step == 10 and job.restore_points.holders(4, huge, 0) == set()
    got = _fail_and_rejoin(h, first, second)
    assert {a.restore_step for a in got} == {10}
    assert all(a.restore_addrs == () for a in got)  # each node restores its own


def test_a_replica_is_believed_only_from_the_node_asked_to_hold_it_with_the_owners_digest() -> None:
    h = Harness()
    a, b, c = (_join(h, n, min_nodes=3, max_nodes=3) for n in ("na", "nb", "nc"))
    by_rank = sorted((a, b, c), key=lambda x: _assignment(h, x).group_rank)
    n0, n1, n2 = by_rank  # ranks 0-1, 2-3, 4-5; each copies to the next (n0 -> n1 -> n2 -> n0)
    assert (_assignment(h, n1).replica_from, _assignment(h, n1).replica_count) == (0, 2)
    _held(h, n0, 6, [(0, 7), (1, 7)])
    _held(h, n1, 6, [(2, 7), (3, 7)])
    _held(h, n2, 6, [(4, 7), (5, 7)])
    job = h.machine.jobs["job"]
    assert job.replicate_step == 7
    node = {n0: "", n1: "", n2: ""}
    for conn in by_rank:
        node[conn] = next(nid for nid, m in job.members.items() if m.conn == conn)
    # n2 was asked to hold n1's ranks (2-3), not n0's: its copy of rank 0 is not believed.
    _held(h, n2, 6, [(4, 7), (5, 7), (0, 7)])
    assert job.restore_points.holders(6, 7, 0) == {node[n0]}
    # A copy with other bytes than the owner's is not believed either.
    _held(
        h,
        n2,
        6,
        [(4, 7), (5, 7), (2, 7), (3, 7)],
        [digest(4, 7), digest(5, 7), digest(2, 7, "x"), digest(3, 7)],
    )
    assert job.restore_points.holders(6, 7, 2) == {node[n1]}
    assert job.restore_points.holders(6, 7, 3) == {node[n1], node[n2]}
    # A copy the node was asked for, with the owner's digest, is.
    _held(h, n2, 6, [(4, 7), (5, 7), (2, 7), (3, 7)])
    assert job.restore_points.holders(6, 7, 2) == {node[n1], node[n2]}


def test_a_replica_said_before_its_owners_digest_is_believed_once_the_digest_comes() -> None:
    h = Harness()
    first, second = _two_nodes(h)
    _held(h, first, 4, [(0, 5), (1, 5)], ["", ""])  # the owner has not hashed them yet
    _held(h, second, 4, [(2, 5), (3, 5)])
    job = h.machine.jobs["job"]
    assert job.replicate_step == 5
    _held(h, second, 4, [(2, 5), (3, 5), (0, 5), (1, 5)])  # its copies, with the digests it computed
    assert job.restore_points.holders(4, 5, 0) == {"na" if first == 1 else "nb"}  # nothing to check them by
    _held(h, first, 4, [(0, 5), (1, 5)])  # the owner's digests come (after its push)
    assert len(job.restore_points.holders(4, 5, 0)) == 2
    assert job.provenance.pending == set()


def test_a_rank_copied_with_an_unknown_digest_is_fetched_only_from_its_maker() -> None:
    h = Harness()
    first, second = _two_nodes(h)
    spare = _join(h, "nc")
    _held(h, first, 4, [(0, 10), (1, 10)], ["", ""])
    _held(h, second, 4, [(2, 10), (3, 10)], ["", ""])
    h.drop(first)  # the spare takes ranks 0-1, held by nobody it may fetch them from
    _join(h, "nb", second), _join(h, "nc", spare)
    got = {c: _assignment(h, c) for c in (second, spare)}
    assert all(a.restore_step == -1 for a in got.values())


def test_a_failed_fetch_of_the_restore_step_makes_the_next_round_restore_an_older_one() -> None:
    """Issue 42 item 3: a spare could not fetch (a holder's replica server filled by
    strangers); every restart repeated the same plan. The agent says which step it could not
    get; the next round restores an older step every rank has, and says so."""
    from .test_journal import Recording, replays_from_every_cut

    h = Harness(machine=Recording())
    first, second = _two_nodes(h)
    for step in (10, 20):  # each node holds its ranks and the other's at both steps
        _held(h, first, 4, [(r, s) for s in (10, step) for r in (0, 1)])
        _held(h, second, 4, [(r, s) for s in (10, step) for r in (2, 3)])
        _held(h, first, 4, [(r, s) for s in (10, step) for r in (0, 1, 2, 3)])
        _held(h, second, 4, [(r, s) for s in (10, step) for r in (2, 3, 0, 1)])
    got = _fail_and_rejoin(h, first, second)
    assert {a.restore_step for a in got} == {20}
    got = _fail_and_rejoin(h, first, second, restore_failed=20)
    assert {a.restore_step for a in got} == {10}
    # A step other than the round's own is no reason to skip one.
    got = _fail_and_rejoin(h, first, second, restore_failed=20)
    assert {a.restore_step for a in got} == {10}
    replays_from_every_cut(h.machine.records, h.machine)


def test_a_second_holder_is_named_for_each_fetched_rank() -> None:
    h = Harness()
    three = {"min_nodes": 3, "max_nodes": 3}
    a, b, c = (_join(h, n, **three) for n in ("na", "nb", "nc"))
    n0, n1, n2 = sorted((a, b, c), key=lambda x: _assignment(h, x).group_rank)
    names = {m.conn: nid for nid, m in h.machine.jobs["job"].members.items()}
    # Every rank's step 7 on its own node and on the next one (n0 -> n1 -> n2 -> n0).
    _held(h, n0, 6, [(0, 7), (1, 7)])
    _held(h, n1, 6, [(2, 7), (3, 7)])
    _held(h, n2, 6, [(4, 7), (5, 7)])
    _held(h, n1, 6, [(2, 7), (3, 7), (0, 7), (1, 7)])
    _held(h, n2, 6, [(4, 7), (5, 7), (2, 7), (3, 7)])
    _held(h, n0, 6, [(0, 7), (1, 7), (4, 7), (5, 7)])
    spare = _join(h, "nd", **three)
    h.drop(n1)  # the spare takes its place; n2 moves to ranks 2-3 (it holds their copies)
    _join(h, names[n0], n0, **three), _join(h, names[n2], n2, **three)
    s = _assignment(h, spare)
    assert s.restore_step == 7 and s.rank_offset == 4
    # Ranks 4-5 are held by n2 (their maker) and n0 (the copy it was asked for): one is the
    # first source of each rank, the other its second.
    assert len(s.restore_addrs) == 2 and sorted(s.restore_source + s.restore_alt) == [0, 0, 1, 1]
    assert s.restore_digests == (digest(4, 7), digest(5, 7))
