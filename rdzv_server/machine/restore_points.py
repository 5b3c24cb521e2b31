"""Which snapshot steps a job can restore from (issue 35): the agents' holdings, indexed.

Every agent that snapshots tells the server which complete snapshots it holds, its own ranks'
and the replicas it keeps for a peer, as (global rank, step) pairs of a job of ``world`` ranks
(``SnapshotsHeld``). This index keeps, per (world, step), the nodes holding each rank, so that

- ``newest(world)``: the newest step every rank has on some node: what a restart restores;
- ``newest(world, twice=True)``: the newest step every rank has on two nodes: what survives the
  loss of any one node, so every agent keeps it (``KeepSnapshot``) until a newer one comes;
- ``holders(world, step, rank)``: where a node that lacks a rank's snapshot fetches it;
- ``newest_alike(world, spans)``: after the world size changed, the newest step at which every
  node of the new round holds a snapshot of one of its own ranks of the old world, all said to
  hold state every rank holds alike (``SnapshotsHeld.replicated``): any rank restores from it.

An update costs O(the node's pairs), a query O(the steps held), whatever the job's size: a
node's summary comes with its heartbeats, one a second at most. Pure and volatile: nothing
here is in the state log (a restarted server learns it again from the agents' next summaries;
the restore a round was given is a logged fact, ``restore_rules.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

Pairs = frozenset[tuple[int, int]]  # (global rank, step)


class RestorePoints:
    """The snapshots a job's nodes hold, by (world, step) and rank."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, Pairs]] = {}  # node -> (world, its pairs)
        # (world, step) -> rank -> the nodes holding it
        self._index: dict[tuple[int, int], dict[int, set[str]]] = {}
        # (world, step) -> how many of its ranks two nodes or more hold: kept as pairs come and
        # go, so that ``newest`` never walks a job's ranks
        self._twice: dict[tuple[int, int], int] = {}
        self._alike: set[str] = set()  # nodes whose own ranks' snapshots hold replicated state

    def __len__(self) -> int:
        return len(self._held)

    def update(
        self, node_id: str, world: int, pairs: Iterable[tuple[int, int]], *, replicated: bool | None = None
    ) -> bool:
        """``node_id`` holds ``pairs`` now (what it held before is forgotten); ranks at or past
        ``world`` are ignored; ``replicated``: its own ranks' hold state every rank holds alike
        (None: as it said last). Whether anything changed."""
        new = frozenset((r, s) for r, s in pairs if 0 <= r < world and s >= 0)
        old = self._held.get(node_id)
        alike = node_id in self._alike
        if replicated is None:
            replicated = alike
        if old is not None and old == (world, new) and alike == replicated:
            return False
        self.drop(node_id)
        if new and replicated:
            self._alike.add(node_id)
        if new:
            self._held[node_id] = (world, new)
            for rank, step in new:
                nodes = self._index.setdefault((world, step), {}).setdefault(rank, set())
                nodes.add(node_id)
                if len(nodes) == 2:
                    self._twice[(world, step)] = self._twice.get((world, step), 0) + 1
        return True

    def drop(self, node_id: str) -> None:
        """The node left the job: what it held is no longer anyone's to restore from."""
        self._alike.discard(node_id)
        old = self._held.pop(node_id, None)
        if old is None:
            return
        world, pairs = old
        for rank, step in pairs:
            key = (world, step)
            ranks = self._index[key]
            nodes = ranks[rank]
            nodes.discard(node_id)
            if len(nodes) == 1:
                self._twice[key] -= 1
                if not self._twice[key]:
                    del self._twice[key]
            elif not nodes:
                del ranks[rank]
                if not ranks:
                    del self._index[key]

    def newest(self, world: int, *, twice: bool = False) -> int:
        """The newest step every one of ``world`` ranks has on a node (``twice``: on two
        distinct nodes); -1: none. O(the steps held)."""
        best = -1
        for key, ranks in self._index.items():
            w, step = key
            if w == world and step > best and len(ranks) >= world:
                if not twice or self._twice.get(key, 0) >= world:
                    best = step
        return best

    def complete(self, world: int, step: int, *, twice: bool = False) -> bool:
        """Every one of ``world`` ranks has ``step`` on a node (``twice``: on two)."""
        key = (world, step)
        if len(self._index.get(key, ())) < world:
            return False
        return not twice or self._twice.get(key, 0) >= world

    def newest_among(self, world: int, among: Collection[str], exclude: Collection[int] = ()) -> int:
        """The newest step every one of ``world`` ranks has on a node of ``among`` (a round
        being formed), other than ``exclude``; -1: none. O(world) per step held: once a round."""
        best = -1
        for (w, step), ranks in self._index.items():
            if w != world or step <= best or len(ranks) < world or step in exclude:
                continue
            if all(any(n in among for n in nodes) for nodes in ranks.values()):
                best = step
        return best

    def holders(self, world: int, step: int, rank: int) -> set[str]:
        """The nodes holding ``rank``'s snapshot at ``step``."""
        return self._index.get((world, step), {}).get(rank, set())

    def holds(self, node_id: str, world: int, step: int, rank: int) -> bool:
        return node_id in self.holders(world, step, rank)

    def newest_alike(
        self, world: int, spans: Mapping[str, range], exclude: Collection[int] = ()
    ) -> tuple[int, dict[str, int]]:
        """For a round of another world size, made of the nodes of ``spans`` (each with its
        global ranks in the old ``world``): the newest step, other than ``exclude``, at which
        every one of them holds its own snapshot of some rank of its span, all of them said to
        hold state every rank holds alike; with the rank each node restores from (the lowest it
        holds). (-1, {}): none. O(the steps held x the spans' ranks): once a round."""
        if not spans or any(n not in self._alike or self._held[n][0] != world for n in spans):
            return -1, {}
        best, picks = -1, {}
        for (w, step), ranks in self._index.items():
            if w != world or step <= best or step in exclude:
                continue
            chosen: dict[str, int] = {}
            for node, span in spans.items():
                rank = next((r for r in span if node in ranks.get(r, ())), None)
                if rank is None:
                    break
                chosen[node] = rank
            else:
                best, picks = step, chosen
        return best, picks
