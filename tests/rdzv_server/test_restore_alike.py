"""Restore at another world size (issue 44): state every rank holds alike (DDP) restores a
job that shrank, from the survivors' own snapshots; any other state restores at its own world
size only."""

from __future__ import annotations

from protocol import Assignment, Progress, SnapshotsHeld, WorkersFailed
from rdzv_server.machine.restore_points import RestorePoints

from .harness import Harness, failure
from .test_restore import KEYS, digest


def _join(h: Harness, node: str, conn: int | None = None) -> int:
    return h.join(
        conn,
        node=node,
        min_nodes=1,
        max_nodes=2,
        max_restarts=3,
        heartbeat_timeout=60.0,
        replica_port=40000,
        replica_key=KEYS[node],
    )


def _held(h: Harness, conn: int, pairs: list[tuple[int, int]], *, alike: bool) -> None:
    h.send(
        conn,
        SnapshotsHeld(
            world_size=4,
            ranks=tuple(r for r, _ in pairs),
            steps=tuple(s for _, s in pairs),
            digests=tuple(digest(r, s) for r, s in pairs),
            replicated=alike,
        ),
    )


def _shrunk(alike_a: bool = True, alike_b: bool = True, lose: str = "nb") -> tuple[Harness, Assignment]:
    """A 1:2 job of two nodes x 2 ranks; both snapshot steps 10 and 11 (node b's rank 3
    only 10), a replica of 10 each way; node ``lose`` is lost, the other forms a round alone."""
    h = Harness()
    a, b = _join(h, "na"), _join(h, "nb")
    h.advance(6)  # the last call ends: a round of both
    first = h.last(a, Assignment)
    assert isinstance(first, Assignment) and first.world_size == 4
    a_first = first.group_rank == 0
    mine_a, mine_b = ((0, 1), (2, 3)) if a_first else ((2, 3), (0, 1))
    _held(
        h,
        a,
        [(mine_a[0], 11), (mine_a[1], 11), (mine_a[0], 10), (mine_a[1], 10), (mine_b[0], 10)],
        alike=alike_a,
    )
    _held(h, b, [(mine_b[0], 11), (mine_b[0], 10), (mine_b[1], 10), (mine_a[0], 10)], alike=alike_b)
    h.send(a, Progress(round=first.round, min_step=12, max_step=12))
    h.take(a), h.take(b)
    survivor, lost = (a, b) if lose == "nb" else (b, a)
    h.drop(lost)
    _join(h, "na" if lose == "nb" else "nb", survivor)
    h.advance(6)
    got = h.last(survivor, Assignment)
    assert isinstance(got, Assignment) and got.world_size == 2
    return h, got


def test_a_shrunk_job_restores_alike_state_from_the_survivor_s_own_snapshot() -> None:
    h, got = _shrunk()
    # Step 11, which the lost node's rank 3 never had: the survivor's own copy serves all.
    assert (got.restore_step, got.restore_world) == (11, 4)
    assert len(got.restore_ranks) == 2 and got.restore_ranks[0] in (0, 2)
    assert len(set(got.restore_ranks)) == 1
    assert (got.restore_source, got.restore_addrs, got.restore_durable) == ((), (), False)
    said = [e.text for e in h.machine.jobs["job"].history if e.kind == "restore"]
    assert said == [
        f"round {got.round} resumes every rank from the in-memory snapshot of step 11 of the 4-rank "
        "world (state every rank holds alike): 1 step lost (the job had reached step 12)"
    ]


def test_a_survivor_whose_ranks_did_not_say_alike_starts_over() -> None:
    _, got = _shrunk(alike_a=False)
    assert (got.restore_step, got.restore_world, got.restore_ranks) == (-1, 0, ())


def test_only_the_survivor_s_word_counts_not_the_lost_node_s() -> None:
    _, got = _shrunk(alike_a=True, alike_b=False)  # b said nothing alike: it is gone anyway
    assert (got.restore_step, got.restore_world) == (11, 4)
    _, got = _shrunk(alike_a=False, alike_b=True)  # a replica of b's ranks is not a's word
    assert got.restore_step == -1


def test_a_failed_carry_is_not_tried_again() -> None:
    # The node could not keep the file (its agent then drops the old world's snapshots, as
    # without the mark): the next round, at the world the failed one had, restores nothing.
    h, got = _shrunk()
    conn = next(c for c, msgs in h.inbox.items() if got in msgs)
    h.send(conn, WorkersFailed(round=got.round, failure=failure(node="na"), restore_failed=11))
    _join(h, "na", conn)
    h.advance(6)
    again = h.last(conn, Assignment)
    assert isinstance(again, Assignment) and again.round > got.round
    assert (again.restore_step, again.restore_world) == (-1, 0)


def test_a_restore_across_worlds_replays_from_the_state_log() -> None:
    from .test_journal import Recording, replays_from_every_cut

    h = Harness(machine=Recording())
    a, b = _join(h, "na"), _join(h, "nb")
    h.advance(6)
    first = h.last(a, Assignment)
    assert isinstance(first, Assignment)
    mine = (0, 1) if first.group_rank == 0 else (2, 3)
    _held(h, a, [(mine[0], 7), (mine[1], 7)], alike=True)
    h.drop(b)
    _join(h, "na", a)
    h.advance(6)
    got = h.last(a, Assignment)
    assert isinstance(got, Assignment) and (got.restore_step, got.restore_ranks) == (7, (mine[0],) * 2)
    replays_from_every_cut(h.machine.records, h.machine)


def test_restore_points_find_a_step_every_span_holds_of_its_own() -> None:
    p = RestorePoints()
    p.update("a", 4, [(0, 5), (1, 5), (0, 6), (2, 6)], replicated=True)
    p.update("b", 4, [(3, 5), (2, 6)], replicated=True)
    spans = {"a": range(0, 2), "b": range(2, 4)}
    assert p.newest_alike(4, spans) == (6, {"a": 0, "b": 2})
    assert p.newest_alike(4, spans, exclude={6}) == (5, {"a": 0, "b": 3})
    assert p.newest_alike(4, {"a": range(1, 2)}) == (5, {"a": 1})  # only its own ranks count
    assert p.newest_alike(2, spans) == (-1, {})  # not the world held
    p.update("b", 4, [(3, 5), (2, 6)], replicated=False)
    assert p.newest_alike(4, spans) == (-1, {})
    p.update("b", 4, [(3, 5), (2, 6)])  # not said again: as it said last
    assert p.newest_alike(4, {"b": range(2, 4)}) == (-1, {})
    p.drop("a")
    assert p.newest_alike(4, {"a": range(0, 2)}) == (-1, {})
