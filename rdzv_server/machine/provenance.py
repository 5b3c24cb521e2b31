"""Which snapshot claims the server believes (issue 42): a member is trusted only about its own ranks.

A node's ``SnapshotsHeld`` lists (rank, step, sha256) triples: its own ranks' snapshots and the
replicas it keeps for its ring predecessor. What it says decides what every other node
restores, so each claim is checked against who could have made the file:

- **An original** is believed only from the node that runs the rank in the current round (the
  rank within its span, the message's world the round's). The first digest said for a
  (world, rank, step) is the snapshot's digest: the node that made it says it, and while it
  still claims the snapshot it may say it again (a snapshot of the same step written anew).
  A node that comes to run a rank another node ran earlier may not give that other node's
  snapshots another digest.
- **A replica** is believed only from the node the server asked to hold it (the ring peer of
  the rank's owner, for the step being copied: ``ask``), and only with the owner's digest, so
  no member can become the source of bytes the owner never made. A replica said before its
  owner's digest arrived waits (``pending``) and is checked again when the digest comes.
- What was believed stays believed while the node still claims it (with the same digest):
  asks are kept for the last few copied steps only, and a round change moves ranks, but
  neither makes an honest holder's earlier replica false.

Digests of snapshots nobody claims any more are forgotten (a count per digest entry), so the
table holds at most what the nodes' claims name: MAX_HELD triples a node. Pure and volatile, as
``restore_points.py``: a restarted server hears the claims again, and believes replicas again
once their owners' digests and the next copy's asks come (a job of one node needs neither).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["MAX_ASKS", "Claim", "Provenance"]

Claim = tuple[int, int, str]  # (global rank, step, sha256 or "")
Key = tuple[int, int, int]  # (world, rank, step)
MAX_ASKS = 8  # (world, step) copy asks remembered: a replica is said within a few copies


class Provenance:
    """The digest of each claimed snapshot and who was asked to hold which replicas, per job."""

    def __init__(self) -> None:
        self._digest: dict[Key, str] = {}  # the owner's digest ("" until it says it)
        self._maker: dict[Key, str] = {}  # the node that made it (said it as an original)
        self._refs: dict[Key, int] = {}  # how many nodes' believed claims name it
        self._believed: dict[str, tuple[int, dict[tuple[int, int], str]]] = {}  # node -> world, pairs
        self._claims: dict[str, tuple[int, tuple[Claim, ...]]] = {}  # node -> its last claims
        self._asked: dict[tuple[int, int], dict[str, range]] = {}  # (world, step) -> holder -> ranks
        self.pending: set[str] = set()  # nodes with replicas waiting for their owner's digest

    def __len__(self) -> int:
        return len(self._digest)

    def digest(self, world: int, rank: int, step: int) -> str:
        """The owner's digest of the snapshot ("": not known)."""
        return self._digest.get((world, rank, step), "")

    def maker(self, world: int, rank: int, step: int) -> str:
        return self._maker.get((world, rank, step), "")

    def ask(self, world: int, step: int, holders: Mapping[str, range]) -> None:
        """The server asked each holder to keep a replica of ``step`` of the given ranks."""
        self._asked[(world, step)] = dict(holders)
        while len(self._asked) > MAX_ASKS:
            del self._asked[next(iter(self._asked))]  # the oldest ask

    def claim(
        self, node: str, world: int, claims: Sequence[Claim], span: range, round_world: int
    ) -> tuple[list[tuple[int, int]], set[str]]:
        """``node`` holds ``claims`` now; ``span``: its ranks in the running round of
        ``round_world`` ranks. The (rank, step) pairs believed, and the other nodes whose
        believed replicas a changed digest made false (to be checked again)."""
        self._claims[node] = (world, tuple(claims))
        return self._check(node, span, round_world)

    def recheck(self, node: str, span: range, round_world: int) -> tuple[int, list[tuple[int, int]]]:
        """``node``'s last claims, checked again (an owner's digest came): their world and
        the pairs believed."""
        believed, _ = self._check(node, span, round_world)
        return self._claims.get(node, (0, ()))[0], believed

    def drop(self, node: str) -> None:
        """The node left the job: nothing it says counts any more."""
        self._claims.pop(node, None)
        self.pending.discard(node)
        self._set_believed(node, 0, {})

    def _check(self, node: str, span: range, round_world: int) -> tuple[list[tuple[int, int]], set[str]]:
        world, claims = self._claims.get(node, (0, ()))
        before_world, before = self._believed.get(node, (0, {}))
        kept = before if before_world == world else {}
        believed: dict[tuple[int, int], str] = {}
        stale: set[str] = set()
        waiting = learned = False
        for rank, step, digest in claims:
            pair = (rank, step)
            if pair in believed:
                continue
            key = (world, rank, step)
            known = self._digest.get(key, "")
            if world == round_world and rank in span:
                maker = self._maker.get(key)
                if maker is not None and maker != node and known and digest and digest != known:
                    continue  # another node's snapshot, with other bytes: not ours to redo
                if maker is None or maker == node or not known:
                    self._maker[key] = node
                    if digest and digest != known:
                        if known:
                            stale |= self._holders_of(key, node)  # a snapshot of the step made anew
                        else:
                            learned = True
                        self._digest[key] = digest
                    elif not known:
                        self._digest.setdefault(key, "")
                believed[pair] = digest or self._digest[key]
            elif pair in kept and kept[pair] == digest and digest == known:
                believed[pair] = digest  # believed before: still true
            elif rank in self._asked.get((world, step), {}).get(node, range(0)):
                if not digest:
                    continue  # a replica we cannot check: its holder says the digest it computed
                if not known:
                    waiting = True
                    continue
                if digest == known:
                    believed[pair] = digest
        if waiting:
            self.pending.add(node)
        else:
            self.pending.discard(node)
        self._set_believed(node, world, believed)
        if learned:
            stale |= self.pending  # replicas that waited for an owner's digest
        return list(believed), stale - {node}

    def _holders_of(self, key: Key, owner: str) -> set[str]:
        world, rank, step = key
        return {
            n
            for n, (w, pairs) in self._believed.items()
            if n != owner and w == world and (rank, step) in pairs
        }

    def _set_believed(self, node: str, world: int, believed: dict[tuple[int, int], str]) -> None:
        old_world, old = self._believed.pop(node, (0, {}))
        for rank, step in believed:
            key = (world, rank, step)
            self._refs[key] = self._refs.get(key, 0) + 1
        for rank, step in old:
            key = (old_world, rank, step)
            left = self._refs.get(key, 0) - 1
            if left > 0:
                self._refs[key] = left
            else:
                self._refs.pop(key, None)
                self._digest.pop(key, None)
                self._maker.pop(key, None)
        if believed:
            self._believed[node] = (world, believed)

    def nodes(self) -> Iterable[str]:
        return self._claims.keys()
